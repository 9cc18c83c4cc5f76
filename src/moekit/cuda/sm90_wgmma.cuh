// The sm_90a pieces both Hopper grouped GEMMs (sm90_grouped_gemm.cuh's forward, sm90_backward_gemm.cuh's
// backward) use the same way: the pipeline barriers' wait, one wgmma batch over an accumulator array, and where a
// thread's accumulators sit in a 64 x N tile.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOEKIT_SM90A_DEVICE 1
#else
#define MOEKIT_SM90A_DEVICE 0
#endif

namespace moekit::cuda::hopper {

// MOEKIT_HOPPER_WATCHDOG=1 at compile time (a debugging build): a wait on a pipeline barrier that lasts
// over ~4 s prints where it is stuck (block, warpgroup, unit, k block, stage, phase) and traps, so a
// hang becomes an error with a place. Off in normal builds: a plain wait.
#ifndef MOEKIT_HOPPER_WATCHDOG
#define MOEKIT_HOPPER_WATCHDOG 0
#endif
// Waits for phase `phase` of the mbarrier at shared address `bar`. The barriers are passed as 32-bit shared
// addresses computed once: from a generic pointer, every wait re-derived the aligned shared base (~20
// instructions in front of each wgmma batch of the FP8 loop).
__device__ __forceinline__ bool try_wait_parity(uint32_t bar, uint32_t phase) {
  uint32_t done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(bar), "r"(phase)
               : "memory");
  return done != 0;
}
__device__ __forceinline__ void wait_stage(uint32_t bar, uint32_t phase, [[maybe_unused]] const char* what,
                                           [[maybe_unused]] int64_t unit, [[maybe_unused]] int kb,
                                           [[maybe_unused]] int stage, [[maybe_unused]] int64_t m_tile,
                                           [[maybe_unused]] int expert, [[maybe_unused]] int flags) {
#if MOEKIT_HOPPER_WATCHDOG
  const long long start = clock64();
  while (!try_wait_parity(bar, phase)) {
    if (clock64() - start > 8000000000LL) {
      printf(
          "moekit watchdog: block %d thread %d stuck on %s: unit %lld kb %d stage %d phase %u m_tile %lld "
          "expert %d flags %d\n",
          static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x), what, static_cast<long long>(unit), kb, stage,
          phase, static_cast<long long>(m_tile), expert, flags);
      __trap();
    }
  }
#else
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT;\n}\n" ::"r"(
          bar),
      "r"(phase)
      : "memory");
#endif
}

template <typename Op, std::size_t... I>
__device__ __forceinline__ void wgmma(uint64_t a, uint64_t b, float* acc, bool accumulate, std::index_sequence<I...>) {
  Op::fma(a, b, acc[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// Named barriers (id 0 is __syncthreads): `threads` of the block (a multiple of 32) meet at barrier `id`; arrive
// passes without waiting.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Accumulator element i of a 64 x N wgmma tile held by lane `lane` of warp `warp` (of 4): row and column.
__device__ __forceinline__ int acc_row(int warp, int lane, int i) {
  return warp * 16 + lane / 4 + 8 * ((i >> 1) & 1);
}
__device__ __forceinline__ int acc_col(int lane, int i) {
  return (i / 4) * 8 + (lane % 4) * 2 + (i & 1);
}

}  // namespace moekit::cuda::hopper

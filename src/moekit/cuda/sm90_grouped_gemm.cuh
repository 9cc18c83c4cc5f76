// The grouped GEMM of the Hopper backends (sm_90a): C[m, n] = sum_k A[m, k] * B_e[n, k] over rows
// grouped by expert in the contiguous layout (each expert's rows start at a multiple of 128, so no
// 128-row tile straddles two experts), or DeepGEMM's masked layout (group g's rows from g * masked_rows).
//
// One persistent block per multiprocessor (or cluster of two) walks the (row tile, column block) units; the number
// of row tiles and each tile's expert come from the device routing, so the host never waits. Inside a block,
// warpgroup 0 is the producer and warpgroups 1-2 do the math, 64 rows of a tile each, meeting at a ring of
// shared-memory stages with "full" and "empty" mbarriers. The parts, each in its own header:
//   sm90_gemm_layout.cuh     tile sizes, GemmParams, the epilogue kinds, shared-memory layout, named barriers;
//   sm90_gemm_scheduler.cuh  TileScheduler: the units a block takes and each unit's tile and expert;
//   sm90_gemm_producer.cuh   load_stages (TMA copies of A, or sonicmoe's gathered token rows; FP8's row
//                            scales; the expert's weight tile, multicast to a cluster pair) and store_staged_rows
//                            (warps 1-3 storing the rows a staged epilogue hands them);
//   sm90_gemm_mainloop.cuh   the math warpgroups' k loops: bf16/f16 (mma_16bit), FP8 128 and 256 wide with block
//                            scales (mma_fp8), and an all-padding warpgroup's pass (pass_stages);
//   sm90_gemm_epilogue.cuh   store rows, gated act(gate) * up, gated e4m3 codes + scales, ungated act; stored by
//                            the math warpgroup or staged for the copying warps (finish_tile).
// Epilogues with 2-byte outputs (both projections in bf16/f16, FP8's second) and FP8's gated e4m3 codes are staged;
// with kGatherA, whose producer warps all gather, and for FP8's float rows, the math warpgroups store them
// themselves. Built with MOEKIT_HOPPER_WATCHDOG=1, a pipeline wait that lasts seconds reports where it is and traps.
// CUTLASS/CuTe supply the instruction wrappers (TMA copies, mbarriers, wgmma, register reconfiguration); the
// schedule, the fused epilogues and the layouts are ours.
#pragma once

#include <cuda.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/cluster_sm90.hpp>

#include "moekit/cuda/sm90_gemm_epilogue.cuh"
#include "moekit/cuda/sm90_gemm_layout.cuh"
#include "moekit/cuda/sm90_gemm_mainloop.cuh"
#include "moekit/cuda/sm90_gemm_producer.cuh"
#include "moekit/cuda/sm90_gemm_scheduler.cuh"
#include "moekit/cuda/sm90_wgmma.cuh"

namespace moekit::cuda::hopper {

// kCluster 2: each block's "empty" barriers count the math warpgroups of both blocks, since a stage is written by
// the peer too (multicast weight tiles), which keeps the pair in lockstep.
// kFp8: A and B are e4m3 bytes with 1 x 128 (A, per row) and 128 x 128 (B) block scales; the copy engine brings the
// A tile's row scales (s_map, [K / 128, rows] float) into the stage with the operands.
template <class C>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                        const __grid_constant__ CUtensorMap s_map, const GemmParams p) {
#if MOEKIT_SM90A_DEVICE
  using Barrier = cutlass::arch::ClusterBarrier;
  using T = typename C::T;
  constexpr int BN = C::BN, kStages = C::kStages, kCluster = C::kCluster;
  constexpr bool kGatherA = C::kGatherA, kFp8 = C::kFp8;
  constexpr Epilogue kEpi = C::kEpi;
  // The 128-byte swizzle needs stages aligned to 1 KB: the declaration asks for it (no slack is budgeted).
  extern __shared__ __align__(1024) uint8_t smem[];
  if (threadIdx.x == 0 && cute::cast_smem_ptr_to_uint(smem) % 1024 != 0) __trap();  // never seen; guards the above
  uint8_t* staged = smem + kStages * C::kStageBytes;
  auto* full = reinterpret_cast<uint64_t*>(staged + staged_epilogue_bytes<BN, kFp8, kEpi, kGatherA>());
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], kGatherA ? 1 + 128 : 1);  // gathering: + one cp.async arrival per producer thread
      Barrier::init(&empty[s], kMathGroups * kCluster);
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (kCluster > 1)
    cute::cluster_sync();  // the peer's barriers are initialised before anyone signals them
  else
    __syncthreads();

  const TileScheduler<kCluster, kEpi> sched(p, kCluster > 1 ? cute::block_rank_in_cluster() : 0);
  const uint32_t full_at = cute::cast_smem_ptr_to_uint(full), empty_at = cute::cast_smem_ptr_to_uint(empty);

  // Warp-uniform as the compiler can see (a shuffle from lane 0), so that what derives from it (the math
  // warpgroups' operand descriptors) can live in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (kGatherA || threadIdx.x < 32) load_stages<C>(a_map, b_map, s_map, p, sched, smem, full, empty_at);
    // Staged epilogues: the math warpgroups stage their finished rows for warps 1-3 to store, and go on to their next
    // tile (FP8's second projection otherwise spent ~23% of its time there, with the tensor cores idle).
    if constexpr (C::kStaged)
      if (threadIdx.x >= 32) store_staged_rows<C>(p, sched, staged);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kMathRegisters>();
    const int math = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    float acc[BN / 2];
    float part[C::kPartAccumulators];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    MathPipeline<kStages, kCluster> pipe(full_at, empty_at);
    // Stage 0's operand descriptors and row scales, once: a stage's are these plus its offset (with_address).
    // With `math` warp-uniform the descriptors live in uniform registers, built in front of each wgmma with two
    // uniform adds; held opaque in ordinary registers, each wgmma first waited for four R2UR moves (FP8 GEMM 6-9%
    // slower, bf16 1-2%).
    const bool ue8m0 = p.a.ue8m0_scales;
    const uint64_t desc_a0 = smem_descriptor(smem + math * 64 * kRowBytes),
                   desc_b0 = smem_descriptor(smem + C::kABytes);
    const OperandDescriptors d{.hi = static_cast<uint32_t>(desc_a0 >> 32),
                               .a_lo = static_cast<uint32_t>(desc_a0),
                               .b_lo = static_cast<uint32_t>(desc_b0)};
    const uint32_t row_scales0 =
        cute::cast_smem_ptr_to_uint(smem + C::kScaleOffset) + 4 * (math * 64 + acc_row(warp, lane, 0));
    int64_t hint = 0;
    for (int64_t unit = sched.first_unit, units = sched.unit_count(); unit < units; unit = sched.advance(unit)) {
      const Tile t = sched.tile_of(unit, hint);
      float weight[2] = {1.0f, 1.0f};
      if (t.valid) row_weights<T, kEpi>(p, t.m_tile, math, weight);
      const uint8_t* scale_base[2] = {nullptr, nullptr};
      if constexpr (kFp8) {
        weight_scale_bases<C>(p, t, ue8m0, scale_base);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
      }
      const bool idle = sched.idle_of(t, math);
      if (idle)
        pass_stages<C>(pipe, p, unit, t, math);
      else if constexpr (kFp8)
        mma_fp8<C>(pipe, p, d, row_scales0, scale_base, ue8m0, acc, part, unit, t, math);
      else
        mma_16bit<C>(pipe, p, d, acc, unit, t, math);
      if (t.valid && !idle) finish_tile<C>(p, acc, weight, t, math, staged);
    }
    if constexpr (C::kStaged) named_sync(5 + math, 128 + kCopyThreads);  // takes the copiers' last "free"
  }
  if constexpr (kCluster > 1) cute::cluster_sync();  // no block leaves while its peer may still signal it
#else
  (void)a_map, (void)b_map, (void)s_map, (void)p;
  __trap();  // launched only on compute capability 9.0, where the sm_90a code exists
#endif
}

}  // namespace moekit::cuda::hopper

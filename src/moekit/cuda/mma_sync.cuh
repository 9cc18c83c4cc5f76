// The tensor-core building blocks of the backward's kernels (sm_80 instructions, which sm_90a runs too):
// ldmatrix loads of 8 x 8 tiles of 2-byte values from shared memory, as stored or transposed, the m16n8k16
// product with float accumulators, and a cp.async pipeline over the k steps of a product.
//
// Which load gives which fragment of mma.m16n8k16 (A: 16 x 16 row-major, B: 16 x 8 column-major):
//   A from rows m with k contiguous ([m][k]):  ldmatrix_x4       (lane: row m = lane % 16, k + (lane / 16) * 8)
//   A from rows k with m contiguous ([k][m]):  ldmatrix_x4_trans (lane: row k = (lane / 16) * 8 + lane % 8,
//                                                                       m + ((lane / 8) % 2) * 8)
//   B (two 8-column tiles) from rows n, k contiguous ([n][k]): ldmatrix_x4 (row n = lane % 8 + (lane / 16) * 8,
//                                                                          k + ((lane / 8) % 2) * 8)
//   B from rows k with n contiguous ([k][n]): ldmatrix_x4_trans (row k = ((lane / 8) % 2) * 8 + lane % 8,
//                                                               n + (lane / 16) * 8)
// so that the result r of a B load feeds mma(acc[n tile 2p], A, r[0], r[1]) and mma(acc[2p + 1], A, r[2], r[3]).
#pragma once

#include <cstdint>
#include <type_traits>

#include "moekit/cuda/device_math.cuh"

namespace moekit::cuda::mma {

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// c += a * b for one m16n8k16 tile of bf16 or f16 values.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, bf16> || std::is_same_v<T, f16>, "mma16816: bf16 or f16 operands");
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The k loop of a tensor-core kernel as a kStages-deep cp.async pipeline. load_stage(step, stage) issues the
// copies of one step (called for steps 0, 1, 2, ... in order, each once); compute(step, stage) runs once stage
// `stage` holds step `step` and every thread has finished computing the step before. Returns with all copies
// complete and the block synchronised, so that the caller may reuse the shared memory.
template <int kStages, typename Load, typename Compute>
__device__ __forceinline__ void pipelined_steps(int64_t k_steps, Load&& load_stage, Compute&& compute) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_steps) load_stage(s, s);
    cp_async_commit();
  }
  for (int64_t step = 0; step < k_steps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int64_t next = step + kStages - 1;
    if (next < k_steps) load_stage(next, static_cast<int>(next % kStages));
    cp_async_commit();
    compute(step, static_cast<int>(step % kStages));
  }
  cp_async_wait<0>();
  __syncthreads();
}

}  // namespace moekit::cuda::mma

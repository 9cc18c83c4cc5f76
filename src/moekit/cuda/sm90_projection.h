// One projection of the Hopper experts backends on the grouped GEMM (sm90_grouped_gemm.cuh), host side: what the
// experts forward runs twice (hopper_experts.cu) and hopper_grouped_gemm (the GEMM alone) once. The launches are
// compiled per operand format, for sm_90a only: sm90_grouped_gemm_bf16.cu (bf16/f16 operands) and
// sm90_grouped_gemm_fp8.cu (e4m3 with block scales), each instantiating run_projection for the cases its callers use.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/cuda/experts_cuda.h"
#include "moekit/gemm_epilogue.h"

namespace moekit::cuda::hopper {

using Epilogue = GroupedGemmEpilogue;

// One projection over the contiguous layout: rows [M, K] (FP8: e4m3 codes with scales [K / 128, M])
// times each row tile's expert's weights [E, parts * part_rows, K] -> out through the epilogue. What the
// experts forward runs twice and hopper_grouped_gemm (the GEMM alone) once.
struct GemmProjection {
  const void* rows = nullptr;  // unused with kGatherA: the producer gathers the token rows from a.x
  const float* row_scales = nullptr;
  int64_t depth = 0;  // K
  const void* weights = nullptr;
  const void* weight_scales = nullptr;
  int64_t part_rows = 0;  // weight rows per part
  int parts = 1;          // 2: gate and up rows, paired by the gated epilogue
  bool interleaved = false;
  int64_t outputs = 0;  // columns of out
  void* out = nullptr;
  float* out_scales = nullptr;  // gated_e4m3: the codes' scales [outputs / 128, rows of the layout]
  float* save_z = nullptr;      // gated / activation, 2-byte operands: z kept for the backward (GemmParams::z_out)
  const int32_t* save_z_offsets = nullptr;  // with save_z: the routing's offsets [E + 1], z's rows (z_row_offsets)
  bool weighted = false;                    // store multiplies each row by its pair's routing weight
  // The masked layout (hopper::GemmParams): rows per group and each group's own rows.
  const int32_t* masked_m = nullptr;
  int64_t masked_rows = 0;
};

// Queues the projection on `stream` over the row tiles of tile_offsets ([E + 1], on the device; at most max_tiles):
// T the activations' type, kEpi the epilogue, kGatherA the gathering producer (sonicmoe's first projection: token
// rows from a.x by padded_pair), kFp8 e4m3 operands with block scales.
template <typename T, Epilogue kEpi, bool kGatherA, bool kFp8>
void run_projection(const ExpertsArgs& a, const int32_t* tile_offsets, const int32_t* padded_pair, int64_t max_tiles,
                    const GemmProjection& j, cudaStream_t stream);

// The launch switches (KernelOptions, kernel_options.h): clusters of two blocks sharing weight tiles, and the
// contiguous layout's all-padding warpgroups skipping their math (measured 10-12% faster at 64 tokens).
bool clusters_enabled();
bool idle_padding_enabled();

// Blocks per cluster of a projection `depth` deep (K rounded up to whole stages): 2, sharing weight tiles, in the
// contiguous layout from 1,024 deep with clusters_enabled(); else 1. The masked layout's tiles of one group are not
// adjacent in rows; and in shallower projections a stage is refilled only once both blocks have released it, which
// with few k-blocks a tile costs more than the shared weight tiles save (GEMM FP8 down at Qwen3's K = 768: 1.046x
// unpaired; at DeepSeek-V3's K = 2,048 pairs pay: docs/history/benchmarks-hopper-sessions-6-26.md, sessions 22-23).
inline int cluster_blocks(int64_t depth, bool masked) {
  constexpr int64_t kPairsMinDepth = 1024;
  return clusters_enabled() && !masked && depth >= kPairsMinDepth ? 2 : 1;
}

}  // namespace moekit::cuda::hopper

// One grouped GEMM of the Hopper experts backends by itself: the kernel and launch that deepgemm's
// projections run (hopper_experts.cu), without routing, row placement, activation quantisation or
// combine, so that the GEMM can be measured and tested alone. Kernel layer: raw device pointers,
// sizes and a stream; sm_90a only (the caller checks the device).
#pragma once

#include <cstdint>

#include "moekit/cuda/experts_cuda.h"
#include "moekit/gemm_epilogue.h"

namespace moekit::cuda {

// rows [M, K] @ weights [G, N, K]^T -> out, rows grouped in DeepGEMM's contiguous layout (or its masked
// one, below): group g owns the 128-row tiles [tile_offsets[g], tile_offsets[g + 1]) of rows and out, and
// each tile is multiplied by weights[g]. Rows of a tile past its group's own rows (padding) produce rows
// that mean nothing. bf16: K and N multiples of 8 (gated: N / 2); FP8: K and N multiples of 128.
struct HopperGemmArgs {
  int64_t groups = 0, n = 0, k = 0;
  int64_t max_tiles = 0;                  // 128-row tiles that rows and out hold (>= tile_offsets[groups])
  const int32_t* tile_offsets = nullptr;  // [groups + 1], read on the device
  bool fp8 = false;                       // e4m3 operands with block scales; otherwise bf16
  bool ue8m0_scales = false;              // FP8: weight scales are ue8m0 bytes (2^(b - 127)), else float
  const void* rows = nullptr;             // [128 * max_tiles, K] bf16 or e4m3
  const float* row_scales = nullptr;      // FP8: [K / 128, 128 * max_tiles], one per row and 128-deep block
  const void* weights = nullptr;          // [G, N, K] bf16 or e4m3
  const void* weight_scales = nullptr;    // FP8: [G, N / 128, K / 128], one per 128 x 128 block
  GroupedGemmEpilogue epilogue = GroupedGemmEpilogue::store;  // SiLU where it activates
  void* out = nullptr;
  float* out_scales = nullptr;  // gated_e4m3: [N / 256, 128 * max_tiles]
  // The masked layout instead (DeepGEMM's, for decode): rows [G, max_m, K] and out [G, max_m, outputs],
  // group g's own rows the first masked_m[g] (clamped to [0, max_m]); max_m a multiple of 128,
  // max_tiles = G * max_m / 128, tile_offsets unused (made on the device from masked_m). Output rows past
  // masked_m[g] mean nothing.
  const int32_t* masked_m = nullptr;  // [G], read on the device
  int64_t max_m = 0;
};

void hopper_grouped_gemm(const HopperGemmArgs& g, cudaStream_t stream);

}  // namespace moekit::cuda

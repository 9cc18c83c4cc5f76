// The grouped GEMM of the Hopper experts backends (deepgemm, sonicmoe) by itself: one projection of
// rows grouped by expert, without routing, row placement, activation quantisation or combine, for
// measuring the GEMM alone (`moekit bench-gemm`) and testing it. It runs the kernel and the launch
// that deepgemm's projections run, on a compute capability 9.0 GPU.
//
// DeepGEMM's contiguous layout: group g owns rows [128 * offsets[g], 128 * offsets[g + 1]) of the row
// matrix and of out, so no 128-row tile straddles two groups; the rows of a group past its own rows are
// padding (whatever they hold, their output rows mean nothing).
//
// DeepGEMM's masked layout (decode, or rows that arrive per expert from an all-to-all): rows [G, max_m,
// K], group g's own rows the first masked_m[g] of its max_m, with masked_m on the device (read there, so
// the call neither synchronises nor needs the counts on the host, and can be captured in a graph). Tiles
// wholly past masked_m[g] are skipped; out is [G, max_m, outputs] and its rows past masked_m[g] mean
// nothing. max_m is a multiple of 128.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/experts.h"
#include "moekit/gemm_epilogue.h"

namespace moekit {

// The epilogues (gemm_epilogue.h), with SiLU as the activation:
//   store:      out [M, N] bf16, the products (deepgemm's second projection);
//   gated:      out [M, N / 2] = silu(gate) * up, weight rows [0, N/2) gate and [N/2, N) up: bf16, or f32 with FP8
//               operands;
//   gated_e4m3: FP8 operands only: silu(gate) * up quantised as the FP8 layer's first projection does it (deepgemm):
//               out [M, N / 2] f8_e4m3 codes and out_scales [N / 256, M] f32 (masked: M = G * max_m), one scale per
//               row and 128-wide group of the outputs, bit for bit what quantize_activations makes of the f32 gated
//               output (power-of-two scales when the weight scales are ue8m0). Takes the overload with out_scales;
//   activation: out [M, N] = silu(products): bf16, or f32 with FP8 operands.

// rows [M, K] @ weights[g] [N, K]^T for the rows of each group g, on one CUDA device.
// bf16: rows and weights bf16, K and N multiples of 8 (gated: N / 2).
// FP8: rows and weights f8_e4m3, K and N multiples of 128; row_scales [K / 128, M] f32 (one per row and
// 128-deep block, block-major as the copy engine reads them; quantize_activations makes them per row);
// weight_scales [G, N / 128, K / 128] f32 or ue8m0 (quantize_weights makes them).
// Masked layout: M = G * max_m in row_scales' shape.
struct GroupedGemmProblem {
  Tensor rows;           // [M, K], M a multiple of 128; masked: [G, max_m, K]
  Tensor row_scales;     // FP8 only
  Tensor weights;        // [G, N, K]
  Tensor weight_scales;  // FP8 only
  Tensor tile_offsets;   // [G + 1] i32: the first 128-row tile of each group, then the end (contiguous_tile_offsets)
  // Instead of tile_offsets, the masked layout: [G] i32, each group's own rows (clamped to [0, max_m]).
  Tensor masked_m;
  GroupedGemmEpilogue epilogue = GroupedGemmEpilogue::store;
};

// The tile offsets [G + 1] (i32, on the CPU) of groups with these row counts: each group's rows rounded
// up to a multiple of 128. Group g's row r is row 128 * offsets[g] + r of the row matrix.
Tensor contiguous_tile_offsets(const std::vector<int64_t>& rows_per_group);

// Whether the Hopper kernels run on this device (a CUDA build, a visible compute capability 9.0 GPU);
// otherwise why not.
Support hopper_grouped_gemm_supports_device(Device device);
// The device, then the dtypes, shapes and alignment of the problem; the reason when they do not fit.
Support hopper_grouped_gemm_supports(const GroupedGemmProblem& p);

// The shape and dtype of out for this problem: [M, N] bf16, gated [M, N / 2] bf16 (f32 with FP8); masked
// [G, max_m, N] or [G, max_m, N / 2].
Shape grouped_gemm_out_shape(const GroupedGemmProblem& p);
DType grouped_gemm_out_dtype(const GroupedGemmProblem& p);
// gated_e4m3: the shape of out_scales, [N / 256, M] (f32).
Shape grouped_gemm_out_scales_shape(const GroupedGemmProblem& p);

// Queues the GEMM on the stream (no host synchronisation); throws with the reason when
// hopper_grouped_gemm_supports refuses the problem or out has the wrong shape, dtype or device.
void hopper_grouped_gemm(const GroupedGemmProblem& p, Tensor& out, Stream stream);
// The same for every epilogue, with out_scales written by gated_e4m3 (and required there; ignored, and
// may be undefined, for the others).
void hopper_grouped_gemm(const GroupedGemmProblem& p, Tensor& out, Tensor& out_scales, Stream stream);

}  // namespace moekit

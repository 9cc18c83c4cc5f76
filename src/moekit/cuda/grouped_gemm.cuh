// The grouped products of grouped_mm (and eager, one expert at a time) on CUDA.
//
// up:   x [T, H] rows gathered by the sorted routing @ up_e [N, H]^T -> hidden [S, I]
//       (bias and activation in the epilogue; each tile holds the gate and up columns of the same
//        intermediate columns so the activation needs no second pass)
// down: hidden [S, I] @ down_e [H, I]^T -> y [S, H] float (bias in the epilogue)
// Rows are grouped by expert; tiles of kTileRows rows never straddle two experts. The tile
// schedule comes from the device routing, so nothing is read back to the host.
// Block-quantised weights (FP8, FP4): the left operands are the activations' e4m3 codes with a scale per
// row and 128-wide group (x quantised once per call, hidden after the up projection wrote it in float),
// and the kernels convert the weight codes as they read them.
#pragma once

#include "moekit/cuda/quantized_weights.cuh"
#include "moekit/cuda/routing.cuh"

namespace moekit::cuda {

enum class Projection : uint8_t { up, down };

struct GroupedProblem {
  ExpertsArgs a;
  DeviceRouting r;
  void* hidden = nullptr;  // [P, I] in the activation dtype, float with quantised weights (first offsets[E] rows used)
  float* y = nullptr;      // [P, H]
  // Quantised weights: the left operands as e4m3 codes (exact in bf16) [rows, groups * 128], zero past the
  // row's end, and their scales [rows, groups], one per 128-wide group: x per token, hidden per row.
  bf16* x_codes = nullptr;
  float* x_scales = nullptr;
  bf16* hidden_codes = nullptr;
  float* hidden_scales = nullptr;
  int only_expert = -1;    // >= 0: the grid covers this expert's tiles only (eager)
  int64_t col_blocks = 1;  // column blocks per row tile (set by the launcher)
};

// The CUDA-core kernels' inner step (grouped_gemm.cu, backward_row_products.cu): each thread's 4 x 4 piece of the
// tile (rows 4 ty.., columns 4 tx..) accumulates one kDepth-deep slab of a [kDepth][rows] and b [kDepth][cols],
// both in shared memory; then the piece goes to c [rows][cols] in shared memory for the epilogue.
template <int kDepth, int kRows, int kCols>
__device__ __forceinline__ void simt_tile_step(float (&acc)[4][4], const float (&a)[kDepth][kRows],
                                               const float (&b)[kDepth][kCols], int ty, int tx) {
#pragma unroll
  for (int kk = 0; kk < kDepth; ++kk) {
    float av[4], bv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) av[i] = a[kk][ty * 4 + i], bv[i] = b[kk][tx * 4 + i];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}

template <int kRows, int kCols>
__device__ __forceinline__ void simt_store_tile(const float (&acc)[4][4], float (&c)[kRows][kCols], int ty, int tx) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) c[ty * 4 + i][tx * 4 + j] = acc[i][j];
}

// Blocks run column block fastest: the blocks in flight together share their row tiles (the left
// operand is read from memory once, not once per column block) and their expert's weights.
__device__ __forceinline__ int64_t block_row_tile(const GroupedProblem& g) {
  return blockIdx.x / g.col_blocks;
}
__device__ __forceinline__ int64_t block_col(const GroupedProblem& g) {
  return blockIdx.x % g.col_blocks;
}

// Which expert and which of its row tiles this block computes; false when the block has no work
// (the grid is sized for the worst case of the routing).
__device__ __forceinline__ bool find_tile(const GroupedProblem& g, int64_t& expert, int64_t& row_begin,
                                          int64_t& row_end, int tile_rows) {
  const int32_t* tiles = g.r.tile_offsets;
  int64_t tile = block_row_tile(g);
  int64_t e;
  if (g.only_expert >= 0) {
    e = g.only_expert;
    tile += tiles[e];
    if (tile >= tiles[e + 1]) return false;
  } else {
    if (tile >= tiles[g.a.experts]) return false;
    e = expert_of(tiles, g.a.experts, tile);
  }
  expert = e;
  row_begin = g.r.offsets[e] + (tile - tiles[e]) * tile_rows;
  row_end = min(row_begin + tile_rows, static_cast<int64_t>(g.r.offsets[e + 1]));
  return true;
}

// Output features of a projection, its reduction length, and where its weight matrix starts.
template <Projection P>
struct ProjectionShape {
  __device__ __forceinline__ static int64_t outputs(const ExpertsArgs& a) {
    return P == Projection::up ? (a.has_gate ? 2 * a.intermediate : a.intermediate) : a.hidden;
  }
  __device__ __forceinline__ static int64_t reduction(const ExpertsArgs& a) {
    return P == Projection::up ? a.hidden : a.intermediate;
  }
};

// The weight row (output feature) that tile column c of tile column block `block` reads, or -1.
// For the gated up projection, a block of `width` columns holds width/2 gate then width/2 up columns.
template <Projection P>
__device__ __forceinline__ int64_t tile_output(const ExpertsArgs& a, int64_t block, int c, int width) {
  if constexpr (P == Projection::up) {
    if (a.has_gate) {
      const int half = width / 2;
      const int64_t j = block * half + (c < half ? c : c - half);
      if (j >= a.intermediate) return -1;
      return c < half ? gate_col(a, j) : up_col(a, j);
    }
    const int64_t j = block * width + c;
    return j < a.intermediate ? j : -1;
  } else {
    const int64_t h = block * width + c;
    return h < a.hidden ? h : -1;
  }
}

// Pointer to row `row` (sorted order) of the product's left operand.
template <typename T, Projection P>
__device__ __forceinline__ const T* left_row(const GroupedProblem& g, int64_t row) {
  if constexpr (P == Projection::up) {
    const int64_t token = g.r.row_pair[row] / g.a.top_k;
    return static_cast<const T*>(g.a.x) + token * g.a.hidden;
  } else {
    return static_cast<const T*>(g.hidden) + row * g.a.intermediate;
  }
}

// Row `row` (sorted order) of the left operand of a projection of quantised weights: codes and scales.
struct CodesRow {
  const bf16* codes = nullptr;
  const float* scales = nullptr;
};

// 128-wide activation groups of a row of n values.
__host__ __device__ __forceinline__ int64_t activation_groups(int64_t n) {
  return (n + 127) / 128;
}

template <Projection P>
__device__ __forceinline__ CodesRow quantized_left_row(const GroupedProblem& g, int64_t row) {
  const int64_t groups = activation_groups(ProjectionShape<P>::reduction(g.a));
  const int64_t source = P == Projection::up ? g.r.row_pair[row] / g.a.top_k : row;
  const bf16* codes = P == Projection::up ? g.x_codes : g.hidden_codes;
  const float* scales = P == Projection::up ? g.x_scales : g.hidden_scales;
  return {codes + source * groups * 128, scales + source * groups};
}

// Writes a finished tile c[rows][ldc] (float, in shared memory): bias and activation into hidden
// for the up projection, bias into y for the down projection. All threads of the block take part.
template <typename T, Projection P, int kRows, int kCols>
__device__ __forceinline__ void store_tile(const GroupedProblem& g, const float* c, int ldc, int64_t expert,
                                           int64_t row_begin, int64_t row_end, int64_t col_block) {
  const ExpertsArgs& a = g.a;
  if constexpr (P == Projection::up) {
    const int width = a.has_gate ? kCols / 2 : kCols;
    const int64_t j0 = col_block * width;
    const int64_t N = a.has_gate ? 2 * a.intermediate : a.intermediate;
    const T* bias = a.up_bias ? static_cast<const T*>(a.up_bias) + expert * N : nullptr;
    for (int i = threadIdx.x; i < kRows * width; i += blockDim.x) {
      const int r = i / width, q = i % width;
      const int64_t row = row_begin + r, j = j0 + q;
      if (row >= row_end || j >= a.intermediate) continue;
      float gate = c[r * ldc + q];
      float up = a.has_gate ? c[r * ldc + width + q] : 0.0f;
      if (bias) {
        gate += to_f(bias[a.has_gate ? gate_col(a, j) : j]);
        if (a.has_gate) up += to_f(bias[up_col(a, j)]);
      }
      const float h = activate(a, gate, up);
      if (a.quantized())  // quantised per 128-wide group afterwards (quantize_grouped_hidden)
        static_cast<float*>(g.hidden)[row * a.intermediate + j] = h;
      else
        static_cast<T*>(g.hidden)[row * a.intermediate + j] = from_f<T>(h);
    }
  } else {
    const int64_t h0 = col_block * kCols;
    const T* bias = a.down_bias ? static_cast<const T*>(a.down_bias) + expert * a.hidden : nullptr;
    for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) {
      const int r = i / kCols, q = i % kCols;
      const int64_t row = row_begin + r, h = h0 + q;
      if (row >= row_end || h >= a.hidden) continue;
      g.y[row * a.hidden + h] = c[r * ldc + q] + (bias ? to_f(bias[h]) : 0.0f);
    }
  }
}

// Device bytes for the routing, hidden [P, I] and y [P, H] of one call, and the problem with those
// buffers carved out of workspace (shared by grouped_mm and eager).
std::size_t grouped_buffers_bytes(const ExpertsArgs& a);
GroupedProblem grouped_buffers(const ExpertsArgs& a, void* workspace);
// Byte offset of the routing inside the workspace (route_on_device's argument).
inline constexpr std::size_t kRoutingOffset = 0;

// Number of tile column blocks of a projection for a tile of kCols columns.
inline int64_t column_blocks(const ExpertsArgs& a, Projection p, int cols) {
  if (p == Projection::up) {
    const int width = a.has_gate ? cols / 2 : cols;
    return (a.intermediate + width - 1) / width;
  }
  return (a.hidden + cols - 1) / cols;
}

// Launches one projection for every expert (only_expert < 0, grid sized for max_tiles row tiles) or
// for one expert (grid exactly its tiles). Picks the tensor-core kernel where it applies.
void launch_grouped_projection(const GroupedProblem& g, Projection p, int64_t max_tiles, cudaStream_t stream);

// Quantised weights: the activations' codes and scales that the projections read. quantize_grouped_x:
// every token of x, once per call, before the up projection. quantize_grouped_hidden: hidden rows
// [first_row, first_row + rows) after the up projection wrote them, before the down projection; rows from
// *row_count on (a device count, when not null) are skipped. Nothing without quantised weights.
void quantize_grouped_x(const GroupedProblem& g, cudaStream_t stream);
void quantize_grouped_hidden(const GroupedProblem& g, int64_t first_row, int64_t rows, const int32_t* row_count,
                             cudaStream_t stream);

// Rows per tile of every grouped kernel (both kernels share the routing's tile schedule).
constexpr int kTileRows = 64;

// out[t] = sum_k w[t, k] * y[pair_row[t * K + k]] in k order (NaN for a token with a negative id).
void launch_combine(const GroupedProblem& g, cudaStream_t stream);
// The same over rows y [*, H] in float (y_is_float) or in the activation dtype, pair_row [T * K];
// weighted = false adds rows that already carry their routing weight.
void launch_combine_rows(const ExpertsArgs& a, const int32_t* pair_row, const void* y, bool y_is_float, bool weighted,
                         cudaStream_t stream);

}  // namespace moekit::cuda

// The backward's three products over row tiles (backward.cuh): rows [S, depth] @ weight_e -> [S, width], rows
// grouped by expert in the routing's 64-row tiles. A tensor-core kernel (mma.sync bf16/f16, 64 x 256 tiles of 8
// warps of 32 x 64, 32-deep k steps, a 4-stage cp.async pipeline, token rows gathered in the operand load) and a
// CUDA-core kernel (f32, which must stay exact, and sizes that are not multiples of 8) share one epilogue per
// product. The weight is read in the orientation the product and the layout give it:
//   by rows of outputs ([width][depth], k contiguous: the forward's up projection reads it so), or
//   by rows of depth   ([depth][width], outputs contiguous: the backward's products of untransposed weights,
//                       loaded with ldmatrix.trans).
#include <algorithm>
#include <type_traits>

#include "moekit/cuda/backward.cuh"
#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/mma_sync.cuh"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

__host__ __device__ __forceinline__ int64_t up_rows(const ExpertsArgs& a) {
  return a.has_gate ? 2 * a.intermediate : a.intermediate;
}

// The reduction length and the outputs of each product; expert e's weight holds depth * width values.
template <RowProduct W>
__host__ __device__ __forceinline__ int64_t product_depth(const ExpertsArgs& a) {
  return W == RowProduct::hidden_gradient ? up_rows(a) : a.hidden;
}
template <RowProduct W>
__host__ __device__ __forceinline__ int64_t product_width(const ExpertsArgs& a) {
  return W == RowProduct::up ? up_rows(a) : W == RowProduct::down_gradient ? a.intermediate : a.hidden;
}

// Whether the product reads its weight by rows of depth ([depth][width]): up_proj is [N, H] (transposed [H, N])
// and down_proj [H, I] (transposed [I, H]), so z = x up^T reads it so only when transposed, the others only when not.
template <RowProduct W>
__host__ __device__ __forceinline__ bool weight_by_depth(const ExpertsArgs& a) {
  return (W == RowProduct::up) == a.transposed;
}

template <typename T, RowProduct W>
__device__ __forceinline__ const T* product_weight(const BackwardProblem& p, int64_t expert) {
  const ExpertsArgs& a = p.b.a;
  const void* w = W == RowProduct::down_gradient ? a.down : a.up;
  return static_cast<const T*>(w) + expert * product_depth<W>(a) * product_width<W>(a);
}

// Row `row` (sorted order) of the product's left operand: the pair's token row of x or grad_out, or a row of dz.
template <typename T, RowProduct W>
__device__ __forceinline__ const T* product_left(const BackwardProblem& p, int64_t row) {
  const ExpertsArgs& a = p.b.a;
  if constexpr (W == RowProduct::hidden_gradient) {
    return static_cast<const T*>(p.dz) + row * up_rows(a);
  } else {
    return static_cast<const T*>(W == RowProduct::up ? a.x : p.b.grad_out) + p.row_token[row] * a.hidden;
  }
}

// Writes a finished tile c [kRows][ldc] (float, shared memory) of output columns [n0, n0 + kCols). All threads of
// the block take part, each taking kV neighbouring columns at a time: kV = 2 (8-byte float and 4-byte 2-byte
// accesses) where the sizes make every pair whole and aligned (the tensor-core kernel's: H and I multiples of 8).
//   up:              z = c + b1
//   hidden_gradient: dx = c (in the dtype)
//   down_gradient:   c is G. A warp a row: dz and wa of each column, and the row's sum of G * act(z) over the
//                    block's columns, added in a fixed order (each lane's columns in order, then warp_sum) into
//                    route_partials[row][n0 / kCols].
template <typename T, RowProduct W, int kRows, int kCols, int kV>
__device__ __forceinline__ void finish_row_tile(const BackwardProblem& p, const float* c, int ldc, int64_t expert,
                                                int64_t row_begin, int64_t row_end, int64_t n0) {
  static_assert(kV == 1 || kV == 2, "one or two columns at a time");
  const ExpertsArgs& a = p.b.a;
  const int64_t N = up_rows(a), I = a.intermediate, H = a.hidden;
  if constexpr (W == RowProduct::up || W == RowProduct::hidden_gradient) {
    const T* bias = W == RowProduct::up && a.up_bias ? static_cast<const T*>(a.up_bias) + expert * N : nullptr;
    const int64_t width = W == RowProduct::up ? N : H;
    for (int i = threadIdx.x; i < kRows * kCols / kV; i += blockDim.x) {
      const int r = i / (kCols / kV), q = i % (kCols / kV) * kV;
      const int64_t row = row_begin + r, n = n0 + q;
      if (row >= row_end || n >= width) continue;
      float v[kV];
#pragma unroll
      for (int u = 0; u < kV; ++u) v[u] = c[r * ldc + q + u] + (bias ? to_f(bias[n + u]) : 0.0f);
      if constexpr (W == RowProduct::up) {
        if constexpr (kV == 2)
          *reinterpret_cast<float2*>(p.z + row * N + n) = make_float2(v[0], v[1]);
        else
          p.z[row * N + n] = v[0];
      } else {
        T* dx = static_cast<T*>(p.dx) + row * H + n;
        if constexpr (kV == 2)
          store_two(dx, v[0], v[1]);
        else
          dx[0] = from_f<T>(v[0]);
      }
    }
  } else {
    const int warps = static_cast<int>(blockDim.x / 32), warp = static_cast<int>(threadIdx.x / 32);
    const int lane = static_cast<int>(threadIdx.x % 32);
    for (int r = warp; r < kRows; r += warps) {
      const int64_t row = row_begin + r;
      if (row >= row_end) break;  // the same for the whole warp
      const float route = load_routing_weight<T>(a, p.r.row_pair[row]);
      const float* z = p.z + row * N;
      T* dz = static_cast<T*>(p.dz) + row * N;
      T* wa = static_cast<T*>(p.wa) + row * I;
      float dot = 0.0f;
      for (int q = lane * kV; q < kCols; q += 32 * kV) {
        const int64_t j = n0 + q;
        if (j >= I) break;
        // The gate and up values of columns j .. j + kV - 1: with kV = 2 one 8-byte load from each half
        // (concatenated), or one 16-byte load of g, u, g, u (interleaved).
        float zg[kV], zu[kV] = {};
        if constexpr (kV == 2) {
          if (!a.has_gate) {
            const float2 v = *reinterpret_cast<const float2*>(z + j);
            zg[0] = v.x, zg[1] = v.y;
          } else if (a.concatenated) {
            const float2 vg = *reinterpret_cast<const float2*>(z + j), vu = *reinterpret_cast<const float2*>(z + I + j);
            zg[0] = vg.x, zg[1] = vg.y, zu[0] = vu.x, zu[1] = vu.y;
          } else {
            const float4 v = *reinterpret_cast<const float4*>(z + 2 * j);
            zg[0] = v.x, zu[0] = v.y, zg[1] = v.z, zu[1] = v.w;
          }
        } else {
          zg[0] = z[a.has_gate ? gate_col(a, j) : j];
          if (a.has_gate) zu[0] = z[up_col(a, j)];
        }
        float d_gate[kV], d_up[kV], value[kV];
#pragma unroll
        for (int u = 0; u < kV; ++u) {
          const float g = c[r * ldc + q + u];
          const ActivationGradient d = activation_gradient(a, zg[u], zu[u]);
          d_gate[u] = route * g * d.d_gate;
          d_up[u] = route * g * d.d_up;
          value[u] = d.value;
          dot = fmaf(g, d.value, dot);
        }
        if constexpr (kV == 2) {
          store_dz_pair(a, dz, j, d_gate, d_up);
          store_two(wa + j, route * value[0], route * value[1]);
        } else {
          dz[a.has_gate ? gate_col(a, j) : j] = from_f<T>(d_gate[0]);
          if (a.has_gate) dz[up_col(a, j)] = from_f<T>(d_up[0]);
          wa[j] = from_f<T>(route * value[0]);
        }
      }
      dot = warp_sum(dot);
      if (lane == 0) p.route_partials[row * p.partial_blocks + n0 / kCols] = dot;
    }
  }
}

// This block's expert, its rows [row_begin, row_end) and its column block. Blocks run in groups of kTileGroup row
// tiles, row tile fastest within a group, so that the tiles of one expert that read the same column block of its
// weight start together and share it in L2 (at DeepSeek-V3's shape an expert's up weight is 59 MB, more than L2);
// run column block fastest, they started a row tile's columns apart. The group's blocks share the left operand's
// rows instead, a few blocks apart. On the H200, DeepSeek-V3 forward + backward at 16,384 tokens: 172 -> 166 ms.
constexpr int64_t kTileGroup = 8;

__device__ __forceinline__ bool find_row_tile(const GroupedProblem& s, int64_t& expert, int64_t& row_begin,
                                              int64_t& row_end, int64_t& col) {
  const int64_t cols = s.col_blocks, tiles = gridDim.x / cols, block = blockIdx.x;
  const int64_t first = block / (kTileGroup * cols) * kTileGroup;
  const int64_t size = min(kTileGroup, tiles - first), within = block - first * cols;
  int64_t tile = first + within % size;
  col = within / size;
  const int32_t* offsets = s.r.tile_offsets;
  int64_t e;
  if (s.only_expert >= 0) {
    e = s.only_expert;
    tile += offsets[e];
    if (tile >= offsets[e + 1]) return false;
  } else {
    if (tile >= offsets[s.a.experts]) return false;
    e = expert_of(offsets, s.a.experts, tile);
  }
  expert = e;
  row_begin = s.r.offsets[e] + (tile - offsets[e]) * kTileRows;
  row_end = min(row_begin + kTileRows, static_cast<int64_t>(s.r.offsets[e + 1]));
  return true;
}

constexpr int kThreads = 256;

// ---- Tensor-core kernel ----
constexpr int kMmaCols = 256, kDepthStep = 32, kStages = 4;
constexpr int kPitchK = kDepthStep + 8;  // rows of 32 k values: 80 bytes, ldmatrix's eight rows hit distinct banks
constexpr int kPitchN = kMmaCols + 8;    // rows of 256 outputs: 528 bytes, likewise
constexpr int kLeftElems = kTileRows * kPitchK;
template <bool kByDepth>
constexpr int kWeightElems = kByDepth ? kDepthStep* kPitchN : kMmaCols* kPitchK;
constexpr int kCPitch = kMmaCols + 4;
template <bool kByDepth>
constexpr std::size_t mma_smem_bytes() {
  return std::max<std::size_t>(kStages * (kLeftElems + kWeightElems<kByDepth>)*2,
                               static_cast<std::size_t>(kTileRows) * kCPitch * 4);
}

// x / grad_out / dz rows [64 of the tile] @ weight_e -> [64, 256] of column block block_col, into finish_row_tile.
template <typename T, RowProduct W, bool kByDepth>
__global__ void __launch_bounds__(kThreads, 2)
    row_product_mma_kernel(const BackwardProblem p, const GroupedProblem schedule) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  int64_t expert, row_begin, row_end, col;
  if (!find_row_tile(schedule, expert, row_begin, row_end, col)) return;
  const ExpertsArgs& a = p.b.a;
  const int64_t depth = product_depth<W>(a), width = product_width<W>(a);
  const T* w = product_weight<T, W>(p, expert);
  const int64_t n0 = col * kMmaCols;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;

  // A stage: 64 left rows of 4 16-byte chunks (one a thread, its row fixed over k) and 32 x 256 weight values
  // (four chunks a thread).
  const int left_row = tid / 4, left_chunk = tid % 4;
  const T* left =
      row_begin + left_row < row_end ? product_left<T, W>(p, row_begin + left_row) + left_chunk * 8 : nullptr;
  constexpr int kWeightChunks = kMmaCols * kDepthStep / 8 / kThreads;
  const T* weight_src[kWeightChunks];
#pragma unroll
  for (int q = 0; q < kWeightChunks; ++q) {
    const int i = tid + q * kThreads;
    if constexpr (kByDepth) {  // chunk i % 32 of depth row i / 32
      const int64_t n = n0 + (i % (kMmaCols / 8)) * 8;
      weight_src[q] = n < width ? w + (i / (kMmaCols / 8)) * width + n : nullptr;
    } else {  // chunk i % 4 of output row i / 4
      const int64_t n = n0 + i / 4;
      weight_src[q] = n < width ? w + n * depth + (i % 4) * 8 : nullptr;
    }
  }
  const int64_t k_steps = (depth + kDepthStep - 1) / kDepthStep;
  auto load_stage = [&](int64_t step, int stage) {
    T* sa = smem + stage * (kLeftElems + kWeightElems<kByDepth>);
    T* sb = sa + kLeftElems;
    const int64_t k0 = step * kDepthStep;
    const bool left_ok = left && k0 + left_chunk * 8 < depth;
    cp_async16(sa + left_row * kPitchK + left_chunk * 8, left_ok ? left + k0 : w, left_ok);
#pragma unroll
    for (int q = 0; q < kWeightChunks; ++q) {
      const int i = tid + q * kThreads;
      if constexpr (kByDepth) {
        const int kr = i / (kMmaCols / 8), chunk = i % (kMmaCols / 8);
        const bool ok = weight_src[q] && k0 + kr < depth;
        cp_async16(sb + kr * kPitchN + chunk * 8, ok ? weight_src[q] + k0 * width : w, ok);
      } else {
        const int n = i / 4, chunk = i % 4;
        const bool ok = weight_src[q] && k0 + chunk * 8 < depth;
        cp_async16(sb + n * kPitchK + chunk * 8, ok ? weight_src[q] + k0 : w, ok);
      }
    }
  };

  const int warp_m = warp / 4, warp_n = warp % 4;  // the warp's rows 32 * warp_m, columns 64 * warp_n
  float acc[2][8][4] = {};
  mma::pipelined_steps<kStages>(k_steps, load_stage, [&](int64_t, int stage) {
    const T* sa = smem + stage * (kLeftElems + kWeightElems<kByDepth>);
    const T* sb = sa + kLeftElems;
#pragma unroll
    for (int kk = 0; kk < kDepthStep; kk += 16) {
      uint32_t af[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        mma::ldmatrix_x4(af[mt], sa + (warp_m * 32 + mt * 16 + lane % 16) * kPitchK + kk + (lane / 16) * 8);
#pragma unroll
      for (int np = 0; np < 4; ++np) {  // pairs of 8-column tiles
        uint32_t bf[4];
        if constexpr (kByDepth)
          mma::ldmatrix_x4_trans(
              bf, sb + (kk + ((lane / 8) % 2) * 8 + lane % 8) * kPitchN + warp_n * 64 + np * 16 + (lane / 16) * 8);
        else
          mma::ldmatrix_x4(
              bf, sb + (warp_n * 64 + np * 16 + lane % 8 + (lane / 16) * 8) * kPitchK + kk + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma::mma16816<T>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
          mma::mma16816<T>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  });
  // The accumulators (m16n8 C fragments) into c over the pipeline's buffers, then the epilogue.
  float* c = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        c[(warp_m * 32 + mt * 16 + lane / 4 + (i / 2) * 8) * kCPitch + warp_n * 64 + nt * 8 + (lane % 4) * 2 + i % 2] =
            acc[mt][nt][i];
  __syncthreads();
  finish_row_tile<T, W, kTileRows, kMmaCols, 2>(p, c, kCPitch, expert, row_begin, row_end, n0);
}

// ---- CUDA-core kernel: 64 x 64 tiles, 16-deep k steps, 4 x 4 outputs a thread ----
constexpr int kSimtCols = 64, kSimtDepth = 16;

template <typename T, RowProduct W, bool kByDepth>
__global__ void __launch_bounds__(kThreads)
    row_product_simt_kernel(const BackwardProblem p, const GroupedProblem schedule) {
  __shared__ float a_tile[kSimtDepth][kTileRows + 4];
  __shared__ float b_tile[kSimtDepth][kSimtCols + 4];
  __shared__ float c_tile[kTileRows][kSimtCols + 1];
  int64_t expert, row_begin, row_end, col;
  if (!find_row_tile(schedule, expert, row_begin, row_end, col)) return;
  const ExpertsArgs& a = p.b.a;
  const int64_t depth = product_depth<W>(a), width = product_width<W>(a);
  const T* w = product_weight<T, W>(p, expert);
  const int64_t n0 = col * kSimtCols;
  const int tid = static_cast<int>(threadIdx.x), ty = tid / 16, tx = tid % 16;
  constexpr int kLoads = kTileRows * kSimtDepth / kThreads;  // 4 values of each tile a thread
  // Load q of a step reads left row i / 16 at k = k0 + i % 16 and the weight at (k0 + kk, n0 + col), i = tid + 256 q,
  // with (kk, col) chosen so that consecutive threads read consecutive addresses in either orientation. Each load
  // is valid while its k is below its limit (depth, or 0 for a row or column past the end): one comparison a load
  // (a predicate kept for each row and column spilled).
  const T* left_rows[kLoads];
  int64_t left_limit[kLoads], weight_offset[kLoads], weight_limit[kLoads];
  int weight_k[kLoads];
#pragma unroll
  for (int q = 0; q < kLoads; ++q) {
    const int i = tid + q * kThreads;
    const int64_t row = row_begin + i / kSimtDepth;
    left_rows[q] = row < row_end ? product_left<T, W>(p, row) : w;
    left_limit[q] = row < row_end ? depth : 0;
    weight_k[q] = kByDepth ? i / kSimtCols : i % kSimtDepth;
    const int64_t n = n0 + (kByDepth ? i % kSimtCols : i / kSimtDepth);
    weight_limit[q] = n < width ? depth : 0;
    weight_offset[q] = n < width ? (kByDepth ? n : n * depth) : 0;
  }
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < depth; k0 += kSimtDepth) {
#pragma unroll
    for (int q = 0; q < kLoads; ++q) {
      const int i = tid + q * kThreads;
      const int left_k = i % kSimtDepth;
      a_tile[left_k][i / kSimtDepth] = k0 + left_k < left_limit[q] ? to_f(left_rows[q][k0 + left_k]) : 0.0f;
      const int64_t k = k0 + weight_k[q];
      const int col = kByDepth ? i % kSimtCols : i / kSimtDepth;
      b_tile[weight_k[q]][col] = k < weight_limit[q] ? to_f(w[weight_offset[q] + (kByDepth ? k * width : k)]) : 0.0f;
    }
    __syncthreads();
    simt_tile_step(acc, a_tile, b_tile, ty, tx);
    __syncthreads();
  }
  simt_store_tile(acc, c_tile, ty, tx);
  __syncthreads();
  finish_row_tile<T, W, kTileRows, kSimtCols, 1>(p, &c_tile[0][0], kSimtCols + 1, expert, row_begin, row_end, n0);
}

unsigned grid_blocks(int64_t row_tiles, int64_t col_blocks) {
  MOEKIT_CHECK(row_tiles * col_blocks <= 0x7fffffff, "experts backward: too many tiles for one launch (", row_tiles,
               " x ", col_blocks, ")");
  return static_cast<unsigned>(row_tiles * col_blocks);
}

template <typename T, RowProduct W>
void launch_product(const BackwardProblem& p, int64_t max_tiles, cudaStream_t stream) {
  const ExpertsArgs& a = p.b.a;
  GroupedProblem schedule;
  schedule.a = a;
  schedule.r = p.r;
  schedule.only_expert = p.only_expert;
  const int64_t width = product_width<W>(a);
  const bool by_depth = weight_by_depth<W>(a);
  if constexpr (!std::is_same_v<T, float>) {
    if (p.tensor_cores) {
      schedule.col_blocks = (width + kMmaCols - 1) / kMmaCols;
      auto* kernel = by_depth ? row_product_mma_kernel<T, W, true> : row_product_mma_kernel<T, W, false>;
      const std::size_t smem = by_depth ? mma_smem_bytes<true>() : mma_smem_bytes<false>();
      allow_dynamic_shared_memory(reinterpret_cast<const void*>(kernel), smem);
      kernel<<<grid_blocks(max_tiles, schedule.col_blocks), kThreads, smem, stream>>>(p, schedule);
      MOEKIT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  schedule.col_blocks = (width + kSimtCols - 1) / kSimtCols;
  auto* kernel = by_depth ? row_product_simt_kernel<T, W, true> : row_product_simt_kernel<T, W, false>;
  kernel<<<grid_blocks(max_tiles, schedule.col_blocks), kThreads, 0, stream>>>(p, schedule);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace

int64_t route_partial_blocks(const ExpertsArgs& a, bool tensor_cores) {
  const int64_t cols = tensor_cores ? kMmaCols : kSimtCols;
  return (a.intermediate + cols - 1) / cols;
}

void launch_row_product(const BackwardProblem& p, RowProduct product, int64_t max_tiles, cudaStream_t stream) {
  if (max_tiles <= 0) return;
  MOEKIT_CHECK(!p.tensor_cores || p.b.a.dtype != DType::f32, "experts backward: f32 products run on CUDA cores");
  visit_float_dtype(p.b.a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (product) {
      case RowProduct::up:
        return launch_product<T, RowProduct::up>(p, max_tiles, stream);
      case RowProduct::down_gradient:
        return launch_product<T, RowProduct::down_gradient>(p, max_tiles, stream);
      case RowProduct::hidden_gradient:
        return launch_product<T, RowProduct::hidden_gradient>(p, max_tiles, stream);
    }
  });
}

}  // namespace moekit::cuda

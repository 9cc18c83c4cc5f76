// The backward's weight and bias gradients (backward.cuh). A weight gradient is, for each expert e,
//   C_e [M, Nw] = sum over the expert's rows r, in sorted order, of left[r]^T right[r]
// where one operand is a buffer in sorted order (dz or wa) and the other the pairs' token rows (x or grad_out,
// gathered as they are loaded). Each block owns one output tile of one expert and walks all of the expert's rows
// itself, so every element is one float sum in a fixed order: deterministic without atomics, and an expert that
// no token chose gets zeros. The grid is experts x tiles, known on the host, so nothing waits for the routing.
// Tensor cores (mma.sync bf16/f16): 128 x 128 tiles, 8 warps of 64 x 32, 32 rows a step, a 4-stage cp.async
// pipeline; both operands are stored with the reduction (row) index outermost, so both are read with
// ldmatrix.trans. With few rows per expert (DeepSeek-V3 at 4,096 tokens: 128, four steps) a one-tile block is
// mostly its pipeline's fill and its first loads' latency (these products ran at 118 TFLOP/s there, 210-270 with
// long row walks), so a block computes a strip of tiles along the output columns through one pipeline: the next
// tile's loads are in flight while this one's last steps and its stores run (DeepSeek-V3 forward + backward at
// 4,096 tokens: 62.7 -> 60.0 ms). The CUDA-core kernel takes f32 and sizes that are not multiples of 8.
#include <algorithm>

#include "moekit/cuda/backward.cuh"
#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/mma_sync.cuh"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

// C_e = left^T right over each expert's rows; out [E, left_width, right_width] in the dtype.
struct GradientProduct {
  const int32_t* offsets = nullptr;    // [E + 1]: the expert's rows
  const int32_t* row_token = nullptr;  // the token of each sorted row
  const void* left = nullptr;          // [rows or tokens, left_width]
  int64_t left_width = 0;
  const void* right = nullptr;  // [rows or tokens, right_width]
  int64_t right_width = 0;
  void* out = nullptr;
  int64_t tiles_m = 0, tiles_n = 0;
  int64_t strip = 1;     // neighbouring output tiles along n that one block computes, one after another
  int only_expert = -1;  // >= 0: the grid covers this expert's tiles only
};

__host__ __device__ __forceinline__ int64_t strips_n(const GradientProduct& g) {
  return (g.tiles_n + g.strip - 1) / g.strip;
}

// This block's expert and its strip of output tiles: rows m0, columns n0 onwards, `tiles` tiles (strip column
// fastest: neighbouring blocks read the same rows).
struct GradientTile {
  int64_t expert, m0, n0, tiles, row_begin, row_end;
};

__device__ __forceinline__ GradientTile gradient_tile(const GradientProduct& g, int tile_m, int tile_n) {
  const int64_t strips = strips_n(g);
  const int64_t per_expert = g.tiles_m * strips, block = blockIdx.x;
  GradientTile t;
  t.expert = g.only_expert >= 0 ? g.only_expert : block / per_expert;
  const int64_t within = block % per_expert;
  const int64_t first = within % strips * g.strip;
  t.m0 = within / strips * tile_m;
  t.n0 = first * tile_n;
  t.tiles = min(g.strip, g.tiles_n - first);
  t.row_begin = g.offsets[t.expert];
  t.row_end = g.offsets[t.expert + 1];
  return t;
}

constexpr int kThreads = 256;

// ---- Tensor-core kernel ----
// 128 x 128 tiles of 8 warps of 64 x 32 (64 accumulators a thread), so that two blocks share a multiprocessor and
// one's start and end (filling the pipeline, storing the tile) overlap the other's products. On the H200 at
// Qwen3-30B-A3B's shape: 128 x 256 tiles of 64 x 64 warps (one block a multiprocessor) ran at 137-150 TFLOP/s,
// these at 182-196, and at 263-271 once the token rows came from row_token instead of a division a row and step.
constexpr int kTileM = 128, kTileN = 128, kRowStep = 32, kStages = 4;
constexpr int kPitch = kTileM + 8;  // 272-byte rows: ldmatrix's eight rows hit distinct banks
constexpr int kOperandElems = kRowStep * kPitch;
constexpr std::size_t kMmaSmem = static_cast<std::size_t>(kStages) * 2 * kOperandElems * 2;
constexpr int kChunksPerRow = kTileM / 8;                     // 16-byte chunks of a tile row
constexpr int kChunks = kRowStep * kChunksPerRow / kThreads;  // chunks of each operand a thread loads a step: 2
static_assert(kTileM == kTileN, "both operands' stage tiles share one shape");

// kLeftByToken: left holds token rows and right sorted rows; otherwise the other way round.
template <typename T, bool kLeftByToken>
__global__ void __launch_bounds__(kThreads, 2) weight_gradient_mma_kernel(const GradientProduct g) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const GradientTile t = gradient_tile(g, kTileM, kTileN);
  const int64_t M = g.left_width, Nw = g.right_width;
  const T* left = static_cast<const T*>(g.left);
  const T* right = static_cast<const T*>(g.right);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  // Chunk q of a step: row (tid + 256 q) / 16 of the step, columns 8 * (tid % 16) of the tile, in both operands. The
  // token rows of the gathered side are read one step ahead (tokens), so that issuing a step's copies does not wait
  // for a load of row_token. The pipeline runs over the strip's tiles one after another, k_steps steps each:
  // load_stage and compute see the steps in order, so each keeps its own position (k step, tile column).
  const int chunk = tid % kChunksPerRow;
  int32_t tokens[kChunks];
  auto fetch_tokens = [&](int64_t k_step) {
#pragma unroll
    for (int q = 0; q < kChunks; ++q) {
      const int64_t r = t.row_begin + k_step * kRowStep + (tid + q * kThreads) / kChunksPerRow;
      tokens[q] = r < t.row_end ? g.row_token[r] : 0;
    }
  };
  fetch_tokens(0);
  const int64_t m = t.m0 + chunk * 8;
  const int64_t k_steps = (t.row_end - t.row_begin + kRowStep - 1) / kRowStep;
  int64_t load_k = 0, load_n0 = t.n0;
  auto load_stage = [&](int64_t, int stage) {
    T* sl = smem + stage * 2 * kOperandElems;
    T* sr = sl + kOperandElems;
    const int64_t n = load_n0 + chunk * 8;
#pragma unroll
    for (int q = 0; q < kChunks; ++q) {
      const int kr = (tid + q * kThreads) / kChunksPerRow;
      const int64_t r = t.row_begin + load_k * kRowStep + kr;
      const int64_t sorted_row = r, token_row = tokens[q];
      const bool row_ok = r < t.row_end;
      const int64_t left_row = kLeftByToken ? token_row : sorted_row, right_row = kLeftByToken ? sorted_row : token_row;
      const bool left_ok = row_ok && m < M, right_ok = row_ok && n < Nw;
      cp_async16(sl + kr * kPitch + chunk * 8, left_ok ? left + left_row * M + m : left, left_ok);
      cp_async16(sr + kr * kPitch + chunk * 8, right_ok ? right + right_row * Nw + n : right, right_ok);
    }
    if (++load_k == k_steps) load_k = 0, load_n0 += kTileN;
    fetch_tokens(load_k);
  };

  const int warp_m = warp / 4, warp_n = warp % 4;  // the warp's outputs: rows 64 * warp_m, columns 32 * warp_n
  float acc[4][4][4] = {};
  // Each lane's accumulators (m16n8 C fragments) are pairs of neighbouring columns: one 4-byte store each
  // (Nw is a multiple of 8, so a pair is whole).
  T* out = static_cast<T*>(g.out) + t.expert * M * Nw;
  auto store_tile = [&](int64_t n0) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t row = t.m0 + warp_m * 64 + mt * 16 + lane / 4 + half * 8;
          const int64_t col = n0 + warp_n * 32 + nt * 8 + (lane % 4) * 2;
          if (row >= M || col >= Nw) continue;
          const uint32_t pair = static_cast<uint32_t>(from_f<T>(acc[mt][nt][2 * half]).bits) |
                                static_cast<uint32_t>(from_f<T>(acc[mt][nt][2 * half + 1]).bits) << 16;
          *reinterpret_cast<uint32_t*>(out + row * Nw + col) = pair;
        }
  };
  if (k_steps == 0) {  // an expert without rows: zeros
    for (int64_t j = 0; j < t.tiles; ++j) store_tile(t.n0 + j * kTileN);
    return;
  }
  int64_t compute_k = 0, compute_n0 = t.n0;
  mma::pipelined_steps<kStages>(k_steps * t.tiles, load_stage, [&](int64_t, int stage) {
    const T* sl = smem + stage * 2 * kOperandElems;
    const T* sr = sl + kOperandElems;
#pragma unroll
    for (int kk = 0; kk < kRowStep; kk += 16) {
      uint32_t af[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        mma::ldmatrix_x4_trans(
            af[mt], sl + (kk + (lane / 16) * 8 + lane % 8) * kPitch + warp_m * 64 + mt * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int np = 0; np < 2; ++np) {  // pairs of 8-column tiles
        uint32_t bf[4];
        mma::ldmatrix_x4_trans(
            bf, sr + (kk + ((lane / 8) % 2) * 8 + lane % 8) * kPitch + warp_n * 32 + np * 16 + (lane / 16) * 8);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          mma::mma16816<T>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
          mma::mma16816<T>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
    if (++compute_k < k_steps) return;
    store_tile(compute_n0);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
    compute_k = 0;
    compute_n0 += kTileN;
  });
}

// ---- CUDA-core kernel: 64 x 64 tiles, 16 rows a step, 4 x 4 outputs a thread ----
constexpr int kSimtTile = 64, kSimtStep = 16;

template <typename T, bool kLeftByToken>
__global__ void __launch_bounds__(kThreads) weight_gradient_simt_kernel(const GradientProduct g) {
  __shared__ float l_tile[kSimtStep][kSimtTile + 4];
  __shared__ float r_tile[kSimtStep][kSimtTile + 4];
  const GradientTile t = gradient_tile(g, kSimtTile, kSimtTile);
  const int64_t M = g.left_width, Nw = g.right_width;
  const T* left = static_cast<const T*>(g.left);
  const T* right = static_cast<const T*>(g.right);
  const int tid = static_cast<int>(threadIdx.x), ty = tid / 16, tx = tid % 16;
  float acc[4][4] = {};
  for (int64_t r0 = t.row_begin; r0 < t.row_end; r0 += kSimtStep) {
#pragma unroll
    for (int q = 0; q < kSimtStep * kSimtTile / kThreads; ++q) {
      const int i = tid + q * kThreads, kr = i / kSimtTile, c = i % kSimtTile;
      const int64_t r = r0 + kr;
      float lv = 0.0f, rv = 0.0f;
      if (r < t.row_end) {
        const int64_t token = g.row_token[r];
        const int64_t m = t.m0 + c, n = t.n0 + c;
        if (m < M) lv = to_f(left[(kLeftByToken ? token : r) * M + m]);
        if (n < Nw) rv = to_f(right[(kLeftByToken ? r : token) * Nw + n]);
      }
      l_tile[kr][c] = lv;
      r_tile[kr][c] = rv;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSimtStep; ++kk) {
      float lv[4], rv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) lv[i] = l_tile[kk][ty * 4 + i], rv[i] = r_tile[kk][tx * 4 + i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(lv[i], rv[j], acc[i][j]);
    }
    __syncthreads();
  }
  T* out = static_cast<T*>(g.out) + t.expert * M * Nw;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t m = t.m0 + ty * 4 + i, n = t.n0 + tx * 4 + j;
      if (m < M && n < Nw) out[m * Nw + n] = from_f<T>(acc[i][j]);
    }
}

// ---- Bias gradients: out[e, c] = sum over the expert's rows r, in order, of src(r)[c] (times the routing weight
// with kByToken, where src(r) is the pair's token row of grad_out; otherwise row r of dz) ----
struct ColumnSums {
  ExpertsArgs a;  // routing weights, top_k, experts
  const int32_t* offsets = nullptr;
  const int32_t* row_pair = nullptr;
  const int32_t* row_token = nullptr;
  const void* src = nullptr;
  int64_t width = 0;
  void* out = nullptr;  // [E, width]
};

template <typename T, bool kByToken>
__global__ void __launch_bounds__(kThreads) column_sums_kernel(const ColumnSums s) {
  const int64_t e = blockIdx.x, col = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (col >= s.width) return;
  const T* src = static_cast<const T*>(s.src);
  const int64_t begin = s.offsets[e], end = s.offsets[e + 1];
  constexpr int kAtOnce = 4;  // rows whose values are loaded before they are added
  float acc = 0.0f;
  for (int64_t r0 = begin; r0 < end; r0 += kAtOnce) {
    float v[kAtOnce], scale[kAtOnce];
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j) {
      const int64_t r = r0 + j;
      v[j] = 0.0f;
      scale[j] = 0.0f;
      if (r < end) {
        if constexpr (kByToken) {
          const int64_t pair = s.row_pair[r];
          v[j] = to_f(src[s.row_token[r] * s.width + col]);
          scale[j] = load_routing_weight<T>(s.a, pair);
        } else {
          v[j] = to_f(src[r * s.width + col]);
          scale[j] = 1.0f;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j)
      if (r0 + j < end) acc = fmaf(scale[j], v[j], acc);
  }
  static_cast<T*>(s.out)[e * s.width + col] = from_f<T>(acc);
}

// Steps a tensor-core block should run at least, over the strip's tiles: with the expert's rows known only on the
// device, the strip is sized from the average rows per expert. One expert's launch (eager) keeps one tile a block,
// its grid being small already.
constexpr int64_t kStripSteps = 32;

template <typename T>
void launch_gradient(GradientProduct g, bool left_by_token, bool tensor_cores, int64_t experts, int64_t pairs,
                     cudaStream_t stream) {
  if (g.left_width == 0 || g.right_width == 0) return;
  const int64_t launched_experts = g.only_expert >= 0 ? 1 : experts;
  if (launched_experts == 0) return;
  const int tile_m = tensor_cores ? kTileM : kSimtTile, tile_n = tensor_cores ? kTileN : kSimtTile;
  g.tiles_m = (g.left_width + tile_m - 1) / tile_m;
  g.tiles_n = (g.right_width + tile_n - 1) / tile_n;
  if (tensor_cores && g.only_expert < 0) {
    const int64_t steps = std::max<int64_t>(1, (pairs / experts + kRowStep - 1) / kRowStep);
    g.strip = std::clamp<int64_t>((kStripSteps + steps - 1) / steps, 1, g.tiles_n);
  }
  const int64_t blocks = launched_experts * g.tiles_m * strips_n(g);
  MOEKIT_CHECK(blocks <= 0x7fffffff, "experts backward: too many weight-gradient tiles for one launch (", blocks, ")");
  if constexpr (!std::is_same_v<T, float>) {
    if (tensor_cores) {
      auto* kernel = left_by_token ? weight_gradient_mma_kernel<T, true> : weight_gradient_mma_kernel<T, false>;
      allow_dynamic_shared_memory(reinterpret_cast<const void*>(kernel), kMmaSmem);
      kernel<<<static_cast<unsigned>(blocks), kThreads, kMmaSmem, stream>>>(g);
      MOEKIT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  auto* kernel = left_by_token ? weight_gradient_simt_kernel<T, true> : weight_gradient_simt_kernel<T, false>;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(g);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_weight_gradients(const BackwardProblem& p, cudaStream_t stream) {
  const ExpertsArgs& a = p.b.a;
  const int64_t N = a.has_gate ? 2 * a.intermediate : a.intermediate, H = a.hidden, I = a.intermediate;
  const int64_t P = a.tokens * a.top_k;
  GradientProduct base;
  base.offsets = p.r.offsets;
  base.row_token = p.row_token;
  base.only_expert = p.only_expert;
  // grad_up: [N, H] = dz^T x, or transposed [H, N] = x^T dz.
  GradientProduct up = base;
  up.out = p.b.grad_up;
  if (a.transposed) {
    up.left = a.x, up.left_width = H, up.right = p.dz, up.right_width = N;
  } else {
    up.left = p.dz, up.left_width = N, up.right = a.x, up.right_width = H;
  }
  // grad_down: [H, I] = grad_out^T wa, or transposed [I, H] = wa^T grad_out.
  GradientProduct down = base;
  down.out = p.b.grad_down;
  if (a.transposed) {
    down.left = p.wa, down.left_width = I, down.right = p.b.grad_out, down.right_width = H;
  } else {
    down.left = p.b.grad_out, down.left_width = H, down.right = p.wa, down.right_width = I;
  }
  visit_float_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_gradient<T>(up, a.transposed, p.tensor_cores, a.experts, P, stream);
    launch_gradient<T>(down, !a.transposed, p.tensor_cores, a.experts, P, stream);
  });
}

void launch_bias_gradients(const BackwardProblem& p, cudaStream_t stream) {
  const ExpertsArgs& a = p.b.a;
  if (!p.b.grad_up_bias || !p.b.grad_down_bias || a.experts == 0) return;
  MOEKIT_CHECK(a.experts <= 0x7fffffff, "experts backward: too many experts for one launch");
  ColumnSums s;
  s.a = a;
  s.offsets = p.r.offsets;
  s.row_pair = p.r.row_pair;
  s.row_token = p.row_token;
  auto launch = [&](auto kernel) {
    const dim3 grid(static_cast<unsigned>(a.experts), static_cast<unsigned>((s.width + kThreads - 1) / kThreads));
    kernel<<<grid, kThreads, 0, stream>>>(s);
    MOEKIT_CUDA_CHECK_LAUNCH();
  };
  visit_float_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    s.src = p.dz;
    s.width = a.has_gate ? 2 * a.intermediate : a.intermediate;
    s.out = p.b.grad_up_bias;
    launch(column_sums_kernel<T, false>);
    s.src = p.b.grad_out;
    s.width = a.hidden;
    s.out = p.b.grad_down_bias;
    launch(column_sums_kernel<T, true>);
  });
}

}  // namespace moekit::cuda

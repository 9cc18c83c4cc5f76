// CUDA kernels of the model runtime's dense operations (model_kernels.h): the device half of
// model/model_ops.cpp and model/router.cpp. Every kernel computes in float and rounds once to the
// dtype where the CPU operation does; the products that the CPU rounds separately are written with
// __fmul_rn / __fadd_rn so that nvcc does not contract them into one fused multiply-add.
#include <algorithm>
#include <limits>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/grouped_gemm.cuh"
#include "moekit/cuda/model_kernels.h"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

constexpr int kThreads = 256;

// Blocks of kThreads for a grid-stride loop over n elements (the loop covers what the cap leaves).
unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16));
}

__device__ __forceinline__ int64_t grid_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Element-wise entry points: checks n, then launch(tag, blocks) with tag naming the dtype's storage type.
template <typename Launch>
void for_elements(const char* op, int64_t n, DType dtype, Launch&& launch) {
  MOEKIT_CHECK(n >= 0, op, ": negative size ", n);
  if (n == 0) return;
  visit_float_dtype(dtype, [&](auto tag) {
    launch(tag, elementwise_blocks(n));
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

// The sum of v over the block (every thread gets it); scratch holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// sigmoid with the accurate expf, as the CPU routers (device_math's sigmoid uses __expf).
__device__ __forceinline__ float sigmoid_accurate(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// ---- Copies: embedding rows and column ranges, in 16-, 4- or 2-byte units. ----

// dst row (r + (dst_first_row ? *dst_first_row : 0)), units [dst_begin, dst_begin + count) = src row
// (ids ? ids[r] : r), units [src_begin, ...). Strides and offsets in units of U. grid-stride over rows * count.
template <typename U>
__global__ void __launch_bounds__(kThreads)
    copy_rows_kernel(const U* __restrict__ src, const int32_t* __restrict__ ids, int64_t rows, int64_t src_stride,
                     int64_t src_begin, int64_t count, U* __restrict__ dst, const int32_t* __restrict__ dst_first_row,
                     int64_t dst_stride, int64_t dst_begin) {
  const int64_t first = dst_first_row ? static_cast<int64_t>(*dst_first_row) : 0;
  for (int64_t i = grid_index(); i < rows * count; i += grid_stride()) {
    const int64_t r = i / count, c = i % count;
    const int64_t s = ids ? static_cast<int64_t>(ids[r]) : r;
    dst[(first + r) * dst_stride + dst_begin + c] = src[s * src_stride + src_begin + c];
  }
}

// Copies with the widest unit that divides every byte offset and stride and both base pointers.
void copy_rows(const void* src, const int32_t* ids, int64_t rows, int64_t src_stride_bytes, int64_t src_begin_bytes,
               int64_t count_bytes, void* dst, int64_t dst_stride_bytes, int64_t dst_begin_bytes, cudaStream_t stream,
               const int32_t* dst_first_row = nullptr) {
  if (rows == 0 || count_bytes == 0) return;
  const auto all_divisible = [&](int64_t unit) {
    return reinterpret_cast<uintptr_t>(src) % unit == 0 && reinterpret_cast<uintptr_t>(dst) % unit == 0 &&
           src_stride_bytes % unit == 0 && src_begin_bytes % unit == 0 && count_bytes % unit == 0 &&
           dst_stride_bytes % unit == 0 && dst_begin_bytes % unit == 0;
  };
  auto launch = [&](auto unit_tag) {
    using U = decltype(unit_tag);
    constexpr int64_t u = sizeof(U);
    copy_rows_kernel<U><<<elementwise_blocks(rows * (count_bytes / u)), kThreads, 0, stream>>>(
        static_cast<const U*>(src), ids, rows, src_stride_bytes / u, src_begin_bytes / u, count_bytes / u,
        static_cast<U*>(dst), dst_first_row, dst_stride_bytes / u, dst_begin_bytes / u);
    MOEKIT_CUDA_CHECK_LAUNCH();
  };
  if (all_divisible(16))
    launch(uint4{});
  else if (all_divisible(4))
    launch(uint32_t{});
  else {
    MOEKIT_CHECK(all_divisible(2), "copy_rows: offsets are not multiples of 2 bytes");
    launch(uint16_t{});
  }
}

// ---- Element-wise kernels. ----

template <typename T>
__global__ void __launch_bounds__(kThreads) add_kernel(T* __restrict__ h, const T* __restrict__ a, int64_t n) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) h[i] = from_f<T>(to_f(h[i]) + to_f(a[i]));
}

// std::clamp's comparisons, so that NaN stays NaN as on the CPU (fminf/fmaxf would drop it).
template <typename T>
__global__ void __launch_bounds__(kThreads) clamp_kernel(T* __restrict__ x, int64_t n, float limit) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    const float v = to_f(x[i]);
    x[i] = from_f<T>(v < -limit ? -limit : (limit < v ? limit : v));
  }
}

template <typename From, typename To>
__global__ void __launch_bounds__(kThreads)
    convert_kernel(const From* __restrict__ src, int64_t n, To* __restrict__ dst) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) dst[i] = from_f<To>(to_f(src[i]));
}

// w = round(sigmoid(round(logit))), kept as float.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sigmoid_gate_kernel(const float* __restrict__ logits, int64_t n, float* __restrict__ weights) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) {
    const float l = to_f(from_f<T>(logits[i]));
    weights[i] = to_f(from_f<T>(sigmoid_accurate(l)));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) fill_kernel(T* __restrict__ dst, int64_t n, T value) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) dst[i] = value;
}

// ---- Greedy pick: one block over the whole row. ----
// The order of sampling.cpp's greedy scan: a number before NaN, the larger number first, the lower index
// among equal numbers; among NaNs the higher index (an all-NaN row gives its last index). index < 0: no
// candidate yet.
constexpr int kArgmaxThreads = 1024;

__device__ __forceinline__ bool picked_before(float a, int a_index, float b, int b_index) {
  if (a_index < 0) return false;
  if (b_index < 0) return true;
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (a_nan) return a_index > b_index;
  if (a != b) return a > b;
  return a_index < b_index;
}

__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const float* __restrict__ x, int n, int32_t* out) {
  __shared__ float best_shared[kArgmaxThreads / 32];
  __shared__ int index_shared[kArgmaxThreads / 32];
  float best = 0.0f;
  int best_index = -1;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    if (picked_before(x[i], i, best, best_index)) {
      best = x[i];
      best_index = i;
    }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
    if (picked_before(other, other_index, best, best_index)) {
      best = other;
      best_index = other_index;
    }
  }
  if (lane == 0) {
    best_shared[warp] = best;
    index_shared[warp] = best_index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / 32; ++w)
      if (picked_before(best_shared[w], index_shared[w], best, best_index)) {
        best = best_shared[w];
        best_index = index_shared[w];
      }
    *out = best_index;
  }
}

// ---- RMSNorm: one block of kThreads per row. ----

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                                            int64_t dim, float eps, T* __restrict__ out) {
  __shared__ float scratch[kThreads / 32];
  const T* row = x + static_cast<int64_t>(blockIdx.x) * dim;
  T* o = out + static_cast<int64_t>(blockIdx.x) * dim;
  float sum = 0.0f;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    const float v = to_f(row[d]);
    sum = fmaf(v, v, sum);
  }
  sum = block_sum(sum, scratch);
  const float inv = 1.0f / sqrtf(sum / static_cast<float>(dim) + eps);
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    const float normalised = to_f(from_f<T>(__fmul_rn(to_f(row[d]), inv)));
    o[d] = from_f<T>(__fmul_rn(to_f(weight[d]), normalised));
  }
}

// ---- Linear, few rows: weight streaming. ----
// x [T, K] @ w [N, K]^T (+ bias) -> out [T, N] (Out: the dtype, rounded, or float), T <= kTokens.
// A block of kGemvThreads owns kGemvRows output features; its threads stride K together (16-byte
// streaming loads of each weight row, kGemvUnroll loads in flight per row), every token row is
// accumulated against the weight values in registers, and the block reduces at the end. Small x is
// read through L1, which the streaming weight loads do not evict. grid ceil(N / kGemvRows).
constexpr int kGemvThreads = 128, kGemvRows = 4, kGemvUnroll = 2, kGemvMaxTokens = 8;

template <typename T, typename Out, int kTokens, bool kVectorised>
__global__ void __launch_bounds__(kGemvThreads)
    gemv_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias, int tokens, int64_t K,
                int64_t N, Out* __restrict__ out) {
  __shared__ float partial[kGemvThreads / 32][kGemvRows * kTokens];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kGemvRows;
  const T* rows[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) rows[r] = w + min(n0 + r, N - 1) * K;  // past N: a duplicate, not stored
  float acc[kGemvRows][kTokens];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[r][t] = 0.0f;

  if constexpr (kVectorised) {
    constexpr int V = kVec<T>;
    constexpr int64_t kStep = static_cast<int64_t>(kGemvThreads) * V;
    int64_t k = static_cast<int64_t>(threadIdx.x) * V;
    // kGemvUnroll steps per iteration: all their weight loads are issued before the first is used.
    for (; k + (kGemvUnroll - 1) * kStep < K; k += kGemvUnroll * kStep) {
      float wv[kGemvUnroll][kGemvRows][V];
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u)
#pragma unroll
        for (int r = 0; r < kGemvRows; ++r) load_vec_stream(rows[r] + k + u * kStep, wv[u][r]);
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u)
#pragma unroll
        for (int t = 0; t < kTokens; ++t)
          if (t < tokens) {
            float xv[V];
            load_vec(x + t * K + k + u * kStep, xv);
#pragma unroll
            for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
              for (int i = 0; i < V; ++i) acc[r][t] = fmaf(wv[u][r][i], xv[i], acc[r][t]);
          }
    }
    for (; k < K; k += kStep) {
      float wv[kGemvRows][V];
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) load_vec_stream(rows[r] + k, wv[r]);
#pragma unroll
      for (int t = 0; t < kTokens; ++t)
        if (t < tokens) {
          float xv[V];
          load_vec(x + t * K + k, xv);
#pragma unroll
          for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
            for (int i = 0; i < V; ++i) acc[r][t] = fmaf(wv[r][i], xv[i], acc[r][t]);
        }
    }
  } else {
    for (int64_t k = threadIdx.x; k < K; k += kGemvThreads) {
      float wv[kGemvRows];
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) wv[r] = to_f(rows[r][k]);
#pragma unroll
      for (int t = 0; t < kTokens; ++t)
        if (t < tokens) {
          const float xv = to_f(x[t * K + k]);
#pragma unroll
          for (int r = 0; r < kGemvRows; ++r) acc[r][t] = fmaf(wv[r], xv, acc[r][t]);
        }
    }
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0) partial[warp][r * kTokens + t] = v;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < kGemvRows * kTokens; i += kGemvThreads) {
    const int r = i / kTokens, t = i % kTokens;
    const int64_t n = n0 + r;
    if (n >= N || t >= tokens) continue;
    float v = 0.0f;
#pragma unroll
    for (int q = 0; q < kGemvThreads / 32; ++q) v += partial[q][i];
    if (bias) v += to_f(bias[n]);
    out[t * N + n] = from_f<Out>(v);
  }
}

template <typename T, typename Out, int kTokens>
void launch_gemv_tokens(const T* x, const T* w, const T* bias, int64_t tokens, int64_t K, int64_t N, Out* out,
                        cudaStream_t stream) {
  const bool vectorised = K % kVec<T> == 0 && aligned16(x) && aligned16(w);
  auto* kernel = vectorised ? gemv_kernel<T, Out, kTokens, true> : gemv_kernel<T, Out, kTokens, false>;
  const int64_t blocks = (N + kGemvRows - 1) / kGemvRows;
  MOEKIT_CHECK(blocks <= 0x7fffffff, "linear: ", N, " output features are too many for one launch");
  kernel<<<static_cast<unsigned>(blocks), kGemvThreads, 0, stream>>>(x, w, bias, static_cast<int>(tokens), K, N, out);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

template <typename T, typename Out>
void launch_gemv(const T* x, const T* w, const T* bias, int64_t tokens, int64_t K, int64_t N, Out* out,
                 cudaStream_t stream) {
  if (tokens <= 1)
    launch_gemv_tokens<T, Out, 1>(x, w, bias, tokens, K, N, out, stream);
  else if (tokens <= 2)
    launch_gemv_tokens<T, Out, 2>(x, w, bias, tokens, K, N, out, stream);
  else if (tokens <= 4)
    launch_gemv_tokens<T, Out, 4>(x, w, bias, tokens, K, N, out, stream);
  else
    launch_gemv_tokens<T, Out, kGemvMaxTokens>(x, w, bias, tokens, K, N, out, stream);
}

// ---- Linear, many rows: the grouped products' down projection with one group. ----
// hidden [S, I] @ down [H, I]^T -> y [S, H] float (+ bias) is x [T, K] @ w [N, K]^T with S = T, I = K,
// H = N and one expert holding every row; its routing is two offsets arrays of two entries, written
// on the device so that nothing is copied from the host.
constexpr std::size_t kGemmRoutingBytes = 256;

__global__ void one_group_routing_kernel(int32_t* offsets, int32_t* tile_offsets, int32_t rows, int32_t tiles) {
  offsets[0] = 0;
  offsets[1] = rows;
  tile_offsets[0] = 0;
  tile_offsets[1] = tiles;
}

// y [T, N] float = x @ w^T (+ bias), through the tensor-core kernel where it applies (16-bit, K % 8 == 0,
// 16-byte aligned operands), the CUDA-core kernel otherwise (f32 stays exact float math).
void launch_gemm(const void* x, const void* w, const void* bias, int64_t tokens, int64_t K, int64_t N, DType dtype,
                 float* y, void* workspace, cudaStream_t stream) {
  MOEKIT_CHECK(tokens <= 0x7fffffff, "linear: ", tokens, " rows are too many for one launch");
  const int64_t tiles = (tokens + kTileRows - 1) / kTileRows;
  GroupedProblem g;
  g.a.tokens = tokens;
  g.a.hidden = N;
  g.a.intermediate = K;
  g.a.experts = 1;
  g.a.top_k = 1;
  g.a.dtype = dtype;
  g.a.x = x;
  g.a.down = w;
  g.a.down_bias = bias;
  g.hidden = const_cast<void*>(x);  // only read
  g.y = y;
  auto* routing = static_cast<int32_t*>(workspace);
  g.r.offsets = routing;
  g.r.tile_offsets = routing + 2;
  one_group_routing_kernel<<<1, 1, 0, stream>>>(g.r.offsets, g.r.tile_offsets, static_cast<int32_t>(tokens),
                                                static_cast<int32_t>(tiles));
  MOEKIT_CUDA_CHECK_LAUNCH();
  launch_grouped_projection(g, Projection::down, tiles, stream);
}

void check_linear(const void* x, const void* weight, int64_t tokens, int64_t K, int64_t N, const void* out,
                  const void* workspace) {
  MOEKIT_CHECK(tokens >= 0 && K >= 0 && N >= 0, "linear: negative size (T = ", tokens, ", K = ", K, ", N = ", N, ")");
  MOEKIT_CHECK(tokens * N == 0 || (x && weight && out), "linear: null x, weight or out");
  MOEKIT_CHECK(tokens <= kGemvMaxTokens || tokens * N == 0 || workspace, "linear: ", tokens,
               " rows need a workspace of linear_workspace_bytes bytes, got null");
}

// ---- Rotary: one warp per (token, head); the rotated values wait in registers until the whole head
// has been read, since interleaved pairs are written back de-interleaved. ----
constexpr int kRotaryWarps = 4, kRotaryPairsPerLane = 8;

template <typename T>
__global__ void __launch_bounds__(kRotaryWarps * 32)
    rotary_kernel(T* __restrict__ x, int64_t tokens, int64_t heads, int64_t head_stride, int64_t offset, int64_t half,
                  const float* __restrict__ inv_freq, float attention_factor, bool interleaved, int64_t positions_begin,
                  const int32_t* __restrict__ positions_begin_device) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kRotaryWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (item >= tokens * heads) return;
  const int64_t t = item / heads, h = item % heads;
  T* v = x + t * heads * head_stride + h * head_stride + offset;
  const int64_t begin = positions_begin_device ? static_cast<int64_t>(*positions_begin_device) : positions_begin;
  const float position = static_cast<float>(begin + t);
  float first[kRotaryPairsPerLane], second[kRotaryPairsPerLane];
#pragma unroll
  for (int m = 0; m < kRotaryPairsPerLane; ++m) {
    const int64_t i = lane + 32 * m;
    if (i >= half) continue;
    // float32 as transformers: the angle, then cos/sin scaled, then rounded to the dtype.
    const float angle = __fmul_rn(inv_freq[i], position);
    const float c = to_f(from_f<T>(__fmul_rn(cosf(angle), attention_factor)));
    const float s = to_f(from_f<T>(__fmul_rn(sinf(angle), attention_factor)));
    const float a = to_f(interleaved ? v[2 * i] : v[i]);
    const float b = to_f(interleaved ? v[2 * i + 1] : v[i + half]);
    first[m] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    second[m] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
  __syncwarp();
#pragma unroll
  for (int m = 0; m < kRotaryPairsPerLane; ++m) {
    const int64_t i = lane + 32 * m;
    if (i >= half) continue;
    v[i] = from_f<T>(first[m]);
    v[i + half] = from_f<T>(second[m]);
  }
}

// ---- Attention: one block of kAttnWarps warps per (query token, query head). ----
// The keys the query sees are cut into tiles of 32; warp w takes tiles w, w + kAttnWarps, ...: each
// lane scores one key of the tile (the query in shared memory, the key row read with 16-byte loads),
// the warp updates its running max, sum and output (lane owning value dims lane + 32 i) online, and the
// warps' partial states merge in shared memory at the end (with the sink logit, if any).
constexpr int kAttnWarps = 4, kAttnMaxDim = 256, kAttnDimsPerLane = kAttnMaxDim / 32;

template <typename T, bool kVectorised>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_kernel(const AttentionArgs a) {
  __shared__ float q_shared[kAttnMaxDim];
  __shared__ float max_shared[kAttnWarps], sum_shared[kAttnWarps];
  __shared__ float out_shared[kAttnWarps][kAttnMaxDim];
  const int64_t t = blockIdx.x / a.query_heads, h = blockIdx.x % a.query_heads;
  const int64_t kh = h / (a.query_heads / a.key_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t dk = a.key_dim, dv = a.value_dim;
  const T* q = static_cast<const T*>(a.q) + t * a.q_row + h * dk;
  for (int64_t d = threadIdx.x; d < dk; d += blockDim.x) q_shared[d] = to_f(q[d]);
  __syncthreads();

  const int64_t position = (a.past_device ? static_cast<int64_t>(*a.past_device) : a.past) + t;
  const int64_t first = a.sliding_window > 0 ? max(int64_t{0}, position - a.sliding_window + 1) : 0;
  const int64_t tiles = (position - first + 32) / 32;
  const T* keys = static_cast<const T*>(a.k) + kh * a.k_head;
  const T* values = static_cast<const T*>(a.v) + kh * a.v_head;
  float running_max = -INFINITY, running_sum = 0.0f, acc[kAttnDimsPerLane];
#pragma unroll
  for (int i = 0; i < kAttnDimsPerLane; ++i) acc[i] = 0.0f;

  for (int64_t tile = warp; tile < tiles; tile += kAttnWarps) {
    const int64_t j0 = first + tile * 32, j = j0 + lane;
    const int valid = static_cast<int>(min(int64_t{32}, position + 1 - j0));  // keys of this tile
    float score = -INFINITY;
    if (lane < valid) {
      const T* key = keys + j * a.k_row;
      float dot = 0.0f;
      if constexpr (kVectorised) {
        constexpr int V = kVec<T>;
#pragma unroll 4
        for (int64_t d = 0; d < dk; d += V) {
          float kv[V];
          load_vec(key + d, kv);
#pragma unroll
          for (int i = 0; i < V; ++i) dot = fmaf(q_shared[d + i], kv[i], dot);
        }
      } else {
        for (int64_t d = 0; d < dk; ++d) dot = fmaf(q_shared[d], to_f(key[d]), dot);
      }
      score = dot * a.scale;
    }
    const float new_max = fmaxf(running_max, warp_max(score));
    const float p = lane < valid ? expf(score - new_max) : 0.0f;
    const float correction = expf(running_max - new_max);  // 0 on the first tile (running_max = -inf)
    running_sum = running_sum * correction + warp_sum(p);
    running_max = new_max;
#pragma unroll
    for (int i = 0; i < kAttnDimsPerLane; ++i) acc[i] *= correction;
    for (int jj = 0; jj < valid; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const T* value = values + (j0 + jj) * a.v_row;
#pragma unroll
      for (int i = 0; i < kAttnDimsPerLane; ++i) {
        const int64_t d = lane + 32 * i;
        if (d < dv) acc[i] = fmaf(pj, to_f(value[d]), acc[i]);
      }
    }
  }
  if (lane == 0) {
    max_shared[warp] = running_max;
    sum_shared[warp] = running_sum;
  }
#pragma unroll
  for (int i = 0; i < kAttnDimsPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < dv) out_shared[warp][d] = acc[i];
  }
  __syncthreads();
  float m = a.sinks ? a.sinks[h] : -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) m = fmaxf(m, max_shared[w]);
  float warp_weight[kAttnWarps];
  float denominator = a.sinks ? expf(a.sinks[h] - m) : 0.0f;
#pragma unroll
  for (int w = 0; w < kAttnWarps; ++w) {
    warp_weight[w] = expf(max_shared[w] - m);  // a warp without keys: exp(-inf) = 0
    denominator += sum_shared[w] * warp_weight[w];
  }
  T* o = static_cast<T*>(a.out) + (t * a.query_heads + h) * dv;
  for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) v += out_shared[w][d] * warp_weight[w];
    o[d] = from_f<T>(v / denominator);
  }
}

// ---- Routers: one warp per token, its scores in shared memory. ----
// The selection is K rounds of a warp arg-best under the CPU routers' total order (router.cpp's
// ranks_before: NaN first, then larger, then the lower index), each winner excluded from the next
// rounds, so the k slots come out in rank order exactly as the CPU's partial sort leaves them.
constexpr int kRouterWarps = 4;

__device__ __forceinline__ bool ranks_before(float a, int a_index, float b, int b_index) {
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return a_index < b_index;
}

// Writes the indices of the k best of n scores (excluded[i] != 0: not a candidate) to chosen[0..k),
// best first, and excludes them. All lanes of the warp call it; excluded and chosen are per-warp shared.
__device__ void warp_select_top(const float* score, uint8_t* excluded, int n, int k, int* chosen) {
  const int lane = threadIdx.x % 32;
  for (int round = 0; round < k; ++round) {
    float best = 0.0f;
    int best_index = -1;
    for (int i = lane; i < n; i += 32)
      if (!excluded[i] && (best_index < 0 || ranks_before(score[i], i, best, best_index))) {
        best = score[i];
        best_index = i;
      }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
      if (other_index >= 0 && (best_index < 0 || ranks_before(other, other_index, best, best_index))) {
        best = other;
        best_index = other_index;
      }
    }
    if (lane == 0) {
      chosen[round] = best_index;
      excluded[best_index] = 1;
    }
    __syncwarp();
  }
}

// Per-warp shared memory of the router kernel, in this order: score [E] and value [E] floats, group
// score [n_group] float, chosen [max(K, topk_group)] int, excluded [E] and group excluded [n_group] bytes.
struct RouterSmem {
  int64_t experts, groups, chosen;
  __host__ __device__ int64_t floats() const { return 2 * experts + groups; }
  __host__ __device__ int64_t bytes() const {
    return ((floats() + chosen) * 4 + experts + groups + 15) / 16 * 16;  // keeps every warp's part 16-aligned
  }
};

__global__ void __launch_bounds__(kRouterWarps * 32) router_kernel(const RouterArgs a) {
  extern __shared__ __align__(16) unsigned char router_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kRouterWarps + warp;
  if (token >= a.tokens) return;  // whole warps leave; no block barrier below
  const int E = static_cast<int>(a.experts), K = static_cast<int>(a.top_k);
  const int n_group = a.kind == 2 ? static_cast<int>(a.n_group) : 1;
  const RouterSmem layout{E, n_group, max(a.top_k, a.kind == 2 ? a.topk_group : 1)};
  unsigned char* base = router_smem + warp * layout.bytes();
  float* score = reinterpret_cast<float*>(base);  // the selection score
  float* value = score + E;                       // deepseek_v3: the sigmoid scores, the weights
  float* group_score = value + E;
  int* chosen = reinterpret_cast<int*>(group_score + n_group);
  uint8_t* excluded = reinterpret_cast<uint8_t*>(chosen + layout.chosen);
  uint8_t* group_excluded = excluded + E;
  const float* row = a.logits + token * E;
  int64_t* ids = a.ids + token * K;
  float* weights = a.weights + token * K;

  if (a.kind == 0) {
    // softmax over all E (the max propagates NaN, as router.cpp's softmax), then the top k.
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) {
      const float v = row[e];
      if (isnan(v) || v > m) m = v;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, m, offset);
      if (isnan(other) || other > m) m = other;
    }
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) {
      const float v = expf(row[e] - m);
      score[e] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32) {
      score[e] /= sum;
      excluded[e] = 0;
    }
  } else if (a.kind == 1) {
    for (int e = lane; e < E; e += 32) {
      score[e] = row[e];
      excluded[e] = 0;
    }
  } else {
    for (int e = lane; e < E; e += 32) {
      const float s = sigmoid_accurate(row[e]);
      value[e] = s;
      score[e] = s + a.correction_bias[e];
      excluded[e] = 0;
    }
    __syncwarp();
    if (n_group > 1) {
      // A group's score: the sum of its two best (a linear scan in expert order, as router.cpp's top2_sum).
      const int G = E / n_group;
      for (int g = lane; g < n_group; g += 32) {
        const float* c = score + g * G;
        float best = c[0], second = c[1];
        int best_i = 0, second_i = 1;
        if (ranks_before(second, second_i, best, best_i)) {
          best = c[1], second = c[0];
          best_i = 1, second_i = 0;
        }
        for (int i = 2; i < G; ++i) {
          if (ranks_before(c[i], i, best, best_i)) {
            second = best, second_i = best_i;
            best = c[i], best_i = i;
          } else if (ranks_before(c[i], i, second, second_i)) {
            second = c[i], second_i = i;
          }
        }
        group_score[g] = best + second;
        group_excluded[g] = 0;
      }
      __syncwarp();
      warp_select_top(group_score, group_excluded, n_group, static_cast<int>(a.topk_group), chosen);
      // group_excluded now marks the kept groups; every expert of the others is no candidate.
      for (int e = lane; e < E; e += 32) excluded[e] = group_excluded[e / G] ? 0 : 1;
    }
  }
  __syncwarp();
  warp_select_top(score, excluded, E, K, chosen);

  // The k weights in slot order; every lane runs the sums sequentially in slot order, as the CPU
  // does, and lanes k < K store.
  const float* source = a.kind == 2 ? value : score;
  for (int k = lane; k < K; k += 32) ids[k] = chosen[k];
  if (a.kind == 1) {
    // softmax over the k selected logits, as router.cpp's softmax over the k-span.
    float m = -INFINITY;
    for (int k = 0; k < K; ++k) {
      const float v = score[chosen[k]];
      if (isnan(v) || v > m) {
        m = v;
        if (isnan(v)) break;
      }
    }
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += expf(score[chosen[k]] - m);
    for (int k = lane; k < K; k += 32) weights[k] = expf(score[chosen[k]] - m) / sum;
    return;
  }
  float sum = 0.0f;
  if (a.norm_topk_prob) {
    for (int k = 0; k < K; ++k) sum += source[chosen[k]];
    if (a.kind == 2) sum += 1e-20f;
  }
  for (int k = lane; k < K; k += 32) {
    float w = source[chosen[k]];
    if (a.norm_topk_prob) w /= sum;
    if (a.kind == 2) w *= a.routed_scaling_factor;
    weights[k] = w;
  }
}

}  // namespace

void embedding_forward(const void* table, const int32_t* ids, int64_t tokens, int64_t hidden, DType dtype, void* out,
                       cudaStream_t stream) {
  MOEKIT_CHECK(tokens >= 0 && hidden >= 0, "embedding_forward: negative size");
  const int64_t row = hidden * static_cast<int64_t>(dtype_size(dtype));
  copy_rows(table, ids, tokens, row, 0, row, out, row, 0, stream);
}

void rms_norm_forward(const void* x, const void* weight, int64_t rows, int64_t dim, float eps, DType dtype, void* out,
                      cudaStream_t stream) {
  MOEKIT_CHECK(rows >= 0 && dim >= 0, "rms_norm_forward: negative size");
  MOEKIT_CHECK(rows <= 0x7fffffff, "rms_norm_forward: ", rows, " rows are too many for one launch");
  if (rows == 0 || dim == 0) return;
  visit_float_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rms_norm_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), dim, eps, static_cast<T*>(out));
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

std::size_t linear_workspace_bytes(int64_t tokens, int64_t in_features, int64_t out_features) {
  (void)in_features;
  if (tokens <= kGemvMaxTokens) return 0;
  return kGemmRoutingBytes + static_cast<std::size_t>(tokens * out_features) * sizeof(float);
}

void linear_forward(const void* x, const void* weight, const void* bias, int64_t tokens, int64_t in_features,
                    int64_t out_features, DType dtype, void* out, void* workspace, cudaStream_t stream) {
  check_linear(x, weight, tokens, in_features, out_features, out, workspace);
  if (tokens == 0 || out_features == 0) return;
  visit_float_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (tokens <= kGemvMaxTokens) {
      launch_gemv<T, T>(static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias), tokens,
                        in_features, out_features, static_cast<T*>(out), stream);
      return;
    }
    // float y [T, N] (bias added) after the routing's bytes, then one rounding pass into out.
    float* y = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + kGemmRoutingBytes);
    launch_gemm(x, weight, bias, tokens, in_features, out_features, dtype, y, workspace, stream);
    const int64_t n = tokens * out_features;
    convert_kernel<float, T><<<elementwise_blocks(n), kThreads, 0, stream>>>(y, n, static_cast<T*>(out));
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

void linear_forward_f32(const void* x, const void* weight, int64_t tokens, int64_t in_features, int64_t out_features,
                        DType dtype, float* out, void* workspace, cudaStream_t stream) {
  check_linear(x, weight, tokens, in_features, out_features, out, workspace);
  if (tokens == 0 || out_features == 0) return;
  visit_float_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (tokens <= kGemvMaxTokens)
      launch_gemv<T, float>(static_cast<const T*>(x), static_cast<const T*>(weight), nullptr, tokens, in_features,
                            out_features, out, stream);
    else
      launch_gemm(x, weight, nullptr, tokens, in_features, out_features, dtype, out, workspace, stream);
  });
}

void add_in_place(void* h, const void* a, int64_t n, DType dtype, cudaStream_t stream) {
  for_elements("add_in_place", n, dtype, [&](auto tag, unsigned blocks) {
    using T = typename decltype(tag)::type;
    add_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(h), static_cast<const T*>(a), n);
  });
}

void clamp_in_place(void* x, int64_t n, float limit, DType dtype, cudaStream_t stream) {
  for_elements("clamp_in_place", n, dtype, [&](auto tag, unsigned blocks) {
    using T = typename decltype(tag)::type;
    clamp_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(x), n, limit);
  });
}

void rotary_forward(void* x, int64_t tokens, int64_t heads, int64_t head_stride, int64_t offset, int64_t half,
                    const float* inv_freq, float attention_factor, bool interleaved, int64_t positions_begin,
                    const int32_t* positions_begin_device, DType dtype, cudaStream_t stream) {
  MOEKIT_CHECK(tokens >= 0 && heads >= 0 && half >= 0 && offset >= 0 && offset + 2 * half <= head_stride,
               "rotary_forward: ", 2 * half, " rotary values at ", offset, " do not fit heads of ", head_stride);
  MOEKIT_CHECK(half <= 32 * kRotaryPairsPerLane, "rotary_forward: half = ", half, " is above the kernel's ",
               32 * kRotaryPairsPerLane);
  const int64_t blocks = (tokens * heads + kRotaryWarps - 1) / kRotaryWarps;
  MOEKIT_CHECK(blocks <= 0x7fffffff, "rotary_forward: too many heads for one launch");
  if (blocks == 0 || half == 0) return;
  visit_float_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rotary_kernel<T><<<static_cast<unsigned>(blocks), kRotaryWarps * 32, 0, stream>>>(
        static_cast<T*>(x), tokens, heads, head_stride, offset, half, inv_freq, attention_factor, interleaved,
        positions_begin, positions_begin_device);
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

void attention_forward(const AttentionArgs& a, cudaStream_t stream) {
  MOEKIT_CHECK(a.tokens >= 0 && a.past >= 0, "attention_forward: negative tokens or past");
  MOEKIT_CHECK(a.key_heads > 0 && a.query_heads % a.key_heads == 0, "attention_forward: ", a.query_heads,
               " query heads are not a multiple of ", a.key_heads, " key heads");
  MOEKIT_CHECK(a.key_dim > 0 && a.key_dim <= kAttnMaxDim && a.value_dim > 0 && a.value_dim <= kAttnMaxDim,
               "attention_forward: head dims ", a.key_dim, " and ", a.value_dim, " must lie in [1, ", kAttnMaxDim, "]");
  const int64_t blocks = a.tokens * a.query_heads;
  MOEKIT_CHECK(blocks <= 0x7fffffff, "attention_forward: too many (token, head) pairs for one launch");
  if (blocks == 0) return;
  visit_float_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int64_t V = kVec<T>;
    const bool vectorised = a.key_dim % V == 0 && a.k_row % V == 0 && a.k_head % V == 0 && aligned16(a.k);
    auto* kernel = vectorised ? attention_kernel<T, true> : attention_kernel<T, false>;
    kernel<<<static_cast<unsigned>(blocks), kAttnWarps * 32, 0, stream>>>(a);
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

void copy_columns(const void* src, int64_t rows, int64_t src_cols, int64_t begin, int64_t end, void* dst,
                  int64_t dst_cols, int64_t dst_begin, DType dtype, cudaStream_t stream) {
  MOEKIT_CHECK(rows >= 0 && 0 <= begin && begin <= end && end <= src_cols && 0 <= dst_begin &&
                   dst_begin + (end - begin) <= dst_cols,
               "copy_columns: [", begin, ", ", end, ") of ", src_cols, " columns to ", dst_begin, " of ", dst_cols);
  const auto e = static_cast<int64_t>(dtype_size(dtype));
  copy_rows(src, nullptr, rows, src_cols * e, begin * e, (end - begin) * e, dst, dst_cols * e, dst_begin * e, stream);
}

void write_rows_at(const void* src, int64_t rows, int64_t row_elements, void* dst, const int32_t* first_row_device,
                   DType dtype, cudaStream_t stream) {
  MOEKIT_CHECK(rows >= 0 && row_elements >= 0 && first_row_device != nullptr,
               "write_rows_at: negative size or no first row");
  const auto row = row_elements * static_cast<int64_t>(dtype_size(dtype));
  copy_rows(src, nullptr, rows, row, 0, row, dst, row, 0, stream, first_row_device);
}

void route_forward(const RouterArgs& a, cudaStream_t stream) {
  MOEKIT_CHECK(a.kind >= 0 && a.kind <= 2, "route_forward: unknown router kind ", a.kind);
  MOEKIT_CHECK(a.tokens >= 0 && a.top_k >= 1 && a.top_k <= a.experts, "route_forward: top_k = ", a.top_k,
               " must lie in [1, E = ", a.experts, "]");
  if (a.kind == 2) {
    MOEKIT_CHECK(a.n_group >= 1 && a.experts % a.n_group == 0, "route_forward: n_group = ", a.n_group,
                 " must divide E = ", a.experts);
    MOEKIT_CHECK(a.n_group == 1 || a.experts / a.n_group >= 2, "route_forward: groups need at least 2 experts");
    MOEKIT_CHECK(a.topk_group >= 1 && a.topk_group <= a.n_group && a.top_k <= a.topk_group * (a.experts / a.n_group),
                 "route_forward: topk_group = ", a.topk_group, " of ", a.n_group,
                 " groups cannot hold top_k = ", a.top_k);
    MOEKIT_CHECK(a.correction_bias != nullptr, "route_forward: deepseek_v3 needs correction_bias");
  }
  const RouterSmem layout{a.experts, a.kind == 2 ? a.n_group : 1, std::max(a.top_k, a.kind == 2 ? a.topk_group : 1)};
  const std::size_t smem = static_cast<std::size_t>(layout.bytes()) * kRouterWarps;
  MOEKIT_CHECK(smem <= 48 * 1024, "route_forward: E = ", a.experts, " needs ", smem,
               " bytes of shared memory, above 48 KiB");
  const int64_t blocks = (a.tokens + kRouterWarps - 1) / kRouterWarps;
  MOEKIT_CHECK(blocks <= 0x7fffffff, "route_forward: too many tokens for one launch");
  if (blocks == 0) return;
  router_kernel<<<static_cast<unsigned>(blocks), kRouterWarps * 32, smem, stream>>>(a);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void float_to_dtype(const float* src, int64_t n, DType dtype, void* dst, cudaStream_t stream) {
  for_elements("float_to_dtype", n, dtype, [&](auto tag, unsigned blocks) {
    using T = typename decltype(tag)::type;
    convert_kernel<float, T><<<blocks, kThreads, 0, stream>>>(src, n, static_cast<T*>(dst));
  });
}

void dtype_to_float(const void* src, int64_t n, DType dtype, float* dst, cudaStream_t stream) {
  for_elements("dtype_to_float", n, dtype, [&](auto tag, unsigned blocks) {
    using T = typename decltype(tag)::type;
    convert_kernel<T, float><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(src), n, dst);
  });
}

void argmax_forward(const float* x, int64_t n, int32_t* out, cudaStream_t stream) {
  MOEKIT_CHECK(n >= 1 && n <= 0x7fffffff, "argmax_forward: ", n, " values (1 to 2^31 - 1)");
  argmax_kernel<<<1, kArgmaxThreads, 0, stream>>>(x, static_cast<int>(n), out);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void fill_forward(void* dst, int64_t n, DType dtype, double value, cudaStream_t stream) {
  MOEKIT_CHECK(n >= 0, "fill_forward: negative size ", n);
  if (n == 0) return;
  visit_dtype_among<float, int32_t, int64_t>(dtype, "f32, i32 or i64 (fill_forward)", [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(static_cast<T*>(dst), n, static_cast<T>(value));
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

void sigmoid_gate_forward(const float* logits, int64_t tokens, DType dtype, float* weights, cudaStream_t stream) {
  for_elements("sigmoid_gate_forward", tokens, dtype, [&](auto tag, unsigned blocks) {
    using T = typename decltype(tag)::type;
    sigmoid_gate_kernel<T><<<blocks, kThreads, 0, stream>>>(logits, tokens, weights);
  });
}

}  // namespace moekit::cuda

// The model runtime's linear layers on CUDA (model_kernels.h): x [T, K] @ w [N, K]^T (+ bias), by weight-streaming
// gemv for few rows and by the grouped GEMM's down projection with one group for many. Float accumulation, one
// rounding to the dtype, as model_ops.cpp's linear.
#include <algorithm>
#include <limits>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/grouped_gemm.cuh"
#include "moekit/cuda/model_kernels.h"
#include "moekit/cuda/model_kernels_common.cuh"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

using namespace model_common;

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

}  // namespace

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
    float_to_dtype(y, tokens * out_features, dtype, out, stream);
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

}  // namespace moekit::cuda

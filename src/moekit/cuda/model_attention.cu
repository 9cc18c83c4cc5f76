// The model runtime's rotary embedding and attention on CUDA (model_kernels.h), rounding where model_ops.cpp does;
// both can read the step's position from device memory (what a captured decode step needs).
#include <algorithm>
#include <limits>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/model_kernels.h"
#include "moekit/cuda/model_kernels_common.cuh"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

using namespace model_common;

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

}  // namespace

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

}  // namespace moekit::cuda

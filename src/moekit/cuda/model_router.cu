// The model runtime's routers on CUDA (model_kernels.h): the device half of model/router.cpp, the same scores and
// the same order of selection, so the experts and weights chosen match the CPU's.
#include <algorithm>
#include <limits>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/model_kernels.h"
#include "moekit/cuda/model_kernels_common.cuh"

namespace moekit::cuda {
namespace {

using namespace model_common;

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

}  // namespace moekit::cuda

// What the model runtime's CUDA units (model_kernels.cu, model_linear.cu, model_attention.cu, model_router.cu)
// share: the element-wise launch shape and the block and warp reductions.
#pragma once

#include <algorithm>
#include <cstdint>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"

namespace moekit::cuda::model_common {

constexpr int kThreads = 256;

// Blocks of kThreads for a grid-stride loop over n elements (the loop covers what the cap leaves).
inline unsigned elementwise_blocks(int64_t n) {
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

}  // namespace moekit::cuda::model_common

// CUDA kernels of the model runtime's dense operations (model_kernels.h): the device half of
// model/model_ops.cpp and model/router.cpp; the linear layers are in model_linear.cu, rotary and attention in
// model_attention.cu, the routers in model_router.cu. Every kernel computes in float and rounds once to the
// dtype where the CPU operation does; the products that the CPU rounds separately are written with
// __fmul_rn / __fadd_rn so that nvcc does not contract them into one fused multiply-add.
#include <algorithm>
#include <limits>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/model_kernels.h"
#include "moekit/cuda/model_kernels_common.cuh"

namespace moekit::cuda {
namespace {

using namespace model_common;

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

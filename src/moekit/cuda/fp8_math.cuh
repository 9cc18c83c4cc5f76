// Device-side FP8 arithmetic shared by the kernels of quantised experts: the e4m3 rounding and the
// activation scale of quantize_activations (quantization.h), bit for bit, the row quantiser built on
// them, and the weights' block scales.
#pragma once

#include <cfloat>

#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/scale_division.h"

namespace moekit::cuda {

// round_to_e4m3 of quantization.cpp: the value of the nearest e4m3 code (ties to even), saturating at
// 448, NaN kept.
__device__ __forceinline__ float e4m3_value(float v) {
  const float a = fabsf(v);
  uint32_t bits = __float_as_uint(a);
  bits = (bits + 0x7ffffu + ((bits >> 20) & 1u)) & 0xfff00000u;
  const float normal = __uint_as_float(bits);
  const float subnormal = __fsub_rn(__fadd_rn(a, 16384.0f), 16384.0f);
  float r = a < 0x1p-6f ? subnormal : normal;
  r = r > 448.0f ? 448.0f : r;
  r = a != a ? a : r;
  return copysignf(r, v);
}

// The scale of a group whose largest magnitude is amax (block_scale of quantization.cpp).
__device__ __forceinline__ float activation_scale(float amax, bool power_of_two) {
  if (amax == 0.0f) return 1.0f;
  const float scale = fmaxf(__fdiv_rn(amax, 448.0f), FLT_MIN);
  if (!power_of_two) return scale;
  const uint32_t bits = __float_as_uint(scale), exponent = bits >> 23;
  const uint32_t code = min((bits & 0x7fffffu) != 0 ? exponent + 1 : exponent, 0xfeu);  // ue8m0_ceil
  return __uint_as_float(code << 23);
}

// A 128-wide activation group held by kLanes aligned lanes of a warp, N values each (N * kLanes = 128, any
// assignment of the values to lanes and slots): replaces each value by the nearest e4m3 value of value / scale
// and returns the group's scale, as quantize_activations does (values past the row's end must be passed as 0).
// Every lane of the warp calls it (the largest magnitude is exchanged within each kLanes-lane group).
template <int N, int kLanes>
__device__ __forceinline__ float quantize_group_values(float (&v)[N], bool power_of_two) {
  static_assert(N * kLanes == 128 && kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = activation_scale(amax, power_of_two);
  const ScaleDivisor divisor = scale_divisor(scale);
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = e4m3_value(divide_by_scale(v[i], divisor));
  return scale;
}

// A warp's 128-wide activation group, 4 values a lane.
__device__ __forceinline__ float quantize_group_lanes(float (&v)[4], bool power_of_two) {
  return quantize_group_values<4, 32>(v, power_of_two);
}

// Where quantize_rows_kernel writes each row's quantised activations: the values the products use
// (q * scale, in float; may alias the source), or the e4m3 codes q as bf16 (exact: e4m3 has 3 mantissa
// bits) with their scales apart, for tensor-core operands. Codes rows hold whole groups (ceil(n/128) * 128
// values, zeros past n) so that 16-byte loads along a row never leave it.
struct QuantizedRows {
  float* values = nullptr;             // [rows, n]
  bf16* codes = nullptr;               // [rows, groups * 128], with values null
  float* scales = nullptr;             // [rows, groups]
  const int32_t* row_count = nullptr;  // device count of the rows in use (rows past it are skipped), or null
};

// dst rows = src [rows, n] quantised per row and 128-wide group. One block of 4 warps per row, one warp
// per group.
template <typename S>
__global__ void __launch_bounds__(128)
    quantize_rows_kernel(const S* src, int64_t n, bool power_of_two, QuantizedRows dst) {
  if (dst.row_count && static_cast<int64_t>(blockIdx.x) >= *dst.row_count) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t groups = (n + 127) / 128;
  const S* row = src + blockIdx.x * n;
  for (int64_t g0 = static_cast<int64_t>(warp) * 128; g0 < n; g0 += 4 * 128) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t j = g0 + lane + 32 * i;
      v[i] = j < n ? to_f(row[j]) : 0.0f;
    }
    const float scale = quantize_group_lanes(v, power_of_two);
    if (dst.values) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t j = g0 + lane + 32 * i;
        if (j < n) dst.values[blockIdx.x * n + j] = __fmul_rn(v[i], scale);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) dst.codes[blockIdx.x * groups * 128 + g0 + lane + 32 * i] = from_f<bf16>(v[i]);
      if (lane == 0) dst.scales[blockIdx.x * groups + g0 / 128] = scale;
    }
  }
}

// A ue8m0 code's value: 2^(code - 127), with 0 read as 2^-127 and 0xff as NaN.
__device__ __forceinline__ float ue8m0_value(uint32_t code) {
  if (code == 0xffu) return __int_as_float(0x7fc00000);
  return code == 0 ? 0x1p-127f : __uint_as_float(code << 23);
}

// Weight block scale `index`: float32, or a ue8m0 code with a.ue8m0_scales.
__device__ __forceinline__ float block_scale_at(const ExpertsArgs& a, const void* scales, int64_t index) {
  if (!a.ue8m0_scales) return static_cast<const float*>(scales)[index];
  return ue8m0_value(static_cast<const uint8_t*>(scales)[index]);
}

}  // namespace moekit::cuda

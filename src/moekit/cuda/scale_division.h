// value / scale, correctly rounded, from the scale's reciprocal: a product and two fused multiply-adds per
// value (host and device, so the CPU tests check it against the division). The activation quantisers
// (quantize_group_lanes, and the FP8 epilogue that quantises the intermediate) divide every value by its
// group's scale. As IEEE divisions, 11% of them took the division's slow path, a call each, and the
// quantising epilogue's GEMM ran 429 us instead of 368 (ncu, FP8 Qwen3-30B-A3B at 4,096 tokens).
#pragma once

#include <cmath>

#include "moekit/cuda/experts_cuda.h"

namespace moekit::cuda {

// Scales below this take the division itself: the correction's residual could then be subnormal (and
// lose bits) while the quotient is still large enough to matter. Activation scales are amax / 448.
inline constexpr float kSmallestReciprocalScale = 0x1p-64f;

// The reciprocal that divide_by_scale takes: 1 / scale correctly rounded.
MOEKIT_HOST_DEVICE inline float scale_reciprocal(float scale) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(scale);
#else
  return 1.0f / scale;
#endif
}

// value / scale rounded to nearest even, for a finite value and a normal positive scale, with
// reciprocal = scale_reciprocal(scale). Markstein's correction: q = value * reciprocal is within an ulp
// of the quotient, the residual value - q * scale is exact in one fused multiply-add, and q plus the
// residual times the correctly rounded reciprocal rounds to the correctly rounded quotient. Its sign is the
// value's, as the division's is: the correction alone would turn a -0 value (or one flushed to zero) into
// +0, whose e4m3 code differs (0x00, not 0x80); seen by the GEMM test on the H200.
MOEKIT_HOST_DEVICE inline float divide_by_scale(float value, float scale, float reciprocal) {
#if defined(__CUDA_ARCH__)
  if (scale < kSmallestReciprocalScale) return __fdiv_rn(value, scale);
  const float q = __fmul_rn(value, reciprocal);
  return copysignf(__fmaf_rn(__fmaf_rn(-q, scale, value), reciprocal, q), value);
#else
  if (scale < kSmallestReciprocalScale) return value / scale;
  const float q = value * reciprocal;
  return std::copysign(std::fma(std::fma(-q, scale, value), reciprocal, q), value);
#endif
}

}  // namespace moekit::cuda

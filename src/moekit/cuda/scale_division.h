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

// A scale prepared for divide_by_scale. Below kSmallestReciprocalScale the scale, and in divide_by_scale the value,
// are both multiplied by 2^64: exact (a power of two; a quantised value is at most 448 scales, so nothing
// overflows), with the same quotient, so that every division takes the correction below. With a branch to the
// division for such scales in every division, the quantising epilogue of the FP8 GEMM carried a division (and its
// slow path's call) for each of its 64 values a thread, which made its code larger and its instruction fetches
// slower.
struct ScaleDivisor {
  float scale;       // the scale, times boost
  float reciprocal;  // scale_reciprocal(scale)
  float boost;       // 1, or 2^64
};
MOEKIT_HOST_DEVICE inline ScaleDivisor scale_divisor(float scale) {
  const float boost = scale < kSmallestReciprocalScale ? 0x1p64f : 1.0f;
  return {scale * boost, scale_reciprocal(scale * boost), boost};
}

// value / scale rounded to nearest even, for a finite value at most 448 times a normal positive scale, with
// d = scale_divisor(scale). Markstein's correction: q = value * reciprocal is within an ulp of the quotient, the
// residual value - q * scale is exact in one fused multiply-add, and q plus the residual times the correctly
// rounded reciprocal rounds to the correctly rounded quotient. Its sign is the value's, as the division's is: the
// correction alone would turn a -0 value (or one flushed to zero) into +0, whose e4m3 code differs (0x00, not
// 0x80); seen by the GEMM test on the H200.
MOEKIT_HOST_DEVICE inline float divide_by_scale(float value, const ScaleDivisor& d) {
#if defined(__CUDA_ARCH__)
  const float v = __fmul_rn(value, d.boost), q = __fmul_rn(v, d.reciprocal);
  return copysignf(__fmaf_rn(__fmaf_rn(-q, d.scale, v), d.reciprocal, q), value);
#else
  const float v = value * d.boost, q = v * d.reciprocal;
  return std::copysign(std::fma(std::fma(-q, d.scale, v), d.reciprocal, q), value);
#endif
}

}  // namespace moekit::cuda

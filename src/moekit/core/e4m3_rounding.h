// The scalar e4m3 arithmetic that the quantisation of weights (core/quantization.cpp) and of activations
// (cpu/activation_quantization.cpp) share, inline so that both layers compile it where they use it: a block's
// scale, and the rounding of a float to the nearest e4m3 value and to its code, without branches.
#pragma once

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "moekit/quantization.h"

namespace moekit::detail {

// The scale of a block (or activation group) whose largest magnitude is amax, for codes up to max_code.
inline float block_scale(float amax, float max_code, bool power_of_two) {
  if (amax == 0.0f) return 1.0f;  // every value is 0, whatever the scale
  const float scale = std::max(amax / max_code, FLT_MIN);
  return power_of_two ? to_float(ue8m0_ceil(scale)) : scale;
}

// The e4m3 value nearest to v (ties to even, saturating at +-448, NaN kept) as a float: what
// to_float(from_float<f8_e4m3>(v)) gives, written without branches so that the activation loop vectorises.
// Normal range: round the float's mantissa to 3 bits in place. Below 2^-6 e4m3 steps by 2^-9: adding 2^14
// puts the float's last mantissa bit at 2^-9, so the addition itself rounds to nearest even there.
inline float round_to_e4m3(float v) {
  const float a = std::fabs(v);
  uint32_t bits = std::bit_cast<uint32_t>(a);
  bits = (bits + 0x7ffffu + ((bits >> 20) & 1u)) & 0xfff00000u;
  const float normal = std::bit_cast<float>(bits);
  const float subnormal = (a + 16384.0f) - 16384.0f;
  float r = a < 0x1p-6f ? subnormal : normal;
  r = r > kE4m3Max ? kE4m3Max : r;  // false for NaN: NaN goes through
  r = a != a ? a : r;
  return std::copysign(r, v);
}

// The e4m3 code of a value that is already one (round_to_e4m3's results, NaN included), without branches:
// normal values rebias the float's exponent and keep its top 3 mantissa bits; below 2^-6 the value is a
// multiple of 2^-9, so value * 512 is the code.
inline f8_e4m3 e4m3_code_of(float r) {
  const float a = std::fabs(r);
  const uint32_t normal = (std::bit_cast<uint32_t>(a) >> 20) - (120u << 3);
  uint32_t code = a < 0x1p-6f ? static_cast<uint32_t>(a * 512.0f) : normal;
  code = a != a ? 0x7fu : code;
  return f8_e4m3{static_cast<uint8_t>(((std::bit_cast<uint32_t>(r) >> 24) & 0x80u) | code)};
}

}  // namespace moekit::detail

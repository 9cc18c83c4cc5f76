#include "moekit/dtype.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cmath>

#include "moekit/quantization.h"

namespace moekit {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::string_view safetensors_name;
  std::size_t size;
  bool floating;
};

constexpr std::array<DTypeInfo, 9> kDTypes = {{
    {DType::f32, "f32", "F32", 4, true},
    {DType::f16, "f16", "F16", 2, true},
    {DType::bf16, "bf16", "BF16", 2, true},
    {DType::i32, "i32", "I32", 4, false},
    {DType::i64, "i64", "I64", 8, false},
    {DType::u8, "u8", "U8", 1, false},
    {DType::f8_e4m3, "f8_e4m3", "F8_E4M3", 1, true},
    {DType::f4_e2m1, "f4_e2m1", "F4", 1, true},
    {DType::ue8m0, "ue8m0", "F8_E8M0", 1, true},
}};

const DTypeInfo& info(DType dtype) {
  for (const auto& i : kDTypes)
    if (i.dtype == dtype) return i;
  MOEKIT_FAIL("unknown dtype code ", static_cast<int>(dtype));
}

}  // namespace

std::string_view dtype_name(DType dtype) {
  return info(dtype).name;
}
std::size_t dtype_size(DType dtype) {
  return info(dtype).size;
}
int64_t dtype_values_per_element(DType dtype) {
  return dtype == DType::f4_e2m1 ? 2 : 1;
}
bool is_floating(DType dtype) {
  return info(dtype).floating;
}

DType parse_dtype(std::string_view name) {
  std::string lower;
  for (char c : name) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "float32" || lower == "float") return DType::f32;
  if (lower == "float16" || lower == "half") return DType::f16;
  if (lower == "bfloat16") return DType::bf16;
  if (lower == "int32") return DType::i32;
  if (lower == "int64") return DType::i64;
  for (const auto& i : kDTypes)
    if (name == i.name || name == i.safetensors_name) return i.dtype;
  std::string valid;
  for (const auto& i : kDTypes) valid += std::string(valid.empty() ? "" : ", ") + std::string(i.name);
  MOEKIT_FAIL("unknown dtype '", name, "'; valid: ", valid);
}

float to_float(f16 v) {
  const uint32_t sign = (uint32_t{v.bits} & 0x8000u) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1fu;
  const uint32_t mantissa = v.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

template <>
f16 from_float<f16>(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u)};   // NaN
  if (abs >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {
    // Subnormal or zero in f16: round |v| * 2^24 to the nearest integer, ties to even.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;
    return f16{static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)))};
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even.
  uint32_t r = abs - (112u << 23);
  r += 0xfffu + ((r >> 13) & 1u);
  return f16{static_cast<uint16_t>(sign | (r >> 13))};
}

template <>
f8_e4m3 from_float<f8_e4m3>(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f8_e4m3{static_cast<uint8_t>(sign | 0x7fu)};  // NaN
  const float a = std::bit_cast<float>(abs);
  // 448 is the largest finite e4m3; everything from it up (the next step, 480, is NaN's code) saturates.
  if (a >= 448.0f) return f8_e4m3{static_cast<uint8_t>(sign | 0x7eu)};
  if (a < 0x1p-6f) {
    // Subnormal (or zero) in e4m3: a multiple of 2^-9. The product is exact, so nearbyint rounds the value
    // itself to nearest even; 8 (= 2^-6) lands on the smallest normal's code, which is what it is.
    return f8_e4m3{static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f)))};
  }
  // Normal: round the 20 dropped mantissa bits to nearest even (a carry moves into the exponent, as it
  // should), then rebias the exponent from 127 to 7.
  uint32_t r = abs + 0x7ffffu + ((abs >> 20) & 1u);
  const uint32_t exponent = (r >> 23) - 120u;
  r = (exponent << 3) | ((r >> 20) & 7u);
  return f8_e4m3{static_cast<uint8_t>(sign | std::min<uint32_t>(r, 0x7eu))};
}

template <>
ue8m0 from_float<ue8m0>(float v) {
  const uint32_t abs = std::bit_cast<uint32_t>(v) & 0x7fffffffu;
  uint32_t exponent = abs >> 23;
  if (exponent == 0xffu) return ue8m0{0xff};  // NaN, infinities
  // Nearest power of two: up when the mantissa is at least 1.5 (its top bit set), as torch rounds; float
  // subnormals have no implicit bit, so they round up only past half of 2^-126.
  const bool up = exponent > 0 ? (abs & 0x400000u) != 0 : (abs & 0x7fffffu) > 0x400000u;
  if (up && exponent < 0xfeu) ++exponent;
  return ue8m0{static_cast<uint8_t>(exponent)};
}

uint8_t e2m1_from_float(float v) {
  const float a = std::fabs(v);
  if (std::isnan(a)) return 0;
  // The code is the number of rounding thresholds at or below |v|: the midpoints between neighbouring
  // values, with a tie going to the even code (0 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
  // 3.5 -> 4.0, 5 -> 4.0), so > at midpoints that tie down and >= at those that tie up.
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(code | (std::signbit(v) ? 8 : 0));
}

// Declared in quantization.h; defined here, beside the ue8m0 type, so that every layer that rounds a scale up
// (the weights' quantisation in core, the activations' in cpu) links it from moekit_base.
ue8m0 ue8m0_ceil(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  if (!std::isfinite(v) || std::signbit(v)) return ue8m0{0xff};  // no power of two covers these
  if (v <= std::ldexp(1.0f, -127)) return ue8m0{0};
  const uint32_t exponent = bits >> 23, mantissa = bits & 0x7fffffu;
  if (exponent == 0) return ue8m0{1};  // a subnormal above 2^-127: 2^-126 covers it
  // 2^127 is the largest code; the few floats above it saturate there (and their values past the format's
  // largest code saturate in the conversion that follows).
  return ue8m0{static_cast<uint8_t>(std::min<uint32_t>(mantissa == 0 ? exponent : exponent + 1, 0xfeu))};
}

}  // namespace moekit

// Element types. The one place that turns a runtime DType into a template parameter is visit_dtype
// below (visit_float_dtype, visit_index_dtype and visit_scale_dtype narrow it to one kind); nothing
// else switches on dtype to pick code.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "moekit/error.h"

namespace moekit {

// f8_e4m3, f4_e2m1 and ue8m0 are the storage of quantised experts (DESIGN §3, include/moekit/quantization.h).
// An f4_e2m1 tensor element is one byte holding a packed pair of 4-bit values (value 2j in the low nibble,
// 2j + 1 in the high one), so a tensor of K 4-bit values along its last dimension has shape [..., K / 2],
// as the checkpoints store it.
enum class DType : uint8_t { f32, f16, bf16, i32, i64, u8, f8_e4m3, f4_e2m1, ue8m0 };

std::string_view dtype_name(DType dtype);
// Parses names as we print them ("bf16") and as safetensors writes them ("BF16").
DType parse_dtype(std::string_view name);
// Bytes per tensor element (an f4_e2m1 element is a packed pair: 1 byte).
std::size_t dtype_size(DType dtype);
// Numbers held by one tensor element: 2 for f4_e2m1 (packed pairs), 1 otherwise.
int64_t dtype_values_per_element(DType dtype);
bool is_floating(DType dtype);

// 16-bit float storage types. Arithmetic happens in float; these only hold bits.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float to_float(float v) {
  return v;
}
inline float to_float(bf16 v) {
  return std::bit_cast<float>(uint32_t{v.bits} << 16);
}
float to_float(f16 v);

// FP8 e4m3 ("fn": no infinities; 0x7f and 0xff are NaN; largest finite 448; subnormals down to 2^-9).
struct f8_e4m3 {
  uint8_t bits;
};
// UE8M0 scale: an unsigned exponent alone, value 2^(bits - 127); 0xff is NaN. Code 0 is 2^-127.
struct ue8m0 {
  uint8_t bits;
};
// Two FP4 e2m1 values in one byte: element 2j in the low nibble, 2j + 1 in the high one. Each nibble is
// sign, 2 exponent bits (bias 1), 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no NaN, no infinity.
struct f4_e2m1x2 {
  uint8_t bits;
};

// The magnitude bits placed at the top of a float's exponent and mantissa fields make a float that is
// 2^-120 times the e4m3 value, subnormals included (they become float subnormals), so one multiply
// rebiases the exponent exactly.
inline float to_float(f8_e4m3 v) {
  const uint32_t magnitude = v.bits & 0x7fu;
  const uint32_t sign = uint32_t{v.bits & 0x80u} << 24;
  if (magnitude == 0x7fu) return std::bit_cast<float>(sign | 0x7fc00000u);  // NaN keeps its sign
  return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(std::bit_cast<float>(magnitude << 20) * 0x1p120f));
}
inline float to_float(ue8m0 v) {
  if (v.bits == 0xffu) return std::numeric_limits<float>::quiet_NaN();
  if (v.bits == 0) return std::bit_cast<float>(0x00400000u);  // 2^-127 is a float subnormal
  return std::bit_cast<float>(uint32_t{v.bits} << 23);
}
// The value of a 4-bit e2m1 code (the low 4 bits of code).
inline float e2m1_to_float(uint8_t code) {
  constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return kValues[code & 0xfu];
}
// Round to nearest, ties to the even code, saturating: |v| beyond 6 (infinities included) gives +-6.
// e2m1 has no NaN: NaN gives +0, so callers that must not lose a NaN check for it first (the weight
// quantisers refuse non-finite weights).
uint8_t e2m1_from_float(float v);

template <typename T>
T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
// Round to nearest even; NaN stays NaN.
template <>
inline bf16 from_float<bf16>(float v) {
  uint32_t u = std::bit_cast<uint32_t>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}
template <>
f16 from_float<f16>(float v);
// Round to nearest even, saturating: finite values beyond 448 and infinities give +-448 (what every FP8
// quantiser wants; nothing in e4m3 is closer). NaN gives NaN (0x7f, or 0xff when its sign bit is set).
template <>
f8_e4m3 from_float<f8_e4m3>(float v);
// The nearest power of two to |v| (the sign is ignored: scales are magnitudes), rounding on the linear
// mantissa with ties (1.5 * 2^e) up, as torch's float8_e8m0fnu does; saturating at 2^127 and at 2^-127
// (zero gives 2^-127). NaN and infinities give NaN (0xff). Scales that must not shrink the range use
// ue8m0_ceil (quantization.h) instead.
template <>
ue8m0 from_float<ue8m0>(float v);

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::f16;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::u8;
}
template <>
constexpr DType dtype_of<f8_e4m3>() {
  return DType::f8_e4m3;
}
template <>
constexpr DType dtype_of<f4_e2m1x2>() {
  return DType::f4_e2m1;
}
template <>
constexpr DType dtype_of<ue8m0>() {
  return DType::ue8m0;
}

template <typename T>
struct TypeTag {
  using type = T;
};

// The single switch over dtypes: calls fn(TypeTag<T>{}) with T the storage type of the dtype (float, f16,
// bf16, int32_t, int64_t, uint8_t, f8_e4m3, f4_e2m1x2, ue8m0). fn must accept every one of them; the
// visitors below narrow it to one kind.
template <typename Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32:
      return fn(TypeTag<float>{});
    case DType::f16:
      return fn(TypeTag<f16>{});
    case DType::bf16:
      return fn(TypeTag<bf16>{});
    case DType::i32:
      return fn(TypeTag<int32_t>{});
    case DType::i64:
      return fn(TypeTag<int64_t>{});
    case DType::u8:
      return fn(TypeTag<uint8_t>{});
    case DType::f8_e4m3:
      return fn(TypeTag<f8_e4m3>{});
    case DType::f4_e2m1:
      return fn(TypeTag<f4_e2m1x2>{});
    case DType::ue8m0:
      return fn(TypeTag<ue8m0>{});
  }
  MOEKIT_FAIL("unknown dtype code ", static_cast<int>(dtype));
}

// visit_dtype for the storage types Ts only; any other dtype throws "expected <expected>, got <dtype>".
// fn is instantiated for Ts alone, so it may use what only those types support.
template <typename... Ts, typename Fn>
decltype(auto) visit_dtype_among(DType dtype, const char* expected, Fn&& fn) {
  using First = std::tuple_element_t<0, std::tuple<Ts...>>;
  using Result = decltype(fn(TypeTag<First>{}));
  return visit_dtype(dtype, [&](auto tag) -> Result {
    using T = typename decltype(tag)::type;
    if constexpr ((std::is_same_v<T, Ts> || ...))
      return fn(tag);
    else
      MOEKIT_FAIL("expected ", expected, ", got ", dtype_name(dtype));
  });
}

// Calls fn(TypeTag<T>{}) with T the storage type of a floating dtype (float, f16, bf16).
template <typename Fn>
decltype(auto) visit_float_dtype(DType dtype, Fn&& fn) {
  return visit_dtype_among<float, f16, bf16>(dtype, "a floating dtype (f32, f16, bf16)", std::forward<Fn>(fn));
}

// Calls fn(TypeTag<T>{}) with T int32_t or int64_t.
template <typename Fn>
decltype(auto) visit_index_dtype(DType dtype, Fn&& fn) {
  return visit_dtype_among<int32_t, int64_t>(dtype, "an index dtype (i32, i64)", std::forward<Fn>(fn));
}

// Calls fn(TypeTag<T>{}) with T float or ue8m0: the dtypes of block scales.
template <typename Fn>
decltype(auto) visit_scale_dtype(DType dtype, Fn&& fn) {
  return visit_dtype_among<float, ue8m0>(dtype, "a scale dtype (f32, ue8m0)", std::forward<Fn>(fn));
}

}  // namespace moekit

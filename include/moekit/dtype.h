// Element types. The one place that turns a runtime DType into a template parameter is
// visit_float_dtype / visit_index_dtype below; nothing else switches on dtype to pick code.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "moekit/error.h"

namespace moekit {

// f8_e4m3, f4_e2m1 (two per byte) and ue8m0 are reserved for the quantised experts; no backend runs
// them yet, and tensors of them can be created and serialised only.
enum class DType : uint8_t { f32, f16, bf16, i32, i64, u8, f8_e4m3, f4_e2m1, ue8m0 };

std::string_view dtype_name(DType dtype);
// Parses names as we print them ("bf16") and as safetensors writes them ("BF16").
DType parse_dtype(std::string_view name);
// Bytes per element; f4_e2m1 is counted as packed pairs (one byte per two elements) by the caller.
std::size_t dtype_size(DType dtype);
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

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with T the storage type of a floating dtype (float, f16, bf16).
template <typename Fn>
decltype(auto) visit_float_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32:
      return fn(TypeTag<float>{});
    case DType::f16:
      return fn(TypeTag<f16>{});
    case DType::bf16:
      return fn(TypeTag<bf16>{});
    default:
      MOEKIT_FAIL("expected a floating dtype (f32, f16, bf16), got ", dtype_name(dtype));
  }
}

// Calls fn(TypeTag<T>{}) with T int32_t or int64_t.
template <typename Fn>
decltype(auto) visit_index_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::i32:
      return fn(TypeTag<int32_t>{});
    case DType::i64:
      return fn(TypeTag<int64_t>{});
    default:
      MOEKIT_FAIL("expected an index dtype (i32, i64), got ", dtype_name(dtype));
  }
}

}  // namespace moekit

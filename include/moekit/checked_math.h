// Sizes read from untrusted input (config.json, command-line flags) are bounded below when read, but a
// product or sum of two of them can still leave int64, which is undefined behaviour in C++. Every such
// product goes through these: the result, or a moekit::Error naming what was being computed.
//
//   const int64_t q_rows = moekit::checked_mul(heads, head_dim, "num_attention_heads x head_dim");
#pragma once

#include <cstdint>
#include <string_view>

#include "moekit/error.h"

namespace moekit {

// a * b, or an Error "<what>: a x b does not fit in 64 bits".
inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) [[unlikely]]
    MOEKIT_FAIL(what, ": ", a, " x ", b, " does not fit in 64 bits");
  return out;
}

// a + b, or an Error "<what>: a + b does not fit in 64 bits".
inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) [[unlikely]]
    MOEKIT_FAIL(what, ": ", a, " + ", b, " does not fit in 64 bits");
  return out;
}

}  // namespace moekit

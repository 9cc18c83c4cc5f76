// The per-group steps of quantize_activations (quantization.h) on AVX-512, bit for bit as the portable loop
// in core/quantization.cpp (which chooses them at run time where gemv_uses_avx512()): the same IEEE
// division, the same rounding on the float's bits, the same selects.
#pragma once

#include <cstdint>

#include "moekit/dtype.h"

namespace moekit::cpu::avx512 {

// The largest |x[i]| of n values, NaN ignored (as std::max(amax, |x|) ignores it), 0 for none.
float group_amax(const float* x, int64_t n);

// For i < n: r = x[i] / scale rounded to e4m3 (saturating at 448, NaN kept); dequantized[i] = r * scale
// (may alias x) and codes[i] = r's code where codes is non-null.
void quantize_group(const float* x, int64_t n, float scale, float* dequantized, f8_e4m3* codes);

}  // namespace moekit::cpu::avx512

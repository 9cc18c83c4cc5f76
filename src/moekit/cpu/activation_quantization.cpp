// quantize_activations (quantization.h), the dynamic quantisation of activations the reference and every CPU
// backend share: per 128-wide group a scale from the group's largest magnitude, then each value divided by it and
// rounded to e4m3. Where the CPU has AVX-512, each group's maximum and rounding run on cpu::avx512's bit-exact twins
// of the loops below (the GCC 12 vectoriser leaves these loops scalar: a float max and selects).
#include "moekit/cpu/activation_quantization.h"

#include <algorithm>
#include <cmath>

#include "moekit/core/e4m3_rounding.h"
#include "moekit/cpu/gemv.h"
#include "moekit/quantization.h"

namespace moekit {

using detail::block_scale;
using detail::e4m3_code_of;
using detail::round_to_e4m3;

void quantize_activations(const float* x, int64_t n, bool power_of_two_scales, float* dequantized, f8_e4m3* codes,
                          float* scales) {
  const bool simd = cpu::gemv_uses_avx512();
  for (int64_t g0 = 0; g0 < n; g0 += kActivationGroupSize) {
    const int64_t g1 = std::min(n, g0 + kActivationGroupSize);
    float amax = 0;
    if (simd)
      amax = cpu::avx512::group_amax(x + g0, g1 - g0);
    else
      for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = block_scale(amax, kE4m3Max, power_of_two_scales);
    if (scales) scales[g0 / kActivationGroupSize] = scale;
    if (simd) {
      cpu::avx512::quantize_group(x + g0, g1 - g0, scale, dequantized + g0, codes ? codes + g0 : nullptr);
    } else if (codes) {
      for (int64_t i = g0; i < g1; ++i) {
        const float r = round_to_e4m3(x[i] / scale);
        codes[i] = e4m3_code_of(r);
        dequantized[i] = r * scale;
      }
    } else {
      for (int64_t i = g0; i < g1; ++i) dequantized[i] = round_to_e4m3(x[i] / scale) * scale;
    }
  }
}

float round_to_e4m3_value(float v) {
  return round_to_e4m3(v);
}

}  // namespace moekit

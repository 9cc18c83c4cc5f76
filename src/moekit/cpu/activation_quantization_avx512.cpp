#include <immintrin.h>

#include "moekit/cpu/activation_quantization.h"
#include "moekit/cpu/avx512_lanes.h"

namespace moekit::cpu::avx512 {

float group_amax(const float* x, int64_t n) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask16(n - i), x + i));
    amax = _mm512_max_ps(a, amax);  // a NaN first operand gives the second: NaN ignored
  }
  return max_lanes(amax);  // no NaN among the lanes
}

void quantize_group(const float* x, int64_t n, float scale, float* dequantized, f8_e4m3* codes) {
  const __m512 s = _mm512_set1_ps(scale), max_code = _mm512_set1_ps(448.0f), two_m6 = _mm512_set1_ps(0x1p-6f);
  const __m512 shift = _mm512_set1_ps(16384.0f), to_units = _mm512_set1_ps(512.0f);
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    const __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), s);
    const __m512 a = _mm512_abs_ps(q);
    // round_to_e4m3: normal range rounds the mantissa to 3 bits in place (ties to even); below 2^-6 adding
    // 2^14 rounds to a multiple of 2^-9; saturate at 448; NaN goes through; the sign comes back.
    __m512i bits = _mm512_castps_si512(a);
    bits = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7ffff)),
                            _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1)));
    const __m512 normal = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xfff00000u))));
    const __m512 subnormal = _mm512_sub_ps(_mm512_add_ps(a, shift), shift);
    const __mmask16 small = _mm512_cmp_ps_mask(a, two_m6, _CMP_LT_OQ);
    __m512 r = _mm512_mask_blend_ps(small, normal, subnormal);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, max_code, _CMP_GT_OQ), r, max_code);
    const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    r = _mm512_mask_blend_ps(nan, r, a);
    const __m512i q_sign = _mm512_and_si512(_mm512_castps_si512(q), sign_bit);
    const __m512 signed_r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), q_sign));
    _mm512_mask_storeu_ps(dequantized + i, m, _mm512_mul_ps(signed_r, s));
    if (!codes) continue;
    // e4m3_code_of: normal values rebias the exponent and keep 3 mantissa bits; below 2^-6, r * 512 is the
    // code; NaN is 0x7f; the sign in bit 7.
    __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(r), 20), _mm512_set1_epi32(120 << 3));
    code = _mm512_mask_blend_epi32(small, code, _mm512_cvttps_epu32(_mm512_mul_ps(r, to_units)));
    code = _mm512_mask_blend_epi32(nan, code, _mm512_set1_epi32(0x7f));
    code = _mm512_or_si512(code, _mm512_srli_epi32(q_sign, 24));
    _mm512_mask_cvtepi32_storeu_epi8(codes + i, m, code);
  }
}

}  // namespace moekit::cpu::avx512

// Lane helpers shared by the AVX-512 kernel files (include only from files compiled for AVX-512).
#pragma once

#include <immintrin.h>

namespace moekit::cpu {

// The sum of the 16 lanes. _mm512_reduce_add_ps would do, but GCC 12 flags the "undefined" vector its
// extract (and even its 512-to-256 cast) starts from (-Wuninitialized) once inlined; the zero-masking
// extract has none.
inline float sum_lanes(__m512 v) {
  const __m512d d = _mm512_castps_pd(v);
  const auto all = static_cast<__mmask8>(0xff);
  const __m256 a = _mm256_add_ps(_mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(all, d, 0)),
                                 _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(all, d, 1)));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

}  // namespace moekit::cpu

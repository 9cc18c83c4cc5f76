// Lane helpers shared by the AVX-512 kernel files (include only from files compiled for AVX-512).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace moekit::cpu {

// The 16 lanes folded by op (given as its 256-bit, 128-bit and scalar forms: add, max). _mm512_reduce_add_ps
// (or _max_ps) would do, but GCC 12 flags the "undefined" vector its extract (and even its 512-to-256 cast)
// starts from (-Wuninitialized) once inlined; the zero-masking extract has none.
template <typename Op256, typename Op128, typename OpScalar>
inline float fold_lanes(__m512 v, Op256 op256, Op128 op128, OpScalar op_scalar) {
  const __m512d d = _mm512_castps_pd(v);
  const auto all = static_cast<__mmask8>(0xff);
  const __m256 a = op256(_mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(all, d, 0)),
                         _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(all, d, 1)));
  __m128 b = op128(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = op128(b, _mm_movehl_ps(b, b));
  b = op_scalar(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// The sum of the 16 lanes.
inline float sum_lanes(__m512 v) {
  return fold_lanes(
      v, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); }, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); },
      [](__m128 a, __m128 b) { return _mm_add_ss(a, b); });
}

// The largest of the 16 lanes (for lanes without NaN: max keeps its second operand on NaN).
inline float max_lanes(__m512 v) {
  return fold_lanes(
      v, [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); }, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); },
      [](__m128 a, __m128 b) { return _mm_max_ss(a, b); });
}

// The first `remaining` of 16 lanes: all from 16 on, none at 0 or below.
inline __mmask16 tail_mask16(int64_t remaining) {
  return remaining >= 16  ? __mmask16{0xffff}
         : remaining <= 0 ? __mmask16{0}
                          : static_cast<__mmask16>((1u << remaining) - 1u);
}

}  // namespace moekit::cpu

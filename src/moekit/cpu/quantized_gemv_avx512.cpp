// AVX-512 matrix-vector products over quantised weights. Like the bf16 kernels they read one row at a time
// as a single sequential stream (the prefetchers follow it); the difference is what happens to the bytes
// in registers:
// - FP8: 32 e4m3 bytes become 32 f16 numbers with three integer ops (sign-extend to 16 bits, shift the
//   7 magnitude bits into f16's exponent and mantissa, clear the one sign copy that lands in the
//   exponent), then two vcvtph2ps. The f16 values are the e4m3 values times 2^-8 exactly, subnormals
//   included (f16 keeps them as subnormals, which the conversion handles at full speed), and the 2^8 goes
//   into the block scale. A 256-entry table would need a gather per 16 values.
// - FP4: 16 bytes hold 32 values; each nibble indexes a 16-entry float table with vpermps (which reads
//   only the low 4 bits of each index, so the high nibble needs one shift). The low nibbles give the even
//   elements and the high ones the odd elements, so x is laid out as [even 16, odd 16] per 32 first.
// Products run in float: code * x per block of K, then times the block's scale.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "moekit/cpu/avx512_lanes.h"
#include "moekit/cpu/quantized_gemv.h"

namespace moekit::cpu::avx512 {
namespace {

inline __mmask16 tail_mask16(int64_t remaining) {
  return remaining >= 16  ? static_cast<__mmask16>(0xffff)
         : remaining <= 0 ? static_cast<__mmask16>(0)
                          : static_cast<__mmask16>((1u << remaining) - 1u);
}

// 32 e4m3 bytes -> lo (elements 0..15) and hi (16..31) as floats times 2^-8.
inline void e4m3_to_scaled_floats(__m256i bytes, __m512& lo, __m512& hi) {
  __m512i w = _mm512_cvtepi8_epi16(bytes);  // bits 8..15 are copies of the sign
  w = _mm512_slli_epi16(w, 7);              // magnitude to bits 7..13; sign copies at 14 and 15
  w = _mm512_and_si512(w, _mm512_set1_epi16(static_cast<short>(0xbf80)));  // drop the copy at bit 14
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
  // The zero-masking form, for the reason given at sum_lanes (avx512_lanes.h).
  hi = _mm512_cvtph_ps(_mm512_maskz_extracti64x4_epi64(static_cast<__mmask8>(0xff), w, 1));
}

// 16 ue8m0 scales -> floats at out[0, 16), times factor.
inline void ue8m0_to_floats(const uint8_t* codes, __mmask16 m, float factor, float* out) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, codes));
  __m512i bits = _mm512_slli_epi32(c, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()),
                               _mm512_set1_epi32(0x00400000));  // 2^-127, a float subnormal
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(255)),
                               _mm512_set1_epi32(0x7fc00000));  // NaN
  _mm512_mask_storeu_ps(out, m, _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(factor)));
}

// The scales of row n's blocks, as floats times factor, into out [blocks].
void row_scales(const QuantizedMatrix& w, int64_t n, int64_t blocks, float factor, float* out) {
  const int64_t first = w.fp4 ? n * w.scale_ld : (n / 128) * w.scale_ld;
  if (w.ue8m0_scales) {
    const auto* codes = static_cast<const uint8_t*>(w.scales) + first;
    for (int64_t b = 0; b < blocks; b += 16) ue8m0_to_floats(codes + b, tail_mask16(blocks - b), factor, out + b);
  } else {
    const float* s = static_cast<const float*>(w.scales) + first;
    for (int64_t b = 0; b < blocks; ++b) out[b] = s[b] * factor;
  }
}

// One FP8 row: sum over 128-wide blocks of scale[b] * (sum of code * x), codes read as values * 2^-8 and
// the scales pre-multiplied by 2^8.
float fp8_row(const uint8_t* r, const float* x, const float* scale, int64_t k_len) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < k_len; k0 += 128, ++b) {
    __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps(), p2 = _mm512_setzero_ps(), p3 = _mm512_setzero_ps();
    if (k0 + 128 <= k_len) {
      // Four independent chains per block keep the fused multiply-adds from waiting on each other.
      for (int64_t k = k0; k < k0 + 128; k += 64) {
        __m512 lo, hi;
        e4m3_to_scaled_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + k)), lo, hi);
        p0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + k), p0);
        p1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + k + 16), p1);
        e4m3_to_scaled_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + k + 32)), lo, hi);
        p2 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + k + 32), p2);
        p3 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + k + 48), p3);
      }
    } else {
      for (int64_t k = k0; k < k_len; k += 32) {
        const int64_t rest = k_len - k;
        const __mmask32 m = rest >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << rest) - 1);
        const __mmask16 m_lo = tail_mask16(rest), m_hi = tail_mask16(rest - 16);
        __m512 lo, hi;
        e4m3_to_scaled_floats(_mm256_maskz_loadu_epi8(m, r + k), lo, hi);
        p0 = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(m_lo, x + k), p0);
        p1 = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(m_hi, x + k + 16), p1);
      }
    }
    const __m512 s = _mm512_set1_ps(scale[b]);
    acc0 = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), s, acc0);
    acc1 = _mm512_fmadd_ps(_mm512_add_ps(p2, p3), s, acc1);
  }
  return sum_lanes(_mm512_add_ps(acc0, acc1));
}

// One FP4 row: x_split holds x as [even 16, odd 16] per 32 values, zero-padded to whole chunks.
float fp4_row(const uint8_t* r, const float* x_split, const float* scale, int64_t k_len) {
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f,
                                      -3.0f, -4.0f, -6.0f);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t chunks = (k_len + 31) / 32, full = k_len / 32;
  auto chunk = [&](int64_t c, __m128i bytes, __m512& a) {
    const __m512i d = _mm512_cvtepu8_epi32(bytes);
    const __m512 even = _mm512_permutexvar_ps(d, table);
    const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
    const __m512 p = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x_split + c * 32 + 16),
                                     _mm512_mul_ps(even, _mm512_loadu_ps(x_split + c * 32)));
    a = _mm512_fmadd_ps(p, _mm512_set1_ps(scale[c]), a);
  };
  int64_t c = 0;
  for (; c + 4 <= full; c += 4)
    for (int u = 0; u < 4; ++u)
      chunk(c + u, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + (c + u) * 16)), acc[u]);
  for (; c < chunks; ++c) {
    const int64_t bytes = std::min<int64_t>(16, (k_len - c * 32) / 2);
    chunk(c, _mm_maskz_loadu_epi8(tail_mask16(bytes), r + c * 16), acc[0]);
  }
  return sum_lanes(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

}  // namespace

void gemv_rows_quantized(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const float* x, float* y,
                         int64_t n_rows, int64_t k_len) {
  const int64_t blocks = w.fp4 ? (k_len + 31) / 32 : (k_len + 127) / 128;
  thread_local std::vector<float> scale, x_split;
  scale.resize(static_cast<std::size_t>(blocks + 16));  // the vector conversion writes whole groups of 16
  if (w.fp4) {
    x_split.assign(static_cast<std::size_t>(blocks * 32), 0.0f);
    for (int64_t k = 0; k < k_len; ++k)
      x_split[static_cast<std::size_t>(k / 32 * 32 + (k % 2) * 16 + (k % 32) / 2)] = x[k];
    for (int64_t i = 0; i < n_rows; ++i) {
      const int64_t n = first_row + i * row_step;
      row_scales(w, n, blocks, 1.0f, scale.data());
      y[i] = fp4_row(w.data + n * w.row_bytes, x_split.data(), scale.data(), k_len);
    }
    return;
  }
  int64_t scale_block = -1;  // the 128-row block whose scales are loaded
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t n = first_row + i * row_step;
    if (n / 128 != scale_block) {
      scale_block = n / 128;
      row_scales(w, n, blocks, 256.0f, scale.data());  // 2^8: the codes are read as values * 2^-8
    }
    y[i] = fp8_row(w.data + n * w.row_bytes, x, scale.data(), k_len);
  }
}

}  // namespace moekit::cpu::avx512

// block_scaled_gemm on AVX512-BF16 + VBMI. Per 128-wide block of K and pair of 16-row panels, the two
// panels' 2 KB of codes each are converted once into 128 vectors of bf16 pairs (8 KB, in L1), and every row tile of up
// to 6 activation rows multiplies them: per k pair, one broadcast of the row's two bf16 codes and two vdpbf16ps into
// the tile's 6 x 2 float accumulators. The products are exact (see quantized_gemv_avx512_bf16.cpp); each block's sums
// are scaled by the row's activation scale times the panel rows' weight scales and added into out.
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "moekit/cpu/avx512_lanes.h"
#include "moekit/cpu/block_scaled_gemm.h"
#include "moekit/cpu/e4m3_to_bf16_avx512.h"

namespace moekit::cpu::avx512_bf16 {
namespace {

constexpr int kTileRows = 6;

// The bf16 codes at a[0], a[1] in every 32-bit lane (a[1] = 0 with only_first).
inline __m512bh broadcast_pair(const bf16* a, bool only_first = false) {
  uint32_t bits = 0;
  std::memcpy(&bits, a, only_first ? sizeof(bf16) : 2 * sizeof(bf16));
  return std::bit_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(bits)));
}

// R rows (a: row stride lda, at the block's first k) times the converted panel pair wb over `pairs` k pairs
// (the last one with a single k when odd_tail); out[r] (its panel pair's 32 columns, masked) += the sums times
// scale[r] * w_scales.
template <int R>
void rows_times_block(const __m512bh* wb, int pairs, bool odd_tail, const bf16* a, int64_t lda, const float* scale,
                      int64_t scale_ld, __m512 w_scale0, __m512 w_scale1, float* out, int64_t ldo, __mmask16 mask0,
                      __mmask16 mask1) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int whole = odd_tail ? pairs - 1 : pairs;
  for (int kk = 0; kk < whole; ++kk) {
    const __m512bh w0 = wb[2 * kk], w1 = wb[2 * kk + 1];
    for (int r = 0; r < R; ++r) {
      const __m512bh x = broadcast_pair(a + r * lda + 2 * kk);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, x);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, x);
    }
  }
  if (odd_tail) {  // k = 2 * whole is the block's last: the next value in memory is not this row's
    const __m512bh w0 = wb[2 * whole], w1 = wb[2 * whole + 1];
    for (int r = 0; r < R; ++r) {
      const __m512bh x = broadcast_pair(a + r * lda + 2 * whole, true);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, x);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, x);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r * scale_ld]);
    float* o = out + r * ldo;
    _mm512_mask_storeu_ps(o, mask0,
                          _mm512_fmadd_ps(acc[r][0], _mm512_mul_ps(s, w_scale0), _mm512_maskz_loadu_ps(mask0, o)));
    _mm512_mask_storeu_ps(o + 16, mask1,
                          _mm512_fmadd_ps(acc[r][1], _mm512_mul_ps(s, w_scale1), _mm512_maskz_loadu_ps(mask1, o + 16)));
  }
}

using RowsTimesBlock = void (*)(const __m512bh*, int, bool, const bf16*, int64_t, const float*, int64_t, __m512, __m512,
                                float*, int64_t, __mmask16, __mmask16);
constexpr RowsTimesBlock kRowsTimesBlock[kTileRows + 1] = {nullptr,
                                                           rows_times_block<1>,
                                                           rows_times_block<2>,
                                                           rows_times_block<3>,
                                                           rows_times_block<4>,
                                                           rows_times_block<5>,
                                                           rows_times_block<6>};

}  // namespace

void block_scaled_gemm(const BlockScaledWeights& w, const bf16* a, int64_t lda, int64_t m, const float* a_scales,
                       int64_t a_scale_ld, float* out, int64_t ldo) {
  for (int64_t r = 0; r < m; ++r) std::fill(out + r * ldo, out + r * ldo + w.n, 0.0f);
  const Converter convert;
  alignas(64) __m512bh converted[128];  // [k pair][panel of the pair]
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t k0 = b * 128, width = std::min<int64_t>(128, w.k - k0);
    const int pairs = static_cast<int>((width + 1) / 2), pieces = (pairs + 1) / 2;
    const bool odd_tail = width % 2 != 0;
    for (int64_t pp = 0; pp < w.panels; pp += 2) {
      const uint8_t* codes = w.codes.data() + (b * w.panels + pp) * 32 * 64;
      for (int piece = 0; piece < pieces; ++piece)
        for (int p = 0; p < 2; ++p)
          convert(_mm512_loadu_si512(codes + (p * 32 + piece) * 64), converted[4 * piece + p],
                  converted[4 * piece + 2 + p]);
      // The next panel pair's codes (the next 4 KB, also across blocks) are fetched while these multiply:
      // the conversion above is where the weights stream in from memory.
      for (int line = 0; line < 64; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(codes) + 4096 + 64 * line, _MM_HINT_T0);
      const float* w_scales = w.scales.data() + (b * w.panels + pp) * 16;
      const __m512 w_scale0 = _mm512_loadu_ps(w_scales), w_scale1 = _mm512_loadu_ps(w_scales + 16);
      const __mmask16 mask0 = tail_mask16(w.n - pp * 16), mask1 = tail_mask16(w.n - pp * 16 - 16);
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
        kRowsTimesBlock[rows](converted, pairs, odd_tail, a + r0 * lda + k0, lda, a_scales + r0 * a_scale_ld + b,
                              a_scale_ld, w_scale0, w_scale1, out + r0 * ldo + pp * 16, ldo, mask0, mask1);
      }
    }
  }
}

}  // namespace moekit::cpu::avx512_bf16

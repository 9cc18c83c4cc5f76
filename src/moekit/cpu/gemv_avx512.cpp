// AVX-512 gemv kernels: weights are converted to float 16 lanes at a time and fused-multiply-added;
// the products are bound by reading the weights, so the kernels aim to keep loads streaming (several
// rows or column blocks in flight) rather than at peak arithmetic.
#include <immintrin.h>

#include "moekit/cpu/avx512_lanes.h"
#include "moekit/cpu/gemv_kernels.h"

namespace moekit::cpu::avx512 {
namespace {

inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
inline __m512 load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __m512 load16_masked(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
inline __m512 load16_masked(const f16* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 load16_masked(const bf16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

}  // namespace

template <typename W>
void gemv_rows(const W* w, int64_t ldw, const float* x, float* y, int64_t n_rows, int64_t k_len) {
  // One row at a time: consecutive rows are consecutive memory, so the weights are read as a single
  // sequential stream, which the hardware prefetchers follow across rows (interleaving several rows
  // made several short page-sized streams and halved the bandwidth). Four accumulators per row keep
  // the fused multiply-adds independent.
  const int64_t k_main = k_len / 64 * 64;
  for (int64_t n = 0; n < n_rows; ++n) {
    const W* r = w + n * ldw;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_main; k += 64) {
      a0 = _mm512_fmadd_ps(load16(r + k), _mm512_loadu_ps(x + k), a0);
      a1 = _mm512_fmadd_ps(load16(r + k + 16), _mm512_loadu_ps(x + k + 16), a1);
      a2 = _mm512_fmadd_ps(load16(r + k + 32), _mm512_loadu_ps(x + k + 32), a2);
      a3 = _mm512_fmadd_ps(load16(r + k + 48), _mm512_loadu_ps(x + k + 48), a3);
    }
    for (int64_t k = k_main; k < k_len; k += 16) {
      const __mmask16 m = tail_mask16(k_len - k);
      a0 = _mm512_fmadd_ps(load16_masked(r + k, m), _mm512_maskz_loadu_ps(m, x + k), a0);
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}

template <typename W>
void gemv_cols(const W* w, int64_t ldw, const float* x, float* y, int64_t n_cols, int64_t k_len) {
  int64_t n = 0;
  // 64 output columns per pass: four accumulators, each weight row read once per pass.
  for (; n + 64 <= n_cols; n += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; ++k) {
      const W* r = w + k * ldw + n;
      const __m512 xk = _mm512_set1_ps(x[k]);
      a0 = _mm512_fmadd_ps(load16(r), xk, a0);
      a1 = _mm512_fmadd_ps(load16(r + 16), xk, a1);
      a2 = _mm512_fmadd_ps(load16(r + 32), xk, a2);
      a3 = _mm512_fmadd_ps(load16(r + 48), xk, a3);
    }
    _mm512_storeu_ps(y + n, a0);
    _mm512_storeu_ps(y + n + 16, a1);
    _mm512_storeu_ps(y + n + 32, a2);
    _mm512_storeu_ps(y + n + 48, a3);
  }
  for (; n < n_cols; n += 16) {
    const __mmask16 m = tail_mask16(n_cols - n);
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; ++k) a = _mm512_fmadd_ps(load16_masked(w + k * ldw + n, m), _mm512_set1_ps(x[k]), a);
    _mm512_mask_storeu_ps(y + n, m, a);
  }
}

MOEKIT_INSTANTIATE_GEMV_KERNELS

}  // namespace moekit::cpu::avx512

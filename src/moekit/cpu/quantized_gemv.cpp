#include "moekit/cpu/quantized_gemv.h"

#include "moekit/cpu/gemv.h"

namespace moekit::cpu {

bool cpu_has_avx512_bf16() {
  static const bool has =
      gemv_uses_avx512() && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
  return has;
}

namespace {

// The value of weight (n, k) before its scale.
float code_value(const QuantizedMatrix& w, int64_t n, int64_t k) {
  const uint8_t* row = w.data + n * w.row_bytes;
  if (!w.fp4) return to_float(f8_e4m3{row[k]});
  const uint8_t pair = row[k / 2];
  return e2m1_to_float(k % 2 ? pair >> 4 : pair);
}

// Portable build: per block, the sum of code * x, then times the block's scale (the same grouping as the
// AVX-512 build, so the two differ only in the order of float additions).
void portable_gemv_rows(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const float* x, float* y,
                        int64_t n_rows, int64_t k_len) {
  const int64_t block = w.fp4 ? 32 : 128;
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t n = first_row + i * row_step;
    float acc = 0;
    for (int64_t k0 = 0; k0 < k_len; k0 += block) {
      const int64_t k1 = std::min(k_len, k0 + block);
      float partial = 0;
      for (int64_t k = k0; k < k1; ++k) partial += code_value(w, n, k) * x[k];
      acc += partial * w.scale(n, k0);
    }
    y[i] = acc;
  }
}

}  // namespace

// Portable build of gemv_rows_codes, in the AVX-512 builds' grouping (per weight scale block: 128 values for
// FP8, 32 for FP4).
void portable::gemv_rows_codes(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const QuantizedVector& x,
                               float* y, int64_t n_rows, int64_t k_len) {
  const int64_t block = w.fp4 ? 32 : 128;
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t n = first_row + i * row_step;
    float acc = 0;
    for (int64_t k0 = 0; k0 < k_len; k0 += block) {
      const int64_t k1 = std::min(k_len, k0 + block);
      float partial = 0;
      for (int64_t k = k0; k < k1; ++k) partial += code_value(w, n, k) * to_float(x.codes[k]);
      acc += partial * (w.scale(n, k0) * x.scales[k0 / 128]);
    }
    y[i] = acc;
  }
}

void gemv_rows_codes(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const QuantizedVector& x, float* y,
                     int64_t n_rows, int64_t k_len) {
  if (!cpu_has_avx512_bf16())
    portable::gemv_rows_codes(w, first_row, row_step, x, y, n_rows, k_len);
  else if (w.fp4)
    avx512_bf16::gemv_rows_fp4_codes(w, first_row, row_step, x, y, n_rows, k_len);
  else
    avx512_bf16::gemv_rows_fp8_codes(w, first_row, row_step, x, y, n_rows, k_len);
}

void gemv_rows_quantized(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const float* x, float* y,
                         int64_t n_rows, int64_t k_len) {
  if (gemv_uses_avx512())
    avx512::gemv_rows_quantized(w, first_row, row_step, x, y, n_rows, k_len);
  else
    portable_gemv_rows(w, first_row, row_step, x, y, n_rows, k_len);
}

void dequantize_row(const QuantizedMatrix& w, int64_t n, float* out, int64_t k_len) {
  const int64_t block = w.fp4 ? 32 : 128;
  for (int64_t k0 = 0; k0 < k_len; k0 += block) {
    const float s = w.scale(n, k0);
    const int64_t k1 = std::min(k_len, k0 + block);
    for (int64_t k = k0; k < k1; ++k) out[k] = code_value(w, n, k) * s;
  }
}

}  // namespace moekit::cpu

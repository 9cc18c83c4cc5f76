// Matrix-vector products over block-quantised weights where they lie (FP8 e4m3 with 128 x 128 block scales,
// FP4 e2m1 pairs with a ue8m0 scale per 32 values), for the (token, expert) pairs of batched_mm and the
// decode rows of grouped_mm; and one row dequantised to float, for the backends that pack weights.
// Kernel layer: raw pointers and sizes. The AVX-512 builds (quantized_gemv_avx512.cpp, and
// quantized_gemv_avx512_bf16.cpp for weight codes times activation codes) are chosen at run time like the other
// gemv kernels.
#pragma once

#include <cstdint>

#include "moekit/dtype.h"

namespace moekit::cpu {

// One quantised weight matrix [N, K], untransposed: row n starts at data + n * row_bytes.
// FP8: W(n, k) = e4m3(data[n * row_bytes + k]) * scale[(n / 128) * scale_ld + k / 128]
// FP4: W(n, k) = e2m1(nibble k % 2 of data[n * row_bytes + k / 2]) * scale[n * scale_ld + k / 32]
// Scales are float or ue8m0 (FP4: ue8m0).
struct QuantizedMatrix {
  bool fp4 = false;
  const uint8_t* data = nullptr;
  int64_t row_bytes = 0;
  const void* scales = nullptr;
  bool ue8m0_scales = false;
  int64_t scale_ld = 0;

  // The scale of weight (n, k).
  float scale(int64_t n, int64_t k) const {
    const int64_t i = fp4 ? n * scale_ld + k / 32 : (n / 128) * scale_ld + k / 128;
    return ue8m0_scales ? to_float(static_cast<const ue8m0*>(scales)[i]) : static_cast<const float*>(scales)[i];
  }
};

// y[i] = sum_k x[k] * W(first_row + i * row_step, k) for i in [0, n_rows), over whole rows (k_len = K; FP4:
// even). x and y are float. NaN weight codes (e4m3 0x7f/0xff, which no quantiser writes) are not
// detected: the AVX-512 build reads them as 480.
void gemv_rows_quantized(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const float* x, float* y,
                         int64_t n_rows, int64_t k_len);

// One row of activations as quantize_activations leaves them: e4m3 codes [k_len] and one float scale per
// 128-wide group; value k = e4m3(codes[k]) * scales[k / 128].
struct QuantizedVector {
  const f8_e4m3* codes = nullptr;
  const float* scales = nullptr;
};

// The same products for quantised weights and quantised activations, from both sides' codes. FP8 weights: per
// 128-wide block, the sum of W code * x code (every such product is exact in float), times the weight block's
// scale times the activation group's scale (activation groups and weight K-blocks are both 128 wide). FP4
// weights: the same per 32-wide block of the weight's scales (e2m1 times e4m3 is exact too), times the block's
// ue8m0 scale times the scale of the activation group holding it. The only rounding is in the float sums and
// the one product of the two scales (exact for ue8m0 weight scales). NaN codes and NaN scales read as NaN.
void gemv_rows_codes(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const QuantizedVector& x, float* y,
                     int64_t n_rows, int64_t k_len);

// out[k] = W(n, k) for k in [0, k_len): one row dequantised to float.
void dequantize_row(const QuantizedMatrix& w, int64_t n, float* out, int64_t k_len);

// Whether the code-times-code kernels can run: vdpbf16ps (AVX512-BF16) and vpermi2b (VBMI) on top of the
// AVX-512 that gemv_uses_avx512 asks for.
bool cpu_has_avx512_bf16();

namespace avx512 {
void gemv_rows_quantized(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const float* x, float* y,
                         int64_t n_rows, int64_t k_len);
}  // namespace avx512
namespace portable {  // what gemv_rows_codes runs on CPUs without AVX512-BF16 and VBMI (tested everywhere)
void gemv_rows_codes(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const QuantizedVector& x, float* y,
                     int64_t n_rows, int64_t k_len);
}  // namespace portable
namespace avx512_bf16 {  // AVX512-BF16 and VBMI
void gemv_rows_fp8_codes(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const QuantizedVector& x,
                         float* y, int64_t n_rows, int64_t k_len);
void gemv_rows_fp4_codes(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const QuantizedVector& x,
                         float* y, int64_t n_rows, int64_t k_len);
}  // namespace avx512_bf16

}  // namespace moekit::cpu

#include "moekit/cpu/block_scaled_gemm.h"

#include <algorithm>

#include "moekit/error.h"

namespace moekit::cpu {

BlockScaledWeights pack_block_scaled(const QuantizedMatrix& w, const std::vector<int64_t>& outputs, int64_t k_len) {
  MOEKIT_CHECK(!w.fp4, "pack_block_scaled: FP8 weights only");
  BlockScaledWeights p;
  p.n = static_cast<int64_t>(outputs.size());
  p.k = k_len;
  p.panels = (p.n + 31) / 32 * 2;
  p.blocks = (k_len + 127) / 128;
  p.codes.assign(static_cast<std::size_t>(p.blocks * p.panels * 32 * 64), 0);
  p.scales.assign(static_cast<std::size_t>(p.blocks * p.panels * 16), 0.0f);
  for (int64_t b = 0; b < p.blocks; ++b)
    for (int64_t panel = 0; panel < p.panels; ++panel)
      for (int r = 0; r < 16 && panel * 16 + r < p.n; ++r) {
        const int64_t row = outputs[static_cast<std::size_t>(panel * 16 + r)];
        const uint8_t* src = w.data + row * w.row_bytes;
        p.scales[static_cast<std::size_t>((b * p.panels + panel) * 16 + r)] = w.scale(row, b * 128);
        uint8_t* dst = p.codes.data() + (b * p.panels + panel) * 32 * 64;
        for (int piece = 0; piece < 32; ++piece)
          for (int j = 0; j < 4; ++j) {
            const int64_t k = b * 128 + piece * 4 + j;
            if (k < k_len) dst[piece * 64 + block_scaled_byte(r, j)] = src[k];
          }
      }
  return p;
}

// Per block, the float sum of code * code, then times the two scales: the AVX512-BF16 build's grouping.
void portable::block_scaled_gemm(const BlockScaledWeights& w, const bf16* a, int64_t lda, int64_t m,
                                 const float* a_scales, int64_t a_scale_ld, float* out, int64_t ldo) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t n = 0; n < w.n; ++n) {
      const int64_t panel = n / 16;
      const int row = static_cast<int>(n % 16);
      float acc = 0.0f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* codes = w.codes.data() + (b * w.panels + panel) * 32 * 64;
        float partial = 0.0f;
        for (int64_t k = b * 128; k < std::min(w.k, (b + 1) * 128); ++k) {
          const int piece = static_cast<int>(k % 128 / 4), j = static_cast<int>(k % 4);
          partial += to_float(a[r * lda + k]) * to_float(f8_e4m3{codes[piece * 64 + block_scaled_byte(row, j)]});
        }
        acc += partial *
               (a_scales[r * a_scale_ld + b] * w.scales[static_cast<std::size_t>((b * w.panels + panel) * 16 + row)]);
      }
      out[r * ldo + n] = acc;
    }
}

void block_scaled_gemm(const BlockScaledWeights& w, const bf16* a, int64_t lda, int64_t m, const float* a_scales,
                       int64_t a_scale_ld, float* out, int64_t ldo) {
  if (cpu_has_avx512_bf16())
    avx512_bf16::block_scaled_gemm(w, a, lda, m, a_scales, a_scale_ld, out, ldo);
  else
    portable::block_scaled_gemm(w, a, lda, m, a_scales, a_scale_ld, out, ldo);
}

}  // namespace moekit::cpu

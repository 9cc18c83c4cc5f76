// Products of activation codes and FP8 weight codes with 128 x 128 block scales (DESIGN §3), for grouped_mm
// on the CPU with FP8 weights and float scales: out[m, n] = sum over 128-wide blocks b of K of
// (sum over k in b of a[m, k] * code(n, k)) * a_scales[m, b] * w_scale(n, b), where a holds e4m3 values as
// bf16 (exact) and code(n, k) is the weight's e4m3 value. Every product is exact in float and each block's
// sum is scaled once, as the float64 reference groups it.
//
// The weights stay e4m3 bytes (half of a bf16 copy), packed once per list of output rows: per 128-wide block
// of K, per panel of 16 rows, 32 pieces of 64 bytes, each piece the 16 rows' codes at 4 consecutive k in the
// order that e4m3_to_bf16_avx512.h's conversion turns into two vectors of (row, k pair) bf16 pairs, the
// operands of vdpbf16ps. Block b's scales of the panel's 16 rows follow in a float array.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/cpu/quantized_gemv.h"
#include "moekit/dtype.h"

namespace moekit::cpu {

struct BlockScaledWeights {
  int64_t n = 0, k = 0;        // output rows and the depth they multiply
  int64_t panels = 0;          // of 16 rows, an even number (zero rows pad the last)
  int64_t blocks = 0;          // 128-wide blocks of k (zero codes pad the last)
  std::vector<uint8_t> codes;  // [blocks][panels][32][64]
  std::vector<float> scales;   // [blocks][panels][16]: row's weight scale of the block (0 for pad rows)
  std::size_t bytes() const { return codes.size() + scales.size() * sizeof(float); }
};

// Packs rows outputs[i] (i < n) of FP8 weights w over k in [0, k_len).
BlockScaledWeights pack_block_scaled(const QuantizedMatrix& w, const std::vector<int64_t>& outputs, int64_t k_len);

// Where weight (row r of a panel, k offset j < 4 of a piece) lies in its 64-byte piece.
constexpr int block_scaled_byte(int r, int j) {
  const int i = 2 * r + j % 2;  // bf16 position in its vector: (row, k parity) pairs
  return 16 * (i / 8) + 8 * (j / 2) + i % 8;
}

// out [m, w.n] (row stride ldo) = the block-scaled product of a [m, w.k] (bf16 codes, row stride lda) with w;
// a_scales[r * a_scale_ld + b] is row r's activation scale of block b. Runs on the calling thread.
// AVX512-BF16 + VBMI where the CPU has them, else a portable loop (per block the same grouping).
void block_scaled_gemm(const BlockScaledWeights& w, const bf16* a, int64_t lda, int64_t m, const float* a_scales,
                       int64_t a_scale_ld, float* out, int64_t ldo);

namespace portable {
void block_scaled_gemm(const BlockScaledWeights& w, const bf16* a, int64_t lda, int64_t m, const float* a_scales,
                       int64_t a_scale_ld, float* out, int64_t ldo);
}  // namespace portable
namespace avx512_bf16 {
void block_scaled_gemm(const BlockScaledWeights& w, const bf16* a, int64_t lda, int64_t m, const float* a_scales,
                       int64_t a_scale_ld, float* out, int64_t ldo);
}  // namespace avx512_bf16

}  // namespace moekit::cpu

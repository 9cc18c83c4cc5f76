// FP8 weights times quantised activations on AVX512-BF16 (+ VBMI): both sides stay codes. Every e4m3 value
// is exact in bf16 (3 mantissa bits of bf16's 7, exponents 2^-9..2^8 well inside bf16's normal range), and
// the product of two e4m3 values has at most 8 significant bits, so vdpbf16ps (bf16 pairs multiplied and
// added into float lanes) forms each product exactly; its flushing of bf16 subnormal inputs and float
// subnormal results never applies (inputs >= 2^-9, products >= 2^-18). Per 128-wide block the lanes sum
// code * code, then one multiply-add applies the weight block's scale times the activation group's scale.
// Against the float kernel (quantized_gemv_avx512.cpp) this reads 2 bytes of x per weight byte instead of
// 4, and converts 64 weight bytes with 5 instructions instead of 32 with 6.
//
// The conversion: vpermi2b looks up a 128-entry byte table with the low 7 bits of each code (the
// magnitude), once for the low and once for the high byte of the bf16 value; one vpternlogd puts the
// sign into the high byte, and two byte unpacks join the halves into 16-bit values. The unpacks work per
// 128-bit lane, so the 64 results come out permuted (lane j of the first vector holds elements
// 16j..16j+7, of the second 16j+8..16j+15); x goes through the same conversion, so it is permuted alike and
// the products pair up correctly.
#include <immintrin.h>

#include <array>
#include <bit>
#include <vector>

#include "moekit/cpu/avx512_lanes.h"
#include "moekit/cpu/quantized_gemv.h"

namespace moekit::cpu::avx512_bf16 {
namespace {

// The bf16 bits of the e4m3 value with magnitude code m (sign 0); 0x7f is NaN.
constexpr uint16_t e4m3_magnitude_to_bf16(unsigned m) {
  if (m == 0x7f) return 0x7fc0;
  const unsigned e = m >> 3, f = m & 7;
  if (e != 0) return static_cast<uint16_t>(((e + 120) << 7) | (f << 4));  // (1 + f/8) * 2^(e - 7)
  if (f == 0) return 0;
  // Subnormal f * 2^-9: normalised with its leading bit p as 2^(p - 9) * (1 + rest / 2^p).
  const unsigned p = f >= 4 ? 2 : f >= 2 ? 1 : 0;
  return static_cast<uint16_t>(((p + 118) << 7) | ((f - (1u << p)) << (7 - p)));
}

struct ByteTables {
  alignas(64) std::array<uint8_t, 128> low{}, high{};
};

constexpr ByteTables make_tables() {
  ByteTables t;
  for (unsigned m = 0; m < 128; ++m) {
    t.low[m] = static_cast<uint8_t>(e4m3_magnitude_to_bf16(m) & 0xff);
    t.high[m] = static_cast<uint8_t>(e4m3_magnitude_to_bf16(m) >> 8);
  }
  return t;
}
static_assert(e4m3_magnitude_to_bf16(0x08) == 0x3c80);  // 2^-6, the smallest normal
static_assert(e4m3_magnitude_to_bf16(0x07) == 0x3c60);  // 7 * 2^-9
static_assert(e4m3_magnitude_to_bf16(0x01) == 0x3b00);  // 2^-9
static_assert(e4m3_magnitude_to_bf16(0x7e) == 0x43e0);  // 448

constexpr ByteTables kTables = make_tables();

struct Converter {
  __m512i low_a, low_b, high_a, high_b, sign;
  Converter()
      : low_a(_mm512_load_si512(kTables.low.data())),
        low_b(_mm512_load_si512(kTables.low.data() + 64)),
        high_a(_mm512_load_si512(kTables.high.data())),
        high_b(_mm512_load_si512(kTables.high.data() + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}

  // 64 e4m3 codes -> 64 bf16 values in the permuted order described at the top.
  void operator()(__m512i codes, __m512bh& first, __m512bh& second) const {
    const __m512i low = _mm512_permutex2var_epi8(low_a, codes, low_b);
    __m512i high = _mm512_permutex2var_epi8(high_a, codes, high_b);
    high = _mm512_ternarylogic_epi32(high, codes, sign, 0xf8);  // high | (codes & 0x80)
    first = std::bit_cast<__m512bh>(_mm512_unpacklo_epi8(low, high));
    second = std::bit_cast<__m512bh>(_mm512_unpackhi_epi8(low, high));
  }
};

// 32 bf16 values from x.
inline __m512bh load32(const uint16_t* x) {
  return std::bit_cast<__m512bh>(_mm512_loadu_si512(x));
}

inline __mmask64 tail_mask64(int64_t remaining) {
  return remaining >= 64 ? ~__mmask64{0} : (__mmask64{1} << remaining) - 1;
}

// One row: x holds the activation codes as bf16 (bits), permuted per 64 as described at the top, zero past
// k_len up to a whole 64; scale[b] is the product of the two scales of block b.
float fp8_row(const Converter& convert, const uint8_t* r, const uint16_t* x, const float* scale, int64_t k_len) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t k0 = 0, b = 0;
  for (; k0 + 128 <= k_len; k0 += 128, ++b) {
    __m512bh w0, w1, w2, w3;
    convert(_mm512_loadu_si512(r + k0), w0, w1);
    convert(_mm512_loadu_si512(r + k0 + 64), w2, w3);
    const uint16_t* xb = x + k0;
    __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, load32(xb));
    __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w1, load32(xb + 32));
    p0 = _mm512_dpbf16_ps(p0, w2, load32(xb + 64));
    p1 = _mm512_dpbf16_ps(p1, w3, load32(xb + 96));
    const __m512 s = _mm512_set1_ps(scale[b]);
    acc0 = _mm512_fmadd_ps(p0, s, acc0);
    acc1 = _mm512_fmadd_ps(p1, s, acc1);
  }
  if (k0 < k_len) {  // the last, partial block: whole 64s of codes, zero past k_len on both sides
    __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
    for (int64_t k = k0; k < k_len; k += 64) {
      __m512bh w0, w1;
      convert(_mm512_maskz_loadu_epi8(tail_mask64(k_len - k), r + k), w0, w1);
      p0 = _mm512_dpbf16_ps(p0, w0, load32(x + k));
      p1 = _mm512_dpbf16_ps(p1, w1, load32(x + k + 32));
    }
    const __m512 s = _mm512_set1_ps(scale[b]);
    acc0 = _mm512_fmadd_ps(p0, s, acc0);
    acc1 = _mm512_fmadd_ps(p1, s, acc1);
  }
  return sum_lanes(_mm512_add_ps(acc0, acc1));
}

}  // namespace

void gemv_rows_fp8_codes(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const QuantizedVector& x,
                         float* y, int64_t n_rows, int64_t k_len) {
  const Converter convert;
  const int64_t chunks = (k_len + 63) / 64, blocks = (k_len + 127) / 128;
  thread_local std::vector<uint16_t> x_bf16;
  thread_local std::vector<float> scale;
  x_bf16.resize(static_cast<std::size_t>(64 * chunks));
  scale.resize(static_cast<std::size_t>(blocks));
  const auto* codes = reinterpret_cast<const uint8_t*>(x.codes);
  for (int64_t c = 0; c < chunks; ++c) {
    __m512bh first, second;
    convert(_mm512_maskz_loadu_epi8(tail_mask64(k_len - c * 64), codes + c * 64), first, second);
    _mm512_storeu_si512(x_bf16.data() + 64 * c, std::bit_cast<__m512i>(first));
    _mm512_storeu_si512(x_bf16.data() + 64 * c + 32, std::bit_cast<__m512i>(second));
  }
  int64_t scale_block = -1;  // the 128-row block whose scales are loaded
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t n = first_row + i * row_step;
    if (n / 128 != scale_block) {
      scale_block = n / 128;
      for (int64_t b = 0; b < blocks; ++b) scale[static_cast<std::size_t>(b)] = w.scale(n, b * 128) * x.scales[b];
    }
    y[i] = fp8_row(convert, w.data + n * w.row_bytes, x_bf16.data(), scale.data(), k_len);
  }
}

}  // namespace moekit::cpu::avx512_bf16

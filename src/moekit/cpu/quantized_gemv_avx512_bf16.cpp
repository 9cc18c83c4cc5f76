// Quantised weights times quantised activations on AVX512-BF16 (+ VBMI): both sides stay codes. FP8 first;
// FP4 (gemv_rows_fp4_codes, at the end) differs in its conversion and its scales, as described there. Every e4m3 value
// is exact in bf16 (3 mantissa bits of bf16's 7, exponents 2^-9..2^8 well inside bf16's normal range), and
// the product of two e4m3 values has at most 8 significant bits, so vdpbf16ps (bf16 pairs multiplied and
// added into float lanes) forms each product exactly; its flushing of bf16 subnormal inputs and float
// subnormal results never applies (inputs >= 2^-9, products >= 2^-18). Per 128-wide block the lanes sum
// code * code, then one multiply-add applies the weight block's scale times the activation group's scale.
// Against the float kernel (quantized_gemv_avx512.cpp) this reads 2 bytes of x per weight byte instead of
// 4, and converts 64 weight bytes with 5 instructions instead of 32 with 6.
//
// The conversion (e4m3_to_bf16_avx512.h) returns 64 values permuted per 128-bit lane; x goes through the
// same conversion, so it is permuted alike and the products pair up correctly.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <vector>

#include "moekit/cpu/avx512_lanes.h"
#include "moekit/cpu/e4m3_to_bf16_avx512.h"
#include "moekit/cpu/quantized_gemv.h"

namespace moekit::cpu::avx512_bf16 {
namespace {

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

// FP4 weights: e2m1 values (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) are exact in bf16, and e2m1 times e4m3 has at most
// 6 significant bits, so vdpbf16ps forms each product exactly here too (products >= 2^-10: no flushing). A
// 16-entry table fits one vpshufb, so a nibble becomes a bf16 value with two shuffles (its low and high byte)
// and one unpack. A 64-byte load holds 128 values, one activation group and four weight scale blocks of 32.
// Low nibbles (values 2i) and high nibbles (2i + 1) convert apart, and the unpacks work per 128-bit lane, so
// 128-bit lane j of all four converted vectors holds values of block j only: lane j of the first holds values
// 32j + 2t (t = 0..7), of the second 32j + 16 + 2t, of the third and fourth the same plus one. x is laid out
// in that order (fp4_x_position), the four products accumulate in one vector, and one multiply-add applies
// a vector whose lane j is block j's scale times the group's activation scale.

// The bf16 bits of e2m1 code c (sign in bit 3).
constexpr uint16_t e2m1_to_bf16(unsigned c) {
  constexpr uint16_t kMagnitude[8] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0};
  return static_cast<uint16_t>(kMagnitude[c & 7] | ((c & 8) ? 0x8000 : 0));
}
static_assert(e2m1_to_bf16(0x1) == 0x3f00 && e2m1_to_bf16(0x7) == 0x40c0 && e2m1_to_bf16(0xd) == 0xc040);

// Where value k of a row goes in the converted order: within its group of 128, lane j = block (k % 128) / 32,
// vector v = ((k % 32) % 2) * 2 + (k % 32) / 16, slot t = (k % 16) / 2.
constexpr int64_t fp4_x_position(int64_t k) {
  const int64_t r = k % 32;
  return k - k % 128 + ((r % 2) * 2 + r / 16) * 32 + (k % 128) / 32 * 8 + (r % 16) / 2;
}
static_assert(fp4_x_position(0) == 0 && fp4_x_position(2) == 1 && fp4_x_position(32) == 8 && fp4_x_position(16) == 32 &&
              fp4_x_position(1) == 64 && fp4_x_position(17) == 96 && fp4_x_position(127) == 127 &&
              fp4_x_position(128) == 128);

// The activation codes of a group of 128 in fp4_x_position order, as vpermi2b indices into the group's 128
// bytes: the e4m3 conversion (Converter) puts bytes 16j..16j+7 of its input into 128-bit lane j of its first
// result and bytes 16j+8..16j+15 into its second, so input byte 16j + t of the h-th call takes the code of
// vector 2h, slot t, and byte 16j + 8 + t that of vector 2h + 1.
struct Fp4XOrder {
  alignas(64) std::array<uint8_t, 64> index[2]{};
};
constexpr Fp4XOrder make_fp4_x_order() {
  Fp4XOrder o;
  for (int64_t k = 0; k < 128; ++k) {
    const int64_t at = fp4_x_position(k), v = at / 32, j = at % 32 / 8, t = at % 8;
    o.index[v / 2][static_cast<std::size_t>(16 * j + 8 * (v % 2) + t)] = static_cast<uint8_t>(k);
  }
  return o;
}
constexpr Fp4XOrder kFp4XOrder = make_fp4_x_order();

struct Fp4Tables {
  __m512i low, high, nibble;
  Fp4Tables() {
    alignas(16) uint8_t lo[16], hi[16];
    for (unsigned c = 0; c < 16; ++c)
      lo[c] = e2m1_to_bf16(c) & 0xff, hi[c] = static_cast<uint8_t>(e2m1_to_bf16(c) >> 8);
    low = _mm512_maskz_broadcast_i32x4(static_cast<__mmask16>(0xffff),
                                       _mm_load_si128(reinterpret_cast<const __m128i*>(lo)));
    high = _mm512_maskz_broadcast_i32x4(static_cast<__mmask16>(0xffff),
                                        _mm_load_si128(reinterpret_cast<const __m128i*>(hi)));
    nibble = _mm512_set1_epi8(0x0f);
  }
};

// Four ue8m0 codes (the first count of them read, the rest taken as 0), valued as to_float(ue8m0) does (0 is
// 2^-127, 0xff NaN) and multiplied by s: code j's in every float of 128-bit lane j.
inline __m512 block_scales(const uint8_t* codes, int count, float s) {
  const __m128i c = _mm_cvtepu8_epi32(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << count) - 1), codes));
  __m128i bits = _mm_slli_epi32(c, 23);
  bits = _mm_mask_mov_epi32(bits, _mm_cmpeq_epi32_mask(c, _mm_setzero_si128()), _mm_set1_epi32(0x00400000));
  bits = _mm_mask_mov_epi32(bits, _mm_cmpeq_epi32_mask(c, _mm_set1_epi32(0xff)), _mm_set1_epi32(0x7fc00000));
  const __m128 v = _mm_mul_ps(_mm_castsi128_ps(bits), _mm_set1_ps(s));
  return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                               _mm512_zextps128_ps512(v));
}

// One FP4 row: r its packed codes, scales its ue8m0 codes (one per 32), x the activation codes as bf16 in
// fp4_x_position order (zero past k_len up to a whole 128), x_scales one per 128.
float fp4_row(const Fp4Tables& t, const uint8_t* r, const uint8_t* scales, const uint16_t* x, const float* x_scales,
              int64_t k_len) {
  __m512 acc = _mm512_setzero_ps();
  const int64_t scale_count = (k_len + 31) / 32;
  for (int64_t k0 = 0, g = 0; k0 < k_len; k0 += 128, ++g) {
    const __m512i bytes = _mm512_maskz_loadu_epi8(tail_mask64((k_len - k0) / 2), r + k0 / 2);
    const __m512i lo = _mm512_and_si512(bytes, t.nibble);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), t.nibble);
    const __m512i lo_low = _mm512_shuffle_epi8(t.low, lo), lo_high = _mm512_shuffle_epi8(t.high, lo);
    const __m512i hi_low = _mm512_shuffle_epi8(t.low, hi), hi_high = _mm512_shuffle_epi8(t.high, hi);
    const uint16_t* xg = x + k0;
    __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), std::bit_cast<__m512bh>(_mm512_unpacklo_epi8(lo_low, lo_high)),
                                load32(xg));
    p = _mm512_dpbf16_ps(p, std::bit_cast<__m512bh>(_mm512_unpackhi_epi8(lo_low, lo_high)), load32(xg + 32));
    p = _mm512_dpbf16_ps(p, std::bit_cast<__m512bh>(_mm512_unpacklo_epi8(hi_low, hi_high)), load32(xg + 64));
    p = _mm512_dpbf16_ps(p, std::bit_cast<__m512bh>(_mm512_unpackhi_epi8(hi_low, hi_high)), load32(xg + 96));
    const int count = static_cast<int>(std::min<int64_t>(4, scale_count - 4 * g));
    acc = _mm512_fmadd_ps(p, block_scales(scales + 4 * g, count, x_scales[g]), acc);
  }
  return sum_lanes(acc);
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

void gemv_rows_fp4_codes(const QuantizedMatrix& w, int64_t first_row, int64_t row_step, const QuantizedVector& x,
                         float* y, int64_t n_rows, int64_t k_len) {
  const Fp4Tables tables;
  const Converter convert;
  const __m512i order0 = _mm512_load_si512(kFp4XOrder.index[0].data());
  const __m512i order1 = _mm512_load_si512(kFp4XOrder.index[1].data());
  const int64_t groups = (k_len + 127) / 128;
  thread_local std::vector<uint16_t> x_bf16;
  x_bf16.resize(static_cast<std::size_t>(128 * groups));
  const auto* codes = reinterpret_cast<const uint8_t*>(x.codes);
  for (int64_t g = 0; g < groups; ++g) {  // codes past k_len read as 0, which converts to 0
    const int64_t k0 = 128 * g;
    const __m512i a = _mm512_maskz_loadu_epi8(tail_mask64(k_len - k0), codes + k0);
    const __m512i b = _mm512_maskz_loadu_epi8(tail_mask64(std::max<int64_t>(0, k_len - k0 - 64)), codes + k0 + 64);
    __m512bh v[4];
    convert(_mm512_permutex2var_epi8(a, order0, b), v[0], v[1]);
    convert(_mm512_permutex2var_epi8(a, order1, b), v[2], v[3]);
    for (int i = 0; i < 4; ++i) _mm512_storeu_si512(x_bf16.data() + k0 + 32 * i, std::bit_cast<__m512i>(v[i]));
  }
  const auto* scales = static_cast<const uint8_t*>(w.scales);  // FP4 scales are ue8m0
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t n = first_row + i * row_step;
    y[i] = fp4_row(tables, w.data + n * w.row_bytes, scales + n * w.scale_ld, x_bf16.data(), x.scales, k_len);
  }
}

}  // namespace moekit::cpu::avx512_bf16

// e4m3 codes to bf16 on AVX-512 VBMI, for the files compiled for AVX512-BF16 (include only from those).
//
// vpermi2b looks up a 128-entry byte table with the low 7 bits of each code (the magnitude), once for the
// low and once for the high byte of the bf16 value; one vpternlogd puts the sign into the high byte, and
// two byte unpacks join the halves into 16-bit values. The unpacks work per 128-bit lane, so the 64
// results come out permuted: lane j of the first vector holds elements 16j..16j+7, of the second
// 16j+8..16j+15. Every e4m3 value is exact in bf16.
#pragma once

#include <immintrin.h>

#include <array>
#include <bit>
#include <cstdint>

namespace moekit::cpu::avx512_bf16 {

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

inline constexpr ByteTables kTables = make_tables();

// 64 e4m3 codes -> 64 bf16 values in the permuted order described at the top.
struct Converter {
  __m512i low_a, low_b, high_a, high_b, sign;
  Converter()
      : low_a(_mm512_load_si512(kTables.low.data())),
        low_b(_mm512_load_si512(kTables.low.data() + 64)),
        high_a(_mm512_load_si512(kTables.high.data())),
        high_b(_mm512_load_si512(kTables.high.data() + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}

  void operator()(__m512i codes, __m512bh& first, __m512bh& second) const {
    const __m512i low = _mm512_permutex2var_epi8(low_a, codes, low_b);
    __m512i high = _mm512_permutex2var_epi8(high_a, codes, high_b);
    high = _mm512_ternarylogic_epi32(high, codes, sign, 0xf8);  // high | (codes & 0x80)
    first = std::bit_cast<__m512bh>(_mm512_unpacklo_epi8(low, high));
    second = std::bit_cast<__m512bh>(_mm512_unpackhi_epi8(low, high));
  }
};

}  // namespace moekit::cpu::avx512_bf16

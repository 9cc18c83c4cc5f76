// The quantised formats of DESIGN §3: the element conversions (f8_e4m3, e2m1, ue8m0), checked against a
// brute-force search over every code decoded from the format's definition, and the tensor functions of
// include/moekit/quantization.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "harness.h"
#include "moekit/cpu/activation_quantization.h"
#include "moekit/cpu/block_scaled_gemm.h"
#include "moekit/cpu/gemv.h"
#include "moekit/cpu/quantized_gemv.h"
#include "moekit/dtype.h"
#include "moekit/quantization.h"
#include "moekit/tensor.h"
#include "moekit/testing/random_problem.h"

namespace moekit {
namespace {

using test::throws_error_with;

// e4m3 from its definition (OCP FP8, the "fn" variant): bias 7, subnormals m/8 * 2^-6, S.1111.111 is NaN.
double e4m3_definition(uint8_t code) {
  const int sign = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -magnitude : magnitude;
}

double e2m1_definition(uint8_t code) {
  const int sign = (code >> 3) & 1, e = (code >> 1) & 3, m = code & 1;
  const double magnitude = e == 0 ? m * 0.5 : std::ldexp(1.0 + m / 2.0, e - 1);
  return sign ? -magnitude : magnitude;
}

// The code nearest to v among the finite codes whose value() is given, ties to the code with an even last
// bit, saturating at the largest magnitude: what "round to nearest even, saturating" means.
template <typename Value>
int nearest_code(double v, int codes, Value value) {
  double max = 0;
  for (int c = 0; c < codes; ++c) max = std::max(max, std::fabs(value(static_cast<uint8_t>(c))));  // NaN skipped
  v = std::clamp(v, -max, max);  // saturation: beyond the largest magnitude, that magnitude
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < codes; ++c) {
    const double x = value(static_cast<uint8_t>(c));
    if (std::isnan(x) || std::signbit(x) != std::signbit(v)) continue;
    const double d = std::fabs(x - v);
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return best;
}

// Finite floats spread over the formats' ranges, plus every midpoint between neighbouring values.
template <typename Value>
std::vector<float> probe_values(int codes, Value value, double max) {
  std::vector<float> v;
  std::vector<double> magnitudes;
  for (int c = 0; c < codes; ++c) {
    const double x = value(static_cast<uint8_t>(c));
    if (!std::isnan(x) && x >= 0) magnitudes.push_back(x);
  }
  std::sort(magnitudes.begin(), magnitudes.end());
  for (std::size_t i = 0; i + 1 < magnitudes.size(); ++i) {
    const double mid = 0.5 * (magnitudes[i] + magnitudes[i + 1]);
    for (double x : {magnitudes[i], mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e9)}) {
      v.push_back(static_cast<float>(x));
      v.push_back(-static_cast<float>(x));
    }
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> log_mag(std::log2(max) - 20, std::log2(max) + 2);
  for (int i = 0; i < 20000; ++i) {
    const auto x = static_cast<float>(std::exp2(log_mag(rng)));
    v.push_back(i % 2 ? x : -x);
  }
  for (float x : {0.0f, -0.0f, static_cast<float>(max), static_cast<float>(max) * 1.04f, 1e30f, -1e30f}) v.push_back(x);
  return v;
}

TEST(F8E4M3, DecodesEveryCodeAsTheFormatDefinesIt) {
  for (int c = 0; c < 256; ++c) {
    const double expected = e4m3_definition(static_cast<uint8_t>(c));
    const float got = to_float(f8_e4m3{static_cast<uint8_t>(c)});
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(got, expected) << "code " << c;
      EXPECT_EQ(std::signbit(got), c >= 128) << "code " << c;
    }
  }
  EXPECT_EQ(to_float(f8_e4m3{0x7e}), 448.0f);
  EXPECT_EQ(to_float(f8_e4m3{0x01}), 0x1p-9f);
}

TEST(F8E4M3, RoundsToNearestEvenAndSaturates) {
  for (float v : probe_values(256, e4m3_definition, 448)) {
    const int expected = nearest_code(v, 256, e4m3_definition);
    EXPECT_EQ(from_float<f8_e4m3>(v).bits, expected) << "v = " << v;
  }
  EXPECT_EQ(from_float<f8_e4m3>(std::numeric_limits<float>::infinity()).bits, 0x7e);
  EXPECT_EQ(from_float<f8_e4m3>(-std::numeric_limits<float>::infinity()).bits, 0xfe);
  EXPECT_TRUE(std::isnan(to_float(from_float<f8_e4m3>(std::numeric_limits<float>::quiet_NaN()))));
  // Every finite code survives a round trip.
  for (int c = 0; c < 256; ++c) {
    const float x = to_float(f8_e4m3{static_cast<uint8_t>(c)});
    if (!std::isnan(x)) {
      EXPECT_EQ(from_float<f8_e4m3>(x).bits, c) << "code " << c;
    }
  }
}

// The branch-free rounding that the activation loop uses agrees with the code path on every float sign,
// exponent and the mantissas that matter: all 2^32 bit patterns would take too long, so every exponent with
// mantissas near each rounding boundary and a random sample.
TEST(F8E4M3, BranchFreeRoundingMatchesTheConversion) {
  std::mt19937 rng(17);
  auto check = [](uint32_t bits) {
    const float v = std::bit_cast<float>(bits);
    const float expected = to_float(from_float<f8_e4m3>(v));
    const float got = round_to_e4m3_value(v);
    if (std::isnan(expected)) return std::isnan(got);
    return std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(expected);
  };
  for (uint32_t sign : {0u, 0x80000000u})
    for (uint32_t e = 0; e < 256; ++e)
      for (uint32_t m : {0u, 1u, 0x7ffffu, 0x80000u, 0x80001u, 0xfffffu, 0x100000u, 0x17ffffu, 0x180000u, 0x180001u,
                         0x400000u, 0x7fffffu, 0x7ffff0u, 0x3fffffu}) {
        const uint32_t bits = sign | (e << 23) | m;
        ASSERT_TRUE(check(bits)) << "bits " << std::hex << bits << " = " << std::bit_cast<float>(bits);
      }
  for (int i = 0; i < 2000000; ++i) {
    const auto bits = static_cast<uint32_t>(rng());
    ASSERT_TRUE(check(bits)) << "bits " << std::hex << bits << " = " << std::bit_cast<float>(bits);
  }
  // The subnormal range, where the rounding step is 2^-9, densely.
  for (uint32_t bits = 0x3a000000u; bits < 0x3c900000u; bits += 97) ASSERT_TRUE(check(bits)) << std::hex << bits;
}

TEST(E2M1, DecodesAndRoundsToNearestEven) {
  for (int c = 0; c < 16; ++c)
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(c)), e2m1_definition(static_cast<uint8_t>(c)));
  for (float v : probe_values(16, e2m1_definition, 6)) {
    EXPECT_EQ(e2m1_from_float(v), nearest_code(v, 16, e2m1_definition)) << "v = " << v;
  }
  EXPECT_EQ(e2m1_from_float(std::numeric_limits<float>::infinity()), 7);
  EXPECT_EQ(e2m1_from_float(-std::numeric_limits<float>::infinity()), 15);
  EXPECT_EQ(e2m1_from_float(std::numeric_limits<float>::quiet_NaN()), 0) << "documented: NaN has no e2m1 code";
}

TEST(UE8M0, DecodesAndRoundsToTheNearestPowerOfTwo) {
  for (int c = 1; c < 255; ++c) EXPECT_EQ(to_float(ue8m0{static_cast<uint8_t>(c)}), std::ldexp(1.0, c - 127)) << c;
  EXPECT_EQ(to_float(ue8m0{0}), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(to_float(ue8m0{255})));
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> log_mag(-120, 120);
  for (int i = 0; i < 20000; ++i) {
    const auto v = static_cast<float>(std::exp2(log_mag(rng)));
    // Nearest on the linear scale: between 2^e and 2^(e+1) the midpoint is 1.5 * 2^e; ties go up.
    const int e = std::ilogb(v);
    const int expected = v >= 1.5f * std::ldexp(1.0f, e) ? e + 1 : e;
    EXPECT_EQ(from_float<ue8m0>(v).bits, expected + 127) << "v = " << v;
    EXPECT_EQ(from_float<ue8m0>(-v).bits, expected + 127) << "the sign is ignored, v = " << -v;
  }
  EXPECT_EQ(from_float<ue8m0>(1.5f).bits, 128);
  EXPECT_EQ(from_float<ue8m0>(std::nextafter(1.5f, 0.0f)).bits, 127);
  EXPECT_EQ(from_float<ue8m0>(0.0f).bits, 0);
  EXPECT_EQ(from_float<ue8m0>(1e38f * 3).bits, 254) << "saturates at 2^127";
  EXPECT_EQ(from_float<ue8m0>(std::numeric_limits<float>::infinity()).bits, 255);
  EXPECT_EQ(from_float<ue8m0>(std::numeric_limits<float>::quiet_NaN()).bits, 255);
}

TEST(QuantizedDTypes, PackingSizesAndConversions) {
  EXPECT_EQ(dtype_values_per_element(DType::f4_e2m1), 2);
  EXPECT_EQ(dtype_values_per_element(DType::f8_e4m3), 1);
  EXPECT_EQ(Tensor::empty({3, 8}, DType::f4_e2m1).nbytes(), 24u) << "one byte per packed pair";
  // f8_e4m3 and ue8m0 tensors convert element-wise, both ways.
  const Tensor t = test::tensor_of({1.0f, -3.3f, 500.0f, 0.001f}, {4});
  const std::vector<float> e4m3 = test::values_of(t.to(DType::f8_e4m3));
  EXPECT_EQ(e4m3, std::vector<float>({1.0f, -3.25f, 448.0f, 0x1p-9f}));  // 0.001 is past 2^-10, half the step
  const std::vector<float> scales = test::values_of(t.to(DType::ue8m0));
  EXPECT_EQ(scales, std::vector<float>({1.0f, 4.0f, 512.0f, 0x1p-10f}));
  // Packed pairs have no element-wise value.
  EXPECT_TRUE(
      throws_error_with([] { Tensor::zeros({2}, DType::f4_e2m1).to(DType::f32); }, {"packed f4_e2m1", "got f4_e2m1"}));
  EXPECT_TRUE(throws_error_with([&] { t.to(DType::f4_e2m1); }, {"to convert to", "got f4_e2m1"}));
}

TEST(QuantizedDTypes, VisitorsNarrowToOneKind) {
  EXPECT_EQ(visit_scale_dtype(DType::ue8m0, [](auto tag) { return dtype_of<typename decltype(tag)::type>(); }),
            DType::ue8m0);
  EXPECT_TRUE(throws_error_with([] { visit_scale_dtype(DType::bf16, [](auto) {}); }, {"scale dtype", "bf16"}));
  EXPECT_TRUE(throws_error_with([] { visit_float_dtype(DType::f8_e4m3, [](auto) {}); }, {"floating dtype", "f8_e4m3"}));
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8, DType::f8_e4m3,
                  DType::f4_e2m1, DType::ue8m0})
    EXPECT_EQ(visit_dtype(d, [](auto tag) { return dtype_of<typename decltype(tag)::type>(); }), d);
}

// ---------------------------------------------------------------------------------------------------------
// Weights

// W [E, N, K] f32 with values spread over several orders of magnitude, a zero block and a few exact zeros.
Tensor spread_weights(int64_t E, int64_t N, int64_t K, uint64_t seed) {
  Tensor w = Tensor::empty({E, N, K}, DType::f32);
  std::mt19937 rng(static_cast<unsigned>(seed));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> octave(-12, 2);
  float* p = w.data_as<float>();
  for (int64_t i = 0; i < w.numel(); ++i) p[i] = u(rng) * std::ldexp(1.0f, octave(rng));
  for (int64_t n = 0; n < std::min<int64_t>(N, 40); ++n)  // expert 0's first 32-wide K block is all zero
    for (int64_t k = 0; k < std::min<int64_t>(K, 32); ++k) p[n * K + k] = 0;
  return w;
}

double amax_of(const Tensor& w, int64_t e, int64_t n0, int64_t n1, int64_t k0, int64_t k1) {
  const int64_t N = w.size(1), K = w.size(2);
  double m = 0;
  for (int64_t n = n0; n < std::min(n1, N); ++n)
    for (int64_t k = k0; k < std::min(k1, K); ++k)
      m = std::max(m, std::fabs(double(w.data_as<float>()[(e * N + n) * K + k])));
  return m;
}

// The scale must be amax / 448 (f32) or the smallest power of two at or above it (ue8m0), 1 for a zero
// block; every dequantised weight within half a step of e4m3 at its magnitude (or of the subnormal step).
TEST(QuantizeWeights, Fp8BlocksCoverPartialEdgesWithinHalfAStep) {
  const int64_t E = 2, N = 130, K = 200;  // partial blocks in both N and K
  const Tensor w = spread_weights(E, N, K, 1);
  for (DType scale_dtype : {DType::f32, DType::ue8m0}) {
    SCOPED_TRACE(dtype_name(scale_dtype));
    const QuantizedWeights q = quantize_weights(w, WeightFormat::fp8_e4m3, scale_dtype);
    EXPECT_EQ(q.weights.dtype(), DType::f8_e4m3);
    EXPECT_EQ(q.weights.shape(), Shape({E, N, K}));
    EXPECT_EQ(q.scale_inv.shape(), Shape({E, 2, 2}));
    EXPECT_EQ(q.scale_inv.dtype(), scale_dtype);
    const std::vector<float> scales = test::values_of(q.scale_inv);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t nb = 0; nb < 2; ++nb)
        for (int64_t kb = 0; kb < 2; ++kb) {
          const double amax = amax_of(w, e, nb * 128, nb * 128 + 128, kb * 128, kb * 128 + 128);
          const double s = scales[static_cast<std::size_t>((e * 2 + nb) * 2 + kb)];
          if (scale_dtype == DType::f32) {
            EXPECT_NEAR(s, amax / 448, amax / 448 * 1e-6) << e << nb << kb;
          } else {
            EXPECT_EQ(std::exp2(std::round(std::log2(s))), s) << "a power of two";
            EXPECT_GE(s, amax / 448);
            EXPECT_LT(s, 2 * amax / 448);
          }
        }
    const Tensor back = dequantize_weights(q.weights, q.scale_inv);
    EXPECT_EQ(back.shape(), Shape({E, N, K}));
    const float* a = w.data_as<float>();
    const float* b = back.data_as<float>();
    for (int64_t i = 0; i < w.numel(); ++i) {
      const int64_t e = i / (N * K), n = i / K % N, k = i % K;
      const double s = scales[static_cast<std::size_t>((e * 2 + n / 128) * 2 + k / 128)];
      // e4m3 has 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 * s the step is 2^-9 * s.
      const double bound = std::max(std::fabs(a[i]) * 0x1p-4, s * 0x1p-10) * (1 + 1e-6);
      ASSERT_LE(std::fabs(double(b[i]) - a[i]), bound) << "w[" << e << ", " << n << ", " << k << "] = " << a[i];
    }
  }
}

TEST(QuantizeWeights, Fp4PerRowBlocksOf32WithinHalfAStep) {
  const int64_t E = 2, N = 5, K = 70;  // a partial 32-block at the end of each row
  const Tensor w = spread_weights(E, N, K, 2);
  const QuantizedWeights q = quantize_weights(w, WeightFormat::fp4_e2m1, DType::ue8m0);
  EXPECT_EQ(q.weights.dtype(), DType::f4_e2m1);
  EXPECT_EQ(q.weights.shape(), Shape({E, N, K / 2}));
  EXPECT_EQ(q.scale_inv.shape(), Shape({E, N, 3}));
  const std::vector<float> scales = test::values_of(q.scale_inv);
  const Tensor back = dequantize_weights(q.weights, q.scale_inv, DType::f32);
  const float* a = w.data_as<float>();
  const float* b = back.data_as<float>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t kb = 0; kb < 3; ++kb) {
        const double amax = amax_of(w, e, n, n + 1, kb * 32, kb * 32 + 32);
        const double s = scales[static_cast<std::size_t>((e * N + n) * 3 + kb)];
        if (amax == 0) {
          EXPECT_EQ(s, 1.0);
        } else {
          EXPECT_GE(s, amax / 6);
          EXPECT_LT(s, 2 * amax / 6);
        }
        for (int64_t k = kb * 32; k < std::min<int64_t>(K, kb * 32 + 32); ++k) {
          const int64_t i = (e * N + n) * K + k;
          const double v = std::fabs(a[i]) / s;
          const double half_step = v < 2 ? 0.25 : v < 4 ? 0.5 : 1.0;  // e2m1 steps: 0.5 below 2, 1 below 4, 2 above
          ASSERT_LE(std::fabs(double(b[i]) - a[i]), half_step * s * (1 + 1e-6)) << e << " " << n << " " << k;
        }
      }
}

// The packing convention, from hand-made bytes: element 2j in the low nibble.
TEST(QuantizeWeights, Fp4PackingLowNibbleFirst) {
  Tensor q = Tensor::empty({1, 1, 16}, DType::f4_e2m1);  // K = 32
  for (int j = 0; j < 16; ++j) q.data_as<f4_e2m1x2>()[j] = f4_e2m1x2{static_cast<uint8_t>(j == 0 ? 0x72 : 0x00)};
  Tensor s = Tensor::empty({1, 1, 1}, DType::ue8m0);
  s.data_as<ue8m0>()[0] = ue8m0{128};  // 2
  const std::vector<float> w = test::values_of(dequantize_weights(q, s));
  ASSERT_EQ(w.size(), 32u);
  EXPECT_EQ(w[0], 2.0f);   // low nibble 2: 1.0 * 2
  EXPECT_EQ(w[1], 12.0f);  // high nibble 7: 6.0 * 2
  EXPECT_EQ(w[2], 0.0f);
  // And quantising puts them back where they were.
  const QuantizedWeights again = quantize_weights(test::tensor_of(w, {1, 1, 32}), WeightFormat::fp4_e2m1, DType::ue8m0);
  EXPECT_EQ(again.weights.data_as<f4_e2m1x2>()[0].bits, 0x72);
  EXPECT_EQ(to_float(again.scale_inv.data_as<ue8m0>()[0]), 2.0f);
}

TEST(QuantizeWeights, BadInputIsNamed) {
  Tensor w = test::tensor_of(std::vector<float>(2 * 3 * 4, 0.5f), {2, 3, 4});
  w.data_as<float>()[(1 * 3 + 2) * 4 + 1] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(
      throws_error_with([&] { quantize_weights(w, WeightFormat::fp8_e4m3); }, {"weight [1, 2, 1]", "not finite"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        quantize_weights(Tensor::zeros({1, 2, 3}, DType::f32), WeightFormat::fp4_e2m1, DType::ue8m0);
      },
      {"K must be even"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        quantize_weights(Tensor::zeros({1, 2, 4}, DType::f32), WeightFormat::fp4_e2m1);
      },
      {"FP4 e2m1 weights take ue8m0 scales"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        quantize_weights(Tensor::zeros({2, 4}, DType::f32), WeightFormat::fp8_e4m3);
      },
      {"[E, N, K]"}));
  const QuantizedWeights q = quantize_weights(Tensor::zeros({1, 2, 4}, DType::f32), WeightFormat::fp8_e4m3);
  EXPECT_TRUE(throws_error_with(
      [&] {
        dequantize_weights(q.weights, Tensor::zeros({1, 2, 1}, DType::f32));
      },
      {"scale_inv of f8_e4m3[1, 2, 4]", "[1, 1, 1]", "f32[1, 2, 1]"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        dequantize_weights(q.weights, Tensor::zeros({1, 1, 1}, DType::bf16));
      },
      {"f32 or ue8m0", "bf16"}));
}

// ---------------------------------------------------------------------------------------------------------
// Activations

TEST(QuantizeActivations, PerGroupOf128FromAmax) {
  const int64_t n = 300;  // groups of 128, 128 and 44
  std::vector<float> x(n);
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (auto& v : x) v = u(rng);
  for (int64_t i = 128; i < 256; ++i) x[static_cast<std::size_t>(i)] = 0;  // an all-zero group
  x[1] = 1e-5f;                                                            // e4m3 subnormals once scaled
  x[2] = -3e-5f;
  x[3] = -0.0f;
  for (bool pow2 : {false, true}) {
    SCOPED_TRACE(pow2 ? "power-of-two scales" : "f32 scales");
    std::vector<float> out(n), scales(3);
    std::vector<f8_e4m3> codes(n);
    quantize_activations(x.data(), n, pow2, out.data(), codes.data(), scales.data());
    for (int g = 0; g < 3; ++g) {
      float amax = 0;
      for (int64_t i = g * 128; i < std::min<int64_t>(n, g * 128 + 128); ++i) amax = std::max(amax, std::fabs(x[i]));
      const float s = scales[static_cast<std::size_t>(g)];
      if (amax == 0)
        EXPECT_EQ(s, 1.0f);
      else if (pow2)
        EXPECT_EQ(s, std::exp2(std::ceil(std::log2(amax / 448.0f))));
      else
        EXPECT_EQ(s, amax / 448.0f);
      for (int64_t i = g * 128; i < std::min<int64_t>(n, g * 128 + 128); ++i) {
        const auto k = static_cast<std::size_t>(i);
        EXPECT_EQ(out[k], to_float(codes[k]) * s);
        EXPECT_EQ(codes[k].bits, from_float<f8_e4m3>(x[k] / s).bits) << i;
        EXPECT_LE(std::fabs(out[k] - x[k]), std::max(std::fabs(x[k]) * 0x1p-4f, s * 0x1p-10f) * 1.000001f) << i;
      }
    }
    // In place gives the same values.
    std::vector<float> same = x;
    quantize_activations(same.data(), n, pow2, same.data());
    EXPECT_EQ(same, out);
  }
  // A NaN stays visible, in the values and in the codes.
  x[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out(n), scales(3);
  std::vector<f8_e4m3> codes(n);
  quantize_activations(x.data(), n, false, out.data(), codes.data(), scales.data());
  EXPECT_TRUE(std::isnan(out[5]));
  EXPECT_TRUE(std::isnan(to_float(codes[5])));
}

// quantize_activations' AVX-512 group steps (what it runs where the CPU has AVX-512) against the portable
// definitions, bit for bit: the group's largest magnitude (NaN ignored), and per value the rounded value
// times the scale and the e4m3 code (from_float), over values around every e4m3 boundary and tie (at several
// scales), zeros of both signs, float subnormals, the saturation region, infinities and NaN, in groups of
// 1..128 values with partial 16-lane tails, in place as well.
TEST(ActivationQuantizationAvx512, BitForBitAsThePortableSteps) {
  if (!cpu::gemv_uses_avx512()) GTEST_SKIP() << "this CPU has no AVX-512: quantize_activations runs the portable loop";
  std::mt19937 rng(24);
  std::vector<float> pool = {0.0f,
                             -0.0f,
                             0x1p-149f,
                             -0x1p-130f,
                             448.0f,
                             464.0f,
                             -480.0f,
                             1e30f,
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN()};
  for (int c = 0; c < 127; ++c) {  // every finite magnitude, the midpoints to the next, and a hair either side
    const auto v = static_cast<float>(e4m3_definition(static_cast<uint8_t>(c)));
    const auto next = static_cast<float>(e4m3_definition(static_cast<uint8_t>(c + 1)));
    const float mid = c < 126 ? (v + next) / 2 : v;
    for (float t : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)})
      pool.push_back(t), pool.push_back(-t);
  }
  std::uniform_real_distribution<float> exponent(-40.0f, 20.0f);
  for (int i = 0; i < 2000; ++i) pool.push_back((rng() % 2 ? 1.0f : -1.0f) * std::exp2(exponent(rng)));
  const auto bits = [](float f) { return std::bit_cast<uint32_t>(f); };
  for (float scale : {1.0f, 0.375f, 0x1p-8f, 3.1e5f, 1.7e-3f})
    for (int64_t n : {1, 5, 16, 17, 100, 128}) {
      SCOPED_TRACE(testing::Message() << "scale " << scale << ", n " << n);
      for (int trial = 0; trial < 40; ++trial) {
        std::vector<float> x(static_cast<std::size_t>(n));
        for (auto& v : x) v = pool[rng() % pool.size()] * (rng() % 4 == 0 ? 1.0f : scale);
        float amax = 0;
        for (float v : x) amax = std::max(amax, std::fabs(v));
        ASSERT_EQ(bits(cpu::avx512::group_amax(x.data(), n)), bits(amax));
        std::vector<float> dequantized(x.size()), in_place = x;
        std::vector<f8_e4m3> codes(x.size());
        cpu::avx512::quantize_group(x.data(), n, scale, dequantized.data(), codes.data());
        cpu::avx512::quantize_group(in_place.data(), n, scale, in_place.data(), nullptr);
        for (int64_t i = 0; i < n; ++i) {
          const auto k = static_cast<std::size_t>(i);
          const float q = x[k] / scale, expected = round_to_e4m3_value(q) * scale;
          if (std::isnan(expected)) {
            ASSERT_TRUE(std::isnan(dequantized[k]) && std::isnan(in_place[k])) << "x = " << x[k];
          } else {
            ASSERT_EQ(bits(dequantized[k]), bits(expected)) << "x = " << x[k];
            ASSERT_EQ(bits(in_place[k]), bits(expected)) << "x = " << x[k];
          }
          ASSERT_EQ(codes[k].bits, from_float<f8_e4m3>(q).bits) << "x = " << x[k];
        }
      }
    }
}

// A random e4m3 code that is not NaN.
uint8_t random_finite_e4m3(std::mt19937& rng) {
  uint8_t c;
  do c = static_cast<uint8_t>(rng());
  while ((c & 0x7f) == 0x7f);
  return c;
}

using CodesGemv = void (*)(const cpu::QuantizedMatrix&, int64_t, int64_t, const cpu::QuantizedVector&, float*, int64_t,
                           int64_t);

// gemv over rows 0.. and every third row from 5 (row steps 1 and 3) against the float64 sums of term(n, k)
// (one product's exact value), within 1e-6 of the sum of the terms' magnitudes (plus `floor`).
template <typename Term>
void expect_rows_match_float64(CodesGemv gemv, const cpu::QuantizedMatrix& m, const cpu::QuantizedVector& v,
                               int64_t rows, int64_t k_len, double floor, Term&& term) {
  for (int64_t step : {1, 3}) {
    const int64_t first = step == 1 ? 0 : 5, n_rows = (rows - first + step - 1) / step;
    std::vector<float> y(static_cast<std::size_t>(n_rows), std::numeric_limits<float>::quiet_NaN());
    gemv(m, first, step, v, y.data(), n_rows, k_len);
    for (int64_t i = 0; i < n_rows; ++i) {
      const int64_t n = first + i * step;
      double ref = 0, magnitude = 0;
      for (int64_t k = 0; k < k_len; ++k) {
        const double t = term(n, k);
        ref += t;
        magnitude += std::fabs(t);
      }
      ASSERT_NEAR(y[static_cast<std::size_t>(i)], ref, 1e-6 * magnitude + floor) << "row " << n;
    }
  }
}

// gemv_rows_codes with FP8 weights (the build this machine picks) against float64 sums of the decoded codes times both
// scales: every e4m3 code on both sides, row blocks of 128 with their own scales, K with partial 64- and
// 128-wide blocks, a row step; a NaN code on either side reads as NaN.
// The dispatched kernel (AVX512-BF16 where the CPU has it) and the portable one, which other CPUs run.
class QuantizedGemvFp8Codes : public ::testing::TestWithParam<bool> {};

TEST_P(QuantizedGemvFp8Codes, MatchFloat64) {
  const auto gemv = GetParam() ? &cpu::portable::gemv_rows_codes : &cpu::gemv_rows_codes;
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> u(0.25f, 4.0f);
  const int64_t rows = 260;
  for (bool ue8m0_scales : {false, true})
    for (int64_t k_len : {1, 63, 64, 100, 128, 200, 300, 1024}) {
      SCOPED_TRACE(testing::Message() << "K=" << k_len << (ue8m0_scales ? " ue8m0" : " f32"));
      const int64_t kb = (k_len + 127) / 128, nb = (rows + 127) / 128;
      std::vector<uint8_t> w(static_cast<std::size_t>(rows * k_len));
      for (auto& c : w) c = random_finite_e4m3(rng);
      std::vector<float> w_scale(static_cast<std::size_t>(nb * kb));
      std::vector<ue8m0> w_scale_e(w_scale.size());
      for (std::size_t i = 0; i < w_scale.size(); ++i) {
        w_scale_e[i] = ue8m0{static_cast<uint8_t>(120 + rng() % 14)};
        w_scale[i] = ue8m0_scales ? to_float(w_scale_e[i]) : u(rng);
      }
      std::vector<f8_e4m3> x(static_cast<std::size_t>(k_len));
      for (auto& c : x) c = f8_e4m3{random_finite_e4m3(rng)};
      std::vector<float> x_scale(static_cast<std::size_t>(kb));
      for (auto& s : x_scale) s = u(rng) * 0x1p-6f;
      cpu::QuantizedMatrix m;
      m.data = w.data();
      m.row_bytes = k_len;
      m.ue8m0_scales = ue8m0_scales;
      m.scales = ue8m0_scales ? static_cast<const void*>(w_scale_e.data()) : w_scale.data();
      m.scale_ld = kb;
      const cpu::QuantizedVector v{x.data(), x_scale.data()};
      expect_rows_match_float64(gemv, m, v, rows, k_len, 1e-30, [&](int64_t n, int64_t k) {
        return e4m3_definition(w[static_cast<std::size_t>(n * k_len + k)]) *
               e4m3_definition(x[static_cast<std::size_t>(k)].bits) *
               w_scale[static_cast<std::size_t>(n / 128 * kb + k / 128)] * x_scale[static_cast<std::size_t>(k / 128)];
      });
      // NaN codes: in one weight row that row only; in x every row.
      w[static_cast<std::size_t>(7 * k_len + k_len / 2)] = 0xff;
      std::vector<float> y(static_cast<std::size_t>(rows));
      gemv(m, 0, 1, v, y.data(), rows, k_len);
      for (int64_t n = 0; n < rows; ++n) EXPECT_EQ(std::isnan(y[static_cast<std::size_t>(n)]), n == 7) << n;
      x[static_cast<std::size_t>(k_len - 1)] = f8_e4m3{0x7f};
      gemv(m, 0, 1, v, y.data(), rows, k_len);
      for (int64_t n = 0; n < rows; ++n) EXPECT_TRUE(std::isnan(y[static_cast<std::size_t>(n)])) << n;
    }
}
INSTANTIATE_TEST_SUITE_P(Kernels, QuantizedGemvFp8Codes, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "portable" : "dispatched"; });

// gemv_rows_codes with FP4 weights, both builds, against float64 sums of the decoded codes times both scales:
// every e2m1 and finite e4m3 code, ue8m0 weight scales per 32 (2^-127, code 0, included) and power-of-two
// activation scales per 128, K with partial 32-, 64- and 128-wide blocks, a row step; a NaN scale (0xff)
// reads as NaN in its row only, a NaN activation code in every row.
class QuantizedGemvFp4Codes : public ::testing::TestWithParam<bool> {};

TEST_P(QuantizedGemvFp4Codes, MatchFloat64) {
  const auto gemv = GetParam() ? &cpu::portable::gemv_rows_codes : &cpu::gemv_rows_codes;
  std::mt19937 rng(22);
  const int64_t rows = 70;
  for (int64_t k_len : {2, 30, 32, 64, 100, 128, 200, 300, 1024}) {
    SCOPED_TRACE(testing::Message() << "K=" << k_len);
    const int64_t kb = (k_len + 31) / 32, groups = (k_len + 127) / 128, row_bytes = k_len / 2;
    std::vector<uint8_t> w(static_cast<std::size_t>(rows * row_bytes));
    for (auto& c : w) c = static_cast<uint8_t>(rng());
    std::vector<ue8m0> w_scale(static_cast<std::size_t>(rows * kb));
    for (auto& s : w_scale) s = ue8m0{static_cast<uint8_t>(118 + rng() % 16)};
    w_scale[3] = ue8m0{0};  // one block scaled by 2^-127, a float subnormal
    std::vector<f8_e4m3> x(static_cast<std::size_t>(k_len));
    for (auto& c : x) c = f8_e4m3{random_finite_e4m3(rng)};
    std::vector<float> x_scale(static_cast<std::size_t>(groups));
    for (auto& s : x_scale) s = std::ldexp(1.0f, static_cast<int>(rng() % 9) - 12);
    cpu::QuantizedMatrix m;
    m.fp4 = true;
    m.data = w.data();
    m.row_bytes = row_bytes;
    m.ue8m0_scales = true;
    m.scales = w_scale.data();
    m.scale_ld = kb;
    const cpu::QuantizedVector v{x.data(), x_scale.data()};
    expect_rows_match_float64(gemv, m, v, rows, k_len, 1e-37, [&](int64_t n, int64_t k) {
      const uint8_t pair = w[static_cast<std::size_t>(n * row_bytes + k / 2)];
      return e2m1_definition(static_cast<uint8_t>(k % 2 ? pair >> 4 : pair & 0xf)) *
             e4m3_definition(x[static_cast<std::size_t>(k)].bits) *
             std::ldexp(1.0, w_scale[static_cast<std::size_t>(n * kb + k / 32)].bits - 127) *
             x_scale[static_cast<std::size_t>(k / 128)];
    });
    // A NaN scale: that row only; a NaN activation code: every row.
    w_scale[static_cast<std::size_t>(7 * kb + kb - 1)] = ue8m0{0xff};
    std::vector<float> y(static_cast<std::size_t>(rows));
    gemv(m, 0, 1, v, y.data(), rows, k_len);
    for (int64_t n = 0; n < rows; ++n) EXPECT_EQ(std::isnan(y[static_cast<std::size_t>(n)]), n == 7) << n;
    x[static_cast<std::size_t>(k_len - 1)] = f8_e4m3{0x7f};
    gemv(m, 0, 1, v, y.data(), rows, k_len);
    for (int64_t n = 0; n < rows; ++n) EXPECT_TRUE(std::isnan(y[static_cast<std::size_t>(n)])) << n;
  }
}
INSTANTIATE_TEST_SUITE_P(Kernels, QuantizedGemvFp4Codes, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "portable" : "dispatched"; });

// block_scaled_gemm (grouped_mm's FP8 product with float scales), both builds, against float64 sums of the
// decoded codes times both scales: every finite e4m3 code on both sides, output rows picked from a weight
// matrix in any order (crossing its 128-row scale blocks, a partial last panel), K with odd and partial
// 128-wide blocks, row tiles of 1..6 and a remainder, strided activations, scales and output. Columns past the
// output rows stay untouched; a NaN activation code poisons its row only, including one at the end of a row
// with odd K (the kernel reads pairs) and one just past a row's end, which belongs to no row.
class BlockScaledGemm : public ::testing::TestWithParam<bool> {};

TEST_P(BlockScaledGemm, MatchesFloat64) {
  const auto gemm = GetParam() ? &cpu::portable::block_scaled_gemm : &cpu::block_scaled_gemm;
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> u(0.25f, 4.0f);
  const int64_t weight_rows = 300;
  for (int64_t k_len : {1, 2, 63, 127, 128, 129, 300, 1024})
    for (int64_t n : {1, 17, 40, 70})
      for (int64_t m : {1, 6, 13}) {
        SCOPED_TRACE(testing::Message() << "K=" << k_len << " N=" << n << " M=" << m);
        const int64_t kb = (k_len + 127) / 128, nb = (weight_rows + 127) / 128;
        std::vector<uint8_t> w(static_cast<std::size_t>(weight_rows * k_len));
        for (auto& c : w) c = random_finite_e4m3(rng);
        std::vector<float> w_scale(static_cast<std::size_t>(nb * kb));
        for (auto& sc : w_scale) sc = u(rng);
        cpu::QuantizedMatrix q;
        q.data = w.data();
        q.row_bytes = k_len;
        q.scales = w_scale.data();
        q.scale_ld = kb;
        std::vector<int64_t> outputs;
        for (int64_t i = 0; i < n; ++i) outputs.push_back((i * 7 + 3) % weight_rows);
        const cpu::BlockScaledWeights packed = cpu::pack_block_scaled(q, outputs, k_len);
        const int64_t lda = k_len + 3, scale_ld = kb + 1, ldo = n + 5;
        std::vector<bf16> a(static_cast<std::size_t>(m * lda), from_float<bf16>(0.0f));
        std::vector<uint8_t> a_codes(a.size(), 0);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t k = 0; k < k_len; ++k) {
            const auto i = static_cast<std::size_t>(r * lda + k);
            a_codes[i] = random_finite_e4m3(rng);
            a[i] = from_float<bf16>(static_cast<float>(e4m3_definition(a_codes[i])));
          }
        std::vector<float> a_scale(static_cast<std::size_t>(m * scale_ld));
        for (auto& sc : a_scale) sc = u(rng) * 0x1p-6f;
        const float untouched = 12345.0f;
        std::vector<float> out(static_cast<std::size_t>(m * ldo), untouched);
        gemm(packed, a.data(), lda, m, a_scale.data(), scale_ld, out.data(), ldo);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < ldo; ++c) {
            const float y = out[static_cast<std::size_t>(r * ldo + c)];
            if (c >= n) {
              ASSERT_EQ(y, untouched) << "row " << r << " column " << c << " is past the output rows";
              continue;
            }
            const int64_t row = outputs[static_cast<std::size_t>(c)];
            double ref = 0, magnitude = 0;
            for (int64_t k = 0; k < k_len; ++k) {
              const double t = e4m3_definition(w[static_cast<std::size_t>(row * k_len + k)]) *
                               e4m3_definition(a_codes[static_cast<std::size_t>(r * lda + k)]) *
                               w_scale[static_cast<std::size_t>(row / 128 * kb + k / 128)] *
                               a_scale[static_cast<std::size_t>(r * scale_ld + k / 128)];
              ref += t;
              magnitude += std::fabs(t);
            }
            ASSERT_NEAR(y, ref, 1e-6 * magnitude + 1e-30) << "row " << r << " column " << c;
          }
        // NaN just past row 0's end: no row's. At row 0's last k: row 0 only.
        a[static_cast<std::size_t>(k_len)] = from_float<bf16>(std::numeric_limits<float>::quiet_NaN());
        gemm(packed, a.data(), lda, m, a_scale.data(), scale_ld, out.data(), ldo);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < n; ++c) ASSERT_FALSE(std::isnan(out[static_cast<std::size_t>(r * ldo + c)])) << r;
        a[static_cast<std::size_t>(k_len - 1)] = from_float<bf16>(std::numeric_limits<float>::quiet_NaN());
        gemm(packed, a.data(), lda, m, a_scale.data(), scale_ld, out.data(), ldo);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < n; ++c)
            ASSERT_EQ(std::isnan(out[static_cast<std::size_t>(r * ldo + c)]), r == 0) << r << ", " << c;
      }
}
INSTANTIATE_TEST_SUITE_P(Kernels, BlockScaledGemm, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "portable" : "dispatched"; });

TEST(QuantizationConfig, NamesAndDefaults) {
  QuantizationConfig c;
  EXPECT_FALSE(c.quantized());
  c.weights = WeightFormat::fp8_e4m3;
  EXPECT_EQ(c.resolved_block_size(), 128);
  EXPECT_EQ(c.describe(), "fp8_e4m3 block 128, dynamic activations");
  c.weights = WeightFormat::fp4_e2m1;
  EXPECT_EQ(c.resolved_block_size(), 32);
  EXPECT_EQ(parse_weight_format("fp8_e4m3"), WeightFormat::fp8_e4m3);
  EXPECT_EQ(parse_activation_scheme("static"), ActivationScheme::static_scales);
  EXPECT_TRUE(throws_error_with([] { parse_weight_format("int4"); }, {"'int4'", "none, fp8_e4m3, fp4_e2m1"}));
  EXPECT_EQ(ue8m0_ceil(1.0f).bits, 127);
  EXPECT_EQ(ue8m0_ceil(std::nextafter(1.0f, 2.0f)).bits, 128);
  EXPECT_EQ(ue8m0_ceil(0.75f).bits, 127);
}

}  // namespace
}  // namespace moekit

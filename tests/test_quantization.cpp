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
#include "moekit/dtype.h"
#include "moekit/tensor.h"

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
  for (float x : {0.0f, -0.0f, static_cast<float>(max), static_cast<float>(max) * 1.04f, 1e30f, -1e30f})
    v.push_back(x);
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

TEST(E2M1, DecodesAndRoundsToNearestEven) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(c)), e2m1_definition(static_cast<uint8_t>(c)));
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
  EXPECT_TRUE(throws_error_with([] { Tensor::zeros({2}, DType::f4_e2m1).to(DType::f32); },
                                {"packed f4_e2m1", "got f4_e2m1"}));
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

}  // namespace
}  // namespace moekit

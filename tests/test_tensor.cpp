// Element types, 16-bit float conversions and the Tensor view type.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "harness.h"
#include "moekit/dtype.h"
#include "moekit/tensor.h"

namespace moekit {
namespace {

using test::throws_error_with;
using test::values_of;

// ---------------------------------------------------------------------------------------------------------
// dtype names and parsing

TEST(DType, NamesSizesAndKinds) {
  struct Expected {
    DType dtype;
    const char* name;
    std::size_t size;
    bool floating;
  };
  const Expected expected[] = {
      {DType::f32, "f32", 4, true},         {DType::f16, "f16", 2, true},         {DType::bf16, "bf16", 2, true},
      {DType::i32, "i32", 4, false},        {DType::i64, "i64", 8, false},        {DType::u8, "u8", 1, false},
      {DType::f8_e4m3, "f8_e4m3", 1, true}, {DType::f4_e2m1, "f4_e2m1", 1, true}, {DType::ue8m0, "ue8m0", 1, true},
  };
  for (const auto& e : expected) {
    SCOPED_TRACE(e.name);
    EXPECT_EQ(dtype_name(e.dtype), e.name);
    EXPECT_EQ(dtype_size(e.dtype), e.size);
    EXPECT_EQ(is_floating(e.dtype), e.floating);
    // Every name we print parses back to the same dtype.
    EXPECT_EQ(parse_dtype(dtype_name(e.dtype)), e.dtype);
  }
}

TEST(DType, ParsesSafetensorsNamesAndAliases) {
  EXPECT_EQ(parse_dtype("F32"), DType::f32);
  EXPECT_EQ(parse_dtype("F16"), DType::f16);
  EXPECT_EQ(parse_dtype("BF16"), DType::bf16);
  EXPECT_EQ(parse_dtype("I32"), DType::i32);
  EXPECT_EQ(parse_dtype("I64"), DType::i64);
  EXPECT_EQ(parse_dtype("U8"), DType::u8);
  EXPECT_EQ(parse_dtype("F8_E4M3"), DType::f8_e4m3);
  EXPECT_EQ(parse_dtype("F4"), DType::f4_e2m1);
  EXPECT_EQ(parse_dtype("F8_E8M0"), DType::ue8m0);
  // torch-style spellings, in any case, as they appear in config.json ("torch_dtype": "bfloat16").
  EXPECT_EQ(parse_dtype("float32"), DType::f32);
  EXPECT_EQ(parse_dtype("float"), DType::f32);
  EXPECT_EQ(parse_dtype("float16"), DType::f16);
  EXPECT_EQ(parse_dtype("half"), DType::f16);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("BFloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("int32"), DType::i32);
  EXPECT_EQ(parse_dtype("int64"), DType::i64);
}

TEST(DType, UnknownNameListsTheValidOnes) {
  EXPECT_TRUE(throws_error_with([] { parse_dtype("f64"); },
                                {"unknown dtype 'f64'", "f32, f16, bf16, i32, i64, u8, f8_e4m3, f4_e2m1, ue8m0"}));
  EXPECT_TRUE(throws_error_with([] { parse_dtype(""); }, {"unknown dtype ''"}));
}

TEST(DType, VisitorsRejectTheWrongKind) {
  EXPECT_TRUE(throws_error_with([] { visit_float_dtype(DType::i32, [](auto) {}); }, {"floating dtype", "i32"}));
  EXPECT_TRUE(throws_error_with([] { visit_index_dtype(DType::bf16, [](auto) {}); }, {"index dtype", "bf16"}));
}

// ---------------------------------------------------------------------------------------------------------
// bf16

float float_of_bits(uint32_t bits) {
  return std::bit_cast<float>(bits);
}

TEST(BF16, ExactValues) {
  EXPECT_EQ(to_float(bf16{0x3f80}), 1.0f);
  EXPECT_EQ(to_float(bf16{0xc000}), -2.0f);
  EXPECT_EQ(from_float<bf16>(1.0f).bits, 0x3f80);
  EXPECT_EQ(from_float<bf16>(-2.0f).bits, 0xc000);
  EXPECT_EQ(from_float<bf16>(0.0f).bits, 0x0000);
  EXPECT_EQ(from_float<bf16>(-0.0f).bits, 0x8000);
}

TEST(BF16, RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81): the tie goes to the even one.
  EXPECT_EQ(from_float<bf16>(1.0f + 0x1p-8f).bits, 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 0x3f81 (odd) and 0x3f82 (even).
  EXPECT_EQ(from_float<bf16>(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
  // Just above a tie rounds up, just below rounds down.
  EXPECT_EQ(from_float<bf16>(std::nextafter(1.0f + 0x1p-8f, 2.0f)).bits, 0x3f81);
  EXPECT_EQ(from_float<bf16>(std::nextafter(1.0f + 3 * 0x1p-8f, 0.0f)).bits, 0x3f81);
}

// Every tie between two adjacent finite bf16 values (both signs, subnormals included) goes to the even
// pattern, and one float ulp either side of the tie goes to the nearer neighbour. The midpoint needs 9
// significant bits, so it is exact in float.
TEST(BF16, EveryMidpointRoundsToEven) {
  for (uint32_t b = 0; b < 0x7f80; ++b) {
    const float lo = to_float(bf16{static_cast<uint16_t>(b)});
    // Above the largest finite bf16 the next value is 2^128, which float cannot hold; its midpoint can.
    const double hi = b + 1 == 0x7f80 ? std::ldexp(1.0, 128) : to_float(bf16{static_cast<uint16_t>(b + 1)});
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2) << "midpoint not exact at " << b;
    const uint16_t even = static_cast<uint16_t>((b & 1u) ? b + 1 : b);
    ASSERT_EQ(from_float<bf16>(mid).bits, even) << "tie above bits " << b;
    ASSERT_EQ(from_float<bf16>(-mid).bits, even | 0x8000u) << "negative tie above bits " << b;
    ASSERT_EQ(from_float<bf16>(std::nextafter(mid, 0.0f)).bits, b) << "below the tie above bits " << b;
    ASSERT_EQ(from_float<bf16>(std::nextafter(mid, INFINITY)).bits, b + 1) << "above the tie above bits " << b;
  }
}

TEST(BF16, InfinityAndOverflow) {
  EXPECT_EQ(from_float<bf16>(INFINITY).bits, 0x7f80);
  EXPECT_EQ(from_float<bf16>(-INFINITY).bits, 0xff80);
  EXPECT_TRUE(std::isinf(to_float(bf16{0x7f80})));
  // The largest float is above the midpoint between the largest bf16 and 2^128, so it rounds to inf.
  EXPECT_EQ(from_float<bf16>(std::numeric_limits<float>::max()).bits, 0x7f80);
  EXPECT_EQ(from_float<bf16>(-std::numeric_limits<float>::max()).bits, 0xff80);
}

TEST(BF16, NaNStaysNaN) {
  EXPECT_TRUE(std::isnan(to_float(from_float<bf16>(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lies only in the 16 bits that bf16 drops would truncate to inf; it must stay NaN.
  const bf16 low_payload = from_float<bf16>(float_of_bits(0x7f800001u));
  EXPECT_TRUE(std::isnan(to_float(low_payload))) << std::hex << low_payload.bits;
  const bf16 negative = from_float<bf16>(float_of_bits(0xff800001u));
  EXPECT_TRUE(std::isnan(to_float(negative)));
  EXPECT_TRUE(negative.bits & 0x8000u) << "the sign of a NaN is kept";
  // A NaN just below the rounding carry must not round into inf or wrap to zero.
  EXPECT_TRUE(std::isnan(to_float(from_float<bf16>(float_of_bits(0x7fffffffu)))));
}

TEST(BF16, Subnormals) {
  // bf16 has float's exponent range, so float subnormals with 7 or fewer mantissa bits are exact.
  EXPECT_EQ(to_float(bf16{0x0001}), 0x1p-133f);
  EXPECT_EQ(from_float<bf16>(0x1p-133f).bits, 0x0001);
  EXPECT_EQ(from_float<bf16>(-0x1p-133f).bits, 0x8001);
  EXPECT_EQ(from_float<bf16>(0x1p-149f).bits, 0x0000);  // far below half of the smallest bf16 subnormal
}

TEST(BF16, ExhaustiveRoundTrip) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const bf16 v{static_cast<uint16_t>(b)};
    const float f = to_float(v);
    // bf16 is the upper half of a float.
    ASSERT_EQ(std::bit_cast<uint32_t>(f), b << 16);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(to_float(from_float<bf16>(f)))) << b;
    } else {
      ASSERT_EQ(from_float<bf16>(f).bits, b) << "round trip of bits " << b;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// f16

// f16 value from its fields, written independently of the library's bit manipulation.
double f16_value(uint16_t bits) {
  const int sign = bits >> 15;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  double magnitude;
  if (exponent == 0)
    magnitude = std::ldexp(mantissa, -24);
  else if (exponent == 31)
    magnitude = mantissa == 0 ? INFINITY : NAN;
  else
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  return sign ? -magnitude : magnitude;
}

TEST(F16, ExactValues) {
  EXPECT_EQ(to_float(f16{0x3c00}), 1.0f);
  EXPECT_EQ(to_float(f16{0xc000}), -2.0f);
  EXPECT_EQ(to_float(f16{0x7bff}), 65504.0f);         // largest finite
  EXPECT_EQ(to_float(f16{0x0400}), 0x1p-14f);         // smallest normal
  EXPECT_EQ(to_float(f16{0x03ff}), 1023 * 0x1p-24f);  // largest subnormal
  EXPECT_EQ(to_float(f16{0x0001}), 0x1p-24f);         // smallest subnormal
  EXPECT_TRUE(std::signbit(to_float(f16{0x8000})));
  EXPECT_EQ(from_float<f16>(1.0f).bits, 0x3c00);
  EXPECT_EQ(from_float<f16>(65504.0f).bits, 0x7bff);
  EXPECT_EQ(from_float<f16>(-0.0f).bits, 0x8000);
}

TEST(F16, AllBitPatternsDecode) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const double expected = f16_value(static_cast<uint16_t>(b));
    const float got = to_float(f16{static_cast<uint16_t>(b)});
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got)) << b;
    } else {
      ASSERT_EQ(static_cast<double>(got), expected) << "bits " << b;
      ASSERT_EQ(std::signbit(got), (b & 0x8000u) != 0) << "sign of bits " << b;
    }
  }
}

TEST(F16, RoundsToNearestEven) {
  // 1 + 2^-11 lies halfway between 1 (0x3c00, even) and 1 + 2^-10; 1 + 3 * 2^-11 between 0x3c01 and 0x3c02.
  EXPECT_EQ(from_float<f16>(1.0f + 0x1p-11f).bits, 0x3c00);
  EXPECT_EQ(from_float<f16>(1.0f + 3 * 0x1p-11f).bits, 0x3c02);
  // Subnormal ties: 2^-25 is halfway between 0 and the smallest subnormal, 3 * 2^-25 between 1 and 2 units.
  EXPECT_EQ(from_float<f16>(0x1p-25f).bits, 0x0000);
  EXPECT_EQ(from_float<f16>(3 * 0x1p-25f).bits, 0x0002);
  // Halfway between the largest subnormal and the smallest normal: the tie goes to the normal (even).
  EXPECT_EQ(from_float<f16>(1023.5f * 0x1p-24f).bits, 0x0400);
}

// As for bf16: every tie between adjacent finite f16 values (subnormals and the overflow boundary
// included) goes to even, and a float ulp either side goes to the nearer neighbour.
TEST(F16, EveryMidpointRoundsToEven) {
  for (uint32_t b = 0; b < 0x7c00; ++b) {
    const double lo = f16_value(static_cast<uint16_t>(b));
    const double hi = b + 1 == 0x7c00 ? 65536.0 : f16_value(static_cast<uint16_t>(b + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "midpoint not exact at " << b;
    const uint16_t even = static_cast<uint16_t>((b & 1u) ? b + 1 : b);
    ASSERT_EQ(from_float<f16>(mid).bits, even) << "tie above bits " << b;
    ASSERT_EQ(from_float<f16>(-mid).bits, even | 0x8000u) << "negative tie above bits " << b;
    ASSERT_EQ(from_float<f16>(std::nextafter(mid, 0.0f)).bits, b) << "below the tie above bits " << b;
    ASSERT_EQ(from_float<f16>(std::nextafter(mid, INFINITY)).bits, b + 1) << "above the tie above bits " << b;
  }
}

TEST(F16, InfinityOverflowAndUnderflow) {
  EXPECT_EQ(from_float<f16>(INFINITY).bits, 0x7c00);
  EXPECT_EQ(from_float<f16>(-INFINITY).bits, 0xfc00);
  EXPECT_TRUE(std::isinf(to_float(f16{0x7c00})));
  EXPECT_EQ(from_float<f16>(65520.0f).bits, 0x7c00);  // the tie above 65504 goes to "65536", i.e. inf
  EXPECT_EQ(from_float<f16>(std::nextafter(65520.0f, 0.0f)).bits, 0x7bff);
  EXPECT_EQ(from_float<f16>(1e6f).bits, 0x7c00);
  EXPECT_EQ(from_float<f16>(-1e6f).bits, 0xfc00);
  EXPECT_EQ(from_float<f16>(std::numeric_limits<float>::max()).bits, 0x7c00);
  // Far below the smallest subnormal: signed zero, including float subnormal inputs.
  EXPECT_EQ(from_float<f16>(1e-10f).bits, 0x0000);
  EXPECT_EQ(from_float<f16>(-1e-10f).bits, 0x8000);
  EXPECT_EQ(from_float<f16>(std::numeric_limits<float>::denorm_min()).bits, 0x0000);
  EXPECT_EQ(from_float<f16>(-std::numeric_limits<float>::denorm_min()).bits, 0x8000);
}

TEST(F16, NaNStaysNaN) {
  EXPECT_TRUE(std::isnan(to_float(from_float<f16>(std::numeric_limits<float>::quiet_NaN()))));
  // Payload only in the low 13 bits that f16 drops: truncation would give inf.
  EXPECT_TRUE(std::isnan(to_float(from_float<f16>(float_of_bits(0x7f800001u)))));
  const f16 negative = from_float<f16>(float_of_bits(0xff800001u));
  EXPECT_TRUE(std::isnan(to_float(negative)));
  EXPECT_TRUE(negative.bits & 0x8000u) << "the sign of a NaN is kept";
  EXPECT_TRUE(std::isnan(to_float(f16{0x7c01})));
  EXPECT_TRUE(std::isnan(to_float(f16{0xfe00})));
}

// Every f16 value survives f16 -> f32 -> f16 bit for bit; NaNs stay NaN with their sign (the payload may
// change, which is allowed).
TEST(F16, ExhaustiveRoundTrip) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const f16 v{static_cast<uint16_t>(b)};
    const f16 back = from_float<f16>(to_float(v));
    const bool is_nan = ((b >> 10) & 0x1fu) == 0x1f && (b & 0x3ffu) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(to_float(back))) << b;
      ASSERT_EQ(back.bits & 0x8000u, b & 0x8000u) << b;
    } else {
      ASSERT_EQ(back.bits, b) << "round trip of bits " << b;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Devices and shapes

TEST(Device, NamesAndParsing) {
  EXPECT_EQ(device_name(Device::cpu()), "cpu");
  EXPECT_EQ(device_name(Device::cuda(3)), "cuda:3");
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(parse_device("cuda:2"), Device::cuda(2));
  EXPECT_TRUE(throws_error_with([] { parse_device("cuda:x"); }, {"bad device 'cuda:x'", "cpu, cuda or cuda:N"}));
  EXPECT_TRUE(throws_error_with([] { parse_device("cuda:"); }, {"bad device"}));
  EXPECT_TRUE(throws_error_with([] { parse_device("cuda:-1"); }, {"bad device"}));
  EXPECT_TRUE(throws_error_with([] { parse_device("gpu"); }, {"unknown device 'gpu'"}));
}

TEST(Device, Availability) {
  std::string why;
  EXPECT_TRUE(device_available(Device::cpu(), &why));
  EXPECT_TRUE(device_available(Device::cpu()));
  synchronize(Device::cpu());  // nothing queued on the CPU: returns at once
  // No machine has a thousand GPUs: refused, with a reason the user can act on.
  EXPECT_FALSE(device_available(Device::cuda(1000), &why));
  EXPECT_FALSE(why.empty());
  std::string cuda_why;
  if (!device_available(Device::cuda(), &cuda_why)) {
    EXPECT_FALSE(cuda_why.empty()) << "a refusal must say why";
  }
}

TEST(Shape, String) {
  EXPECT_EQ(shape_string({}), "[]");
  EXPECT_EQ(shape_string({7}), "[7]");
  EXPECT_EQ(shape_string({2, 0, 3}), "[2, 0, 3]");
}

// ---------------------------------------------------------------------------------------------------------
// Tensor

// A [2, 3, 4] f32 tensor holding 0, 1, ..., 23 in row-major order.
Tensor iota_tensor() {
  Tensor t = Tensor::empty({2, 3, 4}, DType::f32);
  float* p = t.data_as<float>();
  for (int i = 0; i < 24; ++i) p[i] = static_cast<float>(i);
  return t;
}

TEST(Tensor, Undefined) {
  Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.describe(), "undefined tensor");
  EXPECT_TRUE(throws_error_with([&] { t.data(); }, {"undefined tensor"}));
  t.mark_modified();  // harmless on an undefined tensor
}

TEST(Tensor, Empty) {
  const Tensor t = Tensor::empty({2, 3, 4}, DType::bf16);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.shape(), Shape({2, 3, 4}));
  EXPECT_EQ(t.strides(), Shape({12, 4, 1}));
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.dtype(), DType::bf16);
  EXPECT_EQ(t.device(), Device::cpu());
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.storage_offset_bytes(), 0u);
  EXPECT_NE(t.data(), nullptr);
  EXPECT_GE(t.storage()->bytes(), t.nbytes());
  EXPECT_TRUE(throws_error_with([&] { t.size(3); }, {"dimension 3 out of range", "bf16[2, 3, 4]"}));
  EXPECT_TRUE(throws_error_with([&] { t.size(-4); }, {"out of range"}));
}

TEST(Tensor, EmptyWithZeroSizedDimensions) {
  const Tensor t = Tensor::empty({0, 5}, DType::f32);
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.nbytes(), 0u);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.describe(), "f32[0, 5] on cpu");
  const Tensor scalar = Tensor::empty({}, DType::i64);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.describe(), "i64[] on cpu");
}

TEST(Tensor, RejectsNegativeAndHugeShapes) {
  EXPECT_TRUE(throws_error_with([] { Tensor::empty({2, -1}, DType::f32); }, {"negative dimension", "[2, -1]"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        Tensor::empty({int64_t{1} << 40, int64_t{1} << 40}, DType::f32);
      },
      {"too large"}));
}

TEST(Tensor, ZerosAreZero) {
  const Tensor t = Tensor::zeros({3, 5}, DType::f16);
  const auto* bytes = static_cast<const unsigned char*>(t.data());
  for (std::size_t i = 0; i < t.nbytes(); ++i) ASSERT_EQ(bytes[i], 0) << i;
}

TEST(Tensor, FillBytes) {
  Tensor t = Tensor::empty({4, 3}, DType::bf16);
  t.fill_bytes(0xFF);
  for (float v : values_of(t)) EXPECT_TRUE(std::isnan(v));
  // fill_bytes writes whole contiguous memory; a strided view would spill into neighbouring elements.
  EXPECT_TRUE(throws_error_with([&] { t.transpose(0, 1).fill_bytes(0); }, {"fill_bytes needs a contiguous tensor"}));
}

TEST(Tensor, FromBlobViewsCallerMemory) {
  std::vector<float> blob = {1, 2, 3, 4, 5, 6};
  const Tensor t = Tensor::from_blob(blob.data(), {2, 3}, DType::f32);
  EXPECT_EQ(t.data(), blob.data());
  EXPECT_EQ(t.strides(), Shape({3, 1}));
  blob[4] = 50;
  EXPECT_EQ(t.data_as<float>()[4], 50.0f) << "a view sees later writes to the blob";
  // Column-major view of the same six floats: element (i, j) at i + 2j.
  const Tensor column_major = Tensor::from_blob(blob.data(), {2, 3}, DType::f32, Device::cpu(), {1, 2});
  EXPECT_FALSE(column_major.is_contiguous());
  EXPECT_EQ(values_of(column_major), std::vector<float>({1, 3, 50, 2, 4, 6}));
  EXPECT_EQ(column_major.storage()->bytes(), 6 * sizeof(float));
}

TEST(Tensor, FromBlobChecks) {
  float x = 0;
  EXPECT_TRUE(throws_error_with(
      [&] {
        Tensor::from_blob(&x, {2, 3}, DType::f32, Device::cpu(), {1});
      },
      {"strides [1] do not match shape [2, 3]"}));
  EXPECT_TRUE(throws_error_with([] { Tensor::from_blob(nullptr, {2}, DType::f32); }, {"null data"}));
  EXPECT_TRUE(
      throws_error_with([&] { Tensor::from_blob(&x, {2}, DType::f32, Device::cpu(), {-1}); }, {"negative strides"}));
  const Tensor none = Tensor::from_blob(nullptr, {0, 4}, DType::f32);
  EXPECT_EQ(none.numel(), 0);
}

TEST(Tensor, FromStorage) {
  // A storage whose deleter owns the bytes, as a file mapping would.
  auto bytes = std::make_shared<std::vector<float>>(std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  std::weak_ptr<std::vector<float>> watch = bytes;
  auto storage = std::make_shared<Storage>(bytes->data(), 40, Device::cpu(), [keep = bytes](void*) {});
  bytes.reset();
  {
    const Tensor t = Tensor::from_storage(storage, 8, {2, 3}, DType::f32);
    EXPECT_EQ(t.storage(), storage);
    EXPECT_EQ(t.storage_offset_bytes(), 8u);
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(values_of(t), std::vector<float>({2, 3, 4, 5, 6, 7}));
    EXPECT_EQ(Tensor::from_storage(storage, 40, {0}, DType::f32).numel(), 0) << "an empty view at the very end";
    EXPECT_TRUE(throws_error_with([&] { Tensor::from_storage(storage, 8, {9}, DType::f32); },
                                  {"overruns a storage of 40 bytes"}));
    EXPECT_TRUE(throws_error_with([&] { Tensor::from_storage(storage, 44, {0}, DType::f32); }, {"overruns"}));
    EXPECT_TRUE(throws_error_with([&] { Tensor::from_storage(storage, 0, {6}, DType::i64); }, {"overruns"}));
    EXPECT_TRUE(throws_error_with([] { Tensor::from_storage(nullptr, 0, {1}, DType::f32); }, {"null storage"}));
    storage.reset();
    EXPECT_FALSE(watch.expired()) << "a view keeps its storage, and so the bytes, alive";
    EXPECT_EQ(values_of(t)[0], 2.0f);
  }
  EXPECT_TRUE(watch.expired()) << "the bytes are released with the last view";
}

TEST(Tensor, SliceSharesStorage) {
  Tensor t = iota_tensor();
  const Tensor s = t.slice(1, 1, 3);  // [2, 2, 4]: rows 1 and 2 of each outer block
  EXPECT_EQ(s.shape(), Shape({2, 2, 4}));
  EXPECT_EQ(s.strides(), Shape({12, 4, 1}));
  EXPECT_EQ(s.storage(), t.storage());
  EXPECT_EQ(s.storage_offset_bytes(), 4 * sizeof(float));
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(values_of(s), std::vector<float>({4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23}));
  t.data_as<float>()[4] = -1;
  EXPECT_EQ(values_of(s)[0], -1.0f) << "the slice is a view";
  // Negative dimension counts from the end; an empty slice is allowed.
  EXPECT_EQ(t.slice(-1, 1, 2).shape(), Shape({2, 3, 1}));
  EXPECT_EQ(t.slice(0, 2, 2).numel(), 0);
  // A slice of the outer dimension stays contiguous.
  EXPECT_TRUE(t.slice(0, 1, 2).is_contiguous());
}

TEST(Tensor, BadSlicesThrow) {
  const Tensor t = iota_tensor();
  EXPECT_TRUE(throws_error_with([&] { t.slice(1, 2, 1); }, {"slice [2, 1) out of range", "f32[2, 3, 4]"}));
  EXPECT_TRUE(throws_error_with([&] { t.slice(1, 0, 4); }, {"slice [0, 4) out of range"}));
  EXPECT_TRUE(throws_error_with([&] { t.slice(1, -1, 2); }, {"slice [-1, 2) out of range"}));
  EXPECT_TRUE(throws_error_with([&] { t.slice(3, 0, 1); }, {"dimension 3 out of range"}));
  EXPECT_TRUE(throws_error_with([&] { t.slice(-4, 0, 1); }, {"out of range"}));
  EXPECT_TRUE(throws_error_with([&] { t.select(0, 2); }, {"out of range"}));
  EXPECT_TRUE(throws_error_with([&] { t.select(0, -1); }, {"out of range"}));
}

TEST(Tensor, Select) {
  const Tensor t = iota_tensor();
  const Tensor s = t.select(1, 2);  // [2, 4]: t[:, 2, :]
  EXPECT_EQ(s.shape(), Shape({2, 4}));
  EXPECT_EQ(s.strides(), Shape({12, 1}));
  EXPECT_EQ(values_of(s), std::vector<float>({8, 9, 10, 11, 20, 21, 22, 23}));
  const Tensor last = t.select(-1, 3);  // [2, 3]
  EXPECT_EQ(values_of(last), std::vector<float>({3, 7, 11, 15, 19, 23}));
  EXPECT_EQ(t.select(0, 1).select(0, 1).select(0, 1).numel(), 1);
}

TEST(Tensor, Reshape) {
  const Tensor t = iota_tensor();
  const Tensor r = t.reshape({6, 4});
  EXPECT_EQ(r.shape(), Shape({6, 4}));
  EXPECT_EQ(r.strides(), Shape({4, 1}));
  EXPECT_EQ(r.storage(), t.storage());
  EXPECT_EQ(values_of(r), values_of(t));
  EXPECT_TRUE(throws_error_with([&] { t.reshape({5, 5}); }, {"changes the element count"}));
  EXPECT_TRUE(throws_error_with([&] { t.transpose(0, 2).reshape({24}); }, {"reshape needs a contiguous tensor"}));
}

TEST(Tensor, Transpose) {
  const Tensor t = iota_tensor();
  const Tensor tr = t.transpose(1, 2);  // [2, 4, 3]
  EXPECT_EQ(tr.shape(), Shape({2, 4, 3}));
  EXPECT_EQ(tr.strides(), Shape({12, 1, 4}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.storage(), t.storage());
  EXPECT_EQ(values_of(tr.select(0, 0)), std::vector<float>({0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  EXPECT_TRUE(tr.transpose(-1, -2).is_contiguous()) << "transposing back restores the layout";
  EXPECT_TRUE(throws_error_with([&] { t.transpose(0, 3); }, {"transpose dims out of range"}));
}

TEST(Tensor, ContiguousCopiesOnlyWhenNeeded) {
  const Tensor t = iota_tensor();
  EXPECT_EQ(t.contiguous().storage(), t.storage()) << "already contiguous: no copy";
  const Tensor tr = t.transpose(0, 2);  // [4, 3, 2]
  const Tensor c = tr.contiguous();
  EXPECT_NE(c.storage(), t.storage());
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.shape(), Shape({4, 3, 2}));
  // c[i, j, k] = t[k, j, i] = 12k + 4j + i.
  const float* p = c.data_as<float>();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 2; ++k) EXPECT_EQ(p[(i * 3 + j) * 2 + k], 12 * k + 4 * j + i);
}

TEST(Tensor, CloneIsDeep) {
  Tensor t = iota_tensor();
  const Tensor c = t.clone();
  EXPECT_NE(c.storage(), t.storage());
  EXPECT_NE(c.data(), t.data());
  EXPECT_EQ(values_of(c), values_of(t));
  t.data_as<float>()[0] = 100;
  EXPECT_EQ(c.data_as<float>()[0], 0.0f) << "the clone does not see writes to the original";
  const Tensor column = t.select(2, 1).clone();  // a strided view
  EXPECT_TRUE(column.is_contiguous());
  EXPECT_EQ(values_of(column), std::vector<float>({1, 5, 9, 13, 17, 21}));
}

TEST(Tensor, ToDType) {
  const Tensor t = test::tensor_of({1.0f, -2.5f, 3.0f + 0x1p-9f, 65504.0f, 1e-8f, 100000.0f}, {2, 3});
  const Tensor same = t.to(DType::f32);
  EXPECT_EQ(same.storage(), t.storage()) << "same dtype, contiguous: no copy";

  const Tensor b = t.to(DType::bf16);
  EXPECT_EQ(b.dtype(), DType::bf16);
  EXPECT_EQ(b.shape(), t.shape());
  // 3 + 2^-9 rounds to 3 in bf16 (7 mantissa bits); 1e-8 keeps its exponent in bf16 but not in f16.
  const auto bv = values_of(b);
  EXPECT_EQ(bv[0], 1.0f);
  EXPECT_EQ(bv[1], -2.5f);
  EXPECT_EQ(bv[2], 3.0f);
  EXPECT_EQ(bv[3], 65536.0f);  // 65504 needs 11 significant bits: rounds to 2^16 in bf16
  EXPECT_NEAR(bv[4], 1e-8f, 1e-10f);

  const auto hv = values_of(t.to(DType::f16));
  EXPECT_EQ(hv[2], 3.0f + 0x1p-9f);  // exact with 10 mantissa bits
  EXPECT_EQ(hv[3], 65504.0f);
  EXPECT_EQ(hv[4], 0.0f);  // below half of f16's smallest subnormal
  EXPECT_TRUE(std::isinf(hv[5]));

  // Floats to integers truncate toward zero, as a C++ cast (and torch) does.
  const Tensor i = test::tensor_of({2.7f, -2.7f, 7.0f}, {3}).to(DType::i32);
  EXPECT_EQ(i.dtype(), DType::i32);
  EXPECT_EQ(std::vector<int32_t>(i.data_as<int32_t>(), i.data_as<int32_t>() + 3), std::vector<int32_t>({2, -2, 7}));
  const Tensor wide = i.to(DType::i64);
  EXPECT_EQ(wide.data_as<int64_t>()[1], -2);
  EXPECT_EQ(values_of(wide), std::vector<float>({2, -2, 7}));

  // A strided view converts in the order of its logical shape.
  const Tensor tr = iota_tensor().transpose(0, 1).to(DType::f16);  // [3, 2, 4]
  EXPECT_TRUE(tr.is_contiguous());
  EXPECT_EQ(values_of(tr), values_of(iota_tensor().transpose(0, 1).contiguous()));

  EXPECT_TRUE(throws_error_with([&] { t.to(DType::u8); }, {"an index dtype (i32, i64) to convert to", "got u8"}));
}

TEST(Tensor, DataAsChecksTheType) {
  const Tensor t = Tensor::empty({2}, DType::f32);
  EXPECT_TRUE(throws_error_with([&] { t.data_as<bf16>(); }, {"tensor holds f32, accessed as bf16"}));
  EXPECT_TRUE(throws_error_with([&] { t.data_as<int32_t>(); }, {"accessed as i32"}));
}

TEST(Tensor, Describe) {
  EXPECT_EQ(Tensor::empty({2, 3}, DType::bf16).describe(), "bf16[2, 3] on cpu");
  EXPECT_EQ(Tensor::empty({7}, DType::i32).describe(), "i32[7] on cpu");
  EXPECT_EQ(iota_tensor().transpose(0, 2).describe(), "f32[4, 3, 2] on cpu");
}

TEST(Tensor, ToSameDeviceIsAView) {
  const Tensor t = iota_tensor();
  EXPECT_EQ(t.to(Device::cpu()).storage(), t.storage());
}

TEST(Tensor, CudaRoundTrip) {
  if (auto why = test::device_unavailable(Device::cuda())) {
    // A CPU-only build must say why instead of failing obscurely.
    EXPECT_TRUE(throws_error_with([] { iota_tensor().to(Device::cuda()); }, {"cuda"}));
    GTEST_SKIP() << "no CUDA device: " << *why;
  }
  const Tensor t = iota_tensor().transpose(0, 1);
  const Tensor on_gpu = t.to(Device::cuda());
  EXPECT_EQ(on_gpu.device(), Device::cuda());
  EXPECT_EQ(on_gpu.describe(), "f32[3, 2, 4] on cuda:0");
  EXPECT_EQ(values_of(on_gpu.to(Device::cpu())), values_of(t));
}

// ---------------------------------------------------------------------------------------------------------
// Storage attachments: derived data (packed weights) lives with the bytes and is dropped on mark_modified.

TEST(Storage, AttachmentIsCreatedOnce) {
  const Tensor t = iota_tensor();
  int made = 0;
  auto make = [&] {
    ++made;
    return std::static_pointer_cast<void>(std::make_shared<int>(42));
  };
  const auto first = t.storage()->attachment("packed", make);
  const auto second = t.storage()->attachment("packed", make);
  EXPECT_EQ(made, 1);
  EXPECT_EQ(first, second);
  EXPECT_EQ(*std::static_pointer_cast<int>(first), 42);
  // Views share the storage, and so its attachments.
  EXPECT_EQ(t.slice(0, 1, 2).storage()->attachment("packed", make), first);
  EXPECT_EQ(made, 1);
  // Another key is another attachment.
  t.storage()->attachment("other", make);
  EXPECT_EQ(made, 2);
  // A clone has its own bytes and so no attachments.
  iota_tensor().clone().storage()->attachment("packed", make);
  EXPECT_EQ(made, 3);
}

TEST(Storage, MarkModifiedClearsAttachments) {
  const Tensor t = iota_tensor();
  int made = 0;
  auto make = [&] {
    ++made;
    return std::static_pointer_cast<void>(std::make_shared<int>(made));
  };
  t.storage()->attachment("packed", make);
  // Marking a view modified drops the attachments of the whole storage: the view's bytes are its bytes.
  t.select(0, 1).mark_modified();
  const auto again = t.storage()->attachment("packed", make);
  EXPECT_EQ(made, 2);
  EXPECT_EQ(*std::static_pointer_cast<int>(again), 2);
  t.storage()->clear_attachments();
  t.storage()->attachment("packed", make);
  EXPECT_EQ(made, 3);
}

TEST(Storage, AttachmentLivesAsLongAsTheBytes) {
  std::weak_ptr<void> watch;
  {
    const Tensor t = iota_tensor();
    watch = t.storage()->attachment("packed", [] { return std::static_pointer_cast<void>(std::make_shared<int>(1)); });
    EXPECT_FALSE(watch.expired());
  }
  EXPECT_TRUE(watch.expired()) << "the attachment must be freed with its storage";
}

TEST(Storage, ConcurrentFirstUseCreatesOnce) {
  const Tensor t = iota_tensor();
  std::atomic<int> made{0};
  std::vector<std::shared_ptr<void>> seen(8);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < seen.size(); ++i)
    threads.emplace_back([&, i] {
      seen[i] = t.storage()->attachment("packed", [&] {
        ++made;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));  // widen the race window
        return std::static_pointer_cast<void>(std::make_shared<int>(7));
      });
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(made.load(), 1);
  for (const auto& s : seen) EXPECT_EQ(s, seen[0]);
}

TEST(Storage, FromBlobDoesNotFreeCallerMemory) {
  // The storage of a view of caller memory has no deleter; destroying it must leave the memory alone
  // (ASan would report a double free otherwise, and the vector's own destructor would crash).
  std::vector<float> blob(16, 1.0f);
  { const Tensor t = Tensor::from_blob(blob.data(), {16}, DType::f32); }
  EXPECT_EQ(blob[3], 1.0f);
}

}  // namespace
}  // namespace moekit

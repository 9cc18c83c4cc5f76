// Quantised experts problems (DESIGN §3): validation names the tensor and the expected shape and dtype, the
// reference quantises activations as documented (checked by hand on values whose rounding is known), the Hopper
// backends refuse FP4 problems on CUDA by name, and the compute capability 10.x rule of deepgemm.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/backends/quantized_support.h"
#include "moekit/cuda/fp4_f16_codes.h"
#include "moekit/cuda/scale_division.h"
#include "moekit/experts.h"
#include "moekit/kernel_options.h"
#include "moekit/quantization.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

using test::throws_error_with;

// Pairwise distinct sizes (T=4, H=132, I=70 so N=140, E=3, K=2) that leave partial blocks of 128 and 32.
RandomProblemOptions quantized_options(WeightFormat format, DType scale_dtype = DType::f32) {
  RandomProblemOptions o;
  o.tokens = 4;
  o.hidden = 132;
  o.intermediate = 70;
  o.experts = 3;
  o.top_k = 2;
  o.dtype = DType::bf16;
  o.config.quantization.weights = format;
  o.scale_dtype = scale_dtype;
  o.seed = 21;
  return o;
}

::testing::AssertionResult rejects(const ExpertsProblem& p, const std::vector<std::string>& parts) {
  return throws_error_with([&] { validate(p); }, parts);
}

TEST(QuantizedValidation, ValidProblemsPass) {
  for (auto [format, scale] :
       {std::pair{WeightFormat::fp8_e4m3, DType::f32}, std::pair{WeightFormat::fp8_e4m3, DType::ue8m0},
        std::pair{WeightFormat::fp4_e2m1, DType::ue8m0}}) {
    const ExpertsProblem p = make_random_problem(quantized_options(format, scale));
    const ExpertsShape s = validate(p);
    EXPECT_EQ(s.hidden, 132);
    EXPECT_EQ(s.intermediate, 70);
    EXPECT_EQ(p.gate_up_proj.shape(), format == WeightFormat::fp8_e4m3 ? Shape({3, 140, 132}) : Shape({3, 140, 66}));
  }
}

TEST(QuantizedValidation, WeightsAndScalesAreNamedWithTheExpectedShapeAndDType) {
  const ExpertsProblem fp8 = make_random_problem(quantized_options(WeightFormat::fp8_e4m3));
  ExpertsProblem p = fp8;
  p.gate_up_proj_scale_inv = Tensor();
  EXPECT_TRUE(rejects(p, {"gate_up_proj_scale_inv is missing"}));
  p = fp8;
  p.gate_up_proj_scale_inv = Tensor::zeros({3, 2, 1}, DType::f32);
  EXPECT_TRUE(
      rejects(p, {"gate_up_proj_scale_inv must be [3, 2, 2]", "[E, ceil(N/128), ceil(H/128)]", "f32[3, 2, 1]"}));
  p = fp8;
  p.down_proj_scale_inv = Tensor::zeros({3, 2, 1}, DType::f32);  // [E, ceil(132/128), ceil(70/128)] = [3, 2, 1]: fine
  EXPECT_NO_THROW(validate(p));
  p.down_proj_scale_inv = Tensor::zeros({3, 2, 1}, DType::ue8m0);
  EXPECT_TRUE(rejects(p, {"down_proj_scale_inv must have the dtype of gate_up_proj_scale_inv (f32)"}));
  p = fp8;
  p.gate_up_proj_scale_inv = Tensor::zeros({3, 2, 2}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"gate_up_proj_scale_inv must be f32 or ue8m0", "bf16[3, 2, 2]"}));
  p = fp8;
  p.gate_up_proj = p.gate_up_proj.to(DType::f32);
  EXPECT_TRUE(
      rejects(p, {"gate_up_proj must be f8_e4m3 (config.quantization: fp8_e4m3 block 128", "f32[3, 140, 132]"}));
  p = fp8;
  p.config.quantization.block_size = 64;
  EXPECT_TRUE(rejects(p, {"block_size 64 is not supported", "blocks of 128 x 128"}));
  p = fp8;
  p.config.is_transposed = true;
  EXPECT_TRUE(rejects(p, {"must be untransposed [E, N, K]"}));
  p = fp8;
  p.config.quantization = {};
  EXPECT_TRUE(rejects(p, {"gate_up_proj must have the dtype of hidden_states (bf16)", "f8_e4m3"}));

  const ExpertsProblem fp4 = make_random_problem(quantized_options(WeightFormat::fp4_e2m1));
  p = fp4;
  p.gate_up_proj_scale_inv = Tensor::zeros({3, 140, 4}, DType::ue8m0);
  EXPECT_TRUE(rejects(p, {"gate_up_proj_scale_inv must be [3, 140, 5]", "one scale per 32 values along H"}));
  p = fp4;
  p.down_proj = Tensor::zeros({3, 132, 70}, DType::f4_e2m1);
  EXPECT_TRUE(rejects(p, {"down_proj must be [3, 132, 35]", "[E, H, I/2], FP4 pairs"}));
  p = fp4;
  p.gate_up_proj_scale_inv = p.gate_up_proj_scale_inv.to(DType::f32);
  EXPECT_TRUE(rejects(p, {"gate_up_proj_scale_inv must be ue8m0"}));

  // Scales without quantisation are a mistake, not something to ignore.
  RandomProblemOptions plain = quantized_options(WeightFormat::none);
  p = make_random_problem(plain);
  p.down_proj_scale_inv = fp8.down_proj_scale_inv;
  EXPECT_TRUE(rejects(p, {"scale_inv tensors were given but config.quantization says the weights are not quantised"}));
}

// grouped_mm with FP8 weights and float scales runs its block-scaled products on moekit's AVX512-BF16 kernel
// where the CPU has it, else as one oneDNN product per 128-wide block; KernelOptions::cpu_fp8_own_kernel off forces the
// second, so both are checked against the float64 reference on every CPU. 40 tokens over 3 experts: blocks of
// more rows than the matrix-vector path takes, partial 128-wide blocks in H and I.
TEST(GroupedMmFp8FloatScales, BothProductPathsMatchTheReference) {
  RandomProblemOptions o = quantized_options(WeightFormat::fp8_e4m3);
  o.tokens = 40;
  const ExpertsProblem p = make_random_problem(o);
  const std::vector<double> reference = experts_reference(p);
  std::vector<std::string> paths;
  for (const bool onednn : {false, true}) {
    KernelOptions k = kernel_options();
    k.cpu_fp8_own_kernel = !onednn;
    test::ScopedKernelOptions scoped(k);
    paths.push_back(experts_kernel_path(p, "grouped_mm"));
    const test::Comparison c = test::compare_with_reference(experts_forward(p, "grouped_mm"), reference,
                                                            test::tolerance_for(p.hidden_states.dtype(), true));
    EXPECT_TRUE(c.passed()) << (onednn ? "oneDNN per block: " : "default products: ") << paths.back() << ": "
                            << c.summary();
  }
  // The switch shows in the path (where the CPU has moekit's kernel; elsewhere both paths are oneDNN's).
  EXPECT_TRUE(paths[1].find("oneDNN bf16 products per 128-wide block") != std::string::npos) << paths[1];
  EXPECT_TRUE(paths[0] == paths[1] || paths[0].find("AVX512-BF16 block-scaled GEMM") != std::string::npos) << paths[0];
}

// ---------------------------------------------------------------------------------------------------------
// The reference, by hand: T=1, H=2, I=1, E=1, K=1, no gate, relu, weights 1 (scale 1), so that only the
// activation quantisation changes the result. x = [448, 100]: the group's amax is 448, so its scale is 1
// (also as a power of two) and 100 falls exactly halfway between the e4m3 values 96 and 104: the tie goes
// to the even code, 96. The intermediate is then 448 + 96 = 544 (not 548).
// - f32 scales: the scale is the float nearest 544 / 448, s; 544 / s rounds to the code 448, so the down
//   input is 448 * s (544 up to float's rounding of s), and so is out.
// - ue8m0 scales: the scale rounds up to 2, 544 / 2 = 272 lies halfway between 256 and 288: the tie goes to
//   256 (even), so the down input is 512, out = 512.
ExpertsProblem tiny_quantized(DType scale_dtype) {
  ExpertsProblem p;
  p.config.has_gate = false;
  p.config.activation = Activation::relu;
  p.config.quantization.weights = WeightFormat::fp8_e4m3;
  p.hidden_states = test::tensor_of({448.0f, 100.0f}, {1, 2});
  p.top_k_index = test::ids_of({0}, {1, 1});
  p.top_k_weights = test::tensor_of({1.0f}, {1, 1});
  p.gate_up_proj = test::tensor_of({1.0f, 1.0f}, {1, 1, 2}).to(DType::f8_e4m3);
  p.down_proj = test::tensor_of({1.0f, 1.0f}, {1, 2, 1}).to(DType::f8_e4m3);
  p.gate_up_proj_scale_inv = test::tensor_of({1.0f}, {1, 1, 1}).to(scale_dtype);
  p.down_proj_scale_inv = test::tensor_of({1.0f}, {1, 1, 1}).to(scale_dtype);
  return p;
}

TEST(QuantizedReference, ActivationRoundingByHand) {
  const double s = static_cast<double>(544.0f / 448.0f);
  EXPECT_EQ(experts_reference(tiny_quantized(DType::f32)), std::vector<double>({448 * s, 448 * s}));
  EXPECT_EQ(experts_reference(tiny_quantized(DType::ue8m0)), std::vector<double>({512, 512}));
  // Weight scales multiply: a down scale of 0.25 (f32) quarters the output, per output row's block.
  ExpertsProblem p = tiny_quantized(DType::f32);
  p.down_proj_scale_inv = test::tensor_of({0.25f}, {1, 1, 1});
  EXPECT_EQ(experts_reference(p), std::vector<double>({112 * s, 112 * s}));
}

// On a random problem the quantised reference is the unquantised one on the dequantised weights, up to the
// activation quantisation: a few percent apart (e4m3 keeps 3 mantissa bits), never equal.
TEST(QuantizedReference, DiffersFromTheDequantisedProblemByTheActivationRounding) {
  for (auto [format, scale] :
       {std::pair{WeightFormat::fp8_e4m3, DType::f32}, std::pair{WeightFormat::fp4_e2m1, DType::ue8m0}}) {
    RandomProblemOptions o = quantized_options(format, scale);
    o.dtype = DType::f32;
    const ExpertsProblem q = make_random_problem(o);
    ExpertsProblem d = q;
    d.config.quantization = {};
    d.gate_up_proj = dequantize_weights(q.gate_up_proj, q.gate_up_proj_scale_inv, DType::f32);
    d.down_proj = dequantize_weights(q.down_proj, q.down_proj_scale_inv, DType::f32);
    d.gate_up_proj_scale_inv = d.down_proj_scale_inv = Tensor();
    const std::vector<double> a = experts_reference(q), b = experts_reference(d);
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      diff += (a[i] - b[i]) * (a[i] - b[i]);
      norm += b[i] * b[i];
    }
    const double rel = std::sqrt(diff / norm);
    EXPECT_GT(rel, 1e-3) << weight_format_name(format);
    EXPECT_LT(rel, 0.1) << weight_format_name(format);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Refusals

// The problem's tensors as views labelled cuda:0 over the same host bytes: supports() only reads shapes,
// dtypes and devices, so the refusal is checked on machines without a GPU; nothing reads the bytes.
ExpertsProblem labelled_cuda(const ExpertsProblem& p) {
  auto label = [](const Tensor& t) {
    return t.defined() ? Tensor::from_blob(t.data(), t.shape(), t.dtype(), Device::cuda(0)) : Tensor();
  };
  ExpertsProblem q = p;
  for (Tensor* t : {&q.hidden_states, &q.top_k_index, &q.top_k_weights, &q.gate_up_proj, &q.down_proj,
                    &q.gate_up_proj_bias, &q.down_proj_bias, &q.gate_up_proj_scale_inv, &q.down_proj_scale_inv})
    *t = label(*t);
  return q;
}

// On CUDA, the portable backends (eager, batched_mm, grouped_mm) run FP8 and FP4, deepgemm runs FP8;
// everything else is refused by name.
TEST(QuantizedRefusals, BackendsWithoutCudaKernelsRefuseQuantisedProblemsOnCudaByName) {
  for (auto [format, label] : {std::pair{WeightFormat::fp8_e4m3, "FP8"}, std::pair{WeightFormat::fp4_e2m1, "FP4"}}) {
    const ExpertsProblem p = labelled_cuda(make_random_problem(quantized_options(format, DType::ue8m0)));
    ASSERT_NO_THROW(validate(p));
    for (const std::string name : {"eager", "batched_mm", "grouped_mm", "deepgemm", "deepgemm_megamoe", "sonicmoe"}) {
      SCOPED_TRACE(name);
      const Support s = ExpertsInterface::global().get(name).supports(p);
      const std::string refusal = std::string(label) + " experts on CUDA are not implemented yet in " + name;
      const bool portable = name == "eager" || name == "batched_mm" || name == "grouped_mm";
      if (portable || (name == "deepgemm" && format == WeightFormat::fp8_e4m3)) {
        // Accepted as far as quantisation goes; the device check that follows decides on this machine.
        EXPECT_EQ(s.reason.find(refusal), std::string::npos) << s.reason;
        continue;
      }
      EXPECT_FALSE(s.ok);
      EXPECT_NE(s.reason.find(refusal), std::string::npos) << s.reason;
    }
  }
}

TEST(QuantizedRefusals, StaticActivationSchemeIsRefusedByName) {
  RandomProblemOptions o = quantized_options(WeightFormat::fp8_e4m3);
  o.config.quantization.activations = ActivationScheme::static_scales;
  const ExpertsProblem p = make_random_problem(o);
  for (const std::string name : {"eager", "batched_mm", "grouped_mm"}) {
    const Support s = ExpertsInterface::global().get(name).supports(p);
    EXPECT_FALSE(s.ok) << name;
    EXPECT_NE(s.reason.find("\"static\" scheme"), std::string::npos) << s.reason;
    EXPECT_TRUE(throws_error_with([&] { experts_forward(p, name); }, {"cannot run this problem", "\"static\""}));
  }
  EXPECT_TRUE(throws_error_with([&] { experts_reference(p); }, {"static scheme is not supported"}));
}

TEST(BlackwellScales, Ue8m0RequiredOnComputeCapability10Only) {
  const ExpertsProblem f32_scales = make_random_problem(quantized_options(WeightFormat::fp8_e4m3, DType::f32));
  const ExpertsProblem ue8m0_scales = make_random_problem(quantized_options(WeightFormat::fp8_e4m3, DType::ue8m0));
  const ExpertsProblem plain = make_random_problem(quantized_options(WeightFormat::none));
  using backends::blackwell_scale_support;
  for (ComputeCapability cc : {ComputeCapability{10, 0}, ComputeCapability{10, 3}}) {
    const Support s = blackwell_scale_support(f32_scales, cc, "deepgemm");
    EXPECT_FALSE(s.ok) << cc.major << "." << cc.minor;
    EXPECT_NE(s.reason.find("deepgemm on compute capability 10." + std::to_string(cc.minor) +
                            " reads UE8M0 weight scales only, but the scales are f32"),
              std::string::npos)
        << s.reason;
    EXPECT_TRUE(blackwell_scale_support(ue8m0_scales, cc, "deepgemm").ok);
    EXPECT_TRUE(blackwell_scale_support(plain, cc, "deepgemm").ok);
  }
  for (ComputeCapability cc : {ComputeCapability{9, 0}, ComputeCapability{8, 0}, ComputeCapability{12, 0}})
    EXPECT_TRUE(blackwell_scale_support(f32_scales, cc, "deepgemm_megamoe").ok) << cc.major;
}

}  // namespace
}  // namespace moekit

namespace moekit {
namespace {

// The f16 bit pattern's value (no inf / NaN among the patterns below).
double f16_value(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
  return bits & 0x8000 ? -magnitude : magnitude;
}

// e2m1 code n's value (DESIGN §3): sign, 2 exponent bits, 1 mantissa bit, one subnormal.
double e2m1_value(uint32_t n) {
  const uint32_t e = (n >> 1) & 3, m = n & 1;
  const double magnitude = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, static_cast<int>(e) - 1);
  return n & 8 ? -magnitude : magnitude;
}

// The integer conversion the CUDA FP4 tensor-core path uses: every code in every one of the 8 places of a
// packed word comes out as its value times 2^-14, in the half (low: code j, high: code j + 4) of word j.
TEST(Fp4AsF16, EveryCodeInEveryPlaceIsItsValueTimesTwoToTheMinus14) {
  for (int place = 0; place < 8; ++place)
    for (uint32_t n = 0; n < 16; ++n) {
      // The other places hold codes that differ from n, so a conversion reading the wrong place is seen.
      uint32_t word = 0;
      for (int i = 0; i < 8; ++i) word |= (i == place ? n : (n + 3 + static_cast<uint32_t>(i)) % 16) << (4 * i);
      const uint32_t pair = cuda::e2m1_pair_as_f16x2(word, place % 4);
      const auto half = static_cast<uint16_t>(place < 4 ? pair & 0xffffu : pair >> 16);
      EXPECT_EQ(f16_value(half), std::ldexp(e2m1_value(n), -14)) << "code " << n << " in place " << place;
    }
}

TEST(Fp4AsF16, PowersOfTwoAndTheActivationOrder) {
  for (int e = -30; e <= 15; ++e)
    EXPECT_EQ(f16_value(cuda::f16_power_of_two(e)), e < -24 ? 0.0 : std::ldexp(1.0, e)) << "2^" << e;
  // Within each block of 8: values j and j + 4 side by side, a permutation of the block.
  for (int64_t block = 0; block < 3; ++block) {
    std::vector<int> seen(8, 0);
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(cuda::f16_code_position(8 * block + j), 8 * block + 2 * j);
      EXPECT_EQ(cuda::f16_code_position(8 * block + j + 4), 8 * block + 2 * j + 1);
    }
    for (int r = 0; r < 8; ++r) ++seen[static_cast<std::size_t>(cuda::f16_code_position(8 * block + r) - 8 * block)];
    for (int r = 0; r < 8; ++r) EXPECT_EQ(seen[static_cast<std::size_t>(r)], 1);
  }
}

// The FP8 epilogue's division by an activation scale (amax / 448, at least FLT_MIN) must round as the division
// does where it decides the e4m3 code: quantize_rows divides, and both write the same codes, signed zeros
// included (a -0 value has the code 0x80). Checked on amax over the whole float range (scales below
// kSmallestReciprocalScale are taken up by 2^64 with their values) and values of the row, zeros of both signs among
// them.
TEST(ScaleDivision, RoundsAsTheDivisionOnActivationScales) {
  std::mt19937_64 random(7);
  auto from_bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
  };
  int64_t checked = 0, product_differs = 0;
  for (int i = 0; i < 2000000; ++i) {
    // amax: any positive normal float, or one near the threshold of the division (2^-80 .. 2^-48).
    const uint32_t exponent =
        i % 3 == 0 ? 47u + static_cast<uint32_t>(random() % 32) : 1u + static_cast<uint32_t>(random() % 254);
    const float amax = from_bits((exponent << 23) | static_cast<uint32_t>(random() & 0x7fffffu));
    if (!std::isfinite(amax)) continue;
    const float scale = std::fmax(amax / 448.0f, 0x1p-126f);
    const double unit = static_cast<double>(random() >> 11) * 0x1p-53 * 2.0 - 1.0;
    // A row's values: a fraction of amax, or any sign, exponent up to amax's and mantissa (subnormals too).
    const uint32_t bits = static_cast<uint32_t>(random());
    const float value = i % 16 == 5  ? from_bits(bits & 0x80000000u)  // +0 or -0
                        : i % 2 == 0 ? amax * static_cast<float>(unit)
                                     : from_bits((bits & 0x807fffffu) | ((bits >> 8) % (exponent + 1)) << 23);
    if (std::fabs(value) > amax) continue;
    const float reciprocal = cuda::scale_reciprocal(scale);
    const float quotient = value / scale, got = cuda::divide_by_scale(value, cuda::scale_divisor(scale));
    ++checked;
    product_differs += value * reciprocal != quotient;
    // The code is what must agree; the quotients themselves do, except below 2^-10, where the residual may be
    // subnormal and both round to a zero code.
    if (from_float<f8_e4m3>(got).bits != from_float<f8_e4m3>(quotient).bits ||
        std::signbit(got) != std::signbit(quotient) || (std::fabs(quotient) >= 0x1p-10f && got != quotient)) {
      ADD_FAILURE() << std::hexfloat << value << " / " << scale << ": " << got << ", the division gives " << quotient;
      return;
    }
  }
  EXPECT_GT(checked, 1000000);
  // The cases discriminate: the plain product, without the correction, is wrong on some of them.
  EXPECT_GT(product_differs, 1000);
}

}  // namespace
}  // namespace moekit

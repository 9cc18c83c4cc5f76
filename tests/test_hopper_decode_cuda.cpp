// deepgemm and sonicmoe at decode sizes (hopper_decode_streams in cuda/hopper_experts.cu): which problems
// take batched_mm's weight-streaming kernels instead of the grouped GEMM, and that both backends match
// the float64 reference on either side of the limit, in bf16 and with FP8 weights. Needs a compute
// capability 9.0 GPU; skips elsewhere with the reason.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "harness.h"
#ifndef MOEKIT_HAS_CUDA
#define MOEKIT_HAS_CUDA 1  // this file is compiled in CUDA builds only (tests/CMakeLists.txt)
#endif
#include "moekit/backends/portable_backend.h"
#include "moekit/cuda/experts_cuda.h"
#include "moekit/cuda/tensor_map.h"
#include "moekit/device.h"
#include "moekit/testing/random_problem.h"

namespace moekit {
namespace {

std::optional<std::string> no_hopper() {
  if (auto why = test::device_unavailable(Device::cuda())) return "no CUDA device: " + *why;
  if (!cuda::device_is_sm90()) return std::string("deepgemm and sonicmoe run on compute capability 9.0 only");
  return std::nullopt;
}

cuda::ExpertsArgs sizes(int64_t tokens, int64_t experts, int64_t top_k, WeightFormat weights = WeightFormat::none) {
  cuda::ExpertsArgs a;
  a.tokens = tokens;
  a.hidden = 2048;
  a.intermediate = 768;
  a.experts = experts;
  a.top_k = top_k;
  a.weights = weights;
  return a;
}

TEST(HopperDecodeChoice, StreamsFewPairsAboutOnePerExpert) {
  if (auto why = no_hopper()) GTEST_SKIP() << *why;
  // bf16: at most 128 pairs and one per expert.
  EXPECT_TRUE(cuda::hopper_decode_streams(sizes(1, 128, 8)));
  EXPECT_TRUE(cuda::hopper_decode_streams(sizes(16, 128, 8)));
  EXPECT_FALSE(cuda::hopper_decode_streams(sizes(17, 128, 8)));
  EXPECT_FALSE(cuda::hopper_decode_streams(sizes(2, 8, 8)));    // 16 pairs on 8 experts: the grouped GEMM
  EXPECT_FALSE(cuda::hopper_decode_streams(sizes(0, 128, 8)));  // nothing to stream
  // FP8: at most 256 pairs and two per expert.
  EXPECT_TRUE(cuda::hopper_decode_streams(sizes(32, 128, 8, WeightFormat::fp8_e4m3)));
  EXPECT_FALSE(cuda::hopper_decode_streams(sizes(33, 128, 8, WeightFormat::fp8_e4m3)));
  EXPECT_FALSE(cuda::hopper_decode_streams(sizes(4, 8, 8, WeightFormat::fp8_e4m3)));
}

struct DecodeCase {
  const char* backend;
  bool fp8;
  int64_t tokens;
  bool streams;  // what the choice must be
};

std::string case_name(const ::testing::TestParamInfo<DecodeCase>& param) {
  return std::string(param.param.backend) + (param.param.fp8 ? "_fp8" : "_bf16") + "_T" +
         std::to_string(param.param.tokens);
}

class HopperDecodeCuda : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(HopperDecodeCuda, MatchesReferenceOnEitherSideOfTheLimit) {
  if (auto why = no_hopper()) GTEST_SKIP() << *why;
  const DecodeCase c = GetParam();
  RandomProblemOptions o;
  o.tokens = c.tokens;
  o.hidden = 1024;
  o.intermediate = 256;
  o.experts = 32;
  o.top_k = 8;
  o.dtype = DType::bf16;
  o.seed = 5;
  if (c.fp8) {
    o.config.quantization.weights = WeightFormat::fp8_e4m3;
    o.scale_dtype = DType::f32;
  }
  const ExpertsProblem host = make_random_problem(o);
  const ExpertsProblem p = test::problem_on(host, Device::cuda());
  const Support s = ExpertsInterface::global().get(c.backend).supports(p);
  if (!s) GTEST_SKIP() << c.backend << " does not run this problem: " << s.reason;
  ASSERT_EQ(cuda::hopper_decode_streams(backends::cuda_args(p)), c.streams);
  Tensor out = test::poisoned_output(p, Device::cuda());
  experts_forward(p, c.backend, out);
  synchronize(Device::cuda());
  const test::Comparison cmp =
      test::compare_with_reference(out.to(Device::cpu()), experts_reference(host), test::tolerance_for(o.dtype, c.fp8));
  EXPECT_TRUE(cmp.passed()) << cmp.summary();
}

// 32 experts, top 8: 2 tokens (16 pairs) stream in both formats; 6 tokens (48 pairs) only with FP8 (two
// per expert); 12 tokens (96 pairs) in neither.
INSTANTIATE_TEST_SUITE_P(Cases, HopperDecodeCuda,
                         ::testing::Values(DecodeCase{"deepgemm", false, 2, true},
                                           DecodeCase{"deepgemm", false, 6, false},
                                           DecodeCase{"deepgemm", true, 2, true}, DecodeCase{"deepgemm", true, 6, true},
                                           DecodeCase{"deepgemm", true, 12, false},
                                           DecodeCase{"sonicmoe", false, 2, true},
                                           DecodeCase{"sonicmoe", false, 12, false}),
                         case_name);

// The alignment rule that deepgemm's supports words and grouped_mm's choice of kernels asks (host code: no GPU
// needed): 16-byte aligned hidden states and weights, 4-byte aligned biases, absent biases allowed.
TEST(HopperBiasAlignment, RefusalNamesTheRuleOfEachPointer) {
  alignas(16) static uint8_t bytes[64];
  cuda::ExpertsArgs a = sizes(4, 8, 2);
  a.x = a.up = a.down = bytes;
  EXPECT_EQ(cuda::hopper_alignment_refusal(a), nullptr);
  a.up_bias = bytes + 4;
  a.down_bias = bytes + 8;
  EXPECT_EQ(cuda::hopper_alignment_refusal(a), nullptr);
  for (const void** p : {&a.x, &a.up, &a.down}) {
    *p = bytes + 8;
    const char* why = cuda::hopper_alignment_refusal(a);
    ASSERT_NE(why, nullptr);
    EXPECT_NE(std::string(why).find("16-byte aligned hidden states and weights"), std::string::npos) << why;
    *p = bytes;
  }
  for (const void** p : {&a.up_bias, &a.down_bias}) {
    const void* was = *p;
    *p = bytes + 2;
    const char* why = cuda::hopper_alignment_refusal(a);
    ASSERT_NE(why, nullptr);
    EXPECT_NE(std::string(why).find("4-byte aligned"), std::string::npos) << why;
    *p = was;
  }
}

// The Hopper epilogues read biases two at a time: a bias 2 bytes off a 4-byte boundary is refused by deepgemm with
// the reason, and grouped_mm (which then leaves the Hopper GEMM for its portable kernels) still matches the
// reference.
TEST(HopperBiasAlignment, MisalignedBiasRefusedByDeepgemmAndRunByGroupedMm) {
  if (auto why = no_hopper()) GTEST_SKIP() << *why;
  RandomProblemOptions o;
  o.tokens = 300;
  o.hidden = 256;
  o.intermediate = 128;
  o.experts = 8;
  o.top_k = 2;
  o.dtype = DType::bf16;
  o.config.has_bias = true;
  o.seed = 11;
  const ExpertsProblem host = make_random_problem(o);
  ExpertsProblem p = test::problem_on(host, Device::cuda());
  const int64_t n = host.down_proj_bias.numel();
  Tensor flat = Tensor::zeros({n + 1}, DType::bf16);
  std::memcpy(flat.data_as<bf16>() + 1, host.down_proj_bias.data(), host.down_proj_bias.nbytes());
  p.down_proj_bias = flat.to(Device::cuda()).slice(0, 1, n + 1).reshape(host.down_proj_bias.shape());
  ASSERT_NE(reinterpret_cast<uintptr_t>(p.down_proj_bias.data()) % 4, 0u);
  const Support s = ExpertsInterface::global().get("deepgemm").supports(p);
  EXPECT_FALSE(s);
  EXPECT_NE(s.reason.find("4-byte aligned"), std::string::npos) << s.reason;
  Tensor out = test::poisoned_output(p, Device::cuda());
  experts_forward(p, "grouped_mm", out);
  synchronize(Device::cuda());
  const test::Comparison cmp =
      test::compare_with_reference(out.to(Device::cpu()), experts_reference(host), test::tolerance_for(o.dtype, false));
  EXPECT_TRUE(cmp.passed()) << cmp.summary();
}

}  // namespace
}  // namespace moekit

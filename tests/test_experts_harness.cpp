// The experts harness of DESIGN §6: every registered backend, on every device, against the float64 reference,
// on one declared list of cases. Each (backend, device, case) is its own test so that a failure names all
// three. A backend that does not run on a device is skipped with its reason; a portable backend (eager,
// batched_mm, grouped_mm) that runs on the device but declines a problem of the contract fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "harness.h"
#include "harness_cases.h"
#include "moekit/experts.h"
#include "moekit/quantization.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

using test::all_cases;
using test::get_id;
using test::HarnessCase;
using test::make_case_problem;
using test::set_id;
using test::sized;
using test::kDTypes;
using test::tolerance_of;

// The reference of a case, from the very ids the backends get (sentinels up to INT64_MAX included). It
// depends on the case alone and the large cases cost a noticeable fraction of a second, so each is
// computed once and shared by the backends.
const std::vector<double>& reference_of(const HarnessCase& c) {
  static std::map<std::string, std::vector<double>> cache;
  auto it = cache.find(c.name);
  if (it == cache.end()) {
    it = cache.emplace(c.name, experts_reference(make_case_problem(c))).first;
  }
  return it->second;
}

// ---------------------------------------------------------------------------------------------------------
// Parameters: (backend, device, case)

struct HarnessParam {
  std::string backend;
  Device device;
  HarnessCase c;
};

void PrintTo(const HarnessParam& p, std::ostream* os) {
  *os << p.backend << " on " << device_name(p.device) << ", case " << p.c.name;
}

std::string describe(const HarnessParam& p) {
  std::ostringstream os;
  const RandomProblemOptions& o = p.c.options;
  os << "backend " << p.backend << " on " << device_name(p.device) << ", case " << p.c.name << " (T=" << o.tokens
     << " H=" << o.hidden << " I=" << o.intermediate << " E=" << o.experts << " K=" << o.top_k << " "
     << dtype_name(o.dtype) << " ids " << dtype_name(o.index_dtype) << " routing weights "
     << dtype_name(o.weights_dtype) << ", " << o.config.describe() << ", seed " << o.seed << ")";
  return os.str();
}

// Why this backend cannot be tried on this device at all (a skip), or nothing.
std::optional<std::string> device_skip_reason(const HarnessParam& p) {
  if (auto why = test::device_unavailable(p.device)) return device_name(p.device) + " is not available: " + *why;
  const Support s = ExpertsInterface::global().get(p.backend).supports_device(p.device);
  if (!s) return p.backend + " does not run on " + device_name(p.device) + ": " + s.reason;
  return std::nullopt;
}

// Every registered backend: the built-in ones, plus the tests' reference backend as a check of the harness
// itself: it must pass every case, so a failure there points at the harness or at the reference.
std::vector<std::string> harness_backends() {
  test::registered_reference_backend();
  return ExpertsInterface::global().names();
}

// A backend that cannot run on the device (or a device this machine lacks) gets a single test that skips
// with the reason, instead of one skip per case: the reason is the same for all of them, and a test per
// case would cost ctest a process each for nothing.
std::vector<HarnessParam> params_for(Device device, const std::vector<std::string>& case_names = {}) {
  std::vector<HarnessParam> params;
  for (const auto& backend : harness_backends()) {
    if (device_skip_reason({backend, device, {}})) {
      params.push_back({backend, device, {"not_run_on_this_device", {}, {}}});
      continue;
    }
    for (const auto& c : all_cases())
      if (case_names.empty() || std::find(case_names.begin(), case_names.end(), c.name) != case_names.end())
        params.push_back({backend, device, c});
  }
  return params;
}

std::string param_name(const ::testing::TestParamInfo<HarnessParam>& info) {
  return info.param.backend + "__" + info.param.c.name;
}

// ---------------------------------------------------------------------------------------------------------
// The harness

class ExpertsHarness : public ::testing::TestWithParam<HarnessParam> {};

TEST_P(ExpertsHarness, MatchesReference) {
  const HarnessParam& p = GetParam();
  if (auto why = device_skip_reason(p)) GTEST_SKIP() << *why;
  const std::string where = describe(p);
  const std::vector<double>& reference = reference_of(p.c);
  const ExpertsProblem problem = test::problem_on(make_case_problem(p.c), p.device);
  const Support support = ExpertsInterface::global().get(p.backend).supports(problem);
  if (!support) {
    if (test::is_portable_backend(p.backend))
      FAIL() << "a portable backend declined a problem of the contract: " << support.reason << "\n  " << where;
    GTEST_SKIP() << p.backend << " declines this problem: " << support.reason;
  }

  Tensor out = test::poisoned_output(problem, p.device);
  try {
    experts_forward(problem, p.backend, out);
  } catch (const std::exception& e) {
    FAIL() << "experts_forward threw: " << e.what() << "\n  " << where;
  }
  synchronize(p.device);
  const Tensor host = out.to(Device::cpu());
  const test::Comparison c = test::compare_with_reference(host, reference, tolerance_of(p.c));
  EXPECT_TRUE(c.passed()) << c.summary() << "\n  " << where;
  // Kept in --gtest_output=xml so that the margin to the tolerance can be followed over time.
  RecordProperty("overall_rel", (std::ostringstream() << c.overall_rel).str());
  RecordProperty("worst_token_rel", (std::ostringstream() << c.worst_token_rel).str());

  // A token with nothing but sentinels has no contribution at all: exactly zero, not merely small.
  const std::vector<float> values = test::values_of(host);
  const int64_t H = p.c.options.hidden;
  for (int64_t t : p.c.all_sentinel_tokens)
    for (int64_t h = 0; h < H; ++h)
      ASSERT_EQ(values[static_cast<std::size_t>(t * H + h)], 0.0f)
          << "token " << t << " has only sentinels, but out[" << t << ", " << h << "] is not zero\n  " << where;
}

INSTANTIATE_TEST_SUITE_P(Cpu, ExpertsHarness, ::testing::ValuesIn(params_for(Device::cpu())), param_name);
INSTANTIATE_TEST_SUITE_P(Cuda, ExpertsHarness, ::testing::ValuesIn(params_for(Device::cuda())), param_name);

// ---------------------------------------------------------------------------------------------------------
// Checks of the checks, and determinism, on a few cases

class ExpertsHarnessChecks : public ::testing::TestWithParam<HarnessParam> {};

// DESIGN §2: the sum over k runs in a fixed order, so two runs on the same input agree bit for bit. The
// second run writes into an output that experts_forward allocates, so the result cannot depend on what the
// output held before.
TEST_P(ExpertsHarnessChecks, BitIdenticalRuns) {
  const HarnessParam& p = GetParam();
  if (auto why = device_skip_reason(p)) GTEST_SKIP() << *why;
  const ExpertsProblem problem = test::problem_on(make_case_problem(p.c), p.device);
  const Support support = ExpertsInterface::global().get(p.backend).supports(problem);
  if (!support) GTEST_SKIP() << p.backend << " declines this problem (MatchesReference reports it): " << support.reason;
  Tensor first = test::poisoned_output(problem, p.device);
  experts_forward(problem, p.backend, first);
  const Tensor second = experts_forward(problem, p.backend);
  const Tensor a = first.to(Device::cpu()), b = second.to(Device::cpu());
  ASSERT_EQ(a.nbytes(), b.nbytes());
  if (std::memcmp(a.data(), b.data(), a.nbytes()) != 0) {
    const std::vector<float> va = test::values_of(a), vb = test::values_of(b);
    std::size_t i = 0;
    while (i < va.size() && std::memcmp(&va[i], &vb[i], sizeof(float)) == 0) ++i;
    FAIL() << "two runs differ; first at token " << i / p.c.options.hidden << " column " << i % p.c.options.hidden
           << ": " << va[i] << " vs " << vb[i] << "\n  " << describe(p);
  }
}

// Proves that the per-token check can fail on a backend's output: the routing of one token is changed after
// the reference was computed, so that token's output comes from another expert.
TEST_P(ExpertsHarnessChecks, WrongExpertIsCaught) {
  const HarnessParam& p = GetParam();
  if (auto why = device_skip_reason(p)) GTEST_SKIP() << *why;
  const std::vector<double>& reference = reference_of(p.c);
  ExpertsProblem host = make_case_problem(p.c);
  const int64_t token = p.c.options.tokens / 2;
  set_id(host, token, 0, (get_id(host, token, 0) + 1) % p.c.options.experts);
  const ExpertsProblem problem = test::problem_on(host, p.device);
  const Support support = ExpertsInterface::global().get(p.backend).supports(problem);
  if (!support) GTEST_SKIP() << p.backend << " declines this problem (MatchesReference reports it): " << support.reason;
  Tensor out = test::poisoned_output(problem, p.device);
  experts_forward(problem, p.backend, out);
  const test::Comparison c = test::compare_with_reference(out.to(Device::cpu()), reference, tolerance_of(p.c));
  EXPECT_FALSE(c.passed()) << "a wrong expert for token " << token << " went unnoticed: " << c.summary();
  EXPECT_FALSE(c.per_token_ok());
  // The token shows either as the worst relative error or, when its true output is zero (all its other slots
  // sentinels), as the zero row that is furthest from zero.
  EXPECT_TRUE(c.worst_token == token || c.worst_zero_row == token) << c.summary();
}

const std::vector<std::string> kCheckedCases = {"large_f32_swiglu",
                                                "large_f16_gptoss",
                                                "large_bf16_swiglu",
                                                "sentinels_bf16_relu2_nogate",
                                                "odd_sizes_bf16_gptoss",
                                                "large_fp8_bf16_swiglu",
                                                "large_fp8ue8m0_f32_swiglu",
                                                "partial_blocks_fp4_bf16_gptoss",
                                                "sentinels_fp8_bf16_relu2_nogate",
                                                "tiled_partial_fp4_bf16_gptoss_untransposed"};

INSTANTIATE_TEST_SUITE_P(Cpu, ExpertsHarnessChecks, ::testing::ValuesIn(params_for(Device::cpu(), kCheckedCases)),
                         param_name);
INSTANTIATE_TEST_SUITE_P(Cuda, ExpertsHarnessChecks, ::testing::ValuesIn(params_for(Device::cuda(), kCheckedCases)),
                         param_name);

// Without any backend: one token routed to the wrong expert among 50,000 moves the global relative error by
// about sqrt(2 / 50,000) = 0.6%, well inside the 2e-2 bound, so only the per-token check can see it. The
// "backend output" here is the reference of the corrupted routing rounded to bf16.
TEST(ExpertsHarnessCheck, GlobalNormHidesAWrongExpertThePerTokenCheckDoesNot) {
  RandomProblemOptions o = sized(50000, 8, 4, 4, 1, DType::bf16, ExpertsConfig{});
  o.seed = 99;
  ExpertsProblem p = make_random_problem(o);
  const std::vector<double> reference = experts_reference(p);
  const int64_t token = 31337;
  set_id(p, token, 0, (get_id(p, token, 0) + 1) % o.experts);
  const std::vector<double> corrupted = experts_reference(p);
  const Tensor out =
      test::tensor_of(std::vector<float>(corrupted.begin(), corrupted.end()), {o.tokens, o.hidden}, DType::bf16);
  const test::Comparison c = test::compare_with_reference(out, reference, test::tolerance_for(DType::bf16));
  EXPECT_TRUE(c.overall_ok()) << "the premise of this test: the global norm alone passes. " << c.summary();
  EXPECT_FALSE(c.per_token_ok()) << c.summary();
  EXPECT_FALSE(c.passed());
  EXPECT_EQ(c.worst_token, token) << c.summary();

  // And the uncorrupted output, rounded the same way, passes: the failure above is the wrong expert alone.
  const Tensor good =
      test::tensor_of(std::vector<float>(reference.begin(), reference.end()), {o.tokens, o.hidden}, DType::bf16);
  EXPECT_TRUE(test::compare_with_reference(good, reference, test::tolerance_for(DType::bf16)).passed());
}

// The quantised cases' tolerance (test::tolerance_for) must be tight enough to fail a backend that quantises
// the weights but not the activations: the reference of the same weights without the activation
// quantisation, compared as a backend's output, fails on every quantised large case.
TEST(ExpertsHarnessCheck, SkippedActivationQuantisationIsCaught) {
  int checked = 0;
  for (const HarnessCase& c : all_cases()) {
    if (!c.options.config.quantization.quantized() || c.name.rfind("large_", 0) != 0) continue;
    const ExpertsProblem q = make_case_problem(c);
    ExpertsProblem d = q;  // the same weights, dequantised exactly (f32), activations left alone
    d.config.quantization = {};
    d.gate_up_proj = dequantize_weights(q.gate_up_proj, q.gate_up_proj_scale_inv, DType::f32);
    d.down_proj = dequantize_weights(q.down_proj, q.down_proj_scale_inv, DType::f32);
    d.gate_up_proj_scale_inv = d.down_proj_scale_inv = Tensor();
    d.hidden_states = q.hidden_states.to(DType::f32);
    if (d.config.has_bias) {
      d.gate_up_proj_bias = q.gate_up_proj_bias.to(DType::f32);
      d.down_proj_bias = q.down_proj_bias.to(DType::f32);
    }
    d.top_k_weights = q.top_k_weights.to(DType::f32);
    const std::vector<double> skipped = experts_reference(d);
    const Tensor out = test::tensor_of(std::vector<float>(skipped.begin(), skipped.end()),
                                       {c.options.tokens, c.options.hidden}, DType::f32);
    const test::Comparison cmp = test::compare_with_reference(out, reference_of(c), tolerance_of(c));
    EXPECT_FALSE(cmp.passed()) << c.name << ": " << cmp.summary();
    ++checked;
  }
  EXPECT_GE(checked, 5);
}

// NaN never passes, not even one element, and neither does an output left as the poison.
TEST(ExpertsHarnessCheck, NaNAndPoisonNeverPass) {
  RandomProblemOptions o = sized(6, 16, 8, 4, 2, DType::f32, ExpertsConfig{});
  const ExpertsProblem p = make_random_problem(o);
  const std::vector<double> reference = experts_reference(p);
  Tensor out = test::tensor_of(std::vector<float>(reference.begin(), reference.end()), {6, 16});
  EXPECT_TRUE(test::compare_with_reference(out, reference, test::tolerance_for(DType::f32)).passed());
  out.data_as<float>()[37] = std::numeric_limits<float>::quiet_NaN();
  const test::Comparison one_nan = test::compare_with_reference(out, reference, test::tolerance_for(DType::f32));
  EXPECT_FALSE(one_nan.passed());
  EXPECT_EQ(one_nan.nonfinite, 1);
  EXPECT_EQ(one_nan.first_nonfinite, 37);
  for (DType dtype : kDTypes) {
    ExpertsProblem q = p;
    q.hidden_states = p.hidden_states.to(dtype);
    const Tensor poisoned = test::poisoned_output(q, Device::cpu());
    const test::Comparison c = test::compare_with_reference(poisoned, reference, test::tolerance_for(dtype));
    EXPECT_FALSE(c.passed()) << dtype_name(dtype);
    EXPECT_EQ(c.nonfinite, 6 * 16) << dtype_name(dtype) << ": 0xFF bytes must read as NaN";
  }
}

// A row whose reference is zero must come out (near) zero; the relative check has nothing to divide by.
TEST(ExpertsHarnessCheck, ZeroReferenceRowsAreCheckedAbsolutely) {
  const std::vector<double> reference = {0, 0, 1, 2};
  Tensor out = test::tensor_of({0, 1e-3f, 1, 2}, {2, 2});
  const test::Comparison c = test::compare_with_reference(out, reference, test::tolerance_for(DType::bf16));
  EXPECT_FALSE(c.passed());
  EXPECT_EQ(c.worst_zero_row, 0);
  out = test::tensor_of({0, 0, 1, 2}, {2, 2});
  EXPECT_TRUE(test::compare_with_reference(out, reference, test::tolerance_for(DType::bf16)).passed());
}

}  // namespace
}  // namespace moekit

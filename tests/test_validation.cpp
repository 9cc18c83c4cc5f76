// Validation of an experts problem: every malformed input is rejected with a moekit::Error that names the
// tensor and what was expected.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/experts.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

using test::throws_error_with;

// Sizes chosen pairwise distinct (T=4, H=12, I=5 so 2I=10, E=3, K=2) so that a message quoting the wrong
// size, or the right size of the wrong dimension, cannot pass by coincidence.
RandomProblemOptions base_options(ExpertsConfig config = {}) {
  RandomProblemOptions o;
  o.tokens = 4;
  o.hidden = 12;
  o.intermediate = 5;
  o.experts = 3;
  o.top_k = 2;
  o.dtype = DType::bf16;
  o.config = config;
  o.seed = 11;
  return o;
}

ExpertsProblem valid_problem(ExpertsConfig config = {}) {
  return make_random_problem(base_options(config));
}

ExpertsConfig with_bias() {
  ExpertsConfig c;
  c.has_bias = true;
  return c;
}

::testing::AssertionResult rejects(const ExpertsProblem& p, const std::vector<std::string>& parts) {
  return throws_error_with([&] { validate(p); }, parts);
}

// The same logical shape with its last two dimensions stored the other way round: a non-contiguous view
// holding the same values.
Tensor transposed_view(const Tensor& t) {
  return t.transpose(-1, -2).contiguous().transpose(-1, -2);
}

TEST(Validation, ValidProblemsPass) {
  for (bool has_gate : {true, false})
    for (bool has_bias : {false, true})
      for (bool transposed : {false, true}) {
        ExpertsConfig c;
        c.has_gate = has_gate;
        c.has_bias = has_bias;
        c.is_transposed = transposed;
        SCOPED_TRACE(c.describe());
        const ExpertsShape s = validate(valid_problem(c));
        EXPECT_EQ(s.tokens, 4);
        EXPECT_EQ(s.hidden, 12);
        EXPECT_EQ(s.intermediate, 5);
        EXPECT_EQ(s.experts, 3);
        EXPECT_EQ(s.top_k, 2);
      }
  // Routing weights may be f32 or the activation dtype; ids i32 or i64; zero tokens is a valid batch.
  RandomProblemOptions o = base_options();
  o.weights_dtype = DType::bf16;
  o.index_dtype = DType::i32;
  o.tokens = 0;
  EXPECT_EQ(validate(make_random_problem(o)).tokens, 0);
}

TEST(Validation, MissingTensors) {
  ExpertsProblem p = valid_problem();
  p.hidden_states = Tensor();
  EXPECT_TRUE(rejects(p, {"hidden_states is missing"}));
  p = valid_problem();
  p.top_k_index = Tensor();
  EXPECT_TRUE(rejects(p, {"top_k_index is missing"}));
  p = valid_problem();
  p.top_k_weights = Tensor();
  EXPECT_TRUE(rejects(p, {"top_k_weights is missing"}));
  p = valid_problem();
  p.gate_up_proj = Tensor();
  EXPECT_TRUE(rejects(p, {"gate_up_proj is missing"}));
  p = valid_problem();
  p.down_proj = Tensor();
  EXPECT_TRUE(rejects(p, {"down_proj is missing"}));
}

TEST(Validation, WrongRanks) {
  ExpertsProblem p = valid_problem();
  p.hidden_states = p.hidden_states.reshape({48});
  EXPECT_TRUE(rejects(p, {"hidden_states must have rank 2", "bf16[48]"}));
  p = valid_problem();
  p.hidden_states = p.hidden_states.reshape({2, 2, 12});
  EXPECT_TRUE(rejects(p, {"hidden_states must have rank 2", "bf16[2, 2, 12]"}));
  p = valid_problem();
  p.top_k_index = p.top_k_index.reshape({8});
  EXPECT_TRUE(rejects(p, {"top_k_index must have rank 2", "i64[8]"}));
  p = valid_problem();
  p.top_k_weights = p.top_k_weights.reshape({4, 2, 1});
  EXPECT_TRUE(rejects(p, {"top_k_weights must have rank 2", "f32[4, 2, 1]"}));
  p = valid_problem();
  p.gate_up_proj = p.gate_up_proj.reshape({30, 12});
  EXPECT_TRUE(rejects(p, {"gate_up_proj must have rank 3", "bf16[30, 12]"}));
  p = valid_problem();
  p.down_proj = p.down_proj.reshape({3, 12, 5, 1});
  EXPECT_TRUE(rejects(p, {"down_proj must have rank 3", "bf16[3, 12, 5, 1]"}));
  p = valid_problem(with_bias());
  p.gate_up_proj_bias = p.gate_up_proj_bias.reshape({30});
  EXPECT_TRUE(rejects(p, {"gate_up_proj_bias must have rank 2", "bf16[30]"}));
  p = valid_problem(with_bias());
  p.down_proj_bias = p.down_proj_bias.reshape({3, 12, 1});
  EXPECT_TRUE(rejects(p, {"down_proj_bias must have rank 2", "bf16[3, 12, 1]"}));
  // Without a gate the first weight is called up_proj in messages, as in transformers.
  ExpertsConfig ungated;
  ungated.has_gate = false;
  p = valid_problem(ungated);
  p.gate_up_proj = p.gate_up_proj.reshape({15, 12});
  EXPECT_TRUE(rejects(p, {"up_proj must have rank 3"}));
}

TEST(Validation, WrongShapes) {
  ExpertsProblem p = valid_problem();
  p.hidden_states = Tensor::zeros({4, 0}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"hidden_states has hidden size 0", "bf16[4, 0]"}));

  p = valid_problem();
  p.top_k_index = test::ids_of({0, 1, 0, 1, 0, 1, 0, 1, 0, 1}, {5, 2});
  EXPECT_TRUE(rejects(p, {"top_k_index must have 4 rows (one per token of hidden_states)", "i64[5, 2]"}));
  p = valid_problem();
  p.top_k_index = Tensor::zeros({4, 0}, DType::i64);
  EXPECT_TRUE(rejects(p, {"top_k_index must have at least one column", "i64[4, 0]"}));

  p = valid_problem();
  p.top_k_weights = Tensor::zeros({4, 3}, DType::f32);
  EXPECT_TRUE(rejects(p, {"top_k_weights must be [4, 2] (the shape of top_k_index)", "f32[4, 3]"}));
  p = valid_problem();
  p.top_k_weights = Tensor::zeros({3, 2}, DType::f32);
  EXPECT_TRUE(rejects(p, {"top_k_weights must be [4, 2]", "f32[3, 2]"}));

  p = valid_problem();
  p.gate_up_proj = Tensor::zeros({3, 10, 13}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"gate_up_proj dimension 2 must be the hidden size 12 ([E, N, H])", "bf16[3, 10, 13]"}));
  ExpertsConfig transposed;
  transposed.is_transposed = true;
  p = valid_problem(transposed);
  p.gate_up_proj = Tensor::zeros({3, 10, 12}, DType::bf16);  // the canonical layout passed as transposed
  EXPECT_TRUE(rejects(
      p, {"gate_up_proj dimension 1 must be the hidden size 12 (is_transposed: [E, H, N])", "bf16[3, 10, 12]"}));
  p = valid_problem();
  p.gate_up_proj = Tensor::zeros({0, 10, 12}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"gate_up_proj has no experts"}));

  p = valid_problem();
  p.down_proj = Tensor::zeros({3, 12, 6}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"down_proj must be [3, 12, 5] ([E, H, I])", "bf16[3, 12, 6]"}));
  p = valid_problem();
  p.down_proj = Tensor::zeros({3, 5, 12}, DType::bf16);  // the transposed layout passed as canonical
  EXPECT_TRUE(rejects(p, {"down_proj must be [3, 12, 5] ([E, H, I])", "bf16[3, 5, 12]"}));
  p = valid_problem(transposed);
  p.down_proj = Tensor::zeros({3, 12, 5}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"down_proj must be [3, 5, 12] (is_transposed: [E, I, H])", "bf16[3, 12, 5]"}));

  p = valid_problem(with_bias());
  p.gate_up_proj_bias = Tensor::zeros({3, 5}, DType::bf16);  // I instead of 2I
  EXPECT_TRUE(rejects(p, {"gate_up_proj_bias must be [3, 10]", "bf16[3, 5]"}));
  p = valid_problem(with_bias());
  p.down_proj_bias = Tensor::zeros({3, 5}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"down_proj_bias must be [3, 12] ([E, H])", "bf16[3, 5]"}));
  p = valid_problem(with_bias());
  p.down_proj_bias = Tensor::zeros({2, 12}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"down_proj_bias must be [3, 12]", "bf16[2, 12]"}));
  ExpertsConfig ungated_bias = with_bias();
  ungated_bias.has_gate = false;
  p = valid_problem(ungated_bias);
  p.gate_up_proj_bias = Tensor::zeros({3, 10}, DType::bf16);  // 2I, but without a gate N = I
  EXPECT_TRUE(rejects(p, {"up_proj_bias must be [3, 5]", "bf16[3, 10]"}));
}

TEST(Validation, MismatchedExpertCounts) {
  ExpertsProblem p = valid_problem();
  p.down_proj = Tensor::zeros({2, 12, 5}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"down_proj has 2 experts but gate_up_proj has 3"}));
  p = valid_problem();
  p.down_proj = Tensor::zeros({4, 12, 5}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"down_proj has 4 experts but gate_up_proj has 3"}));
}

TEST(Validation, OddGateUpRowsWithGate) {
  ExpertsProblem p = valid_problem();
  p.gate_up_proj = Tensor::zeros({3, 9, 12}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"gate_up_proj dimension 1 must be 2 * intermediate size (gate and up)", "9"}));
  ExpertsConfig transposed;
  transposed.is_transposed = true;
  p = valid_problem(transposed);
  p.gate_up_proj = Tensor::zeros({3, 12, 9}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"gate_up_proj dimension 2 must be 2 * intermediate size"}));
  p = valid_problem();
  p.gate_up_proj = Tensor::zeros({3, 0, 12}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"gate_up_proj dimension 1 must be 2 * intermediate size"}));
  // Without a gate an odd intermediate size is fine; zero is not.
  ExpertsConfig ungated;
  ungated.has_gate = false;
  p = valid_problem(ungated);
  EXPECT_EQ(validate(p).intermediate, 5);
  p.gate_up_proj = Tensor::zeros({3, 0, 12}, DType::bf16);
  EXPECT_TRUE(rejects(p, {"up_proj has intermediate size 0"}));
}

TEST(Validation, WrongDTypes) {
  ExpertsProblem p = valid_problem();
  p.hidden_states = Tensor::zeros({4, 12}, DType::i32);
  EXPECT_TRUE(rejects(p, {"hidden_states must be f32, f16 or bf16", "i32[4, 12]"}));

  p = valid_problem();
  p.gate_up_proj = p.gate_up_proj.to(DType::f16);
  EXPECT_TRUE(rejects(p, {"gate_up_proj must have the dtype of hidden_states (bf16)", "f16[3, 10, 12]"}));
  p = valid_problem();
  p.down_proj = p.down_proj.to(DType::f32);
  EXPECT_TRUE(rejects(p, {"down_proj must have the dtype of hidden_states (bf16)", "f32[3, 12, 5]"}));
  p = valid_problem(with_bias());
  p.gate_up_proj_bias = p.gate_up_proj_bias.to(DType::f32);
  EXPECT_TRUE(rejects(p, {"biases must have the dtype of hidden_states (bf16)", "f32[3, 10]"}));
  p = valid_problem(with_bias());
  p.down_proj_bias = p.down_proj_bias.to(DType::f16);
  EXPECT_TRUE(rejects(p, {"biases must have the dtype of hidden_states (bf16)", "f16[3, 12]"}));

  // Routing weights: f32 or the activation dtype, never another 16-bit type.
  p = valid_problem();
  p.top_k_weights = p.top_k_weights.to(DType::f16);
  EXPECT_TRUE(rejects(p, {"top_k_weights must be f32 or bf16 (the dtype of hidden_states)", "f16[4, 2]"}));
  p = valid_problem();
  p.top_k_weights = p.top_k_weights.to(DType::i64);
  EXPECT_TRUE(rejects(p, {"top_k_weights must be f32 or bf16", "i64[4, 2]"}));
  p = valid_problem();
  p.top_k_weights = p.top_k_weights.to(DType::bf16);
  EXPECT_NO_THROW(validate(p));
  // In a float32 problem the two allowed dtypes are one.
  RandomProblemOptions f32 = base_options();
  f32.dtype = DType::f32;
  p = make_random_problem(f32);
  p.top_k_weights = p.top_k_weights.to(DType::bf16);
  EXPECT_TRUE(rejects(p, {"top_k_weights must be f32, got bf16[4, 2]"}));

  // Ids are integers.
  p = valid_problem();
  p.top_k_index = p.top_k_index.to(DType::f32);
  EXPECT_TRUE(rejects(p, {"top_k_index must be i32 or i64", "f32[4, 2]"}));
  p = valid_problem();
  p.top_k_index = Tensor::zeros({4, 2}, DType::u8);
  EXPECT_TRUE(rejects(p, {"top_k_index must be i32 or i64", "u8[4, 2]"}));
}

TEST(Validation, BiasAndConfigMismatches) {
  // Biases given while has_bias is false would be silently ignored: refuse instead.
  ExpertsProblem p = valid_problem(with_bias());
  p.config.has_bias = false;
  EXPECT_TRUE(rejects(p, {"bias tensors were given but config.has_bias is false"}));
  p.gate_up_proj_bias = Tensor();
  EXPECT_TRUE(rejects(p, {"bias tensors were given but config.has_bias is false"}));

  p = valid_problem();
  p.config.has_bias = true;
  EXPECT_TRUE(rejects(p, {"gate_up_proj_bias is missing"}));
  p = valid_problem(with_bias());
  p.down_proj_bias = Tensor();
  EXPECT_TRUE(rejects(p, {"down_proj_bias is missing"}));
  ExpertsConfig ungated = with_bias();
  ungated.has_gate = false;
  p = valid_problem(ungated);
  p.gate_up_proj_bias = Tensor();
  EXPECT_TRUE(rejects(p, {"up_proj_bias is missing"}));
}

TEST(Validation, SwigluLimitNeedsGatedSilu) {
  ExpertsConfig c;
  c.swiglu_limit = 7.0f;
  c.activation = Activation::relu;
  EXPECT_TRUE(rejects(valid_problem(c), {"swiglu_limit (the GPT-OSS clamped SwiGLU) needs has_gate and activation silu",
                                         "activation=relu"}));
  c.activation = Activation::silu;
  c.has_gate = false;
  EXPECT_TRUE(rejects(valid_problem(c), {"needs has_gate and activation silu", "has_gate=0"}));
  c.has_gate = true;
  EXPECT_NO_THROW(validate(valid_problem(c)));
  c.swiglu_limit = 0.0f;
  EXPECT_TRUE(rejects(valid_problem(c), {"swiglu_limit must be positive, got 0"}));
  c.swiglu_limit = -7.0f;
  EXPECT_TRUE(rejects(valid_problem(c), {"swiglu_limit must be positive, got -7"}));
}

TEST(Validation, NonContiguousTensors) {
  ExpertsProblem p = valid_problem();
  p.hidden_states = transposed_view(p.hidden_states);
  EXPECT_TRUE(rejects(p, {"hidden_states must be contiguous", "strides [1, 4]"}));
  p = valid_problem();
  p.top_k_index = transposed_view(p.top_k_index);
  EXPECT_TRUE(rejects(p, {"top_k_index must be contiguous", "strides [1, 4]"}));
  p = valid_problem();
  p.top_k_weights = transposed_view(p.top_k_weights);
  EXPECT_TRUE(rejects(p, {"top_k_weights must be contiguous"}));
  p = valid_problem();
  p.gate_up_proj = transposed_view(p.gate_up_proj);
  EXPECT_TRUE(rejects(p, {"gate_up_proj must be contiguous", "strides [120, 1, 10]"}));
  p = valid_problem();
  p.down_proj = transposed_view(p.down_proj);
  EXPECT_TRUE(rejects(p, {"down_proj must be contiguous"}));
  p = valid_problem(with_bias());
  p.gate_up_proj_bias = transposed_view(p.gate_up_proj_bias);
  EXPECT_TRUE(rejects(p, {"gate_up_proj_bias must be contiguous"}));
  p = valid_problem(with_bias());
  p.down_proj_bias = transposed_view(p.down_proj_bias);
  EXPECT_TRUE(rejects(p, {"down_proj_bias must be contiguous"}));
  // A column slice is strided as well.
  p = valid_problem();
  p.hidden_states = Tensor::zeros({4, 24}, DType::bf16).slice(1, 0, 12);
  EXPECT_TRUE(rejects(p, {"hidden_states must be contiguous", "strides [24, 1]"}));
}

TEST(Validation, MixedDevices) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "needs a CUDA device: " << *why;
  ExpertsProblem p = valid_problem();
  p.top_k_weights = p.top_k_weights.to(Device::cuda());
  EXPECT_TRUE(rejects(p, {"top_k_weights is on cuda:0 but hidden_states is on cpu"}));
  p = valid_problem();
  p.down_proj = p.down_proj.to(Device::cuda());
  EXPECT_TRUE(rejects(p, {"down_proj is on cuda:0 but hidden_states is on cpu"}));
}

// Writes id into top_k_index[token, slot] whatever the index dtype.
void set_id(ExpertsProblem& p, int64_t token, int64_t slot, int64_t id) {
  visit_index_dtype(p.top_k_index.dtype(), [&](auto tag) {
    using I = typename decltype(tag)::type;
    p.top_k_index.data_as<I>()[token * p.top_k_index.size(1) + slot] = static_cast<I>(id);
  });
}

TEST(Validation, NegativeIdsNameTheTokenAndSlot) {
  for (DType index_dtype : {DType::i32, DType::i64}) {
    SCOPED_TRACE(dtype_name(index_dtype));
    RandomProblemOptions o = base_options();
    o.index_dtype = index_dtype;
    ExpertsProblem p = make_random_problem(o);
    EXPECT_NO_THROW(check_routing_ids(p));
    set_id(p, 2, 1, -1);
    EXPECT_NO_THROW(validate(p)) << "validate does not read ids";
    EXPECT_TRUE(throws_error_with([&] { check_routing_ids(p); }, {"top_k_index[2, 1] = -1 is negative"}));
    EXPECT_TRUE(throws_error_with([&] { experts_reference(p); }, {"top_k_index[2, 1] = -1 is negative"}));
    const int64_t lowest =
        index_dtype == DType::i32 ? std::numeric_limits<int32_t>::min() : std::numeric_limits<int64_t>::min();
    set_id(p, 2, 1, 0);
    set_id(p, 3, 0, lowest);
    EXPECT_TRUE(throws_error_with([&] { check_routing_ids(p); },
                                  {"top_k_index[3, 0] = " + std::to_string(lowest) + " is negative"}));
    // Ids at or beyond E are sentinels, not errors, up to the largest id of the type.
    set_id(p, 3, 0, 3);
    set_id(p, 0, 1,
           index_dtype == DType::i32 ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int64_t>::max());
    EXPECT_NO_THROW(check_routing_ids(p));
  }
}

// The checks of experts_forward, run through every backend that accepts a CPU problem; the test_reference
// user backend is among them, so the checks of experts_forward itself are exercised even in a build where
// no built-in backend runs on the CPU.
class ForwardValidation : public ::testing::TestWithParam<std::string> {
 protected:
  // Skips unless the backend runs this valid problem on the CPU: a refusal there is the harness's business.
  bool accepts(const ExpertsProblem& p) {
    ExpertsBackend& backend = ExpertsInterface::global().get(GetParam());
    const Support device = backend.supports_device(Device::cpu());
    if (!device) {
      skip_reason_ = GetParam() + " does not run on the CPU: " + device.reason;
      return false;
    }
    const Support problem = backend.supports(p);
    if (!problem) {
      skip_reason_ = GetParam() + " declines the problem: " + problem.reason;
      return false;
    }
    return true;
  }
  std::string skip_reason_;
};

TEST_P(ForwardValidation, NegativeIdIsRejectedNamingTokenAndSlot) {
  for (DType index_dtype : {DType::i32, DType::i64}) {
    SCOPED_TRACE(dtype_name(index_dtype));
    RandomProblemOptions o = base_options();
    o.index_dtype = index_dtype;
    ExpertsProblem p = make_random_problem(o);
    if (!accepts(p)) GTEST_SKIP() << skip_reason_;
    set_id(p, 2, 1, -1);
    EXPECT_TRUE(throws_error_with([&] { experts_forward(p, GetParam()); }, {"top_k_index[2, 1]", "negative"}));
  }
}

TEST_P(ForwardValidation, OutputWithTheWrongShapeIsRejected) {
  const ExpertsProblem p = valid_problem();
  if (!accepts(p)) GTEST_SKIP() << skip_reason_;
  const std::string expected = "out must be a contiguous bf16[4, 12] on cpu";
  EXPECT_TRUE(throws_error_with(
      [&] {
        experts_forward(p, GetParam(), Tensor::empty({5, 12}, DType::bf16));
      },
      {expected, "got bf16[5, 12] on cpu"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        experts_forward(p, GetParam(), Tensor::empty({4, 13}, DType::bf16));
      },
      {expected, "got bf16[4, 13] on cpu"}));
  EXPECT_TRUE(throws_error_with([&] { experts_forward(p, GetParam(), Tensor::empty({48}, DType::bf16)); },
                                {expected, "got bf16[48] on cpu"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        experts_forward(p, GetParam(), Tensor::empty({4, 12}, DType::f32));
      },
      {expected, "got f32[4, 12] on cpu"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        experts_forward(p, GetParam(), Tensor::empty({12, 4}, DType::bf16).transpose(0, 1));
      },
      {expected}));
}

// Invalid problems are refused by experts_forward before the backend sees them.
TEST_P(ForwardValidation, InvalidProblemIsRejected) {
  ExpertsProblem p = valid_problem();
  if (!accepts(p)) GTEST_SKIP() << skip_reason_;
  p.down_proj = Tensor::zeros({2, 12, 5}, DType::bf16);
  EXPECT_TRUE(throws_error_with([&] { experts_forward(p, GetParam()); }, {"down_proj has 2 experts"}));
}

std::vector<std::string> cpu_candidate_backends() {
  test::registered_reference_backend();
  return ExpertsInterface::global().names();
}

INSTANTIATE_TEST_SUITE_P(Validation, ForwardValidation, ::testing::ValuesIn(cpu_candidate_backends()),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace moekit

// The MoE block: transformers' own blocks (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock with its
// sigmoid-gated shared expert, DeepseekV3MoE with grouped routing, a correction bias and a shared
// expert), from scripts/make_moe_block_fixtures.py (transformers 5.17, float32, CPU), run with every
// CPU experts backend; a bf16 run against the float32 one; and the validation errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "harness.h"
#include "moekit/model/moe_block.h"
#include "moekit/safetensors.h"

namespace moekit {
namespace {

using test::throws_error_with;

struct Fixture {
  Tensor hidden, output;
  MoeBlockWeights weights;
  RouterConfig router;
};

Fixture load_fixture(const std::string& name) {
  const SafetensorsFile file(std::string(MOEKIT_FIXTURES_DIR) + "/moe_block/" + name + ".safetensors");
  const auto& meta = file.metadata();
  auto get = [&](const std::string& key) { return file.contains(key) ? file.tensor(key).clone() : Tensor(); };
  Fixture f;
  f.hidden = get("hidden");
  f.output = get("output");
  f.weights.router_weight = get("router_weight");
  f.weights.router_bias = get("router_bias");
  f.weights.correction_bias = get("correction_bias");
  f.weights.experts.gate_up_proj = get("experts.gate_up_proj");
  f.weights.experts.down_proj = get("experts.down_proj");
  f.weights.shared_gate_proj = get("shared_gate_proj");
  f.weights.shared_up_proj = get("shared_up_proj");
  f.weights.shared_down_proj = get("shared_down_proj");
  f.weights.shared_expert_gate = get("shared_expert_gate");
  const std::string kind = meta.at("kind");
  f.router.kind = kind == "softmax_topk"   ? RouterKind::softmax_topk
                  : kind == "topk_softmax" ? RouterKind::topk_softmax
                                           : RouterKind::deepseek_v3;
  f.router.num_experts = f.weights.router_weight.size(0);
  f.router.top_k = std::stoll(meta.at("top_k"));
  f.router.norm_topk_prob = meta.at("norm_topk_prob") == "true";
  if (f.router.kind == RouterKind::deepseek_v3) {
    f.router.n_group = std::stoll(meta.at("n_group"));
    f.router.topk_group = std::stoll(meta.at("topk_group"));
    f.router.routed_scaling_factor = std::stof(meta.at("routed_scaling_factor"));
  }
  return f;
}

// Relative L2 error of got against want (float32 [T, H]) overall and of the worst token.
std::pair<double, double> relative_l2(const Tensor& got, const Tensor& want) {
  const Tensor g = got.dtype() == DType::f32 ? got : got.to(DType::f32);
  const int64_t T = want.size(0), H = want.size(1);
  const float* a = g.data_as<float>();
  const float* b = want.data_as<float>();
  double num = 0, den = 0, worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    double n = 0, d = 0;
    for (int64_t h = 0; h < H; ++h) {
      const double diff = double(a[t * H + h]) - double(b[t * H + h]);
      n += diff * diff;
      d += double(b[t * H + h]) * double(b[t * H + h]);
    }
    num += n;
    den += d;
    worst = std::max(worst, std::sqrt(n / std::max(d, 1e-30)));
  }
  return {std::sqrt(num / std::max(den, 1e-30)), worst};
}

class MoeBlockTransformers : public testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(MoeBlockTransformers, MatchesTransformersOutput) {
  const auto& [name, backend] = GetParam();
  const Fixture f = load_fixture(name);
  ASSERT_TRUE(f.hidden.defined() && f.output.defined());
  const Tensor out = moe_block_forward(f.hidden, f.weights, f.router, ExpertsConfig(), backend);
  ASSERT_EQ(out.shape(), f.output.shape());
  ASSERT_EQ(out.dtype(), DType::f32);
  const auto [overall, worst_token] = relative_l2(out, f.output);
  EXPECT_LE(overall, 1e-5) << name << " / " << backend;
  EXPECT_LE(worst_token, 1e-5) << name << " / " << backend;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MoeBlockTransformers,
                         testing::Combine(testing::Values("qwen3_moe", "qwen2_moe_shared", "deepseek_v3"),
                                          testing::Values("eager", "batched_mm", "grouped_mm")),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) + "_" + std::get<1>(param_info.param);
                         });

// The shared expert contributes: dropping it changes the output (the fixtures' shared parts are not
// negligible, so the comparison above really checks them).
TEST(MoeBlock, SharedExpertContributes) {
  for (const char* name : {"qwen2_moe_shared", "deepseek_v3"}) {
    Fixture f = load_fixture(name);
    f.weights.shared_gate_proj = f.weights.shared_up_proj = f.weights.shared_down_proj = Tensor();
    f.weights.shared_expert_gate = Tensor();
    const Tensor out = moe_block_forward(f.hidden, f.weights, f.router, ExpertsConfig(), "eager");
    EXPECT_GT(relative_l2(out, f.output).first, 1e-2) << name;
  }
}

// The fixture's correction bias changes DeepSeek-V3's choice of experts for some tokens, so the
// comparison above checks that it is applied.
TEST(MoeBlock, CorrectionBiasMatters) {
  Fixture f = load_fixture("deepseek_v3");
  f.weights.correction_bias = Tensor::zeros({f.router.num_experts}, DType::f32);
  const Tensor out = moe_block_forward(f.hidden, f.weights, f.router, ExpertsConfig(), "eager");
  EXPECT_GT(relative_l2(out, f.output).first, 1e-3);
}

// bf16 activations and weights: close to transformers' float32 output (bf16 rounding only).
TEST(MoeBlock, Bf16CloseToFloat32) {
  for (const char* name : {"qwen3_moe", "qwen2_moe_shared", "deepseek_v3"}) {
    const Fixture f = load_fixture(name);
    MoeBlockWeights w = f.weights;
    w.router_weight = w.router_weight.to(DType::bf16);
    w.experts.gate_up_proj = w.experts.gate_up_proj.to(DType::bf16);
    w.experts.down_proj = w.experts.down_proj.to(DType::bf16);
    for (Tensor* t : {&w.shared_gate_proj, &w.shared_up_proj, &w.shared_down_proj, &w.shared_expert_gate})
      if (t->defined()) *t = t->to(DType::bf16);
    for (const char* backend : {"eager", "grouped_mm"}) {
      const Tensor out = moe_block_forward(f.hidden.to(DType::bf16), w, f.router, ExpertsConfig(), backend);
      ASSERT_EQ(out.dtype(), DType::bf16);
      // A near-tie in the router can pick another expert for a token in bf16; overall the error stays small.
      EXPECT_LE(relative_l2(out, f.output).first, 5e-2) << name << " / " << backend;
    }
  }
}

TEST(MoeBlock, EmptyInput) {
  const Fixture f = load_fixture("qwen2_moe_shared");
  const Tensor out =
      moe_block_forward(Tensor::empty({0, 32}, DType::f32), f.weights, f.router, ExpertsConfig(), "grouped_mm");
  EXPECT_EQ(out.shape(), (Shape{0, 32}));
}

TEST(MoeBlock, ValidationErrors) {
  const Fixture f = load_fixture("qwen2_moe_shared");
  auto fails = [&](const MoeBlockWeights& w, const std::vector<std::string>& parts, Tensor hidden = Tensor()) {
    return throws_error_with(
        [&] { moe_block_forward(hidden.defined() ? hidden : f.hidden, w, f.router, ExpertsConfig(), "eager"); }, parts);
  };
  MoeBlockWeights w = f.weights;
  w.router_weight = Tensor::zeros({7, 32}, DType::f32);
  EXPECT_TRUE(fails(w, {"router_weight has shape [7, 32]", "expected [8, 32]"}));
  w = f.weights;
  w.router_bias = Tensor::zeros({4}, DType::f32);
  EXPECT_TRUE(fails(w, {"router_bias has shape [4]", "expected [8]"}));
  w = f.weights;
  w.shared_up_proj = Tensor();
  EXPECT_TRUE(fails(w, {"all defined or all undefined"}));
  w = f.weights;
  w.shared_gate_proj = w.shared_up_proj = w.shared_down_proj = Tensor();
  EXPECT_TRUE(fails(w, {"shared_expert_gate is defined but there is no shared expert"}));
  w = f.weights;
  w.shared_down_proj = Tensor::zeros({32, 16}, DType::f32);
  EXPECT_TRUE(fails(w, {"shared_down_proj has shape [32, 16]", "expected [32, 24]"}));
  w = f.weights;
  w.shared_expert_gate = Tensor::zeros({2, 32}, DType::f32);
  EXPECT_TRUE(fails(w, {"shared_expert_gate has shape [2, 32]"}));
  EXPECT_TRUE(fails(f.weights, {"hidden must be [T, H]"}, Tensor::zeros({2, 3, 32}, DType::f32)));
  EXPECT_TRUE(
      fails(f.weights, {"router_weight has shape [8, 32]", "expected [8, 16]"}, Tensor::zeros({2, 16}, DType::f32)));
}

}  // namespace
}  // namespace moekit

// The MoE routers: hand-computed cases for each kind (the arithmetic is in the comments), ties, DeepSeek's
// group masking, correction bias and scaling, 16-bit logits, non-finite logits, a randomised comparison
// with a reference written here in another formulation (a full sort of (score, id) pairs), and every
// validation error.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/model/router.h"
#include "moekit/safetensors.h"

namespace moekit {
namespace {

using test::tensor_of;
using test::throws_error_with;

struct Routed {
  std::vector<int64_t> ids;
  std::vector<float> weights;
};

Routed run(const std::vector<float>& logits, int64_t T, const RouterConfig& config,
           const std::vector<float>& bias = {}) {
  const Tensor bias_tensor = bias.empty() ? Tensor() : tensor_of(bias, {config.num_experts});
  const RouterOutput out = route(tensor_of(logits, {T, config.num_experts}), config, bias_tensor);
  EXPECT_EQ(out.top_k_index.dtype(), DType::i64);
  EXPECT_EQ(out.top_k_weights.dtype(), DType::f32);
  EXPECT_EQ(out.top_k_index.shape(), (Shape{T, config.top_k}));
  EXPECT_EQ(out.top_k_weights.shape(), (Shape{T, config.top_k}));
  const int64_t* ids = out.top_k_index.data_as<int64_t>();
  const float* weights = out.top_k_weights.data_as<float>();
  const auto n = static_cast<std::size_t>(T * config.top_k);
  return {{ids, ids + n}, {weights, weights + n}};
}

RouterConfig softmax_topk(int64_t E, int64_t K, bool norm) {
  return {.kind = RouterKind::softmax_topk, .num_experts = E, .top_k = K, .norm_topk_prob = norm};
}
RouterConfig topk_softmax(int64_t E, int64_t K) {
  return {.kind = RouterKind::topk_softmax, .num_experts = E, .top_k = K};
}
RouterConfig deepseek(int64_t E, int64_t K, int64_t n_group, int64_t topk_group, bool norm, float scaling) {
  return {.kind = RouterKind::deepseek_v3,
          .num_experts = E,
          .top_k = K,
          .norm_topk_prob = norm,
          .n_group = n_group,
          .topk_group = topk_group,
          .routed_scaling_factor = scaling};
}

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

void expect_weights_near(const std::vector<float>& actual, const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) EXPECT_NEAR(actual[i], expected[i], 1e-6) << "slot " << i;
}

// ---- softmax_topk (Qwen2/3-MoE, OLMoE, Mixtral) ----

TEST(RouterSoftmaxTopk, HandComputed) {
  // E = 4, K = 2, logits [1, 3, 2, 0]:
  //   exp = [2.718282, 20.085537, 7.389056, 1], sum = 31.192875
  //   probs = [0.087144, 0.643914, 0.236883, 0.032059]
  //   top-2 = expert 1 (0.643914), expert 2 (0.236883)
  const std::vector<float> logits = {1, 3, 2, 0};
  const double sum = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  Routed r = run(logits, 1, softmax_topk(4, 2, false));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{1, 2}));
  expect_weights_near(r.weights, {std::exp(3.0) / sum, std::exp(2.0) / sum});
  EXPECT_NEAR(r.weights[0], 0.643914, 1e-6);
  EXPECT_NEAR(r.weights[1], 0.236883, 1e-6);

  // norm_topk_prob: divide by 0.643914 + 0.236883 = 0.880797 -> [0.731059, 0.268941], which is
  // softmax([3, 2]) = [sigmoid(1), sigmoid(-1)].
  r = run(logits, 1, softmax_topk(4, 2, true));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{1, 2}));
  expect_weights_near(r.weights, {sigmoid(1.0), sigmoid(-1.0)});
  EXPECT_NEAR(r.weights[0] + r.weights[1], 1.0f, 1e-6);
}

TEST(RouterSoftmaxTopk, TokensAreIndependent) {
  // Two tokens, E = 3, K = 1: token 0 [0, 0, 5] -> expert 2; token 1 [5, 0, 0] -> expert 0; both with
  // weight e^5 / (e^5 + 2) = 0.986703.
  const Routed r = run({0, 0, 5, 5, 0, 0}, 2, softmax_topk(3, 1, false));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{2, 0}));
  const double w = std::exp(5.0) / (std::exp(5.0) + 2.0);
  expect_weights_near(r.weights, {w, w});
  // K = 1 with norm_topk_prob: the single weight becomes 1.
  EXPECT_EQ(run({0, 0, 5}, 1, softmax_topk(3, 1, true)).weights, (std::vector<float>{1.0f}));
}

TEST(RouterSoftmaxTopk, TiesGoToTheLowerExpert) {
  // logits [2, 5, 5, 1, 5]: experts 1, 2 and 4 tie at the top; K = 2 takes 1 and 2, each with
  // e^5 / (3 e^5 + e^2 + e) = 0.322...; with K = 3 expert 4 comes third.
  const Routed r = run({2, 5, 5, 1, 5}, 1, softmax_topk(5, 2, false));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(r.weights[0], r.weights[1]);
  EXPECT_EQ(run({2, 5, 5, 1, 5}, 1, softmax_topk(5, 3, false)).ids, (std::vector<int64_t>{1, 2, 4}));
  // All equal: the first K experts, in id order, each 1/E.
  const Routed flat = run({0, 0, 0, 0}, 1, softmax_topk(4, 3, false));
  EXPECT_EQ(flat.ids, (std::vector<int64_t>{0, 1, 2}));
  expect_weights_near(flat.weights, {0.25, 0.25, 0.25});
}

// ---- topk_softmax (GPT-OSS) ----

TEST(RouterTopkSoftmax, HandComputed) {
  // E = 5, K = 3, logits [0.5, -1, 2, 1.5, 0]: the top-3 logits are 2 (expert 2), 1.5 (expert 3),
  // 0.5 (expert 0); softmax over just those three: exp([0, -0.5, -1.5]) = [1, 0.606531, 0.223130],
  // sum = 1.829661 -> [0.546549, 0.331499, 0.121952]. (softmax_topk would give smaller weights: the
  // two experts left out would take part of the mass.)
  const Routed r = run({0.5f, -1, 2, 1.5f, 0}, 1, topk_softmax(5, 3));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{2, 3, 0}));
  expect_weights_near(r.weights, {0.546549, 0.331499, 0.121952});
  // E = 4, K = 2, logits [1, 3, 2, 0]: top-2 logits 3, 2 -> softmax = [0.731059, 0.268941], the same as
  // softmax_topk with norm_topk_prob (the renormalised softmax of a subset is the softmax of the subset).
  const Routed same = run({1, 3, 2, 0}, 1, topk_softmax(4, 2));
  EXPECT_EQ(same.ids, (std::vector<int64_t>{1, 2}));
  expect_weights_near(same.weights, {sigmoid(1.0), sigmoid(-1.0)});
  // norm_topk_prob is meaningless here and ignored.
  RouterConfig config = topk_softmax(4, 2);
  config.norm_topk_prob = true;
  EXPECT_EQ(run({1, 3, 2, 0}, 1, config).weights, same.weights);
}

TEST(RouterTopkSoftmax, TiesGoToTheLowerExpert) {
  // logits [-1, 4, 0, 4, 4], K = 2: experts 1 and 3 (not 4), weights softmax([4, 4]) = [0.5, 0.5].
  const Routed r = run({-1, 4, 0, 4, 4}, 1, topk_softmax(5, 2));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(r.weights, (std::vector<float>{0.5f, 0.5f}));
}

// ---- deepseek_v3 ----

TEST(RouterDeepseekV3, DroppedGroupsAreNeverChosen) {
  // E = 8 in n_group = 4 groups of 2, topk_group = 2, K = 3, no bias.
  //   logits  [4, -4 | 1, 0.8 | 0.5, 0.5 | -1, -1]
  //   sigmoid [0.982014, 0.017986 | 0.731059, 0.689974 | 0.622459, 0.622459 | 0.268941, 0.268941]
  //   group scores (sum of the top 2): [1.0, 1.421033, 1.244919, 0.537883] -> keep groups 1 and 2.
  // Expert 0 has the best score of all (0.982) but lies in dropped group 0, so it must not be chosen.
  // Top-3 of the kept experts 2..5: expert 2 (0.731059), 3 (0.689974), then 4 and 5 tie at 0.622459:
  // the lower, 4, wins. Weights = the sigmoid scores.
  const std::vector<float> logits = {4, -4, 1, 0.8f, 0.5f, 0.5f, -1, -1};
  const std::vector<float> zero(8, 0.0f);
  Routed r = run(logits, 1, deepseek(8, 3, 4, 2, false, 1.0f), zero);
  EXPECT_EQ(r.ids, (std::vector<int64_t>{2, 3, 4}));
  expect_weights_near(r.weights, {sigmoid(1.0), sigmoid(0.8), sigmoid(0.5)});

  // norm_topk_prob and routed_scaling_factor 2.5: sum = 2.043492 -> [0.357750, 0.337645, 0.304606],
  // then x 2.5 -> [0.894374, 0.844112, 0.761514].
  r = run(logits, 1, deepseek(8, 3, 4, 2, true, 2.5f), zero);
  EXPECT_EQ(r.ids, (std::vector<int64_t>{2, 3, 4}));
  expect_weights_near(r.weights, {0.894374, 0.844112, 0.761514});

  // With topk_group = 3 group 0 (score 1.0) is kept too and expert 0 comes first.
  r = run(logits, 1, deepseek(8, 3, 4, 3, false, 1.0f), zero);
  EXPECT_EQ(r.ids, (std::vector<int64_t>{0, 2, 3}));
}

TEST(RouterDeepseekV3, BiasChoosesButWeightsAreUnbiasedScores) {
  // E = 4, one group, K = 2. logits [2, 1, 0, -1] -> s = [0.880797, 0.731059, 0.5, 0.268941].
  // Without bias the top-2 are experts 0 and 1. bias [0, 0, 0.5, 0] -> c = [0.880797, 0.731059, 1.0,
  // 0.268941]: the top-2 of c are expert 2 (1.0) then 0 (0.880797), but the weights are s, without the
  // bias: [0.5, 0.880797].
  const std::vector<float> logits = {2, 1, 0, -1};
  Routed r = run(logits, 1, deepseek(4, 2, 1, 1, false, 1.0f), {0, 0, 0, 0});
  EXPECT_EQ(r.ids, (std::vector<int64_t>{0, 1}));
  r = run(logits, 1, deepseek(4, 2, 1, 1, false, 1.0f), {0, 0, 0.5f, 0});
  EXPECT_EQ(r.ids, (std::vector<int64_t>{2, 0}));
  expect_weights_near(r.weights, {0.5, sigmoid(2.0)});

  // Scaling comes last: factor 2 without norm -> [1.0, 1.761594]; with norm the weights are first
  // divided by 1.380797 ([0.362110, 0.637890]) and then doubled -> [0.724219, 1.275781], summing to 2
  // (scaling first and normalising after would sum to 1).
  r = run(logits, 1, deepseek(4, 2, 1, 1, false, 2.0f), {0, 0, 0.5f, 0});
  expect_weights_near(r.weights, {1.0, 2.0 * sigmoid(2.0)});
  r = run(logits, 1, deepseek(4, 2, 1, 1, true, 2.0f), {0, 0, 0.5f, 0});
  const double sum = 0.5 + sigmoid(2.0);
  expect_weights_near(r.weights, {2.0 * 0.5 / sum, 2.0 * sigmoid(2.0) / sum});
  EXPECT_NEAR(r.weights[0] + r.weights[1], 2.0f, 1e-6);
}

TEST(RouterDeepseekV3, BiasMovesGroups) {
  // E = 4 in 2 groups of 2, topk_group = 1, K = 2. logits [1, 1, 0, 0] -> s = [0.731059, 0.731059,
  // 0.5, 0.5]; group scores 1.462117 and 1.0 keep group 0 -> experts 0, 1. A bias of +0.3 on group 1
  // makes its score 1.6 > 1.462117 -> experts 2, 3 with weights s = 0.5 each.
  const std::vector<float> logits = {1, 1, 0, 0};
  EXPECT_EQ(run(logits, 1, deepseek(4, 2, 2, 1, false, 1.0f), {0, 0, 0, 0}).ids, (std::vector<int64_t>{0, 1}));
  const Routed r = run(logits, 1, deepseek(4, 2, 2, 1, false, 1.0f), {0, 0, 0.3f, 0.3f});
  EXPECT_EQ(r.ids, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r.weights, (std::vector<float>{0.5f, 0.5f}));
}

TEST(RouterDeepseekV3, MaskedExpertsLoseEvenToNegativeChoices) {
  // The mask removes experts; it does not set their choice to 0. logits 0 -> s = 0.5 everywhere;
  // bias [-1, -1, -2, -2] -> c = [-0.5, -0.5, -1.5, -1.5]; groups of 2 score -1 and -3; topk_group = 1
  // keeps group 0 -> experts 0, 1. (transformers before its -inf fix filled masked experts with 0.0,
  // which beats -0.5 and would have picked the dropped experts 2, 3.)
  const Routed r = run({0, 0, 0, 0}, 1, deepseek(4, 2, 2, 1, false, 1.0f), {-1, -1, -2, -2});
  EXPECT_EQ(r.ids, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(r.weights, (std::vector<float>{0.5f, 0.5f}));
}

TEST(RouterDeepseekV3, GroupTiesGoToTheLowerGroup) {
  // E = 6 in 3 groups of 2, all logits 0 (s = 0.5, every group scores 1.0), topk_group = 2, K = 4:
  // groups 0 and 1 win the tie -> experts 0, 1, 2, 3.
  const Routed r = run(std::vector<float>(6, 0.0f), 1, deepseek(6, 4, 3, 2, false, 1.0f), std::vector<float>(6, 0.0f));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{0, 1, 2, 3}));
}

// ---- every kind ----

const RouterConfig kEveryKind[] = {softmax_topk(8, 3, false), softmax_topk(8, 3, true), topk_softmax(8, 3),
                                   deepseek(8, 3, 4, 2, true, 2.5f)};

std::vector<float> bias_for(const RouterConfig& config) {
  if (config.kind != RouterKind::deepseek_v3) return {};
  std::vector<float> bias(static_cast<std::size_t>(config.num_experts));
  for (std::size_t e = 0; e < bias.size(); ++e) bias[e] = 0.01f * static_cast<float>(e % 3);
  return bias;
}

TEST(RouterEveryKind, SixteenBitLogitsRouteAsTheirFloatValues) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t T = 16, E = 8;
  std::vector<float> values(static_cast<std::size_t>(T * E));
  for (float& v : values) v = normal(rng);
  for (const RouterConfig& config : kEveryKind) {
    const std::vector<float> bias = bias_for(config);
    const Tensor bias_tensor = bias.empty() ? Tensor() : tensor_of(bias, {E});
    for (DType dtype : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(std::string(router_kind_name(config.kind)) + " " + std::string(dtype_name(dtype)));
      const Tensor narrow = tensor_of(values, {T, E}, dtype);
      const RouterOutput a = route(narrow, config, bias_tensor);
      const RouterOutput b = route(narrow.to(DType::f32), config, bias_tensor);
      EXPECT_EQ(test::values_of(a.top_k_weights), test::values_of(b.top_k_weights));
      const auto* ia = a.top_k_index.data_as<int64_t>();
      const auto* ib = b.top_k_index.data_as<int64_t>();
      EXPECT_EQ(std::vector<int64_t>(ia, ia + T * 3), std::vector<int64_t>(ib, ib + T * 3));
    }
  }
}

TEST(RouterEveryKind, NoTokens) {
  for (const RouterConfig& config : kEveryKind) {
    const Routed r = run({}, 0, config, bias_for(config));
    EXPECT_TRUE(r.ids.empty());
  }
}

TEST(RouterEveryKind, NonFiniteLogitsDoNotCrash) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // softmax_topk: one NaN makes the whole softmax row NaN; all probabilities then tie -> experts 0, 1.
  Routed r = run({1, nan, 3, 2}, 1, softmax_topk(4, 2, true));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(std::isnan(r.weights[0]) && std::isnan(r.weights[1]));
  // +inf: exp(inf - inf) = NaN, as torch's softmax gives.
  r = run({1, inf, 3, 2}, 1, softmax_topk(4, 2, false));
  EXPECT_TRUE(std::isnan(r.weights[0]));
  // topk_softmax: NaN ranks above every number (as in torch.topk), then +inf, then the rest.
  r = run({1, inf, 3, nan}, 1, topk_softmax(4, 3));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{3, 1, 2}));
  // -inf logits lose and get weight 0 while a finite logit leads.
  r = run({-inf, 0, -inf, -inf}, 1, topk_softmax(4, 2));
  EXPECT_EQ(r.ids, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(r.weights, (std::vector<float>{1.0f, 0.0f}));
  // deepseek_v3: sigmoid(NaN) = NaN ranks first, and its group first; sigmoid(-inf) = 0, sigmoid(inf) = 1.
  r = run({-inf, 0, nan, inf}, 1, deepseek(4, 2, 2, 1, false, 1.0f), {0, 0, 0, 0});
  EXPECT_EQ(r.ids, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(std::isnan(r.weights[0]));
  EXPECT_EQ(r.weights[1], 1.0f);
  r = run({-inf, 0, inf, inf}, 1, deepseek(4, 2, 2, 2, false, 1.0f), {0, 0, 0, 0});
  EXPECT_EQ(r.ids, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r.weights, (std::vector<float>{1.0f, 1.0f}));
}

// ---- randomised comparison with a reference in another formulation ----

struct Pair {
  float score;
  int64_t id;
};

// The k best (score, id) pairs by a full sort: score descending, NaN first, ties by id ascending.
std::vector<Pair> full_sort_top(std::vector<Pair> pairs, int64_t k) {
  std::stable_sort(pairs.begin(), pairs.end(), [](const Pair& a, const Pair& b) {
    const float sa = std::isnan(a.score) ? std::numeric_limits<float>::infinity() : a.score;
    const float sb = std::isnan(b.score) ? std::numeric_limits<float>::infinity() : b.score;
    return sa > sb;  // stable: equal scores keep id order
  });
  pairs.resize(static_cast<std::size_t>(k));
  return pairs;
}

// Float32 softmax written out plainly (the same elementary operations as transformers' softmax).
std::vector<float> softmax_of(const std::vector<float>& x) {
  const float max = *std::max_element(x.begin(), x.end());
  std::vector<float> e(x.size());
  float sum = 0.0f;
  for (std::size_t i = 0; i < x.size(); ++i) sum += (e[i] = std::exp(x[i] - max));
  for (float& v : e) v /= sum;
  return e;
}

Routed reference_route(const std::vector<float>& row, const RouterConfig& c, const std::vector<float>& bias) {
  const auto E = static_cast<std::size_t>(c.num_experts);
  Routed out;
  auto take = [&](const std::vector<Pair>& top) {
    for (const Pair& p : top) {
      out.ids.push_back(p.id);
      out.weights.push_back(p.score);
    }
  };
  if (c.kind == RouterKind::softmax_topk) {
    const std::vector<float> p = softmax_of(row);
    std::vector<Pair> pairs;
    for (std::size_t e = 0; e < E; ++e) pairs.push_back({p[e], static_cast<int64_t>(e)});
    take(full_sort_top(pairs, c.top_k));
    if (c.norm_topk_prob) {
      float sum = 0.0f;
      for (float w : out.weights) sum += w;
      for (float& w : out.weights) w /= sum;
    }
  } else if (c.kind == RouterKind::topk_softmax) {
    std::vector<Pair> pairs;
    for (std::size_t e = 0; e < E; ++e) pairs.push_back({row[e], static_cast<int64_t>(e)});
    take(full_sort_top(pairs, c.top_k));
    out.weights = softmax_of(out.weights);
  } else {
    std::vector<float> s(E), choice(E);
    for (std::size_t e = 0; e < E; ++e) {
      s[e] = 1.0f / (1.0f + std::exp(-row[e]));
      choice[e] = s[e] + bias[e];
    }
    // Group scores by sorting each group; groups ranked by a full sort; the rest masked with -inf.
    const std::size_t G = E / static_cast<std::size_t>(c.n_group);
    std::vector<Pair> groups;
    for (std::size_t g = 0; g < static_cast<std::size_t>(c.n_group); ++g) {
      std::vector<float> members(choice.begin() + static_cast<std::ptrdiff_t>(g * G),
                                 choice.begin() + static_cast<std::ptrdiff_t>((g + 1) * G));
      std::sort(members.begin(), members.end(), std::greater<>());
      groups.push_back({members[0] + members[1], static_cast<int64_t>(g)});
    }
    std::vector<bool> kept(E, c.n_group == 1);
    if (c.n_group > 1)
      for (const Pair& g : full_sort_top(groups, c.topk_group))
        for (std::size_t e = 0; e < G; ++e) kept[static_cast<std::size_t>(g.id) * G + e] = true;
    std::vector<Pair> pairs;
    for (std::size_t e = 0; e < E; ++e)
      pairs.push_back({kept[e] ? choice[e] : -std::numeric_limits<float>::infinity(), static_cast<int64_t>(e)});
    take(full_sort_top(pairs, c.top_k));
    float sum = 0.0f;
    for (std::size_t k = 0; k < out.ids.size(); ++k) sum += (out.weights[k] = s[static_cast<std::size_t>(out.ids[k])]);
    for (float& w : out.weights) {
      if (c.norm_topk_prob) w /= sum + 1e-20f;
      w *= c.routed_scaling_factor;
    }
  }
  return out;
}

TEST(RouterEveryKind, MatchesFullSortReferenceOnRandomInputs) {
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<int> coarse(-8, 8);  // multiples of 1/4: many exact ties
  int cases = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const int64_t n_group = std::array<int64_t, 4>{1, 2, 4, 8}[trial % 4];
    const int64_t G = 2 + trial % 5;  // 2..6 experts per group
    const int64_t E = n_group * G;
    const int64_t topk_group = 1 + (trial / 4) % n_group;
    const int64_t K = 1 + trial % std::min<int64_t>(E, topk_group * G);
    const int64_t T = 1 + (trial * 37) % 50;
    const bool ties = trial % 3 == 0;
    std::vector<float> logits(static_cast<std::size_t>(T * E)), bias(static_cast<std::size_t>(E));
    for (float& v : logits) v = ties ? 0.25f * static_cast<float>(coarse(rng)) : normal(rng);
    for (float& b : bias) b = ties ? 0.125f * static_cast<float>(coarse(rng) % 3) : 0.1f * normal(rng);
    const RouterConfig configs[] = {softmax_topk(E, K, trial % 2 == 0), topk_softmax(E, K),
                                    deepseek(E, K, n_group, topk_group, trial % 2 == 1, 1.0f + 0.5f * (trial % 3))};
    for (const RouterConfig& config : configs) {
      const bool is_deepseek = config.kind == RouterKind::deepseek_v3;
      SCOPED_TRACE(config.describe() + " T=" + std::to_string(T) + (ties ? " (ties)" : ""));
      const Routed got = run(logits, T, config, is_deepseek ? bias : std::vector<float>());
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<float> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
        const Routed want = reference_route(row, config, bias);
        const auto at = static_cast<std::ptrdiff_t>(t * K);
        ASSERT_EQ(std::vector<int64_t>(got.ids.begin() + at, got.ids.begin() + at + K), want.ids) << "token " << t;
        for (int64_t k = 0; k < K; ++k)
          ASSERT_NEAR(got.weights[static_cast<std::size_t>(at + k)], want.weights[static_cast<std::size_t>(k)],
                      1e-6f * std::max(1.0f, std::abs(want.weights[static_cast<std::size_t>(k)])))
              << "token " << t << " slot " << k;
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 5000);
}

// ---- validation ----

TEST(RouterValidation, LogitsTensor) {
  const RouterConfig config = softmax_topk(4, 2, false);
  EXPECT_TRUE(throws_error_with([&] { route(Tensor(), config); }, {"logits is undefined"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        route(tensor_of({1, 2, 3, 4}, {4}), config);
      },
      {"logits must be [T, E]", "[4]"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        route(Tensor::zeros({2, 4}, DType::i64), config);
      },
      {"logits must be f32, f16 or bf16", "i64"}));
  float host[8] = {};
  EXPECT_TRUE(throws_error_with(
      [&] {
        route(Tensor::from_blob(host, {2, 4}, DType::f32, Device::cuda()), config);
      },
      {"logits must be on the cpu", "cuda"}));
  const Tensor transposed = Tensor::zeros({4, 2}, DType::f32).transpose(0, 1);
  EXPECT_TRUE(throws_error_with([&] { route(transposed, config); }, {"logits must be contiguous"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        route(Tensor::zeros({2, 5}, DType::f32), config);
      },
      {"E = 5", "config.num_experts = 4"}));
}

TEST(RouterValidation, TopK) {
  const Tensor logits = Tensor::zeros({2, 4}, DType::f32);
  for (int64_t k : {0, -1, 5})
    for (RouterConfig config : {softmax_topk(4, k, false), topk_softmax(4, k)})
      EXPECT_TRUE(
          throws_error_with([&] { route(logits, config); }, {"config.top_k = " + std::to_string(k), "[1, E = 4]"}));
}

TEST(RouterValidation, CorrectionBias) {
  const Tensor logits = Tensor::zeros({2, 4}, DType::f32);
  const Tensor bias = Tensor::zeros({4}, DType::f32);
  EXPECT_TRUE(throws_error_with([&] { route(logits, softmax_topk(4, 2, false), bias); },
                                {"correction_bias is for deepseek_v3 only", "softmax_topk"}));
  EXPECT_TRUE(throws_error_with([&] { route(logits, topk_softmax(4, 2), bias); },
                                {"correction_bias is for deepseek_v3 only", "topk_softmax"}));
  const RouterConfig config = deepseek(4, 2, 2, 1, true, 1.0f);
  EXPECT_TRUE(throws_error_with([&] { route(logits, config); }, {"deepseek_v3 needs correction_bias [4]"}));
  for (const Tensor& wrong :
       {Tensor::zeros({5}, DType::f32), Tensor::zeros({1, 4}, DType::f32), Tensor::zeros({4}, DType::bf16),
        Tensor::zeros({4, 2}, DType::f32).transpose(0, 1).select(0, 0)})
    EXPECT_TRUE(throws_error_with([&] { route(logits, config, wrong); },
                                  {"correction_bias must be f32[4] on cpu, contiguous", wrong.describe()}));
  EXPECT_NO_THROW(route(logits, config, bias));
}

TEST(RouterValidation, Groups) {
  const Tensor logits = Tensor::zeros({2, 8}, DType::f32);
  const Tensor bias = Tensor::zeros({8}, DType::f32);
  auto fails = [&](const RouterConfig& config, const std::vector<std::string>& parts) {
    return throws_error_with([&] { route(logits, config, bias); }, parts);
  };
  EXPECT_TRUE(fails(deepseek(8, 2, 3, 1, false, 1.0f), {"config.n_group = 3", "divide E = 8"}));
  EXPECT_TRUE(fails(deepseek(8, 2, 0, 1, false, 1.0f), {"config.n_group = 0"}));
  EXPECT_TRUE(fails(deepseek(8, 1, 8, 1, false, 1.0f), {"groups of E / n_group = 8 / 8 = 1", "at least 2"}));
  EXPECT_TRUE(fails(deepseek(8, 2, 4, 0, false, 1.0f), {"config.topk_group = 0", "[1, n_group = 4]"}));
  EXPECT_TRUE(fails(deepseek(8, 2, 4, 5, false, 1.0f), {"config.topk_group = 5", "[1, n_group = 4]"}));
  // 2 of 4 groups of 2 keep 4 experts: K = 5 cannot be filled (K = 4 can).
  EXPECT_TRUE(fails(deepseek(8, 5, 4, 2, false, 1.0f), {"config.top_k = 5", "4 experts that topk_group = 2"}));
  EXPECT_NO_THROW(route(logits, deepseek(8, 4, 4, 2, false, 1.0f), bias));
  // The group fields mean nothing to the other kinds and are not checked there.
  RouterConfig softmax = softmax_topk(8, 2, false);
  softmax.n_group = 3;
  softmax.topk_group = 7;
  EXPECT_NO_THROW(route(logits, softmax));
}

// transformers' own routers (Qwen3MoeTopKRouter with and without renormalisation, GptOssTopKRouter,
// DeepseekV3TopkRouter with negative correction biases) on the same logits, from
// scripts/make_router_fixtures.py (transformers 5.17, float32, CPU). The same experts must be chosen
// with the same weights; DeepSeek's transformers topk is unsorted, so each token's slots are compared
// as (expert, weight) sets there.
class RouterTransformersFixture : public testing::TestWithParam<std::string> {};

TEST_P(RouterTransformersFixture, ChoosesTheExpertsAndWeightsTransformersChooses) {
  const SafetensorsFile file(std::string(MOEKIT_FIXTURES_DIR) + "/routers/" + GetParam() + ".safetensors");
  const auto& meta = file.metadata();
  const std::string kind = meta.at("kind");
  RouterConfig config;
  config.kind = kind == "softmax_topk"   ? RouterKind::softmax_topk
                : kind == "topk_softmax" ? RouterKind::topk_softmax
                                         : RouterKind::deepseek_v3;
  const Tensor logits = file.tensor("logits").clone();
  config.num_experts = logits.size(1);
  config.top_k = std::stoll(meta.at("top_k"));
  config.norm_topk_prob = meta.at("norm_topk_prob") == "true";
  Tensor bias;
  if (config.kind == RouterKind::deepseek_v3) {
    config.n_group = std::stoll(meta.at("n_group"));
    config.topk_group = std::stoll(meta.at("topk_group"));
    config.routed_scaling_factor = std::stof(meta.at("routed_scaling_factor"));
    bias = file.tensor("correction_bias").clone();
  }
  const RouterOutput got = route(logits, config, bias);
  const Tensor want_ids = file.tensor("indices").clone(), want_w = file.tensor("weights").clone();
  const int64_t T = logits.size(0), K = config.top_k;
  ASSERT_EQ(got.top_k_index.shape(), want_ids.shape());
  const int64_t* gi = got.top_k_index.data_as<int64_t>();
  const float* gw = got.top_k_weights.data_as<float>();
  const int64_t* wi = want_ids.data_as<int64_t>();
  const float* ww = want_w.data_as<float>();
  const bool as_sets = config.kind == RouterKind::deepseek_v3;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<int64_t, float>> a, b;
    for (int64_t k = 0; k < K; ++k) {
      a.emplace_back(gi[t * K + k], gw[t * K + k]);
      b.emplace_back(wi[t * K + k], ww[t * K + k]);
    }
    if (as_sets) {
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
    }
    for (int64_t k = 0; k < K; ++k) {
      const auto uk = static_cast<std::size_t>(k);
      EXPECT_EQ(a[uk].first, b[uk].first) << GetParam() << ": token " << t << " slot " << k;
      EXPECT_NEAR(a[uk].second, b[uk].second, 1e-6f * std::max(1.0f, std::fabs(b[uk].second)))
          << GetParam() << ": token " << t << " slot " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transformers, RouterTransformersFixture,
                         testing::Values("qwen3_moe_norm", "qwen3_moe_plain", "gpt_oss", "deepseek_v3"));

}  // namespace
}  // namespace moekit

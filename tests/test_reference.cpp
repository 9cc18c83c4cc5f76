// The float64 reference against cases small enough to compute by hand. The reference is the oracle of
// every backend, so it is itself checked against numbers that do not come from code sharing its logic.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "harness.h"
#include "moekit/experts.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

// A problem from explicit values. Sizes follow from the vectors: T = |x| / H, K = |ids| / T, the row count
// N of the first projection = |gate_up| / (E H), I = |down| / (E H); the weights are stored in the layout
// that config names.
struct Values {
  int64_t hidden = 2;
  int64_t experts = 2;
  std::vector<float> x;
  std::vector<int64_t> ids;
  std::vector<float> weights;
  std::vector<float> gate_up;
  std::vector<float> down;
  std::vector<float> gate_up_bias;  // empty unless config.has_bias
  std::vector<float> down_bias;
};

ExpertsProblem make_problem(const ExpertsConfig& c, const Values& v, DType dtype = DType::f32,
                            DType index_dtype = DType::i64, DType weights_dtype = DType::f32) {
  const int64_t H = v.hidden, E = v.experts;
  const auto T = static_cast<int64_t>(v.x.size()) / H;
  const int64_t K = T > 0 ? static_cast<int64_t>(v.ids.size()) / T : 1;
  const auto N = static_cast<int64_t>(v.gate_up.size()) / (E * H);
  const auto I = static_cast<int64_t>(v.down.size()) / (E * H);
  ExpertsProblem p;
  p.config = c;
  p.hidden_states = test::tensor_of(v.x, {T, H}, dtype);
  p.top_k_index = test::ids_of(v.ids, {T, K}, index_dtype);
  p.top_k_weights = test::tensor_of(v.weights, {T, K}, weights_dtype);
  p.gate_up_proj = test::tensor_of(v.gate_up, c.is_transposed ? Shape{E, H, N} : Shape{E, N, H}, dtype);
  p.down_proj = test::tensor_of(v.down, c.is_transposed ? Shape{E, I, H} : Shape{E, H, I}, dtype);
  if (c.has_bias) {
    p.gate_up_proj_bias = test::tensor_of(v.gate_up_bias, {E, N}, dtype);
    p.down_proj_bias = test::tensor_of(v.down_bias, {E, H}, dtype);
  }
  return p;
}

// The standard tiny experts (H=2, I=1, E=2, canonical layout) with the token x = [1, 2]:
//   expert 0: gate row [1, 0]     -> g = 1;   up row [0, 1]  -> u = 2;  down column [1, 2]
//   expert 1: gate row [0.5, 0.5] -> g = 1.5; up row [1, -1] -> u = -1; down column [3, -1]
// so expert 0 outputs act(1) * 2 * [1, 2] and expert 1 outputs act(1.5) * (-1) * [3, -1].
Values tiny(std::vector<int64_t> ids, std::vector<float> weights) {
  Values v;
  v.x = {1, 2};
  v.ids = std::move(ids);
  v.weights = std::move(weights);
  v.gate_up = {1, 0, 0, 1, /* expert 1 */ 0.5f, 0.5f, 1, -1};
  v.down = {1, 2, /* expert 1 */ 3, -1};
  return v;
}

// Hand-computed values are given to 16 significant digits, so they are compared to 1e-12 relative.
void expect_values(const std::vector<double>& got, const std::vector<double>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], expected[i], 1e-12 * std::max(1.0, std::abs(expected[i]))) << "element " << i;
}

ExpertsConfig config_of(Activation activation, bool has_gate = true) {
  ExpertsConfig c;
  c.activation = activation;
  c.has_gate = has_gate;
  return c;
}

// ---------------------------------------------------------------------------------------------------------
// Activations on the tiny experts, K=2 with weights 0.25 (expert 0) and 0.75 (expert 1):
//   out = 0.25 * act(1) * 2 * [1, 2] + 0.75 * act(1.5) * (-1) * [3, -1]
//       = [0.5 act(1) - 2.25 act(1.5), act(1) + 0.75 act(1.5)]
// with
//   silu(1) = 1 / (1 + e^-1) = 0.7310585786300049,       silu(1.5) = 1.5 / (1 + e^-1.5) = 1.2263617142904655
//   gelu(1) = 0.5 (1 + erf(1/sqrt2)) = 0.8413447460685429, gelu(1.5) = 0.75 (1 + erf(1.5/sqrt2)) = 1.399789198096713
//   gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): 0.8411919906082768, 1.3995715769802328
//   relu: 1, 1.5                                        relu2 (squared relu): 1, 2.25
struct ActivationCase {
  Activation activation;
  double act_1, act_1_5;
  double out0, out1;
};

TEST(Reference, GatedActivationsByHand) {
  const ActivationCase cases[] = {
      {Activation::silu, 0.7310585786300049, 1.2263617142904655, -2.3937845678385448, 1.650829864347854},
      {Activation::gelu, 0.8413447460685429, 1.399789198096713, -2.7288533226833325, 1.8911866446410777},
      {Activation::gelu_pytorch_tanh, 0.8411919906082768, 1.3995715769802328, -2.7284400529013855, 1.8908706733434515},
      {Activation::relu, 1.0, 1.5, -2.875, 2.125},      // 0.5 - 3.375, 1 + 1.125
      {Activation::relu2, 1.0, 2.25, -4.5625, 2.6875},  // 0.5 - 5.0625, 1 + 1.6875
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(activation_name(c.activation));
    const ExpertsConfig config = config_of(c.activation);
    // The activation itself, gated: act(gate) * up.
    EXPECT_NEAR(reference_activation(config, 1.0, 2.0), 2 * c.act_1, 1e-15);
    EXPECT_NEAR(reference_activation(config, 1.5, -1.0), -c.act_1_5, 1e-15);
    expect_values(experts_reference(make_problem(config, tiny({0, 1}, {0.25f, 0.75f}))), {c.out0, c.out1});
    // K=1 on expert 0: act(1) * 2 * [1, 2].
    expect_values(experts_reference(make_problem(config, tiny({0}, {1.0f}))), {2 * c.act_1, 4 * c.act_1});
  }
}

TEST(Reference, ActivationsAtAndBelowZero) {
  for (Activation a :
       {Activation::silu, Activation::gelu, Activation::gelu_pytorch_tanh, Activation::relu, Activation::relu2}) {
    SCOPED_TRACE(activation_name(a));
    EXPECT_EQ(reference_activation(config_of(a, false), 0.0, 0.0), 0.0);
  }
  // relu and relu2 cut negatives to exactly zero; silu and gelu do not.
  EXPECT_EQ(reference_activation(config_of(Activation::relu, false), -3.0, 0.0), 0.0);
  EXPECT_EQ(reference_activation(config_of(Activation::relu2, false), -3.0, 0.0), 0.0);
  EXPECT_EQ(reference_activation(config_of(Activation::relu2, false), 3.0, 0.0), 9.0);
  EXPECT_LT(reference_activation(config_of(Activation::silu, false), -1.0, 0.0), 0.0);  // -0.2689...
  // Ungated: the second argument is ignored.
  EXPECT_EQ(reference_activation(config_of(Activation::relu, false), 2.0, 100.0), 2.0);
}

// Ungated experts (Nemotron-H style: up_proj [E, I, H] then relu2), x = [1, 2]:
//   expert 0: up row [0.5, 1] -> u = 2.5 -> relu2 = 6.25;  down column [1, 2] -> [6.25, 12.5]
//   expert 1: up row [1, -1]  -> u = -1  -> relu2 = 0;     down column [3, -1] -> [0, 0]
//   K=2, weights 0.25 / 0.75: out = 0.25 * [6.25, 12.5] = [1.5625, 3.125]; relu: 0.25 * [2.5, 5] = [0.625, 1.25]
TEST(Reference, UngatedByHand) {
  Values v = tiny({0, 1}, {0.25f, 0.75f});
  v.gate_up = {0.5f, 1, /* expert 1 */ 1, -1};
  expect_values(experts_reference(make_problem(config_of(Activation::relu2, false), v)), {1.5625, 3.125});
  expect_values(experts_reference(make_problem(config_of(Activation::relu, false), v)), {0.625, 1.25});
}

// GPT-OSS clamped SwiGLU, limit 7, alpha 1.702: g = min(g, 7); u = clamp(u, -7, 7); h = (u + 1) g sigmoid(alpha g).
// alpha is held as a float, 1.7020000219345093, and the values below use that number.
//   expert 0: gate row [3, 3] -> g = 9 -> 7; up row [-4, -2] -> u = -8 -> -7
//             h0 = (-7 + 1) * 7 * sigmoid(11.914) = -42 * 0.9999933040443592 = -41.99971876986309
//   expert 1: gate row [1, 1] -> g = 3 (below the limit); up row [5, 2.5] -> u = 10 -> 7
//             h1 = (7 + 1) * 3 * sigmoid(5.106) = 24 * 0.9939762304914022 = 23.855429531793654
//   K=2, weights 0.25 / 0.75: out = [0.25 h0 + 2.25 h1, 0.5 h0 - 0.75 h1] = [43.17478675406995, -38.89143153377678]
// Unclamped the same experts give 46.30... in the first element, so the expected values check the clamp.
TEST(Reference, GptOssClampedSwigluByHand) {
  ExpertsConfig c;
  c.swiglu_limit = 7.0f;
  c.swiglu_alpha = 1.702f;
  Values v = tiny({0, 1}, {0.25f, 0.75f});
  v.gate_up = {3, 3, -4, -2, /* expert 1 */ 1, 1, 5, 2.5f};
  expect_values(experts_reference(make_problem(c, v)), {43.17478675406995, -38.89143153377678});
  expect_values({reference_activation(c, 9.0, -8.0), reference_activation(c, 3.0, 10.0)},
                {-41.99971876986309, 23.855429531793654});
  // Only the top of the gate is clamped: g = -9 stays -9. With u = 1:
  //   h = 2 * (-9) * sigmoid(-15.318) = -18 * 2.2257528790112233e-07 = -4.006355182220202e-06
  EXPECT_NEAR(reference_activation(c, -9.0, 1.0), -4.006355182220202e-06, 1e-18);
  // The up value is clamped from below as well as from above.
  EXPECT_DOUBLE_EQ(reference_activation(c, 3.0, -100.0), reference_activation(c, 3.0, -7.0));
  EXPECT_DOUBLE_EQ(reference_activation(c, 3.0, 100.0), reference_activation(c, 3.0, 7.0));
  EXPECT_NE(reference_activation(c, 3.0, 6.0), reference_activation(c, 3.0, 7.0));
}

// Biases, silu, K=1 on expert 0 with weight 0.5; gate_up bias [0.5, -1], down bias [0.25, -0.5]:
//   g = 1 + 0.5 = 1.5, u = 2 - 1 = 1, h = silu(1.5) = 1.2263617142904655
//   down: [h + 0.25, 2h - 0.5]; times the routing weight: [0.5 h + 0.125, h - 0.25]
//       = [0.7381808571452327, 0.9763617142904655]
TEST(Reference, BiasByHand) {
  ExpertsConfig c;
  c.has_bias = true;
  Values v = tiny({0}, {0.5f});
  v.gate_up_bias = {0.5f, -1, /* expert 1 */ 0, 0};
  v.down_bias = {0.25f, -0.5f, /* expert 1 */ 0, 0};
  expect_values(experts_reference(make_problem(c, v)), {0.7381808571452327, 0.9763617142904655});
}

// The routing weight multiplies after the down bias: out = w (down h + b2), not w down h + b2. With the gate
// pushed negative by its bias (g = 1 - 2 = -1), relu makes h = 0 and only the down bias remains:
//   out = 0.5 * [0.25, -0.5] = [0.125, -0.25]     (bias after the weight would give [0.25, -0.5])
TEST(Reference, RoutingWeightAppliesAfterTheDownBias) {
  ExpertsConfig c = config_of(Activation::relu);
  c.has_bias = true;
  Values v = tiny({0}, {0.5f});
  v.gate_up_bias = {-2, 0, /* expert 1 */ 0, 0};
  v.down_bias = {0.25f, -0.5f, /* expert 1 */ 0, 0};
  const auto got = experts_reference(make_problem(c, v));
  EXPECT_EQ(got, std::vector<double>({0.125, -0.25}));
}

// Ungated with bias, relu2: u = 2.5 - 0.5 = 2 -> 4; down [4 + 1, 8 - 1] = [5, 7]; weight 0.5 -> [2.5, 3.5].
TEST(Reference, UngatedBiasByHand) {
  ExpertsConfig c = config_of(Activation::relu2, false);
  c.has_bias = true;
  Values v = tiny({0}, {0.5f});
  v.gate_up = {0.5f, 1, /* expert 1 */ 1, -1};
  v.gate_up_bias = {-0.5f, /* expert 1 */ 0};
  v.down_bias = {1, -1, /* expert 1 */ 0, 0};
  EXPECT_EQ(experts_reference(make_problem(c, v)), std::vector<double>({2.5, 3.5}));
}

// Interleaved rows are g0, u0, g1, u1. One expert, H=1, I=2, x = [1], relu, stored rows [1, 2, -1, 3]:
//   interleaved:  g = [1, -1], u = [2, 3] -> h = [relu(1) 2, relu(-1) 3] = [2, 0];  down [1, 10] -> 2
//   concatenated: g = [1, 2],  u = [-1, 3] -> h = [-1, 6];                          down [1, 10] -> 59
TEST(Reference, InterleavedRowsByHand) {
  Values v;
  v.hidden = 1;
  v.experts = 1;
  v.x = {1};
  v.ids = {0};
  v.weights = {1};
  v.gate_up = {1, 2, -1, 3};
  v.down = {1, 10};
  ExpertsConfig c = config_of(Activation::relu);
  EXPECT_EQ(experts_reference(make_problem(c, v)), std::vector<double>({59}));
  c.is_concatenated = false;
  EXPECT_EQ(experts_reference(make_problem(c, v)), std::vector<double>({2}));
}

// Sentinels: an id >= E contributes nothing whatever its weight. Three tokens x = [1, 2], silu:
//   token 0: ids [0, 2],   weights [0.25, 100] -> 0.25 * 2 silu(1) [1, 2]
//                                               = [0.36552928931500245, 0.7310585786300049]
//   token 1: ids [7, 1],   weights [100, 0.75] -> -0.75 silu(1.5) [3, -1]
//                                               = [-2.7593138571535474, 0.919771285717849]
//   token 2: ids [max, 2], weights [100, 100]  -> exactly [0, 0]
// "max" is the largest id of the index dtype: still a sentinel, however the reference stores ids.
TEST(Reference, SentinelsContributeNothing) {
  for (DType index_dtype : {DType::i32, DType::i64}) {
    SCOPED_TRACE(dtype_name(index_dtype));
    const int64_t largest =
        index_dtype == DType::i32 ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int64_t>::max();
    Values v = tiny({0, 2, 7, 1, largest, 2}, {0.25f, 100, 100, 0.75f, 100, 100});
    v.x = {1, 2, 1, 2, 1, 2};
    const auto got = experts_reference(make_problem(ExpertsConfig{}, v, DType::f32, index_dtype));
    expect_values(got, {0.36552928931500245, 0.7310585786300049, -2.7593138571535474, 0.919771285717849, 0, 0});
    EXPECT_EQ(got[4], 0.0);
    EXPECT_EQ(got[5], 0.0);
  }
}

// The same expert in two slots counts twice: ids [0, 0], weights [0.25, 0.5] -> 0.75 * 2 silu(1) [1, 2].
TEST(Reference, RepeatedExpertCountsTwice) {
  expect_values(experts_reference(make_problem(ExpertsConfig{}, tiny({0, 0}, {0.25f, 0.5f}))),
                {1.0965878679450074, 2.193175735890015});
}

// Every value of the tiny problem is exact in bf16 and f16, and the reference works in double from the
// stored values, so the 16-bit problem (with weights in f32 or in the activation dtype) gives the same bits.
TEST(Reference, SixteenBitInputsAreReadExactly) {
  const Values v = tiny({0, 1}, {0.25f, 0.75f});
  const auto wide = experts_reference(make_problem(ExpertsConfig{}, v));
  for (DType dtype : {DType::bf16, DType::f16})
    for (DType weights : {DType::f32, dtype}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " weights " + std::string(dtype_name(weights)));
      EXPECT_EQ(experts_reference(make_problem(ExpertsConfig{}, v, dtype, DType::i32, weights)), wide);
    }
}

TEST(Reference, NoTokens) {
  Values v = tiny({}, {});
  v.x = {};
  EXPECT_TRUE(experts_reference(make_problem(ExpertsConfig{}, v)).empty());
}

TEST(Reference, ValidatesItsInput) {
  ExpertsProblem p = make_problem(ExpertsConfig{}, tiny({0, -1}, {0.5f, 0.5f}));
  EXPECT_TRUE(test::throws_error_with([&] { experts_reference(p); }, {"top_k_index[0, 1] = -1 is negative"}));
  p = make_problem(ExpertsConfig{}, tiny({0}, {1}));
  p.down_proj = p.down_proj.reshape({2, 1, 2});
  EXPECT_TRUE(test::throws_error_with([&] { experts_reference(p); }, {"down_proj must be [2, 2, 1]"}));
}

// ---------------------------------------------------------------------------------------------------------
// Layouts: one set of logical weights stored canonical, transposed, interleaved and both must give the same
// output. The stored tensors are built here from the contract's description of each layout.

struct LogicalExperts {
  int64_t E = 3, H = 5, I = 4;
  std::vector<float> gate, up;            // [E, I, H]: row j of the gate / up projection
  std::vector<float> down;                // [E, H, I]
  std::vector<float> gate_bias, up_bias;  // [E, I]
  std::vector<float> down_bias;           // [E, H]
};

LogicalExperts random_logical_experts(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  LogicalExperts l;
  auto draw = [&](int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = u(rng);
    return v;
  };
  l.gate = draw(l.E * l.I * l.H);
  l.up = draw(l.E * l.I * l.H);
  l.down = draw(l.E * l.H * l.I);
  l.gate_bias = draw(l.E * l.I);
  l.up_bias = draw(l.E * l.I);
  l.down_bias = draw(l.E * l.H);
  return l;
}

// Stores the logical experts as config says: gate_up row n is gate row n (n < I) then up row n - I when
// concatenated, gate row n/2 (n even) / up row n/2 (n odd) when interleaved; transposed swaps the last two
// dimensions of both projections. Without a gate only the up rows are stored. The gate_up bias follows the
// row order of the projection's outputs.
Values store(const LogicalExperts& l, const ExpertsConfig& c) {
  const int64_t E = l.E, H = l.H, I = l.I, N = c.has_gate ? 2 * I : I;
  Values v;
  v.hidden = H;
  v.experts = E;
  v.gate_up.resize(static_cast<std::size_t>(E * N * H));
  v.down.resize(static_cast<std::size_t>(E * H * I));
  v.gate_up_bias.resize(static_cast<std::size_t>(E * N));
  v.down_bias = l.down_bias;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t n = 0; n < N; ++n) {
      bool is_gate = false;
      int64_t j = n;
      if (c.has_gate) {
        is_gate = c.is_concatenated ? n < I : n % 2 == 0;
        j = c.is_concatenated ? n % I : n / 2;
      }
      const std::vector<float>& rows = is_gate ? l.gate : l.up;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t at = c.is_transposed ? (e * H + h) * N + n : (e * N + n) * H + h;
        v.gate_up[static_cast<std::size_t>(at)] = rows[static_cast<std::size_t>((e * I + j) * H + h)];
      }
      v.gate_up_bias[static_cast<std::size_t>(e * N + n)] =
          (is_gate ? l.gate_bias : l.up_bias)[static_cast<std::size_t>(e * I + j)];
    }
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < I; ++j) {
        const int64_t at = c.is_transposed ? (e * I + j) * H + h : (e * H + h) * I + j;
        v.down[static_cast<std::size_t>(at)] = l.down[static_cast<std::size_t>((e * H + h) * I + j)];
      }
  }
  if (!c.has_bias) {
    v.gate_up_bias.clear();
    v.down_bias.clear();
  }
  // Four tokens, K=2, with a sentinel and a repeated expert among the slots.
  v.x = {0.5f, -1, 0.25f, 2, -0.75f, 1, 1, -0.5f, 0.125f, 0.5f, -2, 0.25f, 1.5f, -1, 0, 0.5f, 0.5f, 0.5f, -0.5f, 1};
  v.ids = {0, 2, 1, 5, 2, 2, 1, 0};
  v.weights = {0.625f, 0.375f, 0.5f, 0.5f, 0.25f, 0.75f, 0.875f, 0.125f};
  return v;
}

TEST(Reference, LayoutsAgreeWithTheCanonicalLayout) {
  struct Setting {
    const char* name;
    ExpertsConfig config;
  };
  std::vector<Setting> settings;
  {
    ExpertsConfig c;
    settings.push_back({"silu", c});
    c.has_bias = true;
    settings.push_back({"silu_bias", c});
    c.activation = Activation::gelu;
    settings.push_back({"gelu_bias", c});
    ExpertsConfig clamped;
    clamped.has_bias = true;
    clamped.swiglu_limit = 0.5f;  // small enough that some of these values hit it
    settings.push_back({"gptoss_clamped", clamped});
    ExpertsConfig ungated;
    ungated.has_gate = false;
    ungated.activation = Activation::relu2;
    ungated.has_bias = true;
    settings.push_back({"ungated_relu2_bias", ungated});
  }
  const LogicalExperts logical = random_logical_experts(2024);
  for (const auto& s : settings) {
    SCOPED_TRACE(s.name);
    const std::vector<double> canonical = experts_reference(make_problem(s.config, store(logical, s.config)));
    bool any_nonzero = false;
    for (double v : canonical) any_nonzero |= v != 0;
    EXPECT_TRUE(any_nonzero) << "a test whose expected output is zero would prove nothing";
    for (bool transposed : {false, true})
      for (bool concatenated : {true, false}) {
        if (!s.config.has_gate && !concatenated) continue;  // without a gate there is nothing to interleave
        ExpertsConfig c = s.config;
        c.is_transposed = transposed;
        c.is_concatenated = concatenated;
        SCOPED_TRACE(c.describe());
        const std::vector<double> got = experts_reference(make_problem(c, store(logical, c)));
        ASSERT_EQ(got.size(), canonical.size());
        for (std::size_t i = 0; i < got.size(); ++i) EXPECT_DOUBLE_EQ(got[i], canonical[i]) << "element " << i;
      }
  }
}

// The layout test above is only meaningful if the layouts actually differ in memory.
TEST(Reference, LayoutsDifferInMemory) {
  const LogicalExperts logical = random_logical_experts(7);
  ExpertsConfig canonical, interleaved, transposed;
  interleaved.is_concatenated = false;
  transposed.is_transposed = true;
  EXPECT_NE(store(logical, canonical).gate_up, store(logical, interleaved).gate_up);
  EXPECT_NE(store(logical, canonical).gate_up, store(logical, transposed).gate_up);
  EXPECT_NE(store(logical, canonical).down, store(logical, transposed).down);
}

}  // namespace
}  // namespace moekit

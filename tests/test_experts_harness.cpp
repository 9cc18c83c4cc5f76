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
#include "moekit/experts.h"
#include "moekit/quantization.h"
#include "moekit/random_problem.h"
#include "moekit/reference.h"

namespace moekit {
namespace {

// ---------------------------------------------------------------------------------------------------------
// The declared list of cases

struct HarnessCase {
  std::string name;
  RandomProblemOptions options;
  // Tokens whose every slot is overwritten with a sentinel, so that their rows must come out exactly zero.
  // The sentinel ids cycle through E, E + 7 and the largest id of the index dtype: a backend that offsets,
  // scales or bounds-checks ids carelessly overflows on the last one.
  std::vector<int64_t> all_sentinel_tokens;
};

struct ActivationChoice {
  const char* name;
  Activation activation;
  bool clamped;  // GPT-OSS: silu plus swiglu_limit
};

constexpr ActivationChoice kActivations[] = {
    {"silu", Activation::silu, false},
    {"gelu", Activation::gelu, false},
    {"gelu_tanh", Activation::gelu_pytorch_tanh, false},
    {"relu", Activation::relu, false},
    {"relu2", Activation::relu2, false},
    {"gptoss", Activation::silu, true},
};
constexpr DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};

ExpertsConfig make_config(const ActivationChoice& a, bool has_gate, bool has_bias, bool transposed, bool concatenated) {
  ExpertsConfig c;
  c.activation = a.activation;
  c.has_gate = has_gate;
  c.has_bias = has_bias;
  c.is_transposed = transposed;
  c.is_concatenated = concatenated;
  if (a.clamped) {
    c.swiglu_limit = 7.0f;  // GPT-OSS checkpoints' values
    c.swiglu_alpha = 1.702f;
  }
  return c;
}

// "silu_nogate_bias_transposed_interleaved": the activation and the flags that differ from the default.
std::string config_name(const ActivationChoice& a, const ExpertsConfig& c) {
  std::string name = a.name;
  if (!c.has_gate) name += "_nogate";
  if (c.has_bias) name += "_bias";
  if (c.is_transposed) name += "_transposed";
  if (c.has_gate && !c.is_concatenated) name += "_interleaved";
  return name;
}

RandomProblemOptions sized(int64_t tokens, int64_t hidden, int64_t intermediate, int64_t experts, int64_t top_k,
                           DType dtype, const ExpertsConfig& config) {
  RandomProblemOptions o;
  o.tokens = tokens;
  o.hidden = hidden;
  o.intermediate = intermediate;
  o.experts = experts;
  o.top_k = top_k;
  o.dtype = dtype;
  o.config = config;
  // With unit inputs the pre-activations stay within about +-2 and GPT-OSS's limit of 7 would never bind;
  // scaled inputs push a good share of gate and up values beyond it, so the clamp is what gets tested.
  if (config.swiglu_limit) o.input_scale = 16.0f;
  return o;
}

std::vector<HarnessCase> harness_cases() {
  std::vector<HarnessCase> cases;

  // Every activation x every layout flag x every dtype, on a small problem whose sizes are multiples of
  // 8 but not of 128 (T=12, H=48, I=40, E=6, K=3).
  for (DType dtype : kDTypes)
    for (const auto& a : kActivations)
      for (bool has_gate : {true, false})
        for (bool has_bias : {false, true})
          for (bool transposed : {false, true})
            for (bool concatenated : {true, false}) {
              if (!has_gate && (a.clamped || !concatenated)) continue;  // clamped needs a gate; nothing to interleave
              const ExpertsConfig c = make_config(a, has_gate, has_bias, transposed, concatenated);
              cases.push_back({std::string("small_").append(dtype_name(dtype)).append("_").append(config_name(a, c)),
                               sized(12, 48, 40, 6, 3, dtype, c),
                               {}});
            }

  // The special cases of DESIGN §6, each on three configurations that real models use: Mixtral/Qwen-style
  // SwiGLU, GPT-OSS (clamped, biased, transposed, interleaved) and Nemotron-H (ungated relu2), in each dtype.
  struct NamedConfig {
    const char* name;
    ExpertsConfig config;
  };
  const NamedConfig configs[] = {
      {"swiglu", make_config(kActivations[0], true, false, false, true)},
      {"gptoss", make_config(kActivations[5], true, true, true, false)},
      {"relu2_nogate", make_config(kActivations[4], false, false, false, true)},
  };
  for (DType dtype : kDTypes)
    for (const auto& nc : configs) {
      const std::string suffix = std::string("_").append(dtype_name(dtype)).append("_").append(nc.name);
      auto add = [&](const char* name, RandomProblemOptions o, std::vector<int64_t> all_sentinel_tokens = {}) {
        cases.push_back({std::string(name).append(suffix), o, std::move(all_sentinel_tokens)});
      };
      auto base = [&](int64_t tokens, int64_t experts, int64_t top_k) {
        return sized(tokens, 64, 32, experts, top_k, dtype, nc.config);
      };
      RandomProblemOptions o = base(16, 8, 2);
      o.used_experts = 3;  // experts 3..7 receive no token
      add("empty_experts", o);
      o = base(16, 8, 2);
      o.all_to_one_expert = true;  // both slots of every token go to expert 0
      add("one_expert", o);
      add("top1", base(16, 8, 1));
      add("one_token", base(1, 8, 2));
      add("no_tokens", base(0, 8, 2));
      add("odd_sizes", sized(7, 37, 19, 5, 3, dtype, nc.config));
      o = base(24, 6, 3);
      o.sentinel_fraction = 0.3;
      add("sentinels", o, {0, 13, 23});
      o = base(16, 8, 2);
      o.index_dtype = DType::i32;
      o.sentinel_fraction = 0.2;
      add("i32_ids", o, {3, 4, 5});
      o = base(16, 8, 2);
      o.weights_dtype = dtype;  // routing weights in the activation dtype, as transformers may pass them
      add("act_weights", o);
      add("decode_many_experts", sized(3, 64, 32, 64, 8, dtype, nc.config));
      add("every_expert", base(10, 4, 4));
      // Large enough that tiled and multi-threaded paths run: several tiles per expert in every dimension.
      add("large", sized(300, 160, 96, 16, 4, dtype, nc.config));
      // I = 256: rows of whole 32-lane pieces in every dtype (batched_mm's flat down loads on CUDA),
      // with sentinels and a token of sentinels only.
      o = sized(5, 64, 256, 8, 4, dtype, nc.config);
      o.sentinel_fraction = 0.3;
      add("whole_pieces", o, {2});
      // I = 768 and K = 10: rows of three pieces in bf16 and f16 (batched_mm's staged down kernel on CUDA,
      // with more pairs than warps, so warps stage two pairs in turn), six in f32 (the streaming kernel).
      o = sized(4, 64, 768, 24, 10, dtype, nc.config);
      o.sentinel_fraction = 0.2;
      add("three_pieces", o, {1});
      // H = 60 (the last block of 8 hidden columns is partial) and I = 200 (rows end inside a piece).
      o = sized(5, 60, 200, 8, 3, dtype, nc.config);
      o.sentinel_fraction = 0.2;
      add("ragged_rows", o, {3});
      // I = 1,408 (Qwen1.5-MoE's): six pieces a row in bf16 and f16, the last one partial (the staged down
      // kernel's longest rows, taken when its grid is one wave).
      o = sized(2, 64, 1408, 8, 4, dtype, nc.config);
      o.sentinel_fraction = 0.2;
      add("six_pieces", o);
    }

  // Quantised weights (DESIGN §3): FP8 with f32 and with ue8m0 scales, FP4; activations quantised on the fly.
  // Quantised weights are untransposed, so GPT-OSS's layout appears here untransposed (still clamped,
  // biased and interleaved). Sizes leave partial blocks: H = 200 and I = 150 are not multiples of 128 (FP8)
  // or 32 (FP4); the large case has several full blocks per expert and a partial one in each dimension.
  struct WeightChoice {
    const char* name;
    WeightFormat format;
    DType scale_dtype;
  };
  const WeightChoice weight_choices[] = {{"fp8", WeightFormat::fp8_e4m3, DType::f32},
                                         {"fp8ue8m0", WeightFormat::fp8_e4m3, DType::ue8m0},
                                         {"fp4", WeightFormat::fp4_e2m1, DType::ue8m0}};
  const NamedConfig quantized_configs[] = {
      {"swiglu", make_config(kActivations[0], true, false, false, true)},
      {"gptoss", make_config(kActivations[5], true, true, false, false)},
      {"relu2_nogate", make_config(kActivations[4], false, false, false, true)},
  };
  for (const auto& w : weight_choices)
    for (DType dtype : kDTypes)
      for (const auto& nc : quantized_configs) {
        // Every configuration in bf16 (what quantised checkpoints run with); SwiGLU alone in f32 and f16.
        if (dtype != DType::bf16 && std::string_view(nc.name) != "swiglu") continue;
        const std::string suffix =
            std::string("_").append(w.name).append("_").append(dtype_name(dtype)).append("_").append(nc.name);
        auto add = [&](const char* name, RandomProblemOptions o, std::vector<int64_t> all_sentinel_tokens = {}) {
          o.config.quantization.weights = w.format;
          o.scale_dtype = w.scale_dtype;
          cases.push_back({std::string(name).append(suffix), o, std::move(all_sentinel_tokens)});
        };
        auto base = [&](int64_t tokens, int64_t experts, int64_t top_k) {
          return sized(tokens, 200, 150, experts, top_k, dtype, nc.config);
        };
        add("partial_blocks", base(7, 5, 3));
        RandomProblemOptions o = base(16, 8, 2);
        o.used_experts = 3;
        add("empty_experts", o);
        add("top1", base(16, 8, 1));
        add("one_token", base(1, 8, 2));
        add("no_tokens", base(0, 8, 2));
        o = base(24, 6, 3);
        o.sentinel_fraction = 0.3;
        add("sentinels", o, {0, 13, 23});
        add("decode_many_experts", sized(3, 256, 128, 64, 8, dtype, nc.config));
        // Rows of whole 16-byte pieces (the shapes batched_mm's FP8 tensor-core path takes) with sentinels,
        // a token of sentinels only, and a 128-wide group cut short in H and I.
        o = sized(24, 208, 176, 6, 3, dtype, nc.config);
        o.sentinel_fraction = 0.3;
        add("sentinels_rows16", o, {5, 17});
        add("large", sized(300, 264, 136, 16, 4, dtype, nc.config));
      }

  // Shapes for the tiled GPU kernels (deepgemm: 128-row tiles, 256-wide column blocks, 64-deep k steps):
  // several tiles in every dimension and a partial one in each (H = 520, I = 392), uneven experts, in the
  // untransposed layouts: concatenated and interleaved gate/up (with biases and the clamp), and ungated.
  const NamedConfig tiled_configs[] = {
      {"swiglu", make_config(kActivations[0], true, false, false, true)},
      {"gptoss_untransposed", make_config(kActivations[5], true, true, false, false)},
      {"relu2_nogate", make_config(kActivations[4], false, false, false, true)},
  };
  for (DType dtype : {DType::bf16, DType::f16})
    for (const auto& nc : tiled_configs)
      cases.push_back({std::string("tiled_").append(dtype_name(dtype)).append("_").append(nc.name),
                       sized(300, 520, 392, 8, 4, dtype, nc.config),
                       {}});

  // The same shapes rounded to whole 128 x 128 FP8 blocks (H = 512, I = 384: what deepgemm's FP8 path
  // takes), with f32 and with ue8m0 scales, and in FP4. Then sizes whose rows are whole 16-byte pieces (what
  // the portable tensor-core kernels of quantised weights take) with a partial 128-wide block in H, I and
  // 2I: H = 544, I = 416 (4 and 3 blocks plus 32).
  for (const auto& w : weight_choices)
    for (const auto& nc : tiled_configs)
      for (auto [prefix, hidden, intermediate] :
           {std::tuple{"tiled_", 512, 384}, std::tuple{"tiled_partial_", 544, 416}}) {
        RandomProblemOptions o = sized(300, hidden, intermediate, 8, 4, DType::bf16, nc.config);
        o.config.quantization.weights = w.format;
        o.scale_dtype = w.scale_dtype;
        cases.push_back({std::string(prefix).append(w.name).append("_bf16_").append(nc.name), o, {}});
      }

  // Rows wider than one pass of deepgemm's placing kernel (bf16: 1,152 16-byte pieces for 256 threads taking
  // 4 each; FP8: 36 groups of 128 for 8 warps taking 4 each) and more slots a token than it looks up at once
  // (K = 36 > 32), with sentinels; 288 pairs, so that the Hopper backends take the grouped GEMM, not decode.
  {
    RandomProblemOptions o =
        sized(8, 4608, 128, 40, 36, DType::bf16, make_config(kActivations[0], true, false, false, true));
    o.sentinel_fraction = 0.1;
    cases.push_back({"wide_rows_many_slots_bf16_swiglu", o, {5}});
    o.config.quantization.weights = WeightFormat::fp8_e4m3;
    o.scale_dtype = DType::f32;
    cases.push_back({"wide_rows_many_slots_fp8_bf16_swiglu", o, {5}});
  }

  // Fresh random inputs per case.
  for (std::size_t i = 0; i < cases.size(); ++i) cases[i].options.seed = 1000 + i;
  return cases;
}

const std::vector<HarnessCase>& all_cases() {
  static const std::vector<HarnessCase> cases = harness_cases();
  return cases;
}

test::Tolerance tolerance_of(const HarnessCase& c) {
  return test::tolerance_for(c.options.dtype, c.options.config.quantization.quantized());
}

void set_id(ExpertsProblem& p, int64_t token, int64_t slot, int64_t id) {
  visit_index_dtype(p.top_k_index.dtype(), [&](auto tag) {
    using I = typename decltype(tag)::type;
    p.top_k_index.data_as<I>()[token * p.top_k_index.size(1) + slot] = static_cast<I>(id);
  });
}

int64_t get_id(const ExpertsProblem& p, int64_t token, int64_t slot) {
  return visit_index_dtype(p.top_k_index.dtype(), [&](auto tag) {
    using I = typename decltype(tag)::type;
    return static_cast<int64_t>(p.top_k_index.data_as<I>()[token * p.top_k_index.size(1) + slot]);
  });
}

// The case's problem on the CPU, with its all-sentinel tokens applied.
ExpertsProblem make_case_problem(const HarnessCase& c) {
  ExpertsProblem p = make_random_problem(c.options);
  const int64_t E = c.options.experts;
  const int64_t largest =
      c.options.index_dtype == DType::i32 ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int64_t>::max();
  const int64_t sentinels[] = {E, E + 7, largest};
  int next = 0;
  for (int64_t t : c.all_sentinel_tokens)
    for (int64_t k = 0; k < c.options.top_k; ++k) set_id(p, t, k, sentinels[next++ % 3]);
  return p;
}

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

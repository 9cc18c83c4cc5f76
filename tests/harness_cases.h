// The declared case list of DESIGN §6, shared by the forward harness (test_experts_harness.cpp) and the
// backward's (test_experts_backward.cpp): every activation, layout flag and dtype, the special cases (empty
// experts, one expert, K = 1, T = 1, T = 0, odd sizes, sentinels, int32 ids), quantised weights, and the
// shapes of the tiled GPU kernels.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "harness.h"
#include "moekit/experts.h"
#include "moekit/testing/random_problem.h"

namespace moekit::test {

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

inline constexpr ActivationChoice kActivations[] = {
    {"silu", Activation::silu, false},
    {"gelu", Activation::gelu, false},
    {"gelu_tanh", Activation::gelu_pytorch_tanh, false},
    {"relu", Activation::relu, false},
    {"relu2", Activation::relu2, false},
    {"gptoss", Activation::silu, true},
};
inline constexpr DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};

inline ExpertsConfig make_config(const ActivationChoice& a, bool has_gate, bool has_bias, bool transposed, bool concatenated) {
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
inline std::string config_name(const ActivationChoice& a, const ExpertsConfig& c) {
  std::string name = a.name;
  if (!c.has_gate) name += "_nogate";
  if (c.has_bias) name += "_bias";
  if (c.is_transposed) name += "_transposed";
  if (c.has_gate && !c.is_concatenated) name += "_interleaved";
  return name;
}

inline RandomProblemOptions sized(int64_t tokens, int64_t hidden, int64_t intermediate, int64_t experts, int64_t top_k,
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

inline std::vector<HarnessCase> harness_cases() {
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

inline const std::vector<HarnessCase>& all_cases() {
  static const std::vector<HarnessCase> cases = harness_cases();
  return cases;
}

inline Tolerance tolerance_of(const HarnessCase& c) {
  return tolerance_for(c.options.dtype, c.options.config.quantization.quantized());
}

inline void set_id(ExpertsProblem& p, int64_t token, int64_t slot, int64_t id) {
  visit_index_dtype(p.top_k_index.dtype(), [&](auto tag) {
    using I = typename decltype(tag)::type;
    p.top_k_index.data_as<I>()[token * p.top_k_index.size(1) + slot] = static_cast<I>(id);
  });
}

inline int64_t get_id(const ExpertsProblem& p, int64_t token, int64_t slot) {
  return visit_index_dtype(p.top_k_index.dtype(), [&](auto tag) {
    using I = typename decltype(tag)::type;
    return static_cast<int64_t>(p.top_k_index.data_as<I>()[token * p.top_k_index.size(1) + slot]);
  });
}

// The case's problem on the CPU, with its all-sentinel tokens applied.
inline ExpertsProblem make_case_problem(const HarnessCase& c) {
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

}  // namespace moekit::test

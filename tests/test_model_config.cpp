// ModelConfig: the config.json of one real checkpoint per model_type (copied field for field, without
// auto_map and quantization_config), every parsed field and the router; per-layer MoE layout (Qwen's
// decoder_sparse_step and mlp_only_layers, DeepSeek's first dense layers); a vision-language wrapper's
// text_config; transformers 5's rope_parameters and dtype; and every error.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/model/model_config.h"

namespace moekit {
namespace {

using json = nlohmann::json;
using test::throws_error_with;

// Qwen/Qwen3-30B-A3B
const char* const kQwen3Moe = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
  "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
  "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": false,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
})";

// Qwen/Qwen1.5-MoE-A2.7B
const char* const kQwen2Moe = R"({
  "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
  "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.39.0.dev0", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936,
  "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
  "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": false, "output_router_logits": false,
  "router_aux_loss_coef": 0.001
})";

// mistralai/Mixtral-8x7B-v0.1
const char* const kMixtral = R"({
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
  "use_cache": true, "vocab_size": 32000
})";

// allenai/OLMoE-1B-7B-0924
const char* const kOlmoe = R"({
  "architectures": ["OlmoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "clip_qkv": null,
  "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": false,
  "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
  "num_key_value_heads": 16, "output_router_logits": false, "pad_token_id": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": null, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 50304
})";

// deepseek-ai/DeepSeek-V3
const char* const kDeepseekV3 = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
  "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
  "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
  "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
  "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
  "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
})";

// openai/gpt-oss-20b
const char* const kGptOss = R"({
  "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
  "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
  "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
  "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                  "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
  "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
  "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
  "output_router_logits": false, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                   "rope_type": "yarn", "truncate": false},
  "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
  "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0", "use_cache": true, "vocab_size": 201088
})";

json parsed(const char* text) {
  return json::parse(text);
}

json with(json config, const std::string& key, json value) {
  config[key] = std::move(value);
  return config;
}

json without(json config, const std::string& key) {
  config.erase(key);
  return config;
}

std::function<void()> parsing(const json& config) {
  return [config] { parse_model_config(config); };
}

std::vector<bool> layers(std::initializer_list<int> flags) {
  std::vector<bool> out;
  for (int flag : flags) out.push_back(flag != 0);
  return out;
}

TEST(ModelConfig, SupportedModelTypes) {
  EXPECT_EQ(supported_model_types(), (std::vector<std::string>{"qwen2_moe", "qwen3_moe", "mixtral", "olmoe",
                                                               "deepseek_v3", "gpt_oss", "qwen3_vl_moe"}));
}

TEST(ModelConfig, Qwen3VlMoeIsItsTextConfigWithTheWrappersFields) {
  // As Qwen3-VL-30B-A3B-Instruct's config.json (transformers 5 layout), shortened.
  const json text = {{"model_type", "qwen3_vl_moe_text"},
                     {"vocab_size", 151936},
                     {"hidden_size", 2048},
                     {"num_hidden_layers", 48},
                     {"num_attention_heads", 32},
                     {"num_key_value_heads", 4},
                     {"head_dim", 128},
                     {"intermediate_size", 6144},
                     {"moe_intermediate_size", 768},
                     {"num_experts", 128},
                     {"num_experts_per_tok", 8},
                     {"decoder_sparse_step", 1},
                     {"tie_word_embeddings", true},
                     {"dtype", "float32"},
                     {"rope_parameters",
                      {{"rope_type", "default"},
                       {"rope_theta", 5000000},
                       {"mrope_section", {24, 20, 20}},
                       {"mrope_interleaved", true}}}};
  json wrapper = {{"model_type", "qwen3_vl_moe"},
                  {"text_config", text},
                  {"vision_config", {{"model_type", "qwen3_vl_moe_vision"}, {"depth", 27}}},
                  {"dtype", "bfloat16"}};
  const ModelConfig c = parse_model_config(wrapper);
  EXPECT_EQ(c.model_type, "qwen3_vl_moe_text");
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.layer_is_moe, std::vector<bool>(48, true));
  EXPECT_TRUE(c.router.norm_topk_prob);  // always: its router has no norm_topk_prob switch
  EXPECT_TRUE(c.qk_norm && c.qk_norm_per_head);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.rope_scaling.type, "default");
  EXPECT_FALSE(c.tie_word_embeddings);  // the wrapper's (default false), not the text config's
  EXPECT_EQ(c.dtype, "bfloat16");       // the wrapper's
  EXPECT_EQ(c.text_config, "text_config");
  EXPECT_EQ(c.weights_prefix, "model.language_model.");
  EXPECT_EQ(c.ignored_weight_prefixes, std::vector<std::string>{"model.visual."});
  // Without rope_theta the text config class's default is 5e5.
  wrapper["text_config"]["rope_parameters"].erase("rope_theta");
  EXPECT_DOUBLE_EQ(parse_model_config(wrapper).rope_theta, 5e5);
  // A flat config keeps the flat layout.
  EXPECT_EQ(parse_model_config(parsed(kQwen3Moe)).weights_prefix, "model.");
  EXPECT_TRUE(throws_error_with(parsing(with(wrapper, "text_config", with(text, "model_type", "qwen3_moe"))),
                                {"text_config.model_type is 'qwen3_moe', expected 'qwen3_vl_moe_text'"}));
  EXPECT_TRUE(throws_error_with(parsing(without(wrapper, "text_config")), {"sub-config 'text_config'", "missing"}));
}

TEST(ModelConfig, Qwen3Moe30BA3B) {
  const ModelConfig c = parse_model_config(parsed(kQwen3Moe));
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 128);  // given: not hidden_size / heads = 64
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_EQ(c.layer_is_moe, std::vector<bool>(48, true));
  EXPECT_EQ(c.router.kind, RouterKind::softmax_topk);
  EXPECT_EQ(c.router.num_experts, 128);
  EXPECT_EQ(c.router.top_k, 8);
  EXPECT_TRUE(c.router.norm_topk_prob);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_EQ(c.n_shared_experts, 0);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.clip_qkv, 0);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.kv_lora_rank, 0);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_TRUE(c.layer_types.empty());
  EXPECT_EQ(c.experts.activation, Activation::silu);
  EXPECT_TRUE(c.experts.has_gate);
  EXPECT_FALSE(c.experts.has_bias);
  EXPECT_FALSE(c.experts.is_transposed);
  EXPECT_TRUE(c.experts.is_concatenated);
  EXPECT_FALSE(c.experts.swiglu_limit.has_value());
  EXPECT_EQ(c.dtype, "bfloat16");
}

TEST(ModelConfig, Qwen3MoeDefaultsOfItsConfigClass) {
  json config = parsed(kQwen3Moe);
  for (const char* key : {"norm_topk_prob", "rms_norm_eps", "rope_theta", "max_position_embeddings", "attention_bias",
                          "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings", "hidden_act", "torch_dtype",
                          "head_dim", "num_key_value_heads"})
    config.erase(key);
  const ModelConfig c = parse_model_config(config);
  EXPECT_FALSE(c.router.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.layer_is_moe, std::vector<bool>(48, true));
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.dtype, "");
  EXPECT_EQ(c.head_dim, 64);             // 2048 / 32
  EXPECT_EQ(c.num_key_value_heads, 32);  // num_attention_heads
}

TEST(ModelConfig, Qwen2MoeA27B) {
  const ModelConfig c = parse_model_config(parsed(kQwen2Moe));
  EXPECT_EQ(c.model_type, "qwen2_moe");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 16);
  EXPECT_EQ(c.head_dim, 128);  // 2048 / 16
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_experts, 60);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  EXPECT_EQ(c.intermediate_size, 5632);
  EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
  EXPECT_EQ(c.n_shared_experts, 0);
  EXPECT_EQ(c.layer_is_moe, std::vector<bool>(24, true));
  EXPECT_EQ(c.router.kind, RouterKind::softmax_topk);
  EXPECT_EQ(c.router.num_experts, 60);
  EXPECT_EQ(c.router.top_k, 4);
  EXPECT_FALSE(c.router.norm_topk_prob);
  EXPECT_TRUE(c.attention_bias);  // qkv bias, on by default
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.experts.activation, Activation::silu);
  EXPECT_EQ(c.dtype, "bfloat16");

  EXPECT_FALSE(parse_model_config(with(parsed(kQwen2Moe), "qkv_bias", false)).attention_bias);
  EXPECT_FALSE(parse_model_config(without(parsed(kQwen2Moe), "norm_topk_prob")).router.norm_topk_prob);
}

TEST(ModelConfig, Qwen2MoeSparseStepAndMlpOnlyLayers) {
  json config = parsed(kQwen2Moe);
  config["num_hidden_layers"] = 8;
  config["decoder_sparse_step"] = 2;
  config["mlp_only_layers"] = {3, 6};
  // MoE where (i + 1) % 2 == 0 and i is not in mlp_only_layers: 1, 5, 7.
  EXPECT_EQ(parse_model_config(config).layer_is_moe, layers({0, 1, 0, 0, 0, 1, 0, 1}));
  // mlp_only_layers: null is the empty list.
  config["mlp_only_layers"] = nullptr;
  EXPECT_EQ(parse_model_config(config).layer_is_moe, layers({0, 1, 0, 1, 0, 1, 0, 1}));
  // Dense layers need the dense size.
  EXPECT_TRUE(throws_error_with(parsing(without(config, "intermediate_size")),
                                {"qwen2_moe", "'intermediate_size' is missing"}));
  // Without dense layers it is optional.
  config["decoder_sparse_step"] = 1;
  EXPECT_EQ(parse_model_config(without(config, "intermediate_size")).intermediate_size, 0);
}

TEST(ModelConfig, Mixtral8x7B) {
  const ModelConfig c = parse_model_config(parsed(kMixtral));
  EXPECT_EQ(c.model_type, "mixtral");
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 14336);
  EXPECT_EQ(c.intermediate_size, 0);  // no dense layers
  EXPECT_EQ(c.layer_is_moe, std::vector<bool>(32, true));
  EXPECT_EQ(c.router.kind, RouterKind::softmax_topk);
  EXPECT_EQ(c.router.num_experts, 8);
  EXPECT_EQ(c.router.top_k, 2);
  EXPECT_TRUE(c.router.norm_topk_prob);  // Mixtral always renormalises
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.dtype, "bfloat16");

  EXPECT_EQ(parse_model_config(with(parsed(kMixtral), "sliding_window", 4096)).sliding_window, 4096);
  const ModelConfig defaults = parse_model_config(without(without(parsed(kMixtral), "rope_theta"), "rms_norm_eps"));
  EXPECT_DOUBLE_EQ(defaults.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(defaults.rms_norm_eps, 1e-5);
}

TEST(ModelConfig, Olmoe1B7B) {
  const ModelConfig c = parse_model_config(parsed(kOlmoe));
  EXPECT_EQ(c.model_type, "olmoe");
  EXPECT_EQ(c.vocab_size, 50304);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 16);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 16);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.num_experts, 64);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 1024);
  EXPECT_EQ(c.intermediate_size, 0);
  EXPECT_EQ(c.layer_is_moe, std::vector<bool>(16, true));
  EXPECT_EQ(c.router.kind, RouterKind::softmax_topk);
  EXPECT_EQ(c.router.num_experts, 64);
  EXPECT_EQ(c.router.top_k, 8);
  EXPECT_FALSE(c.router.norm_topk_prob);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.clip_qkv, 0);  // null
  EXPECT_EQ(c.dtype, "bfloat16");

  EXPECT_DOUBLE_EQ(parse_model_config(with(parsed(kOlmoe), "clip_qkv", 8.0)).clip_qkv, 8.0);
  EXPECT_TRUE(parse_model_config(with(parsed(kOlmoe), "norm_topk_prob", true)).router.norm_topk_prob);
}

TEST(ModelConfig, DeepseekV3) {
  const ModelConfig c = parse_model_config(parsed(kDeepseekV3));
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.num_key_value_heads, 128);
  EXPECT_EQ(c.head_dim, 64);  // qk_rope_head_dim, as in transformers' DeepseekV3Config
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);  // an integer in the file
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  std::vector<bool> moe(61, true);
  moe[0] = moe[1] = moe[2] = false;  // first_k_dense_replace = 3
  EXPECT_EQ(c.layer_is_moe, moe);
  EXPECT_EQ(c.router.kind, RouterKind::deepseek_v3);
  EXPECT_EQ(c.router.num_experts, 256);
  EXPECT_EQ(c.router.top_k, 8);
  EXPECT_TRUE(c.router.norm_topk_prob);
  EXPECT_EQ(c.router.n_group, 8);
  EXPECT_EQ(c.router.topk_group, 4);
  EXPECT_FLOAT_EQ(c.router.routed_scaling_factor, 2.5f);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.dtype, "bfloat16");

  // q_lora_rank null: q_proj without compression.
  EXPECT_EQ(parse_model_config(with(parsed(kDeepseekV3), "q_lora_rank", nullptr)).q_lora_rank, 0);
  EXPECT_TRUE(parse_model_config(without(parsed(kDeepseekV3), "norm_topk_prob")).router.norm_topk_prob);
  // No dense layers: intermediate_size becomes optional.
  const json all_moe = with(parsed(kDeepseekV3), "first_k_dense_replace", 0);
  EXPECT_EQ(parse_model_config(all_moe).layer_is_moe, std::vector<bool>(61, true));
  EXPECT_EQ(parse_model_config(without(all_moe, "intermediate_size")).intermediate_size, 0);
}

TEST(ModelConfig, GptOss20B) {
  const ModelConfig c = parse_model_config(parsed(kGptOss));
  EXPECT_EQ(c.model_type, "gpt_oss");
  EXPECT_EQ(c.vocab_size, 201088);
  EXPECT_EQ(c.hidden_size, 2880);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 64);  // given (2880 / 64 = 45)
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 150000.0);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.num_experts, 32);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 2880);
  EXPECT_EQ(c.intermediate_size, 0);
  EXPECT_EQ(c.layer_is_moe, std::vector<bool>(24, true));
  EXPECT_EQ(c.router.kind, RouterKind::topk_softmax);
  EXPECT_EQ(c.router.num_experts, 32);
  EXPECT_EQ(c.router.top_k, 4);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ(c.sliding_window, 128);
  ASSERT_EQ(c.layer_types.size(), 24u);
  EXPECT_EQ(c.layer_types[0], "sliding_attention");
  EXPECT_EQ(c.layer_types[23], "full_attention");
  EXPECT_EQ(c.experts.activation, Activation::silu);
  EXPECT_TRUE(c.experts.has_gate);
  EXPECT_TRUE(c.experts.has_bias);
  EXPECT_TRUE(c.experts.is_transposed);
  EXPECT_FALSE(c.experts.is_concatenated);
  ASSERT_TRUE(c.experts.swiglu_limit.has_value());
  EXPECT_FLOAT_EQ(*c.experts.swiglu_limit, 7.0f);
  EXPECT_FLOAT_EQ(c.experts.swiglu_alpha, 1.702f);
  EXPECT_EQ(c.dtype, "");  // gpt-oss-20b's config.json names none

  // The defaults of GptOssConfig: alternating layer types (even layers slide), window 128, limit 7.
  json defaults = parsed(kGptOss);
  for (const char* key : {"layer_types", "sliding_window", "swiglu_limit", "attention_bias"}) defaults.erase(key);
  defaults["num_hidden_layers"] = 3;
  const ModelConfig d = parse_model_config(defaults);
  EXPECT_EQ(d.layer_types, (std::vector<std::string>{"sliding_attention", "full_attention", "sliding_attention"}));
  EXPECT_EQ(d.sliding_window, 128);
  EXPECT_FLOAT_EQ(*d.experts.swiglu_limit, 7.0f);
  EXPECT_TRUE(d.attention_bias);
  // The top-k under its other name only.
  EXPECT_EQ(parse_model_config(without(parsed(kGptOss), "num_experts_per_tok")).num_experts_per_tok, 4);
}

TEST(ModelConfig, VisionLanguageTextConfigAndTransformers5Fields) {
  // A multimodal wrapper: the language model is the text_config. transformers 5 writes "dtype" and
  // puts rope_theta into rope_parameters.
  json text = without(without(parsed(kQwen3Moe), "rope_theta"), "torch_dtype");
  text["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5000000.0}};
  text["dtype"] = "float32";
  const json wrapper = {{"architectures", {"ExampleMoeVLForConditionalGeneration"}},
                        {"model_type", "example_vl_moe"},
                        {"image_token_id", 151655},
                        {"text_config", text},
                        {"vision_config", {{"model_type", "example_vl_vision"}, {"depth", 27}}},
                        {"dtype", "bfloat16"}};
  const ModelConfig c = parse_model_config(wrapper["text_config"]);
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.dtype, "float32");
  // The wrapper itself is not a supported model; the error points at its sub-configs.
  EXPECT_TRUE(throws_error_with(parsing(wrapper), {"unknown model_type 'example_vl_moe'", "qwen3_moe, mixtral",
                                                   "text_config (qwen3_moe)", "vision_config (example_vl_vision)"}));
  EXPECT_TRUE(throws_error_with(parsing(without(wrapper, "model_type")),
                                {"'model_type' is missing", "supported: qwen2_moe", "text_config (qwen3_moe)"}));
}

TEST(ModelConfig, UnknownOrMissingModelType) {
  EXPECT_TRUE(throws_error_with(
      parsing(with(parsed(kMixtral), "model_type", "llama")),
      {"unknown model_type 'llama'", "supported: qwen2_moe, qwen3_moe, mixtral, olmoe, deepseek_v3, gpt_oss"}));
  EXPECT_TRUE(
      throws_error_with(parsing(with(parsed(kMixtral), "model_type", 3)), {"'model_type' must be a string", "number"}));
  EXPECT_TRUE(throws_error_with(parsing(json::array()), {"expected a JSON object", "array"}));
}

TEST(ModelConfig, MissingRequiredFieldNamesItAndTheModelType) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {kQwen3Moe, "num_experts"},
      {kQwen3Moe, "moe_intermediate_size"},
      {kQwen2Moe, "shared_expert_intermediate_size"},
      {kMixtral, "num_local_experts"},
      {kMixtral, "hidden_size"},
      {kOlmoe, "intermediate_size"},
      {kOlmoe, "vocab_size"},
      {kDeepseekV3, "n_group"},
      {kDeepseekV3, "routed_scaling_factor"},
      {kDeepseekV3, "first_k_dense_replace"},
      {kDeepseekV3, "kv_lora_rank"},
      {kDeepseekV3, "q_lora_rank"},
      {kDeepseekV3, "intermediate_size"},
      {kGptOss, "num_local_experts"},
      {kGptOss, "num_hidden_layers"},
  };
  for (const auto& [text, key] : cases) {
    const json config = parsed(text);
    const std::string model_type = config["model_type"];
    EXPECT_TRUE(throws_error_with(
        parsing(without(config, key)),
        {"model_type '" + model_type + "'", "required field '" + std::string(key) + "'", "moekit takes no default"}))
        << key;
  }
  // Both names of GPT-OSS's top-k missing: the transformers name is asked for.
  EXPECT_TRUE(throws_error_with(parsing(without(without(parsed(kGptOss), "num_experts_per_tok"), "experts_per_token")),
                                {"gpt_oss", "'num_experts_per_tok' is missing"}));
  // null is absent.
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kMixtral), "num_experts_per_tok", nullptr)),
                                {"mixtral", "'num_experts_per_tok' is missing"}));
}

TEST(ModelConfig, WrongJsonTypes) {
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kQwen3Moe), "hidden_size", "2048")),
                                {"qwen3_moe", "'hidden_size' must be an integer", "string \"2048\""}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kQwen3Moe), "hidden_size", 2048.0)),
                                {"'hidden_size' must be an integer", "number 2048.0"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kQwen3Moe), "norm_topk_prob", "true")),
                                {"'norm_topk_prob' must be a boolean"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kMixtral), "rms_norm_eps", "1e-5")),
                                {"mixtral", "'rms_norm_eps' must be a number"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kMixtral), "hidden_act", 1)), {"'hidden_act' must be a string"}));
  EXPECT_TRUE(
      throws_error_with(parsing(with(parsed(kMixtral), "torch_dtype", 16)), {"'torch_dtype' must be a string"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kQwen2Moe), "mlp_only_layers", 3)),
                                {"'mlp_only_layers' must be an array", "number 3"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kQwen2Moe), "mlp_only_layers", {1, 2.5})),
                                {"'mlp_only_layers[1]' must be an integer"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kGptOss), "layer_types", {"sliding_attention", 1})),
                                {"'layer_types[1]' must be a string"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kDeepseekV3), "routed_scaling_factor", true)),
                                {"'routed_scaling_factor' must be a number", "boolean"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kQwen3Moe), "vocab_size", 18446744073709551615ull)),
                                {"'vocab_size' is out of range"}));
  json rope = without(parsed(kQwen3Moe), "rope_theta");
  rope["rope_parameters"] = "default";
  EXPECT_TRUE(throws_error_with(parsing(rope), {"'rope_parameters' must be an object"}));
  EXPECT_TRUE(throws_error_with(parsing(with(parsed(kQwen3Moe), "hidden_act", "swiglu")),
                                {"qwen3_moe", "'hidden_act'", "unknown activation 'swiglu'", "silu"}));
}

TEST(ModelConfig, InconsistentValues) {
  const auto expect_error = [](const json& config, const std::vector<std::string>& parts) {
    EXPECT_TRUE(throws_error_with(parsing(config), parts));
  };
  expect_error(with(parsed(kMixtral), "num_experts_per_tok", 9),
               {"mixtral", "num_experts_per_tok = 9 is larger than num_local_experts = 8"});
  expect_error(with(parsed(kGptOss), "experts_per_token", 5),
               {"num_experts_per_tok = 4 and experts_per_token = 5 disagree"});
  expect_error(with(without(parsed(kQwen3Moe), "head_dim"), "hidden_size", 2050),
               {"head_dim is absent", "hidden_size = 2050 is not divisible by num_attention_heads = 32"});
  expect_error(with(parsed(kMixtral), "num_key_value_heads", 5),
               {"num_attention_heads = 32 is not a multiple of num_key_value_heads = 5"});
  expect_error(with(parsed(kDeepseekV3), "n_group", 7), {"n_group = 7 does not divide n_routed_experts = 256"});
  expect_error(with(with(parsed(kDeepseekV3), "n_routed_experts", 8), "num_experts_per_tok", 2),
               {"groups of n_routed_experts / n_group = 8 / 8 = 1 expert"});
  expect_error(with(parsed(kDeepseekV3), "topk_group", 9), {"topk_group = 9 is larger than n_group = 8"});
  expect_error(with(parsed(kDeepseekV3), "topk_group", 0), {"'topk_group' must be >= 1, got 0"});
  expect_error(with(with(parsed(kDeepseekV3), "topk_group", 1), "num_experts_per_tok", 33),
               {"num_experts_per_tok = 33 is larger than the 32 experts of topk_group = 1 groups of 32"});
  expect_error(with(parsed(kDeepseekV3), "first_k_dense_replace", 62),
               {"first_k_dense_replace = 62 is larger than num_hidden_layers = 61"});
  expect_error(with(parsed(kDeepseekV3), "routed_scaling_factor", 0), {"'routed_scaling_factor' must be > 0"});
  expect_error(with(parsed(kQwen2Moe), "mlp_only_layers", {24}),
               {"mlp_only_layers holds 24, outside the num_hidden_layers = 24 layers"});
  expect_error(with(parsed(kQwen2Moe), "decoder_sparse_step", 0), {"'decoder_sparse_step' must be >= 1, got 0"});
  expect_error(with(parsed(kQwen3Moe), "use_sliding_window", true), {"use_sliding_window = true is not supported"});
  expect_error(with(parsed(kOlmoe), "num_experts", 0), {"olmoe", "'num_experts' must be >= 1, got 0"});
  expect_error(with(parsed(kOlmoe), "hidden_size", -2048), {"'hidden_size' must be >= 1, got -2048"});
  expect_error(with(parsed(kOlmoe), "clip_qkv", -1.0), {"'clip_qkv' must be >= 0"});
  expect_error(with(parsed(kGptOss), "layer_types", {"sliding_attention"}),
               {"layer_types has 1 entries, expected num_hidden_layers = 24"});
  json bad_type = parsed(kGptOss);
  bad_type["layer_types"][5] = "chunked_attention";
  expect_error(bad_type, {"layer_types[5] = 'chunked_attention'", "sliding_attention or full_attention"});
  expect_error(with(parsed(kGptOss), "hidden_act", "gelu"), {"hidden_act must be silu", "'gelu'"});
}

}  // namespace
}  // namespace moekit

// A model's config.json (or one of its sub-configs, such as a vision-language model's text_config) as a
// typed description: the sizes, the per-layer MoE layout, the router and the experts' layout the model
// runtime builds from. Field names and defaults are those of transformers' configuration class for each
// model_type. Where transformers' default is a reference model's size (vocab, hidden, layers, heads,
// experts, top-k, intermediate sizes, DeepSeek's MLA and group sizes) the field is required: a config
// that lacks one is almost certainly not the checkpoint's, and guessing would only fail later, at a
// tensor shape. A JSON null counts as absent, as transformers reads None.
//
// Every error is a moekit::Error naming the model_type and the field, and what was expected.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moekit/experts.h"
#include "moekit/model/router.h"

namespace moekit {

// How the rotary position embedding's frequencies are scaled (transformers' rope_type). "default": none;
// "linear": positions divided by factor; "yarn": YaRN's blend of interpolated and extrapolated
// frequencies with cos/sin scaled by attention_factor. Other rope types are refused at parse time.
struct RopeScaling {
  std::string type = "default";  // default | linear | yarn
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;  // yarn; default max_position_embeddings
  double beta_fast = 32.0, beta_slow = 1.0;       // yarn
  double mscale = 0.0, mscale_all_dim = 0.0;      // yarn (DeepSeek); 0 = absent
  double attention_factor = 0.0;                  // yarn; 0 = derived from factor and the mscales
  bool truncate = true;                           // yarn: round the correction range outwards
};

// A pre-quantised checkpoint's config.json "quantization_config", as transformers' FineGrainedFP8 method
// ("quant_method": "fp8") writes it: weight_block_size [128, 128], activation_scheme "dynamic" (a "static"
// scheme is refused at parse time: no backend runs it), optional scale_fmt "ue8m0" (the float32 scales in
// the file are powers of two and load as ue8m0), and moekit's FP4 variant "expert_dtype": "fp4" (the
// experts hold F4 e2m1 values with ue8m0 scales per 32 values along K; weight_block_size still describes
// any FP8 dense linears). experts.quantization is set from it; the loader may clear that (dequantize).
struct CheckpointQuantization {
  bool present = false;                       // config.json has a quantization_config
  WeightFormat experts = WeightFormat::none;  // fp8_e4m3, or fp4_e2m1 with expert_dtype "fp4"
  bool ue8m0_scales = false;                  // scale_fmt "ue8m0" (always true for FP4 experts)
};

struct ModelConfig {
  std::string model_type;  // one of supported_model_types()
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // divides num_attention_heads; default num_attention_heads
  int64_t head_dim = 0;             // default hidden_size / num_attention_heads (deepseek_v3: qk_rope_head_dim)
  double rms_norm_eps = 0;
  double rope_theta = 0;  // top-level rope_theta, else rope_parameters.rope_theta (transformers 5)
  RopeScaling rope_scaling;  // rope_parameters (transformers 5) or rope_scaling (older configs)
  // deepseek_v3: the rotary dimensions come in interleaved pairs (x0, x1), (x2, x3), ... (rope_interleave,
  // default true); otherwise the two halves of the head rotate together (rotate_half).
  bool rope_interleave = false;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  std::string hidden_act;  // as written; experts.activation is its parse_activation

  // MoE
  int64_t num_experts = 0;            // E: num_experts | num_local_experts | n_routed_experts
  int64_t num_experts_per_tok = 0;    // K, in [1, E]
  int64_t moe_intermediate_size = 0;  // one expert's I (mixtral, olmoe, gpt_oss: their intermediate_size)
  RouterConfig router;
  ExpertsConfig experts;           // activation and layout of the fused expert weights
  std::vector<bool> layer_is_moe;  // [num_hidden_layers]; false: a dense MLP of intermediate_size
  // The dense MLP's size: config intermediate_size for qwen2_moe, qwen3_moe and deepseek_v3 (required
  // only when some layer is dense, else 0 if absent); 0 for mixtral, olmoe and gpt_oss, which have no
  // dense layers (their intermediate_size is the experts').
  int64_t intermediate_size = 0;

  // Shared experts
  int64_t shared_expert_intermediate_size = 0;  // qwen2_moe: one shared expert, sigmoid-gated
  int64_t n_shared_experts = 0;  // deepseek_v3: ungated, one MLP of n_shared_experts * moe_intermediate_size

  // Attention
  bool attention_bias = false;  // q/k/v (and gpt_oss o) projection bias; qwen2_moe: qkv_bias, default true
  bool qk_norm = false;         // RMSNorm on q and k: qwen3_moe (per head), olmoe (whole projection)
  bool qk_norm_per_head = false;  // qk_norm over each head's head_dim values (else the whole projection)
  double clip_qkv = 0;          // olmoe: clamp q, k, v to [-clip_qkv, clip_qkv]; 0 = no clamp

  // deepseek_v3 multi-head latent attention
  int64_t q_lora_rank = 0;  // 0 (null in config.json): q_proj without the low-rank compression
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  // Sliding-window attention (mixtral when set, gpt_oss): window in tokens, 0 = none; layer_types holds
  // "sliding_attention" | "full_attention" per layer for gpt_oss (default: even layers slide), else empty.
  int64_t sliding_window = 0;
  std::vector<std::string> layer_types;

  CheckpointQuantization quantization;  // quantization_config; absent: not quantised

  std::string dtype;  // "dtype" (transformers 5) or "torch_dtype" as written ("bfloat16"), "" if absent

  // A vision-language checkpoint whose language model runs as text only (qwen3_vl_moe): the fields above
  // describe the text sub-config; these say where it and its weights are. Flat checkpoints: "", "model.",
  // none ignored.
  std::string text_config;                           // its key in config.json ("text_config"); the experts backbone
  std::string weights_prefix = "model.";             // "model.language_model.": embed_tokens, layers.*, norm
  std::vector<std::string> ignored_weight_prefixes;  // the other towers' weights ("model.visual."), not loaded
};

// A supported vision-language wrapper (qwen3_vl_moe) gives its text sub-config's ModelConfig with the
// wrapper's fields above; its top-level tie_word_embeddings, dtype and quantization_config apply (as in
// transformers, whose wrapper model owns lm_head). Throws moekit::Error for an unknown model_type (listing
// the supported ones, and the sub-configs the object holds when it is another multimodal wrapper), a
// missing required field, a field of the wrong JSON type, or inconsistent values.
ModelConfig parse_model_config(const nlohmann::json& config);

std::vector<std::string> supported_model_types();  // in a fixed order

}  // namespace moekit

// config.json -> ModelConfig. One parser per model_type, each reading its transformers configuration
// class's field names with that class's defaults; a table of them drives dispatch and
// supported_model_types(). The config is untrusted input: every field is type-checked and every value
// the runtime will size tensors or index layers with is range-checked here, once.
#include "moekit/model/model_config.h"

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>

#include "moekit/error.h"
#include "moekit/io/json_input.h"

namespace moekit {
namespace {

using json = nlohmann::json;

// A short rendering of a JSON value for error messages.
std::string show(const json& value) {
  return describe_json_with_type(value);
}

// Typed access to one config object's fields. A JSON null is absent (transformers reads it as None).
class Fields {
 public:
  Fields(const json& config, std::string model_type) : config_(config), model_type_(std::move(model_type)) {}

  const std::string& model_type() const { return model_type_; }
  // The prefix of every error about this config.
  std::string where() const { return "model config (model_type '" + model_type_ + "'): "; }

  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Present, even if null.
  bool has_key(std::string_view key) const { return config_.contains(key); }

  // A field transformers gives a reference model's value by default, which moekit does not assume.
  template <typename T>
  T required(std::string_view key) const {
    const json* value = find(key);
    MOEKIT_CHECK(value != nullptr, where(), "required field '", key, "' is missing (moekit takes no default for it)");
    return convert<T>(key, *value);
  }

  template <typename T>
  T get(std::string_view key, T fallback) const {
    const json* value = find(key);
    return value != nullptr ? convert<T>(key, *value) : std::move(fallback);
  }

  // An integer >= minimum when present; required or with a default (which may be below minimum, as 0
  // for "none").
  int64_t integer(std::string_view key, int64_t minimum, std::optional<int64_t> fallback = std::nullopt) const {
    if (fallback && !has(key)) return *fallback;
    const int64_t value = required<int64_t>(key);
    MOEKIT_CHECK(value >= minimum, where(), "field '", key, "' must be >= ", minimum, ", got ", value);
    return value;
  }

  // A number > 0, required or with a default.
  double positive_number(std::string_view key, std::optional<double> fallback = std::nullopt) const {
    const double value = fallback ? get<double>(key, *fallback) : required<double>(key);
    MOEKIT_CHECK(value > 0, where(), "field '", key, "' must be > 0, got ", value);
    return value;
  }

 private:
  const json* find(std::string_view key) const {
    const auto it = config_.find(key);
    return it == config_.end() || it->is_null() ? nullptr : &*it;
  }

  template <typename T>
  T convert(std::string_view key, const json& value) const {
    if constexpr (std::is_same_v<T, bool>) {
      MOEKIT_CHECK(value.is_boolean(), where(), "field '", key, "' must be a boolean, got ", show(value));
      return value.get<bool>();
    } else if constexpr (std::is_same_v<T, int64_t>) {
      MOEKIT_CHECK(value.is_number_integer(), where(), "field '", key, "' must be an integer, got ", show(value));
      MOEKIT_CHECK(!value.is_number_unsigned() ||
                       value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                   where(), "field '", key, "' is out of range: ", value.dump());
      return value.get<int64_t>();
    } else if constexpr (std::is_same_v<T, double>) {
      MOEKIT_CHECK(value.is_number(), where(), "field '", key, "' must be a number, got ", show(value));
      return value.get<double>();
    } else if constexpr (std::is_same_v<T, json>) {
      return value;
    } else if constexpr (std::is_same_v<T, std::string>) {
      MOEKIT_CHECK(value.is_string(), where(), "field '", key, "' must be a string, got ", show(value));
      return value.get<std::string>();
    } else {
      using Element = typename T::value_type;
      MOEKIT_CHECK(value.is_array(), where(), "field '", key, "' must be an array, got ", show(value));
      T out;
      for (std::size_t i = 0; i < value.size(); ++i)
        out.push_back(convert<Element>(std::string(key) + "[" + std::to_string(i) + "]", value[i]));
      return out;
    }
  }

  const json& config_;
  std::string model_type_;
};

// The defaults of a transformers configuration class that are behaviour, not a reference model's size.
struct Defaults {
  double rms_norm_eps;
  double rope_theta;
  int64_t max_position_embeddings;
  bool attention_bias;
};

// rope_theta and the rope scaling: transformers 5 writes both into rope_parameters; older configs have
// a top-level rope_theta and a rope_scaling object ("type" or "rope_type"). The top-level rope_theta
// wins when both are there, as in transformers' standardize_rope_params.
void parse_rope(const Fields& f, double default_theta, ModelConfig& c) {
  json rope = json::object();
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!f.has(key)) continue;
    rope = f.required<json>(key);
    MOEKIT_CHECK(rope.is_object(), f.where(), "field '", key, "' must be an object, got ", show(rope));
    break;
  }
  const Fields r(rope, f.model_type());
  c.rope_theta = f.has("rope_theta") ? f.positive_number("rope_theta") : r.positive_number("rope_theta", default_theta);
  auto& s = c.rope_scaling;
  s.type = r.has("rope_type") ? r.required<std::string>("rope_type") : r.get<std::string>("type", "default");
  MOEKIT_CHECK(s.type == "default" || s.type == "linear" || s.type == "yarn", f.where(), "rope type '", s.type,
               "' is not supported (supported: default, linear, yarn)");
  MOEKIT_CHECK(r.get<double>("partial_rotary_factor", 1.0) == 1.0, f.where(),
               "partial_rotary_factor != 1 is not supported");
  if (s.type == "default") return;
  s.factor = r.positive_number("factor");
  if (s.type == "linear") return;
  s.original_max_position_embeddings = r.integer("original_max_position_embeddings", 1, c.max_position_embeddings);
  s.beta_fast = r.positive_number("beta_fast", 32.0);
  s.beta_slow = r.positive_number("beta_slow", 1.0);
  s.mscale = r.get<double>("mscale", 0.0);
  s.mscale_all_dim = r.get<double>("mscale_all_dim", 0.0);
  s.attention_factor = r.get<double>("attention_factor", 0.0);
  s.truncate = r.get<bool>("truncate", true);
}

// Fields every supported model has. head_dim_default: what an absent head_dim means (transformers:
// hidden_size / num_attention_heads, except DeepSeek-V3, whose head_dim is qk_rope_head_dim).
void parse_common(const Fields& f, const Defaults& defaults, std::optional<int64_t> head_dim_default, ModelConfig& c) {
  c.model_type = f.model_type();
  c.vocab_size = f.integer("vocab_size", 1);
  c.hidden_size = f.integer("hidden_size", 1);
  c.num_hidden_layers = f.integer("num_hidden_layers", 1);
  // The config's layer list is built before any weight is read, so its length needs a bound of its own;
  // the deepest models published have fewer than 200 layers.
  constexpr int64_t kMaxLayers = int64_t{1} << 16;
  MOEKIT_CHECK(c.num_hidden_layers <= kMaxLayers, f.where(), "field 'num_hidden_layers' must be <= ", kMaxLayers,
               " (moekit's bound on the layer count), got ", c.num_hidden_layers);
  c.num_attention_heads = f.integer("num_attention_heads", 1);
  c.num_key_value_heads = f.integer("num_key_value_heads", 1, c.num_attention_heads);
  MOEKIT_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, f.where(),
               "num_attention_heads = ", c.num_attention_heads,
               " is not a multiple of num_key_value_heads = ", c.num_key_value_heads);
  if (f.has("head_dim")) {
    c.head_dim = f.integer("head_dim", 1);
  } else if (head_dim_default) {
    c.head_dim = *head_dim_default;
  } else {
    MOEKIT_CHECK(c.hidden_size % c.num_attention_heads == 0, f.where(),
                 "head_dim is absent and hidden_size = ", c.hidden_size,
                 " is not divisible by num_attention_heads = ", c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.rms_norm_eps = f.positive_number("rms_norm_eps", defaults.rms_norm_eps);
  c.max_position_embeddings = f.integer("max_position_embeddings", 1, defaults.max_position_embeddings);
  parse_rope(f, defaults.rope_theta, c);
  c.tie_word_embeddings = f.get<bool>("tie_word_embeddings", false);
  c.hidden_act = f.get<std::string>("hidden_act", "silu");
  try {
    c.experts.activation = parse_activation(c.hidden_act);
  } catch (const Error& e) {
    MOEKIT_FAIL(f.where(), "field 'hidden_act': ", e.what());
  }
  c.attention_bias = f.get<bool>("attention_bias", defaults.attention_bias);
  c.dtype = f.has("dtype") ? f.required<std::string>("dtype") : f.get<std::string>("torch_dtype", "");
}

// The experts' count, top-k and size, under each model's names for them. experts_key may have an alias
// (transformers' attribute_map: Qwen3-MoE's config class writes num_local_experts for num_experts);
// whichever is present counts, and both must agree.
void parse_experts(const Fields& f, std::string_view experts_key, std::string_view top_k_key,
                   std::string_view intermediate_key, ModelConfig& c, std::string_view experts_alias = {}) {
  const bool use_alias = !experts_alias.empty() && !f.has(experts_key) && f.has(experts_alias);
  c.num_experts = f.integer(use_alias ? experts_alias : experts_key, 1);
  if (!experts_alias.empty() && f.has(experts_key) && f.has(experts_alias)) {
    const int64_t other = f.integer(experts_alias, 1);
    MOEKIT_CHECK(other == c.num_experts, f.where(), experts_key, " = ", c.num_experts, " and ", experts_alias, " = ",
                 other, " disagree");
  }
  c.num_experts_per_tok = f.integer(top_k_key, 1);
  MOEKIT_CHECK(c.num_experts_per_tok <= c.num_experts, f.where(), top_k_key, " = ", c.num_experts_per_tok,
               " is larger than ", use_alias ? experts_alias : experts_key, " = ", c.num_experts);
  c.moe_intermediate_size = f.integer(intermediate_key, 1);
  c.router.num_experts = c.num_experts;
  c.router.top_k = c.num_experts_per_tok;
}

// Models whose every layer is MoE.
void all_layers_moe(ModelConfig& c) {
  c.layer_is_moe.assign(static_cast<std::size_t>(c.num_hidden_layers), true);
}

// The dense MLP's intermediate_size: required when some layer is dense, else optional.
void parse_dense_size(const Fields& f, ModelConfig& c) {
  bool any_dense = false;
  for (bool moe : c.layer_is_moe) any_dense = any_dense || !moe;
  c.intermediate_size = any_dense ? f.integer("intermediate_size", 1) : f.integer("intermediate_size", 1, 0);
}

// Qwen2-MoE and Qwen3-MoE: layer i is MoE unless listed in mlp_only_layers or (i + 1) is not a multiple
// of decoder_sparse_step (transformers' Qwen2MoeDecoderLayer).
void parse_qwen_moe(const Fields& f, ModelConfig& c, bool qwen3,
                    const Defaults& defaults = {1e-6, 10000.0, 32768, false}) {
  parse_common(f, defaults, std::nullopt, c);
  parse_experts(f, "num_experts", "num_experts_per_tok", "moe_intermediate_size", c, "num_local_experts");
  c.router.kind = RouterKind::softmax_topk;
  c.router.norm_topk_prob = f.get<bool>("norm_topk_prob", false);
  // Its sliding window covers only some layers (max_window_layers); not implemented, so refuse it.
  MOEKIT_CHECK(!f.get<bool>("use_sliding_window", false), f.where(),
               "use_sliding_window = true is not supported (moekit runs full attention)");
  const int64_t step = f.integer("decoder_sparse_step", 1, 1);
  const auto mlp_only = f.get<std::vector<int64_t>>("mlp_only_layers", {});
  c.layer_is_moe.assign(static_cast<std::size_t>(c.num_hidden_layers), false);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.layer_is_moe[static_cast<std::size_t>(i)] = (i + 1) % step == 0;
  for (int64_t layer : mlp_only) {
    MOEKIT_CHECK(layer >= 0 && layer < c.num_hidden_layers, f.where(), "mlp_only_layers holds ", layer,
                 ", outside the num_hidden_layers = ", c.num_hidden_layers, " layers");
    c.layer_is_moe[static_cast<std::size_t>(layer)] = false;
  }
  parse_dense_size(f, c);
  if (qwen3) {
    c.qk_norm = true;
    c.qk_norm_per_head = true;
  } else {
    // Qwen2-MoE's q/k/v projections have a bias (transformers 5 names the switch qkv_bias).
    c.attention_bias = f.get<bool>("qkv_bias", true);
    c.shared_expert_intermediate_size = f.integer("shared_expert_intermediate_size", 1);
  }
}

void parse_qwen2_moe(const Fields& f, ModelConfig& c) {
  parse_qwen_moe(f, c, false);
}
void parse_qwen3_moe(const Fields& f, ModelConfig& c) {
  parse_qwen_moe(f, c, true);
}

// Qwen3-VL-MoE's language model (its text_config): Qwen3-MoE's layers, a router that always renormalises
// the top-k weights (no norm_topk_prob field), and a multimodal rope whose frequencies are split into
// sections for the temporal, height and width position ids (mrope_section, interleaved). Text tokens
// have the same position in all three, so every section rotates by the same angle as ordinary rope
// does and the sections need nothing here; image and video positions are not run (no vision tower).
void parse_qwen3_vl_moe_text(const Fields& f, ModelConfig& c) {
  parse_qwen_moe(f, c, true, {1e-6, 500000.0, 128000, false});
  c.router.norm_topk_prob = true;
}

// Mixtral's router always renormalises the top-k softmax weights; its intermediate_size is the experts'.
void parse_mixtral(const Fields& f, ModelConfig& c) {
  parse_common(f, {1e-5, 1e6, 4096 * 32, false}, std::nullopt, c);
  parse_experts(f, "num_local_experts", "num_experts_per_tok", "intermediate_size", c, "num_experts");
  c.router.kind = RouterKind::softmax_topk;
  c.router.norm_topk_prob = true;
  c.sliding_window = f.integer("sliding_window", 1, 0);
  all_layers_moe(c);
}

void parse_olmoe(const Fields& f, ModelConfig& c) {
  parse_common(f, {1e-5, 10000.0, 4096, false}, std::nullopt, c);
  parse_experts(f, "num_experts", "num_experts_per_tok", "intermediate_size", c, "num_local_experts");
  c.router.kind = RouterKind::softmax_topk;
  c.router.norm_topk_prob = f.get<bool>("norm_topk_prob", false);
  c.qk_norm = true;
  c.clip_qkv = f.get<double>("clip_qkv", 0.0);
  MOEKIT_CHECK(c.clip_qkv >= 0, f.where(), "field 'clip_qkv' must be >= 0, got ", c.clip_qkv);
  all_layers_moe(c);
}

// DeepSeek-V3: the first first_k_dense_replace layers are dense, the rest MoE with shared experts and
// the grouped sigmoid router. The group checks are route()'s, made here so a bad config fails at load.
void parse_deepseek_v3(const Fields& f, ModelConfig& c) {
  c.qk_rope_head_dim = f.integer("qk_rope_head_dim", 1);
  parse_common(f, {1e-6, 10000.0, 4096, false}, c.qk_rope_head_dim, c);
  parse_experts(f, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", c, "num_local_experts");
  const int64_t E = c.num_experts;
  auto& r = c.router;
  r.kind = RouterKind::deepseek_v3;
  r.norm_topk_prob = f.get<bool>("norm_topk_prob", true);
  r.n_group = f.integer("n_group", 1);
  r.topk_group = f.integer("topk_group", 1);
  r.routed_scaling_factor = static_cast<float>(f.positive_number("routed_scaling_factor"));
  MOEKIT_CHECK(E % r.n_group == 0, f.where(), "n_group = ", r.n_group, " does not divide n_routed_experts = ", E);
  const int64_t group_size = E / r.n_group;
  MOEKIT_CHECK(r.n_group == 1 || group_size >= 2, f.where(), "groups of n_routed_experts / n_group = ", E, " / ",
               r.n_group, " = ", group_size, " expert; a group's score needs 2");
  MOEKIT_CHECK(r.topk_group <= r.n_group, f.where(), "topk_group = ", r.topk_group,
               " is larger than n_group = ", r.n_group);
  MOEKIT_CHECK(c.num_experts_per_tok <= r.topk_group * group_size, f.where(),
               "num_experts_per_tok = ", c.num_experts_per_tok, " is larger than the ", r.topk_group * group_size,
               " experts of topk_group = ", r.topk_group, " groups of ", group_size);
  c.n_shared_experts = f.integer("n_shared_experts", 0);
  const int64_t first_dense = f.integer("first_k_dense_replace", 0);
  MOEKIT_CHECK(first_dense <= c.num_hidden_layers, f.where(), "first_k_dense_replace = ", first_dense,
               " is larger than num_hidden_layers = ", c.num_hidden_layers);
  c.layer_is_moe.assign(static_cast<std::size_t>(c.num_hidden_layers), true);
  for (int64_t i = 0; i < first_dense; ++i) c.layer_is_moe[static_cast<std::size_t>(i)] = false;
  parse_dense_size(f, c);
  // q_lora_rank is null in models whose q_proj is not compressed (config.json still names it).
  MOEKIT_CHECK(f.has_key("q_lora_rank"), f.where(),
               "required field 'q_lora_rank' is missing (moekit takes no default for it; null means no q "
               "compression)");
  c.q_lora_rank = f.integer("q_lora_rank", 1, 0);
  c.kv_lora_rank = f.integer("kv_lora_rank", 1);
  c.qk_nope_head_dim = f.integer("qk_nope_head_dim", 1);
  c.v_head_dim = f.integer("v_head_dim", 1);
  c.rope_interleave = f.get<bool>("rope_interleave", true);
}

// GPT-OSS: top-k on the logits then softmax; biased experts with the clamped SwiGLU, stored transposed
// ([E, H, 2I]) with gate and up interleaved; alternating sliding-window and full attention layers.
void parse_gpt_oss(const Fields& f, ModelConfig& c) {
  parse_common(f, {1e-5, 150000.0, 131072, true}, std::nullopt, c);
  // Its config.json carries the top-k twice: num_experts_per_tok (transformers) and experts_per_token.
  const bool has_hf_name = f.has("num_experts_per_tok");
  parse_experts(f, "num_local_experts",
                has_hf_name || !f.has("experts_per_token") ? "num_experts_per_tok" : "experts_per_token",
                "intermediate_size", c);
  if (has_hf_name && f.has("experts_per_token")) {
    const int64_t other = f.required<int64_t>("experts_per_token");
    MOEKIT_CHECK(other == c.num_experts_per_tok, f.where(), "num_experts_per_tok = ", c.num_experts_per_tok,
                 " and experts_per_token = ", other, " disagree");
  }
  c.router.kind = RouterKind::topk_softmax;
  MOEKIT_CHECK(c.experts.activation == Activation::silu, f.where(),
               "hidden_act must be silu (the clamped SwiGLU), got '", c.hidden_act, "'");
  c.experts.has_bias = true;
  c.experts.is_transposed = true;
  c.experts.is_concatenated = false;
  c.experts.swiglu_limit = static_cast<float>(f.positive_number("swiglu_limit", 7.0));
  c.experts.swiglu_alpha = 1.702f;  // a constant of transformers' GptOssExperts, not a config field
  c.sliding_window = f.integer("sliding_window", 1, 128);
  std::vector<std::string> alternating;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    alternating.emplace_back((i + 1) % 2 != 0 ? "sliding_attention" : "full_attention");
  c.layer_types = f.get<std::vector<std::string>>("layer_types", std::move(alternating));
  MOEKIT_CHECK(static_cast<int64_t>(c.layer_types.size()) == c.num_hidden_layers, f.where(), "layer_types has ",
               c.layer_types.size(), " entries, expected num_hidden_layers = ", c.num_hidden_layers);
  for (std::size_t i = 0; i < c.layer_types.size(); ++i)
    MOEKIT_CHECK(c.layer_types[i] == "sliding_attention" || c.layer_types[i] == "full_attention", f.where(),
                 "layer_types[", i, "] = '", c.layer_types[i], "', expected sliding_attention or full_attention");
  all_layers_moe(c);
}

struct Architecture {
  std::string_view model_type;
  void (*parse)(const Fields&, ModelConfig&);
};

constexpr std::array<Architecture, 6> kArchitectures = {{
    {"qwen2_moe", parse_qwen2_moe},
    {"qwen3_moe", parse_qwen3_moe},
    {"mixtral", parse_mixtral},
    {"olmoe", parse_olmoe},
    {"deepseek_v3", parse_deepseek_v3},
    {"gpt_oss", parse_gpt_oss},
}};

// Vision-language wrappers whose language model runs as text only: the text sub-config's key and
// model_type, where the language model's weights are, and the other towers' weights, skipped knowingly.
struct VisionLanguageWrapper {
  std::string_view model_type;
  std::string_view text_config;
  Architecture text;
  std::string_view weights_prefix;
  std::array<std::string_view, 1> ignored_weight_prefixes;
  bool tie_word_embeddings;  // the wrapper config class's default
};

constexpr std::array<VisionLanguageWrapper, 1> kVisionLanguageWrappers = {{
    {"qwen3_vl_moe",
     "text_config",
     {"qwen3_vl_moe_text", parse_qwen3_vl_moe_text},
     "model.language_model.",
     {"model.visual."},
     false},
}};

std::string supported_list() {
  std::string out;
  for (const auto& a : kArchitectures) out += (out.empty() ? "" : ", ") + std::string(a.model_type);
  for (const auto& w : kVisionLanguageWrappers) out += ", " + std::string(w.model_type) + " (text only)";
  return out;
}

// "; it holds sub-configs text_config (qwen3_moe), ..." for a multimodal wrapper, else "".
std::string sub_config_hint(const json& config) {
  std::string names;
  for (const auto& [key, value] : config.items()) {
    if (!value.is_object() || !(value.contains("model_type") || key.ends_with("_config"))) continue;
    names += (names.empty() ? "" : ", ") + key;
    if (const auto it = value.find("model_type"); it != value.end() && it->is_string())
      names += " (" + it->get<std::string>() + ")";
  }
  return names.empty() ? "" : "; it holds sub-configs " + names + ": parse the language model's";
}

// quantization_config (see CheckpointQuantization): only what the loader can honour is accepted.
void parse_quantization(const json& config, const std::string& model_type, ModelConfig& c) {
  const auto it = config.find("quantization_config");
  if (it == config.end() || it->is_null()) return;
  const std::string where = model_type + " config: quantization_config";
  MOEKIT_CHECK(it->is_object(), where, " must be an object, got ", show(*it));
  const json& q = *it;
  auto text = [&](const char* key, const char* fallback) {
    const auto v = q.find(key);
    if (v == q.end() || v->is_null()) return std::string(fallback);
    MOEKIT_CHECK(v->is_string(), where, ".", key, " must be a string, got ", show(*v));
    return v->get<std::string>();
  };
  const std::string method = text("quant_method", "");
  MOEKIT_CHECK(method == "fp8", where, ".quant_method is '", method,
               "'; only \"fp8\" (transformers' FineGrainedFP8 block-quantised checkpoints) is supported");
  const std::string scheme = text("activation_scheme", "dynamic");
  MOEKIT_CHECK(scheme != "static", where,
               ".activation_scheme is \"static\" (one activation scale per tensor from "
               "the checkpoint), which no experts backend runs; only \"dynamic\" is supported");
  MOEKIT_CHECK(scheme == "dynamic", where, ".activation_scheme '", scheme, "' is unknown; expected \"dynamic\"");
  const auto block = q.find("weight_block_size");
  if (block != q.end() && !block->is_null()) {
    const bool ok = block->is_array() && block->size() == 2 && (*block)[0].is_number_integer() &&
                    (*block)[1].is_number_integer() && (*block)[0].get<int64_t>() == kFp8BlockSize &&
                    (*block)[1].get<int64_t>() == kFp8BlockSize;
    MOEKIT_CHECK(ok, where, ".weight_block_size is ", describe_json(*block), "; only [128, 128] is supported");
  }
  const std::string scale_fmt = text("scale_fmt", "float32");
  MOEKIT_CHECK(scale_fmt == "float32" || scale_fmt == "ue8m0", where, ".scale_fmt '", scale_fmt,
               "' is unknown; expected \"ue8m0\" or \"float32\"");
  const std::string expert_dtype = text("expert_dtype", "fp8");
  MOEKIT_CHECK(expert_dtype == "fp8" || expert_dtype == "fp4", where, ".expert_dtype '", expert_dtype,
               "' is unknown; expected \"fp8\" or \"fp4\"");
  c.quantization.present = true;
  c.quantization.experts = expert_dtype == "fp4" ? WeightFormat::fp4_e2m1 : WeightFormat::fp8_e4m3;
  c.quantization.ue8m0_scales = scale_fmt == "ue8m0" || expert_dtype == "fp4";
  MOEKIT_CHECK(!c.experts.is_transposed, where, ": quantised experts of ", model_type,
               " (transposed fused experts) are not supported");
  c.experts.quantization.weights = c.quantization.experts;
  c.experts.quantization.activations = ActivationScheme::dynamic;
}

// The wrapper's text sub-config parsed as its language model, with the wrapper's own fields.
ModelConfig parse_vision_language(const json& config, const VisionLanguageWrapper& w) {
  const std::string where = "model config (model_type '" + std::string(w.model_type) + "'): ";
  const auto it = config.find(w.text_config);
  MOEKIT_CHECK(it != config.end() && it->is_object(), where, "sub-config '", w.text_config,
               "' (the language model) is missing or not an object");
  const json& text = *it;
  // transformers builds the text config with its own class whatever the sub-config names.
  const std::string text_type = text.contains("model_type") && text["model_type"].is_string()
                                    ? text["model_type"].get<std::string>()
                                    : std::string(w.text.model_type);
  MOEKIT_CHECK(text_type == w.text.model_type, where, w.text_config, ".model_type is '", text_type, "', expected '",
               w.text.model_type, "'");
  ModelConfig out;
  w.text.parse(Fields(text, text_type), out);
  // The wrapper owns lm_head and the dtype (transformers reads them from the top-level config).
  const Fields top(config, std::string(w.model_type));
  out.tie_word_embeddings = top.get<bool>("tie_word_embeddings", w.tie_word_embeddings);
  if (top.has("dtype") || top.has("torch_dtype"))
    out.dtype = top.has("dtype") ? top.required<std::string>("dtype") : top.required<std::string>("torch_dtype");
  parse_quantization(config.contains("quantization_config") ? config : text, text_type, out);
  out.text_config = w.text_config;
  out.weights_prefix = w.weights_prefix;
  out.ignored_weight_prefixes.assign(w.ignored_weight_prefixes.begin(), w.ignored_weight_prefixes.end());
  return out;
}

}  // namespace

std::vector<std::string> supported_model_types() {
  std::vector<std::string> out;
  for (const auto& a : kArchitectures) out.emplace_back(a.model_type);
  for (const auto& w : kVisionLanguageWrappers) out.emplace_back(w.model_type);
  return out;
}

ModelConfig parse_model_config(const nlohmann::json& config) {
  MOEKIT_CHECK(config.is_object(), "model config: expected a JSON object, got ", show(config));
  const auto it = config.find("model_type");
  MOEKIT_CHECK(it != config.end() && !it->is_null(),
               "model config: field 'model_type' is missing; supported: ", supported_list(), sub_config_hint(config));
  MOEKIT_CHECK(it->is_string(), "model config: field 'model_type' must be a string, got ", show(*it));
  const std::string model_type = it->get<std::string>();
  for (const auto& a : kArchitectures) {
    if (a.model_type != model_type) continue;
    ModelConfig out;
    a.parse(Fields(config, model_type), out);
    parse_quantization(config, model_type, out);
    return out;
  }
  for (const auto& w : kVisionLanguageWrappers)
    if (w.model_type == model_type) return parse_vision_language(config, w);
  MOEKIT_FAIL("model config: unknown model_type '", model_type, "'; supported: ", supported_list(),
              sub_config_hint(config));
}

}  // namespace moekit

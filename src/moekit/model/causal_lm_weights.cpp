// CausalLM's weights (causal_lm_impl.h): each layer's tensors read from the checkpoint (attention, the MoE block
// or the dense MLP, norms), quantised experts kept or dequantised as the load options say, and every weight
// moved to the model's GPU once it is loaded and fused on the host.
#include "moekit/model/causal_lm_impl.h"

namespace moekit {

namespace ops = model_ops;

void CausalLM::Impl::load_weights() {
  const ModelConfig& c = config;
  WeightReader r(checkpoint, dtype);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const std::string& prefix = c.weights_prefix;  // "model." (a vision-language model's "model.language_model.")
  embed_tokens = r.load(prefix + "embed_tokens.weight", {V, H});
  final_norm = r.load(prefix + "norm.weight", {H});
  if (r.contains("lm_head.weight") || !c.tie_word_embeddings) {
    lm_head = r.load("lm_head.weight", {V, H});
  } else {
    lm_head = embed_tokens;
  }
  // Layers are added as they load, so that a num_hidden_layers past what the checkpoint holds fails
  // at the first missing tensor instead of allocating that many layers first.
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = prefix + "layers." + std::to_string(i) + ".";
    LayerWeights& l = layers.emplace_back();
    l.input_norm = r.load(p + "input_layernorm.weight", {H});
    l.post_attention_norm = r.load(p + "post_attention_layernorm.weight", {H});
    load_attention(r, p + "self_attn.", l.attention);
    // mixtral: every layer slides when sliding_window is set; gpt_oss: the layers layer_types names.
    const bool slides = c.layer_types.empty() || c.layer_types[static_cast<std::size_t>(i)] == "sliding_attention";
    l.attention.sliding_window = slides ? c.sliding_window : 0;
    l.moe = c.layer_is_moe[static_cast<std::size_t>(i)];
    if (l.moe) {
      load_moe(r, p, l.moe_block);
    } else {
      const int64_t I = c.intermediate_size;
      l.mlp_gate = r.load(p + "mlp.gate_proj.weight", {I, H});
      l.mlp_up = r.load(p + "mlp.up_proj.weight", {I, H});
      l.mlp_down = r.load(p + "mlp.down_proj.weight", {H, I});
    }
  }
  ignored_weights = r.check_all_used(unloaded_weights());
}

UnloadedWeights CausalLM::Impl::unloaded_weights() const {
  return {config.num_hidden_layers, config.weights_prefix + "layers.", config.ignored_weight_prefixes};
}

std::string CausalLM::Impl::ignored_weights_text() const {
  std::string out;
  for (const auto& [prefix, count] : ignored_weights)
    out += (out.empty() ? "ignored " : ", ") + std::to_string(count) + " tensor(s) under " + prefix;
  return out.empty() ? out : out + " (not loaded: text-only model)";
}

void CausalLM::Impl::load_attention(WeightReader& r, const std::string& p, AttentionWeights& a) const {
  const ModelConfig& c = config;
  const int64_t H = c.hidden_size, Hq = c.num_attention_heads;
  // The config bounds each size below only, so the products of two can leave int64.
  if (c.model_type == "deepseek_v3") {
    const int64_t qk = checked_add(c.qk_nope_head_dim, c.qk_rope_head_dim, "qk_nope_head_dim + qk_rope_head_dim");
    const int64_t q_rows = checked_mul(Hq, qk, "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)");
    if (c.q_lora_rank > 0) {
      a.q_a_proj = r.load(p + "q_a_proj.weight", {c.q_lora_rank, H});
      a.q_a_norm = r.load(p + "q_a_layernorm.weight", {c.q_lora_rank});
      a.q_b_proj = r.load(p + "q_b_proj.weight", {q_rows, c.q_lora_rank});
    } else {
      a.q_proj = r.load(p + "q_proj.weight", {q_rows, H});
    }
    const int64_t kv_a_rows = checked_add(c.kv_lora_rank, c.qk_rope_head_dim, "kv_lora_rank + qk_rope_head_dim");
    const int64_t kv_b_rows =
        checked_mul(Hq, checked_add(c.qk_nope_head_dim, c.v_head_dim, "qk_nope_head_dim + v_head_dim"),
                    "num_attention_heads x (qk_nope_head_dim + v_head_dim)");
    a.kv_a_proj = r.load(p + "kv_a_proj_with_mqa.weight", {kv_a_rows, H});
    a.kv_a_norm = r.load(p + "kv_a_layernorm.weight", {c.kv_lora_rank});
    a.kv_b_proj = r.load(p + "kv_b_proj.weight", {kv_b_rows, c.kv_lora_rank});
    a.o_proj = r.load(p + "o_proj.weight", {H, checked_mul(Hq, c.v_head_dim, "num_attention_heads x v_head_dim")});
    MOEKIT_CHECK(!c.attention_bias, "deepseek_v3 with attention_bias = true is not supported");
    return;
  }
  const int64_t hd = c.head_dim;
  const int64_t q_rows = checked_mul(Hq, hd, "num_attention_heads x head_dim");
  const int64_t kv_rows = kv_heads_width(c);
  a.q_proj = r.load(p + "q_proj.weight", {q_rows, H});
  a.k_proj = r.load(p + "k_proj.weight", {kv_rows, H});
  a.v_proj = r.load(p + "v_proj.weight", {kv_rows, H});
  a.o_proj = r.load(p + "o_proj.weight", {H, q_rows});
  if (c.attention_bias) {
    a.q_bias = r.load(p + "q_proj.bias", {q_rows});
    a.k_bias = r.load(p + "k_proj.bias", {kv_rows});
    a.v_bias = r.load(p + "v_proj.bias", {kv_rows});
    // qwen2_moe's qkv_bias covers q, k and v only; the others' attention_bias also o_proj.
    if (c.model_type != "qwen2_moe") a.o_bias = r.load(p + "o_proj.bias", {H});
  }
  if (c.model_type == "gpt_oss") {
    a.sinks = r.load(p + "sinks", {Hq});
    a.sinks_host = ops::to_float_vector(a.sinks);
  }
  if (c.qk_norm) {
    // qwen3_moe normalises each head; olmoe the whole projection.
    const bool per_head = c.qk_norm_per_head;
    a.q_norm = r.load(p + "q_norm.weight", {per_head ? hd : q_rows});
    a.k_norm = r.load(p + "k_norm.weight", {per_head ? hd : kv_rows});
  }
}

void CausalLM::Impl::load_moe(WeightReader& r, const std::string& p, MoeBlockWeights& m) const {
  const ModelConfig& c = config;
  const int64_t H = c.hidden_size, E = c.num_experts;
  // Mixtral checkpoints name the block block_sparse_moe; transformers 5 itself names it mlp.
  const std::string block =
      c.model_type == "mixtral" && r.any_under(p + "block_sparse_moe.") ? p + "block_sparse_moe." : p + "mlp.";
  if (c.model_type == "gpt_oss") {
    // Fused, transposed, gate and up interleaved, biased (ExpertsConfig from the config), and a
    // router with a bias.
    const int64_t I = c.moe_intermediate_size;
    const int64_t I2 = checked_mul(2, I, "2 x moe_intermediate_size");
    m.router_weight = r.load(block + "router.weight", {E, H});
    m.router_bias = r.load(block + "router.bias", {E});
    m.experts.gate_up_proj = r.load(block + "experts.gate_up_proj", {E, H, I2});
    m.experts.gate_up_proj_bias = r.load(block + "experts.gate_up_proj_bias", {E, I2});
    m.experts.down_proj = r.load(block + "experts.down_proj", {E, I, H});
    m.experts.down_proj_bias = r.load(block + "experts.down_proj_bias", {E, H});
    return;
  }
  m.router_weight = r.load(block + "gate.weight", {E, H});
  if (c.router.kind == RouterKind::deepseek_v3)
    m.correction_bias = r.load(block + "gate.e_score_correction_bias", {E}, DType::f32);
  m.experts = r.experts(block + "experts", E, H, c.moe_intermediate_size, c.quantization, dequantize_experts);
  if (c.shared_expert_intermediate_size > 0) {  // qwen2_moe
    const int64_t Is = c.shared_expert_intermediate_size;
    m.shared_gate_proj = r.load(block + "shared_expert.gate_proj.weight", {Is, H});
    m.shared_up_proj = r.load(block + "shared_expert.up_proj.weight", {Is, H});
    m.shared_down_proj = r.load(block + "shared_expert.down_proj.weight", {H, Is});
    m.shared_expert_gate = r.load(block + "shared_expert_gate.weight", {1, H});
  } else if (c.n_shared_experts > 0) {  // deepseek_v3
    const int64_t Is =
        checked_mul(c.n_shared_experts, c.moe_intermediate_size, "n_shared_experts x moe_intermediate_size");
    m.shared_gate_proj = r.load(block + "shared_experts.gate_proj.weight", {Is, H});
    m.shared_up_proj = r.load(block + "shared_experts.up_proj.weight", {Is, H});
    m.shared_down_proj = r.load(block + "shared_experts.down_proj.weight", {H, Is});
  }
}

void CausalLM::Impl::move_weights_to_device() {
  auto move = [&](Tensor& t) {
    if (t.defined()) t = t.to(device);
  };
  const bool tied = lm_head.storage() == embed_tokens.storage();
  move(embed_tokens);
  move(final_norm);
  if (tied) {
    lm_head = embed_tokens;
  } else {
    move(lm_head);
  }
  for (LayerWeights& l : layers) {
    AttentionWeights& a = l.attention;
    for (Tensor* t : {&l.input_norm, &l.post_attention_norm,
                      &a.q_proj,     &a.q_bias,
                      &a.k_proj,     &a.k_bias,
                      &a.v_proj,     &a.v_bias,
                      &a.o_proj,     &a.o_bias,
                      &a.q_norm,     &a.k_norm,
                      &a.q_a_proj,   &a.q_a_norm,
                      &a.q_b_proj,   &a.kv_a_proj,
                      &a.kv_a_norm,  &a.kv_b_proj,
                      &l.mlp_gate,   &l.mlp_up,
                      &l.mlp_down})
      move(*t);
    if (!a.sinks_host.empty()) {
      Tensor sinks = Tensor::empty({static_cast<int64_t>(a.sinks_host.size())}, DType::f32);
      std::copy(a.sinks_host.begin(), a.sinks_host.end(), sinks.data_as<float>());
      a.sinks_device = sinks.to(device);
    }
    MoeBlockWeights& m = l.moe_block;
    for (Tensor* t : {&m.router_weight, &m.router_bias, &m.correction_bias, &m.experts.gate_up_proj,
                      &m.experts.down_proj, &m.experts.gate_up_proj_bias, &m.experts.down_proj_bias,
                      &m.experts.gate_up_proj_scale_inv, &m.experts.down_proj_scale_inv, &m.shared_gate_proj,
                      &m.shared_up_proj, &m.shared_down_proj, &m.shared_expert_gate})
      move(*t);
  }
}

}  // namespace moekit

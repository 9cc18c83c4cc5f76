// The decoder-only MoE language model: weights from one tensor list per layer, the forward step with its
// KV cache, and generation. CPU; the experts of each MoE layer run through the backend its backbone names.
//
// A decoder layer (every supported model_type):
//   h = h + o_proj(attention(input_layernorm(h)))
//   h = h + mlp(post_attention_layernorm(h))         mlp: the MoE block, or a dense gated MLP
// then logits = lm_head(norm(h)). Attention is grouped-query attention with rotary embeddings (q/k
// projection biases for qwen2_moe, per-head q/k RMSNorm for qwen3_moe, whole-projection q/k RMSNorm and
// clip_qkv for olmoe, sliding windows for mixtral when set, sinks and alternating sliding-window layers
// for gpt_oss), or DeepSeek-V3's multi-head latent
// attention, whose cache holds the compressed latent (kv_lora_rank values after kv_a_layernorm) and the
// rotated shared key, as transformers 5.17 caches them.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <set>

#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/model/checkpoint.h"
#include "moekit/model/experts_implementation.h"
#include "moekit/model/model_config.h"
#include "moekit/model/model_ops.h"
#include "moekit/model/moe_block.h"
#include "moekit/model/rotary.h"
#include "moekit/model/sampling.h"

namespace moekit {
namespace {

namespace ops = model_ops;

struct AttentionWeights {
  // Grouped-query attention; sinks [Hq] (GPT-OSS) with float copies for the CPU and the GPU.
  Tensor q_proj, q_bias, k_proj, k_bias, v_proj, v_bias, o_proj, o_bias, q_norm, k_norm, sinks;
  std::vector<float> sinks_host;
  Tensor sinks_device;
  int64_t sliding_window = 0;  // this layer's window (0: full attention)
  // DeepSeek-V3 multi-head latent attention (q_proj above when q_lora_rank is 0).
  Tensor q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj;
};

struct LayerWeights {
  Tensor input_norm, post_attention_norm;
  AttentionWeights attention;
  bool moe = false;
  MoeBlockWeights moe_block;
  Tensor mlp_gate, mlp_up, mlp_down;  // the dense MLP of a dense layer
};

// One layer's cache: per position, `first` then `second` values (keys and values of grouped-query
// attention; MLA's latent and rotated key). On the CPU in float (holding values already rounded to the
// dtype); on a GPU as [capacity, row] tensors of the dtype that double when full.
struct LayerCache {
  std::vector<float> first, second;
  Tensor first_device, second_device;
  int64_t length = 0;  // positions held

  void append(const Tensor& a, const Tensor& b) {
    if (a.device().is_cuda()) {
      for (auto [t, dst] : {std::pair{&a, &first_device}, std::pair{&b, &second_device}}) {
        const int64_t needed = length + t->size(0);
        if (!dst->defined() || dst->size(0) < needed) {
          Tensor grown = Tensor::empty({std::max<int64_t>(needed, dst->defined() ? 2 * dst->size(0) : 256), t->size(1)},
                                       t->dtype(), t->device());
          if (length > 0) ops::write_rows(grown, 0, dst->slice(0, 0, length));
          *dst = grown;
        }
        ops::write_rows(*dst, length, *t);
      }
    } else {
      for (auto [t, dst] : {std::pair{&a, &first}, std::pair{&b, &second}}) {
        const std::vector<float> values = ops::to_float_vector(*t);
        dst->insert(dst->end(), values.begin(), values.end());
      }
    }
    length += a.size(0);
  }
};

// Tensors are read through this, which records what was used so that leftovers can be reported.
class WeightReader {
 public:
  WeightReader(const Checkpoint& checkpoint, DType dtype) : checkpoint_(checkpoint), dtype_(dtype) {}

  Tensor load(const std::string& name, const Shape& shape, std::optional<DType> dtype = std::nullopt) {
    used_.insert(name);
    used_.insert(name + "_scale_inv");  // an FP8 linear's block scales, read (and dequantised) with it
    return checkpoint_.load(name, dtype.value_or(dtype_), shape);
  }
  // Quantised experts stay quantised unless `dequantize` (ExpertsConfig follows: see load_weights).
  FusedExperts experts(const std::string& prefix, int64_t E, int64_t H, int64_t I, const CheckpointQuantization& q,
                       bool dequantize) {
    expert_prefixes_.push_back(prefix + ".");
    if (q.experts == WeightFormat::none) return checkpoint_.experts(prefix, E, H, I, dtype_);
    return checkpoint_.quantized_experts(prefix, E, H, I, q.experts, q.ue8m0_scales,
                                         dequantize ? std::optional<DType>(dtype_) : std::nullopt);
  }
  bool contains(const std::string& name) const { return checkpoint_.contains(name); }
  bool any_under(const std::string& prefix) const {
    for (const auto& name : checkpoint_.tensor_names())
      if (name.starts_with(prefix)) return true;
    return false;
  }

  // Throws naming the checkpoint's tensors that no part of the model read. Ignored, as transformers
  // ignores them: rotary inv_freq buffers of old checkpoints and layers past num_hidden_layers
  // (DeepSeek-V3's multi-token-prediction layer).
  void check_all_used(int64_t num_layers) const {
    std::vector<std::string> unused;
    for (const auto& name : checkpoint_.tensor_names()) {
      if (used_.count(name) != 0 || name.ends_with("rotary_emb.inv_freq")) continue;
      bool in_experts = false;
      for (const auto& prefix : expert_prefixes_) in_experts = in_experts || name.starts_with(prefix);
      if (in_experts) continue;
      if (name.starts_with("model.layers.")) {
        const auto end = name.find('.', 13);
        const std::string index = name.substr(13, end - 13);
        // (More than 9 digits is past any layer count, and past what stoll takes.)
        if (!index.empty() && index.find_first_not_of("0123456789") == std::string::npos &&
            (index.size() > 9 || std::stoll(index) >= num_layers))
          continue;
      }
      unused.push_back(name);
    }
    if (unused.empty()) return;
    std::string list;
    for (std::size_t i = 0; i < std::min<std::size_t>(unused.size(), 5); ++i) list += (i ? ", " : "") + unused[i];
    MOEKIT_FAIL(checkpoint_.directory(), ": ", unused.size(), " tensor(s) the model does not use: ", list,
                unused.size() > 5 ? ", ..." : "", " (a checkpoint of another architecture or config?)");
  }

 private:
  const Checkpoint& checkpoint_;
  DType dtype_;
  std::set<std::string> used_;
  std::vector<std::string> expert_prefixes_;
};

DType parse_config_dtype(const std::string& text, const std::string& dir) {
  if (text == "bfloat16") return DType::bf16;
  if (text == "float16") return DType::f16;
  if (text == "float32") return DType::f32;
  MOEKIT_FAIL(dir, "/config.json: dtype '", text, "' is not supported (bfloat16, float16, float32)");
}

}  // namespace

struct CausalLM::Impl {
  Checkpoint checkpoint;
  ModelConfig config;
  DType dtype = DType::bf16;
  Device device = Device::cpu();
  ExpertsImplementation experts_implementation;
  Tensor embed_tokens, final_norm, lm_head;
  std::vector<LayerWeights> layers;
  ops::RotaryTables rotary;
  float scale = 1.0f;
  std::vector<LayerCache> cache;
  int64_t cached_positions = 0;
  std::vector<std::string> last_step_backends;
  bool dequantize_experts = false;  // quantised experts turned into dtype at load

  Impl(const std::string& dir, const LoadOptions& options)
      : checkpoint(dir),
        config(parse_model_config(checkpoint.config())),
        experts_implementation(checkpoint.sub_config_names()) {
    std::string why_not;
    MOEKIT_CHECK(device_available(options.device, &why_not), "from_pretrained: ", device_name(options.device),
                 " is not available: ", why_not);
    device = options.device;
    if (options.dtype) {
      dtype = *options.dtype;
    } else if (!config.dtype.empty()) {
      dtype = parse_config_dtype(config.dtype, dir);
    } else {
      dtype = checkpoint.tensor("model.embed_tokens.weight").dtype();
    }
    MOEKIT_CHECK(is_floating(dtype), "from_pretrained: dtype must be f32, f16 or bf16, got ", dtype_name(dtype));
    experts_implementation.set_from_text(options.experts_implementation);
    if (config.quantization.experts != WeightFormat::none) {
      dequantize_experts = options.dequantize || (config.quantization.experts == WeightFormat::fp8_e4m3 &&
                                                  config.moe_intermediate_size % kFp8BlockSize != 0);
      if (dequantize_experts) config.experts.quantization = QuantizationConfig();
    }
    load_weights();
    if (device.is_cuda()) move_weights_to_device();
    rotary = rotary_tables(config);
    if (device.is_cuda()) {
      Tensor inv_freq = Tensor::empty({static_cast<int64_t>(rotary.inv_freq.size())}, DType::f32);
      std::copy(rotary.inv_freq.begin(), rotary.inv_freq.end(), inv_freq.data_as<float>());
      rotary.inv_freq_device = inv_freq.to(device);
    }
    scale = attention_scale(config);
    reset_cache();
  }

  void load_weights() {
    const ModelConfig& c = config;
    WeightReader r(checkpoint, dtype);
    const int64_t H = c.hidden_size, V = c.vocab_size;
    embed_tokens = r.load("model.embed_tokens.weight", {V, H});
    final_norm = r.load("model.norm.weight", {H});
    if (r.contains("lm_head.weight") || !c.tie_word_embeddings) {
      lm_head = r.load("lm_head.weight", {V, H});
    } else {
      lm_head = embed_tokens;
    }
    layers.resize(static_cast<std::size_t>(c.num_hidden_layers));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      LayerWeights& l = layers[static_cast<std::size_t>(i)];
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
    r.check_all_used(c.num_hidden_layers);
  }

  void load_attention(WeightReader& r, const std::string& p, AttentionWeights& a) const {
    const ModelConfig& c = config;
    const int64_t H = c.hidden_size, Hq = c.num_attention_heads;
    if (c.model_type == "deepseek_v3") {
      const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (c.q_lora_rank > 0) {
        a.q_a_proj = r.load(p + "q_a_proj.weight", {c.q_lora_rank, H});
        a.q_a_norm = r.load(p + "q_a_layernorm.weight", {c.q_lora_rank});
        a.q_b_proj = r.load(p + "q_b_proj.weight", {Hq * qk, c.q_lora_rank});
      } else {
        a.q_proj = r.load(p + "q_proj.weight", {Hq * qk, H});
      }
      a.kv_a_proj = r.load(p + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, H});
      a.kv_a_norm = r.load(p + "kv_a_layernorm.weight", {c.kv_lora_rank});
      a.kv_b_proj = r.load(p + "kv_b_proj.weight", {Hq * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
      a.o_proj = r.load(p + "o_proj.weight", {H, Hq * c.v_head_dim});
      MOEKIT_CHECK(!c.attention_bias, "deepseek_v3 with attention_bias = true is not supported");
      return;
    }
    const int64_t hd = c.head_dim, Hk = c.num_key_value_heads;
    a.q_proj = r.load(p + "q_proj.weight", {Hq * hd, H});
    a.k_proj = r.load(p + "k_proj.weight", {Hk * hd, H});
    a.v_proj = r.load(p + "v_proj.weight", {Hk * hd, H});
    a.o_proj = r.load(p + "o_proj.weight", {H, Hq * hd});
    if (c.attention_bias) {
      a.q_bias = r.load(p + "q_proj.bias", {Hq * hd});
      a.k_bias = r.load(p + "k_proj.bias", {Hk * hd});
      a.v_bias = r.load(p + "v_proj.bias", {Hk * hd});
      // qwen2_moe's qkv_bias covers q, k and v only; the others' attention_bias also o_proj.
      if (c.model_type != "qwen2_moe") a.o_bias = r.load(p + "o_proj.bias", {H});
    }
    if (c.model_type == "gpt_oss") {
      a.sinks = r.load(p + "sinks", {Hq});
      a.sinks_host = ops::to_float_vector(a.sinks);
    }
    if (c.qk_norm) {
      // qwen3_moe normalises each head; olmoe the whole projection.
      const bool per_head = c.model_type == "qwen3_moe";
      a.q_norm = r.load(p + "q_norm.weight", {per_head ? hd : Hq * hd});
      a.k_norm = r.load(p + "k_norm.weight", {per_head ? hd : Hk * hd});
    }
  }

  void load_moe(WeightReader& r, const std::string& p, MoeBlockWeights& m) const {
    const ModelConfig& c = config;
    const int64_t H = c.hidden_size, E = c.num_experts;
    // Mixtral checkpoints name the block block_sparse_moe; transformers 5 itself names it mlp.
    const std::string block = c.model_type == "mixtral" && r.any_under(p + "block_sparse_moe.")
                                  ? p + "block_sparse_moe."
                                  : p + "mlp.";
    if (c.model_type == "gpt_oss") {
      // Fused, transposed, gate and up interleaved, biased (ExpertsConfig from the config), and a
      // router with a bias.
      const int64_t I = c.moe_intermediate_size;
      m.router_weight = r.load(block + "router.weight", {E, H});
      m.router_bias = r.load(block + "router.bias", {E});
      m.experts.gate_up_proj = r.load(block + "experts.gate_up_proj", {E, H, 2 * I});
      m.experts.gate_up_proj_bias = r.load(block + "experts.gate_up_proj_bias", {E, 2 * I});
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
      const int64_t Is = c.n_shared_experts * c.moe_intermediate_size;
      m.shared_gate_proj = r.load(block + "shared_experts.gate_proj.weight", {Is, H});
      m.shared_up_proj = r.load(block + "shared_experts.up_proj.weight", {Is, H});
      m.shared_down_proj = r.load(block + "shared_experts.down_proj.weight", {H, Is});
    }
  }

  // Every weight to the model's GPU (loaded and fused on the host first, then copied once).
  void move_weights_to_device() {
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
      for (Tensor* t : {&l.input_norm, &l.post_attention_norm, &a.q_proj, &a.q_bias, &a.k_proj, &a.k_bias, &a.v_proj,
                        &a.v_bias, &a.o_proj, &a.o_bias, &a.q_norm, &a.k_norm, &a.q_a_proj, &a.q_a_norm, &a.q_b_proj,
                        &a.kv_a_proj, &a.kv_a_norm, &a.kv_b_proj, &l.mlp_gate, &l.mlp_up, &l.mlp_down})
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

  void reset_cache() {
    cache.assign(layers.size(), LayerCache());
    cached_positions = 0;
  }

  // T new queries at the cache's next positions, with the model's attention scale.
  ops::AttentionShape attention_shape(int64_t T, int64_t query_heads, int64_t key_heads, int64_t key_dim,
                                      int64_t value_dim) const {
    ops::AttentionShape s;
    s.tokens = T;
    s.past = cached_positions;
    s.query_heads = query_heads;
    s.key_heads = key_heads;
    s.key_dim = key_dim;
    s.value_dim = value_dim;
    s.scale = scale;
    return s;
  }

  // Grouped-query attention of x [T, H]; appends the new keys and values to the layer's cache.
  Tensor gqa(const AttentionWeights& a, const Tensor& x, LayerCache& lc) const {
    const ModelConfig& c = config;
    const int64_t T = x.size(0), Hq = c.num_attention_heads, Hk = c.num_key_value_heads, hd = c.head_dim;
    Tensor q = ops::linear(x, a.q_proj, a.q_bias);
    Tensor k = ops::linear(x, a.k_proj, a.k_bias);
    Tensor v = ops::linear(x, a.v_proj, a.v_bias);
    if (a.q_norm.defined()) {
      const bool per_head = a.q_norm.size(0) == hd;
      q = ops::rms_norm(per_head ? q.reshape({T * Hq, hd}) : q, a.q_norm, c.rms_norm_eps).reshape({T, Hq * hd});
      k = ops::rms_norm(per_head ? k.reshape({T * Hk, hd}) : k, a.k_norm, c.rms_norm_eps).reshape({T, Hk * hd});
    }
    if (c.clip_qkv > 0) {
      for (Tensor* t : {&q, &k, &v}) ops::clamp_in_place(*t, static_cast<float>(c.clip_qkv));
    }
    ops::apply_rotary(q, Hq, hd, 0, rotary, cached_positions);
    ops::apply_rotary(k, Hk, hd, 0, rotary, cached_positions);
    lc.append(k, v);
    ops::AttentionShape s = attention_shape(T, Hq, Hk, hd, hd);
    s.sliding_window = a.sliding_window;
    if (device.is_cuda()) {
      s.sinks = a.sinks_device.defined() ? a.sinks_device.data_as<float>() : nullptr;
      const Tensor out = ops::attention(q, lc.first_device, Hk * hd, hd, lc.second_device, Hk * hd, hd, s);
      return ops::linear(out, a.o_proj, a.o_bias);
    }
    s.sinks = a.sinks_host.empty() ? nullptr : a.sinks_host.data();
    const std::vector<float> qf = ops::to_float_vector(q);
    const Tensor out = ops::attention(qf.data(), lc.first.data(), lc.second.data(), s, dtype);
    return ops::linear(out, a.o_proj, a.o_bias);
  }

  // DeepSeek-V3's multi-head latent attention of x [T, H].
  Tensor mla(const AttentionWeights& a, const Tensor& x, LayerCache& lc) const {
    const ModelConfig& c = config;
    const int64_t T = x.size(0), Hq = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim,
                  vd = c.v_head_dim, rank = c.kv_lora_rank, qk = nope + rope;
    Tensor q = a.q_a_proj.defined()
                   ? ops::linear(ops::rms_norm(ops::linear(x, a.q_a_proj), a.q_a_norm, c.rms_norm_eps), a.q_b_proj)
                   : ops::linear(x, a.q_proj);
    ops::apply_rotary(q, Hq, qk, nope, rotary, cached_positions);
    const Tensor compressed = ops::linear(x, a.kv_a_proj);
    const Tensor latent = ops::rms_norm(ops::columns(compressed, 0, rank), a.kv_a_norm, c.rms_norm_eps);
    Tensor k_rot = ops::columns(compressed, rank, rank + rope);
    ops::apply_rotary(k_rot, 1, rope, 0, rotary, cached_positions);
    lc.append(latent, k_rot);

    const int64_t S = cached_positions + T;
    ops::AttentionShape s = attention_shape(T, Hq, Hq, qk, vd);
    if (device.is_cuda()) {
      // Keys [S, Hq, nope + rope]: each head's k_nope from kv_b_proj, then the shared rotated key;
      // values read in place from kv_b_proj's output (columns nope .. nope + vd of each head).
      const Tensor kv = ops::linear(lc.first_device.slice(0, 0, S), a.kv_b_proj);
      Tensor keys = Tensor::empty({S, Hq * qk}, dtype, device);
      const Tensor rotated = lc.second_device.slice(0, 0, S);
      for (int64_t h = 0; h < Hq; ++h) {
        ops::copy_columns(kv, h * (nope + vd), h * (nope + vd) + nope, keys, h * qk);
        ops::copy_columns(rotated, 0, rope, keys, h * qk + nope);
      }
      const Tensor values = kv.slice(1, nope, kv.size(1));
      const Tensor out = ops::attention(q, keys, Hq * qk, qk, values, Hq * (nope + vd), nope + vd, s);
      return ops::linear(out, a.o_proj);
    }
    // Every cached position's keys and values from its latent: [S, Hq, nope + vd].
    Tensor latents = Tensor::empty({S, rank}, dtype);
    visit_float_dtype(dtype, [&](auto tag) {
      using D = typename decltype(tag)::type;
      D* dst = latents.data_as<D>();
      for (int64_t i = 0; i < S * rank; ++i) dst[i] = from_float<D>(lc.first[static_cast<std::size_t>(i)]);
    });
    const std::vector<float> kv = ops::to_float_vector(ops::linear(latents, a.kv_b_proj));
    std::vector<float> keys(static_cast<std::size_t>(S * Hq * qk)), values(static_cast<std::size_t>(S * Hq * vd));
    for (int64_t j = 0; j < S; ++j)
      for (int64_t h = 0; h < Hq; ++h) {
        const float* src = kv.data() + (j * Hq + h) * (nope + vd);
        float* key = keys.data() + (j * Hq + h) * qk;
        std::copy(src, src + nope, key);
        std::copy(lc.second.begin() + j * rope, lc.second.begin() + (j + 1) * rope, key + nope);
        std::copy(src + nope, src + nope + vd, values.data() + (j * Hq + h) * vd);
      }
    const std::vector<float> qf = ops::to_float_vector(q);
    const Tensor out = ops::attention(qf.data(), keys.data(), values.data(), s, dtype);
    return ops::linear(out, a.o_proj);
  }

  // Runs tokens at the next positions of the cache; returns the logits of the last `logit_rows` tokens
  // as float32 [rows, V].
  Tensor step(std::span<const int32_t> tokens, int64_t logit_rows) {
    const ModelConfig& c = config;
    const int64_t T = static_cast<int64_t>(tokens.size());
    MOEKIT_CHECK(T > 0, "forward: no tokens");
    const std::string& backend = experts_implementation.of("");
    last_step_backends.clear();
    Tensor h = ops::embedding(embed_tokens, tokens);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const LayerWeights& l = layers[i];
      const Tensor x = ops::rms_norm(h, l.input_norm, c.rms_norm_eps);
      const Tensor attn = c.model_type == "deepseek_v3" ? mla(l.attention, x, cache[i])
                                                         : gqa(l.attention, x, cache[i]);
      ops::add_in_place(h, attn);
      const Tensor y = ops::rms_norm(h, l.post_attention_norm, c.rms_norm_eps);
      Tensor mlp;
      if (l.moe) {
        mlp = moe_block_forward(y, l.moe_block, c.router, c.experts, backend);
        last_step_backends.push_back(backend);
      } else {
        mlp = dense_mlp_forward(y, l.mlp_gate, l.mlp_up, l.mlp_down, c.experts.activation, backend);
      }
      ops::add_in_place(h, mlp);
    }
    cached_positions += T;
    const Tensor last = logit_rows == T ? h : h.slice(0, T - logit_rows, T);  // whole rows: contiguous
    Tensor logits = ops::linear(ops::rms_norm(last, final_norm, c.rms_norm_eps), lm_head);
    if (logits.device().is_cuda()) logits = logits.to(Device::cpu());  // sampling runs on the host
    return logits.dtype() == DType::f32 ? logits : logits.to(DType::f32);
  }
};

CausalLM::CausalLM(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CausalLM::CausalLM(CausalLM&&) noexcept = default;
CausalLM& CausalLM::operator=(CausalLM&&) noexcept = default;
CausalLM::~CausalLM() = default;

CausalLM CausalLM::from_pretrained(const std::string& dir, const LoadOptions& options) {
  return CausalLM(std::make_unique<Impl>(dir, options));
}

void CausalLM::set_experts_implementation(const std::string& name_or_json) {
  impl_->experts_implementation.set_from_text(name_or_json);
}
void CausalLM::set_experts_implementation(const std::map<std::string, std::string>& per_backbone) {
  impl_->experts_implementation.set(per_backbone);
}
std::map<std::string, std::string> CausalLM::get_experts_implementation() const {
  return impl_->experts_implementation.get();
}

Tensor CausalLM::forward(std::span<const int32_t> tokens) {
  impl_->reset_cache();
  Tensor logits = impl_->step(tokens, static_cast<int64_t>(tokens.size()));
  impl_->reset_cache();
  return logits;
}

GenerationResult CausalLM::generate(std::span<const int32_t> prompt, const GenerationConfig& config) {
  MOEKIT_CHECK(!prompt.empty(), "generate: the prompt has no tokens");
  validate_generation_config(config);
  Impl& m = *impl_;
  m.reset_cache();
  GenerationResult result;
  std::mt19937_64 rng(config.seed);
  using Clock = std::chrono::steady_clock;

  result.prefill_backends = m.experts_implementation.get();
  auto start = Clock::now();
  Tensor logits = m.step(prompt, 1);
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.prefill_tokens = static_cast<int64_t>(prompt.size());
  result.stop_reason = "max new tokens";
  if (config.max_new_tokens == 0) return result;

  DecodePhaseSwitch decode_phase(m.experts_implementation, config.decode_phase_switch ? m.device : Device::cpu());
  result.decode_backends = m.experts_implementation.get();
  start = Clock::now();
  while (true) {
    const int32_t token = pick_token({logits.data_as<float>(), static_cast<std::size_t>(logits.numel())}, config, rng);
    result.tokens.push_back(token);
    if (config.on_token) config.on_token(token);
    if (std::find(config.stop_tokens.begin(), config.stop_tokens.end(), token) != config.stop_tokens.end()) {
      result.stop_reason = "stop token";
      break;
    }
    if (static_cast<int64_t>(result.tokens.size()) >= config.max_new_tokens) break;
    logits = m.step(std::span<const int32_t>(&token, 1), 1);
    ++result.decode_tokens;
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

const std::vector<std::string>& CausalLM::last_step_backends() const {
  return impl_->last_step_backends;
}
const std::string& CausalLM::model_type() const {
  return impl_->config.model_type;
}
DType CausalLM::dtype() const {
  return impl_->dtype;
}
Device CausalLM::device() const {
  return impl_->device;
}
int64_t CausalLM::vocab_size() const {
  return impl_->config.vocab_size;
}
int64_t CausalLM::num_layers() const {
  return impl_->config.num_hidden_layers;
}

std::string experts_implementation_text(const std::map<std::string, std::string>& backends) {
  std::string out;
  for (const auto& [backbone, name] : backends)
    out += (out.empty() ? "" : ", ") + (backbone.empty() ? std::string("\"\"") : backbone) + ": " + name;
  return out;
}

std::string CausalLM::describe() const {
  const ModelConfig& c = impl_->config;
  int64_t moe_layers = 0;
  for (bool moe : c.layer_is_moe) moe_layers += moe ? 1 : 0;
  std::string quantization;
  if (c.quantization.experts != WeightFormat::none)
    quantization = impl_->dequantize_experts
                       ? "; " + std::string(weight_format_name(c.quantization.experts)) + " experts dequantised at load"
                       : "; quantised experts: " + c.experts.quantization.describe();
  const std::string backends = experts_implementation_text(impl_->experts_implementation.get());
  return c.model_type + ": " + std::to_string(c.num_hidden_layers) + " layers (" + std::to_string(moe_layers) +
         " MoE), hidden " + std::to_string(c.hidden_size) + ", " + std::to_string(c.num_experts) + " experts top-" +
         std::to_string(c.num_experts_per_tok) + ", vocab " + std::to_string(c.vocab_size) + ", " +
         std::string(dtype_name(impl_->dtype)) + " on " + device_name(impl_->device) + "; experts: " + backends +
         quantization;
}

}  // namespace moekit

// The decoder-only MoE language model: weights from one tensor list per layer, the forward step with its
// KV cache, and generation, on the CPU or a GPU; the experts of each MoE layer run through the backend its
// backbone names. On a GPU the decode step is captured once into a CUDA graph and replayed for every later
// token (see "Decode steps as one CUDA graph" below).
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
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>

#include "moekit/checked_math.h"
#include "moekit/device.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/model/checkpoint.h"
#include "moekit/model/experts_implementation.h"
#include "moekit/model/model_config.h"
#include "moekit/model/model_ops.h"
#include "moekit/model/moe_block.h"
#include "moekit/model/rotary.h"
#include "moekit/model/sampling.h"
#include "moekit/model/weight_reader.h"

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
// dtype), growing; on a GPU as [capacity, row] tensors of the dtype, allocated at their full length up
// front (reset_cache) so that a captured decode step finds them at the same addresses on every replay.
struct LayerCache {
  std::vector<float> first, second;
  Tensor first_device, second_device;

  // a, b [T, row] at positions [row, row + T); on a GPU the kernels read row from row_device.
  void append(const Tensor& a, const Tensor& b, int64_t row, const int32_t* row_device) {
    if (a.device().is_cuda()) {
      ops::write_rows(first_device, row, a, row_device);
      ops::write_rows(second_device, row, b, row_device);
      return;
    }
    for (auto [t, dst] : {std::pair{&a, &first}, std::pair{&b, &second}}) {
      const std::vector<float> values = ops::to_float_vector(*t);
      dst->insert(dst->end(), values.begin(), values.end());
    }
  }
};

// A decode step captured into a CUDA graph, kept by the model so that later generate calls replay it too
// while what it was captured with is unchanged.
struct DecodeGraph {
  std::map<std::string, std::string> backends;  // the experts backends of the captured step
  std::vector<const void*> caches;              // the cache buffers its kernels write and read
  std::unique_ptr<CapturedGraph> graph;
  Tensor logits;                           // float32 [1, V] on the GPU, rewritten by each replay
  std::vector<std::string> step_backends;  // last_step_backends of the captured step
};

// One generate call's decode phase on a GPU, as far as CUDA graphs go.
struct DecodeRun {
  bool graphs = false;           // still capturing or replaying; false: every step launches its kernels
  std::size_t memory_bytes = 0;  // what the first (uncaptured) decode step allocated: the graph's memory
  bool replayed = false;
  std::string why_not;  // why the steps were not replayed (GenerationResult::decode_graph_reason)
};

// Keys and values of one position of one layer's grouped-query attention cache.
int64_t kv_heads_width(const ModelConfig& c) {
  return checked_mul(c.num_key_value_heads, c.head_dim, "num_key_value_heads x head_dim");
}

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
  int64_t cache_capacity = 0;  // GPU: positions the cache buffers hold
  std::vector<std::string> last_step_backends;
  bool dequantize_experts = false;  // quantised experts turned into dtype at load
  // Tensors not loaded on purpose, per prefix (a vision-language checkpoint's vision tower).
  std::map<std::string, int64_t> ignored_weights;
  // GPU: the stream the decode step is captured and replayed on (ordered with the legacy default stream,
  // where tensors are allocated and freed and steps are otherwise launched, so no synchronisation is
  // needed between the two), the inputs of one-token steps in device memory, the captured decode step,
  // and the last decode backends whose step could not be captured, with the reason.
  std::unique_ptr<DeviceStream> stream;
  Tensor decode_state;              // int32 [2]: the step's first position, then its token
  std::vector<int32_t> state_host;  // the host side of the last copy into a step's inputs (kept until it ran)
  std::unique_ptr<DecodeGraph> decode_graph;
  std::map<std::string, std::string> uncapturable_backends;
  std::string uncapturable_reason;

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
      dtype = checkpoint.tensor(config.weights_prefix + "embed_tokens.weight").dtype();
    }
    MOEKIT_CHECK(is_floating(dtype), "from_pretrained: dtype must be f32, f16 or bf16, got ", dtype_name(dtype));
    experts_implementation.set_from_text(options.experts_implementation);
    if (config.quantization.experts != WeightFormat::none) {
      dequantize_experts = options.dequantize || (config.quantization.experts == WeightFormat::fp8_e4m3 &&
                                                  config.moe_intermediate_size % kFp8BlockSize != 0);
      if (dequantize_experts) config.experts.quantization = QuantizationConfig();
    }
    require_memory(device, WeightReader(checkpoint, dtype).loaded_bytes(unloaded_weights(), dequantize_experts),
                   "from_pretrained: " + dir + " in " + std::string(dtype_name(dtype)) + " (its weights)");
    load_weights();
    if (options.progress && !ignored_weights.empty())
      std::fprintf(stderr, "from_pretrained: %s: %s\n", dir.c_str(), ignored_weights_text().c_str());
    if (device.is_cuda()) move_weights_to_device();
    rotary = rotary_tables(config);
    if (device.is_cuda()) {
      Tensor inv_freq = Tensor::empty({static_cast<int64_t>(rotary.inv_freq.size())}, DType::f32);
      std::copy(rotary.inv_freq.begin(), rotary.inv_freq.end(), inv_freq.data_as<float>());
      rotary.inv_freq_device = inv_freq.to(device);
    }
    scale = attention_scale(config);
    if (device.is_cuda()) {
      stream = std::make_unique<DeviceStream>(device, /*ordered_with_default=*/true);
      decode_state = Tensor::zeros({2}, DType::i32, device);
    }
    reset_cache(0);
  }

  void load_weights() {
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

  UnloadedWeights unloaded_weights() const {
    return {config.num_hidden_layers, config.weights_prefix + "layers.", config.ignored_weight_prefixes};
  }

  // "ignored 38 tensors under model.visual. (not loaded: text-only model)", or "" when none were.
  std::string ignored_weights_text() const {
    std::string out;
    for (const auto& [prefix, count] : ignored_weights)
      out += (out.empty() ? "ignored " : ", ") + std::to_string(count) + " tensor(s) under " + prefix;
    return out.empty() ? out : out + " (not loaded: text-only model)";
  }

  void load_attention(WeightReader& r, const std::string& p, AttentionWeights& a) const {
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

  void load_moe(WeightReader& r, const std::string& p, MoeBlockWeights& m) const {
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
      const int64_t Is = checked_mul(c.n_shared_experts, c.moe_intermediate_size,
                                     "n_shared_experts x moe_intermediate_size");
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

  // The values a cache holds per position of a layer: keys and values, or MLA's latent and rotated key.
  std::pair<int64_t, int64_t> cache_rows() const {
    const ModelConfig& c = config;
    if (c.model_type == "deepseek_v3") return {c.kv_lora_rank, c.qk_rope_head_dim};
    return {kv_heads_width(c), kv_heads_width(c)};
  }

  // Bytes of the cache at `positions`: on a GPU in the dtype, on the CPU in float.
  std::size_t cache_bytes(int64_t positions) const {
    const auto [first_row, second_row] = cache_rows();
    const int64_t element = device.is_cuda() ? static_cast<int64_t>(dtype_size(dtype)) : 4;
    const std::string what = "the KV cache's bytes for " + std::to_string(positions) + " positions";
    const int64_t row = checked_mul(checked_add(first_row, second_row, what), element, what);
    return static_cast<std::size_t>(
        checked_mul(checked_mul(row, positions, what + " (a layer)"), static_cast<int64_t>(layers.size()), what));
  }

  // Empties the cache. On a GPU its buffers hold `capacity` positions from then on (kept when they
  // already hold as many, so that a captured decode step stays valid across generate calls).
  void reset_cache(int64_t capacity) {
    cached_positions = 0;
    if (!device.is_cuda()) {
      cache.assign(layers.size(), LayerCache());
      return;
    }
    cache.resize(layers.size());
    if (capacity <= cache_capacity) return;
    // Positions reach the kernels as int32 (the step's inputs in device memory).
    MOEKIT_CHECK(capacity <= std::numeric_limits<int32_t>::max(), "the KV cache cannot hold ", capacity,
                 " positions (at most 2^31 - 1)");
    const auto [first_row, second_row] = cache_rows();
    for (LayerCache& lc : cache) {
      lc.first_device = Tensor();  // free the old buffers before the new ones are allocated
      lc.second_device = Tensor();
      lc.first_device = Tensor::empty({capacity, first_row}, dtype, device);
      lc.second_device = Tensor::empty({capacity, second_row}, dtype, device);
    }
    cache_capacity = capacity;
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

  // Grouped-query attention of x [T, H]; appends the new keys and values to the layer's cache. position:
  // GPU, the step's first position in device memory.
  Tensor gqa(const AttentionWeights& a, const Tensor& x, LayerCache& lc, const int32_t* position) const {
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
    ops::apply_rotary(q, Hq, hd, 0, rotary, cached_positions, position);
    ops::apply_rotary(k, Hk, hd, 0, rotary, cached_positions, position);
    lc.append(k, v, cached_positions, position);
    ops::AttentionShape s = attention_shape(T, Hq, Hk, hd, hd);
    s.sliding_window = a.sliding_window;
    if (device.is_cuda()) {
      s.sinks = a.sinks_device.defined() ? a.sinks_device.data_as<float>() : nullptr;
      s.past_device = position;  // the kernel loops over the keys up to it, in buffers of full length
      const Tensor out = ops::attention(q, lc.first_device, Hk * hd, hd, lc.second_device, Hk * hd, hd, s);
      return ops::linear(out, a.o_proj, a.o_bias);
    }
    s.sinks = a.sinks_host.empty() ? nullptr : a.sinks_host.data();
    const std::vector<float> qf = ops::to_float_vector(q);
    const Tensor out = ops::attention(qf.data(), lc.first.data(), lc.second.data(), s, dtype);
    return ops::linear(out, a.o_proj, a.o_bias);
  }

  // DeepSeek-V3's multi-head latent attention of x [T, H]. Its GPU path sizes tensors by the cache length
  // (every cached latent is expanded each step), so it is never captured: see decode_graph_refusal.
  Tensor mla(const AttentionWeights& a, const Tensor& x, LayerCache& lc, const int32_t* position) const {
    const ModelConfig& c = config;
    const int64_t T = x.size(0), Hq = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim,
                  vd = c.v_head_dim, rank = c.kv_lora_rank, qk = nope + rope;
    Tensor q = a.q_a_proj.defined()
                   ? ops::linear(ops::rms_norm(ops::linear(x, a.q_a_proj), a.q_a_norm, c.rms_norm_eps), a.q_b_proj)
                   : ops::linear(x, a.q_proj);
    ops::apply_rotary(q, Hq, qk, nope, rotary, cached_positions, position);
    const Tensor compressed = ops::linear(x, a.kv_a_proj);
    const Tensor latent = ops::rms_norm(ops::columns(compressed, 0, rank), a.kv_a_norm, c.rms_norm_eps);
    Tensor k_rot = ops::columns(compressed, rank, rank + rope);
    ops::apply_rotary(k_rot, 1, rope, 0, rotary, cached_positions, position);
    lc.append(latent, k_rot, cached_positions, position);

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

  // Runs tokens at the next positions of the cache; returns the float32 logits of the last `logit_rows`
  // tokens [rows, V], on the model's device.
  Tensor step(std::span<const int32_t> tokens, int64_t logit_rows) {
    const Tensor inputs = write_step_inputs(tokens);
    Tensor logits = run_step(tokens, inputs, logit_rows);
    cached_positions += static_cast<int64_t>(tokens.size());
    return logits;
  }

  // Checks the tokens and the room left in the cache. On a GPU, returns the step's inputs as its kernels
  // read them: int32 [1 + T] in device memory, the step's first position (the positions cached) then the
  // ids, written by one copy on the model's stream; one-token steps always use decode_state, the inputs
  // of a captured decode step.
  Tensor write_step_inputs(std::span<const int32_t> tokens) {
    const int64_t T = static_cast<int64_t>(tokens.size());
    MOEKIT_CHECK(T > 0, "forward: no tokens");
    ops::check_token_ids(tokens, config.vocab_size);
    if (!device.is_cuda()) return Tensor();
    MOEKIT_CHECK(cached_positions + T <= cache_capacity, "the KV cache holds ", cache_capacity, " positions; ",
                 cached_positions, " are used and the step brings ", T, " more");
    state_host.assign(1, static_cast<int32_t>(cached_positions));
    state_host.insert(state_host.end(), tokens.begin(), tokens.end());
    Tensor inputs = T == 1 ? decode_state : Tensor::empty({1 + T}, DType::i32, device);
    copy_into(inputs, Tensor::from_blob(state_host.data(), {1 + T}, DType::i32), *stream);
    return inputs;
  }

  // The forward step itself, from the embedding to the logits, without moving cached_positions. On a GPU
  // it reads the tokens and the first position from `inputs` (write_step_inputs), so that the same
  // launches, captured once, serve every decode step; only tokens.size() is used there.
  Tensor run_step(std::span<const int32_t> tokens, const Tensor& inputs, int64_t logit_rows) {
    const ModelConfig& c = config;
    const int64_t T = static_cast<int64_t>(tokens.size());
    // The language model's backbone: the top level, or a vision-language model's text_config.
    const std::string& backend = experts_implementation.of(c.text_config);
    last_step_backends.clear();
    const int32_t* position = inputs.defined() ? inputs.data_as<int32_t>() : nullptr;
    Tensor h = inputs.defined() ? ops::embedding(embed_tokens, inputs.slice(0, 1, 1 + T))
                                : ops::embedding(embed_tokens, tokens);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const LayerWeights& l = layers[i];
      const Tensor x = ops::rms_norm(h, l.input_norm, c.rms_norm_eps);
      const Tensor attn = c.model_type == "deepseek_v3" ? mla(l.attention, x, cache[i], position)
                                                        : gqa(l.attention, x, cache[i], position);
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
    const Tensor last = logit_rows == T ? h : h.slice(0, T - logit_rows, T);  // whole rows: contiguous
    const Tensor logits = ops::linear(ops::rms_norm(last, final_norm, c.rms_norm_eps), lm_head);
    return logits.dtype() == DType::f32 ? logits : ops::convert(logits, DType::f32);  // exact: a widening
  }

  // Blocks until the model's queued work is done.
  void synchronize() const { moekit::synchronize(device); }

  // The next token from float32 logits [1, V] on the model's device, with one synchronisation: on a GPU
  // a greedy pick runs there and only the index comes back; sampling reads the row. kept: where to append
  // the row (GenerationConfig::output_logits), or null.
  int32_t pick(const Tensor& logits, const GenerationConfig& g, std::mt19937_64& rng, std::vector<float>* kept) {
    const int64_t V = logits.numel();
    if (!device.is_cuda()) {
      const std::span<const float> row(logits.data_as<float>(), static_cast<std::size_t>(V));
      if (kept) kept->insert(kept->end(), row.begin(), row.end());
      return pick_token(row, g, rng);
    }
    // Copies to the host wait for the work queued before them, the graph's replays included.
    const Tensor row = g.do_sample || kept ? logits.to(Device::cpu()) : Tensor();
    const Tensor index = g.do_sample ? Tensor() : ops::argmax(logits).to(Device::cpu());
    const std::span<const float> values =
        row.defined() ? std::span<const float>(row.data_as<float>(), V) : std::span<const float>();
    if (kept) kept->insert(kept->end(), values.begin(), values.end());
    return g.do_sample ? pick_token(values, g, rng) : index.data_as<int32_t>()[0];
  }

  // ---- Decode steps as one CUDA graph ----
  // A decode step launches dozens of small kernels; on a GPU they are captured once into a CUDA graph and
  // the graph is replayed for every later token, so that decode is no longer bound by launching them.
  // The graph stays valid from step to step because nothing it launches depends on the step: the token
  // and the first position come from decode_state (written by one copy before each replay), the kernels
  // read the position from there (rotary angles, the row the keys and values go to, how many keys
  // attention loops over), the cache buffers are allocated at full length up front, and the tensors the
  // step makes come from memory that the graph owns (CapturedGraph's memory), sized by the first decode
  // step, which runs uncaptured under a DeviceAllocationCounter. The second step is captured (on the
  // model's stream: the legacy default stream, where steps are otherwise launched, cannot be); the replays
  // run the same kernels with the same arguments as launching them would, so outputs are bitwise the
  // same. Whether a step can be captured is found out by trying: a backend that synchronises (eager reads
  // its counts back) makes the capture fail, and generation goes on launching kernels (also on later
  // calls with the same backends), with the reason in GenerationResult::decode_graph_reason.

  // Why the decode steps of this model cannot be captured whatever the backend, or "".
  std::string decode_graph_refusal() const {
    if (!device.is_cuda()) return "the model runs on the CPU";
    if (config.model_type == "deepseek_v3")
      return "deepseek_v3's latent attention expands every cached latent each step, so the step's sizes grow "
             "with the cache";
    return "";
  }

  std::vector<const void*> cache_buffers() const {
    std::vector<const void*> buffers;
    for (const LayerCache& lc : cache) {
      buffers.push_back(lc.first_device.data());
      buffers.push_back(lc.second_device.data());
    }
    return buffers;
  }

  DecodeRun start_decode(const GenerationConfig& g) {
    DecodeRun run;
    if (!g.decode_graph) {
      run.why_not = "GenerationConfig::decode_graph is false";
    } else if (const std::string refusal = decode_graph_refusal(); !refusal.empty()) {
      run.why_not = refusal;
    } else if (!uncapturable_reason.empty() && uncapturable_backends == experts_implementation.get()) {
      run.why_not = uncapturable_reason;
    } else {
      run.graphs = true;
    }
    return run;
  }

  // One decode step for `token`: replayed, captured, measured or launched (see above).
  Tensor decode(int32_t token, DecodeRun& run) {
    const std::span<const int32_t> tokens(&token, 1);
    if (!run.graphs) return step(tokens, 1);
    if (decode_graph && decode_graph->backends == experts_implementation.get() &&
        decode_graph->caches == cache_buffers())
      return replay(tokens, run);
    if (run.memory_bytes == 0) {
      const DeviceAllocationCounter counter(device);
      Tensor logits = step(tokens, 1);
      run.memory_bytes = counter.bytes();
      return logits;
    }
    const Tensor inputs = write_step_inputs(tokens);
    auto captured = std::make_unique<DecodeGraph>();
    try {
      // The legacy default stream, where steps are otherwise launched, cannot be captured.
      const ops::StreamScope on_model_stream(stream->stream());
      captured->graph = std::make_unique<CapturedGraph>(
          *stream, [&] { captured->logits = run_step(tokens, inputs, 1); }, run.memory_bytes);
    } catch (const Error& e) {
      // Nothing ran and nothing moved (the capture only recorded): launch this step and the next ones.
      run.graphs = false;
      uncapturable_backends = experts_implementation.get();
      uncapturable_reason = "the decode step with experts " + experts_implementation_text(uncapturable_backends) +
                            " could not be captured: " + e.what();
      run.why_not = uncapturable_reason;
      return step(tokens, 1);
    }
    captured->backends = experts_implementation.get();
    captured->caches = cache_buffers();
    captured->step_backends = last_step_backends;
    decode_graph = std::move(captured);
    return replay(tokens, run);
  }

  Tensor replay(std::span<const int32_t> tokens, DecodeRun& run) {
    write_step_inputs(tokens);  // into decode_state, which the graph reads
    decode_graph->graph->replay();
    cached_positions += 1;
    last_step_backends = decode_graph->step_backends;
    run.replayed = true;
    return decode_graph->logits;
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
  Impl& m = *impl_;
  m.reset_cache(static_cast<int64_t>(tokens.size()));
  Tensor logits = m.step(tokens, static_cast<int64_t>(tokens.size()));
  if (logits.device().is_cuda()) logits = logits.to(Device::cpu());
  m.reset_cache(0);
  return logits;
}

GenerationResult CausalLM::generate(std::span<const int32_t> prompt, const GenerationConfig& config) {
  MOEKIT_CHECK(!prompt.empty(), "generate: the prompt has no tokens");
  validate_generation_config(config);
  Impl& m = *impl_;
  // Every position of the generation: the prompt and the new tokens but the last (never run).
  const int64_t positions = checked_add(static_cast<int64_t>(prompt.size()), std::max<int64_t>(config.max_new_tokens - 1, 0),
                                        "generate: prompt tokens + max_new_tokens - 1");
  // On a GPU the cache is allocated now at its full length; on the CPU it grows, up to the same size.
  if (positions > m.cache_capacity)
    require_memory(m.device, m.cache_bytes(positions) - (m.device.is_cuda() ? m.cache_bytes(m.cache_capacity) : 0),
                   "generate: the KV cache for " + std::to_string(positions) + " positions (" +
                       std::to_string(prompt.size()) + " prompt tokens + max_new_tokens " +
                       std::to_string(config.max_new_tokens) + ")");
  m.reset_cache(positions);
  GenerationResult result;
  std::mt19937_64 rng(config.seed);
  std::vector<float> kept_logits;
  std::vector<float>* kept = config.output_logits ? &kept_logits : nullptr;
  using Clock = std::chrono::steady_clock;

  result.prefill_backends = m.experts_implementation.get();
  auto start = Clock::now();
  Tensor logits = m.step(prompt, 1);
  m.synchronize();
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.prefill_tokens = static_cast<int64_t>(prompt.size());
  result.stop_reason = "max new tokens";
  if (config.max_new_tokens == 0) return result;

  DecodePhaseSwitch decode_phase(m.experts_implementation, config.decode_phase_switch ? m.device : Device::cpu());
  result.decode_backends = m.experts_implementation.get();
  DecodeRun run = m.start_decode(config);
  start = Clock::now();
  while (true) {
    const int32_t token = m.pick(logits, config, rng, kept);
    result.tokens.push_back(token);
    if (config.on_token) config.on_token(token);
    if (std::find(config.stop_tokens.begin(), config.stop_tokens.end(), token) != config.stop_tokens.end()) {
      result.stop_reason = "stop token";
      break;
    }
    if (static_cast<int64_t>(result.tokens.size()) >= config.max_new_tokens) break;
    logits = m.decode(token, run);
    ++result.decode_tokens;
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.decode_graph = run.replayed;
  if (!run.replayed)
    result.decode_graph_reason = !run.why_not.empty() ? run.why_not
                                                      : "generation ended before a decode step was captured (the "
                                                        "first decode step runs uncaptured to size the graph)";
  if (kept) {
    const auto rows = static_cast<int64_t>(result.tokens.size());
    result.logits = Tensor::empty({rows, m.config.vocab_size}, DType::f32);
    std::copy(kept_logits.begin(), kept_logits.end(), result.logits.data_as<float>());
  }
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
  const std::string ignored = impl_->ignored_weights.empty() ? "" : "; " + impl_->ignored_weights_text();
  const std::string name = c.text_config.empty() ? c.model_type : c.model_type + " (" + c.text_config + ")";
  return name + ": " + std::to_string(c.num_hidden_layers) + " layers (" + std::to_string(moe_layers) +
         " MoE), hidden " + std::to_string(c.hidden_size) + ", " + std::to_string(c.num_experts) + " experts top-" +
         std::to_string(c.num_experts_per_tok) + ", vocab " + std::to_string(c.vocab_size) + ", " +
         std::string(dtype_name(impl_->dtype)) + " on " + device_name(impl_->device) + "; experts: " + backends +
         quantization + ignored;
}

}  // namespace moekit

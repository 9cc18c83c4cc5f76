// The decoder-only MoE language model: weights from one tensor list per layer, the forward step with its
// KV cache, and generation, on the CPU or a GPU; the experts of each MoE layer run through the backend its
// backbone names. On a GPU the decode step is captured once into a CUDA graph and replayed for every later
// token (causal_lm_decode_graph.cpp; "Decode steps as one CUDA graph" in causal_lm_impl.h).
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
#include "moekit/model/causal_lm_impl.h"

namespace moekit {

namespace ops = model_ops;

namespace {

DType parse_config_dtype(const std::string& text, const std::string& dir) {
  if (text == "bfloat16") return DType::bf16;
  if (text == "float16") return DType::f16;
  if (text == "float32") return DType::f32;
  MOEKIT_FAIL(dir, "/config.json: dtype '", text, "' is not supported (bfloat16, float16, float32)");
}

}  // namespace

CausalLM::Impl::Impl(const std::string& dir, const LoadOptions& options)
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

Tensor CausalLM::Impl::step(std::span<const int32_t> tokens, int64_t logit_rows) {
  const Tensor inputs = write_step_inputs(tokens);
  Tensor logits = run_step(tokens, inputs, logit_rows);
  cached_positions += static_cast<int64_t>(tokens.size());
  return logits;
}

Tensor CausalLM::Impl::write_step_inputs(std::span<const int32_t> tokens) {
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

Tensor CausalLM::Impl::run_step(std::span<const int32_t> tokens, const Tensor& inputs, int64_t logit_rows) {
  const ModelConfig& c = config;
  const int64_t T = static_cast<int64_t>(tokens.size());
  // The language model's backbone: the top level, or a vision-language model's text_config.
  const std::string& backend = experts_implementation.of(c.text_config);
  last_step_backends.clear();
  const int32_t* position = inputs.defined() ? inputs.data_as<int32_t>() : nullptr;
  Tensor h =
      inputs.defined() ? ops::embedding(embed_tokens, inputs.slice(0, 1, 1 + T)) : ops::embedding(embed_tokens, tokens);
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

int32_t CausalLM::Impl::pick(const Tensor& logits, const GenerationConfig& g, std::mt19937_64& rng,
                             std::vector<float>* kept) {
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
  const int64_t positions =
      checked_add(static_cast<int64_t>(prompt.size()), std::max<int64_t>(config.max_new_tokens - 1, 0),
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

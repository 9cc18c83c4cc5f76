// CausalLM's attention (causal_lm_impl.h): the KV cache (float on the CPU, growing; full-length device buffers on
// a GPU), grouped-query attention with rotary embeddings, and DeepSeek-V3's multi-head latent attention, whose
// cache holds the compressed latent and the rotated shared key.
#include "moekit/model/causal_lm_impl.h"

namespace moekit {

namespace ops = model_ops;

std::pair<int64_t, int64_t> CausalLM::Impl::cache_rows() const {
  const ModelConfig& c = config;
  if (c.model_type == "deepseek_v3") return {c.kv_lora_rank, c.qk_rope_head_dim};
  return {kv_heads_width(c), kv_heads_width(c)};
}

std::size_t CausalLM::Impl::cache_bytes(int64_t positions) const {
  const auto [first_row, second_row] = cache_rows();
  const int64_t element = device.is_cuda() ? static_cast<int64_t>(dtype_size(dtype)) : 4;
  const std::string what = "the KV cache's bytes for " + std::to_string(positions) + " positions";
  const int64_t row = checked_mul(checked_add(first_row, second_row, what), element, what);
  return static_cast<std::size_t>(
      checked_mul(checked_mul(row, positions, what + " (a layer)"), static_cast<int64_t>(layers.size()), what));
}

void CausalLM::Impl::reset_cache(int64_t capacity) {
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

ops::AttentionShape CausalLM::Impl::attention_shape(int64_t T, int64_t query_heads, int64_t key_heads, int64_t key_dim,
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

Tensor CausalLM::Impl::gqa(const AttentionWeights& a, const Tensor& x, LayerCache& lc, const int32_t* position) const {
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

Tensor CausalLM::Impl::mla(const AttentionWeights& a, const Tensor& x, LayerCache& lc, const int32_t* position) const {
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

}  // namespace moekit

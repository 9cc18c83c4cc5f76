#include "moekit/model/moe_block.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "moekit/dtype.h"
#include "moekit/error.h"
#include "moekit/model/model_ops.h"

namespace moekit {
namespace {

Tensor contiguous_f32(const Tensor& t) {
  const Tensor c = t.is_contiguous() ? t : t.contiguous();
  return c.dtype() == DType::f32 ? c : c.to(DType::f32);
}

// out[t, n] = sum_h x[t, h] * w[n, h] (+ b[n]): float32 inputs, double accumulation, float32 result.
Tensor project(const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t T = x.size(0), H = x.size(1), N = w.size(0);
  Tensor out = Tensor::empty({T, N}, DType::f32);
  const float* xs = x.data_as<float>();
  const float* ws = w.data_as<float>();
  const float* bs = b.defined() ? b.data_as<float>() : nullptr;
  float* os = out.data_as<float>();
  const int threads = static_cast<int>(std::clamp<int64_t>(T, 1, omp_get_max_threads()));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xs + t * H;
    for (int64_t n = 0; n < N; ++n) {
      const float* wr = ws + n * H;
      double acc = 0;
      for (int64_t h = 0; h < H; ++h) acc += static_cast<double>(row[h]) * static_cast<double>(wr[h]);
      if (bs != nullptr) acc += static_cast<double>(bs[n]);
      os[t * N + n] = static_cast<float>(acc);
    }
  }
  return out;
}

// v rounded to the storage type of dtype and widened back.
float round_to(float v, DType dtype) {
  return visit_float_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return to_float(from_float<T>(v));
  });
}

// Shape, dtype and device (that of the hidden states) of one input.
void check_shape(const Tensor& t, const char* name, const Shape& expected, Device device) {
  MOEKIT_CHECK(t.shape() == expected, "moe_block_forward: ", name, " has shape ", shape_string(t.shape()),
               ", expected ", shape_string(expected));
  MOEKIT_CHECK(t.device() == device, "moe_block_forward: ", name, " is on ", device_name(t.device()),
               ", expected ", device_name(device), " (where the hidden states are)");
  MOEKIT_CHECK(is_floating(t.dtype()), "moe_block_forward: ", name, " holds ", dtype_name(t.dtype()),
               ", expected f32, f16 or bf16");
}

// A gated MLP as an experts problem of one expert that every token picks: gate_up_proj [1, 2Is, H]
// (gate rows then up rows), down_proj [1, H, Is], weight sigmoid(x . gate_weight) or 1 without one.
// `role` prefixes the weights' names in errors ("shared_", "mlp.").
Tensor one_expert_forward(const Tensor& hidden, const Tensor& gate_proj, const Tensor& up_proj, const Tensor& down_proj,
                          const Tensor& gate_weight, Activation activation, std::string_view backend,
                          const std::string& role) {
  const int64_t T = hidden.size(0), H = hidden.size(1), Is = gate_proj.size(0);
  const Device device = hidden.device();
  check_shape(gate_proj, (role + "gate_proj").c_str(), {Is, H}, device);
  check_shape(up_proj, (role + "up_proj").c_str(), {Is, H}, device);
  check_shape(down_proj, (role + "down_proj").c_str(), {H, Is}, device);
  MOEKIT_CHECK(up_proj.dtype() == gate_proj.dtype(), "moe_block_forward: ", role, "up_proj holds ",
               dtype_name(up_proj.dtype()), ", ", role, "gate_proj ", dtype_name(gate_proj.dtype()),
               ": they must match");

  ExpertsProblem p;
  p.hidden_states = hidden;
  p.config.activation = activation;  // gated, concatenated, not transposed, no bias
  // gate and up rows side by side, built once per pair of weight tensors and kept with the gate
  // weight's storage: a new tensor on every call would also make a backend that prepares weights
  // (grouped_mm packs them) redo that work on every call.
  const std::string key = "moe_block/gate_up/" + std::to_string(gate_proj.storage_offset_bytes()) + "/" +
                          std::to_string(reinterpret_cast<uintptr_t>(up_proj.storage().get())) + "/" +
                          std::to_string(up_proj.storage_offset_bytes());
  const auto fused = gate_proj.storage()->attachment(key, [&]() -> std::shared_ptr<void> {
    Tensor gate_up = Tensor::empty({2 * Is, H}, gate_proj.dtype(), device);
    model_ops::write_rows(gate_up, 0, gate_proj.is_contiguous() ? gate_proj : gate_proj.contiguous());
    model_ops::write_rows(gate_up, Is, up_proj.is_contiguous() ? up_proj : up_proj.contiguous());
    return std::make_shared<Tensor>(gate_up.reshape({1, 2 * Is, H}));
  });
  p.gate_up_proj = *std::static_pointer_cast<Tensor>(fused);
  p.down_proj = (down_proj.is_contiguous() ? down_proj : down_proj.contiguous()).reshape({1, H, Is});

  // Made by kernels on the model's stream, not copied from the host: a decode step captured in a CUDA
  // graph must not touch the default stream.
  p.top_k_index = model_ops::full({T, 1}, DType::i64, 0, device);
  if (device.is_cuda()) {
    if (gate_weight.defined()) {
      check_shape(gate_weight, "shared_expert_gate", {1, H}, device);
      p.top_k_weights = model_ops::sigmoid_gate(model_ops::linear_f32(hidden, gate_weight), hidden.dtype()).reshape({T, 1});
    } else {
      p.top_k_weights = model_ops::full({T, 1}, DType::f32, 1, device);
    }
    return experts_forward(p, backend, Tensor(), model_ops::current_stream());
  }
  p.top_k_weights = Tensor::empty({T, 1}, DType::f32);
  float* weights = p.top_k_weights.data_as<float>();
  if (gate_weight.defined()) {
    check_shape(gate_weight, "shared_expert_gate", {1, H}, device);
    // Qwen2-MoE: sigmoid(F.linear(x, gate)) in the activation dtype.
    const Tensor logit = project(contiguous_f32(hidden), contiguous_f32(gate_weight), Tensor());
    const float* ls = logit.data_as<float>();
    for (int64_t t = 0; t < T; ++t) {
      const float l = round_to(ls[t], hidden.dtype());
      weights[t] = round_to(1.0f / (1.0f + std::exp(-l)), hidden.dtype());
    }
  } else {
    std::fill(weights, weights + T, 1.0f);
  }
  return experts_forward(p, backend);
}

}  // namespace

Tensor moe_block_forward(const Tensor& hidden, const MoeBlockWeights& w, const RouterConfig& router,
                         const ExpertsConfig& experts_config, std::string_view backend) {
  MOEKIT_CHECK(hidden.defined() && hidden.dim() == 2, "moe_block_forward: hidden must be [T, H], got ",
               hidden.defined() ? hidden.describe() : std::string("an undefined tensor"));
  const int64_t T = hidden.size(0), H = hidden.size(1), E = router.num_experts;
  const Device device = hidden.device();
  check_shape(hidden, "hidden", {T, H}, device);
  MOEKIT_CHECK(w.router_weight.defined(), "moe_block_forward: router_weight is undefined");
  check_shape(w.router_weight, "router_weight", {E, H}, device);
  if (w.router_bias.defined()) check_shape(w.router_bias, "router_bias", {E}, device);
  const bool shared = w.shared_gate_proj.defined();
  MOEKIT_CHECK(shared == w.shared_up_proj.defined() && shared == w.shared_down_proj.defined(),
               "moe_block_forward: shared_gate_proj, shared_up_proj and shared_down_proj must be all defined "
               "or all undefined");
  MOEKIT_CHECK(shared || !w.shared_expert_gate.defined(),
               "moe_block_forward: shared_expert_gate is defined but there is no shared expert");
  if (T == 0) return Tensor::empty({0, H}, hidden.dtype(), device);

  const Tensor x = hidden.is_contiguous() ? hidden : hidden.contiguous();
  // transformers: Qwen / GPT-OSS run F.linear in the activation dtype; DeepSeek-V3 casts to float32 first.
  const bool activation_dtype_gate = router.kind != RouterKind::deepseek_v3 && x.dtype() != DType::f32;
  RouterOutput routed;
  if (device.is_cuda()) {
    const Tensor logits = router.kind == RouterKind::deepseek_v3
                              ? model_ops::linear_f32(x, w.router_weight)
                              : model_ops::convert(model_ops::linear(x, w.router_weight, w.router_bias), DType::f32);
    routed = model_ops::route_on_device(logits, router, w.correction_bias);
  } else {
    const Tensor bias32 = w.router_bias.defined() ? contiguous_f32(w.router_bias) : Tensor();
    Tensor logits = project(contiguous_f32(x), contiguous_f32(w.router_weight), bias32);
    if (activation_dtype_gate) logits = logits.to(x.dtype());
    routed = route(logits, router, w.correction_bias);
  }

  ExpertsProblem p;
  p.hidden_states = x;
  p.top_k_index = routed.top_k_index;
  p.top_k_weights =
      activation_dtype_gate ? model_ops::convert(routed.top_k_weights, x.dtype()) : routed.top_k_weights;
  p.gate_up_proj = w.experts.gate_up_proj;
  p.down_proj = w.experts.down_proj;
  p.gate_up_proj_bias = w.experts.gate_up_proj_bias;
  p.down_proj_bias = w.experts.down_proj_bias;
  p.gate_up_proj_scale_inv = w.experts.gate_up_proj_scale_inv;
  p.down_proj_scale_inv = w.experts.down_proj_scale_inv;
  p.config = experts_config;
  Tensor out = experts_forward(p, backend, Tensor(), model_ops::current_stream());
  if (!shared) return out;

  const Tensor shared_out = one_expert_forward(x, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj,
                                              w.shared_expert_gate, experts_config.activation, backend, "shared_");
  model_ops::add_in_place(out, shared_out);  // in float, rounded once
  return out;
}

Tensor dense_mlp_forward(const Tensor& hidden, const Tensor& gate_proj, const Tensor& up_proj, const Tensor& down_proj,
                         Activation activation, std::string_view backend) {
  MOEKIT_CHECK(hidden.defined() && hidden.dim() == 2, "dense_mlp_forward: hidden must be [T, H], got ",
               hidden.defined() ? hidden.describe() : std::string("an undefined tensor"));
  check_shape(hidden, "hidden", hidden.shape(), hidden.device());
  if (hidden.size(0) == 0) return Tensor::empty({0, hidden.size(1)}, hidden.dtype(), hidden.device());
  const Tensor x = hidden.is_contiguous() ? hidden : hidden.contiguous();
  return one_expert_forward(x, gate_proj, up_proj, down_proj, Tensor(), activation, backend, "mlp.");
}

}  // namespace moekit

// The experts contract: names, validation of a problem, and the FLOP count.
#include "moekit/experts.h"

#include <array>
#include <sstream>

namespace moekit {

namespace {
constexpr std::array<std::pair<Activation, std::string_view>, 5> kActivations = {{
    {Activation::silu, "silu"},
    {Activation::gelu, "gelu"},
    {Activation::gelu_pytorch_tanh, "gelu_pytorch_tanh"},
    {Activation::relu, "relu"},
    {Activation::relu2, "relu2"},
}};
}  // namespace

std::string_view activation_name(Activation activation) {
  for (const auto& [a, name] : kActivations)
    if (a == activation) return name;
  MOEKIT_FAIL("unknown activation code ", static_cast<int>(activation));
}

Activation parse_activation(std::string_view name) {
  for (const auto& [a, n] : kActivations)
    if (n == name) return a;
  // transformers' aliases for the same functions
  if (name == "swish") return Activation::silu;
  if (name == "gelu_new" || name == "gelu_fast") return Activation::gelu_pytorch_tanh;
  std::string valid;
  for (const auto& [a, n] : kActivations) valid += std::string(valid.empty() ? "" : ", ") + std::string(n);
  MOEKIT_FAIL("unknown activation '", name, "'; valid: ", valid);
}

std::string ExpertsConfig::describe() const {
  std::ostringstream os;
  os << "activation=" << activation_name(activation) << " has_gate=" << has_gate << " has_bias=" << has_bias
     << " is_transposed=" << is_transposed << " is_concatenated=" << is_concatenated;
  if (swiglu_limit) os << " swiglu_limit=" << *swiglu_limit << " swiglu_alpha=" << swiglu_alpha;
  if (quantization.quantized()) os << " quantization=" << quantization.describe();
  return os.str();
}

namespace {

void check_tensor(const Tensor& t, const char* name, int64_t rank, Device device) {
  MOEKIT_CHECK(t.defined(), name, " is missing");
  MOEKIT_CHECK(t.dim() == rank, name, " must have rank ", rank, ", got ", t.describe());
  MOEKIT_CHECK(t.device() == device, name, " is on ", device_name(t.device()), " but hidden_states is on ",
               device_name(device));
  MOEKIT_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", shape_string(t.strides()), " for ",
               t.describe());
}

void check_shape(const Tensor& t, const char* name, const Shape& expected, const char* meaning) {
  MOEKIT_CHECK(t.shape() == expected, name, " must be ", shape_string(expected), " ", meaning, ", got ", t.describe());
}

}  // namespace

ExpertsShape problem_shape(const ExpertsProblem& p) {
  ExpertsShape s;
  s.tokens = p.hidden_states.size(0);
  s.hidden = p.hidden_states.size(1);
  s.top_k = p.top_k_index.size(1);
  s.experts = p.gate_up_proj.size(0);
  const int64_t n = p.gate_up_proj.size(p.config.is_transposed ? 2 : 1);
  s.intermediate = p.config.has_gate ? n / 2 : n;
  return s;
}

ExpertsShape validate(const ExpertsProblem& p) {
  const ExpertsConfig& c = p.config;
  MOEKIT_CHECK(p.hidden_states.defined(), "hidden_states is missing");
  const Device device = p.hidden_states.device();
  check_tensor(p.hidden_states, "hidden_states", 2, device);
  const DType dtype = p.hidden_states.dtype();
  MOEKIT_CHECK(dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16,
               "hidden_states must be f32, f16 or bf16, got ", p.hidden_states.describe());
  ExpertsShape s;
  s.tokens = p.hidden_states.size(0);
  s.hidden = p.hidden_states.size(1);
  MOEKIT_CHECK(s.hidden > 0, "hidden_states has hidden size 0: ", p.hidden_states.describe());

  check_tensor(p.top_k_index, "top_k_index", 2, device);
  MOEKIT_CHECK(p.top_k_index.dtype() == DType::i32 || p.top_k_index.dtype() == DType::i64,
               "top_k_index must be i32 or i64, got ", p.top_k_index.describe());
  MOEKIT_CHECK(p.top_k_index.size(0) == s.tokens, "top_k_index must have ", s.tokens,
               " rows (one per token of hidden_states), got ", p.top_k_index.describe());
  s.top_k = p.top_k_index.size(1);
  MOEKIT_CHECK(s.top_k > 0, "top_k_index must have at least one column, got ", p.top_k_index.describe());

  check_tensor(p.top_k_weights, "top_k_weights", 2, device);
  MOEKIT_CHECK(p.top_k_weights.dtype() == DType::f32 || p.top_k_weights.dtype() == dtype, "top_k_weights must be ",
               dtype == DType::f32 ? std::string("f32")
                                   : "f32 or " + std::string(dtype_name(dtype)) + " (the dtype of hidden_states)",
               ", got ", p.top_k_weights.describe());
  check_shape(p.top_k_weights, "top_k_weights", {s.tokens, s.top_k}, "(the shape of top_k_index)");

  const char* up_name = c.has_gate ? "gate_up_proj" : "up_proj";
  const QuantizationConfig& q = c.quantization;
  // The dtype the weights are stored in: the activations' own, or the quantised format's.
  const DType weight_dtype = !q.quantized()                        ? dtype
                             : q.weights == WeightFormat::fp8_e4m3 ? DType::f8_e4m3
                                                                   : DType::f4_e2m1;
  // "must have the dtype of hidden_states (bf16)" or "must be f8_e4m3 (config.quantization: ...)".
  const std::string expected_dtype =
      q.quantized()
          ? "must be " + std::string(dtype_name(weight_dtype)) + " (config.quantization: " + q.describe() + ")"
          : "must have the dtype of hidden_states (" + std::string(dtype_name(dtype)) + ")";
  if (q.quantized()) {
    MOEKIT_CHECK(!c.is_transposed, "quantised weights (", q.describe(),
                 ") must be untransposed [E, N, K], the layout their block scales describe; got is_transposed=true");
    MOEKIT_CHECK(q.resolved_block_size() == default_block_size(q.weights), "config.quantization.block_size ",
                 q.block_size, " is not supported: ", weight_format_name(q.weights), " weights use blocks of ",
                 default_block_size(q.weights), q.weights == WeightFormat::fp8_e4m3 ? " x 128" : " along K");
  }
  check_tensor(p.gate_up_proj, up_name, 3, device);
  MOEKIT_CHECK(p.gate_up_proj.dtype() == weight_dtype, up_name, " ", expected_dtype, ", got ",
               p.gate_up_proj.describe());
  s.experts = p.gate_up_proj.size(0);
  MOEKIT_CHECK(s.experts > 0, up_name, " has no experts: ", p.gate_up_proj.describe());
  const int64_t h_dim = c.is_transposed ? 1 : 2;
  const int64_t n_dim = c.is_transposed ? 2 : 1;
  // FP4 packs two values per byte along K: the stored dimension is half the logical one.
  const int64_t packing = dtype_values_per_element(weight_dtype);
  MOEKIT_CHECK(packing == 1 || s.hidden % 2 == 0, "FP4 weights pack two values per byte along H, so the hidden size ",
               "must be even; hidden_states is ", p.hidden_states.describe());
  MOEKIT_CHECK(p.gate_up_proj.size(h_dim) * packing == s.hidden, up_name, " dimension ", h_dim,
               " must be the hidden size ", s.hidden, packing == 2 ? " / 2 (FP4 pairs)" : "",
               (c.is_transposed ? " (is_transposed: [E, H, N])" : " ([E, N, H])"), ", got ", p.gate_up_proj.describe());
  const int64_t n = p.gate_up_proj.size(n_dim);
  if (c.has_gate) {
    MOEKIT_CHECK(n % 2 == 0 && n > 0, "gate_up_proj dimension ", n_dim,
                 " must be 2 * intermediate size (gate and up), got odd or zero ", n, " in ",
                 p.gate_up_proj.describe());
    s.intermediate = n / 2;
  } else {
    MOEKIT_CHECK(n > 0, "up_proj has intermediate size 0: ", p.gate_up_proj.describe());
    s.intermediate = n;
  }

  check_tensor(p.down_proj, "down_proj", 3, device);
  MOEKIT_CHECK(p.down_proj.dtype() == weight_dtype, "down_proj ", expected_dtype, ", got ", p.down_proj.describe());
  MOEKIT_CHECK(p.down_proj.size(0) == s.experts, "down_proj has ", p.down_proj.size(0), " experts but ", up_name,
               " has ", s.experts, ": ", p.down_proj.describe());
  MOEKIT_CHECK(packing == 1 || s.intermediate % 2 == 0, "FP4 weights pack two values per byte along I, so the ",
               "intermediate size must be even; ", up_name, " is ", p.gate_up_proj.describe());
  if (c.is_transposed)
    check_shape(p.down_proj, "down_proj", {s.experts, s.intermediate, s.hidden}, "(is_transposed: [E, I, H])");
  else if (packing == 2)
    check_shape(p.down_proj, "down_proj", {s.experts, s.hidden, s.intermediate / 2}, "([E, H, I/2], FP4 pairs)");
  else
    check_shape(p.down_proj, "down_proj", {s.experts, s.hidden, s.intermediate}, "([E, H, I])");

  if (q.quantized()) {
    const bool fp8 = q.weights == WeightFormat::fp8_e4m3;
    const char* up_scale = c.has_gate ? "gate_up_proj_scale_inv" : "up_proj_scale_inv";
    check_tensor(p.gate_up_proj_scale_inv, up_scale, 3, device);
    check_tensor(p.down_proj_scale_inv, "down_proj_scale_inv", 3, device);
    const DType scale_dtype = p.gate_up_proj_scale_inv.dtype();
    MOEKIT_CHECK(fp8 ? (scale_dtype == DType::f32 || scale_dtype == DType::ue8m0) : scale_dtype == DType::ue8m0,
                 up_scale, " must be ", fp8 ? "f32 or ue8m0" : "ue8m0", " (", q.describe(), "), got ",
                 p.gate_up_proj_scale_inv.describe());
    MOEKIT_CHECK(p.down_proj_scale_inv.dtype() == scale_dtype, "down_proj_scale_inv must have the dtype of ", up_scale,
                 " (", dtype_name(scale_dtype), "): the activations' scales follow them; got ",
                 p.down_proj_scale_inv.describe());
    const char* up_meaning = fp8 ? "([E, ceil(N/128), ceil(H/128)]: one scale per 128 x 128 block)"
                                 : "([E, N, ceil(H/32)]: one scale per 32 values along H)";
    const char* down_meaning = fp8 ? "([E, ceil(H/128), ceil(I/128)]: one scale per 128 x 128 block)"
                                   : "([E, H, ceil(I/32)]: one scale per 32 values along I)";
    check_shape(p.gate_up_proj_scale_inv, up_scale, weight_scale_shape(q.weights, s.experts, n, s.hidden), up_meaning);
    check_shape(p.down_proj_scale_inv, "down_proj_scale_inv",
                weight_scale_shape(q.weights, s.experts, s.hidden, s.intermediate), down_meaning);
  } else {
    MOEKIT_CHECK(!p.gate_up_proj_scale_inv.defined() && !p.down_proj_scale_inv.defined(),
                 "scale_inv tensors were given but config.quantization says the weights are not quantised; set "
                 "config.quantization.weights or drop them");
  }

  if (c.has_bias) {
    const char* b1 = c.has_gate ? "gate_up_proj_bias" : "up_proj_bias";
    check_tensor(p.gate_up_proj_bias, b1, 2, device);
    check_tensor(p.down_proj_bias, "down_proj_bias", 2, device);
    MOEKIT_CHECK(p.gate_up_proj_bias.dtype() == dtype && p.down_proj_bias.dtype() == dtype,
                 "biases must have the dtype of hidden_states (", dtype_name(dtype), "), got ",
                 p.gate_up_proj_bias.describe(), " and ", p.down_proj_bias.describe());
    check_shape(p.gate_up_proj_bias, b1, {s.experts, n}, "([E, N] like the projection's outputs)");
    check_shape(p.down_proj_bias, "down_proj_bias", {s.experts, s.hidden}, "([E, H])");
  } else {
    MOEKIT_CHECK(!p.gate_up_proj_bias.defined() && !p.down_proj_bias.defined(),
                 "bias tensors were given but config.has_bias is false; set has_bias or drop them");
  }
  if (c.swiglu_limit) {
    MOEKIT_CHECK(c.has_gate && c.activation == Activation::silu,
                 "swiglu_limit (the GPT-OSS clamped SwiGLU) needs has_gate and activation silu, got ", c.describe());
    MOEKIT_CHECK(*c.swiglu_limit > 0, "swiglu_limit must be positive, got ", *c.swiglu_limit);
  }
  return s;
}

void check_routing_ids(const ExpertsProblem& p) {
  const Tensor& idx = p.top_k_index;
  MOEKIT_CHECK(idx.device().is_cpu(), "check_routing_ids reads CPU ids only, got ", idx.describe());
  const int64_t k = idx.dim() == 2 ? idx.size(1) : 1;
  visit_index_dtype(idx.dtype(), [&](auto tag) {
    using I = typename decltype(tag)::type;
    const I* ids = static_cast<const I*>(idx.data());
    for (int64_t i = 0; i < idx.numel(); ++i)
      MOEKIT_CHECK(ids[i] >= 0, "top_k_index[", i / k, ", ", i % k, "] = ", static_cast<int64_t>(ids[i]),
                   " is negative; ids must be in [0, E) or >= E for an expert-parallel sentinel");
  });
}

double experts_flops(const ExpertsShape& s, bool has_gate, double routed_pairs) {
  const double up_rows = has_gate ? 2.0 * static_cast<double>(s.intermediate) : static_cast<double>(s.intermediate);
  return 2.0 * routed_pairs * static_cast<double>(s.hidden) * (up_rows + static_cast<double>(s.intermediate));
}

double experts_backward_flops(const ExpertsShape& s, bool has_gate, double routed_pairs) {
  return 2.0 * experts_flops(s, has_gate, routed_pairs);
}

}  // namespace moekit

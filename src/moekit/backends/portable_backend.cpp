#include "moekit/backends/portable_backend.h"

#include "moekit/backends/quantized_support.h"
#include "moekit/core/device_memory.h"

namespace moekit::backends {

Support cuda_device_support(Device device) {
#if MOEKIT_HAS_CUDA
  std::string why;
  if (device_available(device, &why)) return Support::yes();
  return Support::no(why);
#else
  (void)device;
  return Support::no(kNoCudaReason);
#endif
}

#if MOEKIT_HAS_CUDA
cuda::ExpertsArgs cuda_args(const ExpertsProblem& p, Tensor* out) {
  const ExpertsShape s = validate(p);
  const ExpertsConfig& c = p.config;
  cuda::ExpertsArgs a;
  a.tokens = s.tokens;
  a.hidden = s.hidden;
  a.intermediate = s.intermediate;
  a.experts = s.experts;
  a.top_k = s.top_k;
  a.dtype = p.hidden_states.dtype();
  a.index_dtype = p.top_k_index.dtype();
  a.routing_dtype = p.top_k_weights.dtype();
  a.x = p.hidden_states.data();
  a.ids = p.top_k_index.data();
  a.routing_weights = p.top_k_weights.data();
  a.up = p.gate_up_proj.data();
  a.down = p.down_proj.data();
  a.up_bias = c.has_bias ? p.gate_up_proj_bias.data() : nullptr;
  a.down_bias = c.has_bias ? p.down_proj_bias.data() : nullptr;
  a.has_gate = c.has_gate;
  a.transposed = c.is_transposed;
  a.concatenated = !c.has_gate || c.is_concatenated;
  if (c.swiglu_limit) {
    a.act = cuda::Act::clamped_swiglu;
    a.swiglu_limit = *c.swiglu_limit;
    a.swiglu_alpha = c.swiglu_alpha;
  } else {
    switch (c.activation) {
      case Activation::silu:
        a.act = cuda::Act::silu;
        break;
      case Activation::gelu:
        a.act = cuda::Act::gelu;
        break;
      case Activation::gelu_pytorch_tanh:
        a.act = cuda::Act::gelu_tanh;
        break;
      case Activation::relu:
        a.act = cuda::Act::relu;
        break;
      case Activation::relu2:
        a.act = cuda::Act::relu2;
        break;
    }
  }
  const QuantizationConfig& q = c.quantization;
  if (q.quantized()) {
    a.weights = q.weights;
    a.ue8m0_scales = p.gate_up_proj_scale_inv.dtype() == DType::ue8m0;
    a.up_scale = p.gate_up_proj_scale_inv.data();
    a.down_scale = p.down_proj_scale_inv.data();
  }
  a.out = out ? out->data() : nullptr;
  return a;
}
#endif

Support PortableBackend::supports(const ExpertsProblem& p) const {
  // Quantised weights (FP8, FP4) run on every device; only the dynamic activation scheme does.
  if (Support s = activation_scheme_support(p, name()); !s) return s;
  return supports_device(p.hidden_states.device());
}

std::size_t PortableBackend::workspace_bytes(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  if (p.hidden_states.device().is_cuda()) return cuda_.workspace_bytes(cuda_args(p));
#endif
  return cpu_workspace_bytes(p);
}

void PortableBackend::forward(const ExpertsProblem& p, Tensor& out, void* workspace, Stream stream) {
#if MOEKIT_HAS_CUDA
  if (p.hidden_states.device().is_cuda()) return cuda_.forward(cuda_args(p, &out), workspace, cuda_stream(stream));
#endif
  (void)stream;
  cpu_forward(p, out, workspace);
}

}  // namespace moekit::backends

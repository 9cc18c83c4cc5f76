#include "moekit/backends/portable_backend.h"

#include "moekit/backends/cpu_backward.h"
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
  const ExpertsShape s = problem_shape(p);
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

cuda::ExpertsBackwardArgs cuda_backward_args(const ExpertsProblem& p, const Tensor* grad_out, ExpertsGradients* g) {
  cuda::ExpertsBackwardArgs b;
  b.a = cuda_args(p);
  if (grad_out) b.grad_out = grad_out->data();
  if (g) {
    b.grad_x = g->hidden_states.data();
    b.grad_routing_weights = g->top_k_weights.data();
    b.grad_up = g->gate_up_proj.data();
    b.grad_down = g->down_proj.data();
    b.grad_up_bias = p.config.has_bias ? g->gate_up_proj_bias.data() : nullptr;
    b.grad_down_bias = p.config.has_bias ? g->down_proj_bias.data() : nullptr;
  }
  return b;
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

std::string PortableBackend::kernel_path(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  if (p.hidden_states.device().is_cuda()) return "CUDA " + cuda_.kernel_path(cuda_args(p));
#endif
  return "CPU " + cpu_kernel_path(p);
}

Support PortableBackend::supports_backward(const ExpertsProblem& p) const {
  if (p.config.quantization.quantized())
    return Support::no(
        "quantised experts (" + p.config.quantization.describe() +
        ") have no backward: FP8 / FP4 training is out of scope; dequantise the weights to bf16 to train");
  const Device device = p.hidden_states.device();
  if (Support s = supports_device(device); !s) return s;
#if MOEKIT_HAS_CUDA
  if (device.is_cuda() && cuda_.backward == nullptr)
    return Support::no("the CUDA backward of '" + std::string(name()) + "' is not built yet");
#endif
  return Support::yes();
}

std::size_t PortableBackend::backward_workspace_bytes(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  if (p.hidden_states.device().is_cuda()) return cuda_.backward_workspace_bytes(cuda_backward_args(p));
#endif
  return cpu_backward_workspace_bytes(p);
}

void PortableBackend::backward(const ExpertsProblem& p, const Tensor& grad_out, ExpertsGradients& grads,
                               void* workspace, Stream stream) {
#if MOEKIT_HAS_CUDA
  if (p.hidden_states.device().is_cuda())
    return cuda_.backward(cuda_backward_args(p, &grad_out, &grads), workspace, cuda_stream(stream));
#endif
  (void)stream;
  cpu_backward(p, grad_out, grads, workspace);
}

std::size_t PortableBackend::cpu_backward_workspace_bytes(const ExpertsProblem& p) const {
  return cpu::sorted_backward_workspace_bytes(p);
}

void PortableBackend::cpu_backward(const ExpertsProblem& p, const Tensor& grad_out, ExpertsGradients& grads,
                                   void* workspace) {
  cpu::sorted_backward(p, grad_out, grads, workspace);
}

}  // namespace moekit::backends

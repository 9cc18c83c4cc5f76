#include "moekit/backends/hopper_backend.h"

#include "moekit/backends/quantized_support.h"
#include "moekit/core/device_memory.h"

namespace moekit::backends {

Support hopper_cuda_device_support(Device device, const std::string& who) {
  if (Support s = cuda_device_support(device); !s) return s;
  const auto cc = device_compute_capability(device);
  if (!cc || cc->major != 9 || cc->minor != 0)
    return Support::no(who + " needs a Hopper GPU (compute capability 9.0, sm_90a code); this device is " +
                       (cc ? std::to_string(cc->major) + "." + std::to_string(cc->minor) : std::string("unknown")));
  return Support::yes();
}

Support HopperBackend::supports_device(Device device) const {
  const std::string n(name());
  if (device.is_cpu())
    return Support::no("not supported on this device: " + n +
                       " runs on Hopper GPUs (compute capability 9.0) only; on the CPU use grouped_mm");
  return hopper_cuda_device_support(device, n);
}

Support HopperBackend::supports(const ExpertsProblem& p) const {
  const std::string n(name());
  if (const auto cc = device_compute_capability(p.hidden_states.device()))
    if (Support s = blackwell_scale_support(p, *cc, n); !s) return s;
  if (Support s = quantized_cuda_support(p, n, runs_fp8()); !s) return s;
  if (Support s = activation_scheme_support(p, n); !s) return s;
  if (Support s = supports_device(p.hidden_states.device()); !s) return s;
  const DType dtype = p.hidden_states.dtype();
  if (dtype != DType::bf16 && dtype != DType::f16)
    return Support::no(n + " computes in bf16 or f16 on the tensor cores; the activations are " +
                       std::string(dtype_name(dtype)) + " (use grouped_mm for float32)");
  if (p.config.is_transposed)
    return Support::no(n + " reads weights as [experts, out, in] (is_transposed = false); these are transposed");
  const ExpertsShape s = problem_shape(p);
  if (s.hidden % 8 != 0 || s.intermediate % 8 != 0)
    return Support::no(n + "'s tensor copies need rows of a multiple of 16 bytes: hidden size " +
                       std::to_string(s.hidden) + " and intermediate size " + std::to_string(s.intermediate) +
                       " must be multiples of 8");
  if (p.config.quantization.quantized() && (s.hidden % 128 != 0 || s.intermediate % 128 != 0))
    return Support::no(n + " runs FP8 experts in whole 128 x 128 scale blocks: hidden size " +
                       std::to_string(s.hidden) + " and intermediate size " + std::to_string(s.intermediate) +
                       " must be multiples of 128");
#if MOEKIT_HAS_CUDA
  if (const char* why = cuda::hopper_alignment_refusal(cuda_args(p))) return Support::no(n + " " + why);
#endif
  return Support::yes();
}

std::size_t HopperBackend::workspace_bytes(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  return cuda_.workspace_bytes(cuda_args(p));
#else
  (void)p;
  return 0;
#endif
}

std::string HopperBackend::kernel_path(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  return "CUDA " + cuda_.kernel_path(cuda_args(p));
#else
  (void)p;  // unreachable: supports_device refuses every device in a build without CUDA
  return std::string(name());
#endif
}

void HopperBackend::forward(const ExpertsProblem& p, Tensor& out, void* workspace, Stream stream) {
#if MOEKIT_HAS_CUDA
  cuda_.forward(cuda_args(p, &out), workspace, cuda_stream(stream));
#else
  (void)p, (void)out, (void)workspace, (void)stream;
  MOEKIT_FAIL(name(), ": ", kNoCudaReason);
#endif
}

Support HopperBackend::supports_backward(const ExpertsProblem& p) const {
  if (p.config.quantization.quantized())
    return Support::no(
        "quantised experts (" + p.config.quantization.describe() +
        ") have no backward: FP8 / FP4 training is out of scope; dequantise the weights to bf16 to train");
  if (Support s = supports(p); !s) return s;
#if MOEKIT_HAS_CUDA
  if (cuda_.backward == nullptr) return Support::no("the CUDA backward of '" + std::string(name()) + "' is not built");
#endif
  return Support::yes();
}

std::size_t HopperBackend::backward_workspace_bytes(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  return cuda_.backward_workspace_bytes(cuda_backward_args(p));
#else
  (void)p;
  return 0;
#endif
}

void HopperBackend::backward(const ExpertsProblem& p, const Tensor& grad_out, ExpertsGradients& grads, void* workspace,
                             Stream stream) {
#if MOEKIT_HAS_CUDA
  cuda_.backward(cuda_backward_args(p, &grad_out, &grads), workspace, cuda_stream(stream));
#else
  (void)p, (void)grad_out, (void)grads, (void)workspace, (void)stream;
  MOEKIT_FAIL(name(), ": ", kNoCudaReason);
#endif
}

std::size_t HopperBackend::saved_activation_bytes(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  if (cuda_.saved_z_bytes == nullptr || p.config.quantization.quantized()) return 0;
  return cuda_.saved_z_bytes(cuda_args(p));
#else
  (void)p;
  return 0;
#endif
}

std::size_t HopperBackend::saving_workspace_bytes(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  if (saved_activation_bytes(p) == 0) return workspace_bytes(p);
  cuda::ExpertsArgs args = cuda_args(p);
  // Any non-null z: the workspace of the path a forward that keeps z takes (the grouped GEMM at every size).
  args.save_z = reinterpret_cast<float*>(alignof(float));
  return cuda_.workspace_bytes(args);
#else
  (void)p;
  return 0;
#endif
}

std::size_t HopperBackend::saved_backward_workspace_bytes(const ExpertsProblem& p) const {
#if MOEKIT_HAS_CUDA
  if (saved_activation_bytes(p) == 0) return backward_workspace_bytes(p);
  cuda::ExpertsBackwardArgs args = cuda_backward_args(p);
  args.saved_z = reinterpret_cast<const float*>(alignof(float));  // any non-null z: the workspace without z's own
  return cuda_.backward_workspace_bytes(args);
#else
  (void)p;
  return 0;
#endif
}

void HopperBackend::forward_saving(const ExpertsProblem& p, Tensor& out, void* saved, void* workspace, Stream stream) {
#if MOEKIT_HAS_CUDA
  cuda::ExpertsArgs args = cuda_args(p, &out);
  if (saved_activation_bytes(p) > 0) args.save_z = static_cast<float*>(saved);
  cuda_.forward(args, workspace, cuda_stream(stream));
#else
  (void)p, (void)out, (void)saved, (void)workspace, (void)stream;
  MOEKIT_FAIL(name(), ": ", kNoCudaReason);
#endif
}

void HopperBackend::backward_saved(const ExpertsProblem& p, const Tensor& grad_out, const void* saved,
                                   ExpertsGradients& grads, void* workspace, Stream stream) {
#if MOEKIT_HAS_CUDA
  cuda::ExpertsBackwardArgs args = cuda_backward_args(p, &grad_out, &grads);
  args.saved_z = static_cast<const float*>(saved);
  cuda_.backward(args, workspace, cuda_stream(stream));
#else
  (void)p, (void)grad_out, (void)saved, (void)grads, (void)workspace, (void)stream;
  MOEKIT_FAIL(name(), ": ", kNoCudaReason);
#endif
}

}  // namespace moekit::backends

#include "moekit/backends/quantized_support.h"

#include <string>

namespace moekit::backends {

std::string_view quantized_format_label(const ExpertsProblem& p) {
  return p.config.quantization.weights == WeightFormat::fp4_e2m1 ? "FP4" : "FP8";
}

Support quantized_cuda_support(const ExpertsProblem& p, std::string_view backend, bool fp8_kernels) {
  if (!p.config.quantization.quantized() || !p.hidden_states.device().is_cuda()) return Support::yes();
  if (fp8_kernels && p.config.quantization.weights == WeightFormat::fp8_e4m3) return Support::yes();
  return Support::no(std::string(quantized_format_label(p)) + " experts on CUDA are not implemented yet in " +
                     std::string(backend) + " (" + p.config.quantization.describe() +
                     "); run them on the CPU, or dequantize the weights to bf16 first (dequantize_weights)");
}

Support activation_scheme_support(const ExpertsProblem& p, std::string_view backend) {
  const QuantizationConfig& q = p.config.quantization;
  if (!q.quantized() || q.activations == ActivationScheme::dynamic) return Support::yes();
  return Support::no(std::string(backend) + " quantises activations on the fly per token and 128-wide group " +
                     "(activation_scheme \"dynamic\"); the \"static\" scheme (one checkpoint scale per tensor) " +
                     "is not supported");
}

Support blackwell_scale_support(const ExpertsProblem& p, ComputeCapability cc, std::string_view backend) {
  if (!p.config.quantization.quantized() || cc.major != 10) return Support::yes();
  if (p.gate_up_proj_scale_inv.dtype() == DType::ue8m0) return Support::yes();
  return Support::no(std::string(backend) + " on compute capability " + std::to_string(cc.major) + "." +
                     std::to_string(cc.minor) + " reads UE8M0 weight scales only, but the scales are " +
                     std::string(dtype_name(p.gate_up_proj_scale_inv.dtype())) +
                     "; quantise the weights with ue8m0 scales (quantize_weights(..., DType::ue8m0))");
}

}  // namespace moekit::backends

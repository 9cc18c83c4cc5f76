// The base of the Hopper backends (deepgemm, sonicmoe): what they run on and which problems they take
// (compute capability 9.0; bf16/f16; untransposed weights; H and I multiples of 8, of 128 with FP8
// weights; 16-byte aligned),
// answered with the reason, and their CUDA entry points. Their kernels are in src/moekit/cuda/
// (hopper_experts.cu, sm90_grouped_gemm.cuh).
#pragma once

#include <string>

#include "moekit/backends/portable_backend.h"

namespace moekit::backends {

// yes for a visible compute capability 9.0 GPU in a CUDA build; otherwise why not, naming `who`.
Support hopper_cuda_device_support(Device device, const std::string& who);

class HopperBackend : public ExpertsBackend {
 public:
  Support supports_device(Device device) const override;
  Support supports(const ExpertsProblem& p) const override;
  std::size_t workspace_bytes(const ExpertsProblem& p) const override;
  void forward(const ExpertsProblem& p, Tensor& out, void* workspace, Stream stream) override;
  std::string kernel_path(const ExpertsProblem& p) const override;
  // The Hopper backward (cuda/sm90_backward.cu), on the problems the forward takes, unquantised.
  Support supports_backward(const ExpertsProblem& p) const override;
  std::size_t backward_workspace_bytes(const ExpertsProblem& p) const override;
  void backward(const ExpertsProblem& p, const Tensor& grad_out, ExpertsGradients& grads, void* workspace,
                Stream stream) override;
  // A training step's forward keeps z (the first projection plus its bias, float, one row per routed pair in sorted
  // order) and the backward reads it instead of recomputing that product (cuda::hopper_saved_z_bytes).
  std::size_t saved_activation_bytes(const ExpertsProblem& p) const override;
  std::size_t saving_workspace_bytes(const ExpertsProblem& p) const override;
  std::size_t saved_backward_workspace_bytes(const ExpertsProblem& p) const override;
  void forward_saving(const ExpertsProblem& p, Tensor& out, void* saved, void* workspace, Stream stream) override;
  void backward_saved(const ExpertsProblem& p, const Tensor& grad_out, const void* saved, ExpertsGradients& grads,
                      void* workspace, Stream stream) override;

 protected:
  explicit HopperBackend(CudaKernels kernels) : cuda_(kernels) {}
  // Whether the kernels read FP8 e4m3 weights with 128 x 128 block scales (deepgemm).
  virtual bool runs_fp8() const { return false; }

 private:
  [[maybe_unused]] CudaKernels cuda_;
};

}  // namespace moekit::backends

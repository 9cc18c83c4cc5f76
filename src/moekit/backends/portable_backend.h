// The base of the portable backends (eager, batched_mm, grouped_mm) and what they need to hand a
// problem to the CUDA kernels: the device check and the kernel arguments. In builds without CUDA
// the check says so and the CUDA half does not exist.
#pragma once

#include "moekit/experts.h"

#if MOEKIT_HAS_CUDA
#include "moekit/cuda/experts_cuda.h"
#endif

namespace moekit::backends {

// yes for a visible CUDA device in a CUDA build; otherwise the reason.
Support cuda_device_support(Device device);

#if MOEKIT_HAS_CUDA
// The kernel arguments of a validated problem on a CUDA device, writing into *out (null: sizes only).
cuda::ExpertsArgs cuda_args(const ExpertsProblem& p, Tensor* out = nullptr);
inline cudaStream_t cuda_stream(Stream s) {
  return static_cast<cudaStream_t>(s.handle);
}
#endif

// A backend's CUDA entry points (MOEKIT_CUDA_KERNELS below), or nothing in a CPU-only build.
#if MOEKIT_HAS_CUDA
struct CudaKernels {
  std::size_t (*workspace_bytes)(const cuda::ExpertsArgs&);
  void (*forward)(const cuda::ExpertsArgs&, void*, cudaStream_t);
  std::string (*kernel_path)(const cuda::ExpertsArgs&);
  // Null where the backend has no CUDA backward (supports_backward then says so).
  std::size_t (*backward_workspace_bytes)(const cuda::ExpertsBackwardArgs&) = nullptr;
  void (*backward)(const cuda::ExpertsBackwardArgs&, void*, cudaStream_t) = nullptr;
  // Bytes of what the forward keeps for the backward (ExpertsArgs::save_z), or null where it keeps nothing.
  std::size_t (*saved_z_bytes)(const cuda::ExpertsArgs&) = nullptr;
};
// The backward's kernel arguments of a validated problem, grad_out and the gradients (null: sizes only).
cuda::ExpertsBackwardArgs cuda_backward_args(const ExpertsProblem& p, const Tensor* grad_out = nullptr,
                                             ExpertsGradients* grads = nullptr);
#else
struct CudaKernels {};
#endif

// eager, batched_mm and grouped_mm: the same answer to "can you run here?" and the same split
// between their CPU implementation (in the backend's file) and their CUDA kernels (named here).
class PortableBackend : public ExpertsBackend {
 public:
  Support supports_device(Device device) const override {
    return device.is_cpu() ? Support::yes() : cuda_device_support(device);
  }
  // The activation scheme (only the dynamic one runs), then the device.
  Support supports(const ExpertsProblem& p) const override;
  std::size_t workspace_bytes(const ExpertsProblem& p) const override;
  void forward(const ExpertsProblem& p, Tensor& out, void* workspace, Stream stream) override;
  // The CUDA kernels' path (CudaKernels::kernel_path) on a GPU, cpu_kernel_path on the CPU.
  std::string kernel_path(const ExpertsProblem& p) const override;
  // Unquantised problems (FP8 / FP4 training is out of scope), on the CPU and where the CUDA backward exists.
  Support supports_backward(const ExpertsProblem& p) const override;
  std::size_t backward_workspace_bytes(const ExpertsProblem& p) const override;
  void backward(const ExpertsProblem& p, const Tensor& grad_out, ExpertsGradients& grads, void* workspace,
                Stream stream) override;

 protected:
#if MOEKIT_HAS_CUDA
  explicit PortableBackend(CudaKernels kernels) : cuda_(kernels) {}
#else
  explicit PortableBackend(CudaKernels) {}
#endif
  virtual std::size_t cpu_workspace_bytes(const ExpertsProblem& p) const = 0;
  virtual void cpu_forward(const ExpertsProblem& p, Tensor& out, void* workspace) = 0;
  virtual std::string cpu_kernel_path(const ExpertsProblem& p) const = 0;
  // The CPU backward: by default the sorted-row pipeline of cpu_backward.h, which all three share.
  virtual std::size_t cpu_backward_workspace_bytes(const ExpertsProblem& p) const;
  virtual void cpu_backward(const ExpertsProblem& p, const Tensor& grad_out, ExpertsGradients& grads, void* workspace);

 private:
#if MOEKIT_HAS_CUDA
  CudaKernels cuda_;
#endif
};

// The CUDA entry points of a backend, or nothing in a CPU-only build; MOEKIT_CUDA_HOPPER_KERNELS for the Hopper
// backends, whose forwards differ and whose backward is one.
#if MOEKIT_HAS_CUDA
#define MOEKIT_CUDA_KERNELS(name)                                                    \
  {                                                                                  \
    &cuda::name##_workspace_bytes, &cuda::name##_forward, &cuda::name##_kernel_path, \
        &cuda::name##_backward_workspace_bytes, &cuda::name##_backward               \
  }
// A Hopper backend: its forward, and the Hopper backward both share.
#define MOEKIT_CUDA_HOPPER_KERNELS(name)                                                            \
  {                                                                                                 \
    &cuda::name##_workspace_bytes, &cuda::name##_forward, &cuda::name##_kernel_path,                \
        &cuda::hopper_backward_workspace_bytes, &cuda::hopper_backward, &cuda::hopper_saved_z_bytes \
  }
#else
#define MOEKIT_CUDA_HOPPER_KERNELS(name) \
  {}
#define MOEKIT_CUDA_KERNELS(name) \
  {}
#endif

}  // namespace moekit::backends

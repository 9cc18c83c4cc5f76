// What the backends need to hand a problem to the CUDA kernels: the device check and the kernel
// arguments. In builds without CUDA the check says so and nothing else exists.
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
inline cudaStream_t cuda_stream(Stream s) { return static_cast<cudaStream_t>(s.handle); }
#endif

}  // namespace moekit::backends

// The answers backends give about quantised experts (DESIGN §3), written once: pure functions of the
// problem (and of the compute capability, passed in so that the rule is testable without the GPU).
#pragma once

#include <string_view>

#include "moekit/core/device_memory.h"
#include "moekit/experts.h"

namespace moekit::backends {

// "FP8" or "FP4" for a quantised problem, as the refusals name the format.
std::string_view quantized_format_label(const ExpertsProblem& p);

// On a CUDA device, the Hopper backends refuse quantised problems by name ("FP4 experts on CUDA are not
// implemented yet in deepgemm") instead of reading the bytes as bf16, except FP8 where their kernels read
// e4m3 weights (fp8_kernels: deepgemm). The portable backends run both formats everywhere.
Support quantized_cuda_support(const ExpertsProblem& p, std::string_view backend, bool fp8_kernels = false);

// Backends that run quantised experts quantise activations on the fly (the dynamic scheme); a static
// per-tensor scheme is refused with the reason.
Support activation_scheme_support(const ExpertsProblem& p, std::string_view backend);

// DESIGN §3: on compute capability 10.x, deepgemm and deepgemm_megamoe read UE8M0 scales only, so a
// problem with float32 scales is refused there rather than misread; other capabilities and unquantised
// problems pass.
Support blackwell_scale_support(const ExpertsProblem& p, ComputeCapability cc, std::string_view backend);

}  // namespace moekit::backends

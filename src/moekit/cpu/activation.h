// The gated activation of the experts contract over rows of products, in float: one entry point that runs
// the AVX-512 build of activation_math.h where the CPU has it (gemv_uses_avx512), else the portable one.
#pragma once

#include <cstdint>

#include "moekit/dtype.h"
#include "moekit/experts.h"

namespace moekit::cpu {

// h[j] = act(gate[j * gate_stride]) * up[j * up_stride] (activation_math.h's activate_rows) for j < n.
// Out: float or bf16 (the instantiations activation.cpp provides).
template <typename Out>
void apply_activation(const ExpertsConfig& c, const float* gate, int64_t gate_stride, const float* up,
                      int64_t up_stride, int64_t n, Out* h);

namespace avx512 {
// activate_rows compiled for AVX-512 (activation_avx512.cpp, for float and bf16); only where
// gemv_uses_avx512().
template <typename Out>
void activate_rows_avx512(const ExpertsConfig& c, const float* gate, int64_t gate_stride, const float* up,
                          int64_t up_stride, int64_t n, Out* h);
}  // namespace avx512

}  // namespace moekit::cpu

// activation_math.h built with AVX-512 (this file's compile options), in its own namespace: the loops
// vectorise 16 floats wide with the rounding instruction the baseline build lacks (its floor was a scalar
// sequence per value).
#define MOEKIT_ACTIVATION_ISA avx512
#include "moekit/cpu/activation.h"
#include "moekit/cpu/activation_math.h"

namespace moekit::cpu::avx512 {

template <typename Out>
void activate_rows_avx512(const ExpertsConfig& c, const float* gate, int64_t gate_stride, const float* up,
                          int64_t up_stride, int64_t n, Out* h) {
  activate_rows(c, gate, gate_stride, up, up_stride, n, h);
}

template void activate_rows_avx512(const ExpertsConfig&, const float*, int64_t, const float*, int64_t, int64_t, float*);
template void activate_rows_avx512(const ExpertsConfig&, const float*, int64_t, const float*, int64_t, int64_t, bf16*);

}  // namespace moekit::cpu::avx512

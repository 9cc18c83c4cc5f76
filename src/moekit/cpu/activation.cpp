#include "moekit/cpu/activation.h"

#include "moekit/cpu/activation_math.h"
#include "moekit/cpu/gemv.h"

namespace moekit::cpu {

template <typename Out>
void apply_activation(const ExpertsConfig& c, const float* gate, int64_t gate_stride, const float* up,
                      int64_t up_stride, int64_t n, Out* h) {
  static const bool vector = gemv_uses_avx512();
  if (vector)
    avx512::activate_rows_avx512(c, gate, gate_stride, up, up_stride, n, h);
  else
    portable::activate_rows(c, gate, gate_stride, up, up_stride, n, h);
}

template void apply_activation(const ExpertsConfig&, const float*, int64_t, const float*, int64_t, int64_t, float*);
template void apply_activation(const ExpertsConfig&, const float*, int64_t, const float*, int64_t, int64_t, bf16*);

}  // namespace moekit::cpu

#include "moekit/cpu/activation.h"

#include "moekit/cpu/activation_math.h"
#include "moekit/cpu/gemv.h"

namespace moekit::cpu {
namespace {

template <typename Out>
void dispatch(const ExpertsConfig& c, const float* gate, int64_t gate_stride, const float* up, int64_t up_stride,
              int64_t n, Out* h) {
  static const bool vector = gemv_uses_avx512();
  if (vector)
    avx512::activate_rows_avx512(c, gate, gate_stride, up, up_stride, n, h);
  else
    portable::activate_rows(c, gate, gate_stride, up, up_stride, n, h);
}

}  // namespace

void apply_activation(const ExpertsConfig& c, const float* gate, int64_t gate_stride, const float* up,
                      int64_t up_stride, int64_t n, float* h) {
  dispatch(c, gate, gate_stride, up, up_stride, n, h);
}

void apply_activation(const ExpertsConfig& c, const float* gate, int64_t gate_stride, const float* up,
                      int64_t up_stride, int64_t n, bf16* h) {
  dispatch(c, gate, gate_stride, up, up_stride, n, h);
}

}  // namespace moekit::cpu

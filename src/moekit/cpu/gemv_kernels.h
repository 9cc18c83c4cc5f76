// The two builds of the gemv kernels: portable (gemv.cpp) and AVX-512 (gemv_avx512.cpp, compiled
// for that ISA). gemv.cpp dispatches between them; nothing else includes this header.
#pragma once

#include <cstdint>

#include "moekit/dtype.h"

// Instantiates gemv_rows and gemv_cols of the enclosing namespace for every weight type.
#define MOEKIT_INSTANTIATE_GEMV_KERNELS                                                         \
  template void gemv_rows<float>(const float*, int64_t, const float*, float*, int64_t, int64_t); \
  template void gemv_cols<float>(const float*, int64_t, const float*, float*, int64_t, int64_t); \
  template void gemv_rows<f16>(const f16*, int64_t, const float*, float*, int64_t, int64_t);     \
  template void gemv_cols<f16>(const f16*, int64_t, const float*, float*, int64_t, int64_t);     \
  template void gemv_rows<bf16>(const bf16*, int64_t, const float*, float*, int64_t, int64_t);   \
  template void gemv_cols<bf16>(const bf16*, int64_t, const float*, float*, int64_t, int64_t);

namespace moekit::cpu::avx512 {
template <typename W>
void gemv_rows(const W* w, int64_t ldw, const float* x, float* y, int64_t n_rows, int64_t k_len);
template <typename W>
void gemv_cols(const W* w, int64_t ldw, const float* x, float* y, int64_t n_cols, int64_t k_len);
}  // namespace moekit::cpu::avx512

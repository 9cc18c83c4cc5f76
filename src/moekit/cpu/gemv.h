// Matrix-vector products that read the weights where they are (no packing, no copies), for products
// with one activation row per weight pass: the (token, expert) pairs of batched_mm. The AVX-512 build
// of these kernels is chosen at run time where the CPU has it; the portable one otherwise.
#pragma once

#include <cstdint>

#include "moekit/dtype.h"

namespace moekit::cpu {

// y[n] = sum_k x[k] * w[n * ldw + k] for n in [0, n_rows): weight rows contiguous along k.
// w is float, f16 or bf16; x and y are float.
template <typename W>
void gemv_rows(const W* w, int64_t ldw, const float* x, float* y, int64_t n_rows, int64_t k_len);

// y[n] = sum_k x[k] * w[k * ldw + n] for n in [0, n_cols): weight rows contiguous along n.
template <typename W>
void gemv_cols(const W* w, int64_t ldw, const float* x, float* y, int64_t n_cols, int64_t k_len);

// Whether the AVX-512 kernels are in use on this machine (for reports).
bool gemv_uses_avx512();

}  // namespace moekit::cpu

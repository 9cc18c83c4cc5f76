#include "moekit/cpu/gemv.h"

#include "moekit/cpu/gemv_kernels.h"

namespace moekit::cpu {
namespace {

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  return has;
}

template <typename W>
void portable_gemv_rows(const W* w, int64_t ldw, const float* x, float* y, int64_t n_rows, int64_t k_len) {
  for (int64_t n = 0; n < n_rows; ++n) {
    const W* row = w + n * ldw;
    float acc = 0;
    for (int64_t k = 0; k < k_len; ++k) acc += to_float(row[k]) * x[k];
    y[n] = acc;
  }
}

template <typename W>
void portable_gemv_cols(const W* w, int64_t ldw, const float* x, float* y, int64_t n_cols, int64_t k_len) {
  for (int64_t n = 0; n < n_cols; ++n) y[n] = 0;
  for (int64_t k = 0; k < k_len; ++k) {
    const W* row = w + k * ldw;
    const float xk = x[k];
    for (int64_t n = 0; n < n_cols; ++n) y[n] += to_float(row[n]) * xk;
  }
}

}  // namespace

bool gemv_uses_avx512() {
  return cpu_has_avx512();
}

template <typename W>
void gemv_rows(const W* w, int64_t ldw, const float* x, float* y, int64_t n_rows, int64_t k_len) {
  if (cpu_has_avx512())
    avx512::gemv_rows(w, ldw, x, y, n_rows, k_len);
  else
    portable_gemv_rows(w, ldw, x, y, n_rows, k_len);
}

template <typename W>
void gemv_cols(const W* w, int64_t ldw, const float* x, float* y, int64_t n_cols, int64_t k_len) {
  if (cpu_has_avx512())
    avx512::gemv_cols(w, ldw, x, y, n_cols, k_len);
  else
    portable_gemv_cols(w, ldw, x, y, n_cols, k_len);
}

MOEKIT_INSTANTIATE_GEMV_KERNELS

}  // namespace moekit::cpu

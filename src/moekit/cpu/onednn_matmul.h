// oneDNN matrix products for the CPU backends. Kernel layer: raw pointers and sizes in.
#pragma once

#include <cstdint>
#include <memory>

#include "moekit/dtype.h"

namespace moekit::cpu {

// The dtype oneDNN multiplies in: bf16 for bf16 problems; f32 for f32 and f16 problems (oneDNN has
// no f16 matmul on CPUs without AVX512-FP16, and f32 keeps f16's precision).
enum class GemmDType : uint8_t { f32, bf16 };
GemmDType gemm_dtype_for(DType activation_dtype);
std::size_t gemm_dtype_size(GemmDType dtype);

// A weight matrix W [K, N] (in features x out features) packed once into oneDNN's blocked layout,
// then multiplied by activation blocks of any number of rows.
class PackedWeights {
 public:
  // rows_nk: W transposed, N rows of K contiguous values in the gemm dtype (what the caller gathers
  // from the checkpoint layout); it is copied, not kept.
  PackedWeights(const void* rows_nk, int64_t n, int64_t k, GemmDType dtype);
  ~PackedWeights();
  PackedWeights(const PackedWeights&) = delete;
  PackedWeights& operator=(const PackedWeights&) = delete;

  // c [m, N] (float, row stride ldc) = a [m, K] (gemm dtype, row stride lda) @ W. Runs on the
  // calling thread when called inside an OpenMP parallel region, else on all threads.
  void multiply(const void* a, int64_t lda, int64_t m, float* c, int64_t ldc) const;

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  std::size_t bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t n_, k_;
  GemmDType dtype_;
};

// c [m, n] (float, ldc) = a [m, k] (gemm dtype, lda) @ W where W (k, n) is read in place at
// w[k * stride_k + n * stride_n] in the gemm dtype; one of the strides must be 1.
void matmul_strided(const void* a, int64_t lda, int64_t m, const void* w, int64_t k, int64_t n, int64_t stride_k,
                    int64_t stride_n, GemmDType dtype, float* c, int64_t ldc);

}  // namespace moekit::cpu

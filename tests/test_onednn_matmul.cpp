// The oneDNN products of the CPU backends in bf16, against a double-precision sum of the same bf16
// values: on CPUs with AVX-512 oneDNN multiplies bf16 itself; on AVX2-only CPUs (where it has no bf16
// product) the operands are widened to f32, which must give the same values up to the order of the sums.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "moekit/cpu/onednn_matmul.h"

using namespace moekit;
using namespace moekit::cpu;

namespace {

std::vector<bf16> random_bf16(std::size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<bf16> out(count);
  for (auto& v : out) v = from_float<bf16>(u(rng));
  return out;
}

// Each c[i][j] within 1e-5 of sum_k a[i][k] * w(k, j) taken in double; w(k, j) = w[k * stride_k + j * stride_n].
void expect_product(const std::vector<bf16>& a, int64_t lda, int64_t m, const std::vector<bf16>& w, int64_t k, int64_t n,
                    int64_t stride_k, int64_t stride_n, const std::vector<float>& c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t x = 0; x < k; ++x)
        sum += static_cast<double>(to_float(a[static_cast<std::size_t>(i * lda + x)])) *
               to_float(w[static_cast<std::size_t>(x * stride_k + j * stride_n)]);
      ASSERT_NEAR(c[static_cast<std::size_t>(i * ldc + j)], sum, 1e-5 * std::max(1.0, std::abs(sum)))
          << "row " << i << " column " << j;
    }
}

TEST(OnednnMatmul, PackedBf16ProductMatchesTheSumsOfItsValues) {
  const int64_t m = 7, n = 33, k = 70, lda = 75, ldc = 40;
  const auto rows_nk = random_bf16(static_cast<std::size_t>(n * k), 1);  // W^T: N rows of K
  const auto a = random_bf16(static_cast<std::size_t>(m * lda), 2);
  PackedWeights packed(rows_nk.data(), n, k, GemmDType::bf16);
  std::vector<float> c(static_cast<std::size_t>(m * ldc), NAN);
  packed.multiply(a.data(), lda, m, c.data(), ldc);
  expect_product(a, lda, m, rows_nk, k, n, 1, k, c, ldc);
}

TEST(OnednnMatmul, StridedBf16ProductMatchesTheSumsOfItsValuesInBothLayouts) {
  const int64_t m = 5, n = 19, k = 37;
  const auto a = random_bf16(static_cast<std::size_t>(m * k), 3);
  const auto w = random_bf16(static_cast<std::size_t>(n * k), 4);
  for (const auto& [stride_k, stride_n] : {std::pair<int64_t, int64_t>{1, k}, {n, 1}}) {
    std::vector<float> c(static_cast<std::size_t>(m * n), NAN);
    matmul_strided(a.data(), k, m, w.data(), k, n, stride_k, stride_n, GemmDType::bf16, c.data(), n);
    expect_product(a, k, m, w, k, n, stride_k, stride_n, c, n);
  }
}

}  // namespace

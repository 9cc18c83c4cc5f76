// The CPU activation rows (cpu/activation.h): the AVX-512 build of activation_math.h against the portable
// build and against float64, for every activation of the contract, gated or not, unit and interleaved
// strides, float and bf16 outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "moekit/cpu/activation.h"
#include "moekit/cpu/activation_math.h"
#include "moekit/cpu/gemv.h"
#include "moekit/dtype.h"
#include "moekit/experts.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

std::vector<ExpertsConfig> configs() {
  std::vector<ExpertsConfig> out;
  for (Activation act :
       {Activation::silu, Activation::gelu, Activation::gelu_pytorch_tanh, Activation::relu, Activation::relu2})
    for (bool gated : {true, false}) {
      ExpertsConfig c;
      c.activation = act;
      c.has_gate = gated;
      out.push_back(c);
    }
  ExpertsConfig gptoss;
  gptoss.swiglu_limit = 7.0f;
  out.push_back(gptoss);
  return out;
}

TEST(CpuActivation, Avx512MatchesPortableAndFloat64) {
  if (!cpu::gemv_uses_avx512()) GTEST_SKIP() << "this CPU has no AVX-512: apply_activation runs the portable loop";
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> pool = {0.0f, -0.0f, 1e-30f, -1e-30f, 0.5f, -0.5f, 20.0f, -20.0f, 80.0f, -80.0f, 95.0f, -95.0f};
  for (int i = 0; i < 300; ++i) pool.push_back(normal(rng));
  for (const ExpertsConfig& c : configs()) {
    for (int64_t stride : {1, 2}) {
      for (int64_t n : {1, 15, 16, 17, 333}) {
        SCOPED_TRACE(testing::Message() << c.describe() << ", stride " << stride << ", n " << n);
        // gate and up values at stride `stride` (interleaved rows when 2: g0, u0, g1, u1, ...).
        std::vector<float> rows(static_cast<std::size_t>(2 * n * stride));
        for (auto& v : rows) v = pool[rng() % pool.size()];
        const float* gate = rows.data();
        const float* up = stride == 1 ? rows.data() + n : rows.data() + 1;
        std::vector<float> vector_out(static_cast<std::size_t>(n)), portable_out(vector_out.size());
        std::vector<bf16> vector_bf16(vector_out.size()), portable_bf16(vector_out.size());
        cpu::avx512::activate_rows_avx512(c, gate, stride, up, stride, n, vector_out.data());
        cpu::portable::activate_rows(c, gate, stride, up, stride, n, portable_out.data());
        cpu::avx512::activate_rows_avx512(c, gate, stride, up, stride, n, vector_bf16.data());
        cpu::portable::activate_rows(c, gate, stride, up, stride, n, portable_bf16.data());
        for (int64_t j = 0; j < n; ++j) {
          const auto k = static_cast<std::size_t>(j);
          const double g = gate[j * stride], u = up[j * stride], want = reference_activation(c, g, u);
          // Both builds within the approximations' error of float64 (relative 1e-6 of the value, and of the
          // gate and up magnitudes for the cancellation near zero)...
          const double bound = 2e-6 * (std::fabs(want) + std::fabs(g * u) + 1e-30) + 1e-6;
          ASSERT_NEAR(vector_out[k], want, bound) << "g " << g << " u " << u;
          ASSERT_NEAR(portable_out[k], want, bound) << "g " << g << " u " << u;
          // ...and close to each other: a few float ulps, more where gelu's 1 + erf cancels (the two builds
          // may contract different products into FMAs).
          ASSERT_NEAR(vector_out[k], portable_out[k], 1e-6 * (std::fabs(portable_out[k]) + std::fabs(g * u)) + 1e-37)
              << "g " << g;
          // bf16 outputs: the float result rounded, so at most one bf16 step apart.
          ASSERT_NEAR(to_float(vector_bf16[k]), to_float(portable_bf16[k]), std::fabs(portable_out[k]) / 128 + 1e-37);
        }
      }
    }
  }
}

TEST(CpuActivation, EntryPointRunsTheSameRows) {
  // apply_activation (what the backends call) gives what the build it picks gives.
  ExpertsConfig c;
  std::vector<float> gate = {-3.0f, -0.25f, 0.0f, 0.7f, 4.0f}, up = {1.5f, -2.0f, 3.0f, 0.5f, -1.0f};
  std::vector<float> out(gate.size()), want(gate.size());
  cpu::apply_activation(c, gate.data(), 1, up.data(), 1, 5, out.data());
  if (cpu::gemv_uses_avx512())
    cpu::avx512::activate_rows_avx512(c, gate.data(), 1, up.data(), 1, 5, want.data());
  else
    cpu::portable::activate_rows(c, gate.data(), 1, up.data(), 1, 5, want.data());
  for (std::size_t j = 0; j < gate.size(); ++j) {
    EXPECT_EQ(out[j], want[j]);
    EXPECT_NEAR(out[j], reference_activation(c, gate[j], up[j]), 1e-5);
  }
}

}  // namespace
}  // namespace moekit

// The activations of the contract in float, written so that loops over them vectorise (no libm
// calls in the hot loop): exp by range reduction and a degree-6 polynomial (relative error ~1e-7),
// erf by Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7). Both are far below the f32 tolerance.
//
// Compiled twice, into two namespaces: moekit::cpu::portable (the default, for the build's baseline
// instruction set) and moekit::cpu::avx512 (activation_avx512.cpp defines MOEKIT_ACTIVATION_ISA first and is
// built with AVX-512), so that the two copies of these inline functions never meet at link time. Callers use
// cpu::apply_activation (activation.h), which picks one at run time.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "moekit/experts.h"

// A file built with per-file AVX-512 flags must not include this header without its own namespace: its
// copies of the portable functions could then be the ones the linker keeps.
#ifndef MOEKIT_ACTIVATION_ISA
#define MOEKIT_ACTIVATION_ISA portable
#endif

namespace moekit::cpu::MOEKIT_ACTIVATION_ISA {

inline float exp_approx(float x) {
  x = std::clamp(x, -87.0f, 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  // x - n * ln2 in two steps so that r keeps its low bits.
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return p * scale;
}

inline float sigmoid_approx(float x) {
  return 1.0f / (1.0f + exp_approx(-x));
}

inline float erf_approx(float x) {
  const float a = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  const float poly =
      ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
  const float e = 1.0f - poly * exp_approx(-a * a);
  return std::copysign(e, x);
}

inline float tanh_approx(float x) {
  return 1.0f - 2.0f / (exp_approx(2.0f * x) + 1.0f);
}

// h[j] = act(gate[j * gate_stride]) * up[j * up_stride] for gated experts (up ignored when not gated),
// or the GPT-OSS clamped SwiGLU when config.swiglu_limit is set. Writes n values to h. Unit strides (gate and
// up rows side by side) get a loop of their own, which vectorises with plain loads instead of gathers.
template <typename Out>
void activate_rows(const ExpertsConfig& c, const float* gate, int64_t gate_stride, const float* up, int64_t up_stride,
                   int64_t n, Out* h) {
  const bool gated = c.has_gate;
  const bool unit = gate_stride == 1 && (up_stride == 1 || !gated);
  auto run = [&](auto act) {
    if (unit) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float a = act(gate[j]);
        h[j] = from_float<Out>(gated ? a * up[j] : a);
      }
      return;
    }
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float g = gate[j * gate_stride];
      const float a = act(g);
      h[j] = from_float<Out>(gated ? a * up[j * up_stride] : a);
    }
  };
  if (c.swiglu_limit) {
    const float limit = *c.swiglu_limit, alpha = c.swiglu_alpha;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float g = std::min(gate[j * gate_stride], limit);
      const float u = std::clamp(up[j * up_stride], -limit, limit);
      h[j] = from_float<Out>((u + 1.0f) * g * sigmoid_approx(alpha * g));
    }
    return;
  }
  switch (c.activation) {
    case Activation::silu:
      run([](float g) { return g * sigmoid_approx(g); });
      break;
    case Activation::gelu:
      run([](float g) { return 0.5f * g * (1.0f + erf_approx(g * 0.70710678118654752f)); });
      break;
    case Activation::gelu_pytorch_tanh:
      run([](float g) { return 0.5f * g * (1.0f + tanh_approx(0.79788456080286536f * (g + 0.044715f * g * g * g))); });
      break;
    case Activation::relu:
      run([](float g) { return g > 0.0f ? g : 0.0f; });
      break;
    case Activation::relu2:
      run([](float g) { return g > 0.0f ? g * g : 0.0f; });
      break;
  }
}

}  // namespace moekit::cpu::MOEKIT_ACTIVATION_ISA

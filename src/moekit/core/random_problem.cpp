#include "moekit/testing/random_problem.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "moekit/quantization.h"

namespace moekit {
namespace {

// Counter-based: element i gets a value hashed from (stream, i), so that filling runs on all threads
// and the values do not depend on the thread count (model-sized weights are tens of GB).
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void fill_uniform(Tensor& t, std::mt19937_64& rng, float scale) {
  moekit::fill_uniform(t, scale, rng());
}

}  // namespace

void fill_uniform(Tensor& t, float scale, uint64_t stream) {
  MOEKIT_CHECK(t.device().is_cpu() && t.is_contiguous(), "fill_uniform: expected a contiguous CPU tensor, got ",
               t.describe());
  const int64_t n = t.numel();
  visit_float_dtype(t.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(t.data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t bits = mix(stream + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1));
      const float unit = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
      p[i] = from_float<T>((2.0f * unit - 1.0f) * scale);
    }
  });
}

void vary_block_magnitudes(Tensor& w) {
  MOEKIT_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 3,
               "vary_block_magnitudes: expected contiguous CPU weights [E, rows, cols], got ", w.describe());
  const int64_t rows = w.size(1), cols = w.size(2), matrix_rows = w.size(0) * rows;
  visit_float_dtype(w.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(w.data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < matrix_rows; ++i) {  // row i % rows of expert i / rows
      const int64_t first = i / rows + i % rows / 128;
      for (int64_t c = 0; c < cols; ++c) {
        const float factor = std::ldexp(1.0f, static_cast<int>((first + 2 * (c / 128)) % 4) - 1);
        p[i * cols + c] = from_float<T>(to_float(p[i * cols + c]) * factor);
      }
    }
  });
}

void redraw_routing(ExpertsProblem& problem, const RandomProblemOptions& o, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 17);
  const int64_t T = o.tokens, K = o.top_k, E = o.experts;
  const int64_t pool = o.used_experts > 0 ? std::min(o.used_experts, E) : E;

  std::vector<int64_t> ids(static_cast<std::size_t>(T * K));
  std::vector<int64_t> candidates(static_cast<std::size_t>(pool));
  std::bernoulli_distribution sentinel(o.sentinel_fraction);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(candidates.begin(), candidates.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      int64_t id;
      if (o.all_to_one_expert) {
        id = 0;
      } else if (k < pool) {  // distinct experts per token, as a top-k router picks
        std::uniform_int_distribution<int64_t> pick(k, pool - 1);
        std::swap(candidates[static_cast<std::size_t>(k)], candidates[static_cast<std::size_t>(pick(rng))]);
        id = candidates[static_cast<std::size_t>(k)];
      } else {
        id = std::uniform_int_distribution<int64_t>(0, pool - 1)(rng);
      }
      if (o.sentinel_fraction > 0 && sentinel(rng)) id = E + std::uniform_int_distribution<int64_t>(0, 3)(rng);
      ids[static_cast<std::size_t>(t * K + k)] = id;
    }
  }
  problem.top_k_index = Tensor::empty({T, K}, o.index_dtype);
  visit_index_dtype(o.index_dtype, [&](auto tag) {
    using I = typename decltype(tag)::type;
    I* p = static_cast<I*>(problem.top_k_index.data());
    for (std::size_t i = 0; i < ids.size(); ++i) p[i] = static_cast<I>(ids[i]);
  });
  // Softmax-like positive weights that sum to one per token.
  problem.top_k_weights = Tensor::empty({T, K}, o.weights_dtype);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  std::vector<float> w(static_cast<std::size_t>(K));
  visit_float_dtype(o.weights_dtype, [&](auto tag) {
    using W = typename decltype(tag)::type;
    W* p = static_cast<W*>(problem.top_k_weights.data());
    for (int64_t t = 0; t < T; ++t) {
      float sum = 0;
      for (auto& v : w) sum += (v = u(rng));
      for (int64_t k = 0; k < K; ++k) p[t * K + k] = from_float<W>(w[static_cast<std::size_t>(k)] / sum);
    }
  });
}

ExpertsProblem make_random_problem(const RandomProblemOptions& o) {
  MOEKIT_CHECK(o.tokens >= 0 && o.hidden > 0 && o.intermediate > 0 && o.experts > 0 && o.top_k > 0,
               "make_random_problem: bad sizes T=", o.tokens, " H=", o.hidden, " I=", o.intermediate, " E=", o.experts,
               " K=", o.top_k);
  std::mt19937_64 rng(o.seed);
  const ExpertsConfig& c = o.config;
  const int64_t T = o.tokens, H = o.hidden, I = o.intermediate, E = o.experts;
  const int64_t N = c.has_gate ? 2 * I : I;
  ExpertsProblem p;
  p.config = c;
  p.hidden_states = Tensor::empty({T, H}, o.dtype);
  fill_uniform(p.hidden_states, rng, o.input_scale);
  p.gate_up_proj = c.is_transposed ? Tensor::empty({E, H, N}, o.dtype) : Tensor::empty({E, N, H}, o.dtype);
  fill_uniform(p.gate_up_proj, rng, 1.0f / std::sqrt(static_cast<float>(H)));
  p.down_proj = c.is_transposed ? Tensor::empty({E, I, H}, o.dtype) : Tensor::empty({E, H, I}, o.dtype);
  fill_uniform(p.down_proj, rng, 1.0f / std::sqrt(static_cast<float>(I)));
  if (c.quantization.quantized()) {
    MOEKIT_CHECK(!c.is_transposed, "make_random_problem: quantised weights are untransposed; got ", c.describe());
    const DType scale_dtype = c.quantization.weights == WeightFormat::fp4_e2m1 ? DType::ue8m0 : o.scale_dtype;
    vary_block_magnitudes(p.gate_up_proj);
    vary_block_magnitudes(p.down_proj);
    QuantizedWeights up = quantize_weights(p.gate_up_proj, c.quantization.weights, scale_dtype);
    QuantizedWeights down = quantize_weights(p.down_proj, c.quantization.weights, scale_dtype);
    p.gate_up_proj = up.weights;
    p.gate_up_proj_scale_inv = up.scale_inv;
    p.down_proj = down.weights;
    p.down_proj_scale_inv = down.scale_inv;
  }
  if (c.has_bias) {
    p.gate_up_proj_bias = Tensor::empty({E, N}, o.dtype);
    fill_uniform(p.gate_up_proj_bias, rng, 0.5f);
    p.down_proj_bias = Tensor::empty({E, H}, o.dtype);
    fill_uniform(p.down_proj_bias, rng, 0.5f);
  }
  redraw_routing(p, o, o.seed);
  return p;
}

}  // namespace moekit

// The float64 reference: a direct, unoptimised reading of the contract. Slow by design; clarity is
// what makes it an oracle.
#include <cmath>

#include "moekit/reference.h"

namespace moekit {

double reference_activation(const ExpertsConfig& c, double gate, double up) {
  if (c.swiglu_limit) {
    const double limit = *c.swiglu_limit;
    const double g = std::min(gate, limit);
    const double u = std::clamp(up, -limit, limit);
    return (u + 1.0) * g / (1.0 + std::exp(-static_cast<double>(c.swiglu_alpha) * g));
  }
  double a = 0;
  switch (c.activation) {
    case Activation::silu:
      a = gate / (1.0 + std::exp(-gate));
      break;
    case Activation::gelu:
      a = 0.5 * gate * (1.0 + std::erf(gate / std::sqrt(2.0)));
      break;
    case Activation::gelu_pytorch_tanh: {
      const double k = std::sqrt(2.0 / M_PI);
      a = 0.5 * gate * (1.0 + std::tanh(k * (gate + 0.044715 * gate * gate * gate)));
      break;
    }
    case Activation::relu:
      a = gate > 0 ? gate : 0.0;
      break;
    case Activation::relu2:
      a = gate > 0 ? gate * gate : 0.0;
      break;
  }
  return c.has_gate ? a * up : a;
}

namespace {

std::vector<double> to_doubles(const Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (!t.defined()) return out;
  Tensor c = t.contiguous();
  if (c.dtype() == DType::i32 || c.dtype() == DType::i64) {
    visit_index_dtype(c.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* p = static_cast<const T*>(c.data());
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(p[i]);
    });
  } else {
    visit_float_dtype(c.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* p = static_cast<const T*>(c.data());
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(to_float(p[i]));
    });
  }
  return out;
}

}  // namespace

std::vector<double> experts_reference(const ExpertsProblem& p) {
  const ExpertsShape s = validate(p);
  check_routing_ids(p);
  const ExpertsConfig& c = p.config;
  MOEKIT_CHECK(p.hidden_states.device().is_cpu(), "the reference runs on CPU tensors, got ",
               p.hidden_states.describe());
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, E = s.experts, K = s.top_k;
  const int64_t N = c.has_gate ? 2 * I : I;
  const auto x = to_doubles(p.hidden_states);
  // Ids stay integers: a sentinel near INT64_MAX does not survive a trip through double.
  std::vector<int64_t> ids(static_cast<std::size_t>(T * K));
  visit_index_dtype(p.top_k_index.dtype(), [&](auto tag) {
    using Id = typename decltype(tag)::type;
    const Id* src = static_cast<const Id*>(p.top_k_index.data());  // contiguous: validated
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(src[i]);
  });
  const auto w = to_doubles(p.top_k_weights);
  const auto w1 = to_doubles(p.gate_up_proj);
  const auto w2 = to_doubles(p.down_proj);
  const auto b1 = c.has_bias ? to_doubles(p.gate_up_proj_bias) : std::vector<double>(E * N, 0.0);
  const auto b2 = c.has_bias ? to_doubles(p.down_proj_bias) : std::vector<double>(E * H, 0.0);

  // Element n (output row) , h of the first projection of expert e, whatever the layout.
  auto up_weight = [&](int64_t e, int64_t n, int64_t h) {
    return c.is_transposed ? w1[(e * H + h) * N + n] : w1[(e * N + n) * H + h];
  };
  auto down_weight = [&](int64_t e, int64_t h, int64_t i) {
    return c.is_transposed ? w2[(e * I + i) * H + h] : w2[(e * H + h) * I + i];
  };
  // Rows of the gate and up halves for intermediate column j.
  auto gate_row = [&](int64_t j) { return c.is_concatenated ? j : 2 * j; };
  auto up_row = [&](int64_t j) { return c.is_concatenated ? I + j : 2 * j + 1; };

  std::vector<double> out(static_cast<std::size_t>(T * H), 0.0);
  std::vector<double> projected(static_cast<std::size_t>(N));
  std::vector<double> hidden(static_cast<std::size_t>(I));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ids[static_cast<std::size_t>(t * K + k)];
      if (e >= E) continue;  // sentinel
      for (int64_t n = 0; n < N; ++n) {
        double acc = b1[e * N + n];
        for (int64_t h = 0; h < H; ++h) acc += up_weight(e, n, h) * x[t * H + h];
        projected[n] = acc;
      }
      for (int64_t j = 0; j < I; ++j)
        hidden[j] = c.has_gate ? reference_activation(c, projected[gate_row(j)], projected[up_row(j)])
                               : reference_activation(c, projected[j], 0.0);
      for (int64_t h = 0; h < H; ++h) {
        double acc = b2[e * H + h];
        for (int64_t j = 0; j < I; ++j) acc += down_weight(e, h, j) * hidden[j];
        out[t * H + h] += w[t * K + k] * acc;
      }
    }
  }
  return out;
}

}  // namespace moekit

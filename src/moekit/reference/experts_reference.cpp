// The float64 reference: a direct, unoptimised reading of the contract. Slow by design; clarity is
// what makes it an oracle.
//
// Quantised problems (DESIGN §3), where rounding happens and where it does not:
// - weights: q * scale_inv, each exact in double (e4m3/e2m1 codes and f32/ue8m0 scales are all floats);
// - the up projection's input: each token's row, converted to float32 (exact from f32/f16/bf16), goes
//   through quantize_activations (quantization.h) itself, so the float32 scale amax / 448 (a power of two
//   with ue8m0 weight scales), the float32 division and the e4m3 rounding are bit for bit the backends';
//   the products then use code * scale in double;
// - the down projection's input: the activated intermediate, computed in double, rounded to float32 (the
//   backends hold it in float32) and quantised the same way per 128-wide group of I;
// - everything else (dot products, biases, activation, routing weight, sum over k) in double, as for
//   unquantised problems. The one rounding left to the backends is their own arithmetic.
#include <cmath>

#include "moekit/quantization.h"
#include "moekit/testing/reference.h"

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

ActivationDerivatives reference_activation_derivatives(const ExpertsConfig& c, double gate, double up) {
  auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  if (c.swiglu_limit) {
    const double limit = *c.swiglu_limit, alpha = c.swiglu_alpha;
    const double g = std::min(gate, limit);
    const double u = std::clamp(up, -limit, limit);
    const double s = sigmoid(alpha * g);
    const double d_g = (u + 1.0) * (s + alpha * g * s * (1.0 - s));
    return {gate <= limit ? d_g : 0.0, std::abs(up) <= limit ? g * s : 0.0};
  }
  double a = 0, da = 0;  // the activation of the gate value and its derivative
  const double g = gate;
  switch (c.activation) {
    case Activation::silu: {
      const double s = sigmoid(g);
      a = g * s;
      da = s * (1.0 + g * (1.0 - s));
      break;
    }
    case Activation::gelu: {
      const double cdf = 0.5 * (1.0 + std::erf(g / std::sqrt(2.0)));
      a = g * cdf;
      da = cdf + g * std::exp(-0.5 * g * g) / std::sqrt(2.0 * M_PI);
      break;
    }
    case Activation::gelu_pytorch_tanh: {
      const double k = std::sqrt(2.0 / M_PI);
      const double th = std::tanh(k * (g + 0.044715 * g * g * g));
      a = 0.5 * g * (1.0 + th);
      da = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * g * g);
      break;
    }
    case Activation::relu:
      a = g > 0 ? g : 0.0;
      da = g > 0 ? 1.0 : 0.0;
      break;
    case Activation::relu2:
      a = g > 0 ? g * g : 0.0;
      da = g > 0 ? 2.0 * g : 0.0;
      break;
  }
  if (!c.has_gate) return {da, 0.0};
  return {da * up, a};
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
    visit_dtype_among<float, f16, bf16, f8_e4m3, ue8m0>(c.dtype(), "a dtype with one value per element", [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* p = static_cast<const T*>(c.data());
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(to_float(p[i]));
    });
  }
  return out;
}

// Weights q * scale_inv in double, [E, N, K] row-major (K logical, FP4 pairs unpacked).
std::vector<double> dequantized_doubles(const Tensor& q, const Tensor& scale_inv, WeightFormat format) {
  const int64_t E = q.size(0), N = q.size(1), K = q.size(2) * dtype_values_per_element(q.dtype());
  const Shape ss = weight_scale_shape(format, E, N, K);
  const std::vector<double> scales = to_doubles(scale_inv);  // f32 or ue8m0: both exact in double
  std::vector<double> out(static_cast<std::size_t>(E * N * K));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = (e * N + n) * K + k;
        double value = 0, scale = 0;
        if (format == WeightFormat::fp8_e4m3) {
          value = to_float(static_cast<const f8_e4m3*>(q.data())[i]);
          scale = scales[static_cast<std::size_t>((e * ss[1] + n / kFp8BlockSize) * ss[2] + k / kFp8BlockSize)];
        } else {
          const uint8_t pair = static_cast<const f4_e2m1x2*>(q.data())[i / 2].bits;
          value = e2m1_to_float(k % 2 ? pair >> 4 : pair);
          scale = scales[static_cast<std::size_t>((e * N + n) * ss[2] + k / kFp4BlockSize)];
        }
        out[static_cast<std::size_t>(i)] = value * scale;
      }
  return out;
}

// values[0, n) replaced by what the dynamic activation quantisation makes of them: code * scale in double.
void quantize_in_double(double* values, int64_t n, bool power_of_two_scales) {
  std::vector<float> x(static_cast<std::size_t>(n)), unused(static_cast<std::size_t>(n));
  std::vector<f8_e4m3> codes(static_cast<std::size_t>(n));
  std::vector<float> scales(static_cast<std::size_t>((n + kActivationGroupSize - 1) / kActivationGroupSize));
  for (int64_t i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = static_cast<float>(values[i]);
  quantize_activations(x.data(), n, power_of_two_scales, unused.data(), codes.data(), scales.data());
  for (int64_t i = 0; i < n; ++i)
    values[i] = static_cast<double>(to_float(codes[static_cast<std::size_t>(i)])) *
                static_cast<double>(scales[static_cast<std::size_t>(i / kActivationGroupSize)]);
}

}  // namespace

namespace {

// A problem's inputs in double, with the layout resolved once: what the forward and the backward read.
struct ReferenceInputs {
  ExpertsConfig c;
  int64_t T = 0, H = 0, I = 0, E = 0, K = 0, N = 0;
  bool power_of_two = false;
  std::vector<double> x, w, w1, w2, b1, b2;
  std::vector<int64_t> ids;

  explicit ReferenceInputs(const ExpertsProblem& p) : c(p.config) {
    const ExpertsShape s = validate(p);
    check_routing_ids(p);
    MOEKIT_CHECK(p.hidden_states.device().is_cpu(), "the reference runs on CPU tensors, got ",
                 p.hidden_states.describe());
    T = s.tokens, H = s.hidden, I = s.intermediate, E = s.experts, K = s.top_k;
    N = c.has_gate ? 2 * I : I;
    const QuantizationConfig& q = c.quantization;
    MOEKIT_CHECK(!q.quantized() || q.activations == ActivationScheme::dynamic,
                 "the reference quantises activations dynamically; the static scheme is not supported (",
                 q.describe(), ")");
    // Activation scales are powers of two exactly when the weight scales are (ue8m0).
    power_of_two = q.quantized() && p.gate_up_proj_scale_inv.dtype() == DType::ue8m0;
    x = to_doubles(p.hidden_states);
    if (q.quantized())
      for (int64_t t = 0; t < T; ++t) quantize_in_double(x.data() + t * H, H, power_of_two);
    // Ids stay integers: a sentinel near INT64_MAX does not survive a trip through double.
    ids.resize(static_cast<std::size_t>(T * K));
    visit_index_dtype(p.top_k_index.dtype(), [&](auto tag) {
      using Id = typename decltype(tag)::type;
      const Id* src = static_cast<const Id*>(p.top_k_index.data());  // contiguous: validated
      for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(src[i]);
    });
    w = to_doubles(p.top_k_weights);
    w1 = q.quantized() ? dequantized_doubles(p.gate_up_proj, p.gate_up_proj_scale_inv, q.weights)
                       : to_doubles(p.gate_up_proj);
    w2 = q.quantized() ? dequantized_doubles(p.down_proj, p.down_proj_scale_inv, q.weights) : to_doubles(p.down_proj);
    b1 = c.has_bias ? to_doubles(p.gate_up_proj_bias) : std::vector<double>(static_cast<std::size_t>(E * N), 0.0);
    b2 = c.has_bias ? to_doubles(p.down_proj_bias) : std::vector<double>(static_cast<std::size_t>(E * H), 0.0);
  }

  bool quantized() const { return c.quantization.quantized(); }
  // Index of element (n output row, h) of the first projection of expert e, and (h, i) of the second,
  // whatever the layout.
  std::size_t up_at(int64_t e, int64_t n, int64_t h) const {
    return static_cast<std::size_t>(c.is_transposed ? (e * H + h) * N + n : (e * N + n) * H + h);
  }
  std::size_t down_at(int64_t e, int64_t h, int64_t i) const {
    return static_cast<std::size_t>(c.is_transposed ? (e * I + i) * H + h : (e * H + h) * I + i);
  }
  // Rows of the gate and up halves for intermediate column j.
  int64_t gate_row(int64_t j) const { return c.is_concatenated ? j : 2 * j; }
  int64_t up_row(int64_t j) const { return c.is_concatenated ? I + j : 2 * j + 1; }

  // The first projection of token t by expert e (bias added) into projected [N].
  void project_up(int64_t t, int64_t e, std::vector<double>& projected) const {
    for (int64_t n = 0; n < N; ++n) {
      double acc = b1[static_cast<std::size_t>(e * N + n)];
      for (int64_t h = 0; h < H; ++h) acc += w1[up_at(e, n, h)] * x[static_cast<std::size_t>(t * H + h)];
      projected[static_cast<std::size_t>(n)] = acc;
    }
  }
  double gate_of(const std::vector<double>& projected, int64_t j) const {
    return projected[static_cast<std::size_t>(c.has_gate ? gate_row(j) : j)];
  }
  double up_of(const std::vector<double>& projected, int64_t j) const {
    return c.has_gate ? projected[static_cast<std::size_t>(up_row(j))] : 0.0;
  }
};

}  // namespace

std::vector<double> experts_reference(const ExpertsProblem& p) {
  const ReferenceInputs in(p);
  const int64_t T = in.T, H = in.H, I = in.I, E = in.E, K = in.K, N = in.N;
  std::vector<double> out(static_cast<std::size_t>(T * H), 0.0);
  std::vector<double> projected(static_cast<std::size_t>(N));
  std::vector<double> hidden(static_cast<std::size_t>(I));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = in.ids[static_cast<std::size_t>(t * K + k)];
      if (e >= E) continue;  // sentinel
      in.project_up(t, e, projected);
      for (int64_t j = 0; j < I; ++j)
        hidden[static_cast<std::size_t>(j)] =
            reference_activation(in.c, in.gate_of(projected, j), in.up_of(projected, j));
      if (in.quantized()) quantize_in_double(hidden.data(), I, in.power_of_two);
      for (int64_t h = 0; h < H; ++h) {
        double acc = in.b2[static_cast<std::size_t>(e * H + h)];
        for (int64_t j = 0; j < I; ++j) acc += in.w2[in.down_at(e, h, j)] * hidden[static_cast<std::size_t>(j)];
        out[static_cast<std::size_t>(t * H + h)] += in.w[static_cast<std::size_t>(t * K + k)] * acc;
      }
    }
  }
  return out;
}

ReferenceGradients experts_reference_backward(const ExpertsProblem& p, const Tensor& grad_out) {
  const ReferenceInputs in(p);
  MOEKIT_CHECK(!in.quantized(), "the reference backward runs unquantised problems only (",
               in.c.quantization.describe(), ")");
  const int64_t T = in.T, H = in.H, I = in.I, E = in.E, K = in.K, N = in.N;
  MOEKIT_CHECK(grad_out.defined() && grad_out.device().is_cpu() && grad_out.shape() == Shape({T, H}),
               "grad_out must be a CPU tensor ", shape_string({T, H}), ", got ", grad_out.describe());
  const std::vector<double> d_out = to_doubles(grad_out);
  ReferenceGradients g;
  g.hidden_states.assign(static_cast<std::size_t>(T * H), 0.0);
  g.top_k_weights.assign(static_cast<std::size_t>(T * K), 0.0);
  g.gate_up_proj.assign(in.w1.size(), 0.0);
  g.down_proj.assign(in.w2.size(), 0.0);
  if (in.c.has_bias) {
    g.gate_up_proj_bias.assign(in.b1.size(), 0.0);
    g.down_proj_bias.assign(in.b2.size(), 0.0);
  }
  std::vector<double> projected(static_cast<std::size_t>(N)), hidden(static_cast<std::size_t>(I));
  std::vector<double> d_hidden(static_cast<std::size_t>(I)), d_projected(static_cast<std::size_t>(N));
  for (int64_t t = 0; t < T; ++t) {
    const double* dy = d_out.data() + t * H;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = in.ids[static_cast<std::size_t>(t * K + k)];
      if (e >= E) continue;  // sentinel: no contribution, zero routing-weight gradient
      const double weight = in.w[static_cast<std::size_t>(t * K + k)];
      in.project_up(t, e, projected);
      for (int64_t j = 0; j < I; ++j)
        hidden[static_cast<std::size_t>(j)] =
            reference_activation(in.c, in.gate_of(projected, j), in.up_of(projected, j));
      // d out / d w = the expert's output, bias included; the expert's output gets weight * grad_out.
      double d_weight = 0;
      for (int64_t h = 0; h < H; ++h) {
        double y = in.b2[static_cast<std::size_t>(e * H + h)];
        for (int64_t j = 0; j < I; ++j) y += in.w2[in.down_at(e, h, j)] * hidden[static_cast<std::size_t>(j)];
        d_weight += dy[h] * y;
      }
      g.top_k_weights[static_cast<std::size_t>(t * K + k)] = d_weight;
      std::fill(d_hidden.begin(), d_hidden.end(), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        const double d = weight * dy[h];
        if (in.c.has_bias) g.down_proj_bias[static_cast<std::size_t>(e * H + h)] += d;
        for (int64_t j = 0; j < I; ++j) {
          g.down_proj[in.down_at(e, h, j)] += d * hidden[static_cast<std::size_t>(j)];
          d_hidden[static_cast<std::size_t>(j)] += d * in.w2[in.down_at(e, h, j)];
        }
      }
      for (int64_t j = 0; j < I; ++j) {
        const ActivationDerivatives da =
            reference_activation_derivatives(in.c, in.gate_of(projected, j), in.up_of(projected, j));
        const double dh = d_hidden[static_cast<std::size_t>(j)];
        if (in.c.has_gate) {
          d_projected[static_cast<std::size_t>(in.gate_row(j))] = dh * da.gate;
          d_projected[static_cast<std::size_t>(in.up_row(j))] = dh * da.up;
        } else {
          d_projected[static_cast<std::size_t>(j)] = dh * da.gate;
        }
      }
      for (int64_t n = 0; n < N; ++n) {
        const double d = d_projected[static_cast<std::size_t>(n)];
        if (in.c.has_bias) g.gate_up_proj_bias[static_cast<std::size_t>(e * N + n)] += d;
        for (int64_t h = 0; h < H; ++h) {
          g.gate_up_proj[in.up_at(e, n, h)] += d * in.x[static_cast<std::size_t>(t * H + h)];
          g.hidden_states[static_cast<std::size_t>(t * H + h)] += d * in.w1[in.up_at(e, n, h)];
        }
      }
    }
  }
  return g;
}

}  // namespace moekit

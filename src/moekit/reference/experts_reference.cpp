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

std::vector<double> experts_reference(const ExpertsProblem& p) {
  const ExpertsShape s = validate(p);
  check_routing_ids(p);
  const ExpertsConfig& c = p.config;
  MOEKIT_CHECK(p.hidden_states.device().is_cpu(), "the reference runs on CPU tensors, got ",
               p.hidden_states.describe());
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, E = s.experts, K = s.top_k;
  const int64_t N = c.has_gate ? 2 * I : I;
  const QuantizationConfig& q = c.quantization;
  MOEKIT_CHECK(!q.quantized() || q.activations == ActivationScheme::dynamic,
               "the reference quantises activations dynamically; the static scheme is not supported (", q.describe(),
               ")");
  // Activation scales are powers of two exactly when the weight scales are (ue8m0).
  const bool power_of_two = q.quantized() && p.gate_up_proj_scale_inv.dtype() == DType::ue8m0;
  auto x = to_doubles(p.hidden_states);
  if (q.quantized())
    for (int64_t t = 0; t < T; ++t) quantize_in_double(x.data() + t * H, H, power_of_two);
  // Ids stay integers: a sentinel near INT64_MAX does not survive a trip through double.
  std::vector<int64_t> ids(static_cast<std::size_t>(T * K));
  visit_index_dtype(p.top_k_index.dtype(), [&](auto tag) {
    using Id = typename decltype(tag)::type;
    const Id* src = static_cast<const Id*>(p.top_k_index.data());  // contiguous: validated
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(src[i]);
  });
  const auto w = to_doubles(p.top_k_weights);
  const auto w1 = q.quantized() ? dequantized_doubles(p.gate_up_proj, p.gate_up_proj_scale_inv, q.weights)
                                : to_doubles(p.gate_up_proj);
  const auto w2 =
      q.quantized() ? dequantized_doubles(p.down_proj, p.down_proj_scale_inv, q.weights) : to_doubles(p.down_proj);
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
      if (q.quantized()) quantize_in_double(hidden.data(), I, power_of_two);
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

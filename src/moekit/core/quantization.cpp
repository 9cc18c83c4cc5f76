// Block quantisation of expert weights and the dynamic quantisation of activations (quantization.h).
// Everything here is the host-side definition that the reference and the CPU backends share, so a backend
// and the reference quantise activations bit for bit alike.
#include "moekit/quantization.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cfloat>
#include <cmath>
#include <sstream>

#include "moekit/core/e4m3_rounding.h"

namespace moekit {
namespace {

using detail::block_scale;

constexpr std::array<std::pair<WeightFormat, std::string_view>, 3> kFormats = {{
    {WeightFormat::none, "none"},
    {WeightFormat::fp8_e4m3, "fp8_e4m3"},
    {WeightFormat::fp4_e2m1, "fp4_e2m1"},
}};
constexpr std::array<std::pair<ActivationScheme, std::string_view>, 2> kSchemes = {{
    {ActivationScheme::dynamic, "dynamic"},
    {ActivationScheme::static_scales, "static"},
}};

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Records the smallest flat index of a non-finite weight seen by any thread.
void note_bad(std::atomic<int64_t>& first_bad, int64_t index) {
  int64_t seen = first_bad.load();
  while ((seen < 0 || index < seen) && !first_bad.compare_exchange_weak(seen, index)) {
  }
}

}  // namespace

std::string_view weight_format_name(WeightFormat format) {
  for (const auto& [f, name] : kFormats)
    if (f == format) return name;
  MOEKIT_FAIL("unknown weight format code ", static_cast<int>(format));
}

WeightFormat parse_weight_format(std::string_view name) {
  for (const auto& [f, n] : kFormats)
    if (n == name) return f;
  std::string valid;
  for (const auto& [f, n] : kFormats) valid += std::string(valid.empty() ? "" : ", ") + std::string(n);
  MOEKIT_FAIL("unknown weight format '", name, "'; valid: ", valid);
}

std::string_view activation_scheme_name(ActivationScheme scheme) {
  for (const auto& [s, name] : kSchemes)
    if (s == scheme) return name;
  MOEKIT_FAIL("unknown activation scheme code ", static_cast<int>(scheme));
}

ActivationScheme parse_activation_scheme(std::string_view name) {
  for (const auto& [s, n] : kSchemes)
    if (n == name) return s;
  MOEKIT_FAIL("unknown activation scheme '", name, "'; valid: dynamic, static");
}

int64_t default_block_size(WeightFormat format) {
  switch (format) {
    case WeightFormat::none:
      return 0;
    case WeightFormat::fp8_e4m3:
      return kFp8BlockSize;
    case WeightFormat::fp4_e2m1:
      return kFp4BlockSize;
  }
  MOEKIT_FAIL("unknown weight format code ", static_cast<int>(format));
}

int64_t QuantizationConfig::resolved_block_size() const {
  return block_size != 0 ? block_size : default_block_size(weights);
}

std::string QuantizationConfig::describe() const {
  if (!quantized()) return "not quantised";
  std::ostringstream os;
  os << weight_format_name(weights) << " block " << resolved_block_size() << ", " << activation_scheme_name(activations)
     << " activations";
  return os.str();
}

Shape quantized_weight_shape(WeightFormat format, int64_t experts, int64_t rows, int64_t cols) {
  if (format == WeightFormat::fp4_e2m1) return {experts, rows, cols / 2};
  return {experts, rows, cols};
}

Shape weight_scale_shape(WeightFormat format, int64_t experts, int64_t rows, int64_t cols) {
  MOEKIT_CHECK(format != WeightFormat::none, "weight_scale_shape: unquantised weights have no scales");
  if (format == WeightFormat::fp4_e2m1) return {experts, rows, ceil_div(cols, kFp4BlockSize)};
  return {experts, ceil_div(rows, kFp8BlockSize), ceil_div(cols, kFp8BlockSize)};
}

QuantizedWeights quantize_weights(const Tensor& weights, WeightFormat format, DType scale_dtype) {
  MOEKIT_CHECK(weights.defined() && weights.device().is_cpu() && weights.dim() == 3,
               "quantize_weights needs CPU weights [E, N, K], got ", weights.describe());
  MOEKIT_CHECK(format != WeightFormat::none, "quantize_weights: choose fp8_e4m3 or fp4_e2m1");
  MOEKIT_CHECK(scale_dtype == DType::f32 || scale_dtype == DType::ue8m0,
               "quantize_weights: scales are f32 or ue8m0, got ", dtype_name(scale_dtype));
  const bool fp4 = format == WeightFormat::fp4_e2m1;
  MOEKIT_CHECK(!fp4 || scale_dtype == DType::ue8m0, "FP4 e2m1 weights take ue8m0 scales, got ",
               dtype_name(scale_dtype));
  const int64_t E = weights.size(0), N = weights.size(1), K = weights.size(2);
  MOEKIT_CHECK(!fp4 || K % 2 == 0, "FP4 weights pack two values per byte along K, so K must be even; got ",
               weights.describe());
  QuantizedWeights out;
  out.weights = Tensor::empty(quantized_weight_shape(format, E, N, K), fp4 ? DType::f4_e2m1 : DType::f8_e4m3);
  out.scale_inv = Tensor::empty(weight_scale_shape(format, E, N, K), scale_dtype);
  const bool power_of_two = scale_dtype == DType::ue8m0;
  std::atomic<int64_t> first_bad{-1};
  float bad_value = 0;
  auto store_scale = [&](int64_t index, float scale) {
    if (power_of_two)
      out.scale_inv.data_as<ue8m0>()[index] = from_float<ue8m0>(scale);  // exact: scale is a power of two
    else
      out.scale_inv.data_as<float>()[index] = scale;
  };
  // One expert at a time in float: model-sized weights never need a float copy of all of them.
  for (int64_t e = 0; e < E && first_bad.load() < 0; ++e) {
    const Tensor we = weights.select(0, e).to(DType::f32);
    const float* src = we.data_as<float>();
    if (!fp4) {
      const int64_t NB = ceil_div(N, kFp8BlockSize), KB = ceil_div(K, kFp8BlockSize);
      f8_e4m3* q = out.weights.data_as<f8_e4m3>() + e * N * K;
#pragma omp parallel for schedule(dynamic)
      for (int64_t task = 0; task < NB * KB; ++task) {
        const int64_t nb = task / KB, kb = task % KB;
        const int64_t n0 = nb * kFp8BlockSize, n1 = std::min(N, n0 + kFp8BlockSize);
        const int64_t k0 = kb * kFp8BlockSize, k1 = std::min(K, k0 + kFp8BlockSize);
        float amax = 0;
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t k = k0; k < k1; ++k) {
            if (!std::isfinite(src[n * K + k])) note_bad(first_bad, (e * N + n) * K + k);
            amax = std::max(amax, std::fabs(src[n * K + k]));
          }
        const float scale = block_scale(amax, kE4m3Max, power_of_two);
        store_scale((e * NB + nb) * KB + kb, scale);
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t k = k0; k < k1; ++k) q[n * K + k] = from_float<f8_e4m3>(src[n * K + k] / scale);
      }
    } else {
      const int64_t KB = ceil_div(K, kFp4BlockSize);
      f4_e2m1x2* q = out.weights.data_as<f4_e2m1x2>() + e * N * K / 2;
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const float* r = src + n * K;
        for (int64_t kb = 0; kb < KB; ++kb) {
          const int64_t k0 = kb * kFp4BlockSize, k1 = std::min(K, k0 + kFp4BlockSize);
          float amax = 0;
          for (int64_t k = k0; k < k1; ++k) {
            if (!std::isfinite(r[k])) note_bad(first_bad, (e * N + n) * K + k);
            amax = std::max(amax, std::fabs(r[k]));
          }
          const float scale = block_scale(amax, kE2m1Max, true);
          store_scale((e * N + n) * KB + kb, scale);
          for (int64_t k = k0; k < k1; k += 2)  // k0 and K are even, so pairs never straddle blocks
            q[(n * K + k) / 2] = f4_e2m1x2{
                static_cast<uint8_t>(e2m1_from_float(r[k] / scale) | (e2m1_from_float(r[k + 1] / scale) << 4))};
        }
      }
    }
    if (const int64_t bad = first_bad.load(); bad >= 0) bad_value = src[bad % (N * K)];
  }
  if (const int64_t bad = first_bad.load(); bad >= 0)
    MOEKIT_FAIL("quantize_weights: weight [", bad / (N * K), ", ", bad / K % N, ", ", bad % K, "] = ", bad_value,
                " is not finite; block scales need finite weights");
  return out;
}

Tensor dequantize_weights(const Tensor& weights, const Tensor& scale_inv, DType dtype) {
  MOEKIT_CHECK(weights.defined() && weights.device().is_cpu() && weights.dim() == 3 && weights.is_contiguous(),
               "dequantize_weights needs contiguous CPU weights [E, N, K] (FP4: [E, N, K/2]), got ",
               weights.describe());
  MOEKIT_CHECK(weights.dtype() == DType::f8_e4m3 || weights.dtype() == DType::f4_e2m1,
               "dequantize_weights reads f8_e4m3 or f4_e2m1 weights, got ", weights.describe());
  const WeightFormat format = weights.dtype() == DType::f8_e4m3 ? WeightFormat::fp8_e4m3 : WeightFormat::fp4_e2m1;
  const int64_t E = weights.size(0), N = weights.size(1),
                K = weights.size(2) * dtype_values_per_element(weights.dtype());
  const Shape scale_shape = weight_scale_shape(format, E, N, K);
  MOEKIT_CHECK(scale_inv.defined() && scale_inv.device().is_cpu() && scale_inv.is_contiguous() &&
                   scale_inv.shape() == scale_shape,
               "scale_inv of ", weights.describe(), " must be a contiguous CPU tensor ", shape_string(scale_shape),
               ", got ", scale_inv.describe());
  MOEKIT_CHECK(format == WeightFormat::fp8_e4m3 ? (scale_inv.dtype() == DType::f32 || scale_inv.dtype() == DType::ue8m0)
                                                : scale_inv.dtype() == DType::ue8m0,
               "scale_inv of ", weight_format_name(format), " weights must be ",
               format == WeightFormat::fp8_e4m3 ? "f32 or ue8m0" : "ue8m0", ", got ", scale_inv.describe());
  Tensor out = Tensor::empty({E, N, K}, dtype);
  visit_scale_dtype(scale_inv.dtype(), [&](auto scale_tag) {
    using S = typename decltype(scale_tag)::type;
    const S* scales = static_cast<const S*>(scale_inv.data());
    visit_float_dtype(dtype, [&](auto out_tag) {
      using O = typename decltype(out_tag)::type;
      O* o = static_cast<O*>(out.data());
#pragma omp parallel for schedule(static)
      for (int64_t row = 0; row < E * N; ++row) {
        const int64_t e = row / N, n = row % N;
        for (int64_t k = 0; k < K; ++k) {
          float v = 0;
          if (format == WeightFormat::fp8_e4m3) {
            const float s =
                to_float(scales[(e * scale_shape[1] + n / kFp8BlockSize) * scale_shape[2] + k / kFp8BlockSize]);
            v = to_float(static_cast<const f8_e4m3*>(weights.data())[row * K + k]) * s;
          } else {
            const uint8_t pair = static_cast<const f4_e2m1x2*>(weights.data())[(row * K + k) / 2].bits;
            v = e2m1_to_float(k % 2 ? pair >> 4 : pair) * to_float(scales[row * scale_shape[2] + k / kFp4BlockSize]);
          }
          o[row * K + k] = from_float<O>(v);
        }
      }
    });
  });
  return out;
}

}  // namespace moekit

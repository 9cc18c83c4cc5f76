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

#include "moekit/cpu/activation_quantization.h"
#include "moekit/cpu/gemv.h"

namespace moekit {
namespace {

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

// The scale of a block (or activation group) whose largest magnitude is amax, for codes up to max_code.
float block_scale(float amax, float max_code, bool power_of_two) {
  if (amax == 0.0f) return 1.0f;  // every value is 0, whatever the scale
  const float scale = std::max(amax / max_code, FLT_MIN);
  return power_of_two ? to_float(ue8m0_ceil(scale)) : scale;
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

ue8m0 ue8m0_ceil(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  if (!std::isfinite(v) || std::signbit(v)) return ue8m0{0xff};  // no power of two covers these
  if (v <= std::ldexp(1.0f, -127)) return ue8m0{0};
  const uint32_t exponent = bits >> 23, mantissa = bits & 0x7fffffu;
  if (exponent == 0) return ue8m0{1};  // a subnormal above 2^-127: 2^-126 covers it
  // 2^127 is the largest code; the few floats above it saturate there (and their values past the format's
  // largest code saturate in the conversion that follows).
  return ue8m0{static_cast<uint8_t>(std::min<uint32_t>(mantissa == 0 ? exponent : exponent + 1, 0xfeu))};
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

namespace {

// The e4m3 value nearest to v (ties to even, saturating at +-448, NaN kept) as a float: what
// to_float(from_float<f8_e4m3>(v)) gives, written without branches so that the activation loop vectorises.
// Normal range: round the float's mantissa to 3 bits in place. Below 2^-6 e4m3 steps by 2^-9: adding 2^14
// puts the float's last mantissa bit at 2^-9, so the addition itself rounds to nearest even there.
inline float round_to_e4m3(float v) {
  const float a = std::fabs(v);
  uint32_t bits = std::bit_cast<uint32_t>(a);
  bits = (bits + 0x7ffffu + ((bits >> 20) & 1u)) & 0xfff00000u;
  const float normal = std::bit_cast<float>(bits);
  const float subnormal = (a + 16384.0f) - 16384.0f;
  float r = a < 0x1p-6f ? subnormal : normal;
  r = r > kE4m3Max ? kE4m3Max : r;  // false for NaN: NaN goes through
  r = a != a ? a : r;
  return std::copysign(r, v);
}

// The e4m3 code of a value that is already one (round_to_e4m3's results, NaN included), without branches:
// normal values rebias the float's exponent and keep its top 3 mantissa bits; below 2^-6 the value is a
// multiple of 2^-9, so value * 512 is the code.
inline f8_e4m3 e4m3_code_of(float r) {
  const float a = std::fabs(r);
  const uint32_t normal = (std::bit_cast<uint32_t>(a) >> 20) - (120u << 3);
  uint32_t code = a < 0x1p-6f ? static_cast<uint32_t>(a * 512.0f) : normal;
  code = a != a ? 0x7fu : code;
  return f8_e4m3{static_cast<uint8_t>(((std::bit_cast<uint32_t>(r) >> 24) & 0x80u) | code)};
}

}  // namespace

// Where the CPU has AVX-512, each group's maximum and rounding run on cpu::avx512's bit-exact twins of the
// loops below (the GCC 12 vectoriser leaves these loops scalar: a float max and selects).
void quantize_activations(const float* x, int64_t n, bool power_of_two_scales, float* dequantized, f8_e4m3* codes,
                          float* scales) {
  const bool simd = cpu::gemv_uses_avx512();
  for (int64_t g0 = 0; g0 < n; g0 += kActivationGroupSize) {
    const int64_t g1 = std::min(n, g0 + kActivationGroupSize);
    float amax = 0;
    if (simd)
      amax = cpu::avx512::group_amax(x + g0, g1 - g0);
    else
      for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = block_scale(amax, kE4m3Max, power_of_two_scales);
    if (scales) scales[g0 / kActivationGroupSize] = scale;
    if (simd) {
      cpu::avx512::quantize_group(x + g0, g1 - g0, scale, dequantized + g0, codes ? codes + g0 : nullptr);
    } else if (codes) {
      for (int64_t i = g0; i < g1; ++i) {
        const float r = round_to_e4m3(x[i] / scale);
        codes[i] = e4m3_code_of(r);
        dequantized[i] = r * scale;
      }
    } else {
      for (int64_t i = g0; i < g1; ++i) dequantized[i] = round_to_e4m3(x[i] / scale) * scale;
    }
  }
}

float round_to_e4m3_value(float v) {
  return round_to_e4m3(v);
}

}  // namespace moekit

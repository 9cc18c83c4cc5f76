// Block-quantised expert weights (DESIGN §3): the formats, how a problem declares them, and host functions
// that quantise weights, dequantise them back and quantise activations the way the backends do.
//
// Element conversions live beside the other dtypes in dtype.h: from_float<f8_e4m3> (round to nearest
// even, saturating at +-448, NaN stays NaN), e2m1_from_float (nearest even, saturating at +-6, NaN -> +0
// because e2m1 has no NaN), from_float<ue8m0> (nearest power of two, NaN/inf -> the NaN code) and their
// to_float / e2m1_to_float inverses. ue8m0_ceil below rounds a scale up instead.
//
// Formats, for one projection with weight W [E, N, K] (N outputs, K inputs, the [E, N, K] layout):
// - FP8: q [E, N, K] f8_e4m3 and scale_inv [E, ceil(N/128), ceil(K/128)] in f32 or ue8m0; one scale per
//   128 x 128 block. W[e, n, k] = q[e, n, k] * scale_inv[e, n / 128, k / 128].
// - FP4: q [E, N, K/2] f4_e2m1 (packed pairs: element 2j in the low nibble) and scale_inv
//   [E, N, ceil(K/32)] ue8m0; one scale per 32 values along K. W[e, n, k] = q * scale_inv[e, n, k / 32].
// Partial blocks at the ends of N and K use the scale of the block they fall in.
//
// Activations (the "dynamic" scheme): per token, per group of 128 consecutive values along K, in float32:
//   scale = amax / 448; with ue8m0 weight scales (FP4 always) the smallest power of two >= that;
//   q = from_float<f8_e4m3>(x / scale); the product uses q * scale.
// An all-zero group gets scale 1 (its values quantise to 0), and scales never go below 2^-126 (the smallest
// normal float) so that x / scale stays finite. A "static" scheme (one scale per tensor from the
// checkpoint) is described so that a backend can refuse it by name; no backend runs it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "moekit/tensor.h"

namespace moekit {

enum class WeightFormat : uint8_t { none, fp8_e4m3, fp4_e2m1 };
enum class ActivationScheme : uint8_t { dynamic, static_scales };

std::string_view weight_format_name(WeightFormat format);          // "none", "fp8_e4m3", "fp4_e2m1"
WeightFormat parse_weight_format(std::string_view name);           // lists the valid names on failure
std::string_view activation_scheme_name(ActivationScheme scheme);  // "dynamic", "static" (transformers' words)
ActivationScheme parse_activation_scheme(std::string_view name);

// The block edge of each format: FP8 128 x 128 blocks, FP4 32 values along K; activations 128 along K.
inline constexpr int64_t kFp8BlockSize = 128;
inline constexpr int64_t kFp4BlockSize = 32;
inline constexpr int64_t kActivationGroupSize = 128;
inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kE2m1Max = 6.0f;

// How the expert weights of a problem are quantised; the default is not quantised.
struct QuantizationConfig {
  WeightFormat weights = WeightFormat::none;
  // The checkpoint's block size (weight_block_size); 0 means the format's own (128 FP8, 32 FP4), the only
  // one supported, so validation refuses any other.
  int64_t block_size = 0;
  ActivationScheme activations = ActivationScheme::dynamic;

  bool quantized() const { return weights != WeightFormat::none; }
  // The block size in force: block_size, or the format's when 0.
  int64_t resolved_block_size() const;
  std::string describe() const;  // "fp8_e4m3 block 128, dynamic activations"
};

// The format's own block size (0 for none).
int64_t default_block_size(WeightFormat format);
// The stored shape of weights W [E, N, K]: [E, N, K] (FP8), [E, N, K/2] (FP4, K even).
Shape quantized_weight_shape(WeightFormat format, int64_t experts, int64_t rows, int64_t cols);
// The shape of their scale_inv: [E, ceil(N/128), ceil(K/128)] (FP8), [E, N, ceil(K/32)] (FP4).
Shape weight_scale_shape(WeightFormat format, int64_t experts, int64_t rows, int64_t cols);

// The smallest power of two >= v, for scales that must not shrink the range they cover (v > 0, finite).
ue8m0 ue8m0_ceil(float v);

struct QuantizedWeights {
  Tensor weights;    // f8_e4m3 [E, N, K] or f4_e2m1 [E, N, K/2]
  Tensor scale_inv;  // as weight_scale_shape, in scale_dtype
};

// Quantises W [E, N, K] (CPU, f32 | f16 | bf16, any strides) per block: scale = amax / max (448 FP8, 6 FP4),
// kept as f32 or rounded up to a power of two for ue8m0 (so no value saturates); an all-zero block gets
// scale 1. q = round-to-nearest-even(W / scale). FP4 needs ue8m0 scales and an even K. Non-finite weights
// throw, naming the element. Runs on all threads.
QuantizedWeights quantize_weights(const Tensor& weights, WeightFormat format, DType scale_dtype = DType::f32);

// W [E, N, K] in dtype (f32, f16 or bf16) = q * scale_inv, from weights in either format (the format
// follows from the dtype of weights; scale_inv's shape is checked against it).
Tensor dequantize_weights(const Tensor& weights, const Tensor& scale_inv, DType dtype = DType::f32);

// One row of n activations quantised per group of 128 as described above (power_of_two_scales: with ue8m0
// weight scales). Writes the values the products use, q * scale in float32, to dequantized (may alias x);
// codes (n) and scales (ceil(n / 128)) too where non-null.
void quantize_activations(const float* x, int64_t n, bool power_of_two_scales, float* dequantized,
                          f8_e4m3* codes = nullptr, float* scales = nullptr);

// to_float(from_float<f8_e4m3>(v)) computed without the code (what quantize_activations uses so that its
// loop vectorises); equal for every float, NaN included.
float round_to_e4m3_value(float v);

}  // namespace moekit

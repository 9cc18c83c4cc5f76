// Device-side reading of block-quantised expert weights (DESIGN §3), shared by batched_mm's
// matrix-vector kernels and the grouped tensor-core kernels: where a weight's code and scale lie, and
// the exact conversion of e4m3 and e2m1 codes. Weights are untransposed, [E, N, K] per projection.
#pragma once

#include "moekit/cuda/fp8_math.cuh"

namespace moekit::cuda {

// e4m3 code -> float, exactly. The 7 magnitude bits placed at float bits 20..26 read as 2^-120 times the
// e4m3 value, subnormals included (e4m3's exponent bias is 7, float's 127), so one multiplication by 2^120
// restores it. The NaN codes (0x7f, 0xff), which no quantiser writes, read as +-480.
__device__ __forceinline__ float e4m3_code_to_f(uint32_t code) {
  return __uint_as_float(((code & 0x7fu) << 20) | ((code & 0x80u) << 24)) * 0x1p120f;
}

// e2m1 code (the low 4 bits) -> float, exactly: the 3 magnitude bits at float bits 22..24 read as 2^-126
// times the value (0.5, e2m1's one subnormal, lands on float's subnormal 2^-127).
__device__ __forceinline__ float e2m1_code_to_f(uint32_t code) {
  return __uint_as_float(((code & 0x7u) << 22) | ((code & 0x8u) << 28)) * 0x1p126f;
}

// The layout of one format. For weight (n, k) of expert e in a projection of N outputs and K inputs:
// its byte is row n's byte k / kValuesPerByte, and its scale is scales[scale_row(e, n, N, K) + k / kBlockK].
template <WeightFormat F>
struct QuantizedFormat;

template <>
struct QuantizedFormat<WeightFormat::fp8_e4m3> {
  static constexpr int kValuesPerByte = 1;
  static constexpr int kBlockK = 128;  // one scale per 128 x 128 block
  __device__ __forceinline__ static int64_t scale_row(int64_t e, int64_t n, int64_t N, int64_t K) {
    return (e * ((N + 127) / 128) + n / 128) * ((K + 127) / 128);
  }
  __device__ __forceinline__ static float code(const uint8_t* row, int64_t k) { return e4m3_code_to_f(row[k]); }
};

template <>
struct QuantizedFormat<WeightFormat::fp4_e2m1> {
  static constexpr int kValuesPerByte = 2;
  static constexpr int kBlockK = 32;  // one scale per 32 values of a row
  __device__ __forceinline__ static int64_t scale_row(int64_t e, int64_t n, int64_t N, int64_t K) {
    return (e * N + n) * ((K + 31) / 32);
  }
  __device__ __forceinline__ static float code(const uint8_t* row, int64_t k) {
    return e2m1_code_to_f(static_cast<uint32_t>(row[k / 2]) >> (4 * (k % 2)));
  }
};

// The values one 16-byte load of a weight row holds.
template <WeightFormat F>
constexpr int kValuesPer16Bytes = 16 * QuantizedFormat<F>::kValuesPerByte;

// The 4 words of a 16-byte load.
__device__ __forceinline__ void words_of(const uint4 raw, uint32_t (&w)[4]) {
  w[0] = raw.x, w[1] = raw.y, w[2] = raw.z, w[3] = raw.w;
}

// Value i of the codes in a 16-byte load (before the scale), i < kValuesPer16Bytes<F>.
template <WeightFormat F>
__device__ __forceinline__ float code_in(const uint32_t (&w)[4], int i) {
  if constexpr (F == WeightFormat::fp8_e4m3)
    return e4m3_code_to_f(w[i / 4] >> (8 * (i % 4)));
  else
    return e2m1_code_to_f(w[i / 8] >> (4 * (i % 8)));
}

}  // namespace moekit::cuda

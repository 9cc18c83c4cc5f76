// batched_mm with FP8 or FP4 weights on Hopper: decode's matrix-vector products on the tensor cores.
// FP8 is described here; FP4 (the f16 tensor cores, weights converted by integer arithmetic) differs
// only in tile_dot<fp4_e2m1> and in storing the activation codes as f16.
//
// The matrix-vector kernels of batched_mm.cu convert every e4m3 weight to a float and multiply it by a
// float activation: for FP8 that is several instructions per weight byte, and they run out of issue
// slots before they run out of memory bandwidth. Here both sides are e4m3 codes (the activations are
// quantised per 128-wide group first, as DESIGN §3 asks) and a warp multiplies a 16-row tile of weights
// by the activation codes with mma.sync.m16n8k32 (e4m3 x e4m3 -> f32): one instruction per 512 weight
// bytes. The tile's 8 columns all carry the same activation vector, so every column of the result is
// the product (the tensor cores have far more throughput than decode needs).
//
// The layout trick: a dot product does not care in which order k runs, as long as both operands use the
// same one. Lane (g, q) (g = lane / 4, q = lane % 4) loads 16 contiguous bytes at k = c + 16q of weight
// rows g and g + 8 and the same 16 activation codes; the first 8 bytes of each feed one mma's
// (a0, a2 | b0, b1) slots, the last 8 another's. So weights stream as plain 16-byte loads, with no
// shuffles and no shared memory. Each 128-deep block of k is accumulated apart, then promoted with its
// weight block scale times its activation group scale (DESIGN §3's 128 x 128 / 1 x 128 scaling).
//
// Three launches, each later one a programmatic dependent of the one before on Hopper:
//   1. quantise x per token and 128-wide group into e4m3 codes and scales; zero the group counters;
//   2. first projection: a warp per 16-row tile of a pair (8 gate and 8 up rows when gated), activation
//      applied, the float hidden column written; the warp that completes a group of 128 hidden columns
//      of a pair (a counter per group) quantises that group into codes and a scale;
//   3. second projection: a block per (token, 16 output columns), a warp per pair, row sums added in
//      order k with bias and routing weight (deterministic, no atomics on the output).
// The dependents issue their first round of weight loads before waiting for the kernel before them.
#include "moekit/cuda/batched_mm_quantized_tensor_core.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/fp4_f16_codes.h"
#include "moekit/cuda/quantized_weights.cuh"
#include "moekit/cuda/tensor_map.h"
#include "moekit/kernel_options.h"

namespace moekit::cuda {
namespace {

constexpr int kTileRows = 16;     // weight rows per warp (the mma's m)
constexpr int kRoundK = 64;       // k per round: 4 lanes x 16 bytes
constexpr int kRounds = 8;        // rounds of 16-byte loads in flight per lane (2 loads each)
constexpr int kUpWarps = 4;       // tiles per block of the first projection
constexpr int kDownWarps = 8;     // pairs at once per block of the second projection
constexpr int kGroup = 128;       // activation group and weight scale block along k

// Bytes of an activation code: an e4m3 byte beside FP8 weights, an f16 beside FP4 ones (store_code).
MOEKIT_HOST_DEVICE constexpr int code_bytes(bool fp4) {
  return fp4 ? 2 : 1;
}

// The workspace's parts, each 16-byte aligned.
struct Workspace {
  float* hidden = nullptr;      // [P, I] float, activation applied
  uint8_t* x_codes = nullptr;   // [T, H] e4m3 (FP4 weights: f16 holding the e4m3 value, f16_code_position order)
  float* x_scales = nullptr;    // [T, ceil(H / 128)]
  uint8_t* h_codes = nullptr;   // [P, I], as x_codes
  float* h_scales = nullptr;    // [P, ceil(I / 128)]
  int* counters = nullptr;      // [P, ceil(I / 128)]: warps done per group of hidden columns
};

std::size_t round16(std::size_t n) {
  return (n + 15) / 16 * 16;
}

// Offsets of the parts for problem a (laid out in Workspace's order); returns the total bytes.
std::size_t layout(const ExpertsArgs& a, std::size_t (&offsets)[6]) {
  const auto T = static_cast<std::size_t>(a.tokens), P = T * static_cast<std::size_t>(a.top_k);
  const auto H = static_cast<std::size_t>(a.hidden), I = static_cast<std::size_t>(a.intermediate);
  const std::size_t groups_h = (H + kGroup - 1) / kGroup, groups_i = (I + kGroup - 1) / kGroup;
  const std::size_t code = code_bytes(a.fp4());
  const std::size_t sizes[6] = {P * I * sizeof(float), T * H * code, T * groups_h * sizeof(float),
                                P * I * code,          P * groups_i * sizeof(float), P * groups_i * sizeof(int)};
  std::size_t total = 0;
  for (int i = 0; i < 6; ++i) offsets[i] = total, total += round16(sizes[i]);
  return total;
}

Workspace carve(const ExpertsArgs& a, void* base) {
  std::size_t o[6];
  layout(a, o);
  auto* b = static_cast<char*>(base);
  Workspace w;
  w.hidden = reinterpret_cast<float*>(b + o[0]);
  w.x_codes = reinterpret_cast<uint8_t*>(b + o[1]);
  w.x_scales = reinterpret_cast<float*>(b + o[2]);
  w.h_codes = reinterpret_cast<uint8_t*>(b + o[3]);
  w.h_scales = reinterpret_cast<float*>(b + o[4]);
  w.counters = reinterpret_cast<int*>(b + o[5]);
  return w;
}

// d += A (16 x 32 e4m3, row-major fragments a0..a3) * B (32 x 8 e4m3, fragments b0, b1), f32 accumulate.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // never launched: the host runs this path on compute capability 9.0 only
#endif
}

// d += A (16 x 16 f16, fragments a0..a3) * B (16 x 8 f16, fragments b0, b1), f32 accumulate.
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Writes activation code v (an e4m3 value) as position k of a codes row: a byte for FP8 weights, an f16
// in f16_code_position order for FP4 weights.
__device__ __forceinline__ void store_code(uint8_t* row, int64_t k, float v, bool fp4) {
  if (fp4)
    reinterpret_cast<__half*>(row)[f16_code_position(k)] = __float2half_rn(v);  // exact: e4m3 values fit
  else
    row[k] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// The two rows of a lane's tile: weight rows row_lo (tile row g) and row_hi (g + 8) of length K bytes,
// their scale rows (Fp8::scale_row) in `scales`.
struct TileRows {
  const uint8_t* lo;
  const uint8_t* hi;
  int32_t scale_lo, scale_hi;  // fit: the host checks the scale tensors have fewer than 2^31 entries
};


// (row_lo . x, row_hi . x) over k in [k_begin, k_end) (k_begin a multiple of 128), codes times their
// scales, x being e4m3 codes with a scale per 128; lane (g, q) returns rows g and g + 8 of the tile. The
// first round of weight loads (and their block scales) is issued before wait_for_prerequisite (the
// activations come from the kernel before). valid = false: nothing is read and (0, 0) comes back.
template <WeightFormat F>
__device__ __forceinline__ float2 tile_dot(const ExpertsArgs& a, const void* scales, const TileRows& rows,
                                           const uint8_t* x, const float* x_scales, int64_t k_begin, int64_t k_end,
                                           bool valid);

template <>
__device__ __forceinline__ float2 tile_dot<WeightFormat::fp8_e4m3>(const ExpertsArgs& a, const void* scales,
                                                                   const TileRows& rows, const uint8_t* x,
                                                                   const float* x_scales, int64_t k_begin,
                                                                   int64_t k_end, bool valid) {
  constexpr int kGroupsPerChunk = kRounds * kRoundK / kGroup;
  const int q = threadIdx.x % 4;
  float sum_lo = 0.0f, sum_hi = 0.0f;
  for (int64_t c0 = k_begin; c0 < k_end; c0 += kRoundK * kRounds) {
    uint4 w_lo[kRounds], w_hi[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const int64_t k = c0 + r * kRoundK + 16 * q;
      w_lo[r] = w_hi[r] = make_uint4(0, 0, 0, 0);
      // A load instruction reads 64 bytes of each of 8 rows and the next three rounds the rest of each row's
      // 256-byte piece: fetching whole pieces into L2 took DeepSeek-V3 at 8 tokens from 0.79 to 0.71 ms.
      if (valid && k < k_end)
        w_lo[r] = load_stream_raw<256>(rows.lo + k), w_hi[r] = load_stream_raw<256>(rows.hi + k);
    }
    // The chunk's scales, requested with its weights.
    float s_lo[kGroupsPerChunk], s_hi[kGroupsPerChunk];
#pragma unroll
    for (int b = 0; b < kGroupsPerChunk; ++b) {
      const int64_t kb = c0 / kGroup + b;
      const bool in = valid && c0 + b * kGroup < k_end;
      s_lo[b] = in ? block_scale_at(a, scales, rows.scale_lo + static_cast<int32_t>(kb)) : 0.0f;
      s_hi[b] = in ? block_scale_at(a, scales, rows.scale_hi + static_cast<int32_t>(kb)) : 0.0f;
    }
    if (c0 == k_begin) wait_for_prerequisite();
#pragma unroll
    for (int b = 0; b < kGroupsPerChunk; ++b) {
      const float s_x = valid && c0 + b * kGroup < k_end ? x_scales[c0 / kGroup + b] : 0.0f;
      s_lo[b] *= s_x, s_hi[b] *= s_x;
    }
#pragma unroll
    for (int b = 0; b < kGroupsPerChunk; ++b) {
      const int64_t k = c0 + b * kGroup;
      if (k >= k_end) break;
      // The activation codes of the group's two rounds (shared by all warps: from L1 or L2).
      uint4 xv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t kx = k + r * kRoundK + 16 * q;
        xv[r] = make_uint4(0, 0, 0, 0);
        if (valid && kx < k_end) xv[r] = *reinterpret_cast<const uint4*>(x + kx);
      }
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4 lo = w_lo[2 * b + r], hi = w_hi[2 * b + r];
        mma_e4m3(d, lo.x, hi.x, lo.y, hi.y, xv[r].x, xv[r].y);
        mma_e4m3(d, lo.z, hi.z, lo.w, hi.w, xv[r].z, xv[r].w);
      }
      sum_lo = fmaf(d[0], s_lo[b], sum_lo);
      sum_hi = fmaf(d[2], s_hi[b], sum_hi);
    }
  }
  return make_float2(sum_lo, sum_hi);
}

// FP4 (e2m1 pairs, a ue8m0 scale per 32 values of a row): the same tile on the f16 tensor cores
// (mma.sync.m16n8k16). A round is one 128-deep group: lane (g, q) loads the 16 bytes holding values
// c + 32q .. c + 32q + 31 of rows g and g + 8 (each one scale block), turns each packed word into f16
// pairs by integer arithmetic (e2m1_pair_as_f16x2: the value times 2^-14) and multiplies them by
// 2^(s - base + 14), where base is the largest of the row's four scale exponents in the group (the four
// q lanes), so every converted weight is its e2m1 value times 2^(s - base), exactly (down to 2^-23 below
// the group's largest scale). The activations are f16 copies of their e4m3 codes, stored in the order
// that pairs the same values (f16_code_position). After the group's 8 mmas, rows are promoted by
// 2^(base - 127) times the activation group's scale.
template <>
__device__ __forceinline__ float2 tile_dot<WeightFormat::fp4_e2m1>(const ExpertsArgs& a, const void* scales,
                                                                   const TileRows& rows, const uint8_t* x,
                                                                   const float* x_scales, int64_t k_begin,
                                                                   int64_t k_end, bool valid) {
  (void)a;
  const int q = threadIdx.x % 4;
  const auto* scale_codes = static_cast<const uint8_t*>(scales);
  float sum_lo = 0.0f, sum_hi = 0.0f;
  for (int64_t c0 = k_begin; c0 < k_end; c0 += kGroup * kRounds) {
    uint4 w_lo[kRounds], w_hi[kRounds];
    uint32_t code_lo[kRounds], code_hi[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const int64_t k = c0 + r * kGroup + 32 * q;
      w_lo[r] = w_hi[r] = make_uint4(0, 0, 0, 0);
      code_lo[r] = code_hi[r] = 0;
      if (valid && k < k_end) {
        w_lo[r] = load_stream_raw<256>(rows.lo + k / 2), w_hi[r] = load_stream_raw<256>(rows.hi + k / 2);
        code_lo[r] = scale_codes[rows.scale_lo + static_cast<int32_t>(k / 32)];
        code_hi[r] = scale_codes[rows.scale_hi + static_cast<int32_t>(k / 32)];
      }
    }
    if (c0 == k_begin) wait_for_prerequisite();
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const int64_t k = c0 + r * kGroup;
      if (k >= k_end) break;
      // The row's largest scale exponent over the group's four blocks (lanes q = 0..3 of the row).
      uint32_t base_lo = max(code_lo[r], __shfl_xor_sync(0xffffffffu, code_lo[r], 1));
      base_lo = max(base_lo, __shfl_xor_sync(0xffffffffu, base_lo, 2));
      uint32_t base_hi = max(code_hi[r], __shfl_xor_sync(0xffffffffu, code_hi[r], 1));
      base_hi = max(base_hi, __shfl_xor_sync(0xffffffffu, base_hi, 2));
      const uint32_t f_lo = f16_power_of_two(static_cast<int>(code_lo[r]) - static_cast<int>(base_lo) + 14);
      const uint32_t f_hi = f16_power_of_two(static_cast<int>(code_hi[r]) - static_cast<int>(base_hi) + 14);
      const uint32_t factor_lo = f_lo | f_lo << 16, factor_hi = f_hi | f_hi << 16;
      // The group's activation codes for this lane's 32 values (from L1 or L2).
      uint4 xv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        xv[i] = make_uint4(0, 0, 0, 0);
        if (valid && k + 32 * q < k_end) xv[i] = reinterpret_cast<const uint4*>(x + 2 * (k + 32 * q))[i];
      }
      const uint32_t lo_words[4] = {w_lo[r].x, w_lo[r].y, w_lo[r].z, w_lo[r].w};
      const uint32_t hi_words[4] = {w_hi[r].x, w_hi[r].y, w_hi[r].z, w_hi[r].w};
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          lo[j] = mul_f16x2(e2m1_pair_as_f16x2(lo_words[i], j), factor_lo);
          hi[j] = mul_f16x2(e2m1_pair_as_f16x2(hi_words[i], j), factor_hi);
        }
        mma_f16(d, lo[0], hi[0], lo[1], hi[1], xv[i].x, xv[i].y);
        mma_f16(d, lo[2], hi[2], lo[3], hi[3], xv[i].z, xv[i].w);
      }
      if (!valid) continue;
      const float s_x = x_scales[k / kGroup];
      sum_lo = fmaf(d[0], ue8m0_value(base_lo) * s_x, sum_lo);
      sum_hi = fmaf(d[2], ue8m0_value(base_hi) * s_x, sum_hi);
    }
  }
  return make_float2(sum_lo, sum_hi);
}

// Split s of S of k over K (in whole 128-wide groups): [begin, end).
__device__ __forceinline__ void split_range(int64_t K, int s, int S, int64_t& begin, int64_t& end) {
  const int64_t groups = (K + kGroup - 1) / kGroup;
  begin = min(K, groups * s / S * kGroup);
  end = min(K, groups * (s + 1) / S * kGroup);
}

// Quantises one 128-wide group of a row held 4 values a lane (value lane + 32i at g0 + lane + 32i; pass 0
// past the row's n values) as quantize_activations does, and stores its codes into the row's codes
// (store_code) and its scale.
__device__ __forceinline__ void quantize_group_into(const ExpertsArgs& a, float (&v)[4], uint8_t* codes_row,
                                                    int64_t g0, int64_t n, float* scale) {
  const int lane = threadIdx.x % 32;
  const float s = quantize_group_lanes(v, a.ue8m0_scales);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t k = g0 + lane + 32 * i;
    if (k < n) store_code(codes_row, k, v[i], a.fp4());
  }
  if (lane == 0) *scale = s;
}

// 1. x [T, H] -> e4m3 codes and a scale per 128 (quantize_activations' rounding); zeroes the counters.
// grid (T, ceil(groups / 4)), block 128: a warp per group.
template <typename T>
__global__ void __launch_bounds__(128) quantize_x_kernel(const ExpertsArgs a, Workspace ws, int64_t counters) {
  allow_dependents();
  const int64_t H = a.hidden, groups = (H + kGroup - 1) / kGroup;
  const int64_t block = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  for (int64_t i = block * 128 + threadIdx.x; i < counters; i += static_cast<int64_t>(gridDim.x) * gridDim.y * 128)
    ws.counters[i] = 0;
  const int lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x, g = static_cast<int64_t>(blockIdx.y) * 4 + threadIdx.x / 32;
  if (g >= groups) return;
  const T* row = static_cast<const T*>(a.x) + t * H;
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t h = g * kGroup + lane + 32 * i;
    v[i] = h < H ? to_f(row[h]) : 0.0f;
  }
  quantize_group_into(a, v, ws.x_codes + t * H * code_bytes(a.fp4()), g * kGroup, H, ws.x_scales + t * groups + g);
}

// 2. hidden[pair, j] = act(gate_j . x + b, up_j . x + b) for a tile: 8 columns j0.. (gated: rows
// gate(j0 + g) and up(j0 + g)) or 16 (ungated: rows j0 + g and j0 + 8 + g), its k split over `splits`
// warps (1, 2 or 4) whose sums warp 0 of the tile adds in order; then the group counter.
// grid (P, ceil(tiles * splits / kUpWarps)), block 32 * kUpWarps.
template <typename T, WeightFormat F>
__global__ void __launch_bounds__(kUpWarps * 32, 4) up_kernel(const ExpertsArgs a, Workspace ws, int splits) {
  using Q = QuantizedFormat<F>;
  constexpr int kCodeBytes = code_bytes(F == WeightFormat::fp4_e2m1);
  allow_dependents();
  __shared__ float partial[kUpWarps][kTileRows];
  const int64_t H = a.hidden, I = a.intermediate, N = a.has_gate ? 2 * I : I;
  const int64_t groups_h = (H + kGroup - 1) / kGroup, groups_i = (I + kGroup - 1) / kGroup;
  const int cols = a.has_gate ? kTileRows / 2 : kTileRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, split = warp % splits;
  // 32-bit indices where they fit (pairs and columns: the host checks): 64-bit ones live across the
  // products made the kernel spill.
  const int pair = static_cast<int>(blockIdx.x);
  const int j0 = (static_cast<int>(blockIdx.y) * (kUpWarps / splits) + warp / splits) * cols;
  const int64_t e = load_id(a, pair);
  if (e < 0 || e >= a.experts) return;  // the whole block: sentinel (or invalid: the second projection poisons)
  const bool active = j0 < I;
  const int64_t j_lo = min(int64_t{j0} + g, I - 1),
                j_hi = min(int64_t{j0} + (a.has_gate ? 0 : 8) + g, I - 1);  // clamped
  const int64_t n_lo = a.has_gate ? gate_col(a, j_lo) : j_lo, n_hi = a.has_gate ? up_col(a, j_lo) : j_hi;
  const int64_t row_bytes = H / Q::kValuesPerByte;
  const uint8_t* w = static_cast<const uint8_t*>(a.up) + e * N * row_bytes;
  const TileRows rows{w + n_lo * row_bytes, w + n_hi * row_bytes, static_cast<int32_t>(Q::scale_row(e, n_lo, N, H)),
                      static_cast<int32_t>(Q::scale_row(e, n_hi, N, H))};
  const int64_t t = pair / a.top_k;
  // The biases are read first: two floats then stay live across the products instead of the rows' indices.
  const T* b = a.up_bias ? static_cast<const T*>(a.up_bias) + e * N : nullptr;
  const float bias_lo = b ? to_f(b[n_lo]) : 0.0f, bias_hi = b ? to_f(b[n_hi]) : 0.0f;
  int64_t k_begin, k_end;
  split_range(H, split, splits, k_begin, k_end);
  float2 s = tile_dot<F>(a, a.up_scale, rows, ws.x_codes + t * H * kCodeBytes, ws.x_scales + t * groups_h, k_begin,
                         k_end, active);
  if (splits > 1) {
    if (lane % 4 == 0) partial[warp][g] = s.x, partial[warp][8 + g] = s.y;
    __syncthreads();
    if (split != 0) return;
    s = make_float2(0.0f, 0.0f);
    for (int i = 0; i < splits; ++i) s.x += partial[warp + i][g], s.y += partial[warp + i][8 + g];  // in order
  }
  if (!active) return;

  float* out = ws.hidden + static_cast<int64_t>(pair) * I;
  if (lane % 4 == 0) {
    s.x += bias_lo, s.y += bias_hi;
    if (a.has_gate) {
      if (j0 + g < I) out[j0 + g] = activate(a, s.x, s.y);
    } else {
      if (j0 + g < I) out[j0 + g] = activate(a, s.x, 0.0f);
      if (j0 + 8 + g < I) out[j0 + 8 + g] = activate(a, s.y, 0.0f);
    }
  }
  // The warp that brings its group's count to the group's number of tiles quantises the group.
  __threadfence();
  __syncwarp();
  const int64_t group = j0 / kGroup, g0 = group * kGroup;
  const int tiles_in_group = static_cast<int>((min(I, g0 + kGroup) - g0 + cols - 1) / cols);
  int done = 0;
  if (lane == 0) done = atomicAdd(ws.counters + pair * groups_i + group, 1) + 1;
  if (__shfl_sync(0xffffffffu, done, 0) != tiles_in_group) return;
  __threadfence();
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t j = g0 + lane + 32 * i;
    v[i] = j < I ? __ldcg(out + j) : 0.0f;
  }
  quantize_group_into(a, v, ws.h_codes + pair * I * code_bytes(a.fp4()), g0, I, ws.h_scales + pair * groups_i + group);
}

// 3. out[t, h] = sum_k w[t, k] * (down_e[h] . hq[t * K + k] + b2[e, h]) for 16 columns h0.. of token t.
// Warp w takes pair slot w % slots (pairs slot, slot + slots, ...) and split w / slots of k; sums go to
// shared memory and one thread per column adds them, splits in order within a pair and pairs in order k.
// grid (T, ceil(H / 16)), block 32 * slots * splits, shared splits * K * 16 floats.
template <typename T, WeightFormat F>
__global__ void __launch_bounds__(kDownWarps * 32 * 2, 1) down_kernel(const ExpertsArgs a, Workspace ws, int splits) {
  using Q = QuantizedFormat<F>;
  constexpr int kCodeBytes = code_bytes(F == WeightFormat::fp4_e2m1);
  extern __shared__ float row_sums[];  // [splits][K][16], then the pair table
  const int64_t H = a.hidden, I = a.intermediate, K = a.top_k, groups_i = (I + kGroup - 1) / kGroup;
  // 32-bit token, column and pair indices (the host checks they fit), as in up_kernel.
  const int t = static_cast<int>(blockIdx.x), h0 = static_cast<int>(blockIdx.y) * kTileRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
  const int slots = blockDim.x / 32 / splits, split = warp / slots;
  const int64_t h_lo = min(int64_t{h0} + g, H - 1), h_hi = min(int64_t{h0} + 8 + g, H - 1);
  int64_t k_begin, k_end;
  split_range(I, split, splits, k_begin, k_end);
  for (int k = warp % slots; k < K; k += slots) {
    const int pair = t * static_cast<int>(K) + k;
    const int64_t e = load_id(a, pair);
    const bool valid = e >= 0 && e < a.experts;
    const int64_t ee = valid ? e : 0;
    const int64_t row_bytes = I / Q::kValuesPerByte;
    const uint8_t* w = static_cast<const uint8_t*>(a.down) + ee * H * row_bytes;
    const TileRows rows{w + h_lo * row_bytes, w + h_hi * row_bytes, static_cast<int32_t>(Q::scale_row(ee, h_lo, H, I)),
                        static_cast<int32_t>(Q::scale_row(ee, h_hi, H, I))};
    const float2 s = tile_dot<F>(a, a.down_scale, rows, ws.h_codes + pair * I * kCodeBytes, ws.h_scales + pair * groups_i,
                                 k_begin, k_end, valid);
    float* sums = row_sums + (split * K + k) * kTileRows;
    if (lane % 4 == 0) sums[g] = s.x, sums[8 + g] = s.y;
  }
  wait_for_prerequisite();  // every warp, so nothing below runs before the kernels this one follows
  __syncthreads();
  if (warp != 0) return;  // the columns' threads are warp 0's
  float* pairs = row_sums + splits * K * kTileRows;
  load_pair_table<T>(a, t, pairs);
  store_pairs_in_order<T>(a, t, h0, kTileRows, row_sums, splits, pairs);
}

// Launches kernel with grid, block and shared memory, as a programmatic dependent of the stream's last
// kernel on Hopper.
template <typename... Args>
void launch_dependent(void (*kernel)(Args...), dim3 grid, dim3 block, std::size_t shared, cudaStream_t stream,
                      Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &dependent;
  config.numAttrs = 1;
  MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

// How many warps share one tile's k: doubled (up to 4, at most one per 128-wide group) while the warps
// of the whole grid still fit on the GPU at once (16 a multiprocessor, as the register use allows), so
// that small problems put more loads in flight.
int choose_splits(int64_t warps, int64_t K) {
  const int64_t resident = static_cast<int64_t>(multiprocessor_count()) * 16;
  const int64_t groups = (K + kGroup - 1) / kGroup;
  int splits = 1;
  while (splits < 4 && warps * splits * 2 <= resident && groups >= splits * 2) splits *= 2;
  return splits;
}

template <typename T, WeightFormat F>
void launch(const ExpertsArgs& a, Workspace ws, cudaStream_t stream) {
  const int64_t P = a.tokens * a.top_k, H = a.hidden, I = a.intermediate;
  const int64_t counters = P * ((I + kGroup - 1) / kGroup);
  quantize_x_kernel<T><<<dim3(static_cast<unsigned>(a.tokens), static_cast<unsigned>(((H + kGroup - 1) / kGroup + 3) / 4)),
                         128, 0, stream>>>(a, ws, counters);
  MOEKIT_CUDA_CHECK_LAUNCH();
  const int64_t cols = a.has_gate ? kTileRows / 2 : kTileRows;
  const int64_t tiles = (I + cols - 1) / cols;
  const int up_splits = choose_splits(P * tiles, H);
  const int64_t tiles_per_block = kUpWarps / up_splits;
  MOEKIT_CHECK((tiles + tiles_per_block - 1) / tiles_per_block <= 65535, "batched_mm: intermediate size ", I,
               " is too large for one launch");
  launch_dependent(up_kernel<T, F>,
                   dim3(static_cast<unsigned>(P), static_cast<unsigned>((tiles + tiles_per_block - 1) / tiles_per_block)),
                   dim3(kUpWarps * 32), 0, stream, a, ws, up_splits);
  const int64_t slots = std::min<int64_t>(a.top_k, kDownWarps);
  const int64_t row_tiles = (H + kTileRows - 1) / kTileRows;
  const int down_splits = std::min(choose_splits(a.tokens * row_tiles * slots, I), 2);  // at most 16 warps a block
  MOEKIT_CHECK(row_tiles <= 65535, "batched_mm: hidden size ", H, " is too large for one launch");
  launch_dependent(
      down_kernel<T, F>, dim3(static_cast<unsigned>(a.tokens), static_cast<unsigned>(row_tiles)),
      dim3(static_cast<unsigned>(32 * slots * down_splits)),
      static_cast<std::size_t>(down_splits * a.top_k * kTileRows * sizeof(float) + pair_table_bytes(a.top_k)), stream,
      a, ws, down_splits);
}

}  // namespace

namespace {
// Entries of the larger block-scale tensor (the kernels index them with 32-bit offsets).
int64_t scale_entries(const ExpertsArgs& a) {
  const int64_t N = a.has_gate ? 2 * a.intermediate : a.intermediate;
  if (a.fp4()) return a.experts * std::max(N * ((a.hidden + 31) / 32), a.hidden * ((a.intermediate + 31) / 32));
  const int64_t h = (a.hidden + kGroup - 1) / kGroup, i = (a.intermediate + kGroup - 1) / kGroup;
  return a.experts * std::max((N + kGroup - 1) / kGroup * h, h * i);
}
}  // namespace

bool batched_mm_quantized_tensor_core_runs(const ExpertsArgs& a) {
  const bool allowed = kernel_options().batched_mm_tensor_cores;
  // Whole 16-byte pieces of every weight row: 16 e4m3 codes, 32 e2m1 codes.
  const int64_t piece = a.fp8() ? 16 : 32;
  return allowed && a.quantized() && !a.transposed && a.hidden % piece == 0 && a.intermediate % piece == 0 &&
         aligned16(a.up) && aligned16(a.down) &&
         2 * a.top_k * kTileRows * sizeof(float) + pair_table_bytes(a.top_k) <= 48 * 1024 && a.tokens <= 0x7fffffff &&
         a.tokens * a.top_k <= 0x7fffffff && scale_entries(a) <= 0x7fffffff && device_is_sm90();
}

std::size_t batched_mm_quantized_tensor_core_workspace_bytes(const ExpertsArgs& a) {
  std::size_t offsets[6];
  return layout(a, offsets);
}

void batched_mm_quantized_tensor_core_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  MOEKIT_CHECK(batched_mm_quantized_tensor_core_runs(a), "batched_mm: the quantised tensor-core path cannot run this problem");
  if (a.tokens * a.top_k == 0) return;
  const Workspace ws = carve(a, workspace);
  visit_float_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.fp4())
      launch<T, WeightFormat::fp4_e2m1>(a, ws, stream);
    else
      launch<T, WeightFormat::fp8_e4m3>(a, ws, stream);
  });
}

}  // namespace moekit::cuda

// The Hopper grouped GEMM's epilogues, run by a math warpgroup on its 64 rows of a finished tile's accumulators:
//   store:      the second projection plus its bias (times the pair's routing weight with weight_rows) in T;
//   gated:      act(gate) * up of the paired gate and up columns, in T (FP8: float for a quantising pass);
//   gated_e4m3: the same quantised to e4m3 codes and 1 x 128 scales in the epilogue (FP8);
//   activation: act(x) of an ungated first projection, in T (FP8: float).
// Stored by the warpgroup itself (2-byte outputs in 16-byte row pieces), or staged into its shared-memory buffer
// for the producer warpgroup's copying warps (copy_staged) while it goes on to its next tile.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/fp8_math.cuh"
#include "moekit/cuda/scale_division.h"
#include "moekit/cuda/sm90_gemm_layout.cuh"
#include "moekit/cuda/sm90_gemm_scheduler.cuh"
#include "moekit/cuda/sm90_wgmma.cuh"

namespace moekit::cuda::hopper {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(from_f<T>(lo).bits) | (static_cast<uint32_t>(from_f<T>(hi).bits) << 16);
}

// act(g) * u of two adjacent columns, packed. Not inlined: inlining the activation's switch into every
// one of the epilogue's unrolled steps makes the kernel spill its accumulators.
// The activation's settings travel by value: a reference into the kernel's parameters would make the
// compiler copy them all to the stack.
inline __device__ __noinline__ float2 activated_pair(Act act, bool has_gate, float limit, float alpha, float g0,
                                                     float u0, float g1, float u1) {
  ExpertsArgs a;
  a.act = act;
  a.has_gate = has_gate;
  a.swiglu_limit = limit;
  a.swiglu_alpha = alpha;
  return make_float2(activate(a, g0, u0), activate(a, g1, u1));
}

// Two adjacent outputs: float (FP8's first projection, quantised afterwards as the reference does from
// float) or packed into T.
template <typename O>
__device__ __forceinline__ void store_pair(O* p, float2 v) {
  if constexpr (std::is_same_v<O, float>)
    *reinterpret_cast<float2*>(p) = v;
  else
    *reinterpret_cast<uint32_t*>(p) = pack2<O>(v.x, v.y);
}

// Picks x[k] of four values with a run-time k without indexing a register array (which would move it
// to local memory).
__device__ __forceinline__ uint32_t select4(const uint32_t (&x)[4], int k) {
  return k == 0 ? x[0] : k == 1 ? x[1] : k == 2 ? x[2] : x[3];
}

// Stores two column groups of a tile with 16-byte stores. words[k] holds the two outputs of
// accumulator elements 8m + 2k and 8m + 2k + 1: group 2m (k = 0, 1) and 2m + 1 (k = 2, 3), rows r
// (k even) and r + 8 (k odd), columns 8 * group + 2 * (lane % 4) + {0, 1}. The four lanes of a quad
// swap words so that each lane owns 8 consecutive outputs of one row: a warp's store then writes
// whole 32-byte sectors instead of 4 bytes per lane.
template <typename O>
__device__ __forceinline__ void store_group_pair(O* out, int64_t ld, int64_t row_base, int64_t col_base,
                                                 int64_t outputs, int m, const uint32_t (&words)[4], int warp,
                                                 int lane) {
  const int q = lane % 4, quad = lane & ~3;
  // Lane q ends up with (row r, group 2m), (r, 2m + 1), (r + 8, 2m), (r + 8, 2m + 1) for q = 0..3:
  // wanted[q] is what every lane sends to lane q.
  const uint32_t wanted[4] = {words[0], words[2], words[1], words[3]};
  uint32_t mine[4] = {0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int source = (q + r) % 4;  // this round, lane q reads lane `source`, which sends what q wants
    const uint32_t got = __shfl_sync(0xffffffffu, select4(wanted, (q - r + 4) % 4), quad + source);
#pragma unroll
    for (int w = 0; w < 4; ++w) mine[w] = w == source ? got : mine[w];
  }
  const int64_t row = row_base + warp * 16 + lane / 4 + (q >> 1) * 8;
  const int64_t col = col_base + (2 * m + (q & 1)) * 8;
  if (col < outputs)  // outputs is a multiple of 8
    *reinterpret_cast<uint4*>(out + row * ld + col) = make_uint4(mine[0], mine[1], mine[2], mine[3]);
}

// The routing weights of this thread's two rows of a tile (store with weight_rows; 1 otherwise),
// read when the tile starts so that the epilogue does not wait for them.
template <typename T, Epilogue kEpi>
__device__ __forceinline__ void row_weights(const GemmParams& p, int64_t m_tile, int math, float (&weight)[2]) {
  weight[0] = weight[1] = 1.0f;
  if (kEpi != Epilogue::store || !p.weight_rows) return;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int32_t pair = p.padded_pair[m_tile * kBlockM + math * 64 + acc_row(warp, lane, 2 * h)];
    weight[h] = pair >= 0 ? load_routing_weight<T>(p.a, pair) : 0.0f;
  }
}

// Two adjacent outputs of row `row` (0-63), column `col` of a warpgroup's staging buffer of kCols columns,
// packed (only 2-byte outputs are staged).
template <typename O, int kCols>
__device__ __forceinline__ void stage_pair(uint8_t* staged, int row, int col, float2 v) {
  static_assert(sizeof(O) == 2, "staged rows hold 2-byte outputs");
  *reinterpret_cast<uint32_t*>(staged + row * kStagedPitch<kCols> + col * 2) = pack2<O>(v.x, v.y);
}

// Two adjacent biases in one load (even columns; the biases are 4-byte aligned, hopper_gemm_runs).
template <typename T>
__device__ __forceinline__ float2 bias_pair(uint32_t b) {
  return make_float2(to_f(T{static_cast<uint16_t>(b & 0xffffu)}), to_f(T{static_cast<uint16_t>(b >> 16)}));
}

// The gate and up values of accumulator pair i (< BN / 4) of a gated tile, columns j and j + 1 of the intermediate,
// with the biases (bias: the expert's [2I] gate/up biases, or null).
template <typename T, int BN>
__device__ __forceinline__ float4 gate_up_pair(const ExpertsArgs& a, const float* acc, const T* bias, int64_t j,
                                               int i) {
  constexpr int kHalf = BN / 4;  // accumulator index of the up column paired with a gate column
  float g0 = acc[i], g1 = acc[i + 1], u0 = acc[i + kHalf], u1 = acc[i + 1 + kHalf];
  if (bias) {
    g0 += to_f(bias[gate_col(a, j)]), g1 += to_f(bias[gate_col(a, j + 1)]);
    u0 += to_f(bias[up_col(a, j)]), u1 += to_f(bias[up_col(a, j + 1)]);
  }
  return make_float4(g0, g1, u0, u1);
}
// Where this thread's two rows of a warpgroup's 64 (rows r and r + 8: accumulator elements i with (i >> 1) & 1 = 0,
// 1) keep their z: the rows of `z_out`, n values each, of their sorted rows (GemmParams::z_row_offsets), or null for
// rows past the expert's.
__device__ __forceinline__ void z_rows_of(const GemmParams& p, int64_t expert, int64_t row_base, int64_t n,
                                          float* (&rows)[2]) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int64_t first = int64_t{p.z_row_offsets[expert]} - int64_t{p.tile_offsets[expert]} * kBlockM;
  const int64_t end = p.z_row_offsets[expert + 1];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = first + row_base + acc_row(warp, lane, 2 * h);
    rows[h] = row < end ? p.z_out + row * n : nullptr;
  }
}
// A gate_up_pair's z (gate j, j + 1 and up j, j + 1) into its row `z` of the first projection's float output
// kept for the backward, at the weights' columns (gate_col, up_col): two float2 (concatenated; a quad's four lanes
// write 32 contiguous bytes of each half) or one float4 of (g, u) pairs (interleaved).
__device__ __forceinline__ void save_gate_up_z(const ExpertsArgs& a, float* z, int64_t j, float4 v) {
  if (a.concatenated) {
    *reinterpret_cast<float2*>(z + j) = make_float2(v.x, v.y);
    *reinterpret_cast<float2*>(z + a.intermediate + j) = make_float2(v.z, v.w);
  } else {
    *reinterpret_cast<float4*>(z + 2 * j) = make_float4(v.x, v.z, v.y, v.w);
  }
}
// act(gate) * up of a gate_up_pair's two columns: kSilu, SiLU, the common case, inline (activate's arithmetic); the
// others through the call.
template <bool kSilu>
__device__ __forceinline__ float2 activate_gate_up(const ExpertsArgs& a, float4 v) {
  if constexpr (kSilu)
    return make_float2(silu(v.x) * v.z, silu(v.y) * v.w);
  else
    return activated_pair(a.act, a.has_gate, a.swiglu_limit, a.swiglu_alpha, v.x, v.z, v.y, v.w);
}
// The biases are added once (gate_up_pair), before the choice of activation: added in each arm, the bf16 gated
// kernels grew by a third (5,312 -> 7,064 instructions) and their DeepSeek-V3 layer ran 7% slower.
// act(gate) * up of accumulator pair i with the activation chosen at compile time, for epilogues that choose it once
// a tile.
template <typename T, int BN, bool kSilu>
__device__ __forceinline__ float2 gated_pair_as(const ExpertsArgs& a, const float* acc, const T* bias, int64_t j,
                                                int i) {
  return activate_gate_up<kSilu>(a, gate_up_pair<T, BN>(a, acc, bias, j, i));
}

// FP8's gated first projection quantised in its epilogue (Epilogue::gated_e4m3), in place of float rows
// and a pass of quantize_rows over them. A tile is 256 wide: the 128 gate and 128 up rows of the intermediate's
// 128-wide group n_block, so that once they are activated a quad holds a row's 128 values, two shuffles give the
// row's largest magnitude, and each value becomes the e4m3 code of value / scale: bit for bit what quantize_rows writes
// from the float rows (the same activated floats, scale and rounding). The codes go to the warpgroup's staging
// buffer (`staged`: 64 rows of 128 codes), which the copying warps store; the scales go straight to out_scales.
// The activation, and whether there are biases, are chosen once for the tile: chosen per pair, the branches and the
// call's set-up split the unrolled loop into pieces that missed the instruction cache.
template <typename T, int BN>
__device__ __forceinline__ void quantized_gated_epilogue(const GemmParams& p, const float* acc, int64_t expert,
                                                         int64_t tile_row, int n_block, int math, uint8_t* staged) {
  static_assert(BN == 256, "a tile holds its whole group of the intermediate");
  constexpr int kHalf = BN / 4;
  const ExpertsArgs& a = p.a;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const T* bias = a.up_bias ? static_cast<const T*>(a.up_bias) + expert * 2 * a.intermediate : nullptr;
  const int64_t col_base = int64_t{n_block} * (BN / 2);
  float h[kHalf];
  auto activate_tile = [&]<bool kSilu, bool kBias>() {
#pragma unroll
    for (int i = 0; i < kHalf; i += 2) {
      const float2 v = gated_pair_as<T, BN, kSilu>(a, acc, kBias ? bias : nullptr, col_base + acc_col(lane, i), i);
      h[i] = v.x, h[i + 1] = v.y;
    }
  };
  if (a.act == Act::silu && !bias)
    activate_tile.template operator()<true, false>();
  else if (a.act == Act::silu)
    activate_tile.template operator()<true, true>();
  else
    activate_tile.template operator()<false, true>();
  float amax[2] = {0.0f, 0.0f};  // rows r and r + 8 of the thread
#pragma unroll
  for (int i = 0; i < kHalf; ++i) amax[(i >> 1) & 1] = fmaxf(amax[(i >> 1) & 1], fabsf(h[i]));
  float scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2)
      amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], offset));
    scale[r] = activation_scale(amax[r], a.ue8m0_scales);
  }
  const ScaleDivisor divisor[2] = {scale_divisor(scale[0]), scale_divisor(scale[1])};
  // Two codes in one conversion (round to nearest even, saturating: what e4m3_value rounds to), .x in the low
  // byte, of the quotients rounded as quantize_rows' divisions round them.
  auto codes2 = [&](float v0, float v1, int r) {
    const float2 q = make_float2(divide_by_scale(v0, divisor[r]), divide_by_scale(v1, divisor[r]));
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3));
  };
  const int64_t row_base = tile_row + math * 64;
  constexpr int kPitch = kStagedPitch<64>;
  static_assert(kPitch == 128 + 16, "a staged row holds a group's 128 codes");
#pragma unroll
  for (int i = 0; i < kHalf; i += 2) {
    uint8_t* const at = staged + acc_row(warp, lane, i) * kPitch + acc_col(lane, i);
    *reinterpret_cast<uint16_t*>(at) = codes2(h[i], h[i + 1], (i >> 1) & 1);
  }
  if (lane % 4 == 0)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      p.out_scales[n_block * p.out_scale_rows + row_base + acc_row(warp, lane, 2 * r)] = scale[r];
}

// The epilogue of one warpgroup's 64 rows: into out, or (kStaged) into its staging buffer
// `staged`, whose rows copy_staged then stores.
template <typename T, typename O, int BN, Epilogue kEpi, bool kStaged = false>
__device__ __forceinline__ void store_epilogue(const GemmParams& p, const float* acc, const float (&weight)[2],
                                               int64_t expert, int64_t tile_row, int n_block, int math,
                                               uint8_t* staged = nullptr) {
  const ExpertsArgs& a = p.a;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int64_t row_base = tile_row + math * 64;
  constexpr bool kPacked = !std::is_same_v<O, float>;  // 2-byte outputs go through store_group_pair
  if constexpr (kEpi == Epilogue::gated) {
    constexpr int kHalf = BN / 4;
    const int64_t N = 2 * a.intermediate;
    const int64_t col_base = int64_t{n_block} * (BN / 2);
    const T* bias = a.up_bias ? static_cast<const T*>(a.up_bias) + expert * N : nullptr;
    const bool is_silu = a.act == Act::silu;
    // kSaveZ: z (gate and up with their biases) kept as float for the backward too, at the weights' own columns.
    auto epilogue = [&]<bool kSaveZ>() {
      float* z_row[2] = {nullptr, nullptr};
      if constexpr (kSaveZ) z_rows_of(p, expert, row_base, N, z_row);
#pragma unroll
      for (int m = 0; m < kHalf / 8; ++m) {
        uint32_t words[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = 8 * m + 2 * k;
          const int64_t j = col_base + acc_col(lane, i);
          // outputs is a multiple of 8, so j + 1 is inside when j is
          const float4 v = gate_up_pair<T, BN>(a, acc, j < p.outputs ? bias : nullptr, j, i);
          if constexpr (kSaveZ)
            if (j < p.outputs && z_row[k & 1]) save_gate_up_z(a, z_row[k & 1], j, v);
          const float2 h = is_silu ? activate_gate_up<true>(a, v) : activate_gate_up<false>(a, v);
          if constexpr (kStaged)
            stage_pair<O, BN / 2>(staged, acc_row(warp, lane, i), acc_col(lane, i), h);
          else if constexpr (kPacked)
            words[k] = pack2<O>(h.x, h.y);
          else if (j < p.outputs)
            store_pair(static_cast<O*>(p.out) + (row_base + acc_row(warp, lane, i)) * p.outputs + j, h);
        }
        if constexpr (kPacked && !kStaged)
          store_group_pair(static_cast<O*>(p.out), p.outputs, row_base, col_base, p.outputs, m, words, warp, lane);
      }
    };
    if (p.z_out)
      epilogue.template operator()<true>();
    else
      epilogue.template operator()<false>();
  } else {
    const int64_t col_base = int64_t{n_block} * BN;
    // This thread's biases: columns col_base + 2 (lane % 4) + 8 c for c = 0 .. BN / 8 - 1, `left` of them inside
    // the output. Addressed from one base with constant offsets: with a 64-bit column and bound per pair, the
    // bf16 store kernels spilled.
    const T* bias = nullptr;
    if (kEpi == Epilogue::activation && a.up_bias) bias = static_cast<const T*>(a.up_bias);
    if (kEpi == Epilogue::store && a.down_bias) bias = static_cast<const T*>(a.down_bias);
    const int64_t first_col = col_base + (lane % 4) * 2;
    if (bias) bias += expert * p.outputs + first_col;
    const int left = static_cast<int>(min(p.outputs - first_col, int64_t{BN}));
    float* z_row[2] = {nullptr, nullptr};  // activation, keeping z: this thread's two rows of it
    if (kEpi == Epilogue::activation && p.z_out) z_rows_of(p, expert, row_base, p.outputs, z_row);
#pragma unroll
    for (int m = 0; m < BN / 16; ++m) {
      uint32_t words[4], b[2] = {0, 0};  // the biases of column groups 2m and 2m + 1
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (bias && (2 * m + h) * 8 < left) b[h] = *reinterpret_cast<const uint32_t*>(bias + (2 * m + h) * 8);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = 8 * m + 2 * k;
        const int64_t j = col_base + acc_col(lane, i);
        const float2 bk = bias_pair<T>(b[k >> 1]);
        const float v0 = acc[i] + bk.x, v1 = acc[i + 1] + bk.y;
        float2 v;
        if constexpr (kEpi == Epilogue::activation) {
          if (z_row[k & 1] && j < p.outputs) *reinterpret_cast<float2*>(z_row[k & 1] + j) = make_float2(v0, v1);
          v = activated_pair(a.act, a.has_gate, a.swiglu_limit, a.swiglu_alpha, v0, 0.0f, v1, 0.0f);
        } else {
          const float w = weight[k & 1];
          v = make_float2(v0 * w, v1 * w);
        }
        if constexpr (kStaged)
          stage_pair<O, BN>(staged, acc_row(warp, lane, i), acc_col(lane, i), v);
        else if constexpr (kPacked)
          words[k] = pack2<O>(v.x, v.y);
        else if (j < p.outputs)
          store_pair(static_cast<O*>(p.out) + (row_base + acc_row(warp, lane, i)) * p.outputs + j, v);
      }
      if constexpr (kPacked && !kStaged)
        store_group_pair(static_cast<O*>(p.out), p.outputs, row_base, col_base, p.outputs, m, words, warp, lane);
    }
  }
}

// The copying warps' half of a staged epilogue: warpgroup math's 64 rows of the tile, from its staging buffer to
// `out`, rows of `outputs` elements O from row `tile_row` + 64 math and column `col_base` on (columns past
// `outputs`, a multiple of 8, are not stored), by the bulk copy engine: copying thread r < 64 issues row r as one
// bulk copy (cp.async.bulk, 16-byte aligned at both ends: the pitch and `outputs` are multiples of 16 bytes) and
// waits until the engine has read it, so the buffer is free when all have returned. The math warpgroup fenced its
// writes to the async proxy before its "staged" arrival.
template <typename O, int kCols>
__device__ __forceinline__ void copy_staged(O* out_rows, int64_t outputs, const uint8_t* staged, int64_t tile_row,
                                            int math, int64_t col_base, int copier) {
  if (copier >= 64) return;
  const int64_t cols = min(int64_t{kCols}, outputs - col_base);
  if (cols <= 0) return;
  O* const dst = out_rows + (tile_row + math * 64 + copier) * outputs + col_base;
  const auto src = static_cast<uint32_t>(__cvta_generic_to_shared(staged + copier * kStagedPitch<kCols>));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(static_cast<uint32_t>(cols * int64_t{sizeof(O)}))
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// kCluster 2: pairs of blocks (a cluster) take the row tiles 2p and 2p + 1 of the same column block.

// A math warpgroup's epilogue of tile t: stored, or (staged epilogues) written to its staging buffer once the copying
// warps are done with the previous tile's rows, fenced to the bulk copy engine, and handed to them.
template <class C>
__device__ __forceinline__ void finish_tile(const GemmParams& p, const float* acc, const float (&weight)[2],
                                            const Tile& t, int math, uint8_t* staged) {
  using T = typename C::T;
  using Out = typename C::Out;
  constexpr int BN = C::BN, kCols = C::kCols;
  constexpr Epilogue kEpi = C::kEpi;
  if constexpr (kEpi == Epilogue::gated_e4m3) {
    named_sync(5 + math, 128 + kCopyThreads);  // the copying warps are done with the previous tile's codes
    quantized_gated_epilogue<T, BN>(p, acc, t.expert, t.row, t.n_block, math, staged + math * kStagedBytes<kCols>);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the codes, to the bulk copy engine
    named_arrive(3 + math, 128 + kCopyThreads);
  } else if constexpr (C::kStaged) {
    named_sync(5 + math, 128 + kCopyThreads);  // the copying warps are done with the previous tile's rows
    store_epilogue<T, Out, BN, kEpi, true>(p, acc, weight, t.expert, t.row, t.n_block, math,
                                           staged + math * kStagedBytes<kCols>);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the rows, to the bulk copy engine
    named_arrive(3 + math, 128 + kCopyThreads);
  } else {
    store_epilogue<T, Out, BN, kEpi>(p, acc, weight, t.expert, t.row, t.n_block, math);
  }
}

}  // namespace moekit::cuda::hopper

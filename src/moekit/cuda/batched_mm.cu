// batched_mm on CUDA: every (token, expert) pair is multiplied by its expert's weights where they lie.
// Two kernels and no routing step: (1) for each pair, the gate and up rows of an intermediate column
// per warp, dot products over H with 16-byte weight loads, the activation applied at once; (2) for
// each (token, hidden column), one warp over the token's K pairs in order k = 0..K-1, with the bias
// and routing weight, so the weighted combine needs no atomics and no per-pair output. Built for
// decode, where the work is reading the chosen experts' weights once: each warp requests all the
// weight bytes of a round before it reads anything else, and on Hopper the second kernel starts while
// the first drains (programmatic dependent launch).
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>

#include "moekit/cuda/batched_mm_quantized_tensor_core.h"
#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/quantized_weights.cuh"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kColsPerWarp = 4;  // intermediate (kernel 1) or hidden (kernel 2) columns per warp
constexpr int kColsPerBlock = kWarps * kColsPerWarp;

// The up kernels' epilogue: acc holds the gate and up partial sums (gate, up, gate, up, ...) of kCols
// intermediate columns from j0; reduced over the warp, lane c < kCols adds the biases, applies the
// activation and writes column j0 + c of the pair's hidden row.
template <typename T, int kCols>
__device__ __forceinline__ void store_up_columns(const ExpertsArgs& a, int64_t e, int64_t pair, int64_t j0, int lane,
                                                 float (&acc)[2 * kCols], float* __restrict__ hidden) {
  const int64_t I = a.intermediate, N = a.has_gate ? 2 * I : I;
#pragma unroll
  for (int r = 0; r < 2 * kCols; ++r) acc[r] = warp_sum(acc[r]);
  if (lane >= kCols) return;
  float g = 0.0f, u = 0.0f;
#pragma unroll
  for (int r = 0; r < kCols; ++r)
    if (r == lane) g = acc[2 * r], u = acc[2 * r + 1];
  const int64_t j = j0 + lane;
  if (j >= I) return;
  if (a.up_bias) {
    const T* b = static_cast<const T*>(a.up_bias) + e * N;
    g += to_f(b[a.has_gate ? gate_col(a, j) : j]);
    if (a.has_gate) u += to_f(b[up_col(a, j)]);
  }
  hidden[pair * I + j] = activate(a, g, u);
}

// x [T, H] @ up_e [N, H]^T for each pair -> hidden [P, I] (float), activation applied; any H and
// alignment (rows that allow 16-byte loads take up_stream_kernel). grid (P, ceil(I / 16)), block 128,
// dynamic shared memory H floats.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32) up_rows_kernel(const ExpertsArgs a, float* __restrict__ hidden) {
  extern __shared__ float x_shared[];
  const int64_t pair = blockIdx.x, t = pair / a.top_k;
  const int64_t e = load_id(a, pair);
  if (e < 0 || e >= a.experts) return;  // sentinel (or invalid: the down kernel poisons that token)
  const int64_t H = a.hidden, I = a.intermediate, N = a.has_gate ? 2 * I : I;
  const T* x = static_cast<const T*>(a.x) + t * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) x_shared[h] = to_f(x[h]);
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j0 = (static_cast<int64_t>(blockIdx.y) * kWarps + warp) * kColsPerWarp;
  const T* w = static_cast<const T*>(a.up) + e * N * H;
  constexpr int kRows = 2 * kColsPerWarp;
  const T* rows[kRows];
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kColsPerWarp; ++r) {
    const int64_t j = min(j0 + r, I - 1);  // clamp: out-of-range columns compute a duplicate, not stored
    rows[2 * r] = w + (a.has_gate ? gate_col(a, j) : j) * H;
    rows[2 * r + 1] = w + (a.has_gate ? up_col(a, j) : j) * H;
    acc[2 * r] = acc[2 * r + 1] = 0.0f;
  }
  for (int64_t h = lane; h < H; h += 32) {
    const float xi = x_shared[h];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = fmaf(to_f(rows[r][h]), xi, acc[r]);
  }
  store_up_columns<T, kColsPerWarp>(a, e, pair, j0, lane, acc, hidden);
}

// ---------------------------------------------------------------------------------------------------
// The streaming kernels (rows of 16-byte multiples, 16-byte aligned): built so that the weight bytes
// of a warp's whole share are requested at once, before anything else it waits for. A warp takes one
// intermediate column (gate and up rows) or one output column (one down row per pair), issues
// kStreamLoads 16-byte loads per lane, and only then reads the activations it multiplies them by. With
// short rows (decode's whole job is reading the chosen experts' weights) a warp's work is one or two
// such rounds, so the layer costs about one memory latency plus the bytes over the bandwidth.
constexpr int kStreamLoads = 16;  // 16-byte weight loads in flight per lane
constexpr int kStreamBlocksPerSm = 4;

// hidden[pair, j] = act(gate_j . x_t + b, up_j . x_t + b) for the warp's column j (gated), or
// act(row_j . x_t + b) for its two columns j, j + 1 (ungated). grid (P, ceil(columns / 4)), 4 warps a
// block (the warps of a block share x).
template <typename T>
__global__ void __launch_bounds__(kWarps * 32, kStreamBlocksPerSm)
    up_stream_kernel(const ExpertsArgs a, float* __restrict__ hidden) {
  // The down kernel (launched as a programmatic dependent) may start now: it requests its own weights
  // and then waits for this grid's rows before reading them.
  allow_dependents();
  const int64_t H = a.hidden, I = a.intermediate, N = a.has_gate ? 2 * I : I;
  const int cols = a.has_gate ? 1 : 2;
  const int lane = threadIdx.x % 32;
  const int64_t pair = blockIdx.x, j = (static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32) * cols;
  if (j >= I) return;
  const int64_t e = load_id(a, pair);
  if (e < 0 || e >= a.experts) return;  // sentinel (or invalid: the down kernel poisons that token)
  const T* base = static_cast<const T*>(a.up) + e * N * H;
  // Gated: the gate and up rows of column j; ungated: columns j and j + 1 (clamped; not stored past I).
  const T* row0 = base + (a.has_gate ? gate_col(a, j) : j) * H;
  const T* row1 = base + (a.has_gate ? up_col(a, j) : min(j + 1, I - 1)) * H;
  const T* x = static_cast<const T*>(a.x) + (pair / a.top_k) * H;
  constexpr int V = kVec<T>, L = kStreamLoads / 2;
  float acc0 = 0.0f, acc1 = 0.0f;
  for (int64_t h0 = 0; h0 < H; h0 += 32 * V * L) {
    uint4 w0[L], w1[L], xv[L];
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int64_t h = h0 + (l * 32 + lane) * V;
      if (h < H) w0[l] = load_stream_raw(row0 + h), w1[l] = load_stream_raw(row1 + h);
    }
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int64_t h = h0 + (l * 32 + lane) * V;
      if (h < H) xv[l] = __ldg(reinterpret_cast<const uint4*>(x + h));
    }
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int64_t h = h0 + (l * 32 + lane) * V;
      if (h < H) acc0 = dot_vec<T>(w0[l], xv[l], acc0), acc1 = dot_vec<T>(w1[l], xv[l], acc1);
    }
  }
  acc0 = warp_sum(acc0);
  acc1 = warp_sum(acc1);
  if (lane != 0) return;
  const T* b = a.up_bias ? static_cast<const T*>(a.up_bias) + e * N : nullptr;
  float* out = hidden + pair * I;
  if (a.has_gate) {
    if (b) acc0 += to_f(b[gate_col(a, j)]), acc1 += to_f(b[up_col(a, j)]);
    out[j] = activate(a, acc0, acc1);
    return;
  }
  out[j] = activate(a, acc0 + (b ? to_f(b[j]) : 0.0f), 0.0f);
  if (j + 1 < I) out[j + 1] = activate(a, acc1 + (b ? to_f(b[j + 1]) : 0.0f), 0.0f);
}

// out[t, h] = sum_k w[t, k] * (down_e[h] . hidden[t * K + k] + b2[e, h]) for kStreamRows hidden
// columns h0.. of token t per block. Warp k takes pair k (and k + warps, ...): the kStreamRows
// consecutive down rows of its expert (one contiguous stretch of memory), loads running over (row,
// 16-byte piece) in order, kStreamLoads at a time; each row's dot product, reduced over the warp, goes
// to shared memory, and one thread per column then adds the pairs in order k = 0..K-1. Launched as a
// programmatic dependent of the up kernel (sm_90), a warp issues its first round of weight loads
// before griddepcontrol.wait. kFlat (rows of whole 32-lane pieces, H a multiple of kStreamRows): the
// block's rows of an expert are one run of pieces, so a round's loads are one address plus constants,
// which leaves the addresses out of the registers (measured: DeepSeek-V3 8 tokens 1.30 -> 1.25 ms).
// grid (T, ceil(H / kStreamRows)), block 32 * min(K, 8) (two blocks a multiprocessor), shared memory
// K * kStreamRows floats and the pair table.
constexpr int kStreamRows = 8;
constexpr int kStreamDownWarps = 8;

template <typename T, bool kFlat>
__global__ void __launch_bounds__(kStreamDownWarps * 32, 2)
    down_stream_kernel(const ExpertsArgs a, const float* hidden) {
  extern __shared__ float row_sums[];  // [K][R], then the pair table
  const int64_t H = a.hidden, I = a.intermediate, K = a.top_k;
  const int64_t t = blockIdx.x, h0 = static_cast<int64_t>(blockIdx.y) * kStreamRows;
  const PairSlot slot = load_pair_slot<T>(a, t);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  constexpr int V = kVec<T>, L = kStreamLoads, R = kStreamRows;
  const int pieces = static_cast<int>((I + 32 * V - 1) / (32 * V));  // 16-byte loads per lane per row
  const int total = R * pieces;
  for (int64_t k = warp; k < K; k += warps) {
    const int64_t pair = t * K + k, e = load_id(a, pair);
    const bool valid = e >= 0 && e < a.experts;
    const T* rows = static_cast<const T*>(a.down) + ((valid ? e : 0) * H + h0) * I;
    const float* hid = hidden + pair * I;
    float acc = 0.0f;
    int r0 = 0, c0 = 0;  // the row and piece of the round's first load
    for (int f0 = 0; f0 < total; f0 += L) {
      uint4 wv[L];
      if constexpr (kFlat) {  // load l of the round is piece f0 + l of the block's rows taken as one run
        const T* run = rows + (static_cast<int64_t>(f0) * 32 + lane) * V;
#pragma unroll
        for (int l = 0; l < L; ++l)
          if (valid && f0 + l < total) wv[l] = load_stream_raw(run + l * 32 * V);
        // A share of two rounds: the second round's pieces (the rest of the run) are fetched into L2 now,
        // so that they come from L2 once the first round has been used (Qwen3 1 token 0.027 -> 0.026 ms;
        // with four rounds, as at DeepSeek-V3's I = 2,048, prefetching each next round was slower).
        if (valid && lane == 0 && f0 == 0 && total > L && total <= 2 * L)
          prefetch_bulk_l2(rows + static_cast<int64_t>(L) * 32 * V, static_cast<uint32_t>(total - L) * 32 * 16);
      } else {
#pragma unroll
        for (int l = 0, r = r0, c = c0; l < L; ++l) {
          const int64_t i = (static_cast<int64_t>(c) * 32 + lane) * V;
          if (valid && f0 + l < total && h0 + r < H && i < I) wv[l] = load_stream_raw(rows + r * I + i);
          if (++c == pieces) c = 0, ++r;
        }
      }
      // The hidden rows come from the up kernel: wait for it (at once when launched plainly, or once done).
      wait_for_prerequisite();
#pragma unroll
      for (int l = 0; l < L; ++l) {
        if (f0 + l >= total) break;
        const int64_t i = (static_cast<int64_t>(c0) * 32 + lane) * V;
        if (valid && (kFlat || (h0 + r0 < H && i < I))) acc = dot_vec<T>(wv[l], hid + i, acc);
        if (++c0 == pieces) {  // row r0 is complete
          const float v = warp_sum(acc);
          if (lane == 0) row_sums[k * R + r0] = v;
          acc = 0.0f, c0 = 0, ++r0;
        }
      }
    }
  }
  float* pairs = row_sums + K * R;
  stash_pair_slots<T>(a, t, slot, pairs);
  __syncthreads();
  store_pairs_in_order<T>(a, t, h0, R, row_sums, 1, pairs);
}

// The down kernel for short rows (up to kPieces 32-lane pieces of 16 bytes a row), staged: a block takes
// kStreamRows hidden columns of a token and warp k pair k (and k + warps, ...), like down_stream_kernel,
// but each lane copies its pieces of the pair's rows into shared memory with cp.async, all of them at once
// and holding no registers, so a warp's whole share is requested when the block starts; after
// griddepcontrol.wait each lane loads its part of the pair's hidden row into registers (one round trip
// for all the rows, which all multiply the same values), and the products then read only shared memory
// and registers. The streaming kernel has rounds of register loads and reads the hidden values from L2
// piece by piece, so much of its work comes after its last weight bytes arrive (Qwen3-30B-A3B, 1 token,
// graphs: 0.026 -> 0.022-0.023 ms). A lane's pieces past the row's end (I not a multiple of 32 * kVec) and rows
// past H are neither copied nor used. grid (T, ceil(H / kStreamRows)), block 32 * min(K, 8); shared memory
// from launch_staged_down.
template <typename T, int kPieces>
__global__ void __launch_bounds__(kStreamDownWarps * 32, kPieces <= 3 ? 4 : 2)
    down_staged_kernel(const ExpertsArgs a, const float* hidden) {
  extern __shared__ uint4 staged[];  // [warps][kStreamRows * kPieces][32] pieces, row sums [K][R], pair table
  const int64_t H = a.hidden, I = a.intermediate, K = a.top_k;
  const int64_t t = blockIdx.x, h0 = static_cast<int64_t>(blockIdx.y) * kStreamRows;
  const PairSlot slot = load_pair_slot<T>(a, t);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  constexpr int V = kVec<T>, R = kStreamRows;
  const int rows_here = static_cast<int>(H - h0 < R ? H - h0 : R);
  uint4* mine = staged + warp * R * kPieces * 32 + lane;
  float* row_sums = reinterpret_cast<float*>(staged + warps * R * kPieces * 32);
  for (int64_t k = warp; k < K; k += warps) {
    const int64_t pair = t * K + k, e = load_id(a, pair);
    const bool valid = e >= 0 && e < a.experts;
    const T* rows = static_cast<const T*>(a.down) + ((valid ? e : 0) * H + h0) * I;
    // Short rows: every copy unrolled (measured faster); longer ones a row at a time (registers).
    constexpr int kCopyUnroll = kPieces <= 3 ? R : 1;
    if (valid)
#pragma unroll kCopyUnroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < kPieces; ++c) {
          const int i = (c * 32 + lane) * V;
          if (r < rows_here && i < I) cp_async16(mine + (r * kPieces + c) * 32, rows + r * I + i);
        }
    cp_async_commit();
    wait_for_prerequisite();
    // The pair's hidden row, kPieces * V floats a lane, in registers: one round trip for all the rows.
    float x[kPieces][V];
#pragma unroll
    for (int c = 0; c < kPieces; ++c) {
      const int i = (c * 32 + lane) * V;
#pragma unroll
      for (int j = 0; j < V; j += 4) {
        const float4 f = i < I ? *reinterpret_cast<const float4*>(hidden + pair * I + i + j) : float4{};
        x[c][j] = f.x, x[c][j + 1] = f.y, x[c][j + 2] = f.z, x[c][j + 3] = f.w;
      }
    }
    cp_async_wait_all();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float acc = 0.0f;
#pragma unroll
      for (int c = 0; c < kPieces; ++c) {
        if ((c * 32 + lane) * V >= I) continue;  // past the row: nothing was copied
        const uint4 w = mine[(r * kPieces + c) * 32];
        const T* we = reinterpret_cast<const T*>(&w);
#pragma unroll
        for (int j = 0; j < V; ++j) acc = fmaf(to_f(we[j]), x[c][j], acc);
      }
      const float v = warp_sum(acc);
      if (lane == 0) row_sums[k * R + r] = v;  // (an invalid pair's, or a row's past H, is never read)
    }
  }
  float* pairs = row_sums + K * R;
  stash_pair_slots<T>(a, t, slot, pairs);
  __syncthreads();
  store_pairs_in_order<T>(a, t, h0, R, row_sums, 1, pairs);
}

// Transposed up [E, H, N]: consecutive threads take consecutive columns (coalesced), four slices of
// H per column reduced through shared memory. grid (P, ceil(I / 64)), block (64, 4).
template <typename T>
__global__ void __launch_bounds__(256) up_cols_kernel(const ExpertsArgs a, float* __restrict__ hidden) {
  extern __shared__ float x_shared[];
  __shared__ float partial[4][64][2];
  const int64_t pair = blockIdx.x, t = pair / a.top_k;
  const int64_t e = load_id(a, pair);
  if (e < 0 || e >= a.experts) return;
  const int64_t H = a.hidden, I = a.intermediate, N = a.has_gate ? 2 * I : I;
  const T* x = static_cast<const T*>(a.x) + t * H;
  const int tid = threadIdx.y * 64 + threadIdx.x;
  for (int64_t h = tid; h < H; h += 256) x_shared[h] = to_f(x[h]);
  __syncthreads();
  const int64_t j = static_cast<int64_t>(blockIdx.y) * 64 + threadIdx.x;
  float g = 0.0f, u = 0.0f;
  if (j < I) {
    const T* w = static_cast<const T*>(a.up) + e * H * N;
    const int64_t gc = a.has_gate ? gate_col(a, j) : j, uc = a.has_gate ? up_col(a, j) : j;
    for (int64_t h = threadIdx.y; h < H; h += 4) {
      g = fmaf(to_f(w[h * N + gc]), x_shared[h], g);
      if (a.has_gate) u = fmaf(to_f(w[h * N + uc]), x_shared[h], u);
    }
  }
  partial[threadIdx.y][threadIdx.x][0] = g;
  partial[threadIdx.y][threadIdx.x][1] = u;
  __syncthreads();
  if (threadIdx.y == 0 && j < I) {
    g = partial[0][threadIdx.x][0] + partial[1][threadIdx.x][0] + partial[2][threadIdx.x][0] +
        partial[3][threadIdx.x][0];
    u = partial[0][threadIdx.x][1] + partial[1][threadIdx.x][1] + partial[2][threadIdx.x][1] +
        partial[3][threadIdx.x][1];
    if (a.up_bias) {
      const T* b = static_cast<const T*>(a.up_bias) + e * N;
      g += to_f(b[a.has_gate ? gate_col(a, j) : j]);
      if (a.has_gate) u += to_f(b[up_col(a, j)]);
    }
    hidden[pair * I + j] = activate(a, g, u);
  }
}

constexpr int kDownRows = 2, kPairsAtOnce = 4;  // the down kernels: hidden columns per warp, pairs at once

// The down kernels' epilogue: the pairs k0 .. k0 + kPairsAtOnce - 1 of token t (expert -1: skipped)
// reduced over the warp, biased, weighted by their routing weights and added to the output in order k.
template <typename T>
__device__ __forceinline__ void add_pairs_in_order(const ExpertsArgs& a, int64_t t, int64_t k0, int64_t h0,
                                                   const int64_t (&expert)[kPairsAtOnce],
                                                   float (&acc)[kPairsAtOnce][kDownRows], float (&out_acc)[kDownRows]) {
  const int64_t H = a.hidden;
#pragma unroll
  for (int q = 0; q < kPairsAtOnce; ++q) {  // in order k0, k0 + 1, ...
    if (expert[q] < 0) continue;
    const float route = load_routing_weight<T>(a, t * a.top_k + k0 + q);
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) {
      float v = warp_sum(acc[q][r]);
      if (a.down_bias) v += to_f(static_cast<const T*>(a.down_bias)[expert[q] * H + min(h0 + r, H - 1)]);
      out_acc[r] = fmaf(route, v, out_acc[r]);
    }
  }
}

// Lane r < kDownRows writes hidden column h0 + r of token t (NaN for a token with an invalid id).
template <typename T>
__device__ __forceinline__ void store_down_output(const ExpertsArgs& a, int64_t t, int64_t h0, int lane,
                                                  const float (&out_acc)[kDownRows], bool invalid) {
  if (lane >= kDownRows) return;
  float v = 0.0f;
#pragma unroll
  for (int r = 0; r < kDownRows; ++r)
    if (r == lane) v = out_acc[r];
  const int64_t h = h0 + lane;
  if (h < a.hidden) static_cast<T*>(a.out)[t * a.hidden + h] = from_f<T>(invalid ? __int_as_float(0x7fc00000) : v);
}

// out[t, h] = sum_k w[t, k] * (down_e[h] . hidden[t * K + k] + b2[e, h]), k in order; any I and
// alignment (rows that allow 16-byte loads take down_stream_kernel). Each warp takes kDownRows hidden
// columns and runs the K pairs kPairsAtOnce at a time with separate accumulators, then adds them to the
// output in order k = 0..K-1. grid (T, ceil(H / (4 * kDownRows))), block 128.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32) down_rows_kernel(const ExpertsArgs a, const float* __restrict__ hidden) {
  const int64_t t = blockIdx.x, H = a.hidden, I = a.intermediate;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t h0 = (static_cast<int64_t>(blockIdx.y) * kWarps + warp) * kDownRows;
  float out_acc[kDownRows] = {};
  bool invalid = false;
  for (int64_t k0 = 0; k0 < a.top_k; k0 += kPairsAtOnce) {
    const T* rows[kPairsAtOnce][kDownRows];
    const float* hid[kPairsAtOnce];
    int64_t expert[kPairsAtOnce];
    float acc[kPairsAtOnce][kDownRows];
#pragma unroll
    for (int q = 0; q < kPairsAtOnce; ++q) {
      const int64_t k = k0 + q, pair = t * a.top_k + k;
      const bool present = k < a.top_k;
      int64_t e = present ? load_id(a, pair) : -1;
      if (present && e < 0) invalid = true;
      if (e < 0 || e >= a.experts) e = -1;  // no work: past K, a sentinel or an invalid id
      expert[q] = e;
      // A skipped pair reads expert 0's rows and a valid hidden row but never adds them.
      const T* w = static_cast<const T*>(a.down) + (e < 0 ? 0 : e) * H * I;
      hid[q] = hidden + (e < 0 ? t * a.top_k : pair) * I;
#pragma unroll
      for (int r = 0; r < kDownRows; ++r) {
        rows[q][r] = w + min(h0 + r, H - 1) * I;
        acc[q][r] = 0.0f;
      }
    }
    for (int64_t i = lane; i < I; i += 32)
#pragma unroll
      for (int q = 0; q < kPairsAtOnce; ++q) {
        if (expert[q] < 0) continue;
        const float hi = hid[q][i];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) acc[q][r] = fmaf(to_f(rows[q][r][i]), hi, acc[q][r]);
      }
    add_pairs_in_order<T>(a, t, k0, h0, expert, acc, out_acc);
  }
  store_down_output<T>(a, t, h0, lane, out_acc, invalid);
}

// Transposed down [E, I, H]. grid (T, ceil(H / 64)), block (64, 4).
template <typename T>
__global__ void __launch_bounds__(256) down_cols_kernel(const ExpertsArgs a, const float* __restrict__ hidden) {
  __shared__ float partial[4][64];
  const int64_t t = blockIdx.x, H = a.hidden, I = a.intermediate;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * 64 + threadIdx.x;
  float out_acc = 0.0f;
  bool invalid = false;
  for (int64_t k = 0; k < a.top_k; ++k) {
    const int64_t pair = t * a.top_k + k;
    const int64_t e = load_id(a, pair);
    if (e < 0) invalid = true;
    if (e < 0 || e >= a.experts) continue;  // uniform across the block: no barrier divergence
    float v = 0.0f;
    if (h < H) {
      const T* w = static_cast<const T*>(a.down) + e * I * H;
      const float* hid = hidden + pair * I;
      for (int64_t i = threadIdx.y; i < I; i += 4) v = fmaf(to_f(w[i * H + h]), hid[i], v);
    }
    partial[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.y == 0 && h < H) {
      v = partial[0][threadIdx.x] + partial[1][threadIdx.x] + partial[2][threadIdx.x] + partial[3][threadIdx.x];
      if (a.down_bias) v += to_f(static_cast<const T*>(a.down_bias)[e * H + h]);
      out_acc = fmaf(load_routing_weight<T>(a, pair), v, out_acc);
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && h < H)
    static_cast<T*>(a.out)[t * H + h] = from_f<T>(invalid ? __int_as_float(0x7fc00000) : out_acc);
}

// ---------------------------------------------------------------------------------------------------
// Block-quantised weights (DESIGN §3): FP8 e4m3 with 128 x 128 block scales, FP4 e2m1 pairs with a ue8m0
// scale per 32 values. The activations are quantised first, per row and 128-wide group, into a float
// buffer of the values the products use (q * scale), bit for bit as quantize_activations on the CPU; then
// the same two products as above read the weight bytes 16 at a time, convert them in registers and apply
// each scale block's scale to that block's partial sum (a 16-byte load never straddles two blocks).

// sum_i e4m3(raw[i]) * x[i] over the 16 codes of raw, converting two at a time (the loads of all rows are
// issued before any conversion, so many bytes are in flight per warp).
__device__ __forceinline__ float dot_e4m3x16(const uint4 raw, const float* x) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  float partial = 0.0f;
#pragma unroll
  for (int w = 0; w < 4; ++w)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * h));
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      partial = fmaf(f.x, x[4 * w + 2 * h], partial);
      partial = fmaf(f.y, x[4 * w + 2 * h + 1], partial);
    }
  return partial;
}

// sum_i code_i * x[i] over the codes of one 16-byte load (16 e4m3 or 32 e2m1 values), before the scale.
template <WeightFormat F>
__device__ __forceinline__ float dot_codes(const uint4 raw, const float* x) {
  if constexpr (F == WeightFormat::fp8_e4m3) {
    return dot_e4m3x16(raw, x);
  } else {
    uint32_t w[4];
    words_of(raw, w);
    float partial = 0.0f;
#pragma unroll
    for (int i = 0; i < kValuesPer16Bytes<F>; ++i) partial = fmaf(code_in<F>(w, i), x[i], partial);
    return partial;
  }
}

// Intermediate columns per warp of the quantised up kernel. FP8 rows are half as long as bf16 ones: twice
// the columns keep as many bytes in flight. An FP4 load holds 32 values, so a lane keeps twice the
// activations live per load; 4 columns (bf16's bytes in flight per lane) stay within the registers.
template <WeightFormat F>
constexpr int kQuantizedColsPerWarp = F == WeightFormat::fp8_e4m3 ? 8 : 4;

// up: xq [T, H] (quantised) @ up_e [N, H]^T per pair -> hidden [P, I] (float), activation applied.
// grid (P, ceil(I / (4 * kQuantizedColsPerWarp<F>))), block 128, dynamic shared memory H floats.
template <typename T, WeightFormat F, bool kVectorised>
__global__ void __launch_bounds__(kWarps * 32)
    up_rows_quantized_kernel(const ExpertsArgs a, const float* __restrict__ xq, float* __restrict__ hidden) {
  using Q = QuantizedFormat<F>;
  extern __shared__ float x_shared[];
  const int64_t pair = blockIdx.x, t = pair / a.top_k;
  const int64_t e = load_id(a, pair);
  if (e < 0 || e >= a.experts) return;
  const int64_t H = a.hidden, I = a.intermediate, N = a.has_gate ? 2 * I : I;
  const int64_t row_bytes = H / Q::kValuesPerByte;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) x_shared[h] = xq[t * H + h];
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kCols = kQuantizedColsPerWarp<F>, kRows = 2 * kCols;
  const int64_t j0 = (static_cast<int64_t>(blockIdx.y) * kWarps + warp) * kCols;
  const uint8_t* w = static_cast<const uint8_t*>(a.up) + e * N * row_bytes;
  const uint8_t* rows[kRows];
  int64_t scale_row[kRows];
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kCols; ++r) {
    const int64_t j = min(j0 + r, I - 1);
    const int64_t gr = a.has_gate ? gate_col(a, j) : j, ur = a.has_gate ? up_col(a, j) : j;
    rows[2 * r] = w + gr * row_bytes;
    rows[2 * r + 1] = w + ur * row_bytes;
    scale_row[2 * r] = Q::scale_row(e, gr, N, H);
    scale_row[2 * r + 1] = Q::scale_row(e, ur, N, H);
    acc[2 * r] = acc[2 * r + 1] = 0.0f;
  }
  if constexpr (kVectorised) {
    constexpr int V = kValuesPer16Bytes<F>;
    for (int64_t h = lane * V; h < H; h += 32 * V) {
      uint4 raw[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) raw[r] = __ldcs(reinterpret_cast<const uint4*>(rows[r] + h / Q::kValuesPerByte));
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        acc[r] = fmaf(block_scale_at(a, a.up_scale, scale_row[r] + h / Q::kBlockK), dot_codes<F>(raw[r], x_shared + h),
                      acc[r]);
    }
  } else {
    for (int64_t h = lane; h < H; h += 32) {
      const float xi = x_shared[h];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        acc[r] = fmaf(Q::code(rows[r], h) * block_scale_at(a, a.up_scale, scale_row[r] + h / Q::kBlockK), xi, acc[r]);
    }
  }
  store_up_columns<T, kCols>(a, e, pair, j0, lane, acc, hidden);
}

// down: out[t, h] = sum_k w[t, k] * (down_e[h] . hq[t * K + k] + b2[e, h]), k in order; hq quantised.
// Each warp takes kDownRows hidden columns and kPairsAtOnce pairs at a time (their loads issued together),
// adding the pairs to the output in order k = 0..K-1. grid (T, ceil(H / 8)), block 128.
template <typename T, WeightFormat F, bool kVectorised>
__global__ void __launch_bounds__(kWarps * 32)
    down_rows_quantized_kernel(const ExpertsArgs a, const float* __restrict__ hidden) {
  using Q = QuantizedFormat<F>;
  const int64_t t = blockIdx.x, H = a.hidden, I = a.intermediate;
  const int64_t row_bytes = I / Q::kValuesPerByte;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t h0 = (static_cast<int64_t>(blockIdx.y) * kWarps + warp) * kDownRows;
  float out_acc[kDownRows] = {};
  bool invalid = false;
  for (int64_t k0 = 0; k0 < a.top_k; k0 += kPairsAtOnce) {
    const uint8_t* rows[kPairsAtOnce][kDownRows];
    int64_t scale_row[kPairsAtOnce][kDownRows];
    const float* hid[kPairsAtOnce];
    int64_t expert[kPairsAtOnce];
    float acc[kPairsAtOnce][kDownRows];
#pragma unroll
    for (int q = 0; q < kPairsAtOnce; ++q) {
      const int64_t k = k0 + q, pair = t * a.top_k + k;
      const bool present = k < a.top_k;
      int64_t e = present ? load_id(a, pair) : -1;
      if (present && e < 0) invalid = true;
      if (e < 0 || e >= a.experts) e = -1;
      expert[q] = e;
      const int64_t ee = e < 0 ? 0 : e;
      const uint8_t* w = static_cast<const uint8_t*>(a.down) + ee * H * row_bytes;
      hid[q] = hidden + (e < 0 ? t * a.top_k : pair) * I;
#pragma unroll
      for (int r = 0; r < kDownRows; ++r) {
        const int64_t h = min(h0 + r, H - 1);
        rows[q][r] = w + h * row_bytes;
        scale_row[q][r] = Q::scale_row(ee, h, H, I);
        acc[q][r] = 0.0f;
      }
    }
    if constexpr (kVectorised) {
      constexpr int V = kValuesPer16Bytes<F>;
      for (int64_t i = lane * V; i < I; i += 32 * V) {
        uint4 raw[kPairsAtOnce][kDownRows];
#pragma unroll
        for (int q = 0; q < kPairsAtOnce; ++q)
#pragma unroll
          for (int r = 0; r < kDownRows; ++r)
            if (expert[q] >= 0) raw[q][r] = __ldcs(reinterpret_cast<const uint4*>(rows[q][r] + i / Q::kValuesPerByte));
#pragma unroll
        for (int q = 0; q < kPairsAtOnce; ++q) {
          if (expert[q] < 0) continue;
          float hv[V];
#pragma unroll
          for (int v = 0; v < V; v += 4) {
            const float4 f = *reinterpret_cast<const float4*>(hid[q] + i + v);
            hv[v] = f.x, hv[v + 1] = f.y, hv[v + 2] = f.z, hv[v + 3] = f.w;
          }
#pragma unroll
          for (int r = 0; r < kDownRows; ++r)
            acc[q][r] = fmaf(block_scale_at(a, a.down_scale, scale_row[q][r] + i / Q::kBlockK),
                             dot_codes<F>(raw[q][r], hv), acc[q][r]);
        }
      }
    } else {
      for (int64_t i = lane; i < I; i += 32)
#pragma unroll
        for (int q = 0; q < kPairsAtOnce; ++q) {
          if (expert[q] < 0) continue;
#pragma unroll
          for (int r = 0; r < kDownRows; ++r)
            acc[q][r] = fmaf(Q::code(rows[q][r], i) * block_scale_at(a, a.down_scale, scale_row[q][r] + i / Q::kBlockK),
                             hid[q][i], acc[q][r]);
        }
    }
    add_pairs_in_order<T>(a, t, k0, h0, expert, acc, out_acc);
  }
  store_down_output<T>(a, t, h0, lane, out_acc, invalid);
}

// hidden: [P, I] floats, then xq: [T, H] floats (the workspace of batched_mm_workspace_bytes).
template <typename T, WeightFormat F>
void launch_quantized_format(const ExpertsArgs& a, float* hidden, cudaStream_t stream) {
  const int64_t P = a.tokens * a.top_k;
  MOEKIT_CHECK(!a.transposed, "batched_mm: quantised weights must not be transposed (validated earlier)");
  float* xq = hidden + P * a.intermediate;
  const std::size_t x_bytes = static_cast<std::size_t>(a.hidden) * sizeof(float);
  QuantizedRows x_values, hidden_values;
  x_values.values = xq;
  hidden_values.values = hidden;
  quantize_rows_kernel<T><<<static_cast<unsigned>(a.tokens), 128, 0, stream>>>(static_cast<const T*>(a.x), a.hidden,
                                                                               a.ue8m0_scales, x_values);
  MOEKIT_CUDA_CHECK_LAUNCH();
  // 16-byte loads of whole rows: rows of a multiple of 16 bytes, 16-byte aligned.
  constexpr int V = kValuesPer16Bytes<F>;
  const bool vec_up = a.hidden % V == 0 && aligned16(a.up);
  const bool vec_down = a.intermediate % V == 0 && aligned16(a.down) && aligned16(hidden);
  auto* up_kernel = vec_up ? up_rows_quantized_kernel<T, F, true> : up_rows_quantized_kernel<T, F, false>;
  allow_dynamic_shared_memory(reinterpret_cast<const void*>(up_kernel), x_bytes);
  constexpr int kUpPerBlock = kWarps * kQuantizedColsPerWarp<F>;
  up_kernel<<<dim3(static_cast<unsigned>(P), static_cast<unsigned>((a.intermediate + kUpPerBlock - 1) / kUpPerBlock)),
              kWarps * 32, x_bytes, stream>>>(a, xq, hidden);
  MOEKIT_CUDA_CHECK_LAUNCH();
  quantize_rows_kernel<float>
      <<<static_cast<unsigned>(P), 128, 0, stream>>>(hidden, a.intermediate, a.ue8m0_scales, hidden_values);
  MOEKIT_CUDA_CHECK_LAUNCH();
  auto* down_kernel = vec_down ? down_rows_quantized_kernel<T, F, true> : down_rows_quantized_kernel<T, F, false>;
  constexpr int kDownPerBlock = kWarps * kDownRows;
  down_kernel<<<dim3(static_cast<unsigned>(a.tokens),
                     static_cast<unsigned>((a.hidden + kDownPerBlock - 1) / kDownPerBlock)),
                kWarps * 32, 0, stream>>>(a, hidden);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_quantized(const ExpertsArgs& a, float* hidden, cudaStream_t stream) {
  if (a.fp4())
    launch_quantized_format<T, WeightFormat::fp4_e2m1>(a, hidden, stream);
  else
    launch_quantized_format<T, WeightFormat::fp8_e4m3>(a, hidden, stream);
}

// Launches down_staged_kernel with config (the streaming kernel's grid, block and attributes) where two
// blocks' staging fits a multiprocessor's shared memory and a row is at most 3 pieces, or 4-6 pieces with
// the grid in one wave; returns whether it did. Measured (H200, graphs): Qwen3-30B-A3B (3 pieces) faster
// at 1, 8 and 16 tokens; Qwen1.5-MoE-A2.7B (6 pieces, 4 warps a block) 0.030 -> 0.023 ms at 1 token but
// 0.131 -> 0.139 at 8, where the blocks run in waves with 8 warps a multiprocessor.
template <typename T>
bool launch_staged_down(const ExpertsArgs& a, const float* hidden, cudaLaunchConfig_t config, int64_t down_shared) {
  constexpr int V = kVec<T>;
  const int64_t pieces = (a.intermediate + 32 * V - 1) / (32 * V), warps = std::min<int64_t>(a.top_k, kStreamDownWarps);
  const int64_t bytes = warps * kStreamRows * pieces * 32 * 16 + down_shared;
  using Kernel = void (*)(ExpertsArgs, const float*);
  constexpr Kernel kernels[] = {down_staged_kernel<T, 1>, down_staged_kernel<T, 2>, down_staged_kernel<T, 3>,
                                down_staged_kernel<T, 4>, down_staged_kernel<T, 5>, down_staged_kernel<T, 6>};
  const int64_t blocks = static_cast<int64_t>(config.gridDim.x) * config.gridDim.y;
  const bool one_wave = blocks <= 2 * static_cast<int64_t>(multiprocessor_count());
  // Two blocks a multiprocessor (1 KB of each block's share is the system's).
  if (pieces > 6 || (pieces > 3 && !one_wave) || bytes > max_shared_memory_per_block() ||
      2 * (bytes + 1024) > shared_memory_per_multiprocessor())
    return false;
  const Kernel kernel = kernels[pieces - 1];
  allow_dynamic_shared_memory(reinterpret_cast<const void*>(kernel), static_cast<std::size_t>(bytes));
  config.dynamicSmemBytes = static_cast<std::size_t>(bytes);
  MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, a, hidden));
  return true;
}

template <typename T>
void launch(const ExpertsArgs& a, float* hidden, cudaStream_t stream) {
  const int64_t P = a.tokens * a.top_k;
  const std::size_t x_bytes = static_cast<std::size_t>(a.hidden) * sizeof(float);
  MOEKIT_CHECK(x_bytes <= 200 * 1024, "batched_mm on CUDA keeps one hidden row in shared memory; H = ", a.hidden,
               " is too large");
  MOEKIT_CHECK(P <= 0x7fffffff && a.tokens <= 0x7fffffff, "batched_mm: too many pairs for one launch");
  if (P == 0) return;
  if (a.quantized()) return launch_quantized<T>(a, hidden, stream);
  if (a.transposed) {
    auto* up_kernel = up_cols_kernel<T>;
    allow_dynamic_shared_memory(reinterpret_cast<const void*>(up_kernel), x_bytes);
    up_kernel<<<dim3(static_cast<unsigned>(P), static_cast<unsigned>((a.intermediate + 63) / 64)), dim3(64, 4), x_bytes,
                stream>>>(a, hidden);
    MOEKIT_CUDA_CHECK_LAUNCH();
    down_cols_kernel<T><<<dim3(static_cast<unsigned>(a.tokens), static_cast<unsigned>((a.hidden + 63) / 64)),
                          dim3(64, 4), 0, stream>>>(a, hidden);
    MOEKIT_CUDA_CHECK_LAUNCH();
    return;
  }
  constexpr int V = kVec<T>;
  const bool stream_up = a.hidden % V == 0 && aligned16(a.up) && aligned16(a.x);
  const bool stream_down = a.intermediate % V == 0 && aligned16(a.down) && aligned16(hidden);
  if (stream_up) {
    const int64_t columns_per_pair = a.has_gate ? a.intermediate : (a.intermediate + 1) / 2;
    MOEKIT_CHECK((columns_per_pair + kWarps - 1) / kWarps <= 65535, "batched_mm on CUDA: intermediate size ",
                 a.intermediate, " is too large for one launch");
    up_stream_kernel<T>
        <<<dim3(static_cast<unsigned>(P), static_cast<unsigned>((columns_per_pair + kWarps - 1) / kWarps)), kWarps * 32,
           0, stream>>>(a, hidden);
  } else {
    allow_dynamic_shared_memory(reinterpret_cast<const void*>(up_rows_kernel<T>), x_bytes);
    up_rows_kernel<T>
        <<<dim3(static_cast<unsigned>(P), static_cast<unsigned>((a.intermediate + kColsPerBlock - 1) / kColsPerBlock)),
           kWarps * 32, x_bytes, stream>>>(a, hidden);
  }
  MOEKIT_CUDA_CHECK_LAUNCH();
  if (!stream_down) {
    constexpr int kDownPerBlock = kWarps * kDownRows;
    down_rows_kernel<T>
        <<<dim3(static_cast<unsigned>(a.tokens), static_cast<unsigned>((a.hidden + kDownPerBlock - 1) / kDownPerBlock)),
           kWarps * 32, 0, stream>>>(a, hidden);
    MOEKIT_CUDA_CHECK_LAUNCH();
    return;
  }
  // On Hopper the down kernel is a programmatic dependent of the up kernel (griddepcontrol in both;
  // capturable in graphs): its blocks start while the up kernel drains and request their first round
  // of weights before waiting for the hidden rows.
  const int64_t down_shared = a.top_k * kStreamRows * static_cast<int64_t>(sizeof(float)) + pair_table_bytes(a.top_k);
  MOEKIT_CHECK(down_shared <= 48 * 1024, "batched_mm: top_k = ", a.top_k, " is too large");
  cudaLaunchConfig_t config{};
  config.gridDim =
      dim3(static_cast<unsigned>(a.tokens), static_cast<unsigned>((a.hidden + kStreamRows - 1) / kStreamRows));
  config.blockDim = dim3(32 * static_cast<unsigned>(std::min<int64_t>(a.top_k, kStreamDownWarps)));
  config.dynamicSmemBytes = static_cast<std::size_t>(down_shared);
  config.stream = stream;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  if (device_is_sm90()) {
    config.attrs = &dependent;
    config.numAttrs = 1;
  }
  // Rows of whole pieces and whole blocks of rows: every block's rows are one run (the flat loads).
  const bool flat = a.intermediate % (32 * V) == 0 && a.hidden % kStreamRows == 0;
  if (launch_staged_down<T>(a, static_cast<const float*>(hidden), config, down_shared)) return;
  MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&config, flat ? down_stream_kernel<T, true> : down_stream_kernel<T, false>, a,
                                       static_cast<const float*>(hidden)));
}

}  // namespace

std::size_t batched_mm_workspace_bytes(const ExpertsArgs& a) {
  if (batched_mm_quantized_tensor_core_runs(a)) return batched_mm_quantized_tensor_core_workspace_bytes(a);
  const int64_t quantised_x = a.quantized() ? a.tokens * a.hidden : 0;
  return static_cast<std::size_t>(a.tokens * a.top_k * a.intermediate + quantised_x) * sizeof(float);
}

std::string batched_mm_kernel_path(const ExpertsArgs& a) {
  const char* codes = a.fp8() ? "e4m3" : "e2m1";
  if (batched_mm_quantized_tensor_core_runs(a))
    return std::string("batched_mm on the tensor cores (mma.sync) over ") + codes + " weight codes";
  if (a.quantized())
    return std::string("batched_mm weight-streaming gemv over ") + codes + " weight codes (CUDA cores)";
  return "batched_mm weight-streaming gemv (" + std::string(dtype_name(a.dtype)) + ", CUDA cores)";
}

void batched_mm_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  if (batched_mm_quantized_tensor_core_runs(a)) return batched_mm_quantized_tensor_core_forward(a, workspace, stream);
  visit_float_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch<T>(a, static_cast<float*>(workspace), stream);
  });
}

}  // namespace moekit::cuda

// Device-side helpers shared by the CUDA kernels: element conversion of moekit's storage types,
// 16-byte vector loads, warp reductions and the activations of the contract.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "moekit/cuda/experts_cuda.h"
#include "moekit/dtype.h"

namespace moekit::cuda {

__device__ __forceinline__ float to_f(float v) {
  return v;
}
__device__ __forceinline__ float to_f(bf16 v) {
  return __uint_as_float(static_cast<uint32_t>(v.bits) << 16);
}
__device__ __forceinline__ float to_f(f16 v) {
  return __half2float(__ushort_as_half(v.bits));
}
__device__ __forceinline__ float to_f(int32_t v) {
  return static_cast<float>(v);
}

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float v) {
  return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(v))};
}
template <>
__device__ __forceinline__ f16 from_f<f16>(float v) {
  return f16{__half_as_ushort(__float2half_rn(v))};
}

// Elements of T in one 16-byte load.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

// Loads kVec<T> elements (16 bytes, aligned) as floats.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[kVec<T>]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) v[i] = to_f(e[i]);
}

// Streaming 16-byte load (aligned) for weights read once: does not keep them in L1. kL2Piece = 256: a
// miss fetches the whole aligned 256-byte piece into L2, for callers whose next loads read the rest of
// it soon (batched_mm's quantised tensor-core kernels read 64 bytes of a row per load instruction).
template <int kL2Piece = 0>
__device__ __forceinline__ uint4 load_stream_raw(const void* p) {
  static_assert(kL2Piece == 0 || kL2Piece == 256, "L2 piece: 0 (as requested) or 256 bytes");
  uint4 raw;
  if constexpr (kL2Piece == 256)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
                 : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
                 : "l"(p));
  return raw;
}

// The same load, converted to floats.
template <typename T>
__device__ __forceinline__ void load_vec_stream(const T* p, float (&v)[kVec<T>]) {
  const uint4 raw = load_stream_raw(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) v[i] = to_f(e[i]);
}

// Programmatic dependent launch (sm_90; no-ops before): lets the kernel launched after this one as a
// programmatic dependent start now.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the grid this one depends on has finished and its writes are visible (at once when the
// kernel was launched plainly).
__device__ __forceinline__ void wait_for_prerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Asks for bytes (a multiple of 16) from p (16-byte aligned) to be brought into L2, holding no registers
// and waiting for nothing (sm_90's bulk prefetch; a no-op before).
__device__ __forceinline__ void prefetch_bulk_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// 16 bytes from global memory into shared memory by cp.async (through L2 only, holding no registers).
// Complete after cp_async_commit and cp_async_wait; the "memory" clobbers keep the compiler from moving
// shared-memory accesses across them.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
      "l"(gmem)
      : "memory");
}
// The same, where valid = false fills the 16 bytes with zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
      "l"(gmem), "r"(valid ? 16 : 0)
      : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N groups of this thread's copies are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Waits until all of this thread's copies are complete.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// acc + sum_i w[i] * x[i] over the kVec<T> elements of two 16-byte loads of T.
template <typename T>
__device__ __forceinline__ float dot_vec(const uint4 w, const uint4 x, float acc) {
  const T* we = reinterpret_cast<const T*>(&w);
  const T* xe = reinterpret_cast<const T*>(&x);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) acc = fmaf(to_f(we[i]), to_f(xe[i]), acc);
  return acc;
}

// acc + sum_i w[i] * x[i] over the kVec<T> elements of a 16-byte load of T and kVec<T> floats at x
// (16-byte aligned), by plain (L1-cached) loads: x may come from the grid this one depends on, after
// griddepcontrol.wait, and is read by many warps of the block.
template <typename T>
__device__ __forceinline__ float dot_vec(const uint4 w, const float* x, float acc) {
  const T* we = reinterpret_cast<const T*>(&w);
#pragma unroll
  for (int i = 0; i < kVec<T>; i += 4) {
    const float4 f = *reinterpret_cast<const float4*>(x + i);
    acc = fmaf(to_f(we[i]), f.x, acc);
    acc = fmaf(to_f(we[i + 1]), f.y, acc);
    acc = fmaf(to_f(we[i + 2]), f.z, acc);
    acc = fmaf(to_f(we[i + 3]), f.w, acc);
  }
  return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The reciprocal by the approximate instruction (__fdividef, ~2 ulp): the IEEE division was ~10 instructions
// with a branch to a slow path, which made the activation most of the fused epilogues' instructions. For
// very negative x, __expf(-x) is inf and the result 0, the limit.
__device__ __forceinline__ float sigmoid(float x) {
  return __fdividef(1.0f, 1.0f + __expf(-x));
}

__device__ __forceinline__ float silu(float g) {
  return g * sigmoid(g);
}

// act(gate) * up for gated experts, act(gate) alone otherwise; the GPT-OSS clamped SwiGLU uses both.
__device__ __forceinline__ float activate(const ExpertsArgs& a, float g, float u) {
  float h;
  switch (a.act) {
    case Act::silu:
      h = silu(g);
      break;
    case Act::gelu:
      h = 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
      break;
    case Act::gelu_tanh:
      h = 0.5f * g * (1.0f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g)));
      break;
    case Act::relu:
      h = fmaxf(g, 0.0f);
      break;
    case Act::relu2: {
      const float r = fmaxf(g, 0.0f);
      h = r * r;
      break;
    }
    case Act::clamped_swiglu: {
      const float gc = fminf(g, a.swiglu_limit);
      const float uc = fminf(fmaxf(u, -a.swiglu_limit), a.swiglu_limit);
      return (uc + 1.0f) * gc * sigmoid(a.swiglu_alpha * gc);
    }
  }
  return a.has_gate ? h * u : h;
}

// Columns of the first projection holding gate j and up j.
__device__ __forceinline__ int64_t gate_col(const ExpertsArgs& a, int64_t j) {
  return a.concatenated ? j : 2 * j;
}
__device__ __forceinline__ int64_t up_col(const ExpertsArgs& a, int64_t j) {
  return a.concatenated ? a.intermediate + j : 2 * j + 1;
}

__device__ __forceinline__ int64_t load_id(const ExpertsArgs& a, int64_t i) {
  return a.index_dtype == DType::i32 ? static_cast<int64_t>(static_cast<const int32_t*>(a.ids)[i])
                                     : static_cast<const int64_t*>(a.ids)[i];
}

template <typename T>
__device__ __forceinline__ float load_routing_weight(const ExpertsArgs& a, int64_t i) {
  return a.routing_dtype == DType::f32 ? static_cast<const float*>(a.routing_weights)[i]
                                       : to_f(static_cast<const T*>(a.routing_weights)[i]);
}

// Token t's pairs as the end of a second projection needs them, in a table in shared memory: K routing
// weights (floats), then K expert codes (int32: the expert, -1 for an invalid id, -2 for a sentinel or an
// id past the experts), pair_table_bytes(K) in all. Filled either from registers (load_pair_slot when the
// kernel starts: thread k's loads of pair k stay in flight through the main loop; stash_pair_slots before
// the block's last barrier), or by one warp after its products (load_pair_table: the K pairs in one round
// trip, where the kernel has no registers to spare). Before, the end of every block made K dependent
// global round trips after its products were done.
__host__ __device__ constexpr int64_t pair_table_bytes(int64_t top_k) {
  return top_k * static_cast<int64_t>(sizeof(float) + sizeof(int32_t));
}

struct PairSlot {
  int64_t expert = 0;
  float route = 0.0f;
};

template <typename T>
__device__ __forceinline__ PairSlot load_pair_slot(const ExpertsArgs& a, int64_t t) {
  PairSlot s;
  if (threadIdx.x < a.top_k) {
    const int64_t pair = t * a.top_k + threadIdx.x;
    s.expert = load_id(a, pair);
    s.route = load_routing_weight<T>(a, pair);
  }
  return s;
}

__device__ __forceinline__ void set_pair_entry(const ExpertsArgs& a, float* table, int64_t k, int64_t e, float route) {
  table[k] = route;
  reinterpret_cast<int32_t*>(table + a.top_k)[k] = e < 0 ? -1 : e >= a.experts ? -2 : static_cast<int32_t>(e);
}

// Fills the table from every thread's slot (pairs past the block loaded here). Call before the barrier
// that precedes store_pairs_in_order.
template <typename T>
__device__ __forceinline__ void stash_pair_slots(const ExpertsArgs& a, int64_t t, const PairSlot& slot, float* table) {
  for (int64_t k = threadIdx.x; k < a.top_k; k += blockDim.x) {
    if (k == threadIdx.x)
      set_pair_entry(a, table, k, slot.expert, slot.route);
    else
      set_pair_entry(a, table, k, load_id(a, t * a.top_k + k), load_routing_weight<T>(a, t * a.top_k + k));
  }
}

// Fills the table by the calling warp (all its lanes), for the same warp to read.
template <typename T>
__device__ __forceinline__ void load_pair_table(const ExpertsArgs& a, int64_t t, float* table) {
  for (int64_t k = threadIdx.x % 32; k < a.top_k; k += 32)
    set_pair_entry(a, table, k, load_id(a, t * a.top_k + k), load_routing_weight<T>(a, t * a.top_k + k));
  __syncwarp();
}

// The end of a second projection whose pairs' row sums are in row_sums [splits][K][rows] (each pair's sum
// over `splits` slices of k) and whose pairs are in the table at pairs: thread r < rows writes column
// h0 + r of token t, adding a pair's slices in order and then, in order k, bias plus sum times the pair's
// routing weight (NaN for a token with an invalid id; sentinels skipped). Deterministic: no atomics.
template <typename T>
__device__ __forceinline__ void store_pairs_in_order(const ExpertsArgs& a, int64_t t, int64_t h0, int rows,
                                                     const float* row_sums, int splits, const float* pairs) {
  const int64_t H = a.hidden, K = a.top_k, h = h0 + threadIdx.x;
  if (static_cast<int>(threadIdx.x) >= rows || h >= H) return;
  const int32_t* expert = reinterpret_cast<const int32_t*>(pairs + K);
  float out = 0.0f;
  bool invalid = false;
  for (int64_t k = 0; k < K; ++k) {  // in order
    const int32_t e = expert[k];
    if (e == -1) invalid = true;
    if (e < 0) continue;
    float v = row_sums[k * rows + threadIdx.x];
    for (int s = 1; s < splits; ++s) v += row_sums[(s * K + k) * rows + threadIdx.x];
    const float bias = a.down_bias ? to_f(static_cast<const T*>(a.down_bias)[e * H + h]) : 0.0f;
    out = fmaf(pairs[k], v + bias, out);
  }
  static_cast<T*>(a.out)[t * H + h] = from_f<T>(invalid ? __int_as_float(0x7fc00000) : out);
}

}  // namespace moekit::cuda

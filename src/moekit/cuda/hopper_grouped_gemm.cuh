// The grouped GEMM of the Hopper backends (sm_90a): C[m, n] = sum_k A[m, k] * B_e[n, k] over rows
// grouped by expert in the contiguous layout (each expert's rows start at a multiple of 128, so no
// 128-row tile straddles two experts).
//
// One persistent block per multiprocessor walks the (row tile, column block) pairs; the number of
// row tiles and each tile's expert come from the device routing, so the host never waits. Inside a
// block, warpgroup 0 is the producer: one thread issues bulk tensor copies (TMA) of the A tile and the
// expert's B tile into a ring of shared-memory stages, each completing on its "full" mbarrier. The two
// math warpgroups take 64 rows each and run wgmma straight from the 128-byte-swizzled stages,
// releasing a stage through its "empty" mbarrier; then they apply the epilogue from registers:
//   gated_activation: the B tile holds BN/2 gate rows then BN/2 up rows of the same intermediate
//                     columns, so act(gate) * up is formed in registers and stored in T;
//   activation:       act(x) of an ungated first projection, stored in T;
//   store_rows:       the second projection plus its bias, stored in T for the combine.
// kGatherA (sonicmoe's first projection): instead of a TMA copy of a permuted row buffer, the whole
// producer warpgroup gathers each tile's token rows straight from the hidden states with 16-byte
// cp.async copies into the same swizzled layout, completing on the same "full" barrier.
// With weight_rows set, the store_rows epilogue multiplies each row by its pair's routing weight.
// With masked_m set (the masked layout), a tile's rows start inside its group's block of rows.
// kFp8 (deepgemm's FP8 experts): e4m3 operands with block scales, promoted per 128-deep block (see the
// kernel); the gated first projection's epilogue quantises its outputs into e4m3 codes and scales
// (gated_quantized), the ungated one stores float, which a separate pass quantises. FP8 tiles are 256 wide (the
// second projection and gated_quantized: hopper_experts.cu's kTileN), or 128 (the float-row first projections).
// Epilogues with 2-byte outputs (both projections in bf16/f16, FP8's second) and FP8's gated e4m3 codes write each
// warpgroup's rows to a shared-memory buffer and go on to the next tile while warps 1-3 of the producer warpgroup
// copy them out (staged_epilogue, named barriers 3-6); with kGatherA, and for FP8's float rows, the math warpgroups
// store them themselves (2-byte outputs in 16-byte row pieces, store_group_pair). A math warpgroup whose rows are all
// padding (or past masked_m) issues no wgmma: its warps only pass the stages on, meeting at a named barrier before each
// release (1 + math) so that none drifts behind. Built with MOEKIT_HOPPER_WATCHDOG=1, a pipeline wait that lasts
// seconds reports where it is and traps. CUTLASS/CuTe supply the instruction wrappers (TMA copies, mbarriers, wgmma,
// register reconfiguration); the schedule, the fused epilogues and the layouts are ours.
#pragma once

#include <cuda.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/fp8_math.cuh"
#include "moekit/cuda/routing.cuh"
#include "moekit/cuda/scale_division.h"
#include "moekit/cuda/sm90_wgmma.cuh"

namespace moekit::cuda::hopper {

constexpr int kBlockM = 128;    // rows per tile: the contiguous layout's padding unit
constexpr int kRowBytes = 128;  // one 128-byte swizzle row of K per stage: 64 bf16/f16 or 128 e4m3
// Elements of K per stage; for FP8 also the block of the weight and activation scales.
template <bool kFp8>
constexpr int kStageK = kFp8 ? 128 : 64;
constexpr int kMathGroups = 2;  // math warpgroups, 64 rows each
constexpr int kThreads = 128 * (1 + kMathGroups);

// Registers per thread after setmaxnreg: 128 x 56 + 256 x 224 = 64,512 of the 65,536.
constexpr int kProducerRegisters = 56, kMathRegisters = 224;

// A wgmma descriptor from its two words: the start address field is the low 14 bits of `lo` and stays below
// 2^14, so a stage's descriptor is stage 0's low word plus the stage's offset (16-byte units).
__device__ __forceinline__ uint64_t with_address(uint32_t hi, uint32_t lo) {
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// FP8: the raw bits of weight block scale `index` of a row of scales starting at `base` (float32, or one
// ue8m0 byte), and their value: block_scale_at split in two, the load predicated and ue8m0_value written as
// selects, so that the loop has no branch on the format and the decoding waits until the value is used, a
// block later (with ue8m0_value's branches, the compiler decoded right after the load and waited for it).
__device__ __forceinline__ uint32_t load_scale_bits(const uint8_t* base, int index, bool ue8m0) {
  uint32_t bits;
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p ld.global.nc.u8 %0, [%1];\n @!p ld.global.nc.b32 %0, [%2];\n}\n"
      : "=r"(bits)
      : "l"(base + index), "l"(base + 4 * index), "r"(static_cast<uint32_t>(ue8m0)));
  return bits;
}
__device__ __forceinline__ float decode_scale(uint32_t bits, bool ue8m0) {
  uint32_t value;  // selects, not branches: ue8m0 0 -> 2^-127, 0xff -> NaN, else bits << 23
  asm("{\n .reg .pred z, n, u;\n .reg .b32 v;\n shl.b32 v, %1, 23;\n setp.eq.u32 z, %1, 0;\n"
      " selp.b32 v, 0x00400000, v, z;\n setp.eq.u32 n, %1, 255;\n selp.b32 v, 0x7fc00000, v, n;\n"
      " setp.ne.u32 u, %2, 0;\n selp.b32 %0, v, %1, u;\n}\n"
      : "=r"(value)
      : "r"(bits), "r"(static_cast<uint32_t>(ue8m0)));
  return __uint_as_float(value);
}

// One arrival on the mbarrier at `bar` (a shared::cluster address: this block's or its peer's, from mapa) by
// the threads with `leader` set, without a branch around it.
__device__ __forceinline__ void arrive_if(uint32_t bar, bool leader) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n @p mbarrier.arrive.shared::cluster.b64 _, [%0];\n}\n" ::"r"(bar),
      "r"(static_cast<uint32_t>(leader))
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_address(uint32_t bar, uint32_t rank) {
  uint32_t mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(bar), "r"(rank));
  return mapped;
}

// gated_quantized: FP8's gated first projection quantised in its epilogue (quantized_gated_epilogue).
enum class Epilogue : uint8_t { gated_activation, gated_quantized, activation, store_rows };
template <Epilogue kEpi>
constexpr bool kGated = kEpi == Epilogue::gated_activation || kEpi == Epilogue::gated_quantized;

struct GemmParams {
  ExpertsArgs a;                          // sizes, activation, biases
  const int32_t* tile_offsets = nullptr;  // [E + 1]: 128-row tiles of each expert
  int n_blocks = 0;                       // column blocks of the output
  int k_blocks = 0;                       // ceil(K / kStageK)
  bool interleaved = false;               // B map coordinates (k, part, n, e) instead of (k, n, part, e)
  int64_t outputs = 0;                    // valid output columns (I for the first projection, H for the second)
  void* out = nullptr;                    // [rows, outputs] in T
  // [rows]: the (token, slot) pair of each padded row, -1 for padding. Read by the gathering producer
  // and, when weight_rows, by the store_rows epilogue.
  const int32_t* padded_pair = nullptr;
  bool weight_rows = false;
  // FP8: the weights' block scales [E, b_scale_rows, k_blocks] (f32, or ue8m0 with a.ue8m0_scales).
  const void* b_scales = nullptr;
  int64_t b_scale_rows = 0;
  // gated_quantized: out holds e4m3 codes [rows, outputs] and out_scales their scales [outputs / 128,
  // out_scale_rows], as quantize_rows writes them.
  float* out_scales = nullptr;
  int64_t out_scale_rows = 0;
  // The masked layout (DeepGEMM's, for decode): group g's rows start at row g * masked_rows (a multiple
  // of 128) and the first masked_m[g] of them are its own; tile_offsets then count each group's tiles of
  // those rows (masked_tile_offsets). Null: the contiguous layout, a tile's rows start at 128 * its index.
  const int32_t* masked_m = nullptr;
  int64_t masked_rows = 0;
  // Contiguous layout: warpgroups whose rows are all padding (padded_pair < 0) skip their math (default on).
  bool idle_padding = false;
};

// One stage: the A tile, the B tile and (FP8) the A tile's 128 row scales, rounded up to the 1 KB
// alignment of the 128-byte swizzle.
template <int BN, bool kFp8>
constexpr int stage_bytes() {
  return ((kBlockM + BN) * kRowBytes + (kFp8 ? kBlockM * 4 : 0) + 1023) / 1024 * 1024;
}
// Staged epilogues (staged_epilogue): each math warpgroup hands its finished 64 rows of kCols 2-byte outputs to
// the producer warpgroup's idle warps through a buffer of its own, rows padded by 16 bytes so that the
// quad-per-row stores of a warp hit 32 different banks (a row pitch of 4 banks mod 32).
template <int kCols>
constexpr int kStagedPitch = kCols * 2 + 16;
template <int kCols>
constexpr int kStagedBytes = 64 * kStagedPitch<kCols>;
// Output columns of a tile: the gated epilogue pairs gate and up columns.
template <int BN, Epilogue kEpi>
constexpr int kOutCols = kGated<kEpi> ? BN / 2 : BN;
// Epilogues with 2-byte outputs stage their rows: the second projection (FP8 and bf16/f16) and the bf16/f16
// gated first projection. Measured (GEMM alone, m 512): FP8 DeepSeek-V3 down 697 -> 761-784 TFLOP/s, Qwen3
// down 418 -> 523; bf16 Qwen3 down 234 -> 200 us. FP8's first projection wrote float rows, twice the bytes,
// and staged them slower (814 -> 732-736); gated, it now writes e4m3 codes (gated_quantized), and the ungated
// activation epilogue is not staged. Nor is any with kGatherA, whose producer warps all gather.
//
// FP8's gated first projection (gated_quantized) stages its e4m3 codes too: a row's 128 codes of a group take the
// place of 64 2-byte outputs. Storing them itself, 2 bytes a thread per instruction, each store's register held
// until the store had read it, its math warps waited 9% of the kernel's samples on those stores (ncu, Qwen3 gate+up
// at m 512; the whole epilogue took 39% of the math warps' samples, and the GEMM ran 1.45x as fast without it).
template <bool kFp8, Epilogue kEpi, bool kGatherA>
constexpr bool staged_epilogue() {
  return !kGatherA && (kEpi == Epilogue::store_rows || kEpi == Epilogue::gated_quantized ||
                       (!kFp8 && kEpi == Epilogue::gated_activation));
}
// 2-byte columns of a staged row: the tile's outputs, or gated_quantized's group of 128 codes (as 64 2-byte units).
template <int BN, Epilogue kEpi>
constexpr int kStagedCols = kEpi == Epilogue::gated_quantized ? 64 : kOutCols<BN, kEpi>;
// Shared memory of the epilogues: the staging buffers.
template <int BN, bool kFp8, Epilogue kEpi, bool kGatherA>
constexpr int staged_epilogue_bytes() {
  return staged_epilogue<kFp8, kEpi, kGatherA>() ? kMathGroups * kStagedBytes<kStagedCols<BN, kEpi>> : 0;
}
// The dynamic shared memory a block may use, and what a pipeline of kStages takes: the stages (their base is
// aligned to the swizzle atom's 1 KB by the declaration), the staging buffers and the full/empty barriers.
constexpr std::size_t kSharedMemoryLimit = 227 * 1024;
template <int BN, bool kFp8, Epilogue kEpi, bool kGatherA>
constexpr std::size_t gemm_smem_bytes(int stages) {
  return static_cast<std::size_t>(stages) * (stage_bytes<BN, kFp8>() + 2 * 8) +
         staged_epilogue_bytes<BN, kFp8, kEpi, kGatherA>();
}
// The deepest pipeline of at most kMax stages that fits beside the staging buffers.
template <int BN, bool kFp8, Epilogue kEpi, bool kGatherA, int kMax>
constexpr int fitting_stages() {
  int stages = kMax;
  while (stages > 2 && gemm_smem_bytes<BN, kFp8, kEpi, kGatherA>(stages) > kSharedMemoryLimit) --stages;
  return stages;
}

// Named barriers (id 0 is __syncthreads): 1 + math, an idle warpgroup's warps; 3 + math, "warpgroup
// math's rows are staged"; 5 + math, "its buffer is free again". The last two join the warpgroup's 128
// threads and the 96 copying threads (warps 1-3 of the producer warpgroup).
constexpr int kCopyThreads = 96;
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <typename T, int N>
struct WgmmaOp;
template <>
struct WgmmaOp<bf16, 256> {
  using type = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};
template <>
struct WgmmaOp<f16, 256> {
  using type = cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};
template <>
struct WgmmaOp<bf16, 128> {
  using type = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};
template <>
struct WgmmaOp<f16, 128> {
  using type = cute::SM90::GMMA::MMA_64x128x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};
template <>
struct WgmmaOp<f8_e4m3, 128> {
  using type = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct WgmmaOp<f8_e4m3, 256> {  // named for the 256-wide tiles, which issue two m64n128 batches instead
  using type = cute::SM90::GMMA::MMA_64x256x32_F32E4M3E4M3_SS_TN<>;
};

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: rows of 128 bytes,
// groups of 8 rows 1024 bytes apart (the leading offset is unused by this layout).
__device__ __forceinline__ uint64_t smem_descriptor(const void* p) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(p) >> 4);
  d.bitfield.leading_byte_offset_ = 1;
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return d.desc_;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(from_f<T>(lo).bits) | (static_cast<uint32_t>(from_f<T>(hi).bits) << 16);
}

// act(g) * u of two adjacent columns, packed. Not inlined: inlining the activation's switch into every
// one of the epilogue's unrolled steps makes the kernel spill its accumulators.
// The activation's settings travel by value: a reference into the kernel's parameters would make the
// compiler copy them all to the stack.
__device__ __noinline__ float2 activated_pair(Act act, bool has_gate, float limit, float alpha, float g0, float u0,
                                              float g1, float u1) {
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

// The routing weights of this thread's two rows of a tile (store_rows with weight_rows; 1 otherwise),
// read when the tile starts so that the epilogue does not wait for them.
template <typename T, Epilogue kEpi>
__device__ __forceinline__ void row_weights(const GemmParams& p, int64_t m_tile, int math, float (&weight)[2]) {
  weight[0] = weight[1] = 1.0f;
  if (kEpi != Epilogue::store_rows || !p.weight_rows) return;
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
// act(gate) * up of a gate_up_pair's two columns: kSilu, SiLU, the common case, inline (activate's arithmetic); the
// others through the call.
template <bool kSilu>
__device__ __forceinline__ float2 activate_gate_up(const ExpertsArgs& a, float4 v) {
  if constexpr (kSilu)
    return make_float2(silu(v.x) * v.z, silu(v.y) * v.w);
  else
    return activated_pair(a.act, a.has_gate, a.swiglu_limit, a.swiglu_alpha, v.x, v.z, v.y, v.w);
}
// act(gate) * up of accumulator pair i. The biases are added once, before the choice of activation: added in each
// arm, the bf16 gated kernels grew by a third (5,312 -> 7,064 instructions) and their DeepSeek-V3 layer ran 7% slower.
template <typename T, int BN>
__device__ __forceinline__ float2 gated_pair(const ExpertsArgs& a, const float* acc, const T* bias, bool is_silu,
                                             int64_t j, int i) {
  const float4 v = gate_up_pair<T, BN>(a, acc, bias, j, i);
  return is_silu ? activate_gate_up<true>(a, v) : activate_gate_up<false>(a, v);
}
// The same with the activation chosen at compile time, for epilogues that choose it once a tile.
template <typename T, int BN, bool kSilu>
__device__ __forceinline__ float2 gated_pair_as(const ExpertsArgs& a, const float* acc, const T* bias, int64_t j,
                                                int i) {
  return activate_gate_up<kSilu>(a, gate_up_pair<T, BN>(a, acc, bias, j, i));
}

// FP8's gated first projection quantised in its epilogue (Epilogue::gated_quantized), in place of float rows
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
  if constexpr (kEpi == Epilogue::gated_activation) {
    constexpr int kHalf = BN / 4;
    const int64_t N = 2 * a.intermediate;
    const int64_t col_base = int64_t{n_block} * (BN / 2);
    const T* bias = a.up_bias ? static_cast<const T*>(a.up_bias) + expert * N : nullptr;
    const bool is_silu = a.act == Act::silu;
#pragma unroll
    for (int m = 0; m < kHalf / 8; ++m) {
      uint32_t words[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = 8 * m + 2 * k;
        const int64_t j = col_base + acc_col(lane, i);
        // outputs is a multiple of 8, so j + 1 is inside when j is
        const float2 h = gated_pair<T, BN>(a, acc, j < p.outputs ? bias : nullptr, is_silu, j, i);
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
  } else {
    const int64_t col_base = int64_t{n_block} * BN;
    // This thread's biases: columns col_base + 2 (lane % 4) + 8 c for c = 0 .. BN / 8 - 1, `left` of them inside
    // the output. Addressed from one base with constant offsets: with a 64-bit column and bound per pair, the
    // bf16 store_rows kernels spilled.
    const T* bias = nullptr;
    if (kEpi == Epilogue::activation && a.up_bias) bias = static_cast<const T*>(a.up_bias);
    if (kEpi == Epilogue::store_rows && a.down_bias) bias = static_cast<const T*>(a.down_bias);
    const int64_t first_col = col_base + (lane % 4) * 2;
    if (bias) bias += expert * p.outputs + first_col;
    const int left = static_cast<int>(min(p.outputs - first_col, int64_t{BN}));
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
// When both tiles belong to one expert, each block copies half of the weight tile and the copy engine
// multicasts it into both blocks' stages, halving the weight traffic from L2; otherwise each loads its
// own. Each block's "empty" barriers then count the math warpgroups of both blocks, since a stage is
// written by the peer too, which keeps the pair in lockstep.
// kFp8: A and B are e4m3 bytes with 1 x 128 (A, per row) and 128 x 128 (B) block scales. Each stage is
// one 128-deep scale block: its products go to a second set of accumulators, which the math warpgroups
// then add to the tile's accumulators times the A row's and the B block's scale. The copy engine
// brings the A tile's row scales (s_map, [K / 128, rows] float) into the stage with the operands.
template <typename T, int BN, Epilogue kEpi, int kStages, int kCluster, bool kGatherA, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                        const __grid_constant__ CUtensorMap s_map, const GemmParams p) {
#if MOEKIT_SM90A_DEVICE
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  static_assert(kCluster == 1 || kCluster == 2);
  static_assert(!(kGatherA && kFp8), "the gathering producer copies 2-byte rows");
  static_assert(kEpi != Epilogue::gated_quantized || (kFp8 && BN == 256),
                "gated_quantized: FP8 tiles of 128 outputs, a whole group of the intermediate");
  using In = std::conditional_t<kFp8, f8_e4m3, T>;  // operand type
  using Out = std::conditional_t<kFp8 && kEpi != Epilogue::store_rows, float, T>;
  // What the copying warps store: the 2-byte outputs, or gated_quantized's e4m3 codes two at a time.
  using Staged = std::conditional_t<kEpi == Epilogue::gated_quantized, uint16_t, Out>;
  constexpr int kHalfRows = BN / 2;  // the weight tile is copied as two halves (gated: gate rows, up rows)
  constexpr int kABytes = kBlockM * kRowBytes, kHalfBytes = kHalfRows * kRowBytes;
  constexpr int kStageBytes = stage_bytes<BN, kFp8>();
  constexpr int kScaleOffset = kABytes + 2 * kHalfBytes;  // FP8: the A row scales of the stage
  constexpr int kK = kStageK<kFp8>;
  // The 128-byte swizzle needs stages aligned to 1 KB: the declaration asks for it (no slack is budgeted).
  extern __shared__ __align__(1024) uint8_t smem[];
  // Staged epilogues: the math warpgroups stage their finished rows for warps 1-3 of the producer warpgroup to
  // store, and go on to their next tile (FP8's second projection otherwise spent ~23% of its time there, with
  // the tensor cores idle).
  constexpr bool kStaged = staged_epilogue<kFp8, kEpi, kGatherA>();
  if (threadIdx.x == 0 && cute::cast_smem_ptr_to_uint(smem) % 1024 != 0) __trap();  // never seen; guards the above
  uint8_t* staged = smem + kStages * kStageBytes;
  auto* full = reinterpret_cast<uint64_t*>(staged + staged_epilogue_bytes<BN, kFp8, kEpi, kGatherA>());
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], kGatherA ? 1 + 128 : 1);  // gathering: + one cp.async arrival per producer thread
      Barrier::init(&empty[s], kMathGroups * kCluster);
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (kCluster > 1)
    cute::cluster_sync();  // the peer's barriers are initialised before anyone signals them
  else
    __syncthreads();

  const uint32_t rank = kCluster > 1 ? cute::block_rank_in_cluster() : 0;
  const uint32_t full_at = cute::cast_smem_ptr_to_uint(full), empty_at = cute::cast_smem_ptr_to_uint(empty);
  const int64_t experts = p.a.experts;
  const int64_t m_tiles = p.tile_offsets[experts];
  // Computed in each role's loop rather than once before the roles part: held across the register
  // reconfiguration (setmaxnreg), ptxas kept it in local memory.
  auto unit_count = [&] { return (m_tiles + kCluster - 1) / kCluster * p.n_blocks; };
  const int64_t first_unit = blockIdx.x / kCluster, unit_step = gridDim.x / kCluster;
  // The next unit a block takes. gated_quantized reads the step where it is used (gridDim is a constant): held
  // across setmaxnreg, it spilled there once that epilogue staged its codes (and read so by every epilogue, the
  // bf16 ones spilled other values instead).
  auto advance = [&](int64_t unit) {
    return unit + (kEpi == Epilogue::gated_quantized ? int64_t{gridDim.x / kCluster} : unit_step);
  };
  // This block's row tile and expert in a unit, and whether the pair shares its weight tile. A block
  // walks its units in order, so the row tiles only grow: `hint`, the expert of the pair's first tile
  // last time, starts the lookup, a whole warp's (expert_of_from_warp: every caller is a whole warp).
  struct Tile {
    int64_t m_tile;
    int64_t row;  // the tile's first row of A and of out
    int n_block;
    int expert;
    bool valid, multicast;
  };
  auto tile_of = [&](int64_t unit, int64_t& hint) {
    Tile t;
    const int64_t pair = unit / p.n_blocks;
    t.n_block = static_cast<int>(unit % p.n_blocks);
    t.m_tile = pair * kCluster + rank;
    t.valid = t.m_tile < m_tiles;
    t.expert = 0;
    t.multicast = false;
    if (pair * kCluster < m_tiles) {
      const int64_t first = expert_of_from_warp(p.tile_offsets, experts, pair * kCluster, hint);
      hint = first;
      if constexpr (kCluster > 1) {
        const int64_t second = pair * kCluster + 1 < m_tiles
                                   ? expert_of_from_warp(p.tile_offsets, experts, pair * kCluster + 1, first)
                                   : -1;
        t.expert = static_cast<int>(rank == 0 ? first : second >= 0 ? second : 0);
        t.multicast = second == first;
      } else {
        t.expert = static_cast<int>(first);
      }
    }
    t.row =
        p.masked_m ? t.expert * p.masked_rows + (t.m_tile - p.tile_offsets[t.expert]) * kBlockM : t.m_tile * kBlockM;
    return t;
  };
  // A group's own rows come first in its tiles, so when math warpgroup `math`'s first row is past them
  // (masked: at or past masked_m of its group; contiguous: padding), all its 64 rows are: it only passes the
  // stages on, and the other warpgroup has the tensor cores to itself (a tile with at most 64 rows costs
  // half; decode's do). In the contiguous layout with idle_padding (the default; measured 10-12% faster at
  // 64 tokens).
  auto idle_of = [&](const Tile& t, int math) {
    return t.valid &&
           (p.masked_m ? t.row - t.expert * p.masked_rows + math * 64 >= p.masked_m[t.expert]
                       : p.idle_padding && p.padded_pair && p.padded_pair[t.m_tile * kBlockM + math * 64] < 0);
  };
  constexpr int kCols = kStagedCols<BN, kEpi>;

  // Warp-uniform as the compiler can see (a shuffle from lane 0), so that what derives from it (the math
  // warpgroups' operand descriptors) can live in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    // The producer: warp 0 (lane 0 issues the copies; the whole warp walks the tiles, whose expert lookup is a
    // warp's), or with kGatherA the whole warpgroup.
    if (kGatherA || threadIdx.x < 32) {
      if (threadIdx.x == 0) {
        if constexpr (!kGatherA) cute::prefetch_tma_descriptor(&a_map);
        if constexpr (kFp8) cute::prefetch_tma_descriptor(&s_map);
        cute::prefetch_tma_descriptor(&b_map);
      }
      constexpr auto kHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
      // Gathering: this thread copies 16-byte chunk `chunk` of rows first_row + 16 i (i < 8) of each tile.
      const int chunk = threadIdx.x % 8, first_row = threadIdx.x / 8;
      int stage = 0;
      uint32_t phase = 0;
      int64_t hint = 0;
      for (int64_t unit = first_unit, units = unit_count(); unit < units; unit = advance(unit)) {
        const Tile t = tile_of(unit, hint);
        int32_t token[kGatherA ? 8 : 1];
        if constexpr (kGatherA) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int32_t pair = t.valid ? p.padded_pair[t.m_tile * kBlockM + first_row + 16 * i] : -1;
            token[i] = pair >= 0 ? static_cast<int32_t>(pair / p.a.top_k) : -1;
          }
        }
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          wait_stage(empty_at + 8 * stage, phase ^ 1, "empty", unit, kb, stage, t.m_tile, t.expert, t.multicast);
          uint8_t* sa = smem + stage * kStageBytes;
          uint8_t* sb = sa + kABytes;
          const int k = kb * kK;
          if constexpr (kGatherA) {
            const int64_t col = k + chunk * 8;
            const T* x = static_cast<const T*>(p.a.x);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const int r = first_row + 16 * i;  // r % 8 == first_row % 8: the 128-byte swizzle's row phase
              const bool ok = token[i] >= 0 && col < p.a.hidden;
              cp_async16(sa + r * 128 + ((chunk ^ (first_row & 7)) * 16), ok ? x + token[i] * p.a.hidden + col : x, ok);
            }
            cutlass::arch::cpasync_barrier_arrive_noinc(&full[stage]);
          }
          // The copy engine's part is thread 0's: the A tile (unless gathered), FP8's row scales and the weight tile.
          if (threadIdx.x != 0) {
            if (++stage == kStages) stage = 0, phase ^= 1;
            continue;
          }
          if constexpr (kGatherA) {
            TxBarrier::arrive_and_expect_tx(&full[stage], 2 * kHalfBytes);
          } else {
            TxBarrier::arrive_and_expect_tx(&full[stage], kABytes + 2 * kHalfBytes + (kFp8 ? kBlockM * 4 : 0));
            cute::SM90_TMA_LOAD_2D::copy(&a_map, &full[stage], kHint, sa, k, static_cast<int>(t.row));
            if constexpr (kFp8)
              cute::SM90_TMA_LOAD_2D::copy(&s_map, &full[stage], kHint, sa + kScaleOffset, static_cast<int>(t.row), kb);
          }
          // Half h of the weight tile: gated, the gate (h = 0) or up (h = 1) rows of the block's columns;
          // otherwise rows h * 128 onwards of its 256.
          auto copy_half = [&](int h, bool multicast) {
            const int n = kGated<kEpi> ? t.n_block * kHalfRows : t.n_block * BN + h * kHalfRows;
            const int part = kGated<kEpi> ? h : 0;
            const int c1 = p.interleaved ? part : n, c2 = p.interleaved ? n : part;
            uint8_t* dst = sb + h * kHalfBytes;
            if (multicast)
              cute::SM90_TMA_LOAD_MULTICAST_4D::copy(&b_map, &full[stage], uint16_t{0x3}, kHint, dst, k, c1, c2,
                                                     t.expert);
            else
              cute::SM90_TMA_LOAD_4D::copy(&b_map, &full[stage], kHint, dst, k, c1, c2, t.expert);
          };
          if (t.multicast) {
            copy_half(static_cast<int>(rank), true);
          } else {
            copy_half(0, false);
            copy_half(1, false);
          }
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      }
    }
    if constexpr (kStaged) {
      if (threadIdx.x >= 32) {  // warps 1-3: store the rows the math warpgroups stage, tile by tile
        const int copier = threadIdx.x - 32;
#pragma unroll
        for (int m = 0; m < kMathGroups; ++m) named_arrive(5 + m, 128 + kCopyThreads);  // both buffers free
        int64_t hint = 0;
        for (int64_t unit = first_unit, units = unit_count(); unit < units; unit = advance(unit)) {
          const Tile t = tile_of(unit, hint);
          if (!t.valid) continue;
          // gated_quantized stages its group's 128 codes a row (as 64 2-byte units).
          const int64_t col_base = int64_t{t.n_block} * kCols;
          auto* const out_rows = static_cast<Staged*>(p.out);
          const int64_t outputs = kEpi == Epilogue::gated_quantized ? p.outputs / 2 : p.outputs;
#pragma unroll
          for (int m = 0; m < kMathGroups; ++m) {
            if (idle_of(t, m)) continue;
            named_sync(3 + m, 128 + kCopyThreads);
            copy_staged<Staged, kCols>(out_rows, outputs, staged + m * kStagedBytes<kCols>, t.row, m, col_base, copier);
            named_arrive(5 + m, 128 + kCopyThreads);
          }
        }
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the last rows written, not only read
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kMathRegisters>();
    using Op = typename WgmmaOp<In, BN>::type;
    const int math = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    float acc[BN / 2];
    // FP8: one scale block's products (gated_quantized 256 wide: of one half, its gate or its up rows).
    float part[kFp8 ? (BN == 256 ? BN / 4 : BN / 2) : 1];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    int stage = 0;
    uint32_t phase = 0;
    // Frees a stage for the producer, this block's and (clusters) the peer's: thread 0 of the warpgroup
    // arrives on the stage's "empty" barrier in every block of the cluster.
    const bool leader = threadIdx.x % 128 == 0;
    uint32_t empty_of[kCluster];
#pragma unroll
    for (int r = 0; r < kCluster; ++r) empty_of[r] = kCluster > 1 ? cluster_address(empty_at, r) : empty_at;
    auto release = [&](int s) {
#pragma unroll
      for (int r = 0; r < kCluster; ++r) arrive_if(empty_of[r] + 8 * s, leader);
    };
    // Stage 0's operand descriptors and row scales, once: a stage's are these plus its offset (with_address).
    // With `math` warp-uniform the descriptors live in uniform registers, built in front of each wgmma with two
    // uniform adds; held opaque in ordinary registers (session 10), each wgmma first waited for four R2UR moves
    // (measured against that: FP8 GEMM 6-9% faster, bf16 1-2%).
    const bool ue8m0 = p.a.ue8m0_scales;
    const uint64_t desc_a0 = smem_descriptor(smem + math * 64 * kRowBytes), desc_b0 = smem_descriptor(smem + kABytes);
    uint32_t desc_a_lo = static_cast<uint32_t>(desc_a0), desc_b_lo = static_cast<uint32_t>(desc_b0),
             desc_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t row_scales0 =
        cute::cast_smem_ptr_to_uint(smem + kScaleOffset) + 4 * (math * 64 + acc_row(warp, lane, 0));
    int64_t hint = 0;
    for (int64_t unit = first_unit, units = unit_count(); unit < units; unit = advance(unit)) {
      const Tile t = tile_of(unit, hint);
      float weight[2] = {1.0f, 1.0f};
      if (t.valid) row_weights<T, kEpi>(p, t.m_tile, math, weight);
      // FP8: where the two weight scale blocks of the tile start. 128 wide: those of its two 64-row halves
      // (gated: its gate and up rows); gated 256 wide: those of its gate and up rows (interleaved rows: those of
      // its columns 0-63 and 64-127, gate and up rows alike); store_rows 256 wide: those of its two 128-row halves
      // (the last block where the second half is past the weights' rows).
      const uint8_t* scale_base[2] = {nullptr, nullptr};
      if constexpr (kFp8) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int64_t block;  // the 128-row block of weight scales
          if (kGated<kEpi>)
            block = (p.interleaved ? 2 * int64_t{t.n_block} * kHalfRows + (BN == 256 ? h * 128 : 0)
                                   : h * p.a.intermediate + int64_t{t.n_block} * kHalfRows) /
                    128;
          else if constexpr (BN == 128)
            block = (int64_t{t.n_block} * BN + h * kHalfRows) / 128;
          else
            block = min(int64_t{t.n_block} * BN / 128 + h, p.b_scale_rows - 1);
          const int64_t index = (t.expert * p.b_scale_rows + block) * p.k_blocks;
          scale_base[h] = static_cast<const uint8_t*>(p.b_scales) + (ue8m0 ? index : 4 * index);
        }
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
      }
      const bool idle = idle_of(t, math);
      if (idle) {
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          // Only thread 0 releases, so the warpgroup's four warps meet first: otherwise warps 1-3, which
          // gate nothing, can fall two rings behind and wait on a parity that has come round again (a hang
          // seen in clusters of two, located with MOEKIT_HOPPER_WATCHDOG).
          wait_stage(full_at + 8 * stage, phase, "full (idle)", unit, kb, stage, t.m_tile, t.expert,
                     t.multicast + 2 * math);
          named_sync(1 + math, 128);
          release(stage);
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      } else if constexpr (kFp8) {
        // FP8. Everything block kb + 1 needs before its wgmma batch (its stage's "full" barrier, its row scales,
        // its weight scales) is done while block kb's batch runs, so that after the batch only the stage's
        // release and the promotion stand before the next batch (measured: with that work between the
        // promotion and the next batch, each warp's chain of dependent instructions, not the tensor cores,
        // set the pace).
        float a_scale[2];  // the row scales of the block (rows r and r + 8 of the thread)
        auto wait_and_read_rows = [&](int kb) {
          wait_stage(full_at + 8 * stage, phase, "full", unit, kb, stage, t.m_tile, t.expert, t.multicast + 2 * math);
          const uint32_t at = row_scales0 + static_cast<uint32_t>(stage * kStageBytes);
          asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(a_scale[0]) : "r"(at));
          asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(a_scale[1]) : "r"(at + 4 * 8));  // row + 8
        };
        // Block kb's scales, [row r, r + 8][the first or second weight scale block], from its weight scale bits
        // `b_bits`, which then take block kb + 2's.
        auto block_scales = [&](int kb, uint32_t(&b_bits)[2], float(&scale)[2][2]) {
          const float b0 = decode_scale(b_bits[0], ue8m0), b1 = decode_scale(b_bits[1], ue8m0);
#pragma unroll
          for (int r = 0; r < 2; ++r) scale[r][0] = a_scale[r] * b0, scale[r][1] = a_scale[r] * b1;
          const int after = kb + 2 < p.k_blocks ? kb + 2 : kb;
          b_bits[0] = load_scale_bits(scale_base[0], after, ue8m0);
          b_bits[1] = load_scale_bits(scale_base[1], after, ue8m0);
        };
        // Runs block(kb, slot) over the tile's blocks. Weight scales are requested two blocks ahead into two slots
        // used alternately (the loop body is written out twice): with one register carried from load to use, the
        // compiler copied it right after the load and so waited for the load.
        auto each_block = [&](auto&& block) {
          uint32_t b_slot[2][2];
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) b_slot[j][h] = load_scale_bits(scale_base[h], j < p.k_blocks ? j : 0, ue8m0);
          wait_and_read_rows(0);
          for (int kb = 0; kb < p.k_blocks; kb += 2) {
            block(kb, b_slot[0]);
            if (kb + 1 < p.k_blocks) block(kb + 1, b_slot[1]);
          }
        };
        // 128 wide. kSplit: the accumulators [0, kSplit) (columns below 2 kSplit, the first 64-row half's) take the
        // first weight scale block, the rest the second. Generic so that only the 128-wide instantiations compile it.
        auto fp8_tile = [&](auto split) {
          constexpr int kSplit = decltype(split)::value;
          each_block([&](int kb, uint32_t(&b_bits)[2]) {
            const int issued = stage;
            const uint32_t stage_offset = static_cast<uint32_t>(stage) * (kStageBytes >> 4);
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(part[i]);
            cute::warpgroup_arrive();
#pragma unroll
            for (int kk = 0; kk < kRowBytes / 32; ++kk)  // 32 bytes (k32) of e4m3 per wgmma
              wgmma<Op>(with_address(desc_hi, desc_a_lo + stage_offset + 2 * kk),
                        with_address(desc_hi, desc_b_lo + stage_offset + 2 * kk), part, kk > 0,
                        std::make_index_sequence<BN / 2>{});
            cute::warpgroup_commit_batch();
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(part[i]);
            float scale[2][2];
            block_scales(kb, b_bits, scale);
            if (++stage == kStages) stage = 0, phase ^= 1;
            // While the batch runs: block kb + 1's stage and row scales.
            if (kb + 1 < p.k_blocks) wait_and_read_rows(kb + 1);
            cute::warpgroup_wait<0>();
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(part[i]);
            release(issued);
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[i] = fmaf(part[i], scale[(i >> 1) & 1][i < kSplit ? 0 : 1], acc[i]);
          });
        };
        // 256 wide: each 128-deep block's products in two batches of m64n128k32, one per 128-row half of the weight
        // tile (gated: the gate rows', then the up rows'), into one set of 64 accumulators promoted after each (two
        // sets of 128 would not leave the registers for anything else). gated_quantized's tile is then a whole group
        // of the intermediate, and each of store_rows' halves takes one weight scale block.
        // Generic in the half's width so that only the 256-wide instantiations, which call it, compile its body.
        auto fp8_halves = [&](auto half_rows) {
          constexpr int kHalfN = decltype(half_rows)::value;
          using HalfOp = typename WgmmaOp<In, kHalfN>::type;
          constexpr int kPart = kHalfN / 2;  // accumulators of a half
          const bool interleaved = kGated<kEpi> && p.interleaved;
          each_block([&](int kb, uint32_t(&b_bits)[2]) {
            const int issued = stage;
            const uint32_t stage_offset = static_cast<uint32_t>(stage) * (kStageBytes >> 4);
            float scale[2][2];
            block_scales(kb, b_bits, scale);
            if (++stage == kStages) stage = 0, phase ^= 1;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              // The scales of this half's columns 0-63 and 64-127 (rows r and r + 8).
              float low[2], high[2];
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                low[r] = interleaved ? scale[r][0] : scale[r][h];
                high[r] = interleaved ? scale[r][1] : scale[r][h];
              }
#pragma unroll
              for (int i = 0; i < kPart; ++i) cute::warpgroup_fence_operand(part[i]);
              cute::warpgroup_arrive();
#pragma unroll
              for (int kk = 0; kk < kRowBytes / 32; ++kk)
                wgmma<HalfOp>(with_address(desc_hi, desc_a_lo + stage_offset + 2 * kk),
                              with_address(desc_hi, desc_b_lo + stage_offset + h * (kHalfBytes >> 4) + 2 * kk), part,
                              kk > 0, std::make_index_sequence<kPart>{});
              cute::warpgroup_commit_batch();
#pragma unroll
              for (int i = 0; i < kPart; ++i) cute::warpgroup_fence_operand(part[i]);
              // While the up rows' batch runs: block kb + 1's stage and row scales.
              if (h == 1 && kb + 1 < p.k_blocks) wait_and_read_rows(kb + 1);
              cute::warpgroup_wait<0>();
#pragma unroll
              for (int i = 0; i < kPart; ++i) cute::warpgroup_fence_operand(part[i]);
              if (h == 1) release(issued);
#pragma unroll
              for (int i = 0; i < kPart; ++i)
                acc[h * kPart + i] =
                    fmaf(part[i], i < kPart / 2 ? low[(i >> 1) & 1] : high[(i >> 1) & 1], acc[h * kPart + i]);
            }
          });
        };
        static_assert(BN == 128 || (BN == 256 && (kEpi == Epilogue::gated_quantized || kEpi == Epilogue::store_rows)),
                      "FP8 tiles: 128 wide, or 256 for gated_quantized and store_rows");
        if constexpr (BN == 256)
          fp8_halves(std::integral_constant<int, BN / 2>{});
        else
          fp8_tile(std::integral_constant<int, BN / 4>{});  // the two 64-row halves
      } else {
        int previous = -1;
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          wait_stage(full_at + 8 * stage, phase, "full", unit, kb, stage, t.m_tile, t.expert, t.multicast + 2 * math);
          // Rows gathered by cp.async were written through the generic proxy; wgmma reads through the async one.
          if constexpr (kGatherA) cutlass::arch::fence_view_async_shared();
          const uint32_t stage_offset = static_cast<uint32_t>(stage) * (kStageBytes >> 4);
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
          cute::warpgroup_arrive();
#pragma unroll
          for (int kk = 0; kk < kRowBytes / 32; ++kk)  // 32 bytes (k16) of 2-byte values per wgmma
            wgmma<Op>(with_address(desc_hi, desc_a_lo + stage_offset + 2 * kk),
                      with_address(desc_hi, desc_b_lo + stage_offset + 2 * kk), acc, kb > 0 || kk > 0,
                      std::make_index_sequence<BN / 2>{});
          cute::warpgroup_commit_batch();
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
          // One batch stays in flight: wait for the previous k block's products, then free its stage.
          cute::warpgroup_wait<1>();
          if (previous >= 0) release(previous);
          previous = stage;
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
        cute::warpgroup_wait<0>();
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
        if (previous >= 0) release(previous);
      }
      if (t.valid && !idle) {
        if constexpr (kEpi == Epilogue::gated_quantized) {
          named_sync(5 + math, 128 + kCopyThreads);  // the copying warps are done with the previous tile's codes
          quantized_gated_epilogue<T, BN>(p, acc, t.expert, t.row, t.n_block, math,
                                          staged + math * kStagedBytes<kCols>);
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the codes, to the bulk copy engine
          named_arrive(3 + math, 128 + kCopyThreads);
        } else if constexpr (kStaged) {
          named_sync(5 + math, 128 + kCopyThreads);  // the copying warps are done with the previous tile's rows
          store_epilogue<T, Out, BN, kEpi, true>(p, acc, weight, t.expert, t.row, t.n_block, math,
                                                 staged + math * kStagedBytes<kCols>);
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the rows, to the bulk copy engine
          named_arrive(3 + math, 128 + kCopyThreads);
        } else {
          store_epilogue<T, Out, BN, kEpi>(p, acc, weight, t.expert, t.row, t.n_block, math);
        }
      }
    }
    if constexpr (kStaged) named_sync(5 + math, 128 + kCopyThreads);  // takes the copiers' last "free"
  }
  if constexpr (kCluster > 1) cute::cluster_sync();  // no block leaves while its peer may still signal it
#else
  (void)a_map, (void)b_map, (void)s_map, (void)p;
  __trap();  // launched only on compute capability 9.0, where the sm_90a code exists
#endif
}

}  // namespace moekit::cuda::hopper

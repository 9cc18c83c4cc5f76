// The Hopper grouped GEMM's (sm90_grouped_gemm.cuh) sizes, parameters and shared memory: the tile shape, the
// warpgroup roles' registers, the kernel's parameter block, the epilogue kinds, the bytes of a pipeline stage and
// of the staging buffers, and the block-level barriers the roles meet at.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/sm90_wgmma.cuh"
#include "moekit/gemm_epilogue.h"

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

// The epilogue kinds are the public ones (gemm_epilogue.h); gated_e4m3 is quantized_gated_epilogue.
using Epilogue = GroupedGemmEpilogue;
template <Epilogue kEpi>
constexpr bool kGated = kEpi == Epilogue::gated || kEpi == Epilogue::gated_e4m3;

struct GemmParams {
  ExpertsArgs a;                          // sizes, activation, biases
  const int32_t* tile_offsets = nullptr;  // [E + 1]: 128-row tiles of each expert
  int n_blocks = 0;                       // column blocks of the output
  int k_blocks = 0;                       // ceil(K / kStageK)
  bool interleaved = false;               // B map coordinates (k, part, n, e) instead of (k, n, part, e)
  int64_t outputs = 0;                    // valid output columns (I for the first projection, H for the second)
  void* out = nullptr;                    // [rows, outputs] in T
  // First projections (gated, activation) of a forward that keeps z for the backward: the accumulators plus the
  // biases, float [sorted rows, N] at the weights' columns (N = 2 * outputs gated), padded row tile_offsets[e] * 128 +
  // i of expert e at sorted row z_row_offsets[e] + i (the routing's offsets), rows past the expert's not stored.
  // Null: not kept.
  float* z_out = nullptr;
  const int32_t* z_row_offsets = nullptr;
  // [rows]: the (token, slot) pair of each padded row, -1 for padding. Read by the gathering producer
  // and, when weight_rows, by the store epilogue.
  const int32_t* padded_pair = nullptr;
  bool weight_rows = false;
  // FP8: the weights' block scales [E, b_scale_rows, k_blocks] (f32, or ue8m0 with a.ue8m0_scales).
  const void* b_scales = nullptr;
  int64_t b_scale_rows = 0;
  // gated_e4m3: out holds e4m3 codes [rows, outputs] and out_scales their scales [outputs / 128,
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
// and staged them slower (814 -> 732-736); gated, it now writes e4m3 codes (gated_e4m3), and the ungated
// activation epilogue is not staged. Nor is any with kGatherA, whose producer warps all gather.
//
// FP8's gated first projection (gated_e4m3) stages its e4m3 codes too: a row's 128 codes of a group take the
// place of 64 2-byte outputs. Storing them itself, 2 bytes a thread per instruction, each store's register held
// until the store had read it, its math warps waited 9% of the kernel's samples on those stores (ncu, Qwen3 gate+up
// at m 512; the whole epilogue took 39% of the math warps' samples, and the GEMM ran 1.45x as fast without it).
template <bool kFp8, Epilogue kEpi, bool kGatherA>
constexpr bool staged_epilogue() {
  return !kGatherA && (kEpi == Epilogue::store || kEpi == Epilogue::gated_e4m3 || (!kFp8 && kEpi == Epilogue::gated));
}
// 2-byte columns of a staged row: the tile's outputs, or gated_e4m3's group of 128 codes (as 64 2-byte units).
template <int BN, Epilogue kEpi>
constexpr int kStagedCols = kEpi == Epilogue::gated_e4m3 ? 64 : kOutCols<BN, kEpi>;
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
// One instantiation's compile-time shape, what every part of the kernel reads: T the activations' type (bf16/f16),
// BN the tile's columns (weight rows), kStages the pipeline's depth, kCluster its blocks (1, or 2 sharing weight
// tiles), kGatherA the gathering producer (sonicmoe), kFp8 e4m3 operands with block scales.
template <typename T_, int BN_, Epilogue kEpi_, int kStages_, int kCluster_, bool kGatherA_, bool kFp8_>
struct GemmConfig {
  using T = T_;
  static constexpr int BN = BN_;
  static constexpr Epilogue kEpi = kEpi_;
  static constexpr int kStages = kStages_, kCluster = kCluster_;
  static constexpr bool kGatherA = kGatherA_, kFp8 = kFp8_;
  using In = std::conditional_t<kFp8, f8_e4m3, T>;  // operand type
  using Out = std::conditional_t<kFp8 && kEpi != Epilogue::store, float, T>;
  // What the copying warps store: the 2-byte outputs, or gated_e4m3's e4m3 codes two at a time.
  using Staged = std::conditional_t<kEpi == Epilogue::gated_e4m3, uint16_t, Out>;
  static constexpr int kHalfRows = BN / 2;  // the weight tile is copied as two halves (gated: gate rows, up rows)
  static constexpr int kABytes = kBlockM * kRowBytes, kHalfBytes = kHalfRows * kRowBytes;
  static constexpr int kStageBytes = stage_bytes<BN, kFp8>();
  static constexpr int kScaleOffset = kABytes + 2 * kHalfBytes;  // FP8: the A row scales of the stage
  static constexpr int kK = kStageK<kFp8>;
  static constexpr bool kStaged = staged_epilogue<kFp8, kEpi, kGatherA>();
  static constexpr int kCols = kStagedCols<BN, kEpi>;
  // FP8: the accumulators of one scale block's products (256 wide: of one half, its gate or its up rows).
  static constexpr int kPartAccumulators = kFp8 ? (BN == 256 ? BN / 4 : BN / 2) : 1;
  static_assert(kCluster == 1 || kCluster == 2);
  static_assert(!(kGatherA && kFp8), "the gathering producer copies 2-byte rows");
  static_assert(kEpi != Epilogue::gated_e4m3 || (kFp8 && BN == 256),
                "gated_e4m3: FP8 tiles of 128 outputs, a whole group of the intermediate");
};

}  // namespace moekit::cuda::hopper

// The Hopper grouped GEMM's main loops, run by each math warpgroup (64 rows of a tile) over the tile's k blocks: wgmma
// straight from the 128-byte-swizzled stages the producer fills, in bf16/f16 (one batch in flight) or FP8 (each
// 128-deep block's products promoted by its row and weight block scales, 128 or 256 wide), each stage released to
// the producer once its products are in; or, for a warpgroup whose rows are all padding, only the stages' release.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/sm90_gemm_layout.cuh"
#include "moekit/cuda/sm90_gemm_scheduler.cuh"
#include "moekit/cuda/sm90_wgmma.cuh"

namespace moekit::cuda::hopper {

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

// A math warpgroup's side of the stage ring: the stage it reads next and its phase, and the release of a stage to the
// producer, this block's and (clusters) the peer's: thread 0 of the warpgroup arrives on the stage's "empty" barrier
// in every block of the cluster.
template <int kStages, int kCluster>
struct MathPipeline {
  int stage = 0;
  uint32_t phase = 0;
  uint32_t full_at;  // shared address of stage 0's "full" barrier
  uint32_t empty_of[kCluster];
  bool leader;

  __device__ __forceinline__ MathPipeline(uint32_t full, uint32_t empty_at) : full_at(full) {
    leader = threadIdx.x % 128 == 0;
#pragma unroll
    for (int r = 0; r < kCluster; ++r) empty_of[r] = kCluster > 1 ? cluster_address(empty_at, r) : empty_at;
  }
  // Waits until the current stage is full (block kb of `unit`'s tile t; where it waits, for the watchdog).
  __device__ __forceinline__ void wait_full(const char* what, int64_t unit, int kb, const Tile& t, int math) const {
    wait_stage(full_at + 8 * stage, phase, what, unit, kb, stage, t.m_tile, t.expert, t.multicast + 2 * math);
  }
  __device__ __forceinline__ void release(int s) const {
#pragma unroll
    for (int r = 0; r < kCluster; ++r) arrive_if(empty_of[r] + 8 * s, leader);
  }
  __device__ __forceinline__ void next() {
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
};

// A math warpgroup's operand descriptors of stage 0 (its 64 rows of A, the B tile) as the words with_address joins;
// a stage's are these plus its offset.
struct OperandDescriptors {
  uint32_t hi, a_lo, b_lo;
};

// A math warpgroup whose rows are all padding: only passes the tile's stages on.
template <class C>
__device__ __forceinline__ void pass_stages(MathPipeline<C::kStages, C::kCluster>& pipe, const GemmParams& p,
                                            int64_t unit, const Tile& t, int math) {
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    // Only thread 0 releases, so the warpgroup's four warps meet first: otherwise warps 1-3, which
    // gate nothing, can fall two rings behind and wait on a parity that has come round again (a hang
    // seen in clusters of two, located with MOEKIT_HOPPER_WATCHDOG).
    pipe.wait_full("full (idle)", unit, kb, t, math);
    named_sync(1 + math, 128);
    pipe.release(pipe.stage);
    pipe.next();
  }
}

// FP8: where the two weight scale blocks of tile t start (`ue8m0`: one byte a scale, else float32). 128 wide: those
// of its two 64-row halves (gated: its gate and up rows); gated 256 wide: those of its gate and up rows (interleaved
// rows: those of its columns 0-63 and 64-127, gate and up rows alike); store 256 wide: those of its two 128-row
// halves (the last block where the second half is past the weights' rows).
template <class C>
__device__ __forceinline__ void weight_scale_bases(const GemmParams& p, const Tile& t, bool ue8m0,
                                                   const uint8_t* (&scale_base)[2]) {
  constexpr int BN = C::BN, kHalfRows = C::kHalfRows;
  constexpr Epilogue kEpi = C::kEpi;
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
}

// bf16/f16: tile t's products into acc, k16 wgmma batches of one stage each, one batch in flight: a stage is freed
// once the next batch is issued and the previous one has completed.
template <class C>
__device__ __forceinline__ void mma_16bit(MathPipeline<C::kStages, C::kCluster>& pipe, const GemmParams& p,
                                          const OperandDescriptors& d, float (&acc)[C::BN / 2], int64_t unit,
                                          const Tile& t, int math) {
  using Op = typename WgmmaOp<typename C::In, C::BN>::type;
  constexpr int BN = C::BN, kStageBytes = C::kStageBytes;
  constexpr bool kGatherA = C::kGatherA;
  int previous = -1;
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    pipe.wait_full("full", unit, kb, t, math);
    // Rows gathered by cp.async were written through the generic proxy; wgmma reads through the async one.
    if constexpr (kGatherA) cutlass::arch::fence_view_async_shared();
    const uint32_t stage_offset = static_cast<uint32_t>(pipe.stage) * (kStageBytes >> 4);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < kRowBytes / 32; ++kk)  // 32 bytes (k16) of 2-byte values per wgmma
      wgmma<Op>(with_address(d.hi, d.a_lo + stage_offset + 2 * kk), with_address(d.hi, d.b_lo + stage_offset + 2 * kk),
                acc, kb > 0 || kk > 0, std::make_index_sequence<BN / 2>{});
    cute::warpgroup_commit_batch();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
    // One batch stays in flight: wait for the previous k block's products, then free its stage.
    cute::warpgroup_wait<1>();
    if (previous >= 0) pipe.release(previous);
    previous = pipe.stage;
    pipe.next();
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
  if (previous >= 0) pipe.release(previous);
}

// FP8: tile t's products into acc, each 128-deep block's products (one stage) into `part` first and added to acc
// times the block's scales: rows r and r + 8's A scales (read from the stage, row_scales0 + the stage's offset) times
// the weight block's (read from scale_base, weight_scale_bases).
template <class C>
__device__ __forceinline__ void mma_fp8(MathPipeline<C::kStages, C::kCluster>& pipe, const GemmParams& p,
                                        const OperandDescriptors& d, uint32_t row_scales0,
                                        const uint8_t* const (&scale_base)[2], bool ue8m0, float (&acc)[C::BN / 2],
                                        float (&part)[C::kPartAccumulators], int64_t unit, const Tile& t, int math) {
  using In = typename C::In;
  using Op = typename WgmmaOp<In, C::BN>::type;
  constexpr int BN = C::BN, kStageBytes = C::kStageBytes, kHalfBytes = C::kHalfBytes;
  constexpr Epilogue kEpi = C::kEpi;
  // FP8. Everything block kb + 1 needs before its wgmma batch (its stage's "full" barrier, its row scales,
  // its weight scales) is done while block kb's batch runs, so that after the batch only the stage's
  // release and the promotion stand before the next batch (measured: with that work between the
  // promotion and the next batch, each warp's chain of dependent instructions, not the tensor cores,
  // set the pace).
  float a_scale[2];  // the row scales of the block (rows r and r + 8 of the thread)
  auto wait_and_read_rows = [&](int kb) {
    pipe.wait_full("full", unit, kb, t, math);
    const uint32_t at = row_scales0 + static_cast<uint32_t>(pipe.stage * kStageBytes);
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
      const int issued = pipe.stage;
      const uint32_t stage_offset = static_cast<uint32_t>(pipe.stage) * (kStageBytes >> 4);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(part[i]);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < kRowBytes / 32; ++kk)  // 32 bytes (k32) of e4m3 per wgmma
        wgmma<Op>(with_address(d.hi, d.a_lo + stage_offset + 2 * kk),
                  with_address(d.hi, d.b_lo + stage_offset + 2 * kk), part, kk > 0, std::make_index_sequence<BN / 2>{});
      cute::warpgroup_commit_batch();
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(part[i]);
      float scale[2][2];
      block_scales(kb, b_bits, scale);
      pipe.next();
      // While the batch runs: block kb + 1's stage and row scales.
      if (kb + 1 < p.k_blocks) wait_and_read_rows(kb + 1);
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(part[i]);
      pipe.release(issued);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = fmaf(part[i], scale[(i >> 1) & 1][i < kSplit ? 0 : 1], acc[i]);
    });
  };
  // 256 wide: each 128-deep block's products in two batches of m64n128k32, one per 128-row half of the weight
  // tile (gated: the gate rows', then the up rows'), into one set of 64 accumulators promoted after each (two
  // sets of 128 would not leave the registers for anything else). gated_e4m3's tile is then a whole group
  // of the intermediate, and each of store' halves takes one weight scale block.
  // Generic in the half's width so that only the 256-wide instantiations, which call it, compile its body.
  auto fp8_halves = [&](auto half_rows) {
    constexpr int kHalfN = decltype(half_rows)::value;
    using HalfOp = typename WgmmaOp<In, kHalfN>::type;
    constexpr int kPart = kHalfN / 2;  // accumulators of a half
    const bool interleaved = kGated<kEpi> && p.interleaved;
    each_block([&](int kb, uint32_t(&b_bits)[2]) {
      const int issued = pipe.stage;
      const uint32_t stage_offset = static_cast<uint32_t>(pipe.stage) * (kStageBytes >> 4);
      float scale[2][2];
      block_scales(kb, b_bits, scale);
      pipe.next();
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
          wgmma<HalfOp>(with_address(d.hi, d.a_lo + stage_offset + 2 * kk),
                        with_address(d.hi, d.b_lo + stage_offset + h * (kHalfBytes >> 4) + 2 * kk), part, kk > 0,
                        std::make_index_sequence<kPart>{});
        cute::warpgroup_commit_batch();
#pragma unroll
        for (int i = 0; i < kPart; ++i) cute::warpgroup_fence_operand(part[i]);
        // While the up rows' batch runs: block kb + 1's stage and row scales.
        if (h == 1 && kb + 1 < p.k_blocks) wait_and_read_rows(kb + 1);
        cute::warpgroup_wait<0>();
#pragma unroll
        for (int i = 0; i < kPart; ++i) cute::warpgroup_fence_operand(part[i]);
        if (h == 1) pipe.release(issued);
#pragma unroll
        for (int i = 0; i < kPart; ++i)
          acc[h * kPart + i] =
              fmaf(part[i], i < kPart / 2 ? low[(i >> 1) & 1] : high[(i >> 1) & 1], acc[h * kPart + i]);
      }
    });
  };
  static_assert(BN == 128 || (BN == 256 && (kEpi == Epilogue::gated_e4m3 || kEpi == Epilogue::store)),
                "FP8 tiles: 128 wide, or 256 for gated_e4m3 and store");
  if constexpr (BN == 256)
    fp8_halves(std::integral_constant<int, BN / 2>{});
  else
    fp8_tile(std::integral_constant<int, BN / 4>{});  // the two 64-row halves
}

}  // namespace moekit::cuda::hopper

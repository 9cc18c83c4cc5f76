// The Hopper grouped GEMM's producer warpgroup (warpgroup 0 of a block): the loads that fill the pipeline's stages
// with each tile's A rows (a TMA copy, or gathered token rows), FP8's row scales and the expert's weight tile, and
// the copying warps that store the rows the math warpgroups stage (the staged epilogues).
#pragma once

#include <cuda.h>
#include <cutlass/arch/barrier.h>

#include <cute/arch/copy_sm90_tma.hpp>

#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/sm90_gemm_epilogue.cuh"
#include "moekit/cuda/sm90_gemm_layout.cuh"
#include "moekit/cuda/sm90_gemm_scheduler.cuh"
#include "moekit/cuda/sm90_wgmma.cuh"

namespace moekit::cuda::hopper {

// Fills the stages, tile by tile and k block by k block, each completing on its "full" barrier once the math
// warpgroups have freed it ("empty"). Run by warp 0 (lane 0 issues the copies; the whole warp walks the tiles, whose
// expert lookup is a warp's), or with kGatherA by the whole warpgroup, each thread gathering 16-byte pieces of the
// tile's token rows with cp.async into the 128-byte-swizzled layout TMA would write.
// kCluster 2: when both tiles of the pair belong to one expert, each block copies half of the weight tile and the
// copy engine multicasts it into both blocks' stages.
template <class C>
__device__ __forceinline__ void load_stages(const CUtensorMap& a_map, const CUtensorMap& b_map,
                                            const CUtensorMap& s_map, const GemmParams& p,
                                            const TileScheduler<C::kCluster, C::kEpi>& sched, uint8_t* smem,
                                            uint64_t* full, uint32_t empty_at) {
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  using T = typename C::T;
  constexpr int BN = C::BN, kStages = C::kStages, kK = C::kK;
  constexpr bool kGatherA = C::kGatherA, kFp8 = C::kFp8;
  constexpr Epilogue kEpi = C::kEpi;
  constexpr int kHalfRows = C::kHalfRows, kABytes = C::kABytes, kHalfBytes = C::kHalfBytes;
  constexpr int kStageBytes = C::kStageBytes, kScaleOffset = C::kScaleOffset;
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
  for (int64_t unit = sched.first_unit, units = sched.unit_count(); unit < units; unit = sched.advance(unit)) {
    const Tile t = sched.tile_of(unit, hint);
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
          cute::SM90_TMA_LOAD_MULTICAST_4D::copy(&b_map, &full[stage], uint16_t{0x3}, kHint, dst, k, c1, c2, t.expert);
        else
          cute::SM90_TMA_LOAD_4D::copy(&b_map, &full[stage], kHint, dst, k, c1, c2, t.expert);
      };
      if (t.multicast) {
        copy_half(static_cast<int>(sched.rank), true);
      } else {
        copy_half(0, false);
        copy_half(1, false);
      }
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  }
}

// The copying warps (warps 1-3 of the producer warpgroup, threads 32-127) of a staged epilogue: for each tile, wait
// until math warpgroup m has staged its rows (named barrier 3 + m), store them (copy_staged), and free its buffer (5 +
// m).
template <class C>
__device__ __forceinline__ void store_staged_rows(const GemmParams& p, const TileScheduler<C::kCluster, C::kEpi>& sched,
                                                  const uint8_t* staged) {
  using Staged = typename C::Staged;
  constexpr Epilogue kEpi = C::kEpi;
  constexpr int kCols = C::kCols;
  const int copier = threadIdx.x - 32;
#pragma unroll
  for (int m = 0; m < kMathGroups; ++m) named_arrive(5 + m, 128 + kCopyThreads);  // both buffers free
  int64_t hint = 0;
  for (int64_t unit = sched.first_unit, units = sched.unit_count(); unit < units; unit = sched.advance(unit)) {
    const Tile t = sched.tile_of(unit, hint);
    if (!t.valid) continue;
    // gated_e4m3 stages its group's 128 codes a row (as 64 2-byte units).
    const int64_t col_base = int64_t{t.n_block} * kCols;
    auto* const out_rows = static_cast<Staged*>(p.out);
    const int64_t outputs = kEpi == Epilogue::gated_e4m3 ? p.outputs / 2 : p.outputs;
#pragma unroll
    for (int m = 0; m < kMathGroups; ++m) {
      if (sched.idle_of(t, m)) continue;
      named_sync(3 + m, 128 + kCopyThreads);
      copy_staged<Staged, kCols>(out_rows, outputs, staged + m * kStagedBytes<kCols>, t.row, m, col_base, copier);
      named_arrive(5 + m, 128 + kCopyThreads);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the last rows written, not only read
}

}  // namespace moekit::cuda::hopper

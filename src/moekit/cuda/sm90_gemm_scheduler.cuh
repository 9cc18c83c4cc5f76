// The Hopper grouped GEMM's tile scheduler: which (row tile, column block) units a persistent block takes, in
// what order, and what each unit's tile is (its rows, expert, whether a cluster pair shares its weight tile).
// Every role of a block (producer, copiers, math warpgroups) walks the same units with its own scheduler.
#pragma once

#include <cstdint>

#include "moekit/cuda/routing.cuh"
#include "moekit/cuda/sm90_gemm_layout.cuh"

namespace moekit::cuda::hopper {

// A block's row tile and expert in one unit of work, and whether the pair shares its weight tile.
struct Tile {
  int64_t m_tile;
  int64_t row;  // the tile's first row of A and of out
  int n_block;
  int expert;
  bool valid, multicast;
};

// kCluster 2: pairs of blocks (a cluster) take the row tiles 2u and 2u + 1 of the same column block, so a unit is
// a pair of row tiles times a column block; block `rank` of the pair takes the tile 2u + rank.
template <int kCluster, Epilogue kEpi>
struct TileScheduler {
  const GemmParams& p;
  int64_t experts, m_tiles;  // m_tiles: the row tiles the device routing made
  uint32_t rank;             // this block's in its cluster
  int64_t first_unit, unit_step;

  __device__ __forceinline__ TileScheduler(const GemmParams& params, uint32_t block_rank)
      : p(params),
        experts(params.a.experts),
        m_tiles(params.tile_offsets[params.a.experts]),
        rank(block_rank),
        first_unit(blockIdx.x / kCluster),
        unit_step(gridDim.x / kCluster) {}

  // Recomputed in each role's loop rather than held: held across the register reconfiguration (setmaxnreg),
  // ptxas kept it in local memory.
  __device__ __forceinline__ int64_t unit_count() const { return (m_tiles + kCluster - 1) / kCluster * p.n_blocks; }

  // The next unit a block takes. gated_e4m3 reads the step where it is used (gridDim is a constant): held
  // across setmaxnreg, it spilled there once that epilogue staged its codes (and read so by every epilogue, the
  // bf16 ones spilled other values instead).
  __device__ __forceinline__ int64_t advance(int64_t unit) const {
    return unit + (kEpi == Epilogue::gated_e4m3 ? int64_t{gridDim.x / kCluster} : unit_step);
  }

  // The tile of `unit`. A block walks its units in order, so the row tiles only grow: `hint`, the expert of the
  // pair's first tile last time, starts the lookup, a whole warp's (expert_of_from_warp: every caller is a whole
  // warp).
  __device__ __forceinline__ Tile tile_of(int64_t unit, int64_t& hint) const {
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
  }

  // Whether math warpgroup `math`'s 64 rows of tile t are all past its group's own rows. A group's own rows come
  // first in its tiles, so when the warpgroup's first row is past them (masked: at or past masked_m of its group;
  // contiguous: padding), all its rows are: it only passes the stages on, and the other warpgroup has the tensor
  // cores to itself (a tile with at most 64 rows costs half; decode's do). In the contiguous layout only with
  // idle_padding (the default; measured 10-12% faster at 64 tokens).
  __device__ __forceinline__ bool idle_of(const Tile& t, int math) const {
    return t.valid &&
           (p.masked_m ? t.row - t.expert * p.masked_rows + math * 64 >= p.masked_m[t.expert]
                       : p.idle_padding && p.padded_pair && p.padded_pair[t.m_tile * kBlockM + math * 64] < 0);
  }
};

}  // namespace moekit::cuda::hopper

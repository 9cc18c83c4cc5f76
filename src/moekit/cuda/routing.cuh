// Routing on the device: (token, slot) pairs sorted by expert (stable), per-expert offsets, the
// inverse permutation and the tile schedule of the grouped products. No host synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/cuda/experts_cuda.h"

#ifdef __CUDACC__
#include <cub/block/block_scan.cuh>
#endif

namespace moekit::cuda {

struct DeviceRouting {
  int32_t* offsets = nullptr;       // [E + 1]: rows of expert e are [offsets[e], offsets[e + 1])
  int32_t* tile_offsets = nullptr;  // [E + 1]: row tiles of expert e are [tile_offsets[e], tile_offsets[e + 1])
  int32_t* row_pair = nullptr;      // [P]: the pair t * K + k of each sorted row (first offsets[E] valid)
  int32_t* pair_row = nullptr;      // [P]: the sorted row of each pair, -1 for a sentinel or invalid id
};

// Device bytes route_on_device needs for P = T * K pairs and E experts.
std::size_t routing_workspace_bytes(int64_t pairs, int64_t experts);

// Fills r (carved out of workspace) for tiles of tile_rows rows. Asynchronous on stream.
void route_on_device(const ExpertsArgs& a, int tile_rows, void* workspace, DeviceRouting& r, cudaStream_t stream);

#ifdef __CUDACC__
constexpr int kScanThreads = 256;  // block_exclusive_sums' block (1,024 spilled: 64 registers a thread)

// Exclusive prefix sums of two counts per item over items [0, n), by one block of kScanThreads threads: each
// thread takes a run of consecutive items and cub::BlockScan the runs' totals. count(i) gives item i's two
// counts (int2); store(i, sums) receives the sums over the items before i, for i in [0, n] (store(n, ...) the
// totals). A thread walking the counts took 13.6 us at 128 experts on the H200: a dependent global load an expert.
template <typename Count, typename Store>
__device__ void block_exclusive_sums(int64_t n, Count count, Store store) {
  using Scan = cub::BlockScan<int2, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const auto add = [](int2 x, int2 y) { return make_int2(x.x + y.x, x.y + y.y); };
  const int64_t run = (n + kScanThreads - 1) / kScanThreads;
  const int64_t first = threadIdx.x * run, last = min(first + run, n);
  int2 total = make_int2(0, 0);
  for (int64_t i = first; i < last; ++i) total = add(total, count(i));
  int2 before, all;
  Scan(scan_storage).ExclusiveScan(total, before, make_int2(0, 0), add, all);
  for (int64_t i = first; i < last; ++i) {
    store(i, before);
    before = add(before, count(i));
  }
  if (threadIdx.x == 0) store(n, all);
}

// The last e in [lo, hi] with starts[e] <= index, given starts[lo] <= index.
__device__ __forceinline__ int64_t last_start_at_most(const int32_t* starts, int64_t lo, int64_t hi, int64_t index) {
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (starts[mid] <= index)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The expert of an index into a prefix-sum array of E + 1 entries (rows: offsets; tiles:
// tile_offsets): the last e with starts[e] <= index, which skips experts that have none.
__device__ __forceinline__ int64_t expert_of(const int32_t* starts, int64_t experts, int64_t index) {
  return last_start_at_most(starts, 0, experts - 1, index);
}

// expert_of when the answer is known to be at least `hint` (the expert of an earlier index), by a whole warp: all
// 32 lanes call it with the same arguments and get the same answer. 32 consecutive starts a load, so one coalesced
// load when the answer lies within 32 experts of `hint`: the starts are non-decreasing, so those at most `index`
// are a prefix, whose length is the count of a ballot. For a persistent kernel walking its tiles in order (the
// grouped GEMM, whose blocks step over a dozen experts and more at a time), where a binary search above the hint
// was a chain of 5-6 dependent loads a tile.
__device__ __forceinline__ int64_t expert_of_from_warp(const int32_t* starts, int64_t experts, int64_t index,
                                                       int64_t hint) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int64_t e = hint;
  for (int64_t base = hint + 1; base < experts; base += 32) {
    const int64_t j = base + lane;
    const unsigned below = __ballot_sync(0xffffffffu, j < experts && starts[j] <= index);
    const int n = __popc(below);
    if (n > 0) e = base + n - 1;
    if (n < 32) break;
  }
  return e;
}
#endif

}  // namespace moekit::cuda

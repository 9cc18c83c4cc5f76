// Routing on the device: (token, slot) pairs sorted by expert (stable), per-expert offsets, the
// inverse permutation and the tile schedule of the grouped products. No host synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/cuda/experts_cuda.h"

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

// expert_of when the answer is known to be at least `hint` (the expert of an earlier index): two
// independent loads when the index lies in hint's expert or the next one, as it does for a
// persistent kernel walking its tiles in order; a binary search above them otherwise.
__device__ __forceinline__ int64_t expert_of_from(const int32_t* starts, int64_t experts, int64_t index, int64_t hint) {
  if (hint + 1 >= experts) return experts - 1;
  const int32_t next = starts[hint + 1];
  const int32_t after = hint + 2 < experts ? starts[hint + 2] : 0x7fffffff;
  if (next > index) return hint;
  if (after > index) return hint + 1;
  return last_start_at_most(starts, hint + 2, experts - 1, index);
}
#endif

}  // namespace moekit::cuda

#include <cub/device/device_radix_sort.cuh>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/routing.cuh"

namespace moekit::cuda {
namespace {

std::size_t align256(std::size_t b) {
  return (b + 255) / 256 * 256;
}

int key_bits(int64_t experts) {
  int bits = 1;
  while ((int64_t{1} << bits) <= experts) ++bits;  // keys go up to E (the sentinel bucket)
  return bits;
}

// Sort keys: the expert, or E for a sentinel or invalid id, so those sort last. With kBlockCounts each block counts
// its pairs in shared memory and adds its nonzero counts once per expert: a global atomic per pair put P / E
// atomics in a row on each address (40 us for 196,608 pairs over 128 experts on the H200).
template <bool kBlockCounts>
__global__ void make_keys_kernel(const ExpertsArgs a, uint32_t* keys, int32_t* pairs, int32_t* counts) {
  extern __shared__ int32_t block_counts[];
  const int64_t P = a.tokens * a.top_k, buckets = a.experts + 1;
  if constexpr (kBlockCounts) {
    for (int64_t e = threadIdx.x; e < buckets; e += blockDim.x) block_counts[e] = 0;
    __syncthreads();
  }
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < P; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = load_id(a, i);
    const auto bucket = static_cast<uint32_t>(e < 0 || e >= a.experts ? a.experts : e);
    keys[i] = bucket;
    pairs[i] = static_cast<int32_t>(i);
    atomicAdd(kBlockCounts ? &block_counts[bucket] : &counts[bucket], 1);
  }
  if constexpr (kBlockCounts) {
    __syncthreads();
    for (int64_t e = threadIdx.x; e < buckets; e += blockDim.x)
      if (const int32_t c = block_counts[e]) atomicAdd(&counts[e], c);
  }
}

constexpr int kKeysThreads = 256, kKeysPerThread = 4;
constexpr std::size_t kMaxBlockCountBytes = 48 * 1024;  // without opting in to more shared memory

__global__ void __launch_bounds__(kScanThreads)
    offsets_kernel(const int32_t* counts, int64_t experts, int tile_rows, int32_t* offsets, int32_t* tile_offsets) {
  block_exclusive_sums(
      experts, [&](int64_t e) { return make_int2(counts[e], (counts[e] + tile_rows - 1) / tile_rows); },
      [&](int64_t e, int2 before) {
        offsets[e] = before.x;
        tile_offsets[e] = before.y;
      });
}

__global__ void inverse_kernel(int64_t pairs, const int32_t* sorted_pairs, const int32_t* offsets, int64_t experts,
                               int32_t* row_pair, int32_t* pair_row) {
  const int32_t valid = offsets[experts];
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < pairs; r += int64_t{gridDim.x} * blockDim.x) {
    const int32_t pair = sorted_pairs[r];
    row_pair[r] = pair;
    pair_row[pair] = r < valid ? static_cast<int32_t>(r) : -1;
  }
}

struct Layout {
  std::size_t counts, offsets, tiles, keys_in, keys_out, pairs_in, sorted_pairs, row_pair, pair_row, sort_temp, total;
};

Layout layout(int64_t pairs, int64_t experts) {
  Layout l;
  const auto E1 = static_cast<std::size_t>(experts + 1);
  const auto P = static_cast<std::size_t>(std::max<int64_t>(pairs, 1));
  std::size_t temp = 0;
  MOEKIT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, temp, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(P), 0, key_bits(experts)));
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t here = at;
    at += align256(bytes);
    return here;
  };
  l.counts = take(E1 * 4);
  l.offsets = take(E1 * 4);
  l.tiles = take(E1 * 4);
  l.keys_in = take(P * 4);
  l.keys_out = take(P * 4);
  l.pairs_in = take(P * 4);
  l.sorted_pairs = take(P * 4);
  l.row_pair = take(P * 4);
  l.pair_row = take(P * 4);
  l.sort_temp = take(temp);
  l.total = at;
  return l;
}

}  // namespace

std::size_t routing_workspace_bytes(int64_t pairs, int64_t experts) {
  return layout(pairs, experts).total;
}

void route_on_device(const ExpertsArgs& a, int tile_rows, void* workspace, DeviceRouting& r, cudaStream_t stream) {
  const int64_t P = a.tokens * a.top_k, E = a.experts;
  MOEKIT_CHECK(P < (int64_t{1} << 31), "too many (token, expert) pairs for one call: ", P);
  const Layout l = layout(P, E);
  char* base = static_cast<char*>(workspace);
  auto* counts = reinterpret_cast<int32_t*>(base + l.counts);
  r.offsets = reinterpret_cast<int32_t*>(base + l.offsets);
  r.tile_offsets = reinterpret_cast<int32_t*>(base + l.tiles);
  r.row_pair = reinterpret_cast<int32_t*>(base + l.row_pair);
  r.pair_row = reinterpret_cast<int32_t*>(base + l.pair_row);
  auto* keys_in = reinterpret_cast<uint32_t*>(base + l.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(base + l.keys_out);
  auto* pairs_in = reinterpret_cast<int32_t*>(base + l.pairs_in);
  MOEKIT_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<std::size_t>(E + 1) * 4, stream));
  const int blocks = static_cast<int>(std::min<int64_t>((P + 255) / 256, 4096));
  if (P > 0) {
    const auto count_bytes = static_cast<std::size_t>(E + 1) * sizeof(int32_t);
    const int key_blocks = static_cast<int>(
        std::min<int64_t>((P + kKeysThreads * kKeysPerThread - 1) / (kKeysThreads * kKeysPerThread), 1024));
    if (count_bytes <= kMaxBlockCountBytes)
      make_keys_kernel<true><<<key_blocks, kKeysThreads, count_bytes, stream>>>(a, keys_in, pairs_in, counts);
    else
      make_keys_kernel<false><<<blocks, kKeysThreads, 0, stream>>>(a, keys_in, pairs_in, counts);
    MOEKIT_CUDA_CHECK_LAUNCH();
  }
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(counts, E, tile_rows, r.offsets, r.tile_offsets);
  MOEKIT_CUDA_CHECK_LAUNCH();
  if (P == 0) return;
  std::size_t temp = l.total - l.sort_temp;
  // Radix sort is stable: rows of one expert stay in pair order.
  auto* sorted_pairs = reinterpret_cast<int32_t*>(base + l.sorted_pairs);
  MOEKIT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + l.sort_temp, temp, keys_in, keys_out, pairs_in, sorted_pairs,
                                                    static_cast<int>(P), 0, key_bits(E), stream));
  inverse_kernel<<<blocks, 256, 0, stream>>>(P, sorted_pairs, r.offsets, E, r.row_pair, r.pair_row);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::cuda

#include <algorithm>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/device_math.cuh"
#include "moekit/cuda/routing.cuh"

namespace moekit::cuda {
namespace {

std::size_t align256(std::size_t b) {
  return (b + 255) / 256 * 256;
}

// Routing is a stable counting sort of the pairs by bucket (the expert, or E for a sentinel or invalid id, so those
// sort last), in three launches: count_kernel, a histogram of each chunk of pairs; offsets_kernel, the experts'
// row and tile offsets and where each chunk's rows of each bucket start; place_rows_kernel, each pair's row (its
// chunk's start for its bucket plus its rank among the chunk's earlier pairs of that bucket). It replaced a radix sort
// (cub::DeviceRadixSort) and the kernel that inverted it: the same rows, in three launches instead of seven or eight
// (with the memset of the counts), 16 us instead of 27 at 32,768 pairs on the H200.
__device__ __forceinline__ int64_t bucket_of(const ExpertsArgs& a, int64_t pair) {
  const int64_t e = load_id(a, pair);
  return e < 0 || e >= a.experts ? a.experts : e;
}

// The pairs are cut into chunks, a block of count_kernel and of place_rows_kernel each: at most kMaxChunks chunks of a
// multiple of kChunkPairs pairs, so that the offsets kernel's thread a bucket loads all its chunks' counts at once, a
// placing warp's run of a chunk is one batch of registers up to 131,072 pairs, and small calls are spread over as many
// blocks as they can be (with chunks of 2,048, 4,096 pairs were placed by two blocks in 11 us).
constexpr int64_t kChunkPairs = 256, kMaxChunks = 32;
int64_t chunk_pairs(int64_t pairs) {
  const int64_t rounds = (pairs + kChunkPairs * kMaxChunks - 1) / (kChunkPairs * kMaxChunks);
  return kChunkPairs * std::max<int64_t>(rounds, 1);
}
// Chunks of `pairs` pairs: the rows of counts the workspace holds, and the blocks of the launches (one without pairs).
int64_t chunk_count(int64_t pairs) {
  return std::max<int64_t>((pairs + chunk_pairs(pairs) - 1) / chunk_pairs(pairs), 1);
}
constexpr std::size_t kMaxSharedCounts = 48 * 1024;  // bytes of counts a block holds without opting in to more
constexpr int kCountThreads = 256, kPlaceWarps = 8;
constexpr int kPlaceBatch = 16;  // rounds of 32 pairs whose buckets a placing warp loads at once

// Bucket counts of chunk blockIdx.x, to counts[blockIdx.x * (E + 1) + bucket]: in shared memory (kShared), or with
// global atomics in the chunk's own row (past kMaxSharedCounts: 12,288 experts and more).
template <bool kShared>
__global__ void __launch_bounds__(kCountThreads) count_kernel(const ExpertsArgs a, int64_t chunk, int32_t* counts) {
  extern __shared__ int32_t shared_counts[];
  const int64_t P = a.tokens * a.top_k, buckets = a.experts + 1;
  int32_t* const row = counts + blockIdx.x * buckets;
  int32_t* const local = kShared ? shared_counts : row;
  for (int64_t e = threadIdx.x; e < buckets; e += blockDim.x) local[e] = 0;
  __syncthreads();
  const int64_t first = blockIdx.x * chunk, last = min(first + chunk, P);
  // kAtOnce ids a thread, loaded before their counts are added.
  constexpr int kAtOnce = 4;
  for (int64_t i0 = first + threadIdx.x; i0 < last; i0 += int64_t{kAtOnce} * blockDim.x) {
    int64_t bucket[kAtOnce];
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j) {
      const int64_t i = i0 + int64_t{j} * blockDim.x;
      bucket[j] = i < last ? bucket_of(a, i) : -1;
    }
#pragma unroll
    for (int j = 0; j < kAtOnce; ++j)
      if (bucket[j] >= 0) atomicAdd(&local[bucket[j]], 1);
  }
  if constexpr (kShared) {
    __syncthreads();
    for (int64_t e = threadIdx.x; e < buckets; e += blockDim.x) row[e] = local[e];
  }
}

// One block. Each bucket's counts over the chunks become, in place, its rows in earlier chunks, and its total goes to
// the row of `counts` after the chunks'; the totals give the experts' row and tile offsets (offsets[E]: the first
// sentinel row). A thread a bucket, kAhead chunks' counts loaded before they are summed.
__global__ void __launch_bounds__(kScanThreads) offsets_kernel(int32_t* counts, int64_t chunks, int64_t experts,
                                                               int tile_rows, int32_t* offsets, int32_t* tile_offsets) {
  constexpr int kAhead = static_cast<int>(kMaxChunks);
  const int64_t buckets = experts + 1;
  int32_t* const totals = counts + chunks * buckets;
  for (int64_t e = threadIdx.x; e < buckets; e += blockDim.x) {
    int32_t before = 0;
    for (int64_t c0 = 0; c0 < chunks; c0 += kAhead) {
      int32_t n[kAhead];
#pragma unroll
      for (int j = 0; j < kAhead; ++j) n[j] = c0 + j < chunks ? counts[(c0 + j) * buckets + e] : 0;
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        if (c0 + j < chunks) counts[(c0 + j) * buckets + e] = before;
        before += n[j];
      }
    }
    totals[e] = before;
  }
  __syncthreads();
  block_exclusive_sums(
      experts, [&](int64_t e) { return make_int2(totals[e], (totals[e] + tile_rows - 1) / tile_rows); },
      [&](int64_t e, int2 before) {
        offsets[e] = before.x;
        tile_offsets[e] = before.y;
      });
}

// Each pair's row: offsets[bucket] + the bucket's rows in earlier chunks + its rank among its chunk's earlier pairs of
// the bucket. A chunk is a block of `warps` warps, each taking a run of the chunk's pairs in rounds of 32: the warp
// counts its run (pass 1), the block turns the counts into where each warp's rows of each bucket start (`next`, in
// shared memory, or with kShared false the chunk's own row of `counts`, one warp a block), and the warp walks its
// run again (pass 2), each lane's row `next` plus the earlier lanes of its round with the same bucket (a match).
// Writes row_pair (the sorted pairs) and pair_row (each pair's row, -1 for a sentinel or invalid id).
template <bool kShared>
__global__ void __launch_bounds__(kPlaceWarps * 32, 1)
    place_rows_kernel(const ExpertsArgs a, int64_t chunk, int32_t* counts, const int32_t* offsets, int32_t* row_pair,
                      int32_t* pair_row) {
  extern __shared__ int32_t next_rows[];
  const int64_t P = a.tokens * a.top_k, E = a.experts, buckets = E + 1;
  const int warps = static_cast<int>(blockDim.x / 32), warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t first = blockIdx.x * chunk, last = min(first + chunk, P);
  const int64_t run = (last - first + warps - 1) / warps;
  const int64_t begin = min(first + warp * run, last), end = min(begin + run, last);
  int32_t* const chunk_row = counts + blockIdx.x * buckets;
  int32_t* const next = kShared ? next_rows + warp * buckets : chunk_row;
  // The buckets of kPlaceBatch rounds from `from` (-1 past the run), all loads issued before any is used. The first
  // batch stays in registers for both passes (a run is one batch up to 131,072 pairs).
  auto load_batch = [&](int64_t from, int32_t(&bucket)[kPlaceBatch]) {
#pragma unroll
    for (int j = 0; j < kPlaceBatch; ++j) {
      const int64_t i = from + j * 32 + lane;
      bucket[j] = i < end ? static_cast<int32_t>(bucket_of(a, i)) : -1;
    }
  };
  int32_t first_batch[kPlaceBatch];
  load_batch(begin, first_batch);
  auto each_batch = [&](auto&& body) {
    body(begin, first_batch);
    for (int64_t from = begin + kPlaceBatch * 32; from < end; from += kPlaceBatch * 32) {
      int32_t bucket[kPlaceBatch];
      load_batch(from, bucket);
      body(from, bucket);
    }
  };
  if constexpr (kShared) {
    for (int64_t e = lane; e < buckets; e += 32) next[e] = 0;
    __syncwarp();
    each_batch([&](int64_t, const int32_t(&bucket)[kPlaceBatch]) {
#pragma unroll
      for (int j = 0; j < kPlaceBatch; ++j) {
        const int32_t e = bucket[j];
        const unsigned same = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && lane == __ffs(same) - 1) next[e] += __popc(same);
        __syncwarp();
      }
    });
    __syncthreads();
    // The warps' counts of bucket e become where their rows start.
    for (int64_t e = threadIdx.x; e < buckets; e += blockDim.x) {
      int32_t at = offsets[e] + chunk_row[e];
      for (int w = 0; w < warps; ++w) {
        const int32_t n = next_rows[w * buckets + e];
        next_rows[w * buckets + e] = at;
        at += n;
      }
    }
    __syncthreads();
  } else {
    // One warp: the chunk's row of counts, made the bucket's first row.
    for (int64_t e = lane; e < buckets; e += 32) next[e] += offsets[e];
    __syncwarp();
  }
  each_batch([&](int64_t from, const int32_t(&bucket)[kPlaceBatch]) {
#pragma unroll
    for (int j = 0; j < kPlaceBatch; ++j) {
      const int32_t e = bucket[j];
      const int64_t i = from + j * 32 + lane;
      const unsigned same = __match_any_sync(0xffffffffu, e);
      if (e >= 0) {
        const int32_t row = next[e] + __popc(same & ((1u << lane) - 1));
        row_pair[row] = static_cast<int32_t>(i);
        pair_row[i] = e < E ? row : -1;
      }
      __syncwarp();
      if (e >= 0 && lane == __ffs(same) - 1) next[e] += __popc(same);
      __syncwarp();
    }
  });
}

struct Layout {
  std::size_t offsets, tiles, counts, row_pair, pair_row, total;
};

Layout layout(int64_t pairs, int64_t experts) {
  Layout l;
  const auto E1 = static_cast<std::size_t>(experts + 1);
  const auto P = static_cast<std::size_t>(std::max<int64_t>(pairs, 1));
  const auto chunks = static_cast<std::size_t>(chunk_count(pairs));
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t here = at;
    at += align256(bytes);
    return here;
  };
  l.offsets = take(E1 * 4);
  l.tiles = take(E1 * 4);
  l.counts = take((chunks + 1) * E1 * 4);  // each chunk's counts, then the buckets' totals
  l.row_pair = take(P * 4);
  l.pair_row = take(P * 4);
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
  const int64_t chunk = chunk_pairs(P), chunks = chunk_count(P);
  const auto count_bytes = static_cast<std::size_t>(E + 1) * sizeof(int32_t);
  const bool shared = count_bytes <= kMaxSharedCounts;
  const auto grid = static_cast<unsigned>(chunks);
  if (shared)
    count_kernel<true><<<grid, kCountThreads, count_bytes, stream>>>(a, chunk, counts);
  else
    count_kernel<false><<<grid, kCountThreads, 0, stream>>>(a, chunk, counts);
  MOEKIT_CUDA_CHECK_LAUNCH();
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(counts, chunks, E, tile_rows, r.offsets, r.tile_offsets);
  MOEKIT_CUDA_CHECK_LAUNCH();
  if (P == 0) return;
  // As many warps a chunk as have room for their counts in shared memory (at most kPlaceWarps); one warp on the
  // chunk's row of counts in global memory past that.
  const int warps =
      shared ? static_cast<int>(std::clamp<std::size_t>(kMaxSharedCounts / count_bytes, 1, kPlaceWarps)) : 1;
  if (shared)
    place_rows_kernel<true><<<grid, static_cast<unsigned>(warps * 32), warps * count_bytes, stream>>>(
        a, chunk, counts, r.offsets, r.row_pair, r.pair_row);
  else
    place_rows_kernel<false><<<grid, 32, 0, stream>>>(a, chunk, counts, r.offsets, r.row_pair, r.pair_row);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::cuda

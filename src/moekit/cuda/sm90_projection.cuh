// The launch of one projection on the Hopper grouped GEMM (sm90_projection.h), included by the per-format units
// that instantiate it (sm90_grouped_gemm_bf16.cu, sm90_grouped_gemm_fp8.cu): the tile width and pipeline depth of
// each case, the tensor maps of the operands, the grid (one block, or cluster of two, per multiprocessor that holds
// one) and the choice of clusters.
// Projections at least 1,024 deep run in clusters of two blocks that share (multicast) their weight tiles where
// both row tiles belong to one expert; MOEKIT_DEEPGEMM_CLUSTER=1 in the environment turns that off.
// Launches are sized from host-known bounds and the tile counts are read on the device, so a call never waits for the
// host and can be captured in a CUDA graph.
#pragma once

#include <algorithm>
#include <array>
#include <mutex>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/sm90_grouped_gemm.cuh"
#include "moekit/cuda/sm90_projection.h"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda::hopper {

// Weight rows per column block (gated: half gate, half up rows) and pipeline depth, the deepest that fits beside
// the staging buffers: bf16 4 x 48 KB (beside the first projection's two 17 KB buffers; 3 beside the second's
// two 33 KB); FP8's gated first projection 128 wide (its second set of accumulators takes the registers
// of a wider tile) at 6 x 34 KB; FP8's gated_e4m3 256 wide, a whole 128-wide group of the intermediate a tile
// whose gate and up halves take turns on one set of accumulators (session 24: its GEMM 1.17-1.18x as fast as pairs
// of 128-wide tiles), at 4 x 49 KB beside its two 9 KB staging buffers; FP8's second projection 256 wide in the same
// two halves, one weight scale block each (192 wide before: session 20, its GEMM 1.035-1.125x as fast as 128 wide),
// 3 x 49 KB beside its two 33 KB staging buffers.
template <bool kFp8, Epilogue kEpi>
constexpr int kTileN = !kFp8                          ? 256
                       : kEpi == Epilogue::store      ? 256
                       : kEpi == Epilogue::gated_e4m3 ? 256
                                                      : 128;
template <bool kFp8, Epilogue kEpi, bool kGatherA>
constexpr int kStages = fitting_stages<kTileN<kFp8, kEpi>, kFp8, kEpi, kGatherA, kFp8 ? 6 : 4>();
static_assert(kStages<false, Epilogue::gated, false> == 4 && kStages<false, Epilogue::store, false> == 3 &&
              kStages<false, Epilogue::gated, true> == 4 && kStages<true, Epilogue::gated, false> == 6 &&
              kStages<true, Epilogue::gated_e4m3, false> == 4 && kStages<true, Epilogue::store, false> == 3);

template <typename T, Epilogue kEpi, int kCluster, bool kGatherA, bool kFp8>
void launch_gemm_on(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& s_map, const GemmParams& p,
                    int64_t max_tiles, cudaStream_t stream) {
  constexpr int BN = kTileN<kFp8, kEpi>;
  constexpr int kDepth = kStages<kFp8, kEpi, kGatherA>;
  auto* kernel = grouped_gemm_kernel<GemmConfig<T, BN, kEpi, kDepth, kCluster, kGatherA, kFp8>>;
  constexpr std::size_t smem = gemm_smem_bytes<BN, kFp8, kEpi, kGatherA>(kDepth);
  static_assert(smem <= kSharedMemoryLimit, "the pipeline does not fit in shared memory");
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // One cluster per pair of multiprocessors that can hold one, never more than there are units of work.
  // The shared memory opt-in and the occupancy query are made once per device: asked of the driver on
  // every call, they cost more host time than a decode step's kernels take.
  static std::mutex mutex;
  static std::array<int, 64> resident_clusters{};
  const int clusters = once_per_device(resident_clusters, mutex, [&] {
    MOEKIT_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int fit = multiprocessor_count() / kCluster;
    if constexpr (kCluster > 1) {
      config.gridDim = dim3(static_cast<unsigned>(fit * kCluster));
      MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&fit, kernel, &config));
      MOEKIT_CHECK(fit > 0, "deepgemm: no cluster of ", kCluster, " blocks fits on this device");
    }
    return fit;
  });
  const int64_t units = (max_tiles + kCluster - 1) / kCluster * p.n_blocks;
  config.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(units, clusters) * kCluster));
  MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, a_map, b_map, s_map, p));
}

template <typename T, Epilogue kEpi, bool kGatherA, bool kFp8>
void launch_gemm(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& s_map, const GemmParams& p,
                 int64_t max_tiles, cudaStream_t stream) {
  if (cluster_blocks(int64_t{p.k_blocks} * kStageK<kFp8>, p.masked_m != nullptr) == 2)
    launch_gemm_on<T, kEpi, 2, kGatherA, kFp8>(a_map, b_map, s_map, p, max_tiles, stream);
  else
    launch_gemm_on<T, kEpi, 1, kGatherA, kFp8>(a_map, b_map, s_map, p, max_tiles, stream);
}

// The B map of a projection's weights, as 4-D {K, rows per part, parts, E} (or {K, parts, rows, E}
// for interleaved gate/up rows, keeping the strides increasing) with a box of half a weight tile.
inline CUtensorMap weight_map(const void* w, DType dtype, int64_t K, int64_t rows, int parts, bool interleaved,
                              int64_t E, int box_rows) {
  const uint64_t element = dtype_size(dtype);
  const uint64_t row_bytes = static_cast<uint64_t>(K) * element;
  const uint64_t expert_bytes = row_bytes * static_cast<uint64_t>(rows * parts);
  const auto box_k = static_cast<uint32_t>(kRowBytes / element);
  TensorMapShape s;
  s.rank = 4;
  if (interleaved) {
    s.sizes = {static_cast<uint64_t>(K), 2, static_cast<uint64_t>(rows), static_cast<uint64_t>(E), 0};
    s.strides = {row_bytes, 2 * row_bytes, expert_bytes, 0};
    s.box = {box_k, 1, static_cast<uint32_t>(box_rows), 1, 0};
  } else {
    s.sizes = {static_cast<uint64_t>(K), static_cast<uint64_t>(rows), static_cast<uint64_t>(parts),
               static_cast<uint64_t>(E), 0};
    s.strides = {row_bytes, row_bytes * static_cast<uint64_t>(rows), expert_bytes, 0};
    s.box = {box_k, static_cast<uint32_t>(box_rows), 1, 1, 0};
  }
  return make_tensor_map(w, dtype, s);
}

// Rows [M, K] in 128-row, 128-byte boxes.
inline CUtensorMap rows_map(const void* rows, DType dtype, int64_t K, int64_t M) {
  const uint64_t element = dtype_size(dtype);
  TensorMapShape s;
  s.rank = 2;
  s.sizes = {static_cast<uint64_t>(K), static_cast<uint64_t>(M), 0, 0, 0};
  s.strides = {static_cast<uint64_t>(K) * element, 0, 0, 0};
  s.box = {static_cast<uint32_t>(kRowBytes / element), kBlockM, 0, 0, 0};
  return make_tensor_map(rows, dtype, s);
}

// FP8 row scales [K / 128, M] in boxes of one tile's 128 rows of one K block.
inline CUtensorMap scales_map(const float* scales, int64_t K, int64_t M) {
  TensorMapShape s;
  s.rank = 2;
  s.sizes = {static_cast<uint64_t>(M), static_cast<uint64_t>(K / 128), 0, 0, 0};
  s.strides = {static_cast<uint64_t>(M) * 4, 0, 0, 0};
  s.box = {kBlockM, 1, 0, 0, 0};
  return make_tensor_map(scales, DType::f32, s);
}

template <typename T, Epilogue kEpi, bool kGatherA, bool kFp8>
void run_projection(const ExpertsArgs& a, const int32_t* tile_offsets, const int32_t* padded_pair, int64_t max_tiles,
                    const GemmProjection& j, cudaStream_t stream) {
  constexpr int BN = kTileN<kFp8, kEpi>;
  const DType operand = kFp8 ? DType::f8_e4m3 : a.dtype;
  const int64_t stage_k = kStageK<kFp8>, M = max_tiles * kBlockM, N = j.parts * j.part_rows;
  GemmParams p;
  p.a = a;
  p.tile_offsets = tile_offsets;
  p.padded_pair = padded_pair;
  p.weight_rows = j.weighted;
  p.k_blocks = static_cast<int>((j.depth + stage_k - 1) / stage_k);
  p.n_blocks = static_cast<int>((N + BN - 1) / BN);
  p.interleaved = j.interleaved;
  p.outputs = j.outputs;
  p.out = j.out;
  p.out_scales = j.out_scales;
  p.z_out = kFp8 ? nullptr : j.save_z;
  p.z_row_offsets = j.save_z_offsets;
  p.out_scale_rows = M;
  p.b_scales = j.weight_scales;
  p.b_scale_rows = (N + 127) / 128;
  p.masked_m = j.masked_m;
  p.masked_rows = j.masked_rows;
  p.idle_padding = idle_padding_enabled();
  // The gathering producer never reads the A map; it still gets a valid one (over the weights).
  const CUtensorMap a_map = kGatherA ? rows_map(j.weights, a.dtype, j.depth, 1) : rows_map(j.rows, operand, j.depth, M);
  const CUtensorMap s_map = kFp8 ? scales_map(j.row_scales, j.depth, M) : a_map;
  const CUtensorMap b_map =
      weight_map(j.weights, operand, j.depth, j.part_rows, j.parts, j.interleaved, a.experts, BN / 2);
  launch_gemm<T, kEpi, kGatherA, kFp8>(a_map, b_map, s_map, p, max_tiles, stream);
}

}  // namespace moekit::cuda::hopper

// The Hopper experts backends on CUDA (sm_90a, bf16/f16), both on the grouped GEMM of
// hopper_grouped_gemm.cuh over DeepGEMM's contiguous layout (every expert's rows start at a multiple
// of 128, so a row tile never straddles two experts):
//   deepgemm: route on the device (128-row tiles); copy each routed token row into its padded row;
//             first projection (TMA A, activation fused); second projection (bias fused, rows in the
//             activation dtype, as transformers' grouped_mm rounds them); weighted combine.
//   sonicmoe: the same routing, but no copied rows: the first projection's producer gathers the token
//             rows straight into shared memory; the second projection's epilogue applies the routing
//             weight; the combine adds the k rows of each token in order.
// The combine is grouped_mm's (pairs added in k order, in float), so results are deterministic.
// Both GEMMs run in clusters of two blocks that share (multicast) their weight tiles where both row
// tiles belong to one expert; MOEKIT_DEEPGEMM_CLUSTER=1 in the environment turns that off (a knob for
// measuring it, read once).
// Launches are sized from host-known bounds and the tile counts are read on the device, so a call
// never waits for the host and can be captured in a CUDA graph.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/grouped_gemm.cuh"
#include "moekit/cuda/hopper_grouped_gemm.cuh"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

using hopper::Epilogue;
using hopper::kBlockK;
using hopper::kBlockM;

constexpr int kTileN = 256;  // weight rows per column block (gated: 128 gate + 128 up)
constexpr int kStages = 4;   // 4 x 48 KB of the 227 KB a block may hold

std::size_t align256(std::size_t b) {
  return (b + 255) / 256 * 256;
}

// Row tiles of the padded layout in the worst case: every expert's last tile partly filled.
int64_t max_row_tiles(const ExpertsArgs& a) {
  const int64_t P = a.tokens * a.top_k;
  return (P + kBlockM - 1) / kBlockM + std::min(a.experts, P);
}

struct Layout {
  std::size_t pair_row, padded_pair, rows, hidden, y, total;
};

// deepgemm copies the token rows (rows); sonicmoe gathers them in the GEMM and has none.
Layout layout(const ExpertsArgs& a, bool copies_rows) {
  const auto P = static_cast<std::size_t>(a.tokens * a.top_k);
  const auto M = static_cast<std::size_t>(max_row_tiles(a) * kBlockM);
  const std::size_t e = dtype_size(a.dtype);
  Layout l;
  l.pair_row = align256(routing_workspace_bytes(static_cast<int64_t>(P), a.experts));
  l.padded_pair = l.pair_row + align256(P * 4);
  l.rows = l.padded_pair + align256(M * 4);
  l.hidden = l.rows + (copies_rows ? align256(M * static_cast<std::size_t>(a.hidden) * e) : 0);
  l.y = l.hidden + align256(M * static_cast<std::size_t>(a.intermediate) * e);
  l.total = l.y + align256(M * static_cast<std::size_t>(a.hidden) * e);
  return l;
}

// One block per sorted row: records the pair's padded row (and the padded row's pair), and with
// rows set copies the token's hidden state into its padded row, 16 bytes a thread.
__global__ void place_rows_kernel(const ExpertsArgs a, const DeviceRouting r, int32_t* pair_padded_row,
                                  int32_t* padded_pair, uint4* rows) {
  const int64_t P = a.tokens * a.top_k;
  const int32_t valid = r.offsets[a.experts];
  const int64_t vectors = a.hidden / 8;  // 2-byte elements, H a multiple of 8
  for (int64_t row = blockIdx.x; row < P; row += gridDim.x) {
    const int32_t pair = r.row_pair[row];
    if (row >= valid) {  // a sentinel or invalid id: no row, nothing to add
      if (threadIdx.x == 0) pair_padded_row[pair] = -1;
      continue;
    }
    const int64_t e = expert_of(r.offsets, a.experts, row);
    const int64_t padded = int64_t{r.tile_offsets[e]} * kBlockM + (row - r.offsets[e]);
    if (threadIdx.x == 0) {
      pair_padded_row[pair] = static_cast<int32_t>(padded);
      padded_pair[padded] = pair;
    }
    if (!rows) continue;
    const auto* src = static_cast<const uint4*>(a.x) + (pair / a.top_k) * vectors;
    uint4* dst = rows + padded * vectors;
    for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) dst[v] = __ldg(src + v);
  }
}

bool use_clusters() {
  static const bool on = [] {
    const char* v = std::getenv("MOEKIT_DEEPGEMM_CLUSTER");
    return !(v && std::strcmp(v, "1") == 0);
  }();
  return on;
}

template <typename T, Epilogue kEpi, int kCluster, bool kGatherA>
void launch_gemm_on(const CUtensorMap& a_map, const CUtensorMap& b_map, const hopper::GemmParams& p, int64_t max_tiles,
                    cudaStream_t stream) {
  auto* kernel = hopper::grouped_gemm_kernel<T, kTileN, kEpi, kStages, kCluster, kGatherA>;
  constexpr std::size_t smem = hopper::gemm_smem_bytes<kTileN, kStages>();
  static_assert(smem <= 227 * 1024, "the pipeline does not fit in shared memory");
  MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(hopper::kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // One cluster per pair of multiprocessors that can hold one, never more than there are units of work.
  int clusters = multiprocessor_count() / kCluster;
  if constexpr (kCluster > 1) {
    config.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
    MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
    MOEKIT_CHECK(clusters > 0, "deepgemm: no cluster of ", kCluster, " blocks fits on this device");
  }
  const int64_t units = (max_tiles + kCluster - 1) / kCluster * p.n_blocks;
  config.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(units, clusters) * kCluster));
  MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, a_map, b_map, p));
}

template <typename T, Epilogue kEpi, bool kGatherA = false>
void launch_gemm(const CUtensorMap& a_map, const CUtensorMap& b_map, const hopper::GemmParams& p, int64_t max_tiles,
                 cudaStream_t stream) {
  if (use_clusters())
    launch_gemm_on<T, kEpi, 2, kGatherA>(a_map, b_map, p, max_tiles, stream);
  else
    launch_gemm_on<T, kEpi, 1, kGatherA>(a_map, b_map, p, max_tiles, stream);
}

// The B map of a projection's weights, as 4-D {K, rows per part, parts, E} (or {K, parts, rows, E}
// for interleaved gate/up rows, keeping the strides increasing) with a box of half a weight tile.
CUtensorMap weight_map(const void* w, DType dtype, int64_t K, int64_t rows, int parts, bool interleaved, int64_t E) {
  constexpr int box_rows = kTileN / 2;
  const uint64_t row_bytes = static_cast<uint64_t>(K) * 2;
  const uint64_t expert_bytes = row_bytes * static_cast<uint64_t>(rows * parts);
  TensorMapShape s;
  s.rank = 4;
  if (interleaved) {
    s.sizes = {static_cast<uint64_t>(K), 2, static_cast<uint64_t>(rows), static_cast<uint64_t>(E), 0};
    s.strides = {row_bytes, 2 * row_bytes, expert_bytes, 0};
    s.box = {kBlockK, 1, static_cast<uint32_t>(box_rows), 1, 0};
  } else {
    s.sizes = {static_cast<uint64_t>(K), static_cast<uint64_t>(rows), static_cast<uint64_t>(parts),
               static_cast<uint64_t>(E), 0};
    s.strides = {row_bytes, row_bytes * static_cast<uint64_t>(rows), expert_bytes, 0};
    s.box = {kBlockK, static_cast<uint32_t>(box_rows), 1, 1, 0};
  }
  return make_tensor_map(w, dtype, s);
}

CUtensorMap rows_map(const void* rows, DType dtype, int64_t K, int64_t M) {
  TensorMapShape s;
  s.rank = 2;
  s.sizes = {static_cast<uint64_t>(K), static_cast<uint64_t>(M), 0, 0, 0};
  s.strides = {static_cast<uint64_t>(K) * 2, 0, 0, 0};
  s.box = {kBlockK, kBlockM, 0, 0, 0};
  return make_tensor_map(rows, dtype, s);
}

template <typename T>
void forward_typed(const ExpertsArgs& a, void* workspace, bool gather_in_gemm, cudaStream_t stream) {
  const Layout l = layout(a, !gather_in_gemm);
  char* base = static_cast<char*>(workspace);
  DeviceRouting r;
  route_on_device(a, kBlockM, base, r, stream);
  const int64_t P = a.tokens * a.top_k, max_tiles = max_row_tiles(a), M = max_tiles * kBlockM;
  auto* pair_padded_row = reinterpret_cast<int32_t*>(base + l.pair_row);
  auto* padded_pair = reinterpret_cast<int32_t*>(base + l.padded_pair);
  void* rows = gather_in_gemm ? nullptr : base + l.rows;
  void* hidden = base + l.hidden;
  void* y = base + l.y;
  if (P > 0) {
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(padded_pair, 0xFF, static_cast<std::size_t>(M) * 4, stream));  // -1: padding
    place_rows_kernel<<<static_cast<unsigned>(std::min<int64_t>(P, 65535)), 128, 0, stream>>>(
        a, r, pair_padded_row, padded_pair, static_cast<uint4*>(rows));
    MOEKIT_CUDA_CHECK_LAUNCH();

    hopper::GemmParams up;
    up.a = a;
    up.tile_offsets = r.tile_offsets;
    up.padded_pair = padded_pair;
    up.k_blocks = static_cast<int>((a.hidden + kBlockK - 1) / kBlockK);
    up.outputs = a.intermediate;
    up.out = hidden;
    up.interleaved = a.has_gate && !a.concatenated;
    // sonicmoe gathers its rows and never reads this map; it still gets a valid one (over the weights).
    const CUtensorMap up_rows = gather_in_gemm ? rows_map(a.up, a.dtype, a.hidden, 1) : rows_map(rows, a.dtype, a.hidden, M);
    const int parts = a.has_gate ? 2 : 1;
    up.n_blocks = static_cast<int>((a.intermediate * parts + kTileN - 1) / kTileN);
    const CUtensorMap up_w = weight_map(a.up, a.dtype, a.hidden, a.intermediate, parts, up.interleaved, a.experts);
    auto launch_up = [&]<Epilogue kEpi>() {
      if (gather_in_gemm)
        launch_gemm<T, kEpi, true>(up_rows, up_w, up, max_tiles, stream);
      else
        launch_gemm<T, kEpi>(up_rows, up_w, up, max_tiles, stream);
    };
    if (a.has_gate)
      launch_up.template operator()<Epilogue::gated_activation>();
    else
      launch_up.template operator()<Epilogue::activation>();

    hopper::GemmParams down;
    down.a = a;
    down.tile_offsets = r.tile_offsets;
    down.padded_pair = padded_pair;
    down.weight_rows = gather_in_gemm;  // sonicmoe weights its rows here, deepgemm in the combine
    down.k_blocks = static_cast<int>((a.intermediate + kBlockK - 1) / kBlockK);
    down.n_blocks = static_cast<int>((a.hidden + kTileN - 1) / kTileN);
    down.outputs = a.hidden;
    down.out = y;
    const CUtensorMap down_rows = rows_map(hidden, a.dtype, a.intermediate, M);
    const CUtensorMap down_w = weight_map(a.down, a.dtype, a.intermediate, a.hidden, 1, false, a.experts);
    launch_gemm<T, Epilogue::store_rows>(down_rows, down_w, down, max_tiles, stream);
  }
  launch_combine_rows(a, pair_padded_row, y, false, /*weighted=*/!gather_in_gemm, stream);
}

void forward(const ExpertsArgs& a, void* workspace, bool gather_in_gemm, cudaStream_t stream) {
  const char* name = gather_in_gemm ? "sonicmoe" : "deepgemm";
  MOEKIT_CHECK(a.dtype == DType::bf16 || a.dtype == DType::f16, name, ": activations must be bf16 or f16, not ",
               dtype_name(a.dtype));
  MOEKIT_CHECK(hopper_gemm_runs(a), name, ": problem outside the supported set (checked by the backend's supports())");
  if (a.dtype == DType::bf16)
    forward_typed<bf16>(a, workspace, gather_in_gemm, stream);
  else
    forward_typed<f16>(a, workspace, gather_in_gemm, stream);
}

}  // namespace

bool hopper_gemm_runs(const ExpertsArgs& a) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return (a.dtype == DType::bf16 || a.dtype == DType::f16) && !a.transposed && !a.fp8 && a.hidden % 8 == 0 &&
         a.intermediate % 8 == 0 && aligned(a.x) && aligned(a.up) && aligned(a.down) && device_is_sm90();
}

std::size_t deepgemm_workspace_bytes(const ExpertsArgs& a) {
  return layout(a, true).total;
}

void deepgemm_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  forward(a, workspace, false, stream);
}

std::size_t sonicmoe_workspace_bytes(const ExpertsArgs& a) {
  return layout(a, false).total;
}

void sonicmoe_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  forward(a, workspace, true, stream);
}

}  // namespace moekit::cuda

// eager on CUDA: route on the device, read the per-expert row counts back (the one host
// synchronisation, as in transformers' eager loop), then one product pair per hit expert.
#include <vector>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/grouped_gemm.cuh"

namespace moekit::cuda {

std::size_t eager_workspace_bytes(const ExpertsArgs& a) {
  return grouped_buffers_bytes(a);
}

std::string eager_kernel_path(const ExpertsArgs& a) {
  return "one launch per hit expert after a host synchronisation, " + grouped_gemm_kernel_path(a);
}

void eager_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  GroupedProblem g = grouped_buffers(a, workspace);
  route_on_device(a, kTileRows, static_cast<char*>(workspace) + kRoutingOffset, g.r, stream);
  std::vector<int32_t> offsets(static_cast<std::size_t>(a.experts + 1));
  MOEKIT_CUDA_CHECK(
      cudaMemcpyAsync(offsets.data(), g.r.offsets, offsets.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  quantize_grouped_x(g, stream);
  for (int64_t e = 0; e < a.experts; ++e) {
    const int64_t first = offsets[static_cast<std::size_t>(e)];
    const int64_t rows = offsets[static_cast<std::size_t>(e + 1)] - first;
    if (rows == 0) continue;
    g.only_expert = static_cast<int>(e);
    const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    launch_grouped_projection(g, Projection::up, tiles, stream);
    quantize_grouped_hidden(g, first, rows, nullptr, stream);
    launch_grouped_projection(g, Projection::down, tiles, stream);
  }
  g.only_expert = -1;
  launch_combine(g, stream);
}

}  // namespace moekit::cuda

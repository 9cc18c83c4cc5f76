// grouped_mm on CUDA: route on the device, one grouped product per projection, a deterministic
// combine. Every launch is sized from host-known bounds, so the call never synchronises with the
// host and can be captured in a CUDA graph. On Hopper (compute capability 9.0) the problems deepgemm's
// TMA + wgmma kernels take run through them (same routing and combine, rows padded per expert), FP8
// weights included (H and I multiples of 128); FP4, and FP8 of other sizes, run on the portable kernels;
// KernelOptions::grouped_mm_hopper_kernels false (MOEKIT_HOPPER_GEMM=0) keeps the portable kernels there.
#include <algorithm>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/grouped_gemm.cuh"
#include "moekit/cuda/tensor_map.h"
#include "moekit/kernel_options.h"

namespace moekit::cuda {

namespace {

bool uses_hopper_gemm(const ExpertsArgs& a) {
  return kernel_options().grouped_mm_hopper_kernels && hopper_gemm_runs(a);
}

}  // namespace

std::size_t grouped_mm_workspace_bytes(const ExpertsArgs& a) {
  return uses_hopper_gemm(a) ? deepgemm_workspace_bytes(a) : grouped_buffers_bytes(a);
}

std::string grouped_mm_kernel_path(const ExpertsArgs& a) {
  return uses_hopper_gemm(a) ? "deepgemm's kernels: " + deepgemm_kernel_path(a) : grouped_gemm_kernel_path(a);
}

void grouped_mm_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  if (uses_hopper_gemm(a)) return deepgemm_forward(a, workspace, stream);
  GroupedProblem g = grouped_buffers(a, workspace);
  route_on_device(a, kTileRows, static_cast<char*>(workspace) + kRoutingOffset, g.r, stream);
  const int64_t P = a.tokens * a.top_k;
  // Worst case over all routings: every expert's last tile partly filled.
  const int64_t max_tiles = (P + kTileRows - 1) / kTileRows + std::min(a.experts, P);
  quantize_grouped_x(g, stream);
  launch_grouped_projection(g, Projection::up, max_tiles, stream);
  quantize_grouped_hidden(g, 0, P, g.r.offsets + a.experts, stream);
  launch_grouped_projection(g, Projection::down, max_tiles, stream);
  launch_combine(g, stream);
}

}  // namespace moekit::cuda

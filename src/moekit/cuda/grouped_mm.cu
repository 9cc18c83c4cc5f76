// grouped_mm on CUDA: route on the device, one grouped product per projection, a deterministic
// combine. Every launch is sized from host-known bounds, so the call never synchronises with the
// host and can be captured in a CUDA graph. On Hopper (compute capability 9.0) the problems deepgemm's
// TMA + wgmma kernels take run through them (same routing and combine, rows padded per expert), FP8
// weights included (H and I multiples of 128); FP4, and FP8 of other sizes, run on the portable kernels;
// KernelOptions::grouped_mm_hopper_kernels false (MOEKIT_HOPPER_GEMM=0) keeps the portable kernels there. At serving
// batch sizes it takes sonicmoe's variant of those kernels (gathers_rows below).
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

// Whether the Hopper path takes sonicmoe's variant: the first GEMM gathers the token rows (no copied rows) and the
// second weights its rows. Measured on the H200 with CUDA graphs (docs/benchmarks.md, "Serving batch sizes"): 5-10%
// faster than deepgemm's from 32 to 1,024 tokens with top 8 (DeepSeek-V3, Qwen3-30B-A3B; ~1% with Qwen1.5's top 4),
// slower with top 2 (Mixtral: 0.91-0.99x) and from 4,096 tokens on Qwen3 (0.93x). bf16/f16 only: sonicmoe has no FP8.
bool gathers_rows(const ExpertsArgs& a) {
  constexpr int64_t kMinTopK = 4, kMaxPairs = 8192;
  return kernel_options().grouped_mm_gathered_rows && !a.fp8() && a.top_k >= kMinTopK &&
         a.tokens * a.top_k <= kMaxPairs;
}

}  // namespace

std::size_t grouped_mm_workspace_bytes(const ExpertsArgs& a) {
  if (!uses_hopper_gemm(a)) return grouped_buffers_bytes(a);
  return gathers_rows(a) ? sonicmoe_workspace_bytes(a) : deepgemm_workspace_bytes(a);
}

std::string grouped_mm_kernel_path(const ExpertsArgs& a) {
  if (!uses_hopper_gemm(a)) return grouped_gemm_kernel_path(a);
  return gathers_rows(a) ? "sonicmoe's kernels: " + sonicmoe_kernel_path(a)
                         : "deepgemm's kernels: " + deepgemm_kernel_path(a);
}

void grouped_mm_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  if (uses_hopper_gemm(a))
    return gathers_rows(a) ? sonicmoe_forward(a, workspace, stream) : deepgemm_forward(a, workspace, stream);
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

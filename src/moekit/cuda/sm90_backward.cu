// The backward of the Hopper backends (deepgemm, sonicmoe) on sm_90a: the portable backward's pipeline and buffers
// (backward.cuh: routing, z, G with dz / wa / the routing-weight partial sums, dx, the combine over k, the weight
// and bias gradients) with its five products on wgmma (sm90_backward_gemm.cuh), every token row gathered in the
// operand load and the activation's backward fused into G's epilogue:
//   z         = x[t] @ up_e^T + b1   rows grouping, A x (K-major, gathered), B up_e [N, H] (K-major)
//   G         = grad_out[t] @ down_e rows grouping, A grad_out (K-major, gathered), B down_e [H, I] (MN-major)
//   dx        = dz @ up_e            rows grouping, A dz (K-major), B up_e [N, H] (MN-major)
//   grad_up_e   = dz_e^T xs_e        depth grouping, A dz (MN-major), B xs (MN-major)
//   grad_down_e = gs_e^T wa_e        depth grouping, A gs (MN-major), B wa (MN-major)
// where xs and gs are x and grad_out copied in the sorted order into buffers free by then (z's and dx's); where they
// do not fit (H > 2N), the weight gradients gather the token rows in their loads instead (grad_up as x^T dz, stored
// transposed, so that the gathered operand is the two-chunk A).
// z is the one the forward kept where it did (ExpertsBackwardArgs::saved_z, in the sorted order of the same
// routing): then the first product is not run at all, and z's buffer holds only x's sorted copy.
// Launches are sized from host-known bounds and read the tile counts on the device: no host synchronisation, no
// allocation, so a training step captures in a CUDA graph.
#include <algorithm>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/sm90_backward_gemm.cuh"
#include "moekit/cuda/tensor_map.h"
#include "moekit/kernel_options.h"

namespace moekit::cuda {
namespace {

using sm90_backward::Epilogue;
using sm90_backward::Grouping;
using sm90_backward::Major;
using sm90_backward::Operand;
using sm90_backward::Params;

// The copy engine's view of a tensor [experts][rows][columns] (experts 1 for a plain matrix) in 64 x 64 boxes of
// 128-byte swizzled rows: what the kernel reads as K-major chunks (box rows are rows of m or n) or MN-major ones
// (box rows are rows of k).
CUtensorMap chunk_map(const void* base, DType dtype, int64_t columns, int64_t rows, int64_t experts) {
  const auto row_bytes = static_cast<uint64_t>(columns) * dtype_size(dtype);
  TensorMapShape s;
  s.rank = 3;
  s.sizes = {static_cast<uint64_t>(columns), static_cast<uint64_t>(std::max<int64_t>(rows, 1)),
             static_cast<uint64_t>(std::max<int64_t>(experts, 1)), 0, 0};
  s.strides = {row_bytes, row_bytes * static_cast<uint64_t>(std::max<int64_t>(rows, 1)), 0, 0};
  s.box = {sm90_backward::kChunkRows, sm90_backward::kChunkRows, 1, 0, 0};
  return make_tensor_map(base, dtype, s);
}

// G's float z [rows, N] in the boxes its epilogue reads (sm90_backward::kZCols).
CUtensorMap z_map(const float* z, int64_t n, int64_t rows) {
  TensorMapShape s;
  s.rank = 2;
  s.sizes = {static_cast<uint64_t>(n), static_cast<uint64_t>(std::max<int64_t>(rows, 1)), 0, 0, 0};
  s.strides = {static_cast<uint64_t>(n) * 4, 0, 0, 0};
  s.box = {sm90_backward::kZCols, sm90_backward::kBlockM, 0, 0, 0};
  s.swizzle_f32 = true;
  return make_tensor_map(z, DType::f32, s);
}

// The A, B and third maps of a launch (the kernel's c_map: G's z, a staged weight gradient's output); a gathered
// operand, which the kernel never reads by map, and an unused third map get any valid one.
struct Maps {
  CUtensorMap a, b, c;
};

// A persistent launch's blocks: one a multiprocessor, at most one a unit, at most p.grid_blocks where that is set.
unsigned grid_blocks(const Params& p, int64_t max_units) {
  int64_t blocks = std::min<int64_t>(max_units, multiprocessor_count());
  if (p.grid_blocks > 0) blocks = std::min<int64_t>(blocks, p.grid_blocks);
  return static_cast<unsigned>(blocks);
}

template <typename T, Major kA, Major kB, bool kGatherA, bool kGatherB, Grouping kGroup, Epilogue kEpi>
void launch(const Maps& maps, const Params& p, int64_t max_units, cudaStream_t stream) {
  if (max_units <= 0) return;
  auto* kernel = sm90_backward::backward_gemm_kernel<T, kA, kB, kGatherA, kGatherB, kGroup, kEpi>;
  constexpr std::size_t smem = sm90_backward::kSmemBytesOf<kEpi>;
  allow_dynamic_shared_memory(reinterpret_cast<const void*>(kernel), smem);
  const auto blocks = grid_blocks(p, max_units);
  kernel<<<blocks, sm90_backward::kThreads, smem, stream>>>(maps.a, maps.b, maps.c, p);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

int blocks_of(int64_t size, int64_t block) {
  return static_cast<int>((size + block - 1) / block);
}

// x and grad_out in the sorted order, into z's and dx's buffers (backward_typed): sorted row pair_row[t * K + k] is
// token t of each, for the pairs with a row (not sentinels). A block a token, 16-byte pieces a thread (H a multiple of
// 8): each token row is read once and written to its K rows. Walked by sorted row instead, every token row was read K
// times, from DRAM mostly (x and grad_out do not stay in L2 between an expert's rows and the next's), and the copy ran
// at the copy bandwidth with twice the bytes.
__global__ void __launch_bounds__(256)
    gather_sorted_rows_kernel(const uint4* x, const uint4* grad_out, const int32_t* pair_row, int64_t tokens,
                              int64_t top_k, int64_t pieces, uint4* xs, uint4* gs) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t i = threadIdx.x; i < pieces; i += blockDim.x) {
      const uint4 vx = __ldg(x + t * pieces + i), vg = __ldg(grad_out + t * pieces + i);
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t r = pair_row[t * top_k + k];
        if (r < 0) continue;
        xs[r * pieces + i] = vx;
        gs[r * pieces + i] = vg;
      }
    }
  }
}

void gather_sorted_rows(const ExpertsArgs& a, const BackwardProblem& p, cudaStream_t stream) {
  const int64_t pieces = a.hidden * static_cast<int64_t>(dtype_size(a.dtype)) / 16;
  gather_sorted_rows_kernel<<<static_cast<unsigned>(std::min<int64_t>(a.tokens, 65535)), 256, 0, stream>>>(
      static_cast<const uint4*>(a.x), static_cast<const uint4*>(p.b.grad_out), p.r.pair_row, a.tokens, a.top_k, pieces,
      static_cast<uint4*>(static_cast<void*>(p.z)), static_cast<uint4*>(p.dx));
  MOEKIT_CUDA_CHECK_LAUNCH();
}

// max_blocks caps every launch's blocks (KernelOptions::hopper_backward_blocks; 0: none).
template <typename T>
void backward_typed(BackwardProblem& p, int max_blocks, cudaStream_t stream) {
  const ExpertsArgs& a = p.b.a;
  const int64_t P = a.tokens * a.top_k, H = a.hidden, I = a.intermediate, N = a.has_gate ? 2 * I : I;
  // Row tiles in the worst case: every expert's last tile partly filled.
  const int64_t max_tiles = (P + sm90_backward::kBlockM - 1) / sm90_backward::kBlockM + std::min(a.experts, P);
  Params base;
  base.a = a;
  base.r = p.r;
  base.grid_blocks = max_blocks;
  const DType t = a.dtype;
  const int64_t E = a.experts, rows = std::max<int64_t>(P, 1);
  const CUtensorMap up_map = chunk_map(a.up, t, H, N, E), down_map = chunk_map(a.down, t, I, H, E);
  const CUtensorMap dz_map = chunk_map(p.dz, t, N, rows, 1), wa_map = chunk_map(p.wa, t, I, rows, 1);

  // z = x @ up_e^T + b1, float [P, N] in the sorted order: the one the forward kept, or recomputed here.
  const bool saved_z = p.b.saved_z != nullptr;
  if (!saved_z) {
    Params z = base;
    z.A = Operand{a.x, H, 0, p.row_token, H};
    z.B = Operand{a.up, H, N * H, nullptr, H};
    z.n = N, z.k = H, z.n_blocks = blocks_of(N, sm90_backward::kBlockN);
    z.out = p.z, z.ld_out = N;
    launch<T, Major::k, Major::k, true, false, Grouping::rows, Epilogue::store_float>({up_map, up_map, up_map}, z,
                                                                                      max_tiles * z.n_blocks, stream);
  }

  Params g = base;  // G = grad_out @ down_e, into dz, wa and the partial sums
  g.A = Operand{p.b.grad_out, H, 0, p.row_token, H};
  g.B = Operand{a.down, I, H * I, nullptr, I};
  g.n = I, g.k = H, g.n_blocks = blocks_of(I, sm90_backward::kBlockN);
  g.dz = p.dz, g.wa = p.wa, g.route_partials = p.route_partials, g.partial_blocks = p.partial_blocks;
  launch<T, Major::k, Major::mn, true, false, Grouping::rows, Epilogue::activation_gradient>(
      {down_map, down_map, z_map(saved_z ? p.b.saved_z : p.z, N, rows)}, g, max_tiles * g.n_blocks, stream);

  Params dx = base;  // dx = dz @ up_e
  dx.A = Operand{p.dz, N, 0, nullptr, N};
  dx.B = Operand{a.up, H, N * H, nullptr, H};
  dx.n = H, dx.k = N, dx.n_blocks = blocks_of(H, sm90_backward::kBlockN);
  dx.out = p.dx, dx.ld_out = H;
  launch<T, Major::k, Major::mn, false, false, Grouping::rows, Epilogue::store_rows>(
      {dz_map, up_map, chunk_map(p.dx, t, H, rows, 1)}, dx, max_tiles * dx.n_blocks, stream);

  finish_token_gradients(p, stream);

  // The weight gradients reduce over each expert's token rows. Where x and grad_out sorted by expert fit in the
  // buffers that are free by now (x in z's, grad_out in dx's: H <= 2N, true of every MoE model we know; with z kept
  // by the forward, z's buffer is sized for x), they are copied there once, so that both gradients read every operand
  // by the copy engine; otherwise they gather the token rows by cp.async.
  const bool sorted_copies = (saved_z || H <= 2 * N) && P > 0;
  // The weight gradients' outputs [E][m][n], for the copy engine's stores (store_weights).
  const CUtensorMap grad_up_map = chunk_map(p.b.grad_up, t, H, N, E),
                    grad_down_map = chunk_map(p.b.grad_down, t, I, H, E);
  const void* xs = p.z;
  const void* gs = p.dx;
  if (sorted_copies) gather_sorted_rows(a, p, stream);
  const CUtensorMap xs_map = chunk_map(xs, t, H, rows, 1), gs_map = chunk_map(gs, t, H, rows, 1);

  Params up = base;
  up.out = p.b.grad_up, up.out_expert_stride = N * H;
  if (sorted_copies) {  // grad_up_e [N, H] = dz_e^T xs_e
    up.A = Operand{p.dz, N, 0, nullptr, N};
    up.B = Operand{xs, H, 0, nullptr, H};
    up.m = N, up.n = H, up.ld_out = H;
    up.m_blocks = blocks_of(N, sm90_backward::kBlockM), up.n_blocks = blocks_of(H, sm90_backward::kBlockN);
    launch<T, Major::mn, Major::mn, false, false, Grouping::depth, Epilogue::store_weights>(
        {dz_map, xs_map, grad_up_map}, up, a.experts * up.m_blocks * up.n_blocks, stream);
  } else {  // grad_up_e^T [H, N] = x_e^T dz_e, stored transposed: the gathered x is A, the 2-chunk operand
    up.A = Operand{a.x, H, 0, p.row_token, H};
    up.B = Operand{p.dz, N, 0, nullptr, N};
    up.m = H, up.n = N, up.ld_out = H;
    up.m_blocks = blocks_of(H, sm90_backward::kBlockM), up.n_blocks = blocks_of(N, sm90_backward::kBlockN);
    launch<T, Major::mn, Major::mn, true, false, Grouping::depth, Epilogue::store_weights_transposed>(
        {dz_map, dz_map, dz_map}, up, a.experts * up.m_blocks * up.n_blocks, stream);
  }

  Params down = base;  // grad_down_e [H, I] = grad_out_e^T wa_e
  down.A = sorted_copies ? Operand{gs, H, 0, nullptr, H} : Operand{p.b.grad_out, H, 0, p.row_token, H};
  down.B = Operand{p.wa, I, 0, nullptr, I};
  down.m = H, down.n = I, down.m_blocks = blocks_of(H, sm90_backward::kBlockM),
  down.n_blocks = blocks_of(I, sm90_backward::kBlockN);
  down.out = p.b.grad_down, down.ld_out = I, down.out_expert_stride = H * I;
  const int64_t down_units = a.experts * down.m_blocks * down.n_blocks;
  if (sorted_copies)
    launch<T, Major::mn, Major::mn, false, false, Grouping::depth, Epilogue::store_weights>(
        {gs_map, wa_map, grad_down_map}, down, down_units, stream);
  else
    launch<T, Major::mn, Major::mn, true, false, Grouping::depth, Epilogue::store_weights>(
        {wa_map, wa_map, grad_down_map}, down, down_units, stream);

  launch_bias_gradients(p, stream);
}

}  // namespace

std::size_t hopper_backward_workspace_bytes(const ExpertsBackwardArgs& b) {
  return backward_buffers_bytes(b);
}

void hopper_backward(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream) {
  const ExpertsArgs& a = b.a;
  MOEKIT_CHECK(hopper_gemm_runs(a) && !a.quantized(),
               "the Hopper backward: problem outside the supported set (checked by the backend's supports_backward())");
  BackwardProblem p = backward_buffers(b, workspace);
  MOEKIT_CHECK(p.tensor_cores, "the Hopper backward needs 16-byte aligned operands, gradients and workspace");
  route_backward_rows(p, workspace, sm90_backward::kBlockM, stream);
  p.partial_blocks = blocks_of(a.intermediate, sm90_backward::kBlockN);
  if (a.dtype == DType::bf16)
    backward_typed<bf16>(p, kernel_options().hopper_backward_blocks, stream);
  else
    backward_typed<f16>(p, kernel_options().hopper_backward_blocks, stream);
}

}  // namespace moekit::cuda

// The CUDA backward of the portable backends (DESIGN §2b): routing, the three row products, the combine of
// grad_x over k in order, the routing-weight gradients, then the weight and bias gradients (backward.cuh says
// what each step computes). grouped_mm and batched_mm run it with every launch sized from host-known bounds (no
// host synchronisation, no allocation: capturable in a CUDA graph); eager reads the experts' row counts back
// and launches the products expert by expert, as its forward does.
#include <algorithm>
#include <vector>

#include "moekit/cuda/backward.cuh"
#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

struct BackwardLayout {
  std::size_t z, dz, wa, dx, partials, row_token, total;
};

// With z kept by the forward (b.saved_z, the Hopper backward), z's buffer holds x's sorted copy only.
BackwardLayout backward_layout(const ExpertsBackwardArgs& b) {
  const ExpertsArgs& a = b.a;
  const int64_t P = a.tokens * a.top_k, N = a.has_gate ? 2 * a.intermediate : a.intermediate;
  auto round = [](std::size_t n) { return (n + 255) / 256 * 256; };
  auto bytes = [](int64_t n, std::size_t size) { return static_cast<std::size_t>(n) * size; };
  const std::size_t element = dtype_size(a.dtype);
  BackwardLayout l;
  l.z = kRoutingOffset + round(routing_workspace_bytes(P, a.experts));
  l.dz = l.z + round(b.saved_z ? bytes(P * a.hidden, element) : bytes(P * N, sizeof(float)));
  l.wa = l.dz + round(bytes(P * N, element));
  l.dx = l.wa + round(bytes(P * a.intermediate, element));
  l.partials = l.dx + round(bytes(P * a.hidden, element));
  // The partial sums: room for the CUDA-core kernel's column blocks, the more of the two kernels'.
  l.row_token = l.partials + round(bytes(P * route_partial_blocks(a, false), sizeof(float)));
  l.total = l.row_token + round(bytes(P, sizeof(int32_t)));
  return l;
}

// The products run on mma.sync where every operand row is whole 16-byte pieces: a 2-byte dtype, H and I multiples
// of 8, and 16-byte aligned inputs and workspace (the weight gradients store pairs of values: 4-byte aligned).
bool runs_on_tensor_cores(const ExpertsBackwardArgs& b, const void* workspace) {
  const ExpertsArgs& a = b.a;
  auto aligned4 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; };
  return a.dtype != DType::f32 && a.hidden % 8 == 0 && a.intermediate % 8 == 0 && aligned16(a.x) &&
         aligned16(b.grad_out) && aligned16(a.up) && aligned16(a.down) && aligned16(workspace) && aligned4(b.grad_up) &&
         aligned4(b.grad_down);
}

// The token of every sorted row, once, so that the kernels that gather token rows read it instead of dividing
// row_pair by K in their loops (the weight gradients: for every row of every step).
__global__ void __launch_bounds__(256)
    row_tokens_kernel(const int32_t* row_pair, int64_t pairs, int64_t top_k, int32_t* row_token) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < pairs) row_token[r] = static_cast<int32_t>(token_of_pair(row_pair[r], top_k));
}

}  // namespace

void route_backward_rows(BackwardProblem& p, void* workspace, int tile_rows, cudaStream_t stream) {
  route_on_device(p.b.a, tile_rows, static_cast<char*>(workspace) + kRoutingOffset, p.r, stream);
  const int64_t P = p.b.a.tokens * p.b.a.top_k;
  if (P == 0) return;
  row_tokens_kernel<<<static_cast<unsigned>((P + 255) / 256), 256, 0, stream>>>(p.r.row_pair, P, p.b.a.top_k,
                                                                                p.row_token);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

namespace {

// grad_routing_weights[p], a warp a pair: zero at a sentinel, NaN at an invalid (negative) id, otherwise the row's
// partial sums of G * act(z) in column-block order plus <grad_out[t], b2_e> (the expert output's bias term).
constexpr int kRouteWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kRouteWarps * 32) route_gradient_kernel(const BackwardProblem p) {
  const ExpertsArgs& a = p.b.a;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kRouteWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (pair >= a.tokens * a.top_k) return;
  const int64_t e = load_id(a, pair);
  float gradient = 0.0f;
  if (e < 0) {
    gradient = __int_as_float(0x7fc00000);
  } else if (e < a.experts) {
    float bias_term = 0.0f;
    if (a.down_bias) {
      const T* dy = static_cast<const T*>(p.b.grad_out) + token_of_pair(pair, a.top_k) * a.hidden;
      const T* b2 = static_cast<const T*>(a.down_bias) + e * a.hidden;
      for (int64_t h = lane; h < a.hidden; h += 32) bias_term = fmaf(to_f(dy[h]), to_f(b2[h]), bias_term);
      bias_term = warp_sum(bias_term);
    }
    const float* partials = p.route_partials + static_cast<int64_t>(p.r.pair_row[pair]) * p.partial_blocks;
    for (int64_t c = 0; c < p.partial_blocks; ++c) gradient += partials[c];
    gradient += bias_term;
  }
  if (lane != 0) return;
  if (a.routing_dtype == DType::f32)
    static_cast<float*>(p.b.grad_routing_weights)[pair] = gradient;
  else
    static_cast<T*>(p.b.grad_routing_weights)[pair] = from_f<T>(gradient);
}

}  // namespace

// grad_x: the forward's combine, unweighted (NaN for a token with an invalid id).
void finish_token_gradients(const BackwardProblem& p, cudaStream_t stream) {
  ExpertsArgs combine = p.b.a;
  combine.out = p.b.grad_x;
  launch_combine_rows(combine, p.r.pair_row, p.dx, false, false, stream);
  const int64_t P = p.b.a.tokens * p.b.a.top_k;
  if (P == 0) return;
  const auto blocks = static_cast<unsigned>((P + kRouteWarps - 1) / kRouteWarps);
  visit_float_dtype(p.b.a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    route_gradient_kernel<T><<<blocks, kRouteWarps * 32, 0, stream>>>(p);
  });
  MOEKIT_CUDA_CHECK_LAUNCH();
}

namespace {

// grouped_mm's and batched_mm's backward: every launch covers the worst case of the routing, idle blocks exit.
void backward_on_device_schedule(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream) {
  BackwardProblem p = backward_buffers(b, workspace);
  route_backward_rows(p, workspace, kTileRows, stream);
  const int64_t P = b.a.tokens * b.a.top_k;
  const int64_t max_tiles = (P + kTileRows - 1) / kTileRows + std::min(b.a.experts, P);
  launch_row_product(p, RowProduct::up, max_tiles, stream);
  launch_row_product(p, RowProduct::down_gradient, max_tiles, stream);
  launch_row_product(p, RowProduct::hidden_gradient, max_tiles, stream);
  finish_token_gradients(p, stream);
  launch_weight_gradients(p, stream);
  launch_bias_gradients(p, stream);
}

}  // namespace

std::size_t backward_buffers_bytes(const ExpertsBackwardArgs& b) {
  return backward_layout(b).total;
}

BackwardProblem backward_buffers(const ExpertsBackwardArgs& b, void* workspace) {
  MOEKIT_CHECK(!b.a.quantized(), "experts backward: quantised weights have no backward (refused earlier)");
  const BackwardLayout l = backward_layout(b);
  char* base = static_cast<char*>(workspace);
  BackwardProblem p;
  p.b = b;
  p.z = reinterpret_cast<float*>(base + l.z);
  p.dz = base + l.dz;
  p.wa = base + l.wa;
  p.dx = base + l.dx;
  p.route_partials = reinterpret_cast<float*>(base + l.partials);
  p.row_token = reinterpret_cast<int32_t*>(base + l.row_token);
  p.tensor_cores = runs_on_tensor_cores(b, workspace);
  p.partial_blocks = route_partial_blocks(b.a, p.tensor_cores);
  return p;
}

std::size_t grouped_mm_backward_workspace_bytes(const ExpertsBackwardArgs& b) {
  return backward_buffers_bytes(b);
}

void grouped_mm_backward(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream) {
  backward_on_device_schedule(b, workspace, stream);
}

std::size_t batched_mm_backward_workspace_bytes(const ExpertsBackwardArgs& b) {
  return backward_buffers_bytes(b);
}

void batched_mm_backward(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream) {
  backward_on_device_schedule(b, workspace, stream);
}

std::size_t eager_backward_workspace_bytes(const ExpertsBackwardArgs& b) {
  return backward_buffers_bytes(b);
}

void eager_backward(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream) {
  const ExpertsArgs& a = b.a;
  BackwardProblem p = backward_buffers(b, workspace);
  route_backward_rows(p, workspace, kTileRows, stream);
  std::vector<int32_t> offsets(static_cast<std::size_t>(a.experts + 1));
  MOEKIT_CUDA_CHECK(
      cudaMemcpyAsync(offsets.data(), p.r.offsets, offsets.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  auto rows_of = [&](int64_t e) {
    return offsets[static_cast<std::size_t>(e + 1)] - offsets[static_cast<std::size_t>(e)];
  };
  for (int64_t e = 0; e < a.experts; ++e) {
    if (rows_of(e) == 0) continue;
    p.only_expert = static_cast<int>(e);
    const int64_t tiles = (rows_of(e) + kTileRows - 1) / kTileRows;
    launch_row_product(p, RowProduct::up, tiles, stream);
    launch_row_product(p, RowProduct::down_gradient, tiles, stream);
    launch_row_product(p, RowProduct::hidden_gradient, tiles, stream);
  }
  p.only_expert = -1;
  finish_token_gradients(p, stream);
  // The hit experts' weight gradients one expert at a time; each run of experts no token chose is zeroed at once.
  const int64_t N = a.has_gate ? 2 * a.intermediate : a.intermediate;
  const std::size_t up_bytes = static_cast<std::size_t>(N * a.hidden) * dtype_size(a.dtype);
  const std::size_t down_bytes = static_cast<std::size_t>(a.hidden * a.intermediate) * dtype_size(a.dtype);
  for (int64_t e = 0; e < a.experts;) {
    if (rows_of(e) > 0) {
      p.only_expert = static_cast<int>(e);
      launch_weight_gradients(p, stream);
      ++e;
      continue;
    }
    int64_t end = e;
    while (end < a.experts && rows_of(end) == 0) ++end;
    const auto n = static_cast<std::size_t>(end - e);
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(b.grad_up) + e * up_bytes, 0, n * up_bytes, stream));
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(b.grad_down) + e * down_bytes, 0, n * down_bytes, stream));
    e = end;
  }
  p.only_expert = -1;
  launch_bias_gradients(p, stream);
}

}  // namespace moekit::cuda

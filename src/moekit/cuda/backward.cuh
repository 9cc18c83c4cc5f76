// The backward of the portable backends on CUDA (DESIGN §2b), over the pairs sorted by expert (the forward's
// device routing): row r of the sorted order is pair (t, k) = row_pair[r], its expert e. Per row:
//   z    = x[t] @ up_e^T + b1                    [S, N] float  the forward's first projection, recomputed
//   G    = grad_out[t] @ down_e                  [I]           never stored: the epilogue of its product uses it
//   dz   = act'(z) * (w[t, k] * G)               [S, N] dtype  d gate and d up, at the weight's own rows n
//   wa   = w[t, k] * act(z)                      [S, I] dtype  the down projection's weighted input
//   dx   = dz @ up_e                             [S, H] dtype  then grad_x[t] = sum_k dx[row(t, k)], k in order
//   grad_w[t, k] = sum_j G * act(z) + <grad_out[t], b2_e>      per column block of G, then the blocks in order
//   grad_up_e = dz^T x  ([N, H]; x^T dz when transposed),  grad_down_e = grad_out^T wa  ([H, I]; wa^T grad_out)
//   grad_b1_e = sum_r dz,  grad_b2_e = sum_r w[t, k] grad_out[t]  over the expert's rows, in order.
// z stays float: a clamped SwiGLU's gradient jumps to zero at the limit, and a z rounded to bf16 (steps of 1/32
// near 7) lands on the other side of it far more often than float's does.
// Every sum runs in a fixed order (rows in sorted order within one block, k and column blocks in order, no float
// atomics), so the gradients are bitwise the same run to run.
#pragma once

#include "moekit/cuda/grouped_gemm.cuh"

namespace moekit::cuda {

// The three products over row tiles (the routing's tile schedule, like the forward's grouped products).
enum class RowProduct : uint8_t {
  up,               // z = x @ up_e^T + b1
  down_gradient,    // G = grad_out @ down_e, epilogue: dz, wa and the routing-weight gradient's partial sums
  hidden_gradient,  // dx = dz @ up_e
};

struct BackwardProblem {
  ExpertsBackwardArgs b;
  DeviceRouting r;
  float* z = nullptr;               // [P, N]
  void* dz = nullptr;               // [P, N] dtype
  void* wa = nullptr;               // [P, I] dtype
  void* dx = nullptr;               // [P, H] dtype
  float* route_partials = nullptr;  // [P, partial_blocks]: sum_j G * act(z) of each column block of G
  int32_t* row_token = nullptr;     // [P]: the token of each sorted row (row_pair / K, written once after routing)
  int64_t partial_blocks = 0;
  bool tensor_cores = false;  // the products run on mma.sync (2-byte dtype, H and I multiples of 8, aligned)
  int only_expert = -1;       // >= 0: launches cover this expert only (eager's loop)
};

// The token of pair `pair` (t * K + k): a 32-bit division (the routing refuses 2^31 pairs and more), which the
// compiler inlines where a 64-bit one is a call.
__device__ __forceinline__ int64_t token_of_pair(int64_t pair, int64_t top_k) {
  return static_cast<int32_t>(pair) / static_cast<int32_t>(top_k);
}

// The activation at (gate, up) and its partial derivatives (reference_activation_derivatives in float): a clamp
// that is active passes no gradient (GPT-OSS: gate > limit, |up| > limit), at the limit it does, as torch's clamp.
// The values are those of activate() (device_math.cuh), which the forward applies.
struct ActivationGradient {
  float value, d_gate, d_up;
};

__device__ __forceinline__ ActivationGradient activation_gradient(const ExpertsArgs& a, float g, float u) {
  if (a.act == Act::clamped_swiglu) {
    const float limit = a.swiglu_limit, alpha = a.swiglu_alpha;
    const float gc = fminf(g, limit), uc = fminf(fmaxf(u, -limit), limit);
    const float s = sigmoid(alpha * gc);
    return {(uc + 1.0f) * gc * s, g <= limit ? (uc + 1.0f) * s * (1.0f + alpha * gc * (1.0f - s)) : 0.0f,
            fabsf(u) <= limit ? gc * s : 0.0f};
  }
  float h = 0.0f, dh = 0.0f;
  switch (a.act) {
    case Act::silu: {
      const float s = sigmoid(g);
      h = g * s;
      dh = s * (1.0f + g * (1.0f - s));
      break;
    }
    case Act::gelu: {
      const float cdf = 0.5f * (1.0f + erff(g * 0.70710678118654752f));
      h = g * cdf;
      dh = cdf + g * 0.39894228040143268f * expf(-0.5f * g * g);  // 1 / sqrt(2 pi)
      break;
    }
    case Act::gelu_tanh: {
      constexpr float k = 0.79788456080286536f, c = 0.044715f;
      const float th = tanhf(k * (g + c * g * g * g));
      h = 0.5f * g * (1.0f + th);
      dh = 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * k * (1.0f + 3.0f * c * g * g);
      break;
    }
    case Act::relu:
      h = fmaxf(g, 0.0f);
      dh = g > 0.0f ? 1.0f : 0.0f;
      break;
    case Act::relu2:
      h = g > 0.0f ? g * g : 0.0f;
      dh = g > 0.0f ? 2.0f * g : 0.0f;
      break;
    case Act::clamped_swiglu:
      break;  // above
  }
  if (!a.has_gate) return {h, dh, 0.0f};
  return {h * u, dh * u, h};
}

// Two neighbouring values of an output row in one store (4 bytes in a 2-byte dtype).
template <typename T>
__device__ __forceinline__ void store_two(T* p, float x, float y) {
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint32_t*>(p) =
        static_cast<uint32_t>(from_f<T>(x).bits) | static_cast<uint32_t>(from_f<T>(y).bits) << 16;
  } else {
    p[0] = from_f<T>(x);
    p[1] = from_f<T>(y);
  }
}

// dz of intermediate columns j and j + 1 into its row `dz` at the weight's own rows: gate and up halves
// (concatenated), g, u pairs (interleaved), or the ungated rows. kConcatenatedGate: the first, known at compile time.
template <typename T, bool kConcatenatedGate = false>
__device__ __forceinline__ void store_dz_pair(const ExpertsArgs& a, T* dz, int64_t j, const float (&d_gate)[2],
                                              const float (&d_up)[2]) {
  if (kConcatenatedGate) {
    store_two(dz + j, d_gate[0], d_gate[1]);
    store_two(dz + a.intermediate + j, d_up[0], d_up[1]);
  } else if (!a.has_gate) {
    store_two(dz + j, d_gate[0], d_gate[1]);
  } else if (a.concatenated) {
    store_two(dz + j, d_gate[0], d_gate[1]);
    store_two(dz + a.intermediate + j, d_up[0], d_up[1]);
  } else {
    store_two(dz + 2 * j, d_gate[0], d_up[0]);
    store_two(dz + 2 * j + 2, d_gate[1], d_up[1]);
  }
}

// Device bytes of the routing and the buffers above for one call, and the problem carved out of workspace.
std::size_t backward_buffers_bytes(const ExpertsBackwardArgs& b);
BackwardProblem backward_buffers(const ExpertsBackwardArgs& b, void* workspace);

// Column blocks of G in the down_gradient product (route_partials holds one sum per row and block), by kernel.
int64_t route_partial_blocks(const ExpertsArgs& a, bool tensor_cores);

// Routes the pairs (the forward's device routing, in tiles of tile_rows rows) into p.r and finds each sorted row's
// token (p.row_token).
void route_backward_rows(BackwardProblem& p, void* workspace, int tile_rows, cudaStream_t stream);
// grad_x (the rows dx summed over k in order) and grad_routing_weights, once dx and the partial sums are written.
void finish_token_gradients(const BackwardProblem& p, cudaStream_t stream);

// One row product over max_tiles row tiles of all experts (only_expert < 0) or over one expert's tiles.
void launch_row_product(const BackwardProblem& p, RowProduct product, int64_t max_tiles, cudaStream_t stream);

// grad_up and grad_down of every expert (only_expert < 0; experts without rows get zeros) or of one expert,
// each output tile owned by one block that walks the expert's rows in order.
void launch_weight_gradients(const BackwardProblem& p, cudaStream_t stream);
// The bias gradients of every expert (nothing without biases): column sums over each expert's rows, in order.
void launch_bias_gradients(const BackwardProblem& p, cudaStream_t stream);

}  // namespace moekit::cuda

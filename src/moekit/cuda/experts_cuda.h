// CUDA kernels of the experts backends. Kernel layer: raw device pointers, sizes and a stream in.
// Every entry point is asynchronous on the stream and needs no host synchronisation, except
// eager_forward, which reads the per-expert counts back to loop over the hit experts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "moekit/dtype.h"
#include "moekit/quantization.h"

typedef struct CUstream_st* cudaStream_t;

// Member functions of the argument structs run on both sides.
#if defined(__CUDACC__)
#define MOEKIT_HOST_DEVICE __host__ __device__
#else
#define MOEKIT_HOST_DEVICE
#endif

namespace moekit::cuda {

enum class Act : uint8_t { silu, gelu, gelu_tanh, relu, relu2, clamped_swiglu };

// One experts call on the device (DESIGN §2). All pointers are device pointers of contiguous tensors.
struct ExpertsArgs {
  int64_t tokens = 0, hidden = 0, intermediate = 0, experts = 0, top_k = 0;
  DType dtype = DType::bf16;              // hidden_states, weights, biases and out
  DType index_dtype = DType::i64;         // top_k_index
  DType routing_dtype = DType::f32;       // top_k_weights
  const void* x = nullptr;                // [T, H]
  const void* ids = nullptr;              // [T, K]
  const void* routing_weights = nullptr;  // [T, K]
  const void* up = nullptr;               // [E, N, H] or transposed [E, H, N]; N = 2I gated, I not
  const void* down = nullptr;             // [E, H, I] or transposed [E, I, H]
  const void* up_bias = nullptr;          // [E, N] or null
  const void* down_bias = nullptr;        // [E, H] or null
  bool has_gate = true, transposed = false, concatenated = true;
  Act act = Act::silu;
  float swiglu_limit = 0, swiglu_alpha = 0;
  // Block-quantised weights (DESIGN §3), untransposed. FP8: up and down hold e4m3 bytes [E, N, H] and
  // [E, H, I], up_scale [E, ceil(N/128), ceil(H/128)] and down_scale [E, ceil(H/128), ceil(I/128)] their
  // block scales (f32, or ue8m0 bytes). FP4: e2m1 pairs [E, N, H/2] and [E, H, I/2] (element 2j in the low
  // nibble), ue8m0 scales [E, N, ceil(H/32)] and [E, H, ceil(I/32)]. Activations are quantised per row and 128-wide
  // group as quantize_activations (quantization.h) does.
  WeightFormat weights = WeightFormat::none;
  bool ue8m0_scales = false;  // FP4: always
  const void* up_scale = nullptr;
  const void* down_scale = nullptr;
  void* out = nullptr;  // [T, H]
  // The Hopper forward of a training step (hopper_saved_z_bytes): z = x @ up_e^T + b1 as float, written beside out in
  // the sorted order of its routing ([pairs, N], the weights' columns) for the Hopper backward. Null: not kept.
  float* save_z = nullptr;

  MOEKIT_HOST_DEVICE bool fp8() const { return weights == WeightFormat::fp8_e4m3; }
  MOEKIT_HOST_DEVICE bool fp4() const { return weights == WeightFormat::fp4_e2m1; }
  MOEKIT_HOST_DEVICE bool quantized() const { return weights != WeightFormat::none; }
};

// The backward of one experts call on the device (DESIGN §2b): a holds the forward's inputs (a.out unused,
// unquantised weights only), grad_out the incoming gradient, and the grad_* pointers where each gradient
// goes: contiguous, each in its input's dtype and layout (grad_routing_weights in routing_dtype; the bias
// gradients null without bias). Every element of every gradient is written.
struct ExpertsBackwardArgs {
  ExpertsArgs a;
  const void* grad_out = nullptr;        // [T, H] dtype
  void* grad_x = nullptr;                // [T, H] dtype
  void* grad_routing_weights = nullptr;  // [T, K] routing_dtype, zero at sentinel slots
  void* grad_up = nullptr;               // the layout of a.up
  void* grad_down = nullptr;             // the layout of a.down
  void* grad_up_bias = nullptr;          // [E, N] dtype or null
  void* grad_down_bias = nullptr;        // [E, H] dtype or null
  // The Hopper backward: the z its forward kept (ExpertsArgs::save_z, same problem), read in place of recomputing
  // it; its workspace (backward_buffers_bytes) then holds no z of its own. Null: recomputed.
  const float* saved_z = nullptr;
};

// The backward of the portable backends (cuda/backward.cuh), asynchronous on the stream, in a workspace of
// *_backward_workspace_bytes. grouped_mm and batched_mm share one pipeline: the weight gradients sum each expert's
// rows in order, which needs the pairs grouped by expert, so batched_mm's backward sorts them as grouped_mm's does;
// neither synchronises with the host nor allocates. eager_backward reads the experts' row counts back (its one
// host synchronisation) and runs the products expert by expert.
std::size_t grouped_mm_backward_workspace_bytes(const ExpertsBackwardArgs& b);
void grouped_mm_backward(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream);
std::size_t batched_mm_backward_workspace_bytes(const ExpertsBackwardArgs& b);
void batched_mm_backward(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream);
std::size_t eager_backward_workspace_bytes(const ExpertsBackwardArgs& b);
void eager_backward(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream);

std::size_t batched_mm_workspace_bytes(const ExpertsArgs& a);
void batched_mm_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream);

std::size_t grouped_mm_workspace_bytes(const ExpertsArgs& a);
void grouped_mm_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream);

std::size_t eager_workspace_bytes(const ExpertsArgs& a);
void eager_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream);

// deepgemm: sm_90a only (bf16/f16, untransposed weights, H and I multiples of 8; the backend checks).
std::size_t deepgemm_workspace_bytes(const ExpertsArgs& a);
void deepgemm_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream);
// sonicmoe: the same kernels with the token gather in the first GEMM and the routing weight in the second.
std::size_t sonicmoe_workspace_bytes(const ExpertsArgs& a);
void sonicmoe_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream);
// The backward of both Hopper backends (sm90_backward.cu): the portable backward's pipeline with its products on
// wgmma, token rows gathered in the operand loads, the activation's backward in an epilogue (bf16/f16,
// untransposed, H and I multiples of 8, 16-byte aligned; the backends check). No host synchronisation.
std::size_t hopper_backward_workspace_bytes(const ExpertsBackwardArgs& b);
// Bytes of the z a Hopper forward keeps for its backward (ExpertsArgs::save_z): float [pairs, N]. A forward that keeps
// it always runs the grouped GEMM (never the decode-size path).
std::size_t hopper_saved_z_bytes(const ExpertsArgs& a);
void hopper_backward(const ExpertsBackwardArgs& b, void* workspace, cudaStream_t stream);
// Whether the Hopper kernels run this problem on the current device (grouped_mm uses them there): bf16/f16,
// untransposed, H and I multiples of 8 (FP8: of 128), never FP4, and no hopper_alignment_refusal.
bool hopper_gemm_runs(const ExpertsArgs& a);
// Why the Hopper kernels cannot read these operands where they are, or null: the copy engine reads 16-byte
// aligned rows and the epilogues read biases two at a time. Host code without a device, so that deepgemm's
// supports (which words its refusal with it) and hopper_gemm_runs (grouped_mm's choice) ask the same rule.
inline const char* hopper_alignment_refusal(const ExpertsArgs& a) {
  auto aligned = [](const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; };
  if (!aligned(a.x, 16) || !aligned(a.up, 16) || !aligned(a.down, 16))
    return "needs 16-byte aligned hidden states and weights";
  if (!aligned(a.up_bias, 4) || !aligned(a.down_bias, 4))
    return "reads biases two at a time: they must be 4-byte aligned";
  return nullptr;
}
// Decode on the Hopper backends: with few pairs, about one per expert or fewer (bf16/f16: at most 128
// pairs and one per expert; FP8: 256 and two), the layer is bound by reading the chosen experts' weights
// and deepgemm and sonicmoe run batched_mm's weight-streaming kernels (with FP8, its tensor-core path)
// instead of the grouped GEMM, whose 128-row tiles are then mostly padding. The limits are the measured
// crossovers on the H200 (docs/benchmarks.md). MOEKIT_HOPPER_DECODE_STREAMING=0 keeps the grouped GEMM.
bool hopper_decode_streams(const ExpertsArgs& a);

// The kernels each forward runs for a problem, in words (ExpertsBackend::kernel_path), as the forward chooses them
// under the kernel_options() in force. Host code.
std::string eager_kernel_path(const ExpertsArgs& a);
std::string batched_mm_kernel_path(const ExpertsArgs& a);
std::string grouped_mm_kernel_path(const ExpertsArgs& a);
std::string deepgemm_kernel_path(const ExpertsArgs& a);
std::string sonicmoe_kernel_path(const ExpertsArgs& a);
// The portable grouped GEMM's kernels for both projections (grouped_mm off Hopper, eager per expert).
std::string grouped_gemm_kernel_path(const ExpertsArgs& a);

}  // namespace moekit::cuda

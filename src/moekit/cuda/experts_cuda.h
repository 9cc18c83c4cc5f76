// CUDA kernels of the experts backends. Kernel layer: raw device pointers, sizes and a stream in.
// Every entry point is asynchronous on the stream and needs no host synchronisation, except
// eager_forward, which reads the per-expert counts back to loop over the hit experts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/dtype.h"

typedef struct CUstream_st* cudaStream_t;

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
  // FP8 e4m3 weights (batched_mm only): up and down hold the e4m3 bytes, up_scale [E, ceil(N/128),
  // ceil(H/128)] and down_scale [E, ceil(H/128), ceil(I/128)] their block scales (f32, or ue8m0 bytes);
  // activations are quantised per row and 128-wide group as quantize_activations (quantization.h) does.
  bool fp8 = false;
  bool ue8m0_scales = false;
  const void* up_scale = nullptr;
  const void* down_scale = nullptr;
  void* out = nullptr;  // [T, H]
};

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
// Whether the Hopper kernels run this problem on the current device (grouped_mm uses them there).
bool hopper_gemm_runs(const ExpertsArgs& a);

}  // namespace moekit::cuda

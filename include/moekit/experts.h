// The experts interface: one MoE expert computation, many interchangeable backends.
//
// out[t] = sum_k w[t,k] * (down_e . act(gate_up_e . x[t] + b1_e) + b2_e),  e = idx[t,k]
// The routing weight multiplies after the down projection and its bias; the sum over k runs in
// float32 in the order k = 0..K-1. An id >= E is an expert-parallel sentinel (no contribution, no
// work); a negative id is invalid input.
//
// The backward (DESIGN §2b): given grad_out [T, H], the gradients of out with respect to hidden_states,
// top_k_weights (zero at sentinel slots), the weights and the biases, each in its input's dtype and
// layout, accumulated in float32; top_k_index is not differentiable. Sums over tokens (weight gradients)
// and over k (hidden-state gradients) run in a fixed order: the results are bitwise reproducible.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/quantization.h"
#include "moekit/tensor.h"

namespace moekit {

enum class Activation : uint8_t { silu, gelu, gelu_pytorch_tanh, relu, relu2 };

std::string_view activation_name(Activation activation);
Activation parse_activation(std::string_view name);  // lists the valid names on failure

// How the expert weights are laid out and which activation runs (transformers' module attributes).
struct ExpertsConfig {
  Activation activation = Activation::silu;
  // false: the weight is up_proj [E, I, H] and the activation applies to it directly.
  bool has_gate = true;
  bool has_bias = false;
  // true: gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ W) instead of [E, 2I, H], [E, H, I].
  bool is_transposed = false;
  // true: gate rows [0, I) then up rows [I, 2I); false: interleaved g0, u0, g1, u1, ...
  bool is_concatenated = true;
  // GPT-OSS clamped SwiGLU, on when swiglu_limit is set (needs has_gate and silu):
  // g = min(g, limit); u = clamp(u, -limit, limit); h = (u + 1) * g * sigmoid(alpha * g).
  std::optional<float> swiglu_limit;
  float swiglu_alpha = 1.702f;
  // Block-quantised weights (DESIGN §3, quantization.h); the default is not quantised. Quantised weights
  // are untransposed ([E, N, K], as FP8/FP4 checkpoints store them) and come with their scale_inv tensors.
  QuantizationConfig quantization;

  std::string describe() const;
};

// The whole input of one experts call. Tensors must share one device. Biases are undefined tensors
// unless config.has_bias; scales are undefined unless config.quantization says the weights are quantised.
struct ExpertsProblem {
  Tensor hidden_states;      // [T, H] f32 | f16 | bf16
  Tensor top_k_index;        // [T, K] i32 | i64
  Tensor top_k_weights;      // [T, K] f32 or the dtype of hidden_states
  Tensor gate_up_proj;       // [E, 2I, H] ([E, H, 2I] transposed); up_proj [E, I, H] without gate
  Tensor down_proj;          // [E, H, I] ([E, I, H] transposed)
  Tensor gate_up_proj_bias;  // [E, 2I] ([E, I] without gate)
  Tensor down_proj_bias;     // [E, H]
  // Quantised weights: gate_up_proj is f8_e4m3 [E, N, H] or f4_e2m1 [E, N, H/2] (N = 2I, or I without
  // gate), down_proj f8_e4m3 [E, H, I] or f4_e2m1 [E, H, I/2], and these hold their scales:
  // FP8 [E, ceil(N/128), ceil(H/128)] and [E, ceil(H/128), ceil(I/128)], f32 or ue8m0 (both the same);
  // FP4 [E, N, ceil(H/32)] and [E, H, ceil(I/32)], ue8m0.
  Tensor gate_up_proj_scale_inv;
  Tensor down_proj_scale_inv;
  ExpertsConfig config;
};

// Sizes of a problem, derived and checked by validate().
struct ExpertsShape {
  int64_t tokens = 0;        // T
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int64_t experts = 0;       // E
  int64_t top_k = 0;         // K
};

// Checks every shape, dtype, rank, device and stride of the problem against the contract and returns
// its sizes; throws moekit::Error naming the tensor and what was expected. Does not read ids.
ExpertsShape validate(const ExpertsProblem& problem);
// The sizes of a problem validate() accepted, read from its tensors without checking them again: what a backend's
// supports, workspace_bytes and forward use, so that a call validates its problem once (experts_forward does).
ExpertsShape problem_shape(const ExpertsProblem& problem);
// Also scans the ids (CPU tensors only): throws on a negative id, naming the token and slot.
void check_routing_ids(const ExpertsProblem& problem);

// FLOPs of one call: 2 * (pairs routed to a real expert) * H * (2I + I) for gated experts.
double experts_flops(const ExpertsShape& shape, bool has_gate, double routed_pairs);

// FLOPs of one backward call: twice the forward's (12 * pairs * H * I gated), what DESIGN §2b counts. A
// backend that recomputes the forward's first projection does more work than this.
double experts_backward_flops(const ExpertsShape& shape, bool has_gate, double routed_pairs);

// The gradients of one experts call. Each has the shape, dtype and layout of its input; the bias gradients
// are defined exactly when config.has_bias.
struct ExpertsGradients {
  Tensor hidden_states;      // [T, H]
  Tensor top_k_weights;      // [T, K], zero at sentinel slots
  Tensor gate_up_proj;       // the layout of gate_up_proj (or up_proj)
  Tensor down_proj;          // the layout of down_proj
  Tensor gate_up_proj_bias;  // [E, 2I] ([E, I] without gate)
  Tensor down_proj_bias;     // [E, H]
};

// A backend's answer to "can you run this?": ok, or the reason why not.
struct Support {
  bool ok = true;
  std::string reason;
  static Support yes() { return {}; }
  static Support no(std::string why) { return {false, std::move(why)}; }
  explicit operator bool() const { return ok; }
};

// An opaque stream (cudaStream_t on CUDA, ignored on the CPU).
struct Stream {
  void* handle = nullptr;
};

// A backend's life: supports(problem) -> workspace_bytes(problem) -> forward(...).
class ExpertsBackend {
 public:
  virtual ~ExpertsBackend() = default;
  virtual std::string_view name() const = 0;
  virtual std::string_view description() const = 0;
  // Whether the backend can run on this device at all, in this build, on this machine.
  virtual Support supports_device(Device device) const = 0;
  // Whether it can run this (already validated) problem; checked before any work starts.
  virtual Support supports(const ExpertsProblem& problem) const = 0;
  // Scratch memory forward() needs, on the problem's device.
  virtual std::size_t workspace_bytes(const ExpertsProblem& problem) const = 0;
  // Writes out [T, H] (dtype of hidden_states, contiguous). workspace holds workspace_bytes().
  virtual void forward(const ExpertsProblem& problem, Tensor& out, void* workspace, Stream stream) = 0;
  // The kernels forward() runs for this (supported) problem, in a few words: which of the backend's paths, on
  // which kind of kernel (e.g. "Hopper TMA + wgmma grouped GEMM, bf16, clusters of 2 (up) / 1 (down)", "CUDA
  // batched_mm: weight-streaming gemv"), as the kernel_options() in force choose. Default: the backend's name.
  virtual std::string kernel_path(const ExpertsProblem& problem) const;

  // The backward: supports_backward(problem) -> backward_workspace_bytes(problem) -> backward(...).
  // backward() reads the problem's inputs again and recomputes what it needs of the forward. The defaults
  // refuse: a backend without a backward says so.
  virtual Support supports_backward(const ExpertsProblem& problem) const;
  virtual std::size_t backward_workspace_bytes(const ExpertsProblem& problem) const;
  // grad_out [T, H] (dtype of hidden_states, contiguous); writes every tensor of grads (all allocated,
  // contiguous, in their inputs' dtypes and shapes; the bias gradients only with has_bias).
  virtual void backward(const ExpertsProblem& problem, const Tensor& grad_out, ExpertsGradients& grads, void* workspace,
                        Stream stream);

  // Activations kept from the forward for the backward, a choice per backend (DESIGN §2b): a training step may run
  // forward_saving, which also writes saved_activation_bytes(problem) bytes to `saved` (on the problem's device, in a
  // workspace of saving_workspace_bytes), and then backward_saved with the same problem, inputs and saved bytes,
  // which reads them in place of recomputing (in a workspace of saved_backward_workspace_bytes). The defaults keep
  // nothing (0 bytes) and run forward() and backward() in their own workspaces.
  virtual std::size_t saved_activation_bytes(const ExpertsProblem& problem) const;
  virtual std::size_t saving_workspace_bytes(const ExpertsProblem& problem) const;
  virtual std::size_t saved_backward_workspace_bytes(const ExpertsProblem& problem) const;
  virtual void forward_saving(const ExpertsProblem& problem, Tensor& out, void* saved, void* workspace, Stream stream);
  virtual void backward_saved(const ExpertsProblem& problem, const Tensor& grad_out, const void* saved,
                              ExpertsGradients& grads, void* workspace, Stream stream);
};

// The registry of backends by name. The built-in backends are registered on first use; users add
// their own with register_backend.
class ExpertsInterface {
 public:
  static ExpertsInterface& global();

  // Throws if the name is taken.
  void register_backend(std::shared_ptr<ExpertsBackend> backend);
  // Throws with the list of valid names if there is no such backend.
  ExpertsBackend& get(std::string_view name) const;
  bool contains(std::string_view name) const;
  std::vector<std::string> names() const;  // in registration order

 private:
  ExpertsInterface();
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// Runs the named backend: validates the problem, asks the backend whether it supports it (throws
// with the reason if not), sizes the workspace, and writes out (allocated when undefined). Returns
// out. Pass a workspace of at least workspace_bytes(problem) bytes (any dtype, on the problem's
// device) to run with no allocation at all, e.g. inside a CUDA graph capture; otherwise one is
// allocated for the call.
Tensor experts_forward(const ExpertsProblem& problem, std::string_view backend = "grouped_mm", Tensor out = Tensor(),
                       Stream stream = Stream(), Tensor workspace = Tensor());

// What experts_forward(problem, backend) runs now: the backend's kernel_path for the problem, after the same checks
// (the problem's validation, supports_device and supports, which throw with the reason).
std::string experts_kernel_path(const ExpertsProblem& problem, std::string_view backend = "grouped_mm");

// The backward of the named backend (DESIGN §2b), with the life of experts_forward: validates the problem
// and grad_out, asks supports_backward (throws with the reason), sizes the workspace and writes grads. A
// gradient left undefined in grads is allocated; a defined one must have its input's shape and dtype, be
// contiguous and on the problem's device. Pass a workspace of at least backward_workspace_bytes(problem)
// bytes to run with no allocation (CUDA graph capture).
// saved: what experts_forward_saving kept for this problem with this backend (TrainingForward::saved), read in place
// of recomputing it; undefined (or empty, where the backend keeps nothing): the backward recomputes. A given workspace
// must then hold saved_backward_workspace_bytes(problem). Only the size of `saved` is checked: it must come from
// experts_forward_saving with this backend on these very inputs (what autograd's saved tensors guarantee).
ExpertsGradients experts_backward(const ExpertsProblem& problem, const Tensor& grad_out,
                                  std::string_view backend = "grouped_mm", ExpertsGradients grads = ExpertsGradients(),
                                  Stream stream = Stream(), Tensor workspace = Tensor(), Tensor saved = Tensor());

// The forward of a training step: out, and what the backend keeps for its backward (ExpertsBackend::forward_saving).
struct TrainingForward {
  Tensor out;    // [T, H]
  Tensor saved;  // u8 [saved_activation_bytes(problem)] on the problem's device; empty where the backend keeps nothing
};
// experts_forward that also keeps the backend's saved activations, for experts_backward(..., saved). A defined
// `saved` must be a contiguous tensor of at least saved_activation_bytes(problem) bytes on the problem's device, and
// a defined workspace of at least saving_workspace_bytes(problem); undefined ones are allocated for the call. Also
// asks supports_backward: a forward kept for a backward the backend cannot run is refused up front.
TrainingForward experts_forward_saving(const ExpertsProblem& problem, std::string_view backend = "grouped_mm",
                                       Tensor out = Tensor(), Tensor saved = Tensor(), Stream stream = Stream(),
                                       Tensor workspace = Tensor());

}  // namespace moekit

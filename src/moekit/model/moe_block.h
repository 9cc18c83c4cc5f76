// The MoE block of a decoder layer (transformers' Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock,
// DeepseekV3MoE, GptOssMLP's routed part...), on the CPU: the gate projection, the router, the routed
// experts through a named experts backend, and the optional shared expert.
//
//   logits = hidden @ router_weight^T (+ router_bias)                       [T, E]
//   ids, w = route(logits, router, correction_bias)
//   out    = experts(hidden, ids, w) + [sigmoid(hidden . shared_expert_gate)] * shared_mlp(hidden)
//
// Gate precision follows transformers per router kind. The projection is accumulated in float (double
// internally) in every case; then
//   softmax_topk, topk_softmax (Qwen, Mixtral, OLMoE, GPT-OSS): F.linear runs in the activation dtype,
//       so for 16-bit hidden states the logits are rounded to that dtype before routing, and the routing
//       weights are rounded to it afterwards (router_top_value.to(router_logits.dtype));
//   deepseek_v3: the router casts to float32 first, so the logits and the weights stay float32.
// The shared expert's gate logit is likewise rounded to the activation dtype, its sigmoid too.
//
// The shared expert is run by experts_forward itself as one expert (E = 1, gate rows then up rows,
// fused once and kept with shared_gate_proj's storage; call mark_modified() on it after writing into
// the shared weights in place) that every token picks with the weight sigmoid(gate logit), or 1
// without a gate; the two outputs are added in float and rounded once to the activation dtype.
#pragma once

#include <string_view>

#include "moekit/experts.h"
#include "moekit/model/checkpoint.h"
#include "moekit/model/router.h"
#include "moekit/tensor.h"

namespace moekit {

struct MoeBlockWeights {
  Tensor router_weight;    // [E, H]   (gate.weight)
  Tensor router_bias;      // [E] or undefined (GPT-OSS has one)
  Tensor correction_bias;  // [E] f32 or undefined (DeepSeek-V3 e_score_correction_bias)
  FusedExperts experts;    // the routed experts, in the layout of experts_config
  // The shared expert (a dense gated MLP), undefined when absent: Qwen2-MoE's shared_expert (with
  // shared_expert_gate [1, H]: its output is multiplied by sigmoid(x . gate)); DeepSeek-V3's
  // shared_experts (no gate; n_shared_experts MLPs are one MLP of n_shared * moe_intermediate).
  Tensor shared_gate_proj;    // [Is, H]
  Tensor shared_up_proj;      // [Is, H]
  Tensor shared_down_proj;    // [H, Is]
  Tensor shared_expert_gate;  // [1, H] or undefined
};

// hidden [T, H] (f32, f16 or bf16, CPU) -> a new contiguous [T, H] tensor of hidden's dtype: route, run the
// experts with `backend` (a name in ExpertsInterface), add the shared expert. The shared expert uses
// experts_config's activation. Throws moekit::Error naming the tensor whose shape, dtype or device
// is wrong (the experts themselves are checked by experts_forward).
Tensor moe_block_forward(const Tensor& hidden, const MoeBlockWeights& w, const RouterConfig& router,
                         const ExpertsConfig& experts_config, std::string_view backend);

// A dense gated MLP, down(act(gate x) * up x), as transformers' *MLP modules (DeepSeek-V3's first dense
// layers): run by experts_forward as one expert that every token picks with weight 1, so that it runs
// on every backend and device the experts do. gate_proj, up_proj [I, H], down_proj [H, I].
Tensor dense_mlp_forward(const Tensor& hidden, const Tensor& gate_proj, const Tensor& up_proj, const Tensor& down_proj,
                         Activation activation, std::string_view backend);

}  // namespace moekit

// The MoE routers of the model runtime: gate logits [T, E] -> the top-k experts of each token and their
// weights, in the form the experts backends take (ExpertsProblem::top_k_index / top_k_weights).
// CPU, float32 math, parallel over tokens. Each kind reproduces one transformers router:
//
//   softmax_topk  (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral)
//       p = softmax(logits) over all E experts; the k largest p and their ids;
//       norm_topk_prob: w /= sum(w). (Mixtral always renormalises: the runtime sets it true.)
//   topk_softmax  (GPT-OSS)
//       the k largest logits and their ids; w = softmax over those k logits.
//   deepseek_v3   (DeepSeek-V3: sigmoid, correction bias, grouped top-k, routed scaling)
//       s = sigmoid(logits); c = s + correction_bias; the E experts form n_group contiguous groups of
//       E / n_group; a group's score is the sum of its two largest c; only the experts of the topk_group
//       best groups can be chosen (the others are never chosen, as with transformers' -inf mask);
//       ids = the k largest c among them; w = s at those ids (without the bias);
//       norm_topk_prob: w /= sum(w) + 1e-20; then w *= routed_scaling_factor.
//
// Order and ties (torch.topk leaves them unspecified; here they are fixed so that results are
// reproducible): the k slots of a token are written in descending order of the selection score (p,
// the logit, or c), as torch.topk(sorted=True) returns them; among equal scores the lower expert id
// comes first. Groups are ranked the same way (equal group scores: the lower group wins).
//
// Non-finite logits never crash. NaN ranks above every number, +inf included, as in torch.topk, and
// NaNs tie with each other (lower id first). NaN then propagates as in transformers: one NaN logit
// makes the whole softmax row NaN (softmax_topk), the weights of a top-k set holding a NaN NaN
// (topk_softmax), or a NaN sigmoid score whose group then ranks first (deepseek_v3). +inf logits give
// NaN softmax weights (inf - inf), as torch's softmax does; sigmoid(+inf) = 1 and sigmoid(-inf) = 0.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "moekit/tensor.h"

namespace moekit {

enum class RouterKind : uint8_t { softmax_topk, topk_softmax, deepseek_v3 };

std::string_view router_kind_name(RouterKind kind);  // "softmax_topk", ...

struct RouterConfig {
  RouterKind kind = RouterKind::softmax_topk;
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K, in [1, E]
  // softmax_topk and deepseek_v3: renormalise the k weights (ignored by topk_softmax, whose k weights
  // already sum to one).
  bool norm_topk_prob = false;
  // deepseek_v3 only (ignored by the other kinds):
  int64_t n_group = 1;     // divides E; groups of E / n_group experts (at least 2 when n_group > 1)
  int64_t topk_group = 1;  // in [1, n_group], and topk_group * E / n_group >= K
  float routed_scaling_factor = 1.0f;

  std::string describe() const;
};

struct RouterOutput {
  Tensor top_k_index;    // [T, K] i64, each row in descending order of the selection score
  Tensor top_k_weights;  // [T, K] f32
};

// logits [T, E] (f32 | f16 | bf16, CPU, contiguous): the gate projection x @ W_gate^T (+ bias for
// GPT-OSS); 16-bit logits are widened to float32 exactly. correction_bias: [E] f32 CPU contiguous
// (e_score_correction_bias) for deepseek_v3, an undefined tensor for the other kinds.
// Throws moekit::Error naming the tensor or the config field that is wrong. T = 0 gives [0, K] outputs.
RouterOutput route(const Tensor& logits, const RouterConfig& config, const Tensor& correction_bias = Tensor());

}  // namespace moekit

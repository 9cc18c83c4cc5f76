// The float64 reference of the experts contract: the oracle every backend is checked against.
#pragma once

#include <vector>

#include "moekit/experts.h"

namespace moekit {

// out [T, H] in float64 (row-major), computed from the problem's CPU tensors with every input
// converted to double: the activation, biases, routing weight and sum over k exactly as in the contract.
std::vector<double> experts_reference(const ExpertsProblem& problem);

// The gradients of the contract (DESIGN §2b) in float64 for grad_out [T, H] (CPU, any float dtype), each
// row-major in its input's logical layout (transposed weights stay transposed); the bias gradients are
// empty without has_bias. Unquantised problems only.
struct ReferenceGradients {
  std::vector<double> hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias;
};
ReferenceGradients experts_reference_backward(const ExpertsProblem& problem, const Tensor& grad_out);

// The activation of the contract on one (gate, up) pair in double; for ungated experts pass the up
// value as `gate` and ignore `up`.
double reference_activation(const ExpertsConfig& config, double gate, double up);
// Its partial derivatives at (gate, up): d act / d gate and d act / d up (zero for ungated experts). A
// clamp that is active (GPT-OSS: gate > limit, |up| > limit) passes no gradient; at the limit it does, as
// torch's clamp.
struct ActivationDerivatives {
  double gate = 0, up = 0;
};
ActivationDerivatives reference_activation_derivatives(const ExpertsConfig& config, double gate, double up);

}  // namespace moekit

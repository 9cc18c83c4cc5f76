// The float64 reference of the experts contract: the oracle every backend is checked against.
#pragma once

#include <vector>

#include "moekit/experts.h"

namespace moekit {

// out [T, H] in float64 (row-major), computed from the problem's CPU tensors with every input
// converted to double: the activation, biases, routing weight and sum over k exactly as in the contract.
std::vector<double> experts_reference(const ExpertsProblem& problem);

// The activation of the contract on one (gate, up) pair in double; for ungated experts pass the up
// value as `gate` and ignore `up`.
double reference_activation(const ExpertsConfig& config, double gate, double up);

}  // namespace moekit

// Choosing the next token from a row of logits: greedy, or sampling with temperature, top-k and top-p
// applied in that order (transformers' logits processors' order).
#pragma once

#include <cstdint>
#include <random>
#include <span>

#include "moekit/model.h"

namespace moekit {

// Throws naming the field that is out of range (temperature <= 0 when sampling, top_p outside (0, 1],
// negative top_k or max_new_tokens).
void validate_generation_config(const GenerationConfig& config);

// Greedy: the first index of the largest logit (NaN logits are never chosen unless all are NaN).
// Sampling: logits / temperature; keep the top_k largest (ties at the k-th value kept, as
// transformers' TopKLogitsWarper); keep the smallest set of most likely tokens whose probability
// reaches top_p (at least one); draw from the renormalised softmax with rng.
int32_t pick_token(std::span<const float> logits, const GenerationConfig& config, std::mt19937_64& rng);

}  // namespace moekit

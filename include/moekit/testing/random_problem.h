// Random experts problems, for tests and benchmarks: deterministic from a seed.
#pragma once

#include <cstdint>

#include "moekit/experts.h"

namespace moekit {

struct RandomProblemOptions {
  int64_t tokens = 1;
  int64_t hidden = 64;
  int64_t intermediate = 32;
  int64_t experts = 8;
  int64_t top_k = 2;
  DType dtype = DType::bf16;
  DType index_dtype = DType::i64;
  // f32, or the activation dtype (transformers passes both).
  DType weights_dtype = DType::f32;
  ExpertsConfig config;
  uint64_t seed = 0;
  // Routing: each token picks top_k distinct experts uniformly at random, unless one of these is set.
  bool all_to_one_expert = false;  // every slot routes to expert 0 (the others stay empty)
  double sentinel_fraction = 0.0;  // this fraction of slots gets an id >= E
  int64_t used_experts = 0;        // > 0: route only among the first used_experts (others empty)
  // Values: x ~ U(-1, 1); weights ~ U(-1, 1) / sqrt(fan_in) so activations stay O(1).
  float input_scale = 1.0f;
  // With config.quantization set, each 128 x 128 block of the weights drawn as above is multiplied by its own
  // power of two (1/2 to 4; neighbouring blocks' scales then differ, which uniform weights would not make them),
  // the weights are quantised (quantize_weights) and the problem holds the quantised weights and their scales, in
  // this dtype for FP8 (f32 or ue8m0); FP4 always has ue8m0 scales.
  DType scale_dtype = DType::f32;
};

// A problem on the CPU with freshly allocated tensors (never aliasing an earlier problem's memory).
ExpertsProblem make_random_problem(const RandomProblemOptions& options);

// Fills a contiguous CPU float tensor with values uniform in [-scale, scale), each element hashed from
// (stream, its index): the same stream gives the same values on any number of threads.
void fill_uniform(Tensor& t, float scale, uint64_t stream);

// Multiplies each 128 x 128 block of contiguous CPU weights [E, rows, cols] by its own power of two, 2^-1 to 2^2
// by (expert + row block + 2 column block) mod 4 (exact), so that neighbouring blocks' quantisation scales differ by
// 2x to 8x: a kernel that applies a neighbouring block's scale is then clearly wrong. make_random_problem does it
// to quantised problems' weights before quantising them.
void vary_block_magnitudes(Tensor& w);

// Redraws the routing (ids and weights) of an existing problem in place, keeping the weights.
void redraw_routing(ExpertsProblem& problem, const RandomProblemOptions& options, uint64_t seed);

}  // namespace moekit

// What a grouped GEMM of the Hopper backends does with its products before it stores them: one list, from the
// public GEMM (hopper_gemm.h) down to the kernel (src/moekit/cuda/sm90_gemm_epilogue.cuh), which the experts
// backends run with the layer's activation, biases and routing weights and the GEMM alone with SiLU and none.
#pragma once

#include <cstdint>

namespace moekit {

enum class GroupedGemmEpilogue : uint8_t {
  // out [M, N]: the products (an experts layer's second projection: plus its bias, and times the pair's routing
  // weight where the backend weights its rows there).
  store,
  // out [M, N / 2]: act(gate) * up, the weight rows of each column block half gate rows and half the up rows of the
  // same intermediate columns (the GEMM alone: rows [0, N/2) gate, [N/2, N) up, act SiLU).
  gated,
  // FP8 operands only: gated, quantised in the epilogue as quantize_activations quantises the float rows: e4m3 codes
  // [M, N / 2] and one scale per row and 128-wide group (an FP8 experts layer's first projection).
  gated_e4m3,
  // out [M, N]: act(x) of an ungated first projection (the GEMM alone: SiLU).
  activation,
};

}  // namespace moekit

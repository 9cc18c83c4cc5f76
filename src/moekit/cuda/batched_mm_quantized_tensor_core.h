// batched_mm with block-quantised weights on Hopper's tensor cores (the decode path of quantised experts):
// each pair's products are 16-row matrix-vector tiles run by mma.sync, FP8 as e4m3 codes from both sides,
// FP4 as exact f16 copies of the weights (scaled per block) and of the activation codes. A weight byte
// costs a 16-byte load and a share of one instruction (FP8) or a few integer instructions (FP4) instead of
// a float conversion and an FMA per value.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "moekit/cuda/experts_cuda.h"

namespace moekit::cuda {

// Whether this path runs the problem on the current device: FP8 e4m3 weights with H and I multiples of 16,
// or FP4 e2m1 weights with H and I multiples of 32 (whole 16-byte pieces of every row); untransposed,
// 16-byte aligned weights, compute capability 9.0 (the sm_90a code), and not turned off with
// MOEKIT_BATCHED_MM_TENSOR_CORES=0 (which keeps the matrix-vector kernels of batched_mm.cu).
bool batched_mm_quantized_tensor_core_runs(const ExpertsArgs& a);

// The workspace it needs: float hidden rows, the activation codes (bytes; f16 for FP4) and scales of the activations and of the
// hidden rows, and one counter per (pair, 128 intermediate columns).
std::size_t batched_mm_quantized_tensor_core_workspace_bytes(const ExpertsArgs& a);

// Three launches, the last two programmatic dependents of the one before (no host synchronisation,
// capturable): quantise x, the first projection (each group of 128 hidden columns quantised by the
// warp that completes it), the second projection with the ordered combine.
void batched_mm_quantized_tensor_core_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream);

}  // namespace moekit::cuda

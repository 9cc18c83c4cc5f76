// Switches between kernel paths of the same computation, kept for measuring one path against the other. Each
// starts from its environment variable (read once, at the first kernel_options() call) and can be set in code
// with set_kernel_options; `moekit bench` prints the values in force with its results and records them in its
// JSON. Whatever they say, a backend computes the same result (to the rounding its kernels document).
#pragma once

#include <string>

namespace moekit {

struct KernelOptions {
  // CUDA grouped_mm on Hopper runs deepgemm's TMA + wgmma kernels where they take the problem; false keeps its
  // portable kernels there. MOEKIT_HOPPER_GEMM=0 sets it false.
  bool grouped_mm_hopper_kernels = true;
  // There, from 32 to 1,024 tokens with top-k >= 4 (at most 8,192 pairs; bf16/f16), it takes sonicmoe's variant of
  // them (token rows gathered into the first GEMM, each row weighted in the second's epilogue), measured faster at
  // those sizes; false: deepgemm's (rows copied, weighted in the combine). MOEKIT_GROUPED_MM_GATHER=0 sets it false.
  bool grouped_mm_gathered_rows = true;
  // The Hopper GEMMs at least 1,024 deep run in clusters of two blocks sharing (multicasting) weight tiles; false:
  // clusters of one. MOEKIT_DEEPGEMM_CLUSTER=1 sets it false.
  bool hopper_clusters = true;
  // A Hopper GEMM warpgroup whose 64 rows are all padding skips its math; false: it computes them.
  // MOEKIT_HOPPER_IDLE_PADDING=0 sets it false.
  bool hopper_idle_padding = true;
  // deepgemm and sonicmoe run batched_mm's weight-streaming kernels at decode sizes (few pairs, about one an
  // expert); false: their grouped GEMMs at every size. MOEKIT_HOPPER_DECODE_STREAMING=0 sets it false.
  bool hopper_decode_streaming = true;
  // The Hopper backward's persistent GEMMs launch at most this many blocks (0: one a multiprocessor), so that each
  // block takes many units: the tests' small problems then wrap every ring, as model-sized problems do.
  // MOEKIT_HOPPER_BACKWARD_BLOCKS=N sets it.
  int hopper_backward_blocks = 0;
  // CUDA batched_mm reads FP8 / FP4 weights on the tensor cores (Hopper); false: its older CUDA-core kernels.
  // MOEKIT_BATCHED_MM_TENSOR_CORES=0 sets it false.
  bool batched_mm_tensor_cores = true;
  // CPU grouped_mm multiplies FP8 block-scaled codes on moekit's AVX512-BF16 kernel where the CPU has it; false:
  // one oneDNN bf16 product per 128-wide block. MOEKIT_CPU_FP8_GEMM=onednn sets it false.
  bool cpu_fp8_own_kernel = true;
};

// The options in force (thread-safe).
KernelOptions kernel_options();
// Replaces them for every later call (thread-safe); calls already queued keep what they were launched with.
void set_kernel_options(const KernelOptions& options);
// "grouped_mm_hopper_kernels=1 hopper_clusters=1 ...", every field in declaration order.
std::string describe(const KernelOptions& options);

}  // namespace moekit

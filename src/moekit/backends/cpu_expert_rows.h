// Pieces the CPU backends (eager, batched_mm, grouped_mm) share: where each expert's weights and biases live whatever
// the layout flags, and the deterministic weighted combine.
#pragma once

#include <cstdint>

#include "moekit/backends/cpu_routing.h"
#include "moekit/cpu/onednn_matmul.h"
#include "moekit/cpu/quantized_gemv.h"
#include "moekit/experts.h"

namespace moekit::cpu {

// One projection of one expert seen as an [out, in] matrix: element (n, k) is at
// base[n * stride_out + k * stride_in] in elements of the weight dtype.
struct MatrixView {
  const char* base = nullptr;
  int64_t stride_out = 0, stride_in = 0;
  std::size_t element_bytes = 0;

  const void* row(int64_t n) const { return base + static_cast<std::size_t>(n * stride_out) * element_bytes; }
  const void* at(int64_t n, int64_t k) const {
    return base + static_cast<std::size_t>(n * stride_out + k * stride_in) * element_bytes;
  }
};

// Whether a problem's activations are quantised before each projection (DESIGN §3: per token, per 128-wide
// group, power-of-two scales with ue8m0 weight scales), and the one call that does it.
struct ActivationQuantization {
  bool enabled = false;
  bool power_of_two = false;

  explicit ActivationQuantization(const ExpertsProblem& p);
  // values [0, n) become the values the products use (in place); nothing when not enabled. A group starts
  // at values[0]. Where codes (n) and scales (one per group) are given, they receive the e4m3 codes and
  // group scales as well.
  void apply(float* values, int64_t n, f8_e4m3* codes = nullptr, float* scales = nullptr) const;
};

// The layout of a problem's expert weights (DESIGN §2 flags resolved once).
struct ExpertLayout {
  int64_t hidden = 0, intermediate = 0, experts = 0;
  int64_t up_outputs = 0;  // 2I with a gate, I without
  bool has_gate = true, is_concatenated = true, is_transposed = false, has_bias = false;
  bool quantized = false;  // block-quantised weights: use up_quantized / down_quantized, not the MatrixViews
  Tensor gate_up, down, gate_up_bias, down_bias, gate_up_scale, down_scale;
  ActivationQuantization activations;

  explicit ExpertLayout(const ExpertsProblem& p);

  // gate_up_proj (or up_proj) of expert e as [up_outputs, H]; unquantised weights only.
  MatrixView up_matrix(int64_t e) const;
  // down_proj of expert e as [H, I]; unquantised weights only.
  MatrixView down_matrix(int64_t e) const;
  // The same projections of quantised weights, with their scales.
  QuantizedMatrix up_quantized(int64_t e) const;
  QuantizedMatrix down_quantized(int64_t e) const;
  // Output columns of the first projection holding gate j and up j.
  int64_t gate_column(int64_t j) const { return is_concatenated ? j : 2 * j; }
  int64_t up_column(int64_t j) const { return is_concatenated ? intermediate + j : 2 * j + 1; }
};

// out[t] = sum_k w[t, k] * y[pair_row[t * K + k] - row_base] for t in [t_begin, t_end), in float,
// k = 0..K-1 in order; sentinel slots (pair_row -1) add nothing. y holds one float row of length H
// (stride ldy) per routed pair with the down bias already added.
void combine_weighted(const ExpertsProblem& p, const std::vector<int64_t>& pair_row, const float* y, int64_t ldy,
                      int64_t t_begin, int64_t t_end, int64_t row_base, Tensor& out);

}  // namespace moekit::cpu

namespace moekit::cpu {

// y[j] += bias[e, first + j] for j in [0, n) (bias in its own dtype); nothing for an undefined bias.
void add_bias(const Tensor& bias, int64_t e, int64_t first, int64_t n, float* y);

// Reads the ids [T, K] into pair order: pair_row[t * K + k] = t * K + k, or -1 for a sentinel (>= E).
// Negative ids throw, naming the token and slot.
std::vector<int64_t> pairs_in_token_order(const Tensor& top_k_index, int64_t experts,
                                          std::vector<int64_t>& expert_of_pair);

}  // namespace moekit::cpu

namespace moekit::cpu {

// Whether a problem's quantised rows can be multiplied as block-scaled codes: FP8 weights with float scales,
// whose values (code * scale) bf16 cannot hold (see RowBuffers). The products then run per 128-wide block of
// K on bf16 copies of the e4m3 codes of both sides (exact), and each block's float sums are multiplied by the
// activation group's scale times the weight block's scale.
bool uses_block_scaled_codes(const ExpertsProblem& p);

// The buffers of the sorted-row pipeline (eager and grouped_mm) carved from one workspace, each
// 64-byte aligned: gathered rows x [rows + pad, H] and hidden [rows + pad, I] in the gemm dtype,
// down outputs y [rows, H] in float, with block-scaled codes the activation scales of x [rows + pad,
// ceil(H / 128)] and of hidden [rows + pad, ceil(I / 128)], and what the backend adds after them
// (extra_bytes).
struct RowBuffers {
  int64_t max_rows = 0, hidden = 0, intermediate = 0, up_outputs = 0;
  int64_t h_groups = 0, i_groups = 0;  // 128-wide activation groups of an x row and of a hidden row
  GemmDType gemm = GemmDType::f32;
  bool block_scaled_codes = false;  // x and hidden hold bf16 e4m3 codes, their scales apart
  std::size_t x_bytes = 0, hidden_bytes = 0, y_bytes = 0, scale_bytes = 0, extra_bytes = 0;

  // pad_rows: rows past the last one that products may read (zeroed by the backend). codes: the caller
  // multiplies block-scaled codes (only where uses_block_scaled_codes(p)); gemm is then bf16.
  RowBuffers(const ExpertsProblem& p, int64_t pad_rows, bool codes = false);
  std::size_t total() const { return x_bytes + hidden_bytes + y_bytes + scale_bytes + extra_bytes; }
  static std::size_t aligned(std::size_t bytes) { return (bytes + 63) / 64 * 64; }

  char* x(void* workspace) const { return static_cast<char*>(workspace); }
  char* hidden_rows(void* workspace) const { return x(workspace) + x_bytes; }
  float* y(void* workspace) const { return reinterpret_cast<float*>(hidden_rows(workspace) + hidden_bytes); }
  float* x_scales(void* workspace) const {
    return reinterpret_cast<float*>(reinterpret_cast<char*>(y(workspace)) + y_bytes);
  }
  float* hidden_scales(void* workspace) const { return x_scales(workspace) + (max_rows + pad_rows_) * h_groups; }
  char* extra(void* workspace) const { return reinterpret_cast<char*>(y(workspace)) + y_bytes + scale_bytes; }

 private:
  int64_t pad_rows_ = 0;
};

// dst [rows, H] in the gemm dtype (see onednn_matmul.h) = hidden_states[row_token[row]], converted, and
// quantised first where the problem's activations are. Runs on all threads.
// With scales (block-scaled codes: dtype bf16, quantisation enabled), dst receives the e4m3 codes as bf16 and
// scales [rows, ceil(H / 128)] the group scales.
void gather_rows(const Tensor& hidden_states, const std::vector<int64_t>& row_token, GemmDType dtype, void* dst,
                 const ActivationQuantization& quantization, float* scales = nullptr);

// dst [n] in the gemm dtype = act(gate, up) for n intermediate columns (see apply_activation), quantised
// per 128-wide group first where the problem's activations are (the columns then start at a group
// boundary). scratch holds n floats.
// With scales (block-scaled codes), dst receives the e4m3 codes as bf16 and scales the ceil(n / 128) group scales.
void activate_into(const ExpertsConfig& config, const float* gate, int64_t gate_stride, const float* up,
                   int64_t up_stride, int64_t n, const ActivationQuantization& quantization, GemmDType dtype, void* dst,
                   float* scratch, float* scales = nullptr);

// dst [count, k_len] in the gemm dtype: row i = output row outputs[i] of the weight matrix w (of
// dtype w_dtype), converted. How weights in any layout become the rows oneDNN packs.
void gather_weight_rows(const MatrixView& w, DType w_dtype, const std::vector<int64_t>& outputs, int64_t k_len,
                        GemmDType dtype, void* dst);
// The same from quantised weights: row i = output row outputs[i] of w, dequantised and converted.
void gather_weight_rows(const QuantizedMatrix& w, const std::vector<int64_t>& outputs, int64_t k_len, GemmDType dtype,
                        void* dst);
// dst [count, k_len] bf16: row i = the e4m3 codes of FP8 weight row outputs[i] of w at k0 .. k0 + k_len - 1,
// as bf16 values (exact), before their scales.
void gather_weight_codes(const QuantizedMatrix& w, const std::vector<int64_t>& outputs, int64_t k0, int64_t k_len,
                         bf16* dst);

}  // namespace moekit::cpu

// CUDA kernels of the model runtime's dense operations (the device half of model/model_ops.h). Kernel
// layer: raw device pointers, sizes and a stream; all asynchronous on the stream, no host
// synchronisation. Activations and weights hold the model's dtype (f32, f16 or bf16); every kernel
// computes in float and rounds its result once to the dtype, at the same points as the CPU
// operations (see model_ops.h), so the two devices agree to rounding.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moekit/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace moekit::cuda {

// out [T, H] = table [V, H] rows at ids [T] (int32, device). Ids were checked on the host.
void embedding_forward(const void* table, const int32_t* ids, int64_t tokens, int64_t hidden, DType dtype, void* out,
                       cudaStream_t stream);

// Each row of x [R, D]: out = weight * round(x * rsqrt(mean(x^2) + eps)) (weight [D] in dtype).
void rms_norm_forward(const void* x, const void* weight, int64_t rows, int64_t dim, float eps, DType dtype, void* out,
                      cudaStream_t stream);

// out [T, N] = round(x [T, K] @ weight [N, K]^T + bias [N]) (bias may be null), float accumulation.
// workspace: linear_workspace_bytes(T, K, N) bytes of device memory.
std::size_t linear_workspace_bytes(int64_t tokens, int64_t in_features, int64_t out_features);
void linear_forward(const void* x, const void* weight, const void* bias, int64_t tokens, int64_t in_features,
                    int64_t out_features, DType dtype, void* out, void* workspace, cudaStream_t stream);
// Same product, float32 result (no rounding): DeepSeek-V3's router logits.
void linear_forward_f32(const void* x, const void* weight, int64_t tokens, int64_t in_features, int64_t out_features,
                        DType dtype, float* out, void* workspace, cudaStream_t stream);

// h = round(h + a) over n elements; x = clamp(x, -limit, limit) over n elements.
void add_in_place(void* h, const void* a, int64_t n, DType dtype, cudaStream_t stream);
void clamp_in_place(void* x, int64_t n, float limit, DType dtype, cudaStream_t stream);

// Rotates in place 2 * half values starting at column `offset` of each of `heads` heads of x
// [T, heads * head_stride], row t at position positions_begin + t (positions_begin read from
// positions_begin_device, int32 on the device, when that is not null: read when the kernel runs, so that
// one captured CUDA graph serves every decode step): cos/sin = round(cos/sin(inv_freq[i]
// * position) * attention_factor) to the dtype; half-split pairs (x[i], x[i + half]) or, interleaved,
// (x[2i], x[2i+1]) written de-interleaved (first halves then second halves), as model_ops::apply_rotary.
// inv_freq: [half] float, device.
void rotary_forward(void* x, int64_t tokens, int64_t heads, int64_t head_stride, int64_t offset, int64_t half,
                    const float* inv_freq, float attention_factor, bool interleaved, int64_t positions_begin,
                    const int32_t* positions_begin_device, DType dtype, cudaStream_t stream);

// Causal attention of T new queries (positions past .. past + T - 1) against S = past + T keys; past is
// read from past_device (int32 on the device) when that is not null, when the kernel runs, so that one
// captured graph serves every decode step over a cache allocated at its full length.
// q element (t, h, d) at q[t * q_row + h * key_dim + d]; key (j, kh, d) at k[j * k_row + kh * k_head + d];
// value (j, kh, d) at v[j * v_row + kh * v_head + d]; out [T, Hq * value_dim] contiguous. Query head h
// reads key head h / (Hq / Hk). A query sees keys j <= its position and, with sliding_window > 0, j >
// position - sliding_window. sinks: [Hq] float device (an extra logit per head, GPT-OSS) or null.
// Scores and softmax in float; out rounded to the dtype.
struct AttentionArgs {
  int64_t tokens = 0, past = 0, query_heads = 0, key_heads = 0, key_dim = 0, value_dim = 0;
  const int32_t* past_device = nullptr;
  int64_t q_row = 0, k_row = 0, k_head = 0, v_row = 0, v_head = 0;
  float scale = 1.0f;
  int64_t sliding_window = 0;
  const float* sinks = nullptr;
  DType dtype = DType::bf16;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
};
void attention_forward(const AttentionArgs& a, cudaStream_t stream);

// Copies columns [begin, end) of each of `rows` rows of src (row length src_cols) to dst (row length
// dst_cols, starting at column dst_begin); elements of dtype.
void copy_columns(const void* src, int64_t rows, int64_t src_cols, int64_t begin, int64_t end, void* dst,
                  int64_t dst_cols, int64_t dst_begin, DType dtype, cudaStream_t stream);

// Copies src [rows, row_elements] into rows [first_row, first_row + rows) of dst (row_elements per row),
// first_row read from first_row_device (int32 on the device) when the kernel runs: the KV cache append
// of a captured decode step. The caller makes sure the rows fit.
void write_rows_at(const void* src, int64_t rows, int64_t row_elements, void* dst, const int32_t* first_row_device,
                   DType dtype, cudaStream_t stream);

// Routers on the device (model/router.h gives the exact semantics, ties and NaN rules, which these
// follow): logits [T, E] float -> ids [T, K] int64 (descending selection score), weights [T, K] float.
// kind 0: softmax top-k (renormalise if norm_topk_prob); 1: top-k then softmax; 2: DeepSeek-V3 grouped
// sigmoid with correction_bias [E] float, n_group, topk_group, norm_topk_prob, routed_scaling_factor.
struct RouterArgs {
  int kind = 0;
  int64_t tokens = 0, experts = 0, top_k = 0, n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  const float* logits = nullptr;
  const float* correction_bias = nullptr;
  int64_t* ids = nullptr;
  float* weights = nullptr;
};
void route_forward(const RouterArgs& a, cudaStream_t stream);

// Converts n float values to the dtype (rounding), or n dtype values to float.
void float_to_dtype(const float* src, int64_t n, DType dtype, void* dst, cudaStream_t stream);
void dtype_to_float(const void* src, int64_t n, DType dtype, float* dst, cudaStream_t stream);

// out[0] = the first index of the largest of x[0, n) (float): NaN is never chosen unless every value is
// NaN (then n - 1), as sampling.h's greedy pick_token; int32 on the device.
void argmax_forward(const float* x, int64_t n, int32_t* out, cudaStream_t stream);

// Sets n elements of dst to value: float32, int32 or int64 (value a whole number for those).
void fill_forward(void* dst, int64_t n, DType dtype, double value, cudaStream_t stream);

// Qwen2-MoE's shared-expert weight: w[t] = round(sigmoid(round(logit[t]))) in the dtype, as float.
void sigmoid_gate_forward(const float* logits, int64_t tokens, DType dtype, float* weights, cudaStream_t stream);

}  // namespace moekit::cuda

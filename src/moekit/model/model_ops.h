// The dense operations of a decoder layer, on the CPU or on CUDA (the tensors' device picks; the CUDA
// kernels are in cuda/model_kernels.h): embedding lookup, RMSNorm, linear projections, residual adds,
// rotary embeddings, causal attention and, on CUDA, the routers. Tensors hold the model's dtype (f32, f16 or
// bf16) between operations and every operation computes in float, rounding its result once to the
// dtype: the points where PyTorch rounds a 16-bit model's activations, so that a bf16 model follows
// transformers' numerics closely (exactly in float32).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moekit/model/router.h"
#include "moekit/tensor.h"

namespace moekit::model_ops {

// table [V, H] rows at ids -> [T, H]. An id outside [0, V) throws naming its position.
Tensor embedding(const Tensor& table, std::span<const int32_t> ids);

// Each row of x [R, D] (contiguous): weight * round(x * rsqrt(mean(x^2) + eps)), as transformers'
// RMSNorm (the normalised row is rounded to the dtype before the weight multiplies it).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);

// x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N], float accumulation. Few rows run as
// matrix-vector products that read the weight in place, more as one oneDNN product.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// h = round(h + a), element-wise; same shape and dtype.
void add_in_place(Tensor& h, const Tensor& a);
// Clamps every element of x to [-limit, limit] (OLMoE's clip_qkv).
void clamp_in_place(Tensor& x, float limit);

// Columns [begin, end) of a [T, N] tensor as a new contiguous [T, end - begin] tensor.
Tensor columns(const Tensor& x, int64_t begin, int64_t end);
// Copies columns [begin, end) of src [R, C] into columns [dst_begin, dst_begin + end - begin) of
// dst [R, D] (same dtype and device, contiguous).
void copy_columns(const Tensor& src, int64_t begin, int64_t end, Tensor& dst, int64_t dst_begin);
// Copies src [n, C] into rows [row, row + n) of dst [R, C] (same dtype and device, contiguous).
void write_rows(Tensor& dst, int64_t row, const Tensor& src);
// x [T, K] @ weight [N, K]^T in float32, not rounded (DeepSeek-V3's router, Qwen2-MoE's shared gate).
Tensor linear_f32(const Tensor& x, const Tensor& weight);

// The rotary embedding's tables for one model: inv_freq [d/2] and the factor cos and sin are scaled by.
struct RotaryTables {
  std::vector<float> inv_freq;
  Tensor inv_freq_device;  // inv_freq on the model's GPU (CUDA models), else undefined
  float attention_factor = 1.0f;
  bool interleaved = false;  // DeepSeek: pairs (x0, x1), (x2, x3), ...; else the two halves rotate
};

// Rotates, in place, the 2 * inv_freq.size() values starting at column `offset` of every head of
// x [T, heads * head_stride] (row t is the token at position positions_begin + t). cos and sin are
// computed in float and rounded to x's dtype first, as transformers does.
void apply_rotary(Tensor& x, int64_t heads, int64_t head_stride, int64_t offset, const RotaryTables& rope,
                  int64_t positions_begin);

// Causal attention of T new queries against S = past + T keys (the cached ones then the new ones).
struct AttentionShape {
  int64_t tokens = 0;       // T new queries, at positions past .. past + T - 1
  int64_t past = 0;         // keys before the first query
  int64_t query_heads = 0;  // Hq, a multiple of key_heads (grouped-query attention)
  int64_t key_heads = 0;    // Hk
  int64_t key_dim = 0;      // dq = dk
  int64_t value_dim = 0;    // dv
  float scale = 1.0f;       // multiplies q . k
  int64_t sliding_window = 0;           // > 0: a query sees keys less than this many positions back
  const float* sinks = nullptr;         // [Hq] GPT-OSS attention sinks (an extra logit per head), or null
};
// q [T, Hq, dk], k [S, Hk, dk], v [S, Hk, dv] in float (values already rounded to the dtype) ->
// out [T, Hq, dv] in dtype. Softmax in float.
Tensor attention(const float* q, const float* k, const float* v, const AttentionShape& shape, DType dtype);

// The same attention on CUDA tensors of the dtype: q [T, Hq * dk] contiguous; key (j, kh, d) at
// k[j * k_row + kh * k_head + d] and value (j, kh, d) at v[j * v_row + kh * v_head + d] (elements), the
// first S = past + T positions valid.
Tensor attention(const Tensor& q, const Tensor& k, int64_t k_row, int64_t k_head, const Tensor& v, int64_t v_row,
                 int64_t v_head, const AttentionShape& shape);

// A contiguous float32 copy of x's values (copied to the host first when x is on a GPU).
std::vector<float> to_float_vector(const Tensor& x);
// Element-wise dtype conversion on x's device.
Tensor convert(const Tensor& x, DType dtype);

// The routers on CUDA: route() of router.h on device logits [T, E] f32 (ids i64, weights f32 on the
// device); correction_bias [E] f32 on the device for deepseek_v3.
RouterOutput route_on_device(const Tensor& logits, const RouterConfig& config, const Tensor& correction_bias);
// Qwen2-MoE's shared-expert weight on CUDA: round(sigmoid(round(logit))) to dtype, as float [T].
Tensor sigmoid_gate(const Tensor& logits_f32, DType dtype);

}  // namespace moekit::model_ops

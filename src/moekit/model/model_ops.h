// The dense operations of a decoder layer on the CPU: embedding lookup, RMSNorm, linear projections,
// residual adds, rotary embeddings and causal attention. Tensors hold the model's dtype (f32, f16 or
// bf16) between operations and every operation computes in float, rounding its result once to the
// dtype: the points where PyTorch rounds a 16-bit model's activations, so that a bf16 model follows
// transformers' numerics closely (exactly in float32).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

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

// The rotary embedding's tables for one model: inv_freq [d/2] and the factor cos and sin are scaled by.
struct RotaryTables {
  std::vector<float> inv_freq;
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

// A contiguous float32 copy of x's values.
std::vector<float> to_float_vector(const Tensor& x);

}  // namespace moekit::model_ops

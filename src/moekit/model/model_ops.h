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

#include "moekit/experts.h"
#include "moekit/model/router.h"
#include "moekit/tensor.h"

namespace moekit::model_ops {

// The stream that the calling thread's CUDA operations below (and moe_block's experts calls) queue on:
// the legacy default stream unless a StreamScope names another. The model runtime runs on a stream of
// its own so that its decode step can be captured into a CUDA graph, which the legacy stream cannot be.
class StreamScope {
 public:
  explicit StreamScope(Stream stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  Stream previous_;
};
Stream current_stream();

// Throws naming the position of the first id outside [0, vocab).
void check_token_ids(std::span<const int32_t> ids, int64_t vocab);

// table [V, H] rows at ids -> [T, H]. An id outside [0, V) throws naming its position.
Tensor embedding(const Tensor& table, std::span<const int32_t> ids);
// The same with the ids in an int32 [T] tensor on table's device, already checked (check_token_ids):
// a GPU reads them when the kernel runs, so a captured step embeds whatever token was written there.
Tensor embedding(const Tensor& table, const Tensor& ids);

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
// Copies src [n, C] into rows [row, row + n) of dst [R, C] (same dtype and device, contiguous). On CUDA
// with row_device (int32 on the device, holding row), the kernel reads the row from there when it runs.
void write_rows(Tensor& dst, int64_t row, const Tensor& src, const int32_t* row_device = nullptr);
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
// computed in float and rounded to x's dtype first, as transformers does. On CUDA with
// positions_begin_device (int32 on the device, holding positions_begin), the kernel reads it from there.
void apply_rotary(Tensor& x, int64_t heads, int64_t head_stride, int64_t offset, const RotaryTables& rope,
                  int64_t positions_begin, const int32_t* positions_begin_device = nullptr);

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
  const int32_t* past_device = nullptr;  // CUDA: past in device memory, read by the kernel, or null
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

// A new tensor of `shape` with every element `value` (f32, i32 or i64; a whole number for the latter),
// made on the device (on CUDA by a kernel on the current stream, so that it can be captured).
Tensor full(const Shape& shape, DType dtype, double value, Device device);

// The greedy pick on CUDA: for float32 logits [1, V] (or [V]) on a GPU, an int32 [1] tensor there holding
// the first index of the largest value, as pick_token (sampling.h) chooses it, so that 4 bytes come back
// to the host instead of the row.
Tensor argmax(const Tensor& logits);

}  // namespace moekit::model_ops

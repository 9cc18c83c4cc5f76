#include "moekit/backends/cpu_backward.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "moekit/backends/cpu_expert_rows.h"

namespace moekit::cpu {
namespace {

// The derivatives of the contract's activation at one (gate, up) pair, in float, with the activation's
// value: what the backward needs of it. A clamp that is active passes no gradient (at the limit it does,
// as torch's clamp); ungated experts pass the value as `gate` and get d_up = 0.
struct ActivationStep {
  float value = 0, d_gate = 0, d_up = 0;
};

ActivationStep activation_step(const ExpertsConfig& c, float gate, float up) {
  auto sigmoid = [](float v) { return 1.0f / (1.0f + std::exp(-v)); };
  if (c.swiglu_limit) {
    const float limit = *c.swiglu_limit, alpha = c.swiglu_alpha;
    const float g = std::min(gate, limit), u = std::clamp(up, -limit, limit);
    const float s = sigmoid(alpha * g);
    const float d_g = (u + 1.0f) * (s + alpha * g * s * (1.0f - s));
    return {(u + 1.0f) * g * s, gate <= limit ? d_g : 0.0f, std::abs(up) <= limit ? g * s : 0.0f};
  }
  float a = 0, da = 0;
  const float g = gate;
  switch (c.activation) {
    case Activation::silu: {
      const float s = sigmoid(g);
      a = g * s;
      da = s * (1.0f + g * (1.0f - s));
      break;
    }
    case Activation::gelu: {
      const float cdf = 0.5f * (1.0f + std::erf(g * 0.70710678118654752f));
      a = g * cdf;
      da = cdf + g * std::exp(-0.5f * g * g) * 0.39894228040143268f;
      break;
    }
    case Activation::gelu_pytorch_tanh: {
      const float k = 0.79788456080286536f, c3 = 0.044715f;
      const float th = std::tanh(k * (g + c3 * g * g * g));
      a = 0.5f * g * (1.0f + th);
      da = 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * k * (1.0f + 3.0f * c3 * g * g);
      break;
    }
    case Activation::relu:
      a = g > 0 ? g : 0.0f;
      da = g > 0 ? 1.0f : 0.0f;
      break;
    case Activation::relu2:
      a = g > 0 ? g * g : 0.0f;
      da = g > 0 ? 2.0f * g : 0.0f;
      break;
  }
  if (!c.has_gate) return {a, da, 0.0f};
  return {a * up, da * up, a};
}

// Rows per product: an expert's row count above 8 rounded up to a multiple of 16 (zero rows), so that only a
// few product shapes are ever created: oneDNN products are created once per shape and kept, and the row
// counts change with every batch's routing.
int64_t padded_rows(int64_t n) {
  return n <= 8 ? n : (n + 15) / 16 * 16;
}

// The buffers of the backward carved from one workspace, each 64-byte aligned, for every routed pair and the
// zero rows that pad each expert's (at most T * K + 15 E rows): sorted inputs x and grad_out rows d in the gemm dtype; z (then dz) and g in float;
// dz and w * act(z) in the gemm dtype; dx in float; one expert's transposed left operand in the gemm dtype;
// one expert's weight gradients in float; with weights oneDNN cannot read in place (f16), one expert's
// weights converted.
struct BackwardBuffers {
  int64_t rows = 0, H = 0, I = 0, N = 0;
  GemmDType gemm = GemmDType::f32;
  std::size_t g = 4;  // bytes per gemm element
  bool converts_weights = false;
  std::size_t offsets[11] = {};

  explicit BackwardBuffers(const ExpertsProblem& p) {
    const ExpertsShape s = problem_shape(p);
    rows = s.tokens * s.top_k + 15 * s.experts;
    H = s.hidden;
    I = s.intermediate;
    N = p.config.has_gate ? 2 * I : I;
    gemm = gemm_dtype_for(p.hidden_states.dtype());
    g = gemm_dtype_size(gemm);
    converts_weights = p.hidden_states.dtype() == DType::f16;
    const std::size_t r = static_cast<std::size_t>(rows);
    const std::size_t sizes[10] = {
        r * H * g,                                           // x
        r * H * g,                                           // d
        r * N * sizeof(float),                               // z, then dz
        r * I * sizeof(float),                               // g = d W2
        r * N * g,                                           // dz in the gemm dtype
        r * I * g,                                           // w * act(z)
        r * H * sizeof(float),                               // dx
        r * std::max(H, N) * g,                              // one expert's transposed left operand
        static_cast<std::size_t>(std::max(N * H, H * I)) * sizeof(float),  // one weight gradient
        converts_weights ? static_cast<std::size_t>(N * H + H * I) * g : 0,  // converted weights
    };
    for (int i = 0; i < 10; ++i) offsets[i + 1] = offsets[i] + RowBuffers::aligned(sizes[i]);
  }
  std::size_t total() const { return offsets[10]; }
  char* at(void* workspace, int i) const { return static_cast<char*>(workspace) + offsets[i]; }
};

// dst [cols, rows] = src [rows, cols] (row stride ld) transposed, in the gemm dtype; in 32 x 32 blocks so
// that both sides are read and written a cache line at a time.
template <typename T>
void transpose_block_rows(const T* src, int64_t ld, int64_t rows, int64_t cols, T* dst) {
  constexpr int64_t kBlock = 32;
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < cols; c0 += kBlock)
    for (int64_t r0 = 0; r0 < rows; r0 += kBlock)
      for (int64_t c = c0; c < std::min(c0 + kBlock, cols); ++c)
        for (int64_t r = r0; r < std::min(r0 + kBlock, rows); ++r) dst[c * rows + r] = src[r * ld + c];
}

void transpose_rows(const char* src, int64_t ld, int64_t rows, int64_t cols, GemmDType gemm, char* dst) {
  if (gemm == GemmDType::bf16)
    transpose_block_rows(reinterpret_cast<const uint16_t*>(src), ld, rows, cols, reinterpret_cast<uint16_t*>(dst));
  else
    transpose_block_rows(reinterpret_cast<const float*>(src), ld, rows, cols, reinterpret_cast<float*>(dst));
}

void store_gemm(float v, GemmDType gemm, char* dst, int64_t i) {
  if (gemm == GemmDType::bf16)
    reinterpret_cast<bf16*>(dst)[i] = from_float<bf16>(v);
  else
    reinterpret_cast<float*>(dst)[i] = v;
}

// Writes expert e's weight gradient (float [rows_out, cols_in], row-major in the matrix view's (n, k)
// order) into grad, the gradient tensor of a weight whose expert-e matrix view is `view`.
void store_weight_gradient(const float* dw, int64_t rows_out, int64_t cols_in, const MatrixView& view,
                           const Tensor& weights, Tensor& grad) {
  const std::ptrdiff_t expert_offset = (view.base - static_cast<const char*>(weights.data())) /
                                       static_cast<std::ptrdiff_t>(view.element_bytes);
  visit_float_dtype(grad.dtype(), [&](auto tag) {
    using W = typename decltype(tag)::type;
    W* base = static_cast<W*>(grad.data()) + expert_offset;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows_out; ++n)
      for (int64_t k = 0; k < cols_in; ++k)
        base[n * view.stride_out + k * view.stride_in] = from_float<W>(dw[n * cols_in + k]);
  });
}

void store_bias_gradient(const std::vector<float>& db, int64_t e, Tensor& grad) {
  visit_float_dtype(grad.dtype(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    B* dst = static_cast<B*>(grad.data()) + e * static_cast<int64_t>(db.size());
    for (std::size_t j = 0; j < db.size(); ++j) dst[j] = from_float<B>(db[j]);
  });
}

}  // namespace

std::size_t sorted_backward_workspace_bytes(const ExpertsProblem& p) {
  return BackwardBuffers(p).total();
}

void sorted_backward(const ExpertsProblem& p, const Tensor& grad_out, ExpertsGradients& grads, void* workspace) {
  const ExpertLayout layout(p);
  const BackwardBuffers b(p);
  const ExpertRouting routing = route_by_expert(p.top_k_index, layout.experts);
  const int64_t H = b.H, I = b.I, N = b.N, K = routing.top_k, T = routing.tokens;
  const GemmDType gemm = b.gemm;
  const std::size_t g = b.g;
  char* x = b.at(workspace, 0);
  char* d = b.at(workspace, 1);
  auto* z = reinterpret_cast<float*>(b.at(workspace, 2));
  auto* gd = reinterpret_cast<float*>(b.at(workspace, 3));
  char* dz = b.at(workspace, 4);
  char* aw = b.at(workspace, 5);
  auto* dx = reinterpret_cast<float*>(b.at(workspace, 6));
  char* transposed = b.at(workspace, 7);
  auto* dw = reinterpret_cast<float*>(b.at(workspace, 8));
  char* converted = b.at(workspace, 9);

  // Expert e's rows start at row padded_first[e] of the buffers, padded_rows of them, the last ones zero.
  const int64_t E = layout.experts;
  std::vector<int64_t> padded_first(static_cast<std::size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) padded_first[e + 1] = padded_first[e] + padded_rows(routing.rows_of(e));
  std::vector<int64_t> padded_token(static_cast<std::size_t>(padded_first[E]), 0), buffer_row(routing.row_token.size());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < routing.rows_of(e); ++i) {
      padded_token[padded_first[e] + i] = routing.row_token[routing.offsets[e] + i];
      buffer_row[routing.offsets[e] + i] = padded_first[e] + i;
    }
  const ActivationQuantization no_quantization(p);  // unquantised problems only: disabled
  gather_rows(p.hidden_states, padded_token, gemm, x, no_quantization);
  gather_rows(grad_out, padded_token, gemm, d, no_quantization);
  // Zero rows past each expert's last: the products over rows (the weight gradients) then add nothing for them.
  auto zero_pad_rows = [&](char* rows, int64_t width, int64_t e) {
    const int64_t real = padded_first[e] + routing.rows_of(e);
    std::fill(rows + static_cast<std::size_t>(real * width) * g,
              rows + static_cast<std::size_t>(padded_first[e + 1] * width) * g, char(0));
  };
  for (int64_t e = 0; e < E; ++e) {
    zero_pad_rows(x, H, e);
    zero_pad_rows(d, H, e);
  }
  std::vector<int64_t> all_up(static_cast<std::size_t>(N)), all_down(static_cast<std::size_t>(H));
  std::iota(all_up.begin(), all_up.end(), 0);
  std::iota(all_down.begin(), all_down.end(), 0);
  const DType w_dtype = p.gate_up_proj.dtype();

  visit_float_dtype(p.top_k_weights.dtype(), [&](auto w_tag) {
    using RW = typename decltype(w_tag)::type;
    const RW* routing_weight = static_cast<const RW*>(p.top_k_weights.data());
    RW* grad_weight = static_cast<RW*>(grads.top_k_weights.data());
    for (int64_t i = 0; i < T * K; ++i) grad_weight[i] = from_float<RW>(0.0f);  // sentinels stay zero

    std::vector<float> db1(static_cast<std::size_t>(N)), db2(static_cast<std::size_t>(H)), b2(static_cast<std::size_t>(H));
    auto grad_value = [&](const char* rows, int64_t i) {  // element i of grad_out rows in the gemm dtype
      return gemm == GemmDType::bf16 ? to_float(reinterpret_cast<const bf16*>(rows)[i])
                                     : reinterpret_cast<const float*>(rows)[i];
    };
    for (int64_t e = 0; e < E; ++e) {
      const int64_t first = routing.offsets[e], n = routing.rows_of(e);
      const int64_t pf = padded_first[e], np = padded_rows(n);  // the expert's rows in the buffers
      MatrixView up = layout.up_matrix(e), down = layout.down_matrix(e);
      const MatrixView up_in_grad = up, down_in_grad = down;  // where this expert's gradients go
      if (n == 0) {  // no token: zero gradients
        std::fill(dw, dw + std::max(N * H, H * I), 0.0f);
        store_weight_gradient(dw, N, H, up_in_grad, p.gate_up_proj, grads.gate_up_proj);
        store_weight_gradient(dw, H, I, down_in_grad, p.down_proj, grads.down_proj);
        if (layout.has_bias) {
          std::fill(db1.begin(), db1.end(), 0.0f);
          std::fill(db2.begin(), db2.end(), 0.0f);
          store_bias_gradient(db1, e, grads.gate_up_proj_bias);
          store_bias_gradient(db2, e, grads.down_proj_bias);
        }
        continue;
      }
      if (b.converts_weights) {  // rows [N, H] and [H, I] in the gemm dtype
        char* down_rows = converted + static_cast<std::size_t>(N * H) * g;
        gather_weight_rows(up, w_dtype, all_up, H, gemm, converted);
        gather_weight_rows(down, w_dtype, all_down, I, gemm, down_rows);
        up = {converted, H, 1, g};
        down = {down_rows, I, 1, g};
      }
      const char* xe = x + static_cast<std::size_t>(pf * H) * g;
      const char* de = d + static_cast<std::size_t>(pf * H) * g;
      float* ze = z + pf * N;
      float* ge = gd + pf * I;
      char* dze = dz + static_cast<std::size_t>(pf * N) * g;
      char* awe = aw + static_cast<std::size_t>(pf * I) * g;
      if (layout.has_bias) {
        std::fill(b2.begin(), b2.end(), 0.0f);
        add_bias(layout.down_bias, e, 0, H, b2.data());
      }
      // Z = X W1^T, G = D W2.
      matmul_strided(xe, H, np, up.base, H, N, up.stride_in, up.stride_out, gemm, ze, N);
      matmul_strided(de, H, np, down.base, H, I, down.stride_out, down.stride_in, gemm, ge, I);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < n; ++r) {
        const int64_t pair = routing.row_pair[static_cast<std::size_t>(first + r)];
        const float weight = to_float(routing_weight[pair]);
        float* zr = ze + r * N;
        const float* gr = ge + r * I;
        add_bias(layout.gate_up_bias, e, 0, N, zr);
        double d_weight = 0;
        for (int64_t j = 0; j < I; ++j) {
          const int64_t gc = layout.has_gate ? layout.gate_column(j) : j;
          const int64_t uc = layout.has_gate ? layout.up_column(j) : j;
          const ActivationStep s = activation_step(p.config, zr[gc], layout.has_gate ? zr[uc] : 0.0f);
          d_weight += static_cast<double>(gr[j]) * s.value;
          const float da = weight * gr[j];
          store_gemm(weight * s.value, gemm, awe, r * I + j);
          // dz overwrites z in place: both columns of j are read above before either is written.
          zr[gc] = da * s.d_gate;
          if (layout.has_gate) zr[uc] = da * s.d_up;
        }
        for (int64_t c = 0; c < N; ++c) store_gemm(zr[c], gemm, dze, r * N + c);
        if (layout.has_bias)
          for (int64_t h = 0; h < H; ++h) d_weight += static_cast<double>(grad_value(de, r * H + h)) * b2[static_cast<std::size_t>(h)];
        grad_weight[pair] = from_float<RW>(static_cast<float>(d_weight));
      }
      zero_pad_rows(dz, N, e);
      zero_pad_rows(aw, I, e);
      // dW2 = D^T (w act(Z)) [H, I].
      transpose_rows(de, H, np, H, gemm, transposed);
      matmul_strided(transposed, np, H, awe, np, I, I, 1, gemm, dw, I);
      store_weight_gradient(dw, H, I, down_in_grad, p.down_proj, grads.down_proj);
      // dW1 = dZ^T X [N, H].
      transpose_rows(dze, N, np, N, gemm, transposed);
      matmul_strided(transposed, np, N, xe, np, H, H, 1, gemm, dw, H);
      store_weight_gradient(dw, N, H, up_in_grad, p.gate_up_proj, grads.gate_up_proj);
      // dX = dZ W1 [n, H].
      matmul_strided(dze, N, np, up.base, N, H, up.stride_out, up.stride_in, gemm, dx + pf * H, H);
      if (layout.has_bias) {  // in row order: db1 = sum_r dz, db2 = sum_r w D
        std::fill(db1.begin(), db1.end(), 0.0f);
        std::fill(db2.begin(), db2.end(), 0.0f);
        for (int64_t r = 0; r < n; ++r) {
          const float* dzr = ze + r * N;
          for (int64_t c = 0; c < N; ++c) db1[static_cast<std::size_t>(c)] += dzr[c];
          const int64_t pair = routing.row_pair[static_cast<std::size_t>(first + r)];
          const float weight = to_float(routing_weight[pair]);
          for (int64_t h = 0; h < H; ++h) db2[static_cast<std::size_t>(h)] += weight * grad_value(de, r * H + h);
        }
        store_bias_gradient(db1, e, grads.gate_up_proj_bias);
        store_bias_gradient(db2, e, grads.down_proj_bias);
      }
    }
  });

  // grad_x[t] = sum_k dx[row(t, k)], k in order.
  visit_float_dtype(grads.hidden_states.dtype(), [&](auto tag) {
    using O = typename decltype(tag)::type;
    O* o = static_cast<O*>(grads.hidden_states.data());
#pragma omp parallel
    {
      std::vector<float> acc(static_cast<std::size_t>(H));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t row = routing.pair_row[static_cast<std::size_t>(t * K + k)];
          if (row < 0) continue;
          const float* dr = dx + buffer_row[static_cast<std::size_t>(row)] * H;
          for (int64_t h = 0; h < H; ++h) acc[static_cast<std::size_t>(h)] += dr[h];
        }
        for (int64_t h = 0; h < H; ++h) o[t * H + h] = from_float<O>(acc[static_cast<std::size_t>(h)]);
      }
    }
  });
}

}  // namespace moekit::cpu

#include "moekit/backends/cpu_expert_rows.h"

#include "moekit/cpu/activation.h"
#include "moekit/quantization.h"

namespace moekit::cpu {

ActivationQuantization::ActivationQuantization(const ExpertsProblem& p)
    : enabled(p.config.quantization.quantized()),
      power_of_two(enabled && p.gate_up_proj_scale_inv.dtype() == DType::ue8m0) {}

void ActivationQuantization::apply(float* values, int64_t n, f8_e4m3* codes, float* scales) const {
  if (enabled) quantize_activations(values, n, power_of_two, values, codes, scales);
}

ExpertLayout::ExpertLayout(const ExpertsProblem& p) : activations(p) {
  const ExpertsShape s = problem_shape(p);
  hidden = s.hidden;
  intermediate = s.intermediate;
  experts = s.experts;
  has_gate = p.config.has_gate;
  up_outputs = has_gate ? 2 * intermediate : intermediate;
  // Without a gate there is nothing to interleave: the flag does not apply.
  is_concatenated = !has_gate || p.config.is_concatenated;
  is_transposed = p.config.is_transposed;
  has_bias = p.config.has_bias;
  gate_up = p.gate_up_proj;
  down = p.down_proj;
  gate_up_bias = p.gate_up_proj_bias;
  down_bias = p.down_proj_bias;
  quantized = p.config.quantization.quantized();
  gate_up_scale = p.gate_up_proj_scale_inv;
  down_scale = p.down_proj_scale_inv;
}

namespace {

// Expert e of quantised weights [E, rows, cols] with scales [E, ...].
QuantizedMatrix quantized_matrix(const Tensor& w, const Tensor& scale, int64_t e, int64_t rows, int64_t cols) {
  QuantizedMatrix m;
  m.fp4 = w.dtype() == DType::f4_e2m1;
  m.row_bytes = m.fp4 ? cols / 2 : cols;
  m.data = static_cast<const uint8_t*>(w.data()) + e * rows * m.row_bytes;
  m.ue8m0_scales = scale.dtype() == DType::ue8m0;
  m.scale_ld = scale.size(2);
  const int64_t per_expert = scale.size(1) * scale.size(2);
  m.scales =
      static_cast<const char*>(scale.data()) + static_cast<std::size_t>(e * per_expert) * dtype_size(scale.dtype());
  return m;
}

}  // namespace

QuantizedMatrix ExpertLayout::up_quantized(int64_t e) const {
  return quantized_matrix(gate_up, gate_up_scale, e, up_outputs, hidden);
}

QuantizedMatrix ExpertLayout::down_quantized(int64_t e) const {
  return quantized_matrix(down, down_scale, e, hidden, intermediate);
}

MatrixView ExpertLayout::up_matrix(int64_t e) const {
  MatrixView v;
  v.element_bytes = dtype_size(gate_up.dtype());
  v.base =
      static_cast<const char*>(gate_up.data()) + static_cast<std::size_t>(e * up_outputs * hidden) * v.element_bytes;
  v.stride_out = is_transposed ? 1 : hidden;
  v.stride_in = is_transposed ? up_outputs : 1;
  return v;
}

MatrixView ExpertLayout::down_matrix(int64_t e) const {
  MatrixView v;
  v.element_bytes = dtype_size(down.dtype());
  v.base =
      static_cast<const char*>(down.data()) + static_cast<std::size_t>(e * hidden * intermediate) * v.element_bytes;
  v.stride_out = is_transposed ? 1 : intermediate;
  v.stride_in = is_transposed ? hidden : 1;
  return v;
}

void combine_weighted(const ExpertsProblem& p, const std::vector<int64_t>& pair_row, const float* y, int64_t ldy,
                      int64_t t_begin, int64_t t_end, int64_t row_base, Tensor& out) {
  const int64_t H = out.size(1), K = p.top_k_index.size(1);
  visit_float_dtype(out.dtype(), [&](auto out_tag) {
    using O = typename decltype(out_tag)::type;
    visit_float_dtype(p.top_k_weights.dtype(), [&](auto w_tag) {
      using W = typename decltype(w_tag)::type;
      O* o = static_cast<O*>(out.data());
      const W* w = static_cast<const W*>(p.top_k_weights.data());
#pragma omp parallel for schedule(static)
      for (int64_t t = t_begin; t < t_end; ++t) {
        float acc[256];
        for (int64_t h0 = 0; h0 < H; h0 += 256) {
          const int64_t hn = std::min<int64_t>(256, H - h0);
          for (int64_t h = 0; h < hn; ++h) acc[h] = 0.0f;
          for (int64_t k = 0; k < K; ++k) {
            const int64_t row = pair_row[static_cast<std::size_t>(t * K + k)];
            if (row < 0) continue;
            const float wk = to_float(w[t * K + k]);
            const float* yr = y + (row - row_base) * ldy + h0;
#pragma omp simd
            for (int64_t h = 0; h < hn; ++h) acc[h] += wk * yr[h];
          }
          for (int64_t h = 0; h < hn; ++h) o[t * H + h0 + h] = from_float<O>(acc[h]);
        }
      }
    });
  });
}

}  // namespace moekit::cpu

namespace moekit::cpu {

void add_bias(const Tensor& bias, int64_t e, int64_t first, int64_t n, float* y) {
  if (!bias.defined()) return;
  const int64_t width = bias.size(1);
  visit_float_dtype(bias.dtype(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    const B* b = static_cast<const B*>(bias.data()) + e * width + first;
    for (int64_t j = 0; j < n; ++j) y[j] += to_float(b[j]);
  });
}

std::vector<int64_t> pairs_in_token_order(const Tensor& top_k_index, int64_t experts,
                                          std::vector<int64_t>& expert_of_pair) {
  const ExpertRouting r = route_by_expert(top_k_index, experts);
  const int64_t pairs = r.tokens * r.top_k;
  std::vector<int64_t> pair_row(static_cast<std::size_t>(pairs), -1);
  expert_of_pair.assign(static_cast<std::size_t>(pairs), -1);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t row = r.offsets[e]; row < r.offsets[e + 1]; ++row) {
      const int64_t pair = r.row_pair[static_cast<std::size_t>(row)];
      pair_row[static_cast<std::size_t>(pair)] = pair;
      expert_of_pair[static_cast<std::size_t>(pair)] = e;
    }
  return pair_row;
}

}  // namespace moekit::cpu

namespace moekit::cpu {

bool uses_block_scaled_codes(const ExpertsProblem& p) {
  return p.config.quantization.weights == WeightFormat::fp8_e4m3 && p.gate_up_proj_scale_inv.dtype() == DType::f32;
}

namespace {
// dst[i] = the e4m3 code in byte codes[i] as bf16 (exact: every e4m3 value is a bf16 value).
void e4m3_codes_to_bf16(const void* codes, int64_t n, bf16* dst) {
  const auto* bytes = static_cast<const uint8_t*>(codes);
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<bf16>(to_float(f8_e4m3{bytes[i]}));
}
}  // namespace

RowBuffers::RowBuffers(const ExpertsProblem& p, int64_t pad_rows, bool codes)
    : block_scaled_codes(codes), pad_rows_(pad_rows) {
  const ExpertsShape s = problem_shape(p);
  max_rows = s.tokens * s.top_k;
  hidden = s.hidden;
  intermediate = s.intermediate;
  up_outputs = p.config.has_gate ? 2 * s.intermediate : s.intermediate;
  gemm = gemm_dtype_for(p.hidden_states.dtype());
  // FP8 with float scales: the values the products use (code * scale, for the weights and for the
  // quantised activations, whose scales are then amax / 448) are not bf16 values, and rounding them to bf16
  // moves ~5% of the intermediates across an e4m3 rounding boundary before the second projection (2-3e-2
  // relative error at a token). Such problems multiply in f32. With ue8m0 scales (and FP4, always ue8m0)
  // the values are codes times powers of two, which bf16 holds exactly.
  // Block-scaled codes avoid that (their products are exact in bf16) where the caller multiplies per block.
  MOEKIT_CHECK(!codes || uses_block_scaled_codes(p),
               "RowBuffers: block-scaled codes are for FP8 weights with float scales");
  if (uses_block_scaled_codes(p)) gemm = codes ? GemmDType::bf16 : GemmDType::f32;
  h_groups = (hidden + kActivationGroupSize - 1) / kActivationGroupSize;
  i_groups = (intermediate + kActivationGroupSize - 1) / kActivationGroupSize;
  const std::size_t g = gemm_dtype_size(gemm);
  x_bytes = aligned(static_cast<std::size_t>((max_rows + pad_rows) * hidden) * g);
  hidden_bytes = aligned(static_cast<std::size_t>((max_rows + pad_rows) * intermediate) * g);
  y_bytes = aligned(static_cast<std::size_t>(max_rows * hidden) * sizeof(float));
  if (codes)
    scale_bytes = aligned(static_cast<std::size_t>((max_rows + pad_rows) * (h_groups + i_groups)) * sizeof(float));
}

void gather_rows(const Tensor& hidden_states, const std::vector<int64_t>& row_token, GemmDType dtype, void* dst,
                 const ActivationQuantization& quantization, float* scales) {
  const int64_t H = hidden_states.size(1);
  const auto rows = static_cast<int64_t>(row_token.size());
  MOEKIT_CHECK(!scales || (quantization.enabled && dtype == GemmDType::bf16),
               "gather_rows: codes are for quantised activations in bf16");
  if (quantization.enabled) {  // through float: quantisation reads whole groups of the row
#pragma omp parallel
    {
      std::vector<float> row(static_cast<std::size_t>(H));
      std::vector<f8_e4m3> codes(scales ? static_cast<std::size_t>(H) : 0);
      const int64_t groups = (H + kActivationGroupSize - 1) / kActivationGroupSize;
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        visit_float_dtype(hidden_states.dtype(), [&](auto tag) {
          using A = typename decltype(tag)::type;
          const A* src = static_cast<const A*>(hidden_states.data()) + row_token[static_cast<std::size_t>(r)] * H;
          for (int64_t h = 0; h < H; ++h) row[static_cast<std::size_t>(h)] = to_float(src[h]);
        });
        if (scales) {
          quantization.apply(row.data(), H, codes.data(), scales + r * groups);
          e4m3_codes_to_bf16(codes.data(), H, static_cast<bf16*>(dst) + r * H);
          continue;
        }
        quantization.apply(row.data(), H);
        if (dtype == GemmDType::bf16) {
          bf16* d = static_cast<bf16*>(dst) + r * H;
          for (int64_t h = 0; h < H; ++h) d[h] = from_float<bf16>(row[static_cast<std::size_t>(h)]);
        } else {
          std::copy(row.begin(), row.end(), static_cast<float*>(dst) + r * H);
        }
      }
    }
    return;
  }
  visit_float_dtype(hidden_states.dtype(), [&](auto tag) {
    using A = typename decltype(tag)::type;
    const A* x = static_cast<const A*>(hidden_states.data());
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const A* src = x + row_token[static_cast<std::size_t>(r)] * H;
      if (dtype == GemmDType::bf16) {
        bf16* d = static_cast<bf16*>(dst) + r * H;
        for (int64_t h = 0; h < H; ++h) d[h] = from_float<bf16>(to_float(src[h]));
      } else {
        float* d = static_cast<float*>(dst) + r * H;
        for (int64_t h = 0; h < H; ++h) d[h] = to_float(src[h]);
      }
    }
  });
}

void gather_weight_rows(const MatrixView& w, DType w_dtype, const std::vector<int64_t>& outputs, int64_t k_len,
                        GemmDType dtype, void* dst) {
  visit_float_dtype(w_dtype, [&](auto tag) {
    using W = typename decltype(tag)::type;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const W* row = static_cast<const W*>(w.row(outputs[i]));
      const auto base = static_cast<int64_t>(i) * k_len;
      if (dtype == GemmDType::bf16) {
        bf16* d = static_cast<bf16*>(dst) + base;
        for (int64_t k = 0; k < k_len; ++k) d[k] = from_float<bf16>(to_float(row[k * w.stride_in]));
      } else {
        float* d = static_cast<float*>(dst) + base;
        for (int64_t k = 0; k < k_len; ++k) d[k] = to_float(row[k * w.stride_in]);
      }
    }
  });
}

void activate_into(const ExpertsConfig& config, const float* gate, int64_t gate_stride, const float* up,
                   int64_t up_stride, int64_t n, const ActivationQuantization& quantization, GemmDType dtype, void* dst,
                   float* scratch, float* scales) {
  if (quantization.enabled) {
    apply_activation(config, gate, gate_stride, up, up_stride, n, scratch);
    if (scales) {
      MOEKIT_CHECK(dtype == GemmDType::bf16, "activate_into: codes are written as bf16");
      thread_local std::vector<f8_e4m3> codes;
      codes.resize(static_cast<std::size_t>(n));
      quantization.apply(scratch, n, codes.data(), scales);
      e4m3_codes_to_bf16(codes.data(), n, static_cast<bf16*>(dst));
      return;
    }
    quantization.apply(scratch, n);
    if (dtype == GemmDType::bf16)
      for (int64_t j = 0; j < n; ++j) static_cast<bf16*>(dst)[j] = from_float<bf16>(scratch[j]);
    else
      std::copy(scratch, scratch + n, static_cast<float*>(dst));
    return;
  }
  if (dtype == GemmDType::bf16)
    apply_activation(config, gate, gate_stride, up, up_stride, n, static_cast<bf16*>(dst));
  else
    apply_activation(config, gate, gate_stride, up, up_stride, n, static_cast<float*>(dst));
}

void gather_weight_rows(const QuantizedMatrix& w, const std::vector<int64_t>& outputs, int64_t k_len, GemmDType dtype,
                        void* dst) {
  std::vector<float> row(static_cast<std::size_t>(k_len));
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const auto base = static_cast<int64_t>(i) * k_len;
    if (dtype == GemmDType::bf16) {
      dequantize_row(w, outputs[i], row.data(), k_len);
      bf16* d = static_cast<bf16*>(dst) + base;
      for (int64_t k = 0; k < k_len; ++k) d[k] = from_float<bf16>(row[static_cast<std::size_t>(k)]);
    } else {
      dequantize_row(w, outputs[i], static_cast<float*>(dst) + base, k_len);
    }
  }
}

void gather_weight_codes(const QuantizedMatrix& w, const std::vector<int64_t>& outputs, int64_t k0, int64_t k_len,
                         bf16* dst) {
  MOEKIT_CHECK(!w.fp4, "gather_weight_codes: FP8 weights only");
  for (std::size_t i = 0; i < outputs.size(); ++i)
    e4m3_codes_to_bf16(w.data + outputs[i] * w.row_bytes + k0, k_len, dst + static_cast<int64_t>(i) * k_len);
}

}  // namespace moekit::cpu

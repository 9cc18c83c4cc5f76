// batched_mm on the CPU: every (token, expert) pair is multiplied by its own expert's weights where
// they lie (no copies, no packing), as a pair of matrix-vector products. Built for few tokens
// (decode), where reading the chosen experts' weights once is all the work there is. Memory is
// bounded at any token count: tokens run in blocks, each block's pairs in a fixed-size workspace.
// Quantised weights (FP8, FP4) are read in their stored bytes by the quantised gemv, which converts them
// in registers, so decode reads half (FP8) or a quarter (FP4) of bf16's bytes; activations are quantised
// per token (and per pair, for the down projection's input) right before each projection. The products take
// the activations' e4m3 codes and group scales (gemv_rows_codes: code times code, both scales applied per
// weight scale block), which reads half of float x's bytes per weight value.
#include <algorithm>

#include "moekit/backends/builtin_backends.h"
#include "moekit/backends/cpu_expert_rows.h"
#include "moekit/backends/portable_backend.h"
#include "moekit/cpu/activation.h"
#include "moekit/cpu/gemv.h"
#include "moekit/cpu/quantized_gemv.h"
#include "moekit/quantization.h"

namespace moekit::backends {
namespace {

constexpr int64_t kTokensPerBlock = 16;
// Weight bytes per task: each task reads one contiguous run of rows as a single stream, long enough
// that the prefetchers' start-up is small against it, short enough that a single pair still gives
// both cores several tasks.
constexpr int64_t kBytesPerTask = int64_t{1} << 20;

int64_t rows_per_task(int64_t row_bytes) {
  return std::max<int64_t>(16, kBytesPerTask / std::max<int64_t>(row_bytes, 1));
}

// Bytes of one stored weight row of k_len inputs.
int64_t row_bytes(const cpu::ExpertLayout& l, DType activation_dtype, int64_t k_len) {
  if (!l.quantized) return k_len * static_cast<int64_t>(dtype_size(activation_dtype));
  return l.gate_up.dtype() == DType::f4_e2m1 ? k_len / 2 : k_len;
}

// The workspace of one block of tokens: x rows, then per pair the projected, hidden and down outputs, all
// in float; with quantised weights also the activation codes' group scales (x rows', hidden rows') and the codes.
// With a null base only the size is meaningful.
struct Workspace {
  int64_t h_groups = 0, i_groups = 0;
  bool codes = false;
  float *x = nullptr, *projected = nullptr, *hidden = nullptr, *down = nullptr;
  float *x_scales = nullptr, *hidden_scales = nullptr;
  f8_e4m3 *x_codes = nullptr, *hidden_codes = nullptr;
  std::size_t bytes = 0;

  Workspace(const ExpertsProblem& p, void* base) {
    const ExpertsShape s = problem_shape(p);
    const int64_t H = s.hidden, I = s.intermediate, K = s.top_k;
    const int64_t N = p.config.has_gate ? 2 * I : I;
    const int64_t block = std::min(s.tokens, kTokensPerBlock);
    codes = p.config.quantization.quantized();
    h_groups = (H + kActivationGroupSize - 1) / kActivationGroupSize;
    i_groups = (I + kActivationGroupSize - 1) / kActivationGroupSize;
    auto* f = static_cast<float*>(base);
    int64_t used = 0;  // floats
    auto take = [&](int64_t n) {
      float* at = f ? f + used : nullptr;
      used += n;
      return at;
    };
    x = take(block * H);
    projected = take(block * K * N);
    hidden = take(block * K * I);
    down = take(block * K * H);
    if (codes) {
      x_scales = take(block * h_groups);
      hidden_scales = take(block * K * i_groups);
      auto* c = f ? reinterpret_cast<f8_e4m3*>(f + used) : nullptr;
      x_codes = c;
      hidden_codes = c ? c + block * H : nullptr;
    }
    bytes = static_cast<std::size_t>(used) * sizeof(float) +
            (codes ? static_cast<std::size_t>(block * H + block * K * I) : 0);
  }
};

class BatchedMm final : public PortableBackend {
 public:
  BatchedMm() : PortableBackend(MOEKIT_CUDA_KERNELS(batched_mm)) {}
  std::string_view name() const override { return "batched_mm"; }
  std::string_view description() const override {
    return "one product per (token, expert) pair with that expert's weights in place; best for few tokens";
  }

 protected:
  std::size_t cpu_workspace_bytes(const ExpertsProblem& p) const override { return Workspace(p, nullptr).bytes; }
  std::string cpu_kernel_path(const ExpertsProblem& p) const override {
    return p.config.quantization.quantized() ? "per-pair gemv over the stored weight codes"
                                             : "per-pair gemv over the weights in place";
  }

  void cpu_forward(const ExpertsProblem& p, Tensor& out, void* workspace) override {
    const cpu::ExpertLayout layout(p);
    const int64_t T = p.hidden_states.size(0), K = p.top_k_index.size(1);
    const int64_t H = layout.hidden, I = layout.intermediate, N = layout.up_outputs;
    std::vector<int64_t> expert_of_pair;
    const std::vector<int64_t> pair_row = cpu::pairs_in_token_order(p.top_k_index, layout.experts, expert_of_pair);
    const int64_t block = std::min(T, kTokensPerBlock);
    const Workspace ws(p, workspace);
    float* x = ws.x;
    float* projected = ws.projected;
    float* hidden = ws.hidden;
    float* down = ws.down;
    // The activations' codes and scales of token t / pair q, where the products take them.
    auto x_codes = [&](int64_t t) { return cpu::QuantizedVector{ws.x_codes + t * H, ws.x_scales + t * ws.h_groups}; };
    auto hidden_codes = [&](int64_t q) {
      return cpu::QuantizedVector{ws.hidden_codes + q * I, ws.hidden_scales + q * ws.i_groups};
    };

    visit_float_dtype(p.hidden_states.dtype(), [&](auto tag) {
      using A = typename decltype(tag)::type;
      const A* xs = static_cast<const A*>(p.hidden_states.data());
      for (int64_t t0 = 0; t0 < T; t0 += block) {
        const int64_t tb = std::min(block, T - t0);
        for (int64_t i = 0; i < tb * H; ++i) x[i] = to_float(xs[t0 * H + i]);
        for (int64_t t = 0; t < tb; ++t) {
          if (ws.codes)
            layout.activations.apply(x + t * H, H, ws.x_codes + t * H, ws.x_scales + t * ws.h_groups);
          else
            layout.activations.apply(x + t * H, H);
        }
        // Pairs of this block routed to a real expert.
        std::vector<int64_t> pairs;
        for (int64_t q = t0 * K; q < (t0 + tb) * K; ++q)
          if (expert_of_pair[static_cast<std::size_t>(q)] >= 0) pairs.push_back(q);
        const auto P = static_cast<int64_t>(pairs.size());
        auto expert = [&](int64_t i) { return expert_of_pair[static_cast<std::size_t>(pairs[i])]; };
        auto local = [&](int64_t i) { return pairs[static_cast<std::size_t>(i)] - t0 * K; };

        // Up (or gate and up) projection, then bias and activation per pair.
        const int64_t up_rows = rows_per_task(row_bytes(layout, p.hidden_states.dtype(), H));
        const int64_t down_rows = rows_per_task(row_bytes(layout, p.hidden_states.dtype(), I));
        const int64_t up_tasks = (N + up_rows - 1) / up_rows;
#pragma omp parallel for schedule(dynamic)
        for (int64_t task = 0; task < P * up_tasks; ++task) {
          const int64_t i = task / up_tasks, n0 = task % up_tasks * up_rows;
          const int64_t nn = std::min(up_rows, N - n0);
          const int64_t q = local(i);
          const float* xt = x + (q / K) * H;
          float* y = projected + q * N + n0;
          if (ws.codes) {
            cpu::gemv_rows_codes(layout.up_quantized(expert(i)), n0, 1, x_codes(q / K), y, nn, H);
            continue;
          }
          if (layout.quantized) {
            cpu::gemv_rows_quantized(layout.up_quantized(expert(i)), n0, 1, xt, y, nn, H);
            continue;
          }
          const cpu::MatrixView w = layout.up_matrix(expert(i));
          if (layout.is_transposed)
            cpu::gemv_cols(static_cast<const A*>(w.at(n0, 0)), N, xt, y, nn, H);
          else
            cpu::gemv_rows(static_cast<const A*>(w.row(n0)), H, xt, y, nn, H);
        }
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < P; ++i) {
          const int64_t q = local(i);
          float* g = projected + q * N;
          cpu::add_bias(layout.gate_up_bias, expert(i), 0, N, g);
          const int64_t gate_stride = layout.is_concatenated ? 1 : 2;
          cpu::apply_activation(p.config, g + layout.gate_column(0), gate_stride, g + layout.up_column(0), gate_stride,
                                I, hidden + q * I);
          if (ws.codes)
            layout.activations.apply(hidden + q * I, I, ws.hidden_codes + q * I, ws.hidden_scales + q * ws.i_groups);
          else
            layout.activations.apply(hidden + q * I, I);
        }
        // Down projection, then bias.
        const int64_t down_tasks = (H + down_rows - 1) / down_rows;
#pragma omp parallel for schedule(dynamic)
        for (int64_t task = 0; task < P * down_tasks; ++task) {
          const int64_t i = task / down_tasks, h0 = task % down_tasks * down_rows;
          const int64_t hn = std::min(down_rows, H - h0);
          const int64_t q = local(i);
          float* y = down + q * H + h0;
          if (layout.quantized) {
            if (ws.codes)
              cpu::gemv_rows_codes(layout.down_quantized(expert(i)), h0, 1, hidden_codes(q), y, hn, I);
            else
              cpu::gemv_rows_quantized(layout.down_quantized(expert(i)), h0, 1, hidden + q * I, y, hn, I);
            cpu::add_bias(layout.down_bias, expert(i), h0, hn, y);
            continue;
          }
          const cpu::MatrixView w = layout.down_matrix(expert(i));
          if (layout.is_transposed)
            cpu::gemv_cols(static_cast<const A*>(w.at(h0, 0)), H, hidden + q * I, y, hn, I);
          else
            cpu::gemv_rows(static_cast<const A*>(w.row(h0)), I, hidden + q * I, y, hn, I);
          cpu::add_bias(layout.down_bias, expert(i), h0, hn, y);
        }
        cpu::combine_weighted(p, pair_row, down, H, t0, t0 + tb, t0 * K, out);
      }
    });
  }
};

}  // namespace

std::shared_ptr<ExpertsBackend> make_batched_mm() {
  return std::make_shared<BatchedMm>();
}

}  // namespace moekit::backends

// eager on the CPU: the reference-style implementation. Sort the pairs by expert, then loop over the
// experts that were hit and run each one's two projections on all of its tokens with oneDNN (all
// threads inside each product), reading the weights in place. f16 weights are converted to f32 per
// hit expert first, since oneDNN has no f16 product on CPUs without AVX512-FP16; quantised weights are
// dequantised per hit expert the same way (into the gemm dtype), and activations quantised per row.
#include <algorithm>
#include <numeric>

#include "moekit/backends/builtin_backends.h"
#include "moekit/backends/cpu_expert_rows.h"
#include "moekit/backends/portable_backend.h"

namespace moekit::backends {
namespace {

// Weights oneDNN cannot read where they lie: f16 (no f16 product here) and quantised ones.
bool converts_weights(const ExpertsProblem& p) {
  return p.hidden_states.dtype() == DType::f16 || p.config.quantization.quantized();
}

// After the shared row buffers: the first projection's float outputs [rows, N], then (converted weights
// only) the hit expert's weights in the gemm dtype, then one float row of I for the activation.
cpu::RowBuffers eager_buffers(const ExpertsProblem& p) {
  cpu::RowBuffers b(p, 0);
  b.extra_bytes = cpu::RowBuffers::aligned(static_cast<std::size_t>(b.max_rows * b.up_outputs) * sizeof(float));
  if (converts_weights(p))
    b.extra_bytes += cpu::RowBuffers::aligned(
        static_cast<std::size_t>(b.up_outputs * b.hidden + b.hidden * b.intermediate) * cpu::gemm_dtype_size(b.gemm));
  return b;
}

class Eager final : public PortableBackend {
 public:
  Eager() : PortableBackend(MOEKIT_CUDA_KERNELS(eager)) {}
  std::string_view name() const override { return "eager"; }
  std::string_view description() const override {
    return "reference: loop over the hit experts, one product per expert on its tokens";
  }

 protected:
  std::size_t cpu_workspace_bytes(const ExpertsProblem& p) const override { return eager_buffers(p).total(); }
  std::string cpu_kernel_path(const ExpertsProblem& p) const override {
    return converts_weights(p) ? "oneDNN products per hit expert, its weights converted first"
                               : "oneDNN products per hit expert over the weights in place";
  }

  void cpu_forward(const ExpertsProblem& p, Tensor& out, void* workspace) override {
    const cpu::ExpertLayout layout(p);
    const cpu::RowBuffers b = eager_buffers(p);
    const cpu::ExpertRouting routing = cpu::route_by_expert(p.top_k_index, layout.experts);
    const int64_t N = b.up_outputs, H = b.hidden, I = b.intermediate;
    const cpu::GemmDType gemm = b.gemm;
    const bool convert_weights = converts_weights(p);
    char* x = b.x(workspace);
    char* hidden = b.hidden_rows(workspace);
    float* y = b.y(workspace);
    auto* projected = reinterpret_cast<float*>(b.extra(workspace));
    void* converted =
        b.extra(workspace) + cpu::RowBuffers::aligned(static_cast<std::size_t>(b.max_rows * N) * sizeof(float));
    const std::size_t g = cpu::gemm_dtype_size(gemm);

    cpu::gather_rows(p.hidden_states, routing.row_token, gemm, x, layout.activations);
    std::vector<int64_t> all_up(static_cast<std::size_t>(N)), all_down(static_cast<std::size_t>(H));
    std::iota(all_up.begin(), all_up.end(), 0);
    std::iota(all_down.begin(), all_down.end(), 0);
    const DType w_dtype = p.gate_up_proj.dtype();

    for (int64_t e = 0; e < layout.experts; ++e) {
      const int64_t first = routing.offsets[e], rows = routing.rows_of(e);
      if (rows == 0) continue;
      cpu::MatrixView up, down;
      if (convert_weights) {  // rows [N, H] and [H, I] in the gemm dtype
        char* up_rows = static_cast<char*>(converted);
        char* down_rows = up_rows + static_cast<std::size_t>(N * H) * g;
        if (layout.quantized) {
          cpu::gather_weight_rows(layout.up_quantized(e), all_up, H, gemm, up_rows);
          cpu::gather_weight_rows(layout.down_quantized(e), all_down, I, gemm, down_rows);
        } else {
          cpu::gather_weight_rows(layout.up_matrix(e), w_dtype, all_up, H, gemm, up_rows);
          cpu::gather_weight_rows(layout.down_matrix(e), w_dtype, all_down, I, gemm, down_rows);
        }
        up = {up_rows, H, 1, g};
        down = {down_rows, I, 1, g};
      } else {
        up = layout.up_matrix(e);
        down = layout.down_matrix(e);
      }
      float* proj = projected + first * N;
      cpu::matmul_strided(static_cast<const char*>(x) + static_cast<std::size_t>(first * H) * g, H, rows, up.base, H, N,
                          up.stride_in, up.stride_out, gemm, proj, N);
      char* hid = hidden + static_cast<std::size_t>(first * I) * g;
#pragma omp parallel
      {
        std::vector<float> scratch(static_cast<std::size_t>(I));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
          float* g_row = proj + r * N;
          cpu::add_bias(layout.gate_up_bias, e, 0, N, g_row);
          const int64_t stride = layout.is_concatenated ? 1 : 2;
          cpu::activate_into(p.config, g_row + layout.gate_column(0), stride, g_row + layout.up_column(0), stride, I,
                             layout.activations, gemm, hid + static_cast<std::size_t>(r * I) * g, scratch.data());
        }
      }
      float* y_rows = y + first * H;
      cpu::matmul_strided(hid, I, rows, down.base, I, H, down.stride_in, down.stride_out, gemm, y_rows, H);
      if (layout.has_bias)
        for (int64_t r = 0; r < rows; ++r) cpu::add_bias(layout.down_bias, e, 0, H, y_rows + r * H);
    }
    cpu::combine_weighted(p, routing.pair_row, y, H, 0, routing.tokens, 0, out);
  }
};

}  // namespace

std::shared_ptr<ExpertsBackend> make_eager() {
  return std::make_shared<Eager>();
}

}  // namespace moekit::backends

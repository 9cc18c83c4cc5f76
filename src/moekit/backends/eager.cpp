// eager on the CPU: the reference-style implementation. Sort the pairs by expert, then loop over the
// experts that were hit and run each one's two projections on all of its tokens with oneDNN (all
// threads inside each product), reading the weights in place. f16 weights are converted to f32 per
// hit expert first, since oneDNN has no f16 product on CPUs without AVX512-FP16.
#include <algorithm>
#include <numeric>

#include "moekit/backends/builtin_backends.h"
#include "moekit/backends/cpu_expert_rows.h"
#include "moekit/backends/portable_backend.h"
#include "moekit/cpu/activation_math.h"

namespace moekit::backends {
namespace {

struct EagerSizes {
  int64_t max_rows, N, H, I;
  cpu::GemmDType gemm;
  bool convert_weights;
  std::size_t x_bytes, projected_bytes, hidden_bytes, y_bytes, weights_bytes;
  std::size_t total() const { return x_bytes + projected_bytes + hidden_bytes + y_bytes + weights_bytes; }
};

EagerSizes eager_sizes(const ExpertsProblem& p) {
  const ExpertsShape s = validate(p);
  EagerSizes z;
  z.max_rows = s.tokens * s.top_k;
  z.H = s.hidden;
  z.I = s.intermediate;
  z.N = p.config.has_gate ? 2 * s.intermediate : s.intermediate;
  z.gemm = cpu::gemm_dtype_for(p.hidden_states.dtype());
  z.convert_weights = p.hidden_states.dtype() == DType::f16;
  const std::size_t g = cpu::gemm_dtype_size(z.gemm);
  auto round = [](std::size_t b) { return (b + 63) / 64 * 64; };
  z.x_bytes = round(static_cast<std::size_t>(z.max_rows * z.H) * g);
  z.projected_bytes = round(static_cast<std::size_t>(z.max_rows * z.N) * sizeof(float));
  z.hidden_bytes = round(static_cast<std::size_t>(z.max_rows * z.I) * g);
  z.y_bytes = round(static_cast<std::size_t>(z.max_rows * z.H) * sizeof(float));
  z.weights_bytes = z.convert_weights ? round(static_cast<std::size_t>(z.N * z.H + z.H * z.I) * sizeof(float)) : 0;
  return z;
}

class Eager final : public PortableBackend {
 public:
  Eager() : PortableBackend(MOEKIT_CUDA_KERNELS(eager)) {}
  std::string_view name() const override { return "eager"; }
  std::string_view description() const override {
    return "reference: loop over the hit experts, one product per expert on its tokens";
  }

 protected:
  std::size_t cpu_workspace_bytes(const ExpertsProblem& p) const override { return eager_sizes(p).total(); }

  void cpu_forward(const ExpertsProblem& p, Tensor& out, void* workspace) override {
    const cpu::ExpertLayout layout(p);
    const EagerSizes z = eager_sizes(p);
    const cpu::ExpertRouting routing = cpu::route_by_expert(p.top_k_index, layout.experts);
    char* ws = static_cast<char*>(workspace);
    void* x = ws;
    auto* projected = reinterpret_cast<float*>(ws + z.x_bytes);
    char* hidden = ws + z.x_bytes + z.projected_bytes;
    auto* y = reinterpret_cast<float*>(hidden + z.hidden_bytes);
    void* converted = hidden + z.hidden_bytes + z.y_bytes;
    const std::size_t g = cpu::gemm_dtype_size(z.gemm);

    cpu::gather_rows(p.hidden_states, routing.row_token, z.gemm, x);
    std::vector<int64_t> all_up(static_cast<std::size_t>(z.N)), all_down(static_cast<std::size_t>(z.H));
    std::iota(all_up.begin(), all_up.end(), 0);
    std::iota(all_down.begin(), all_down.end(), 0);
    const DType w_dtype = p.gate_up_proj.dtype();

    for (int64_t e = 0; e < layout.experts; ++e) {
      const int64_t first = routing.offsets[e], rows = routing.rows_of(e);
      if (rows == 0) continue;
      cpu::MatrixView up = layout.up_matrix(e), down = layout.down_matrix(e);
      if (z.convert_weights) {  // f16: to f32 rows [N, H] and [H, I]
        auto* up_rows = static_cast<float*>(converted);
        float* down_rows = up_rows + z.N * z.H;
        cpu::gather_weight_rows(up, w_dtype, all_up, z.H, z.gemm, up_rows);
        cpu::gather_weight_rows(down, w_dtype, all_down, z.I, z.gemm, down_rows);
        up = {reinterpret_cast<const char*>(up_rows), z.H, 1, sizeof(float)};
        down = {reinterpret_cast<const char*>(down_rows), z.I, 1, sizeof(float)};
      }
      float* proj = projected + first * z.N;
      cpu::matmul_strided(static_cast<const char*>(x) + static_cast<std::size_t>(first * z.H) * g, z.H, rows, up.base,
                          z.H, z.N, up.stride_in, up.stride_out, z.gemm, proj, z.N);
      char* hid = hidden + static_cast<std::size_t>(first * z.I) * g;
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        float* g_row = proj + r * z.N;
        cpu::add_bias(layout.gate_up_bias, e, 0, z.N, g_row);
        const int64_t stride = layout.is_concatenated ? 1 : 2;
        if (z.gemm == cpu::GemmDType::bf16)
          cpu::apply_activation(p.config, g_row + layout.gate_column(0), stride, g_row + layout.up_column(0), stride,
                                z.I, reinterpret_cast<bf16*>(hid) + r * z.I);
        else
          cpu::apply_activation(p.config, g_row + layout.gate_column(0), stride, g_row + layout.up_column(0), stride,
                                z.I, reinterpret_cast<float*>(hid) + r * z.I);
      }
      float* y_rows = y + first * z.H;
      cpu::matmul_strided(hid, z.I, rows, down.base, z.I, z.H, down.stride_in, down.stride_out, z.gemm, y_rows, z.H);
      if (layout.has_bias)
        for (int64_t r = 0; r < rows; ++r) cpu::add_bias(layout.down_bias, e, 0, z.H, y_rows + r * z.H);
    }
    cpu::combine_weighted(p, routing.pair_row, y, z.H, 0, routing.tokens, 0, out);
  }
};

}  // namespace

std::shared_ptr<ExpertsBackend> make_eager() {
  return std::make_shared<Eager>();
}

}  // namespace moekit::backends

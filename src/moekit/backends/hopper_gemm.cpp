// The Hopper grouped GEMM alone (include/moekit/hopper_gemm.h): the checks at the boundary and the
// hand-over to the kernel layer (src/moekit/cuda/hopper_gemm.h, run by hopper_experts.cu).
#include "moekit/hopper_gemm.h"

#include <cstdint>
#include <string>

#include "moekit/backends/hopper_backend.h"

#if MOEKIT_HAS_CUDA
#include "moekit/cuda/hopper_gemm.h"
#endif

namespace moekit {
namespace {

constexpr const char* kWho = "the Hopper grouped GEMM";
constexpr int64_t kTileRows = 128;  // the contiguous layout's padding unit
constexpr int64_t kScaleBlock = 128;

bool fp8(const GroupedGemmProblem& p) {
  return p.rows.dtype() == DType::f8_e4m3;
}

bool masked(const GroupedGemmProblem& p) {
  return p.masked_m.defined();
}

// The rows as the kernel reads them, [M, K] (masked: G * max_m of them).
int64_t row_count(const GroupedGemmProblem& p) {
  return masked(p) ? p.rows.size(0) * p.rows.size(1) : p.rows.size(0);
}

bool aligned16(const Tensor& t) {
  return (reinterpret_cast<uintptr_t>(t.data()) & 15u) == 0;
}

std::string sizes(const Tensor& t) {
  return t.defined() ? t.describe() : std::string("undefined");
}

bool gated(const GroupedGemmProblem& p) {
  return p.epilogue == GroupedGemmEpilogue::gated || p.epilogue == GroupedGemmEpilogue::gated_e4m3;
}

}  // namespace

Tensor contiguous_tile_offsets(const std::vector<int64_t>& rows_per_group) {
  Tensor offsets = Tensor::empty({static_cast<int64_t>(rows_per_group.size()) + 1}, DType::i32);
  auto* o = offsets.data_as<int32_t>();
  int64_t tiles = 0;
  for (std::size_t g = 0; g < rows_per_group.size(); ++g) {
    MOEKIT_CHECK(rows_per_group[g] >= 0, "group ", g, " has a negative row count ", rows_per_group[g]);
    o[g] = static_cast<int32_t>(tiles);
    tiles += (rows_per_group[g] + kTileRows - 1) / kTileRows;
    MOEKIT_CHECK(tiles * kTileRows <= INT32_MAX, "the groups' rows exceed 2^31");
  }
  o[rows_per_group.size()] = static_cast<int32_t>(tiles);
  return offsets;
}

Support hopper_grouped_gemm_supports_device(Device device) {
  if (device.is_cpu())
    return Support::no(std::string(kWho) + " runs on Hopper GPUs (compute capability 9.0) only, not on the CPU");
  return backends::hopper_cuda_device_support(device, kWho);
}

Support hopper_grouped_gemm_supports(const GroupedGemmProblem& p) {
  const std::string who(kWho);
  if (!p.rows.defined() || !p.weights.defined() || p.tile_offsets.defined() == p.masked_m.defined())
    return Support::no(who +
                       " needs rows, weights and either tile_offsets (the contiguous layout) or masked_m (the "
                       "masked one), not both");
  if (p.epilogue > GroupedGemmEpilogue::activation)
    return Support::no(who + ": unknown epilogue " + std::to_string(static_cast<int>(p.epilogue)) +
                       " (store, gated, gated_e4m3 or activation)");
  if (Support s = hopper_grouped_gemm_supports_device(p.rows.device()); !s) return s;
  const bool q = fp8(p);
  const DType operand = q ? DType::f8_e4m3 : DType::bf16;
  if (p.rows.dtype() != operand || p.weights.dtype() != operand)
    return Support::no(who + " takes bf16 or f8_e4m3 rows and weights of the same dtype, got rows " + sizes(p.rows) +
                       " and weights " + sizes(p.weights));
  const int64_t row_dims = masked(p) ? 3 : 2;
  if (p.rows.dim() != row_dims || p.weights.dim() != 3 || p.rows.size(row_dims - 1) != p.weights.size(2) ||
      (masked(p) && p.rows.size(0) != p.weights.size(0)))
    return Support::no(who + ": rows must be " + (masked(p) ? "[G, max_m, K]" : "[M, K]") +
                       " and weights [G, N, K], got " + sizes(p.rows) + " and " + sizes(p.weights));
  const int64_t M = row_count(p), G = p.weights.size(0), N = p.weights.size(1), K = p.rows.size(row_dims - 1);
  if (masked(p)) {
    const int64_t max_m = p.rows.size(1);
    if (max_m % kTileRows != 0 || max_m == 0 || G == 0)
      return Support::no(who + ": the masked layout needs max_m a positive multiple of 128 and G >= 1, got max_m = " +
                         std::to_string(max_m) + ", G = " + std::to_string(G));
    if (p.masked_m.dtype() != DType::i32 || p.masked_m.shape() != Shape{G})
      return Support::no(who + ": masked_m must be i32 [G] = [" + std::to_string(G) + "], got " + sizes(p.masked_m));
  } else {
    if (M % kTileRows != 0 || M == 0 || G == 0)
      return Support::no(who + ": rows must be a positive multiple of 128 (the padded layout) and G >= 1, got M = " +
                         std::to_string(M) + ", G = " + std::to_string(G));
    if (p.tile_offsets.dtype() != DType::i32 || p.tile_offsets.shape() != Shape{G + 1})
      return Support::no(who + ": tile_offsets must be i32 [G + 1] = [" + std::to_string(G + 1) + "], got " +
                         sizes(p.tile_offsets));
  }
  if (M > INT32_MAX) return Support::no(who + ": more than 2^31 rows (" + std::to_string(M) + ")");
  if (p.epilogue == GroupedGemmEpilogue::gated_e4m3 && !q)
    return Support::no(who +
                       ": the gated_e4m3 epilogue (the FP8 layer's first projection) takes f8_e4m3 rows "
                       "and weights, got " +
                       sizes(p.rows));
  const bool is_gated = gated(p);
  // The copy engine reads whole 16-byte pieces of rows; FP8 runs in whole 128 x 128 scale blocks.
  const int64_t granule = q ? kScaleBlock : 8;
  const int64_t outputs = is_gated ? N / 2 : N;
  if (K % granule != 0 || N % granule != 0 || (is_gated && (N % 2 != 0 || outputs % granule != 0)))
    return Support::no(who + ": K and N" + (is_gated ? " (and N / 2, gated)" : "") + " must be multiples of " +
                       std::to_string(granule) + " with " + std::string(dtype_name(operand)) +
                       " operands, got K = " + std::to_string(K) + ", N = " + std::to_string(N));
  if (q) {
    if (!p.row_scales.defined() || p.row_scales.dtype() != DType::f32 ||
        p.row_scales.shape() != Shape{K / kScaleBlock, M})
      return Support::no(who + ": FP8 row_scales must be f32 [K / 128, M] = [" + std::to_string(K / kScaleBlock) +
                         ", " + std::to_string(M) + "], got " + sizes(p.row_scales));
    if (!p.weight_scales.defined() ||
        (p.weight_scales.dtype() != DType::f32 && p.weight_scales.dtype() != DType::ue8m0) ||
        p.weight_scales.shape() != Shape{G, N / kScaleBlock, K / kScaleBlock})
      return Support::no(who + ": FP8 weight_scales must be f32 or ue8m0 [G, N / 128, K / 128], got " +
                         sizes(p.weight_scales));
  } else if (p.row_scales.defined() || p.weight_scales.defined()) {
    return Support::no(who + ": bf16 operands take no scales");
  }
  for (const Tensor* t : {&p.rows, &p.row_scales, &p.weights, &p.weight_scales, &p.tile_offsets, &p.masked_m}) {
    if (!t->defined()) continue;
    if (t->device() != p.rows.device() || !t->is_contiguous() || !aligned16(*t))
      return Support::no(who + " needs every tensor contiguous, 16-byte aligned and on " +
                         device_name(p.rows.device()) + ", got " + t->describe());
  }
  return Support::yes();
}

Shape grouped_gemm_out_shape(const GroupedGemmProblem& p) {
  const int64_t N = p.weights.size(1);
  const int64_t outputs = gated(p) ? N / 2 : N;
  if (masked(p)) return {p.rows.size(0), p.rows.size(1), outputs};
  return {p.rows.size(0), outputs};
}

DType grouped_gemm_out_dtype(const GroupedGemmProblem& p) {
  if (p.epilogue == GroupedGemmEpilogue::gated_e4m3) return DType::f8_e4m3;
  // FP8's gated and activation rows stay float, as the layer's do before it quantises them.
  const bool activated = p.epilogue == GroupedGemmEpilogue::gated || p.epilogue == GroupedGemmEpilogue::activation;
  return fp8(p) && activated ? DType::f32 : DType::bf16;
}

Shape grouped_gemm_out_scales_shape(const GroupedGemmProblem& p) {
  return {p.weights.size(1) / 2 / kScaleBlock, row_count(p)};
}

void hopper_grouped_gemm(const GroupedGemmProblem& p, Tensor& out, Stream stream) {
  MOEKIT_CHECK(p.epilogue != GroupedGemmEpilogue::gated_e4m3, kWho,
               ": the gated_e4m3 epilogue writes scales too: call hopper_grouped_gemm(p, out, out_scales, stream)");
  Tensor no_scales;
  hopper_grouped_gemm(p, out, no_scales, stream);
}

void hopper_grouped_gemm(const GroupedGemmProblem& p, Tensor& out, Tensor& out_scales, Stream stream) {
  if (const Support s = hopper_grouped_gemm_supports(p); !s) MOEKIT_FAIL(s.reason);
  MOEKIT_CHECK(out.defined() && out.shape() == grouped_gemm_out_shape(p) && out.dtype() == grouped_gemm_out_dtype(p) &&
                   out.device() == p.rows.device() && out.is_contiguous() && aligned16(out),
               kWho, ": out must be a contiguous, 16-byte aligned ", dtype_name(grouped_gemm_out_dtype(p)), " ",
               shape_string(grouped_gemm_out_shape(p)), " on ", device_name(p.rows.device()), ", got ", sizes(out));
  const bool quantized_out = p.epilogue == GroupedGemmEpilogue::gated_e4m3;
  if (quantized_out)
    MOEKIT_CHECK(out_scales.defined() && out_scales.shape() == grouped_gemm_out_scales_shape(p) &&
                     out_scales.dtype() == DType::f32 && out_scales.device() == p.rows.device() &&
                     out_scales.is_contiguous(),
                 kWho, ": out_scales of the gated_e4m3 epilogue must be a contiguous f32 ",
                 shape_string(grouped_gemm_out_scales_shape(p)), " on ", device_name(p.rows.device()), ", got ",
                 sizes(out_scales));
#if MOEKIT_HAS_CUDA
  cuda::HopperGemmArgs g;
  g.groups = p.weights.size(0);
  g.n = p.weights.size(1);
  g.k = p.weights.size(2);
  g.max_tiles = row_count(p) / kTileRows;
  if (masked(p)) {
    g.masked_m = p.masked_m.data_as<int32_t>();
    g.max_m = p.rows.size(1);
  } else {
    g.tile_offsets = p.tile_offsets.data_as<int32_t>();
  }
  g.fp8 = fp8(p);
  g.ue8m0_scales = g.fp8 && p.weight_scales.dtype() == DType::ue8m0;
  g.rows = p.rows.data();
  g.row_scales = g.fp8 ? p.row_scales.data_as<float>() : nullptr;
  g.weights = p.weights.data();
  g.weight_scales = g.fp8 ? p.weight_scales.data() : nullptr;
  g.epilogue = p.epilogue;
  g.out = out.data();
  g.out_scales = quantized_out ? out_scales.data_as<float>() : nullptr;
  cuda::hopper_grouped_gemm(g, backends::cuda_stream(stream));
#else
  (void)stream;  // unreachable: the device check refuses every device in a build without CUDA
#endif
}

}  // namespace moekit

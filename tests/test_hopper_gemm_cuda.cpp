// The Hopper grouped GEMM alone (include/moekit/hopper_gemm.h) against a float64 product on the host of
// the very operand values it reads (bf16, or e4m3 codes times their scales), on a small shape with
// several groups, row counts that are not multiples of 128 (padding inside tiles), an empty group and
// a column block of N that is only partly inside; in the contiguous layout and in the masked one (one
// group's masked_m past max_m, which counts as max_m); and 80 groups of which four have rows (tile lookups that
// walk many empty groups). Needs a compute capability 9.0 GPU; skips elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/device.h"
#include "moekit/hopper_gemm.h"
#include "moekit/testing/random_problem.h"

namespace moekit {
namespace {

struct GemmCase {
  const char* name;
  bool fp8;
  DType scale_dtype;  // FP8 weight scales
  GroupedGemmEpilogue epilogue;
  bool masked = false;  // the masked layout [G, max_m, K] instead of the contiguous one
  // FP8 gated: gated_e4m3 on the same operands too, whose codes and scales must be bit for bit what
  // quantize_activations makes of gated's f32 rows.
  bool also_e4m3 = false;
  // K: 384 is 6 (bf16) or 3 (FP8) pipeline stages, so the stage ring wraps around within a tile; 1,152 is deep
  // enough (>= 1,024) for the contiguous layout's tiles to run in clusters of two blocks sharing weight tiles.
  int64_t depth = 384;
  // 80 groups, four of them with rows, far apart (0, 37, 71, 79): a block's first lookup of a tile's group walks
  // more than 32 groups (expert_of_from_warp's second load of starts) past empty ones.
  bool sparse = false;
};

class HopperGroupedGemmCuda : public ::testing::TestWithParam<GemmCase> {};

// The host operands as the values the products use, row-major: rows [M, K] and weights [G, N, K].
struct HostOperands {
  std::vector<double> rows, weights;
};

TEST_P(HopperGroupedGemmCuda, MatchesFloat64Product) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  if (const Support s = hopper_grouped_gemm_supports_device(Device::cuda()); !s) GTEST_SKIP() << s.reason;
  const GemmCase c = GetParam();
  const Device gpu = Device::cuda();
  // N = 384 leaves the second 256-wide column block partly outside (bf16 and FP8 store; bf16 gated: 192 outputs);
  // FP8's gated outputs must fill whole 128 scale blocks, so N = 512 there.
  // Masked: max_m = 384, and the last group's 400 rows count as its 384.
  std::vector<int64_t> rows_per_group =
      c.masked ? std::vector<int64_t>{100, 0, 257, 128, 400} : std::vector<int64_t>{100, 0, 257, 128, 1};
  if (c.sparse) {
    rows_per_group.assign(80, 0);
    rows_per_group[0] = 1, rows_per_group[37] = 130, rows_per_group[71] = 300, rows_per_group[79] = 5;
  }
  const auto G = static_cast<int64_t>(rows_per_group.size());
  const bool gated = c.epilogue == GroupedGemmEpilogue::gated;
  const int64_t N = c.fp8 && gated ? 512 : 384, K = c.depth, max_m = 384;
  const Tensor offsets = contiguous_tile_offsets(rows_per_group);
  const int32_t* o = offsets.data_as<int32_t>();
  const int64_t M = c.masked ? G * max_m : int64_t{o[G]} * 128;
  // Group g's row r is row first_row(g) + r of the row matrix and of out (as [M, ...]).
  auto first_row = [&](int64_t g) { return c.masked ? g * max_m : int64_t{o[g]} * 128; };
  auto own_rows = [&](int64_t g) {
    const int64_t m = rows_per_group[static_cast<std::size_t>(g)];
    return c.masked ? std::min(m, max_m) : m;
  };

  Tensor w = Tensor::empty({G, N, K}, DType::f32), x = Tensor::empty({M, K}, DType::f32);
  fill_uniform(w, 1.0f / std::sqrt(static_cast<float>(K)), 31);
  // Each 128 x 128 block of a group's weights times its own power of two, so that FP8's block scales differ by 2x
  // to 8x from their neighbours': a tile column that took a neighbouring block's scale (a 256-wide tile's halves take
  // one block each; the last tile's second half, past N, takes none) is off by a factor of 2 or more.
  vary_block_magnitudes(w);
  fill_uniform(x, 1.0f, 32);
  GroupedGemmProblem p;
  p.epilogue = c.epilogue;
  if (c.masked) {
    Tensor masked_m = Tensor::empty({G}, DType::i32);
    for (int64_t g = 0; g < G; ++g)
      masked_m.data_as<int32_t>()[g] = static_cast<int32_t>(rows_per_group[static_cast<std::size_t>(g)]);
    p.masked_m = masked_m.to(gpu);
  } else {
    p.tile_offsets = offsets.to(gpu);
  }
  HostOperands h;
  h.rows.resize(static_cast<std::size_t>(M * K));
  h.weights.resize(static_cast<std::size_t>(G * N * K));
  if (!c.fp8) {
    const Tensor wb = w.to(DType::bf16), xb = x.to(DType::bf16);
    for (std::size_t i = 0; i < h.weights.size(); ++i) h.weights[i] = to_float(wb.data_as<bf16>()[i]);
    for (std::size_t i = 0; i < h.rows.size(); ++i) h.rows[i] = to_float(xb.data_as<bf16>()[i]);
    p.rows = xb.to(gpu);
    p.weights = wb.to(gpu);
  } else {
    const QuantizedWeights q = quantize_weights(w, WeightFormat::fp8_e4m3, c.scale_dtype);
    const Tensor dequantized = dequantize_weights(q.weights, q.scale_inv);
    for (std::size_t i = 0; i < h.weights.size(); ++i) h.weights[i] = dequantized.data_as<float>()[i];
    const int64_t blocks = K / 128;
    Tensor codes = Tensor::empty({M, K}, DType::f8_e4m3), row_scales = Tensor::empty({blocks, M}, DType::f32);
    std::vector<float> values(static_cast<std::size_t>(K)), scales(static_cast<std::size_t>(blocks));
    for (int64_t r = 0; r < M; ++r) {
      quantize_activations(x.data_as<float>() + r * K, K, c.scale_dtype == DType::ue8m0, values.data(),
                           codes.data_as<f8_e4m3>() + r * K, scales.data());
      for (int64_t k = 0; k < K; ++k) h.rows[static_cast<std::size_t>(r * K + k)] = values[static_cast<std::size_t>(k)];
      for (int64_t b = 0; b < blocks; ++b) row_scales.data_as<float>()[b * M + r] = scales[static_cast<std::size_t>(b)];
    }
    p.rows = codes.to(gpu);
    p.row_scales = row_scales.to(gpu);
    p.weights = q.weights.to(gpu);
    p.weight_scales = q.scale_inv.to(gpu);
  }
  if (c.masked) p.rows = p.rows.reshape({G, max_m, K});
  const Support support = hopper_grouped_gemm_supports(p);
  ASSERT_TRUE(support.ok) << support.reason;

  Tensor out = Tensor::empty(grouped_gemm_out_shape(p), grouped_gemm_out_dtype(p), gpu);
  out.fill_bytes(0xFF);  // NaN in bf16 and f32: a row the kernel does not write fails
  DeviceStream stream(gpu, /*ordered_with_default=*/true);  // after the poison, queued on the default stream
  hopper_grouped_gemm(p, out, stream.stream());
  stream.synchronize();
  const Tensor got = out.to(Device::cpu()).to(DType::f32);
  const int64_t outputs = gated ? N / 2 : N;
  // Per row, so that one wrong group shows: bf16 outputs round to 2^-9 relative (about 1.1e-3 in a row's
  // norm), float ones carry only the float accumulation and (FP8) the tensor cores' reduced-precision sums
  // within each 128-deep block.
  const double tolerance = grouped_gemm_out_dtype(p) == DType::bf16 ? 4e-3 : 1e-3;
  std::vector<double> product(static_cast<std::size_t>(N));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < own_rows(g); ++r) {
      const int64_t row = first_row(g) + r;
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0;
        for (int64_t k = 0; k < K; ++k)
          sum +=
              h.rows[static_cast<std::size_t>(row * K + k)] * h.weights[static_cast<std::size_t>((g * N + n) * K + k)];
        product[static_cast<std::size_t>(n)] = sum;
      }
      double err = 0, norm = 0;
      bool finite = true;
      for (int64_t j = 0; j < outputs; ++j) {
        double want = product[static_cast<std::size_t>(j)];
        if (gated) {
          const double up = product[static_cast<std::size_t>(outputs + j)];
          want = want / (1.0 + std::exp(-want)) * up;
        } else if (c.epilogue == GroupedGemmEpilogue::activation) {
          want = want / (1.0 + std::exp(-want));
        }
        const double have = got.data_as<float>()[row * outputs + j];
        finite = finite && std::isfinite(have);
        err += (have - want) * (have - want);
        norm += want * want;
      }
      ASSERT_TRUE(finite) << "group " << g << " row " << r << " (padded row " << row << ") has a non-finite output";
      EXPECT_LE(std::sqrt(err / norm), tolerance) << "group " << g << " row " << r << " (padded row " << row << ")";
    }
  }
  if (!c.also_e4m3) return;

  GroupedGemmProblem pq = p;
  pq.epilogue = GroupedGemmEpilogue::gated_e4m3;
  ASSERT_TRUE(hopper_grouped_gemm_supports(pq).ok) << hopper_grouped_gemm_supports(pq).reason;
  ASSERT_EQ(grouped_gemm_out_shape(pq), grouped_gemm_out_shape(p));
  Tensor codes = Tensor::empty(grouped_gemm_out_shape(pq), grouped_gemm_out_dtype(pq), gpu);
  Tensor scales = Tensor::empty(grouped_gemm_out_scales_shape(pq), DType::f32, gpu);
  codes.fill_bytes(0x7F);   // e4m3 NaN, which no finite row quantises to
  scales.fill_bytes(0xFF);  // NaN
  hopper_grouped_gemm(pq, codes, scales, stream.stream());
  stream.synchronize();
  const Tensor got_codes = codes.to(Device::cpu()), got_scales = scales.to(Device::cpu());
  const int64_t blocks = outputs / 128, scale_rows = got_scales.size(1);
  ASSERT_EQ(scale_rows, M);
  std::vector<float> values(static_cast<std::size_t>(outputs)), want_scales(static_cast<std::size_t>(blocks));
  std::vector<f8_e4m3> want_codes(static_cast<std::size_t>(outputs));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < own_rows(g); ++r) {
      const int64_t row = first_row(g) + r;
      quantize_activations(got.data_as<float>() + row * outputs, outputs, c.scale_dtype == DType::ue8m0, values.data(),
                           want_codes.data(), want_scales.data());
      for (int64_t j = 0; j < outputs; ++j) {
        const uint8_t have = got_codes.data_as<f8_e4m3>()[row * outputs + j].bits;
        ASSERT_EQ(have, want_codes[static_cast<std::size_t>(j)].bits)
            << "code " << j << " of group " << g << " row " << r << " (padded row " << row << ")";
      }
      for (int64_t b = 0; b < blocks; ++b)
        ASSERT_EQ(got_scales.data_as<float>()[b * scale_rows + row], want_scales[static_cast<std::size_t>(b)])
            << "scale " << b << " of group " << g << " row " << r << " (padded row " << row << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, HopperGroupedGemmCuda,
    ::testing::Values(
        GemmCase{"bf16_store", false, DType::f32, GroupedGemmEpilogue::store},
        GemmCase{"bf16_gated", false, DType::f32, GroupedGemmEpilogue::gated},
        GemmCase{"fp8_store", true, DType::f32, GroupedGemmEpilogue::store},
        GemmCase{"fp8_ue8m0_store", true, DType::ue8m0, GroupedGemmEpilogue::store},
        GemmCase{"fp8_gated", true, DType::f32, GroupedGemmEpilogue::gated, false, true},
        GemmCase{"bf16_activation", false, DType::f32, GroupedGemmEpilogue::activation},
        GemmCase{"fp8_activation", true, DType::f32, GroupedGemmEpilogue::activation},
        GemmCase{"masked_fp8_ue8m0_activation", true, DType::ue8m0, GroupedGemmEpilogue::activation, true},
        GemmCase{"masked_bf16_store", false, DType::f32, GroupedGemmEpilogue::store, true},
        GemmCase{"masked_bf16_gated", false, DType::f32, GroupedGemmEpilogue::gated, true},
        GemmCase{"masked_fp8_store", true, DType::f32, GroupedGemmEpilogue::store, true},
        GemmCase{"masked_fp8_ue8m0_gated", true, DType::ue8m0, GroupedGemmEpilogue::gated, true, true},
        GemmCase{"deep_bf16_store", false, DType::f32, GroupedGemmEpilogue::store, false, false, 1152},
        GemmCase{"deep_bf16_gated", false, DType::f32, GroupedGemmEpilogue::gated, false, false, 1152},
        GemmCase{"deep_fp8_store", true, DType::f32, GroupedGemmEpilogue::store, false, false, 1152},
        GemmCase{"deep_fp8_gated", true, DType::f32, GroupedGemmEpilogue::gated, false, true, 1152},
        GemmCase{"sparse_bf16_store", false, DType::f32, GroupedGemmEpilogue::store, false, false, 384, true},
        GemmCase{"sparse_fp8_gated", true, DType::f32, GroupedGemmEpilogue::gated, false, true, 384, true},
        GemmCase{"deep_sparse_fp8_store", true, DType::f32, GroupedGemmEpilogue::store, false, false, 1152, true}),
    [](const ::testing::TestParamInfo<GemmCase>& c) { return std::string(c.param.name); });

// The boundary checks answer before any work, with the reason (no GPU needed: a CPU tensor is refused
// for its device, and a malformed problem on a Hopper GPU for its shapes).
TEST(HopperGroupedGemm, RefusesTheCpuWithTheReason) {
  GroupedGemmProblem p;
  p.rows = Tensor::zeros({128, 128}, DType::bf16);
  p.weights = Tensor::zeros({1, 128, 128}, DType::bf16);
  p.tile_offsets = contiguous_tile_offsets({128});
  const Support s = hopper_grouped_gemm_supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("compute capability 9.0"), std::string::npos) << s.reason;
  Tensor out = Tensor::empty({128, 128}, DType::bf16);
  EXPECT_THROW(hopper_grouped_gemm(p, out, Stream{}), Error);
}

// gated_e4m3 writes scales as well as codes: the call without out_scales says so, before any device check.
TEST(HopperGroupedGemm, QuantizingEpilogueNeedsTheScalesOverload) {
  GroupedGemmProblem p;
  p.rows = Tensor::zeros({128, 128}, DType::f8_e4m3);
  p.weights = Tensor::zeros({1, 256, 128}, DType::f8_e4m3);
  p.tile_offsets = contiguous_tile_offsets({128});
  p.epilogue = GroupedGemmEpilogue::gated_e4m3;
  EXPECT_EQ(grouped_gemm_out_dtype(p), DType::f8_e4m3);
  EXPECT_EQ(grouped_gemm_out_scales_shape(p), (Shape{1, 128}));
  Tensor out = Tensor::empty({128, 128}, DType::f8_e4m3);
  EXPECT_TRUE(test::throws_error_with([&] { hopper_grouped_gemm(p, out, Stream{}); }, {"out_scales"}));
}

// A problem names its layout by exactly one of tile_offsets (contiguous) and masked_m (masked); the
// check says so before it looks at the device.
TEST(HopperGroupedGemm, RefusesBothLayoutsOrNeither) {
  GroupedGemmProblem p;
  p.rows = Tensor::zeros({1, 128, 128}, DType::bf16);
  p.weights = Tensor::zeros({1, 128, 128}, DType::bf16);
  for (const bool both : {true, false}) {
    p.tile_offsets = both ? contiguous_tile_offsets({128}) : Tensor();
    p.masked_m = both ? Tensor::zeros({1}, DType::i32) : Tensor();
    const Support s = hopper_grouped_gemm_supports(p);
    EXPECT_FALSE(s.ok);
    EXPECT_NE(s.reason.find("either tile_offsets"), std::string::npos) << s.reason;
  }
}

TEST(HopperGroupedGemm, TileOffsetsPadEachGroupTo128Rows) {
  const Tensor offsets = contiguous_tile_offsets({100, 0, 257, 128, 1});
  const std::vector<int32_t> want{0, 1, 1, 4, 5, 6};
  ASSERT_EQ(offsets.shape(), Shape{6});
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(offsets.data_as<int32_t>()[i], want[i]) << i;
}

}  // namespace
}  // namespace moekit

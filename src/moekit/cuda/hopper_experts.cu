// The Hopper experts backends on CUDA (sm_90a, bf16/f16), both on the grouped GEMM of
// sm90_grouped_gemm.cuh over DeepGEMM's contiguous layout (every expert's rows start at a multiple
// of 128, so a row tile never straddles two experts):
//   deepgemm: route on the device (128-row tiles); copy each routed token row into its padded row;
//             first projection (TMA A, activation fused); second projection (bias fused, rows in the
//             activation dtype, as transformers' grouped_mm rounds them); weighted combine.
//   sonicmoe: the same routing, but no copied rows: the first projection's producer gathers the token
//             rows straight into shared memory; the second projection's epilogue applies the routing
//             weight; the combine adds the k rows of each token in order.
// deepgemm also runs FP8 e4m3 weights with 128 x 128 block scales (f32 or ue8m0) when H and I are
// multiples of 128: each token's row is quantised once per 1 x 128 group, and its codes and scales are
// copied to its padded rows (the scales stored K-block-major, [H / 128, rows], for the copy engine); the
// gated first GEMM quantises the activated intermediate the same way in its epilogue (an ungated one writes it in
// float, and a pass quantises it), and the second GEMM reads it in e4m3; the GEMMs apply the scales per 128-deep
// block (tile widths: kTileN in sm90_projection.cuh).
// The combine is launch_combine_rows' (pairs added in k order, in float), so results are deterministic.
// Both projections go through run_projection (sm90_projection.h), which hopper_grouped_gemm (hopper_gemm.h) also
// calls to run one of these GEMMs alone.
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "moekit/cuda/batched_mm_quantized_tensor_core.h"
#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/fp8_math.cuh"
#include "moekit/cuda/grouped_gemm.cuh"
#include "moekit/cuda/hopper_gemm.h"
#include "moekit/cuda/sm90_gemm_layout.cuh"
#include "moekit/cuda/sm90_projection.h"
#include "moekit/cuda/tensor_map.h"
#include "moekit/kernel_options.h"

namespace moekit::cuda {

namespace hopper {

bool clusters_enabled() {
  return kernel_options().hopper_clusters;
}

bool idle_padding_enabled() {
  return kernel_options().hopper_idle_padding;
}

}  // namespace hopper

namespace {

using hopper::Epilogue;
using hopper::GemmProjection;
using hopper::kBlockM;
using hopper::run_projection;

std::size_t align256(std::size_t b) {
  return (b + 255) / 256 * 256;
}

// Row tiles of the padded layout in the worst case: every expert's last tile partly filled.
int64_t max_row_tiles(const ExpertsArgs& a) {
  const int64_t P = a.tokens * a.top_k;
  return (P + kBlockM - 1) / kBlockM + std::min(a.experts, P);
}

enum class Variant : uint8_t { deepgemm, sonicmoe };

struct Layout {
  // rows: the placed token rows (deepgemm; e4m3 with FP8), row_scales: their FP8 scales [H / 128, M];
  // hidden: the intermediate (T, or float with FP8); hidden_q / hidden_scales: its e4m3 copy (FP8);
  std::size_t pair_row, padded_pair, rows, row_scales, hidden, hidden_q, hidden_scales, y, total;
};

Layout layout(const ExpertsArgs& a, Variant v) {
  const auto P = static_cast<std::size_t>(a.tokens * a.top_k);
  const auto M = static_cast<std::size_t>(max_row_tiles(a) * kBlockM);
  const auto H = static_cast<std::size_t>(a.hidden), I = static_cast<std::size_t>(a.intermediate);
  const std::size_t e = dtype_size(a.dtype);
  Layout l;
  l.pair_row = align256(routing_workspace_bytes(static_cast<int64_t>(P), a.experts));
  l.padded_pair = l.pair_row + align256(P * 4);
  l.rows = l.padded_pair + align256(M * 4);
  l.row_scales = l.rows + (v == Variant::sonicmoe ? 0 : align256(M * H * (a.fp8() ? 1 : e)));
  l.hidden = l.row_scales + (a.fp8() ? align256((H / 128) * M * 4) : 0);
  // FP8: float rows for the quantising pass, except gated, whose first projection writes the codes itself.
  l.hidden_q = l.hidden + (a.fp8() && a.has_gate ? 0 : align256(M * I * (a.fp8() ? 4 : e)));
  l.hidden_scales = l.hidden_q + (a.fp8() ? align256(M * I) : 0);
  l.y = l.hidden_scales + (a.fp8() ? align256((I / 128) * M * 4) : 0);
  l.total = l.y + align256(M * H * e);
  return l;
}

// One warp quantises one 128-wide group of a row as quantize_activations does: codes into q (128
// bytes) and the group's scale (what the products multiply by) into *scale.
template <typename S>
__device__ __forceinline__ void quantize_group(const S* v, bool power_of_two, uint8_t* q, float* scale, int lane) {
  float x[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = to_f(v[lane * 4 + i]);
  const float s = quantize_group_lanes(x, power_of_two);
  uint32_t codes = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)  // x[i] is exactly an e4m3 value: the conversion only encodes it
    codes |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3)) << (8 * i);
  reinterpret_cast<uint32_t*>(q)[lane] = codes;
  if (lane == 0) *scale = s;
}

// FP8: rows [rows, width] (the token rows in bf16/f16, or the first GEMM's float intermediate)
// quantised per 128-wide group as quantize_activations does, one warp per group: codes [rows, width],
// scales K-block-major [width / 128, scale_rows]. With tile_offsets, `rows` is a host-known bound and
// only the rows of the tiles that exist are quantised (padding rows too, harmlessly). grid.y covers the
// groups of a row in blocks of up to 8 warps and grid.x strides over the rows: no 64-bit division per group.
template <typename S>
__global__ void quantize_rows_kernel(const S* v, int64_t width, int64_t rows, const int32_t* tile_offsets,
                                     int64_t experts, bool power_of_two, uint8_t* q, float* scales,
                                     int64_t scale_rows) {
  if (tile_offsets) rows = min(rows, int64_t{tile_offsets[experts]} * kBlockM);
  const int64_t g = int64_t{blockIdx.y} * (blockDim.x / 32) + threadIdx.x / 32;
  if (g >= width / 128) return;
  const int lane = threadIdx.x % 32;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x)
    quantize_group(v + row * width + g * 128, power_of_two, q + row * width + g * 128, scales + g * scale_rows + row,
                   lane);
}

template <typename S>
void quantize_rows(const S* v, int64_t width, int64_t rows, const int32_t* tile_offsets, int64_t experts,
                   bool power_of_two, uint8_t* q, float* scales, int64_t scale_rows, cudaStream_t stream) {
  const int64_t groups = std::max<int64_t>(1, width / 128);
  const int64_t warps = std::min<int64_t>(8, groups);  // a block's warps: consecutive groups of one row
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(rows, 1, 65535)),
                  static_cast<unsigned>((groups + warps - 1) / warps));
  quantize_rows_kernel<S><<<grid, static_cast<unsigned>(warps * 32), 0, stream>>>(v, width, rows, tile_offsets, experts,
                                                                                  power_of_two, q, scales, scale_rows);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

constexpr int kPlaceThreads = 256;  // place_tokens_kernel's and place_pairs_kernel's block

// The padded row of pair `pair`, -1 for a sentinel or invalid id: its expert is its id (valid whenever the pair has
// a sorted row), so two rounds of loads, not a search of the expert offsets.
__device__ __forceinline__ int64_t padded_row_of(const ExpertsArgs& a, const DeviceRouting& r, int64_t pair) {
  const int32_t row = r.pair_row[pair];
  const int64_t e = load_id(a, pair);  // loaded beside the row: out of range only where row < 0
  if (row < 0) return -1;
  return int64_t{r.tile_offsets[e]} * kBlockM + (row - r.offsets[e]);
}

// Where each pair lands in the padded layout, with no rows to write (sonicmoe gathers them in its first
// projection): a thread a pair. place_tokens_kernel, a block a token, kept 8 of 256 threads busy for sonicmoe's
// 8 pairs a token and took 32 us at 24,576 tokens on the H200.
__global__ void __launch_bounds__(kPlaceThreads)
    place_pairs_kernel(const ExpertsArgs a, const DeviceRouting r, int32_t* pair_padded_row, int32_t* padded_pair) {
  const int64_t P = a.tokens * a.top_k;
  for (int64_t pair = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; pair < P;
       pair += int64_t{gridDim.x} * blockDim.x) {
    const int64_t p = padded_row_of(a, r, pair);
    pair_padded_row[pair] = static_cast<int32_t>(p);
    if (p >= 0) padded_pair[p] = static_cast<int32_t>(pair);
  }
}

// Where each pair lands in the padded layout, and (deepgemm) its row there, a token at a time: records each
// of the token's pairs' padded row (pair_padded_row, -1 for a sentinel or invalid id, and padded_pair of that
// row), then writes the token's row, read once, into all of its padded rows: the bf16/f16 hidden state, or
// with FP8 its e4m3 codes and scales (K-block-major, [H / 128, M]), quantised here as quantize_activations
// does. One block a token (grid.x strides over them) writes the whole row: 16-byte pieces a thread, kChunk of
// them at a time so that as many loads are in flight, or (FP8) 16 values a lane, 8 lanes a 128-wide group. Reading each
// token once, not once per pair, and no quantised copy of x in between: DeepSeek-V3 at 16,384 tokens read x (235 MB) 8
// times. With FP8 and rows of fewer than kPlaceGroups groups a block takes `tokens_at_once` tokens
// (place_tokens_at_once), so that all its warps quantise: a token a block left half of them idle at H = 2,048.
// A token's pairs are recorded kPlacePairsAtOnce at a time (one pass when its top_k is at most that).
constexpr int kPlaceWarps = kPlaceThreads / 32, kPlaceGroups = kPlaceWarps * 4, kPlacePairs = kPlaceThreads,
              kPlacePairsAtOnce = 32;

// Tokens a block of place_tokens_kernel takes: 1, or with FP8 as many as fill its kPlaceGroups groups (their pairs
// at most kPlacePairs, recorded in one pass).
int place_tokens_at_once(const ExpertsArgs& a, bool fp8) {
  const int64_t groups = a.hidden / 128;
  if (!fp8 || groups >= kPlaceGroups || a.top_k > kPlacePairsAtOnce) return 1;
  return static_cast<int>(
      std::max<int64_t>(1, std::min(kPlaceGroups / std::max<int64_t>(groups, 1), kPlacePairs / a.top_k)));
}

template <typename S, bool kFp8>
__global__ void __launch_bounds__(kPlaceThreads)
    place_tokens_kernel(const ExpertsArgs a, const DeviceRouting r, int32_t* pair_padded_row, int32_t* padded_pair,
                        void* rows, float* row_scales, int64_t M, int tokens_at_once) {
  constexpr int kChunk = 4;
  static_assert(!kFp8 || sizeof(S) == 2, "FP8 rows are read as four 2-byte values a lane (8 bytes)");
  __shared__ int64_t padded[kPlacePairs];
  const int64_t K = a.top_k;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row_bytes = kFp8 ? a.hidden : a.hidden * int64_t{sizeof(S)};
  const int64_t units = kFp8 ? a.hidden / 128 : row_bytes / 16;  // groups (FP8) or 16-byte pieces
  for (int64_t t0 = blockIdx.x * int64_t{tokens_at_once}; t0 < a.tokens; t0 += int64_t{gridDim.x} * tokens_at_once) {
    // This round's tokens; when more than 1, their pairs take one pass (top_k <= kPlacePairsAtOnce).
    const int64_t tokens = min(int64_t{tokens_at_once}, a.tokens - t0);
    for (int64_t k0 = 0; k0 < K; k0 += kPlacePairsAtOnce) {
      const int64_t n = min(int64_t{kPlacePairsAtOnce}, K - k0);
      if (threadIdx.x < tokens * n) {  // entry tk * n + j: pair k0 + j of token t0 + tk
        const int64_t pair = (t0 + threadIdx.x / n) * K + k0 + threadIdx.x % n;
        const int64_t p = padded_row_of(a, r, pair);
        padded[threadIdx.x] = p;
        pair_padded_row[pair] = static_cast<int32_t>(p);
        if (p >= 0) padded_pair[p] = static_cast<int32_t>(pair);
      }
      __syncthreads();
      uint8_t* const out = static_cast<uint8_t*>(rows);
      if constexpr (kFp8) {
        // 16 values a lane, so a group is 8 lanes and a warp takes 4 groups: lane `lane` of warp `warp` holds
        // values 16 (lane % 8) .. + 15 of item 4 warp + lane / 8 (+ kPlaceGroups per pass), item tk * units + g
        // being group g of token t0 + tk, written as one 16-byte store of codes (a 4-byte store a lane wrote each
        // row's 128 bytes in four times the instructions).
        const int64_t items = tokens * units;
        for (int64_t i0 = 0; i0 < items; i0 += kPlaceGroups) {
          const int64_t item = i0 + 4 * warp + lane / 8, tk = item / units, g = item % units, t = t0 + tk;
          const bool in_row = item < items;  // not warp-uniform: every lane still quantises (zeros past the row)
          const int64_t* const token_padded = padded + tk * n;
          uint4 raw[2] = {};
          if (in_row) {
            const auto* src =
                reinterpret_cast<const uint4*>(static_cast<const S*>(a.x) + t * a.hidden + g * 128 + (lane % 8) * 16);
            raw[0] = __ldg(src);
            raw[1] = __ldg(src + 1);
          }
          float x[16];
          const S* v = reinterpret_cast<const S*>(raw);
#pragma unroll
          for (int i = 0; i < 16; ++i) x[i] = to_f(v[i]);
          const float scale = quantize_group_values<16, 8>(x, a.ue8m0_scales);
          uint32_t codes[4] = {};
#pragma unroll
          for (int i = 0; i < 16; ++i)  // x[i] is exactly an e4m3 value: the conversion only encodes it
            codes[i / 4] |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3))
                            << (8 * (i % 4));
          const uint4 packed = make_uint4(codes[0], codes[1], codes[2], codes[3]);
          if (in_row)
            for (int64_t j = 0; j < n; ++j) {
              const int64_t p = token_padded[j];
              if (p < 0) continue;
              reinterpret_cast<uint4*>(out + p * row_bytes + g * 128)[lane % 8] = packed;
              if (lane % 8 == 0) row_scales[g * M + p] = scale;
            }
        }
      } else {  // tokens_at_once is 1
        const int64_t t = t0;
        for (int64_t v0 = threadIdx.x; v0 < units; v0 += int64_t{kPlaceThreads} * kChunk) {
          uint4 value[kChunk];
#pragma unroll
          for (int c = 0; c < kChunk; ++c) {
            const int64_t v = v0 + int64_t{kPlaceThreads} * c;
            value[c] = v < units
                           ? __ldg(reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.x) + t * row_bytes) + v)
                           : uint4{};
          }
          for (int64_t j = 0; j < n; ++j) {
            const int64_t p = padded[j];
            if (p < 0) continue;
#pragma unroll
            for (int c = 0; c < kChunk; ++c) {
              const int64_t v = v0 + int64_t{kPlaceThreads} * c;
              if (v < units) reinterpret_cast<uint4*>(out + p * row_bytes)[v] = value[c];
            }
          }
        }
      }
      __syncthreads();  // padded is rewritten next
    }
  }
}

// The masked layout's tile offsets [G + 1]: the tiles of group g's first masked_m[g] rows (clamped to
// [0, max_m]), 128 rows each. One block, as routing's offsets_kernel.
__global__ void __launch_bounds__(kScanThreads)
    masked_tile_offsets_kernel(const int32_t* masked_m, int64_t groups, int64_t max_m, int32_t* tile_offsets) {
  block_exclusive_sums(
      groups,
      [&](int64_t g) {
        const int64_t m = min(max(static_cast<int64_t>(masked_m[g]), int64_t{0}), max_m);
        return make_int2(0, static_cast<int32_t>((m + kBlockM - 1) / kBlockM));
      },
      [&](int64_t g, int2 before) { tile_offsets[g] = before.y; });
}

template <typename T, bool kFp8>
void forward_typed(const ExpertsArgs& a, void* workspace, Variant v, cudaStream_t stream) {
  const bool gather = v == Variant::sonicmoe;
  const Layout l = layout(a, v);
  char* base = static_cast<char*>(workspace);
  DeviceRouting r;
  route_on_device(a, kBlockM, base, r, stream);
  const int64_t P = a.tokens * a.top_k, max_tiles = max_row_tiles(a), M = max_tiles * kBlockM;
  auto* pair_padded_row = reinterpret_cast<int32_t*>(base + l.pair_row);
  auto* padded_pair = reinterpret_cast<int32_t*>(base + l.padded_pair);
  void* rows = gather ? nullptr : base + l.rows;
  auto* row_scales = reinterpret_cast<float*>(base + l.row_scales);
  void* hidden = base + l.hidden;
  auto* hidden_q = reinterpret_cast<uint8_t*>(base + l.hidden_q);
  auto* hidden_scales = reinterpret_cast<float*>(base + l.hidden_scales);
  void* y = base + l.y;
  if (P > 0) {
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(padded_pair, 0xFF, static_cast<std::size_t>(M) * 4, stream));  // -1: padding
    if (rows) {
      const int at_once = place_tokens_at_once(a, kFp8);
      place_tokens_kernel<T, kFp8>
          <<<static_cast<unsigned>(std::min<int64_t>((a.tokens + at_once - 1) / at_once, 65535)), kPlaceThreads, 0,
             stream>>>(a, r, pair_padded_row, padded_pair, rows, row_scales, M, at_once);
    } else {
      place_pairs_kernel<<<static_cast<unsigned>(std::min<int64_t>((P + kPlaceThreads - 1) / kPlaceThreads, 65535)),
                           kPlaceThreads, 0, stream>>>(a, r, pair_padded_row, padded_pair);
    }
    MOEKIT_CUDA_CHECK_LAUNCH();

    // FP8 gated: the first projection writes the intermediate's e4m3 codes and scales itself.
    const bool quantized_up = kFp8 && a.has_gate;
    const GemmProjection up{.rows = rows,
                            .row_scales = row_scales,
                            .depth = a.hidden,
                            .weights = a.up,
                            .weight_scales = a.up_scale,
                            .part_rows = a.intermediate,
                            .parts = a.has_gate ? 2 : 1,
                            .interleaved = a.has_gate && !a.concatenated,
                            .outputs = a.intermediate,
                            .out = quantized_up ? static_cast<void*>(hidden_q) : hidden,
                            .out_scales = quantized_up ? hidden_scales : nullptr,
                            .save_z = a.save_z,
                            .save_z_offsets = r.offsets};
    auto launch_up = [&]<Epilogue kEpi>() {
      if constexpr (!kFp8)
        if (gather) return run_projection<T, kEpi, true, false>(a, r.tile_offsets, padded_pair, max_tiles, up, stream);
      run_projection<T, kEpi, false, kFp8>(a, r.tile_offsets, padded_pair, max_tiles, up, stream);
    };
    if (!a.has_gate)
      launch_up.template operator()<Epilogue::activation>();
    else if constexpr (kFp8)
      launch_up.template operator()<Epilogue::gated_e4m3>();
    else
      launch_up.template operator()<Epilogue::gated>();

    const void* down_rows = hidden;
    const float* down_scales = nullptr;
    if constexpr (kFp8) {
      if (!quantized_up)
        quantize_rows(static_cast<const float*>(hidden), a.intermediate, M, r.tile_offsets, a.experts, a.ue8m0_scales,
                      hidden_q, hidden_scales, M, stream);
      down_rows = hidden_q;
      down_scales = hidden_scales;
    }
    const GemmProjection down{.rows = down_rows,
                              .row_scales = down_scales,
                              .depth = a.intermediate,
                              .weights = a.down,
                              .weight_scales = a.down_scale,
                              .part_rows = a.hidden,
                              .outputs = a.hidden,
                              .out = y,
                              .weighted = gather};  // sonicmoe weights its rows here, deepgemm in the combine
    run_projection<T, Epilogue::store, false, kFp8>(a, r.tile_offsets, padded_pair, max_tiles, down, stream);
  }
  launch_combine_rows(a, pair_padded_row, y, false, /*weighted=*/!gather, stream);
}

// The workspace of the path forward takes: batched_mm's at decode sizes (unless z is kept), the padded layout's
// otherwise.
std::size_t workspace_bytes(const ExpertsArgs& a, Variant v) {
  return !a.save_z && hopper_decode_streams(a) ? batched_mm_workspace_bytes(a) : layout(a, v).total;
}

void forward(const ExpertsArgs& a, void* workspace, Variant v, cudaStream_t stream) {
  const char* name = v == Variant::sonicmoe ? "sonicmoe" : "deepgemm";
  MOEKIT_CHECK(a.dtype == DType::bf16 || a.dtype == DType::f16, name, ": activations must be bf16 or f16, not ",
               dtype_name(a.dtype));
  MOEKIT_CHECK(hopper_gemm_runs(a) && !(a.fp8() && v == Variant::sonicmoe), name,
               ": problem outside the supported set (checked by the backend's supports())");
  MOEKIT_CHECK(!a.save_z || !a.fp8(), name, ": a forward that keeps z for the backward needs unquantised weights");
  if (!a.save_z && hopper_decode_streams(a)) return batched_mm_forward(a, workspace, stream);
  if (a.dtype == DType::bf16)
    a.fp8() ? forward_typed<bf16, true>(a, workspace, v, stream) : forward_typed<bf16, false>(a, workspace, v, stream);
  else
    a.fp8() ? forward_typed<f16, true>(a, workspace, v, stream) : forward_typed<f16, false>(a, workspace, v, stream);
}

}  // namespace

bool hopper_gemm_runs(const ExpertsArgs& a) {
  const int64_t granule = a.fp8() ? 128 : 8;  // FP8: whole scale blocks; otherwise 16-byte rows
  return !a.fp4() && (a.dtype == DType::bf16 || a.dtype == DType::f16) && !a.transposed && a.hidden % granule == 0 &&
         a.intermediate % granule == 0 && !hopper_alignment_refusal(a) && device_is_sm90();
}

std::size_t hopper_saved_z_bytes(const ExpertsArgs& a) {
  const int64_t N = a.has_gate ? 2 * a.intermediate : a.intermediate;
  return static_cast<std::size_t>(a.tokens * a.top_k * N) * sizeof(float);
}

bool hopper_decode_streams(const ExpertsArgs& a) {
  const bool allowed = kernel_options().hopper_decode_streaming;
  const int64_t pairs = a.tokens * a.top_k;
  const int64_t limit = a.fp8() ? 256 : 128, per_expert = a.fp8() ? 2 : 1;
  if (!allowed || pairs == 0 || pairs > limit || pairs > per_expert * a.experts) return false;
  return !a.fp8() || batched_mm_quantized_tensor_core_runs(a);
}

namespace {

// The grouped GEMMs of a Hopper forward: the operands, and each projection's cluster size.
std::string hopper_gemm_text(const ExpertsArgs& a, Variant v) {
  const int64_t stage_k = a.fp8() ? hopper::kStageK<true> : hopper::kStageK<false>;
  auto rounded = [&](int64_t k) { return (k + stage_k - 1) / stage_k * stage_k; };
  const int up = hopper::cluster_blocks(rounded(a.hidden), false),
            down = hopper::cluster_blocks(rounded(a.intermediate), false);
  std::string text = "Hopper TMA + wgmma grouped GEMM (";
  text += a.fp8() ? "e4m3 codes with 128 x 128 block scales" : std::string(dtype_name(a.dtype));
  text += v == Variant::sonicmoe ? "; token rows gathered into shared memory" : "; token rows copied to padded rows";
  text += "), clusters of " + std::to_string(up) + " (up) / " + std::to_string(down) + " (down)";
  return text;
}

std::string hopper_kernel_path(const ExpertsArgs& a, Variant v) {
  if (hopper_decode_streams(a)) return "decode size: " + batched_mm_kernel_path(a);
  return hopper_gemm_text(a, v);
}

}  // namespace

std::string deepgemm_kernel_path(const ExpertsArgs& a) {
  return hopper_kernel_path(a, Variant::deepgemm);
}

std::string sonicmoe_kernel_path(const ExpertsArgs& a) {
  return hopper_kernel_path(a, Variant::sonicmoe);
}

std::size_t deepgemm_workspace_bytes(const ExpertsArgs& a) {
  return workspace_bytes(a, Variant::deepgemm);
}

void deepgemm_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  forward(a, workspace, Variant::deepgemm, stream);
}

std::size_t sonicmoe_workspace_bytes(const ExpertsArgs& a) {
  return workspace_bytes(a, Variant::sonicmoe);
}

void sonicmoe_forward(const ExpertsArgs& a, void* workspace, cudaStream_t stream) {
  forward(a, workspace, Variant::sonicmoe, stream);
}

void hopper_grouped_gemm(const HopperGemmArgs& g, cudaStream_t stream) {
  const bool quantized_out = g.epilogue == Epilogue::gated_e4m3;
  const bool gated = g.epilogue == Epilogue::gated || quantized_out;
  MOEKIT_CHECK(!quantized_out || (g.fp8 && g.out_scales),
               "the Hopper grouped GEMM: gated_e4m3 needs FP8 operands and out_scales");
  // What the kernel reads of an experts call: the sizes its epilogues and scale lookups use, the
  // activation and the scale format; no biases, routing or gathered rows.
  ExpertsArgs a;
  a.dtype = DType::bf16;
  a.experts = g.groups;
  // The first projection's shape (gated, activation) or the second's (store).
  const bool first = gated || g.epilogue == Epilogue::activation;
  a.hidden = first ? g.k : g.n;
  a.intermediate = gated ? g.n / 2 : first ? g.n : g.k;
  a.has_gate = g.epilogue != Epilogue::activation;  // activation: act(x), ungated
  a.act = Act::silu;
  a.weights = g.fp8 ? WeightFormat::fp8_e4m3 : WeightFormat::none;
  a.ue8m0_scales = g.ue8m0_scales;
  const int parts = gated ? 2 : 1;
  const GemmProjection j{.rows = g.rows,
                         .row_scales = g.row_scales,
                         .depth = g.k,
                         .weights = g.weights,
                         .weight_scales = g.weight_scales,
                         .part_rows = g.n / parts,
                         .parts = parts,
                         .outputs = g.n / parts,
                         .out = g.out,
                         .out_scales = g.out_scales,
                         .masked_m = g.masked_m,
                         .masked_rows = g.masked_m ? g.max_m : 0};
  // The masked layout: its tile offsets made here from masked_m, in stream-ordered memory (so the call
  // stays free of host synchronisation and capturable in a graph).
  int32_t* masked_offsets = nullptr;
  if (g.masked_m) {
    MOEKIT_CHECK(g.max_m > 0 && g.max_m % kBlockM == 0 && g.max_tiles * kBlockM == g.groups * g.max_m,
                 "the Hopper grouped GEMM: the masked layout needs max_m a positive multiple of 128 and max_tiles = G "
                 "* max_m / 128");
    MOEKIT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&masked_offsets),
                                      static_cast<std::size_t>(g.groups + 1) * sizeof(int32_t), stream));
    masked_tile_offsets_kernel<<<1, kScanThreads, 0, stream>>>(g.masked_m, g.groups, g.max_m, masked_offsets);
    MOEKIT_CUDA_CHECK_LAUNCH();
  }
  const int32_t* tile_offsets = g.masked_m ? masked_offsets : g.tile_offsets;
  // The same instantiations as the layer's: store is its second projection, gated (gated_e4m3 with FP8) its first,
  // activation an ungated first projection's.
  auto run = [&]<Epilogue kEpi, bool kFp8>() {
    run_projection<bf16, kEpi, false, kFp8>(a, tile_offsets, nullptr, g.max_tiles, j, stream);
  };
  auto run_format = [&]<Epilogue kEpi>() {
    g.fp8 ? run.template operator()<kEpi, true>() : run.template operator()<kEpi, false>();
  };
  switch (g.epilogue) {
    case Epilogue::store:
      run_format.template operator()<Epilogue::store>();
      break;
    case Epilogue::gated:
      run_format.template operator()<Epilogue::gated>();
      break;
    case Epilogue::gated_e4m3:
      run.template operator()<Epilogue::gated_e4m3, true>();
      break;
    case Epilogue::activation:
      run_format.template operator()<Epilogue::activation>();
      break;
    default:
      MOEKIT_FAIL("the Hopper grouped GEMM: unknown epilogue ", static_cast<int>(g.epilogue));
  }
  if (masked_offsets) MOEKIT_CUDA_CHECK(cudaFreeAsync(masked_offsets, stream));
}

}  // namespace moekit::cuda

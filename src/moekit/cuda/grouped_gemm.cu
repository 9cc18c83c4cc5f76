// Kernels of the grouped products: a tensor-core kernel (mma.sync, bf16/f16, cp.async pipeline,
// row gather fused into the operand load) for the weight layout [E, N, K] with K a multiple of 8,
// and a CUDA-core kernel for everything else (f32, which must stay exact; transposed weights; odd
// sizes). Both share the routing's tile schedule and the epilogues of grouped_gemm.cuh.
// Quantised weights (FP8, FP4) have a tensor-core kernel of their own for rows of a multiple of 16
// bytes (the CUDA-core kernel takes the rest): bf16 operands, exact for e4m3 activation codes and for
// the weight codes, and the scales applied in float per 128-deep block of K (see mma_quantized_kernel).
#include <algorithm>
#include <type_traits>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/grouped_gemm.cuh"
#include "moekit/cuda/mma_sync.cuh"
#include "moekit/cuda/tensor_map.h"

namespace moekit::cuda {
namespace {

// ---- CUDA-core kernel: 64 x 64 tiles, 16-deep k steps, 256 threads of 4 x 4 outputs. ----
constexpr int kSimtCols = 64, kSimtDepth = 16;

// Element k of a left row: the value itself, or a quantised row's code times its group's scale.
template <typename T>
__device__ __forceinline__ float left_at(const T* row, int64_t k) {
  return to_f(row[k]);
}
__device__ __forceinline__ float left_at(const CodesRow& row, int64_t k) {
  return to_f(row.codes[k]) * row.scales[k / 128];
}

// F: the weights' format (WeightFormat::none: T like the activations, in either layout).
template <typename T, Projection P, WeightFormat F>
__global__ void __launch_bounds__(256) simt_kernel(const GroupedProblem g) {
  constexpr bool kQuantized = F != WeightFormat::none;
  using LeftRow = std::conditional_t<kQuantized, CodesRow, const T*>;
  using Q = QuantizedFormat<kQuantized ? F : WeightFormat::fp8_e4m3>;  // used only when quantised
  __shared__ float a_tile[kSimtDepth][kTileRows + 4];
  __shared__ float b_tile[kSimtDepth][kSimtCols + 4];
  __shared__ float c_tile[kTileRows][kSimtCols + 1];
  int64_t expert, row_begin, row_end;
  if (!find_tile(g, expert, row_begin, row_end, kTileRows)) return;
  const ExpertsArgs& a = g.a;
  const int64_t K = ProjectionShape<P>::reduction(a), N = ProjectionShape<P>::outputs(a);
  const void* weights = P == Projection::up ? a.up : a.down;
  const void* scales = P == Projection::up ? a.up_scale : a.down_scale;
  const T* w = static_cast<const T*>(weights) + expert * N * K;
  const int64_t row_bytes = K / Q::kValuesPerByte;  // quantised rows
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  // Per thread: the 4 left rows and 4 weight rows it loads (fixed over k).
  LeftRow a_rows[4] = {};
  bool a_present[4];
  int64_t w_rows[4], w_scale_rows[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int i = tid + q * 256;  // element of the 64 x 16 tile, k fastest
    const int64_t row = row_begin + i / kSimtDepth;
    a_present[q] = row < row_end;
    if constexpr (kQuantized) {
      if (a_present[q]) a_rows[q] = quantized_left_row<P>(g, row);
    } else {
      if (a_present[q]) a_rows[q] = left_row<T, P>(g, row);
    }
    w_rows[q] = tile_output<P>(a, block_col(g), i / kSimtDepth, kSimtCols);
    if constexpr (kQuantized) w_scale_rows[q] = Q::scale_row(expert, w_rows[q] < 0 ? 0 : w_rows[q], N, K);
  }
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kSimtDepth) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = tid + q * 256, r = i / kSimtDepth, kk = i % kSimtDepth;
      const int64_t k = k0 + kk;
      a_tile[kk][r] = (a_present[q] && k < K) ? left_at(a_rows[q], k) : 0.0f;
      float wv = 0.0f;
      if (w_rows[q] >= 0 && k < K) {
        if constexpr (kQuantized) {
          const uint8_t* row = static_cast<const uint8_t*>(weights) + (expert * N + w_rows[q]) * row_bytes;
          wv = Q::code(row, k) * block_scale_at(a, scales, w_scale_rows[q] + k / Q::kBlockK);
        } else {
          wv = to_f(a.transposed ? w[k * N + w_rows[q]] : w[w_rows[q] * K + k]);
        }
      }
      b_tile[kk][r] = wv;
    }
    __syncthreads();
    simt_tile_step(acc, a_tile, b_tile, ty, tx);
    __syncthreads();
  }
  simt_store_tile(acc, c_tile, ty, tx);
  __syncthreads();
  store_tile<T, P, kTileRows, kSimtCols>(g, &c_tile[0][0], kSimtCols + 1, expert, row_begin, row_end, block_col(g));
}

// ---- Tensor-core kernel: 64 x 256 tiles, 32-deep k steps, 8 warps of 32 x 64, 4-stage cp.async. ----
// Wide tiles: each left row loaded is used against 256 weight rows, which the 64-row tiles of the
// shared schedule (short experts waste little) would otherwise lack.
constexpr int kMmaCols = 256, kMmaDepth = 32, kStages = 4, kMmaThreads = 256;
constexpr int kPitch = kMmaDepth + 8;  // 80-byte rows: ldmatrix's eight 16-byte reads hit distinct banks
constexpr int kStageElems = (kTileRows + kMmaCols) * kPitch;
constexpr int kCPitch = kMmaCols + 4;
constexpr std::size_t kMmaSmem =
    std::max<std::size_t>(kStages * kStageElems * 2, static_cast<std::size_t>(kTileRows) * kCPitch * 4);

using mma::ldmatrix_x4;
using mma::mma16816;

// One kMmaDepth-deep step of a warp's 32 x 64 piece of the tile (rows 32 * warp_m, columns 64 * warp_n):
// a [kTileRows][kPitch] and b [kMmaCols][kPitch] in shared memory, k contiguous.
template <typename O>
__device__ __forceinline__ void warp_tile_step(float (&acc)[2][8][4], const O* sa, const O* sb, int warp_m, int warp_n,
                                               int lane) {
#pragma unroll
  for (int kk = 0; kk < kMmaDepth; kk += 16) {
    uint32_t af[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
      ldmatrix_x4(af[mt], sa + (warp_m * 32 + mt * 16 + lane % 16) * kPitch + kk + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < 4; ++np) {  // pairs of 8-column tiles
      uint32_t bf[4];
      ldmatrix_x4(bf, sb + (warp_n * 64 + np * 16 + lane % 8 + (lane / 16) * 8) * kPitch + kk + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma16816<O>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
        mma16816<O>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
      }
    }
  }
}

// Tile row and column of accumulator element i of acc[mt][nt] (the m16n8 C fragment layout).
__device__ __forceinline__ int fragment_row(int warp_m, int mt, int lane, int i) {
  return warp_m * 32 + mt * 16 + lane / 4 + (i / 2) * 8;
}
__device__ __forceinline__ int fragment_col(int warp_n, int nt, int lane, int i) {
  return warp_n * 64 + nt * 8 + (lane % 4) * 2 + i % 2;
}

// The accumulators into c [kTileRows][kCPitch] (shared memory) for the shared epilogue.
__device__ __forceinline__ void store_accumulators(float* c, const float (&acc)[2][8][4], int warp_m, int warp_n,
                                                   int lane) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        c[fragment_row(warp_m, mt, lane, i) * kCPitch + fragment_col(warp_n, nt, lane, i)] = acc[mt][nt][i];
}

// After the k loop: the accumulators to shared memory (over the pipeline buffers), then the shared
// epilogue.
template <typename T, Projection P>
__device__ __forceinline__ void write_tile(const GroupedProblem& g, unsigned char* smem, const float (&acc)[2][8][4],
                                           int warp_m, int warp_n, int lane, int64_t expert, int64_t row_begin,
                                           int64_t row_end) {
  float* c = reinterpret_cast<float*>(smem);
  store_accumulators(c, acc, warp_m, warp_n, lane);
  __syncthreads();
  store_tile<T, P, kTileRows, kMmaCols>(g, c, kCPitch, expert, row_begin, row_end, block_col(g));
}

template <typename T, Projection P>
__global__ void __launch_bounds__(kMmaThreads) mma_kernel(const GroupedProblem g) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  int64_t expert, row_begin, row_end;
  if (!find_tile(g, expert, row_begin, row_end, kTileRows)) return;
  const ExpertsArgs& a = g.a;
  const int64_t K = ProjectionShape<P>::reduction(a), N = ProjectionShape<P>::outputs(a);
  const T* w = static_cast<const T*>(P == Projection::up ? a.up : a.down) + expert * N * K;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // Loads: 64 left rows and 256 weight rows of 4 x 16-byte chunks each per stage; a thread owns
  // 1 left chunk and 4 weight chunks, with their row pointers fixed over k.
  constexpr int kLeftChunks = kTileRows * 4 / kMmaThreads, kWeightChunks = kMmaCols * 4 / kMmaThreads;
  const T* a_src[kLeftChunks];
  const T* b_src[kWeightChunks];
#pragma unroll
  for (int q = 0; q < kLeftChunks; ++q) {
    const int i = tid + q * kMmaThreads, r = i / 4;
    const int64_t row = row_begin + r;
    a_src[q] = row < row_end ? left_row<T, P>(g, row) + (i % 4) * 8 : nullptr;
  }
#pragma unroll
  for (int q = 0; q < kWeightChunks; ++q) {
    const int i = tid + q * kMmaThreads, c = i / 4;
    const int64_t out = tile_output<P>(a, block_col(g), c, kMmaCols);
    b_src[q] = out >= 0 ? w + out * K + (i % 4) * 8 : nullptr;
  }
  const int64_t k_steps = (K + kMmaDepth - 1) / kMmaDepth;
  auto load_stage = [&](int64_t step, int stage) {
    T* sa = smem + stage * kStageElems;
    T* sb = sa + kTileRows * kPitch;
    const int64_t k0 = step * kMmaDepth;
#pragma unroll
    for (int q = 0; q < kLeftChunks; ++q) {
      const int i = tid + q * kMmaThreads;
      const bool ok = a_src[q] && k0 + (i % 4) * 8 < K;
      cp_async16(sa + (i / 4) * kPitch + (i % 4) * 8, ok ? a_src[q] + k0 : static_cast<const T*>(a.x), ok);
    }
#pragma unroll
    for (int q = 0; q < kWeightChunks; ++q) {
      const int i = tid + q * kMmaThreads;
      const bool ok = b_src[q] && k0 + (i % 4) * 8 < K;
      cp_async16(sb + (i / 4) * kPitch + (i % 4) * 8, ok ? b_src[q] + k0 : w, ok);
    }
  };

  const int warp_m = warp / 4, warp_n = warp % 4;  // warp tile: rows 32*warp_m, cols 64*warp_n
  float acc[2][8][4] = {};
  mma::pipelined_steps<kStages>(k_steps, load_stage, [&](int64_t, int stage) {
    const T* sa = smem + stage * kStageElems;
    warp_tile_step<T>(acc, sa, sa + kTileRows * kPitch, warp_m, warp_n, lane);
  });
  write_tile<T, P>(g, smem_raw, acc, warp_m, warp_n, lane, expert, row_begin, row_end);
}

// ---- Tensor-core kernel of quantised weights: the tiles, warps and pipeline above, bf16 operands. ----
// Per stage: the left rows' e4m3 codes (exact in bf16) and the raw weight bytes of the tile's 256 rows
// (32 FP8 codes or 32 FP4 codes a row). Each step, thread i converts weight row i of the stage into a
// shared bf16 tile: e4m3 codes as they are (their block scale is not exact in bf16), e2m1 codes times
// their ue8m0 scale (a power of two: exact, and per 32 values, one step). The products of each 128-deep
// block of K (one activation group, one FP8 scale block) accumulate apart and are added in float times
// the row's activation scale (and, FP8, the column's block scale): no scale is ever rounded to bf16.
// Bytes of a raw weight row in a stage (FP8: 32 codes + 16 bytes against bank conflicts; FP4: 32 codes),
// of a stage (left codes, then raw weight rows) and of the kernel's shared memory (the stages, the
// converted weights, the row and column scales; the epilogue's tile over them).
constexpr int raw_pitch(WeightFormat f) {
  return f == WeightFormat::fp8_e4m3 ? 48 : 16;
}
constexpr int quantized_stage_bytes(WeightFormat f) {
  return kTileRows * kPitch * 2 + kMmaCols * raw_pitch(f);
}
constexpr std::size_t quantized_smem_bytes(WeightFormat f) {
  return std::max<std::size_t>(kStages * quantized_stage_bytes(f) + kMmaCols * kPitch * 2 + (kTileRows + kMmaCols) * 4,
                               static_cast<std::size_t>(kTileRows) * kCPitch * 4);
}
constexpr int kStepsPerGroup = 128 / kMmaDepth;  // steps of one 128-deep block of K

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // exact here: the values have few significant bits
  return *reinterpret_cast<const uint32_t*>(&v);
}

// raw (raw_pitch(F) bytes) of one weight row at one step -> dst [32] bf16 (scale: the row's FP4 scale of the step).
template <WeightFormat F>
__device__ __forceinline__ void convert_weight_row(const uint8_t* raw, float scale, bf16* dst) {
  uint32_t out[16];
  if constexpr (F == WeightFormat::fp8_e4m3) {
    const uint4 r0 = *reinterpret_cast<const uint4*>(raw), r1 = *reinterpret_cast<const uint4*>(raw + 16);
    const uint32_t w[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
#pragma unroll
    for (int i = 0; i < 16; ++i)
      out[i] = pack_bf16x2(e4m3_code_to_f(w[i / 2] >> (16 * (i % 2))), e4m3_code_to_f(w[i / 2] >> (16 * (i % 2) + 8)));
  } else {
    uint32_t w[4];
    words_of(*reinterpret_cast<const uint4*>(raw), w);
#pragma unroll
    for (int i = 0; i < 16; ++i)
      out[i] = pack_bf16x2(e2m1_code_to_f(w[i / 4] >> (8 * (i % 4))) * scale,
                           e2m1_code_to_f(w[i / 4] >> (8 * (i % 4) + 4)) * scale);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    reinterpret_cast<uint4*>(dst)[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
}

// Rows of a multiple of 16 bytes (FP8: K % 16 == 0; FP4: K % 32 == 0), 16-byte aligned weights (the
// launcher checks).
template <typename T, Projection P, WeightFormat F>
__global__ void __launch_bounds__(kMmaThreads) mma_quantized_kernel(const GroupedProblem g) {
  using Q = QuantizedFormat<F>;
  static_assert(kTileRows * 4 == kMmaThreads && kMmaCols == kMmaThreads, "one left chunk and one weight row a thread");
  static_assert(Q::kBlockK % kMmaDepth == 0, "a step lies in one scale block");
  static_assert(F != WeightFormat::fp8_e4m3 || Q::kBlockK == kMmaDepth * kStepsPerGroup,
                "FP8 scale blocks are the activation groups");
  constexpr int kRawBytes = kMmaDepth / Q::kValuesPerByte;  // weight bytes of a row per step
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int64_t expert, row_begin, row_end;
  if (!find_tile(g, expert, row_begin, row_end, kTileRows)) return;
  const ExpertsArgs& a = g.a;
  const int64_t K = ProjectionShape<P>::reduction(a), N = ProjectionShape<P>::outputs(a);
  const int64_t row_bytes = K / Q::kValuesPerByte;
  const uint8_t* w = static_cast<const uint8_t*>(P == Projection::up ? a.up : a.down) + expert * N * row_bytes;
  const void* scales = P == Projection::up ? a.up_scale : a.down_scale;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  bf16* converted = reinterpret_cast<bf16*>(smem_raw + kStages * quantized_stage_bytes(F));
  float* row_scale = reinterpret_cast<float*>(converted + kMmaCols * kPitch);  // [kTileRows] of the current block
  float* col_scale = row_scale + kTileRows;                                    // [kMmaCols], FP8

  // Thread tid loads left chunk tid (8 codes of row tid / 4) and weight row tid of the tile, converts that
  // weight row and, tid < kTileRows, supplies row tid's activation scales.
  const int64_t a_row = row_begin + tid / 4;
  const bf16* a_src = a_row < row_end ? quantized_left_row<P>(g, a_row).codes + (tid % 4) * 8 : nullptr;
  const float* my_row_scales = nullptr;
  if (tid < kTileRows && row_begin + tid < row_end) my_row_scales = quantized_left_row<P>(g, row_begin + tid).scales;
  const int64_t out = tile_output<P>(a, block_col(g), tid, kMmaCols);
  const uint8_t* w_row = out >= 0 ? w + out * row_bytes : nullptr;
  const int64_t w_scale_row = Q::scale_row(expert, out < 0 ? 0 : out, N, K);

  auto stage_left = [&](int stage) { return reinterpret_cast<bf16*>(smem_raw + stage * quantized_stage_bytes(F)); };
  auto stage_raw = [&](int stage) { return smem_raw + stage * quantized_stage_bytes(F) + kTileRows * kPitch * 2; };
  const int64_t k_steps = (K + kMmaDepth - 1) / kMmaDepth;
  auto load_stage = [&](int64_t step, int stage) {
    const int64_t k0 = step * kMmaDepth;
    // Codes rows hold whole 128-wide groups (zeros past K), so every step's chunk lies inside the row.
    cp_async16(stage_left(stage) + (tid / 4) * kPitch + (tid % 4) * 8, a_src ? a_src + k0 : static_cast<const void*>(w),
               a_src != nullptr);
#pragma unroll
    for (int c = 0; c < kRawBytes / 16; ++c) {
      const int64_t byte = k0 / Q::kValuesPerByte + c * 16;
      const bool ok = w_row && byte < row_bytes;  // rows of whole 16-byte chunks
      cp_async16(stage_raw(stage) + tid * raw_pitch(F) + c * 16, ok ? w_row + byte : w, ok);
    }
  };

  // Scales are read a block (activations, FP8 weights) or a step (FP4 weights) ahead of their use, so that
  // their latency hides behind the work in between.
  auto weight_scale = [&](int64_t i) { return w_row ? block_scale_at(a, scales, w_scale_row + i) : 0.0f; };
  auto activation_scale = [&](int64_t group) { return my_row_scales ? my_row_scales[group] : 0.0f; };
  const int64_t groups = (k_steps + kStepsPerGroup - 1) / kStepsPerGroup;
  float next_row_scale = activation_scale(0);
  float next_col_scale = F == WeightFormat::fp8_e4m3 ? weight_scale(0) : 0.0f;
  float next_step_scale = F == WeightFormat::fp4_e2m1 ? weight_scale(0) : 0.0f;

  const int warp_m = warp / 4, warp_n = warp % 4;  // warp tile: rows 32*warp_m, cols 64*warp_n
  float acc[2][8][4] = {}, block_acc[2][8][4] = {};
  // Each step begins after every warp is done with the previous one's converted tile and scales.
  mma::pipelined_steps<kStages>(k_steps, load_stage, [&](int64_t step, int stage) {
    if (step % kStepsPerGroup == 0) {  // a new 128-deep block: its scales
      if (tid < kTileRows) row_scale[tid] = next_row_scale;
      if constexpr (F == WeightFormat::fp8_e4m3) col_scale[tid] = next_col_scale;
      const int64_t next_group = step / kStepsPerGroup + 1;
      if (next_group < groups) {
        next_row_scale = activation_scale(next_group);
        if constexpr (F == WeightFormat::fp8_e4m3) next_col_scale = weight_scale(next_group);
      }
    }
    const float step_scale = next_step_scale;
    if (F == WeightFormat::fp4_e2m1 && step + 1 < k_steps) next_step_scale = weight_scale(step + 1);
    convert_weight_row<F>(stage_raw(stage) + tid * raw_pitch(F), step_scale, converted + tid * kPitch);
    __syncthreads();
    warp_tile_step<bf16>(block_acc, stage_left(stage), converted, warp_m, warp_n, lane);
    if (step % kStepsPerGroup == kStepsPerGroup - 1 || step == k_steps - 1) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float scale = row_scale[fragment_row(warp_m, mt, lane, i)];
            if constexpr (F == WeightFormat::fp8_e4m3) scale *= col_scale[fragment_col(warp_n, nt, lane, i)];
            acc[mt][nt][i] = fmaf(block_acc[mt][nt][i], scale, acc[mt][nt][i]);
            block_acc[mt][nt][i] = 0.0f;
          }
    }
  });
  write_tile<T, P>(g, smem_raw, acc, warp_m, warp_n, lane, expert, row_begin, row_end);
}

// One-dimensional grid of row tiles x column blocks (column block fastest, see block_col).
unsigned grid_blocks(int64_t row_tiles, int64_t col_blocks) {
  MOEKIT_CHECK(row_tiles * col_blocks <= 0x7fffffff, "grouped_mm: too many tiles for one launch (", row_tiles, " x ",
               col_blocks, ")");
  return static_cast<unsigned>(row_tiles * col_blocks);
}

template <typename T, Projection P, WeightFormat F>
void launch_quantized(const GroupedProblem& g, int64_t max_tiles, cudaStream_t stream) {
  const ExpertsArgs& a = g.a;
  MOEKIT_CHECK(!a.transposed, "grouped products: quantised weights must not be transposed (validated earlier)");
  const int64_t K = P == Projection::up ? a.hidden : a.intermediate;
  GroupedProblem launched = g;
  if (K % kValuesPer16Bytes<F> == 0 && aligned16(P == Projection::up ? a.up : a.down)) {
    launched.col_blocks = column_blocks(a, P, kMmaCols);
    auto* kernel = mma_quantized_kernel<T, P, F>;
    allow_dynamic_shared_memory(reinterpret_cast<const void*>(kernel), quantized_smem_bytes(F));
    kernel<<<grid_blocks(max_tiles, launched.col_blocks), kMmaThreads, quantized_smem_bytes(F), stream>>>(launched);
  } else {
    launched.col_blocks = column_blocks(a, P, kSimtCols);
    simt_kernel<T, P, F><<<grid_blocks(max_tiles, launched.col_blocks), 256, 0, stream>>>(launched);
  }
  MOEKIT_CUDA_CHECK_LAUNCH();
}

template <typename T, Projection P>
void launch(const GroupedProblem& g, int64_t max_tiles, cudaStream_t stream) {
  if (max_tiles <= 0) return;
  const ExpertsArgs& a = g.a;
  if (a.fp8()) return launch_quantized<T, P, WeightFormat::fp8_e4m3>(g, max_tiles, stream);
  if (a.fp4()) return launch_quantized<T, P, WeightFormat::fp4_e2m1>(g, max_tiles, stream);
  const int64_t K = P == Projection::up ? a.hidden : a.intermediate;
  const void* left = P == Projection::up ? a.x : g.hidden;
  const void* weights = P == Projection::up ? a.up : a.down;
  const bool tensor_cores =
      !std::is_same_v<T, float> && !a.transposed && K % 8 == 0 && aligned16(left) && aligned16(weights);
  if (tensor_cores) {
    if constexpr (!std::is_same_v<T, float>) {
      GroupedProblem launched = g;
      launched.col_blocks = column_blocks(a, P, kMmaCols);
      auto* kernel = mma_kernel<T, P>;
      allow_dynamic_shared_memory(reinterpret_cast<const void*>(kernel), kMmaSmem);
      kernel<<<grid_blocks(max_tiles, launched.col_blocks), kMmaThreads, kMmaSmem, stream>>>(launched);
      MOEKIT_CUDA_CHECK_LAUNCH();
    }
    return;
  }
  GroupedProblem launched = g;
  launched.col_blocks = column_blocks(a, P, kSimtCols);
  simt_kernel<T, P, WeightFormat::none><<<grid_blocks(max_tiles, launched.col_blocks), 256, 0, stream>>>(launched);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

// acc[i] += w * value i of eight 2-byte values packed in 16 bytes (value 2j in the low half of word j).
template <typename Y>
__device__ __forceinline__ void add_packed8(float (&acc)[8], const uint4 raw, float w) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    Y e;
    e.bits = static_cast<uint16_t>(i % 2 ? words[i / 2] >> 16 : words[i / 2] & 0xffffu);
    acc[i] = fmaf(w, to_f(e), acc[i]);
  }
}

// Eight sums as T, packed into 16 bytes like add_packed8's input; NaN where the token has an invalid id.
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&acc)[8], bool invalid) {
  const float nan = __int_as_float(0x7fc00000);
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    words[i] = static_cast<uint32_t>(from_f<T>(invalid ? nan : acc[2 * i]).bits) |
               static_cast<uint32_t>(from_f<T>(invalid ? nan : acc[2 * i + 1]).bits) << 16;
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Y: the type of the per-pair rows (float for grouped_mm and eager, the activation dtype for deepgemm).
template <typename T, typename Y>
__global__ void __launch_bounds__(256)
    combine_kernel(const ExpertsArgs a, const int32_t* pair_row, const Y* y, bool vectorized, bool weighted) {
  const int64_t t = blockIdx.x, H = a.hidden, K = a.top_k;
  bool invalid = false;
  for (int64_t k = 0; k < K; ++k) invalid |= load_id(a, t * K + k) < 0;
  const float nan = __int_as_float(0x7fc00000);
  if constexpr (sizeof(Y) == 2 && sizeof(T) == 2) {
    // 2-byte rows, H a multiple of 8 and 16-byte aligned rows (the launcher checks): 8 columns a
    // thread, 16-byte loads and stores; the same fmaf sequence per column as below.
    if (vectorized) {
      for (int64_t v = threadIdx.x; v < H / 8; v += blockDim.x) {
        float acc[8] = {};
        for (int64_t k = 0; k < K; ++k) {
          const int32_t row = pair_row[t * K + k];
          if (row < 0) continue;
          const float w = weighted ? load_routing_weight<T>(a, t * K + k) : 1.0f;
          add_packed8<Y>(acc, __ldg(reinterpret_cast<const uint4*>(y + row * H) + v), w);
        }
        reinterpret_cast<uint4*>(static_cast<T*>(a.out) + t * H)[v] = pack8<T>(acc, invalid);
      }
      return;
    }
  }
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = pair_row[t * K + k];
      if (row >= 0) acc = fmaf(weighted ? load_routing_weight<T>(a, t * K + k) : 1.0f, to_f(y[row * H + h]), acc);
    }
    static_cast<T*>(a.out)[t * H + h] = from_f<T>(invalid ? nan : acc);
  }
}

// The 2-byte rows' combine (deepgemm and sonicmoe; grouped_mm's rows are float): the same sums as combine_kernel's
// vectorized path, each column's fmaf in slot order, but the token's K pairs (row, routing weight, valid id) are read
// once into shared memory by K threads in one round trip (kMaxCombineSlots at most), and each thread then has
// kCombineBatch of its 16-byte loads in flight before it adds them. combine_kernel read the ids, then each pair's row
// and weight, then its values, one dependent round trip after another, K times over.
constexpr int kMaxCombineSlots = 64, kCombineBatch = 8;
template <typename T>
__global__ void __launch_bounds__(256)
    combine_2byte_rows_kernel(const ExpertsArgs a, const int32_t* pair_row, const T* y, bool weighted) {
  __shared__ int32_t rows[kMaxCombineSlots];
  __shared__ float weights[kMaxCombineSlots];
  const int64_t t = blockIdx.x, H = a.hidden;
  const int K = static_cast<int>(a.top_k);
  bool invalid = false;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const int64_t pair = t * K + k;
    invalid |= load_id(a, pair) < 0;
    rows[k] = pair_row[pair];
    weights[k] = weighted ? load_routing_weight<T>(a, pair) : 1.0f;
  }
  invalid = __syncthreads_or(invalid);
  for (int64_t v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float acc[8] = {};
    for (int k0 = 0; k0 < K; k0 += kCombineBatch) {
      uint4 raw[kCombineBatch];
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {
        const int k = k0 + b;
        raw[b] =
            k < K && rows[k] >= 0 ? __ldg(reinterpret_cast<const uint4*>(y + rows[k] * H) + v) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {
        const int k = k0 + b;
        if (k < K && rows[k] >= 0) add_packed8<T>(acc, raw[b], weights[k]);
      }
    }
    reinterpret_cast<uint4*>(static_cast<T*>(a.out) + t * H)[v] = pack8<T>(acc, invalid);
  }
}

// Byte offsets in the workspace; the codes and scales exist with quantised weights only.
struct GroupedLayout {
  std::size_t hidden, y, x_codes, x_scales, hidden_codes, hidden_scales, total;
};

GroupedLayout grouped_layout(const ExpertsArgs& a) {
  const int64_t P = a.tokens * a.top_k;
  auto round = [](std::size_t b) { return (b + 255) / 256 * 256; };
  auto bytes = [](int64_t n, std::size_t size) { return static_cast<std::size_t>(n) * size; };
  const int64_t q = a.quantized() ? 1 : 0;
  const int64_t h_groups = activation_groups(a.hidden), i_groups = activation_groups(a.intermediate);
  GroupedLayout l;
  l.hidden = kRoutingOffset + round(routing_workspace_bytes(P, a.experts));
  l.y = l.hidden + round(bytes(P * a.intermediate, a.quantized() ? sizeof(float) : dtype_size(a.dtype)));
  l.x_codes = l.y + round(bytes(P * a.hidden, sizeof(float)));
  l.x_scales = l.x_codes + round(bytes(q * a.tokens * h_groups * 128, sizeof(bf16)));
  l.hidden_codes = l.x_scales + round(bytes(q * a.tokens * h_groups, sizeof(float)));
  l.hidden_scales = l.hidden_codes + round(bytes(q * P * i_groups * 128, sizeof(bf16)));
  l.total = l.hidden_scales + round(bytes(q * P * i_groups, sizeof(float)));
  return l;
}

}  // namespace

std::size_t grouped_buffers_bytes(const ExpertsArgs& a) {
  return grouped_layout(a).total;
}

GroupedProblem grouped_buffers(const ExpertsArgs& a, void* workspace) {
  const GroupedLayout l = grouped_layout(a);
  char* base = static_cast<char*>(workspace);
  GroupedProblem g;
  g.a = a;
  g.hidden = base + l.hidden;
  g.y = reinterpret_cast<float*>(base + l.y);
  if (a.quantized()) {
    g.x_codes = reinterpret_cast<bf16*>(base + l.x_codes);
    g.x_scales = reinterpret_cast<float*>(base + l.x_scales);
    g.hidden_codes = reinterpret_cast<bf16*>(base + l.hidden_codes);
    g.hidden_scales = reinterpret_cast<float*>(base + l.hidden_scales);
  }
  return g;
}

void quantize_grouped_x(const GroupedProblem& g, cudaStream_t stream) {
  const ExpertsArgs& a = g.a;
  if (!a.quantized() || a.tokens == 0) return;
  MOEKIT_CHECK(a.tokens <= 0x7fffffff, "grouped products: too many tokens for one launch");
  QuantizedRows dst;
  dst.codes = g.x_codes;
  dst.scales = g.x_scales;
  visit_float_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    quantize_rows_kernel<T><<<static_cast<unsigned>(a.tokens), 128, 0, stream>>>(static_cast<const T*>(a.x), a.hidden,
                                                                                 a.ue8m0_scales, dst);
  });
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void quantize_grouped_hidden(const GroupedProblem& g, int64_t first_row, int64_t rows, const int32_t* row_count,
                             cudaStream_t stream) {
  const ExpertsArgs& a = g.a;
  if (!a.quantized() || rows == 0) return;
  MOEKIT_CHECK(rows <= 0x7fffffff, "grouped products: too many rows for one launch");
  MOEKIT_CHECK(!row_count || first_row == 0, "quantize_grouped_hidden: a row count applies from row 0");
  const int64_t groups = activation_groups(a.intermediate);
  QuantizedRows dst;
  dst.codes = g.hidden_codes + first_row * groups * 128;
  dst.scales = g.hidden_scales + first_row * groups;
  dst.row_count = row_count;
  quantize_rows_kernel<float><<<static_cast<unsigned>(rows), 128, 0, stream>>>(
      static_cast<const float*>(g.hidden) + first_row * a.intermediate, a.intermediate, a.ue8m0_scales, dst);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

std::string grouped_gemm_kernel_path(const ExpertsArgs& a) {
  // The kernel each projection's launch picks (launch, launch_quantized): the down projection's left operand is
  // the workspace's hidden rows, always aligned.
  auto kernel = [&](Projection P) -> std::string {
    const int64_t K = P == Projection::up ? a.hidden : a.intermediate;
    const void* weights = P == Projection::up ? a.up : a.down;
    const bool mma = a.quantized() ? K % (a.fp8() ? 16 : 32) == 0 && aligned16(weights)
                                   : a.dtype != DType::f32 && !a.transposed && K % 8 == 0 && aligned16(weights) &&
                                         (P != Projection::up || aligned16(a.x));
    return mma ? "mma.sync tensor cores" : "CUDA cores";
  };
  const std::string up = kernel(Projection::up), down = kernel(Projection::down);
  const std::string operands = a.fp8()   ? "e4m3 weight codes, " + std::string(dtype_name(a.dtype)) + " activations"
                               : a.fp4() ? "e2m1 weight codes, " + std::string(dtype_name(a.dtype)) + " activations"
                                         : std::string(dtype_name(a.dtype));
  return "portable grouped GEMM (" + operands + ") on " + (up == down ? up : up + " (up), " + down + " (down)");
}

void launch_grouped_projection(const GroupedProblem& g, Projection p, int64_t max_tiles, cudaStream_t stream) {
  visit_float_dtype(g.a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (p == Projection::up)
      launch<T, Projection::up>(g, max_tiles, stream);
    else
      launch<T, Projection::down>(g, max_tiles, stream);
  });
}

void launch_combine_rows(const ExpertsArgs& a, const int32_t* pair_row, const void* y, bool y_is_float, bool weighted,
                         cudaStream_t stream) {
  if (a.tokens == 0) return;
  MOEKIT_CHECK(a.tokens <= 0x7fffffff, "combine: too many tokens for one launch");
  visit_float_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto blocks = static_cast<unsigned>(a.tokens);
    const bool vectorized = a.hidden % 8 == 0 && aligned16(a.out) && aligned16(y);
    if (y_is_float) {
      combine_kernel<T, float><<<blocks, 256, 0, stream>>>(a, pair_row, static_cast<const float*>(y), false, weighted);
    } else if (sizeof(T) == 2 && vectorized && a.top_k <= kMaxCombineSlots) {
      if constexpr (sizeof(T) == 2) {
        // A thread per 16 bytes of a row, in whole warps, at most 256 (one 16-byte column a thread up to H = 2,048),
        // so that all of a column's loads go out at once.
        const int64_t threads = std::clamp<int64_t>((a.hidden / 8 + 31) / 32 * 32, 32, 256);
        combine_2byte_rows_kernel<T>
            <<<blocks, static_cast<unsigned>(threads), 0, stream>>>(a, pair_row, static_cast<const T*>(y), weighted);
      }
    } else {
      combine_kernel<T, T>
          <<<blocks, vectorized ? 128 : 256, 0, stream>>>(a, pair_row, static_cast<const T*>(y), vectorized, weighted);
    }
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

void launch_combine(const GroupedProblem& g, cudaStream_t stream) {
  launch_combine_rows(g.a, g.r.pair_row, g.y, true, true, stream);
}

}  // namespace moekit::cuda

// Kernels of the grouped products: a tensor-core kernel (mma.sync, bf16/f16, cp.async pipeline,
// row gather fused into the operand load) for the weight layout [E, N, K] with K a multiple of 8,
// and a CUDA-core kernel for everything else (f32, which must stay exact; transposed weights; odd
// sizes). Both share the routing's tile schedule and the epilogues of grouped_gemm.cuh.
#include <algorithm>

#include "moekit/cuda/cuda_check.h"
#include "moekit/cuda/grouped_gemm.cuh"

namespace moekit::cuda {
namespace {

// ---- CUDA-core kernel: 64 x 64 tiles, 16-deep k steps, 256 threads of 4 x 4 outputs. ----
constexpr int kSimtCols = 64, kSimtDepth = 16;

template <typename T, Projection P>
__global__ void __launch_bounds__(256) simt_kernel(const GroupedProblem g) {
  __shared__ float a_tile[kSimtDepth][kTileRows + 4];
  __shared__ float b_tile[kSimtDepth][kSimtCols + 4];
  __shared__ float c_tile[kTileRows][kSimtCols + 1];
  int64_t expert, row_begin, row_end;
  if (!find_tile(g, expert, row_begin, row_end, kTileRows)) return;
  const ExpertsArgs& a = g.a;
  const int64_t K = ProjectionShape<P>::reduction(a), N = ProjectionShape<P>::outputs(a);
  const T* w = static_cast<const T*>(P == Projection::up ? a.up : a.down) + expert * N * K;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  // Per thread: the 4 left rows and 4 weight rows it loads (fixed over k).
  const T* a_rows[4];
  int64_t w_rows[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int i = tid + q * 256;  // element of the 64 x 16 tile, k fastest
    const int64_t row = row_begin + i / kSimtDepth;
    a_rows[q] = row < row_end ? left_row<T, P>(g, row) : nullptr;
    w_rows[q] = tile_output<P>(a, block_col(g), i / kSimtDepth, kSimtCols);
  }
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kSimtDepth) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = tid + q * 256, r = i / kSimtDepth, kk = i % kSimtDepth;
      const int64_t k = k0 + kk;
      a_tile[kk][r] = (a_rows[q] && k < K) ? to_f(a_rows[q][k]) : 0.0f;
      float wv = 0.0f;
      if (w_rows[q] >= 0 && k < K) wv = to_f(a.transposed ? w[k * N + w_rows[q]] : w[w_rows[q] * K + k]);
      b_tile[kk][r] = wv;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSimtDepth; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = a_tile[kk][ty * 4 + i], bv[i] = b_tile[kk][tx * 4 + i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) c_tile[ty * 4 + i][tx * 4 + j] = acc[i][j];
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

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: fill with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
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
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_steps) load_stage(s, s);
    cp_async_commit();
  }
  for (int64_t step = 0; step < k_steps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int64_t next = step + kStages - 1;
    if (next < k_steps) load_stage(next, static_cast<int>(next % kStages));
    cp_async_commit();
    const T* sa = smem + static_cast<int>(step % kStages) * kStageElems;
    const T* sb = sa + kTileRows * kPitch;
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
          mma16816<T>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
          mma16816<T>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // Accumulators to shared memory (over the pipeline buffers), then the shared epilogue.
  float* c = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int r = warp_m * 32 + mt * 16 + lane / 4, col = warp_n * 64 + nt * 8 + (lane % 4) * 2;
      c[r * kCPitch + col] = acc[mt][nt][0];
      c[r * kCPitch + col + 1] = acc[mt][nt][1];
      c[(r + 8) * kCPitch + col] = acc[mt][nt][2];
      c[(r + 8) * kCPitch + col + 1] = acc[mt][nt][3];
    }
  __syncthreads();
  store_tile<T, P, kTileRows, kMmaCols>(g, c, kCPitch, expert, row_begin, row_end, block_col(g));
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// One-dimensional grid of row tiles x column blocks (column block fastest, see block_col).
unsigned grid_blocks(int64_t row_tiles, int64_t col_blocks) {
  MOEKIT_CHECK(row_tiles * col_blocks <= 0x7fffffff, "grouped_mm: too many tiles for one launch (", row_tiles, " x ",
               col_blocks, ")");
  return static_cast<unsigned>(row_tiles * col_blocks);
}

template <typename T, Projection P>
void launch(const GroupedProblem& g, int64_t max_tiles, cudaStream_t stream) {
  if (max_tiles <= 0) return;
  const ExpertsArgs& a = g.a;
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
      MOEKIT_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kMmaSmem)));
      kernel<<<grid_blocks(max_tiles, launched.col_blocks), kMmaThreads, kMmaSmem, stream>>>(launched);
      MOEKIT_CUDA_CHECK_LAUNCH();
    }
    return;
  }
  GroupedProblem launched = g;
  launched.col_blocks = column_blocks(a, P, kSimtCols);
  simt_kernel<T, P><<<grid_blocks(max_tiles, launched.col_blocks), 256, 0, stream>>>(launched);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

// Y: the type of the per-pair rows (float for grouped_mm and eager, the activation dtype for deepgemm).
template <typename T, typename Y>
__global__ void __launch_bounds__(256) combine_kernel(const ExpertsArgs a, const int32_t* pair_row, const Y* y,
                                                      bool vectorized, bool weighted) {
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
          const uint4 raw = __ldg(reinterpret_cast<const uint4*>(y + row * H) + v);
          const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            Y e;
            e.bits = static_cast<uint16_t>(i % 2 ? words[i / 2] >> 16 : words[i / 2] & 0xffffu);
            acc[i] = fmaf(w, to_f(e), acc[i]);
          }
        }
        uint32_t words[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          words[i] = static_cast<uint32_t>(from_f<T>(invalid ? nan : acc[2 * i]).bits) |
                     static_cast<uint32_t>(from_f<T>(invalid ? nan : acc[2 * i + 1]).bits) << 16;
        reinterpret_cast<uint4*>(static_cast<T*>(a.out) + t * H)[v] = make_uint4(words[0], words[1], words[2], words[3]);
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

struct GroupedLayout {
  std::size_t hidden, y, total;
};

GroupedLayout grouped_layout(const ExpertsArgs& a) {
  const int64_t P = a.tokens * a.top_k;
  auto round = [](std::size_t b) { return (b + 255) / 256 * 256; };
  GroupedLayout l;
  l.hidden = kRoutingOffset + round(routing_workspace_bytes(P, a.experts));
  l.y = l.hidden + round(static_cast<std::size_t>(P * a.intermediate) * dtype_size(a.dtype));
  l.total = l.y + round(static_cast<std::size_t>(P * a.hidden) * sizeof(float));
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
  return g;
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
    if (y_is_float)
      combine_kernel<T, float><<<blocks, 256, 0, stream>>>(a, pair_row, static_cast<const float*>(y), false, weighted);
    else
      combine_kernel<T, T><<<blocks, vectorized ? 128 : 256, 0, stream>>>(a, pair_row, static_cast<const T*>(y),
                                                                         vectorized, weighted);
    MOEKIT_CUDA_CHECK_LAUNCH();
  });
}

void launch_combine(const GroupedProblem& g, cudaStream_t stream) {
  launch_combine_rows(g.a, g.r.pair_row, g.y, true, true, stream);
}

}  // namespace moekit::cuda

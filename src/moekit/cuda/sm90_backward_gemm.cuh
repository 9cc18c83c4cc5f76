// The grouped GEMMs of the Hopper backward (sm90_backward.cu): C[m, n] = sum_k A[m, k] B[n, k] with wgmma over
// the backward's sorted rows (backward.cuh: row r of the sorted order is pair row_pair[r], the rows of expert e
// are [offsets[e], offsets[e + 1]), unpadded), in one of two groupings:
//   rows:  the row products (z, G, dx). A 128-row tile of one expert (the routing's 128-row tile schedule; its
//          rows past the expert's end are computed from zeros and never stored) times that expert's B.
//   depth: the weight gradients. C_e [m, n] = sum over the expert's rows r of A[r, m] B[r, n]: the reduction runs
//          over the expert's rows in order, 64 a stage, rows past its end read as zeros.
// Each operand is read in the orientation it has in memory, as 128-byte rows of a 128-byte-swizzled stage:
//   K-major:  operand rows are rows of m (or n), 64 k values each (x, grad_out, dz as A; up_proj as B of z);
//   MN-major: operand rows are rows of k, 64 m (or n) values each (down_proj and up_proj as B of G and dx, every
//             operand of the weight gradients), which wgmma reads transposed.
// Token rows (x, grad_out) are gathered by each sorted row's token in the load itself (cp.async, 16 bytes a thread of
// the producer warpgroup's 128), the other operands come by the copy engine (TMA), and every copy past an operand's
// rows or columns fills zeros, so no operand is ever copied or padded in memory. Both complete on the stage's "full"
// mbarrier; the two math warpgroups take 64 rows of the 128-row tile each and release a stage through its "empty"
// mbarrier.
// Persistent: one block per multiprocessor walks the (tile, column block) units; the tile counts and each tile's
// expert are read on the device, so the host never waits. Every sum runs in one fixed order (wgmma's accumulation
// along k in order, then the epilogue's in column order): results are bitwise the same run to run.
#pragma once

#include <cuda.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

#include "moekit/cuda/backward.cuh"
#include "moekit/cuda/routing.cuh"
#include "moekit/cuda/sm90_wgmma.cuh"

namespace moekit::cuda::sm90_backward {

constexpr int kBlockM = 128;    // rows of a tile: two math warpgroups of 64
constexpr int kBlockN = 256;    // columns of a tile
constexpr int kStageK = 64;     // k of a stage: one 128-byte row of 2-byte values
constexpr int kChunkRows = 64;  // a stage operand is chunks of 64 rows of 128 bytes (8 KB)
constexpr int kChunkBytes = kChunkRows * 128;
constexpr int kABytes = kBlockM * 128, kBBytes = kBlockN * 128, kStageBytes = kABytes + kBBytes;
constexpr int kThreads = 384;  // the producer warpgroup and two math warpgroups
constexpr int kProducerRegisters = 56, kMathRegisters = 224;
// G's epilogue reads z from shared memory: after a unit's k stages, the producer copies the unit's float z tile into
// the next stages of the ring, kZCols columns of the intermediate a stage, as boxes of [128 rows][32 floats] in the
// 128-byte swizzle (z_map): the gate and the up columns (concatenated), the two halves of the interleaved pairs'
// 64 floats, or one box (ungated). Read from global memory instead, each of the epilogue's steps waited for its
// loads with the tensor cores idle (70% of the math warps' samples at Qwen3-30B-A3B's shape, G 2.1 ms against z's
// 1.3 for twice the FLOPs).
constexpr int kZCols = 32;
constexpr int kZBoxBytes = kBlockM * 128;
static_assert(2 * kZBoxBytes <= kStageBytes && kBlockN % kZCols == 0 && kZCols % 16 == 0);

enum class Major : uint8_t { k, mn };
enum class Grouping : uint8_t { rows, depth };
enum class Epilogue : uint8_t {
  store_float,               // z = C + b1 as float [P, N] (rows)
  store_rows,                // dx = C in the dtype [P, H] (rows)
  activation_gradient,       // C is G: dz, wa and the routing-weight gradient's partial sums (rows)
  store_weights,             // C_e in the dtype at out + e * out_expert_stride (depth)
  store_weights_transposed,  // C_e^T there: out[n][m] (depth)
};

// store_weights and store_rows hand their tiles to the copy engine: each math warpgroup writes its 64 rows into a
// staging buffer of its own (four [64 rows][64 values] boxes in the 128-byte swizzle) and one thread stores them by
// TMA (the kernel's third map), so that the warpgroup goes on to its next unit while the copy runs; the buffer is
// reused once the copy has read it. Stored from registers, a weight-gradient unit's epilogue (a 128 x 256 tile after
// as few as 2-16 stages of k) kept the tensor cores idle: staged, grad_up and grad_down ran 1.3-1.4x as fast (H100,
// Qwen3-30B-A3B, 16,384 tokens). store_rows stages the warpgroups whose 64 rows are all the expert's (a box stores
// whole rows, and the rows past the expert's end are the next expert's); the rest store from registers. The staging
// takes the place of one stage of the ring.
constexpr int kStagedBoxBytes = kChunkRows * 128;                            // [64 rows][64 2-byte values]
constexpr int kStagedGroupBytes = (kBlockN / kChunkRows) * kStagedBoxBytes;  // one warpgroup's 64 x 256
template <Epilogue kEpi>
constexpr bool kStagedStore = kEpi == Epilogue::store_weights || kEpi == Epilogue::store_rows;
template <Epilogue kEpi>
constexpr int kStagesOf = kStagedStore<kEpi> ? 3 : 4;
// Dynamic shared memory of a launch: the ring, the staging buffers, the barriers, and the alignment slack.
template <Epilogue kEpi>
constexpr std::size_t kSmemBytesOf = kStagesOf<kEpi>*(kStageBytes + 16) +
                                     (kStagedStore<kEpi> ? 2 * kStagedGroupBytes : 0) + 1024;
static_assert(kSmemBytesOf<Epilogue::store_weights> <= 227 * 1024 && kSmemBytesOf<Epilogue::store_rows> <= 227 * 1024);

// Where an operand's 128-byte rows are: row i of its row space at base + row(i) * ld (+ the expert's offset with
// rows grouping), row(i) = gather ? gather[i] : i; `columns` valid elements a row (past them: zeros).
struct Operand {
  const void* base = nullptr;
  int64_t ld = 0;
  int64_t expert_stride = 0;
  const int32_t* gather = nullptr;
  int64_t columns = 0;
};

struct Params {
  ExpertsArgs a;
  DeviceRouting r;  // offsets, tile_offsets (128-row tiles), row_pair
  Operand A, B;
  int64_t m = 0, n = 0, k = 0;  // rows grouping: n and k (m is the rows); depth grouping: m and n of each C_e
  int m_blocks = 0, n_blocks = 0;
  void* out = nullptr;
  int64_t ld_out = 0, out_expert_stride = 0;
  // activation_gradient (z comes through the kernel's z_map)
  void* dz = nullptr;
  void* wa = nullptr;
  float* route_partials = nullptr;
  int64_t partial_blocks = 0;
  int grid_blocks = 0;  // host side: the launch's cap on blocks (KernelOptions::hopper_backward_blocks; 0: none)
};

template <typename T, Major kA, Major kB>
struct Wgmma {
  static constexpr auto kMajorA = kA == Major::k ? cute::SM90::GMMA::Major::K : cute::SM90::GMMA::Major::MN;
  static constexpr auto kMajorB = kB == Major::k ? cute::SM90::GMMA::Major::K : cute::SM90::GMMA::Major::MN;
  using type =
      std::conditional_t<std::is_same_v<T, bf16>, cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<kMajorA, kMajorB>,
                         cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<kMajorA, kMajorB>>;
};

// The shared-memory descriptor of an operand in 128-byte-swizzled rows. K-major: rows of 128 bytes of k, groups of
// 8 rows 1,024 bytes apart. MN-major: chunks of [64 k rows][64 values], the 8-row groups along k 1,024 bytes apart
// (stride offset) and the next 64 values of m or n a chunk (8 KB) on (leading offset).
template <Major kMajor>
__device__ __forceinline__ uint64_t descriptor(const void* p) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(p) >> 4);
  d.bitfield.leading_byte_offset_ = kMajor == Major::k ? 1 : kChunkBytes >> 4;
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return d.desc_;
}
// How far one k16 step moves a descriptor's address (16-byte units): 32 bytes along a K-major row, 16 rows of an
// MN-major chunk.
template <Major kMajor>
constexpr uint32_t kK16Step = kMajor == Major::k ? 2 : (16 * 128) >> 4;

using hopper::acc_col;
using hopper::acc_row;
using hopper::wgmma;

// One chunk of a stage (64 rows of 128 bytes) by cp.async, from the producer warpgroup: thread t copies 16-byte piece
// t % 8 of chunk rows t / 8 + 16 j (j < 4), which are rows src_row[j] of the operand in memory (negative: zeros) from
// column first_col + 8 (t % 8) on (columns at or past the operand's `columns`: zeros). The piece lands at the
// 128-byte swizzle's place for its row (piece ^ row % 8).
template <typename T>
__device__ __forceinline__ void copy_chunk(uint8_t* chunk, const Operand& o, const T* base, const int32_t (&src_row)[4],
                                           int64_t first_col) {
  const int t = static_cast<int>(threadIdx.x % 128), piece = t % 8;
  const int64_t col = first_col + piece * 8;
  const bool col_ok = col < o.columns;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = t / 8 + 16 * j;
    const bool ok = col_ok && src_row[j] >= 0;
    cp_async16(chunk + r * 128 + ((piece ^ (r & 7)) * 16), ok ? base + int64_t{src_row[j]} * o.ld + col : base, ok);
  }
}

// The memory rows of this producer thread's four chunk rows, rows first_row + t / 8 + 16 j of the operand's row
// space, through its gather (negative past row_end).
__device__ __forceinline__ void chunk_rows(const Operand& o, int64_t first_row, int64_t row_end,
                                           int32_t (&src_row)[4]) {
  const int t = static_cast<int>(threadIdx.x % 128);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t row = first_row + t / 8 + 16 * j;
    src_row[j] = row < row_end ? (o.gather ? o.gather[row] : static_cast<int32_t>(row)) : -1;
  }
}

// A unit of work: its expert, the tile's rows (rows grouping) or m block (depth grouping), its column block, and
// the k range: [0, k) for rows grouping, the expert's rows for depth grouping.
struct Unit {
  int64_t expert = 0;
  int64_t row_begin = 0, row_end = 0;  // rows grouping: the tile's sorted rows
  int64_t m0 = 0, n0 = 0;
  int64_t k_begin = 0, k_end = 0;
};

template <Grouping kGroup>
__device__ __forceinline__ int64_t unit_count(const Params& p) {
  if constexpr (kGroup == Grouping::rows)
    return int64_t{p.r.tile_offsets[p.a.experts]} * p.n_blocks;
  else
    return p.a.experts * p.m_blocks * p.n_blocks;
}

// Unit `u` of the block's walk (a whole warp calls it: the expert lookup is a warp's). `hint`: the expert of the
// block's previous unit, where the lookup starts.
template <Grouping kGroup>
__device__ __forceinline__ Unit unit_of(const Params& p, int64_t u, int64_t& hint) {
  Unit w;
  if constexpr (kGroup == Grouping::rows) {
    const int64_t tile = u / p.n_blocks;
    w.n0 = (u % p.n_blocks) * kBlockN;
    w.expert = expert_of_from_warp(p.r.tile_offsets, p.a.experts, tile, hint);
    hint = w.expert;
    w.row_begin = p.r.offsets[w.expert] + (tile - p.r.tile_offsets[w.expert]) * kBlockM;
    w.row_end = min(w.row_begin + kBlockM, int64_t{p.r.offsets[w.expert + 1]});
    w.k_begin = 0;
    w.k_end = p.k;
  } else {
    const int64_t per_expert = int64_t{p.m_blocks} * p.n_blocks;
    w.expert = u / per_expert;
    const int64_t rest = u % per_expert;
    w.m0 = (rest / p.n_blocks) * kBlockM;
    w.n0 = (rest % p.n_blocks) * kBlockN;
    w.k_begin = p.r.offsets[w.expert];
    w.k_end = p.r.offsets[w.expert + 1];
  }
  return w;
}

// Stores a warpgroup's 64 rows of C (+ bias[col]) as O at out[row * ld + col] for rows below `rows` and columns
// below `cols` (row and column relative to the warpgroup's first row and the tile's first column; cols even).
template <typename O, typename T>
__device__ __forceinline__ void store_tile(const float* acc, O* out, int64_t ld, int64_t rows, int64_t cols,
                                           const T* bias) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kBlockN / 2; i += 2) {
    const int row = acc_row(warp, lane, i), col = acc_col(lane, i);
    if (row >= rows || col >= cols) continue;
    float v0 = acc[i], v1 = acc[i + 1];
    if (bias) v0 += to_f(bias[col]), v1 += to_f(bias[col + 1]);
    O* at = out + row * ld + col;
    if constexpr (std::is_same_v<O, float>)
      *reinterpret_cast<float2*>(at) = make_float2(v0, v1);
    else
      store_two(at, v0, v1);
  }
}

// store_tile's transpose: C[row][col] at out[col * ld + row], one 2-byte value a store (the eight rows of a column
// that a warp holds are 16 contiguous bytes).
template <typename T>
__device__ __forceinline__ void store_tile_transposed(const float* acc, T* out, int64_t ld, int64_t rows,
                                                      int64_t cols) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) {
    const int row = acc_row(warp, lane, i), col = acc_col(lane, i);
    if (row < rows && col < cols) out[col * ld + row] = from_f<T>(acc[i]);
  }
}

// The activation's value and derivatives at (g, u) through a call: inlined into each of the epilogue's unrolled steps,
// the activation's switch made the kernel's code many times larger.
__device__ __noinline__ ActivationGradient activation_gradient_call(Act act, bool has_gate, float limit, float alpha,
                                                                    float g, float u) {
  ExpertsArgs a;
  a.act = act;
  a.has_gate = has_gate;
  a.swiglu_limit = limit;
  a.swiglu_alpha = alpha;
  return activation_gradient(a, g, u);
}
// kSwiGlu: SiLU with a gate (concatenated), the common case, inline; every other activation through the call.
template <bool kSwiGlu>
__device__ __forceinline__ ActivationGradient gradient_at(const ExpertsArgs& a, float g, float u) {
  if constexpr (kSwiGlu) {
    const float s = sigmoid(g), h = g * s;
    return {h * u, s * (1.0f + g * (1.0f - s)) * u, h};
  } else {
    return activation_gradient_call(a.act, a.has_gate, a.swiglu_limit, a.swiglu_alpha, g, u);
  }
}

// The stages of z a unit of G's epilogue takes: kZCols columns each of the tile's columns of the intermediate.
__device__ __forceinline__ int z_stages_of(const Params& p, const Unit& w) {
  return static_cast<int>((min(int64_t{kBlockN}, p.a.intermediate - w.n0) + kZCols - 1) / kZCols);
}

// The shared address of float c (of kZCols) of row r of a z box at shared address `box`, where the copy engine's
// 128-byte swizzle put it: the row's 16-byte piece c / 4 at piece (c / 4) ^ (r % 8), so that the eight rows a warp
// reads at once fall on different banks. Read by ld.shared: through generic pointers the loads were generic ones.
__device__ __forceinline__ uint32_t z_box_at(uint32_t box, int r, int c) {
  return box + r * 128 + (((c >> 2) ^ (r & 7)) << 4) + (c & 3) * 4;
}
__device__ __forceinline__ float2 load_shared_float2(uint32_t at) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(at));
  return v;
}
__device__ __forceinline__ float4 load_shared_float4(uint32_t at) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(at));
  return v;
}

// The down-projection gradient's epilogue: C = G = grad_out[t] @ down_e of the warpgroup's rows [row0, row0 + 64)
// (sorted order, those below row_end) and the tile's columns n0.. of the intermediate. Per column j (backward.cuh):
// dz at the weight's own rows, wa = w act(z), and the row's sum of G act(z) over the tile's columns (each thread's
// columns in order, then the four threads of a row in a fixed tree) into route_partials[row][n0 / kBlockN]. z comes
// from the ring: z_stages stages from (stage, phase) on, each released once the whole warpgroup has read it.
template <typename T, bool kSwiGlu>
__device__ __forceinline__ void activation_gradient_epilogue(const Params& p, const float* acc, int64_t row0,
                                                             int64_t row_end, int64_t n0, const uint8_t* smem,
                                                             uint32_t full_at, uint64_t* empty, int z_stages,
                                                             int& stage, uint32_t& phase, int math) {
  using Barrier = cutlass::arch::ClusterBarrier;
  const ExpertsArgs& a = p.a;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int64_t I = a.intermediate, N = a.has_gate ? 2 * I : I;
  float route[2], dot[2] = {0.0f, 0.0f};
  bool valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + acc_row(warp, lane, 2 * h);
    valid[h] = row < row_end;
    route[h] = valid[h] ? load_routing_weight<T>(a, p.r.row_pair[row]) : 0.0f;
  }
#pragma unroll
  for (int s = 0; s < kBlockN / kZCols; ++s) {
    if (s >= z_stages) break;
    hopper::wait_stage(full_at + 8 * stage, phase, "backward z", -1, s, stage, -1, -1, 1 + math);
    const uint32_t zs = cute::cast_smem_ptr_to_uint(smem + stage * kStageBytes);
    // Groups of four column pairs (eight accumulators, 16 columns).
#pragma unroll
    for (int g16 = 0; g16 < kZCols / 16; ++g16) {
      const int m = s * (kZCols / 16) + g16;
      float zg[8], zu[8];
      bool ok[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = 8 * m + 2 * k, h = k & 1;
        const int r = 64 * math + acc_row(warp, lane, i), c = acc_col(lane, i) - kZCols * s;
        ok[k] = valid[h] && n0 + acc_col(lane, i) < I;
        zg[2 * k] = zg[2 * k + 1] = zu[2 * k] = zu[2 * k + 1] = 0.0f;
        if (!ok[k]) continue;
        if (kSwiGlu || (a.has_gate && a.concatenated)) {
          const float2 vg = load_shared_float2(z_box_at(zs, r, c));
          const float2 vu = load_shared_float2(z_box_at(zs + kZBoxBytes, r, c));
          zg[2 * k] = vg.x, zg[2 * k + 1] = vg.y, zu[2 * k] = vu.x, zu[2 * k + 1] = vu.y;
        } else if (!a.has_gate) {
          const float2 v = load_shared_float2(z_box_at(zs, r, c));
          zg[2 * k] = v.x, zg[2 * k + 1] = v.y;
        } else {  // interleaved: (g, u) of columns c and c + 1 are floats 2c..2c + 3 of the stage's 64
          const float4 v = load_shared_float4(z_box_at(zs + (c / 16) * kZBoxBytes, r, (2 * c) % 32));
          zg[2 * k] = v.x, zu[2 * k] = v.y, zg[2 * k + 1] = v.z, zu[2 * k + 1] = v.w;
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (!ok[k]) continue;
        const int i = 8 * m + 2 * k, h = k & 1;
        const int64_t row = row0 + acc_row(warp, lane, i), j = n0 + acc_col(lane, i);
        float d_gate[2], d_up[2], value[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float g = acc[i + u];
          const ActivationGradient d = gradient_at<kSwiGlu>(a, zg[2 * k + u], zu[2 * k + u]);
          d_gate[u] = route[h] * g * d.d_gate;
          d_up[u] = route[h] * g * d.d_up;
          value[u] = d.value;
          dot[h] = fmaf(g, d.value, dot[h]);
        }
        store_dz_pair<T, kSwiGlu>(a, static_cast<T*>(p.dz) + row * N, j, d_gate, d_up);
        store_two(static_cast<T*>(p.wa) + row * I + j, route[h] * value[0], route[h] * value[1]);
      }
    }
    // Every thread of the warpgroup has read the stage (its values are used above): free it.
    hopper::named_sync(1 + math, 128);
    if (threadIdx.x % 128 == 0) Barrier::arrive(&empty[stage]);
    if (++stage == kStagesOf<Epilogue::activation_gradient>) stage = 0, phase ^= 1;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float s = dot[h];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (lane % 4 == 0 && valid[h])
      p.route_partials[(row0 + acc_row(warp, lane, 2 * h)) * p.partial_blocks + n0 / kBlockN] = s;
  }
}

// The staged epilogue (kStagedStore): warpgroup `math`'s 64 rows of C as rows first_row.., columns n0.. of matrix
// `matrix` of out_map ([matrices][rows][columns] in 64 x 64 boxes, which drop what falls past its rows or columns),
// through its staging buffer and the copy engine. `pending`: the warpgroup's previous copy may still be reading it.
template <typename T>
__device__ __forceinline__ void store_staged(const float* acc, uint8_t* staging, const CUtensorMap& out_map,
                                             int64_t matrix, int64_t first_row, int64_t n0, int math, bool& pending) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const bool leader = threadIdx.x % 128 == 0;
  if (pending && leader) cute::tma_store_wait<0>();
  hopper::named_sync(1 + math, 128);  // the buffer is free
#pragma unroll
  for (int i = 0; i < kBlockN / 2; i += 2) {
    const int row = acc_row(warp, lane, i), col = acc_col(lane, i);
    // Box col / 64; in it, the row's 16-byte piece (col % 64) / 8 at piece ^ (row % 8), as the swizzle lays it out.
    const uint32_t at = cute::cast_smem_ptr_to_uint(staging) + (col / 64) * kStagedBoxBytes + row * 128 +
                        ((((col % 64) / 8) ^ (row & 7)) << 4) + (col % 8) * 2;
    const uint32_t v = static_cast<uint32_t>(from_f<T>(acc[i]).bits) | static_cast<uint32_t>(from_f<T>(acc[i + 1]).bits)
                                                                           << 16;
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
  }
  cute::tma_store_fence();  // this thread's writes, visible to the copy engine
  hopper::named_sync(1 + math, 128);
  if (leader) {
#pragma unroll
    for (int c = 0; c < kBlockN / kChunkRows; ++c)
      cute::SM90_TMA_STORE_3D::copy(&out_map, staging + c * kStagedBoxBytes, static_cast<int>(n0 + c * kChunkRows),
                                    static_cast<int>(first_row), static_cast<int>(matrix));
    cute::tma_store_arrive();
  }
  pending = true;
}

// kGatherA / kGatherB: the operand's rows are token rows gathered by cp.async (negative rows and columns past the
// operand fill zeros); otherwise the copy engine (TMA) brings it through a_map / b_map, 3-D {columns, rows, experts}
// with 64 x 64 boxes, except in a depth-grouped unit's last stage when it ends inside the stage: rows past the
// expert's are another expert's, so that stage copies the operand by cp.async too, with zeros past the expert's rows.
// c_map, the third map: G's float z [P, N] in boxes of [kBlockM rows][kZCols floats] (activation_gradient), the
// weight gradient [E][m][n] in 64 x 64 boxes (store_weights), any map otherwise.
template <typename T, Major kA, Major kB, bool kGatherA, bool kGatherB, Grouping kGroup, Epilogue kEpi>
__global__ void __launch_bounds__(kThreads, 1)
    backward_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                         const __grid_constant__ CUtensorMap c_map, const __grid_constant__ Params p) {
#if MOEKIT_SM90A_DEVICE
  static_assert(kGroup == Grouping::depth || kA == Major::k, "a row tile's rows are rows of A");
  static_assert(kGroup == Grouping::depth || kB == Major::k || !kGatherB, "weights are never gathered");
  static_assert(!kGatherA || kA == Major::mn || kGroup == Grouping::rows, "K-major gathered rows are a tile's");
  static_assert(
      (kGroup == Grouping::depth) == (kEpi == Epilogue::store_weights || kEpi == Epilogue::store_weights_transposed),
      "weight gradients group by depth");
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ uint8_t smem_raw[];
  // The 128-byte swizzle needs its stages 1 KB aligned.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  constexpr int kStages = kStagesOf<kEpi>;
  uint8_t* staging = smem + kStages * kStageBytes;  // kStagedStore: the math warpgroups' buffers
  auto* full = reinterpret_cast<uint64_t*>(staging + (kStagedStore<kEpi> ? 2 * kStagedGroupBytes : 0));
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], 128 + 1);  // a cp.async arrival per producer thread, and thread 0's expecting the copies
      Barrier::init(&empty[s], 2);       // one arrival per math warpgroup
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const uint32_t full_at = cute::cast_smem_ptr_to_uint(full), empty_at = cute::cast_smem_ptr_to_uint(empty);
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  auto k_blocks_of = [](const Unit& w) { return (w.k_end - w.k_begin + kStageK - 1) / kStageK; };

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x == 0) {
      if constexpr (!kGatherA) cute::prefetch_tma_descriptor(&a_map);
      if constexpr (!kGatherB) cute::prefetch_tma_descriptor(&b_map);
      if constexpr (kEpi == Epilogue::activation_gradient || kStagedStore<kEpi>) cute::prefetch_tma_descriptor(&c_map);
    }
    constexpr auto kHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
    constexpr int kAChunks = kBlockM / kChunkRows, kBChunks = kBlockN / kChunkRows;
    const T* a_base = static_cast<const T*>(p.A.base);
    int stage = 0;
    uint32_t phase = 0;
    int64_t hint = 0;
    for (int64_t u = blockIdx.x, units = unit_count<kGroup>(p); u < units; u += gridDim.x) {
      const Unit w = unit_of<kGroup>(p, u, hint);
      const T* b_base = static_cast<const T*>(p.B.base) + (kGroup == Grouping::rows ? w.expert * p.B.expert_stride : 0);
      const int e = kGroup == Grouping::rows ? static_cast<int>(w.expert) : 0;
      // A row tile's gathered rows, the same for every stage of the unit.
      int32_t tile_rows[kAChunks][4];
      if constexpr (kGatherA && kA == Major::k)
#pragma unroll
        for (int c = 0; c < kAChunks; ++c) chunk_rows(p.A, w.row_begin + c * kChunkRows, w.row_end, tile_rows[c]);
      // MN-major gathered rows (k rows) of the next stage, looked up while this one's copies run, so that the lookup's
      // latency hides behind the wait for a free stage.
      int32_t a_rows[4], b_rows[4];
      if constexpr (kGatherA && kA == Major::mn) chunk_rows(p.A, w.k_begin, w.k_end, a_rows);
      if constexpr (kGatherB) chunk_rows(p.B, w.k_begin, w.k_end, b_rows);
      for (int64_t kb = 0, blocks = k_blocks_of(w); kb < blocks; ++kb) {
        hopper::wait_stage(empty_at + 8 * stage, phase ^ 1, "backward empty", u, static_cast<int>(kb), stage, -1,
                           static_cast<int>(w.expert), 0);
        uint8_t* sa = smem + stage * kStageBytes;
        uint8_t* sb = sa + kABytes;
        const int64_t k0 = w.k_begin + kb * kStageK;
        const bool partial = kGroup == Grouping::depth && k0 + kStageK > w.k_end;
        const bool copy_a = !kGatherA && !partial, copy_b = !kGatherB && !partial;  // by the copy engine
        if (threadIdx.x == 0) {
          TxBarrier::arrive_and_expect_tx(&full[stage], (copy_a ? kABytes : 0) + (copy_b ? kBBytes : 0));
          const int k = static_cast<int>(k0);
          if (copy_a)
#pragma unroll
            for (int c = 0; c < kAChunks; ++c) {
              if constexpr (kA == Major::k)
                cute::SM90_TMA_LOAD_3D::copy(&a_map, &full[stage], kHint, sa + c * kChunkBytes, k,
                                             static_cast<int>(w.row_begin + c * kChunkRows), 0);
              else
                cute::SM90_TMA_LOAD_3D::copy(&a_map, &full[stage], kHint, sa + c * kChunkBytes,
                                             static_cast<int>(w.m0 + c * kChunkRows), k, 0);
            }
          if (copy_b)
#pragma unroll
            for (int c = 0; c < kBChunks; ++c) {
              if constexpr (kB == Major::k)
                cute::SM90_TMA_LOAD_3D::copy(&b_map, &full[stage], kHint, sb + c * kChunkBytes, k,
                                             static_cast<int>(w.n0 + c * kChunkRows), e);
              else
                cute::SM90_TMA_LOAD_3D::copy(&b_map, &full[stage], kHint, sb + c * kChunkBytes,
                                             static_cast<int>(w.n0 + c * kChunkRows), k, e);
            }
        }
        if (kGatherA || !copy_a) {
          if constexpr (kA == Major::k) {
#pragma unroll
            for (int c = 0; c < kAChunks; ++c) copy_chunk<T>(sa + c * kChunkBytes, p.A, a_base, tile_rows[c], k0);
          } else {
            if (!kGatherA) chunk_rows(p.A, k0, w.k_end, a_rows);  // a partial stage of an operand read by map
#pragma unroll
            for (int c = 0; c < kAChunks; ++c)
              copy_chunk<T>(sa + c * kChunkBytes, p.A, a_base, a_rows, w.m0 + c * kChunkRows);
          }
        }
        if constexpr (kB == Major::mn) {
          if (kGatherB || !copy_b) {
            // Neither operand gathered: B's k rows are those A took by cp.async in this same (partial) stage, kept in
            // one set of registers (two spilled the producer's).
            constexpr bool kSameRows = !kGatherA && !kGatherB && kA == Major::mn;
            if (!kSameRows && !kGatherB) chunk_rows(p.B, k0, w.k_end, b_rows);
            const int32_t(&rows)[4] = kSameRows ? a_rows : b_rows;
#pragma unroll
            for (int c = 0; c < kBChunks; ++c)
              copy_chunk<T>(sb + c * kChunkBytes, p.B, b_base, rows, w.n0 + c * kChunkRows);
          }
        }
        if (kb + 1 < blocks) {
          if constexpr (kGatherA && kA == Major::mn) chunk_rows(p.A, k0 + kStageK, w.k_end, a_rows);
          if constexpr (kGatherB) chunk_rows(p.B, k0 + kStageK, w.k_end, b_rows);
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(&full[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      // G: the unit's z tile behind its k stages, for the epilogue (kZCols above).
      if constexpr (kEpi == Epilogue::activation_gradient) {
        const ExpertsArgs& a = p.a;
        for (int s = 0, stages = z_stages_of(p, w); s < stages; ++s) {
          hopper::wait_stage(empty_at + 8 * stage, phase ^ 1, "backward z empty", u, s, stage, -1,
                             static_cast<int>(w.expert), 0);
          if (threadIdx.x == 0) {
            uint8_t* sz = smem + stage * kStageBytes;
            TxBarrier::arrive_and_expect_tx(&full[stage], a.has_gate ? 2 * kZBoxBytes : kZBoxBytes);
            const int64_t col = w.n0 + s * kZCols;
            const int row = static_cast<int>(w.row_begin);
            const int64_t first = a.has_gate && !a.concatenated ? 2 * col : col;
            const int64_t second = a.concatenated ? a.intermediate + col : first + kZCols;
            cute::SM90_TMA_LOAD_2D::copy(&c_map, &full[stage], kHint, sz, static_cast<int>(first), row);
            if (a.has_gate)
              cute::SM90_TMA_LOAD_2D::copy(&c_map, &full[stage], kHint, sz + kZBoxBytes, static_cast<int>(second), row);
          }
          cutlass::arch::cpasync_barrier_arrive_noinc(&full[stage]);
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kMathRegisters>();
    using Op = typename Wgmma<T, kA, kB>::type;
    const int math = warpgroup - 1;
    const bool leader = threadIdx.x % 128 == 0;
    float acc[kBlockN / 2];
    // This warpgroup's 64 rows of A: K-major, rows 64 math on (1,024-byte groups of 8); MN-major, chunk `math`.
    const uint64_t desc_a0 = descriptor<kA>(smem + math * kChunkBytes), desc_b0 = descriptor<kB>(smem + kABytes);
    const uint32_t desc_a_lo = static_cast<uint32_t>(desc_a0), desc_b_lo = static_cast<uint32_t>(desc_b0);
    const uint32_t desc_a_hi = static_cast<uint32_t>(desc_a0 >> 32), desc_b_hi = static_cast<uint32_t>(desc_b0 >> 32);
    int stage = 0;
    uint32_t phase = 0;
    int64_t hint = 0;
    bool pending = false;  // kStagedStore: a copy out of this warpgroup's staging buffer may be running
    for (int64_t u = blockIdx.x, units = unit_count<kGroup>(p); u < units; u += gridDim.x) {
      const Unit w = unit_of<kGroup>(p, u, hint);
      const int64_t blocks = k_blocks_of(w);
      if (blocks == 0) {
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.0f;
      }
      int previous = -1;
      for (int64_t kb = 0; kb < blocks; ++kb) {
        hopper::wait_stage(full_at + 8 * stage, phase, "backward full", u, static_cast<int>(kb), stage, -1,
                           static_cast<int>(w.expert), 1 + math);
        // cp.async wrote the stage through the generic proxy; wgmma reads it through the async one.
        cutlass::arch::fence_view_async_shared();
        const uint32_t offset = static_cast<uint32_t>(stage) * (kStageBytes >> 4);
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
        cute::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < kStageK / 16; ++kk)
          wgmma<Op>((static_cast<uint64_t>(desc_a_hi) << 32) | (desc_a_lo + offset + kk * kK16Step<kA>),
                    (static_cast<uint64_t>(desc_b_hi) << 32) | (desc_b_lo + offset + kk * kK16Step<kB>), acc,
                    kb > 0 || kk > 0, std::make_index_sequence<kBlockN / 2>{});
        cute::warpgroup_commit_batch();
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
        // One batch in flight: wait for the previous stage's products, then free it.
        cute::warpgroup_wait<1>();
        if (previous >= 0 && leader) Barrier::arrive(&empty[previous]);
        previous = stage;
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);
      if (previous >= 0 && leader) Barrier::arrive(&empty[previous]);

      const ExpertsArgs& a = p.a;
      if constexpr (kEpi == Epilogue::store_weights) {
        store_staged<T>(acc, staging + math * kStagedGroupBytes, c_map, w.expert, w.m0 + 64 * math, w.n0, math,
                        pending);
      } else if constexpr (kEpi == Epilogue::store_weights_transposed) {
        T* out = static_cast<T*>(p.out) + w.expert * p.out_expert_stride + w.n0 * p.ld_out + w.m0 + math * 64;
        store_tile_transposed<T>(acc, out, p.ld_out, p.m - (w.m0 + math * 64), p.n - w.n0);
      } else {
        const int64_t row0 = w.row_begin + math * 64;
        if constexpr (kEpi == Epilogue::activation_gradient) {
          const int z_stages = z_stages_of(p, w);
          if (a.act == Act::silu && a.has_gate && a.concatenated)
            activation_gradient_epilogue<T, true>(p, acc, row0, w.row_end, w.n0, smem, full_at, empty, z_stages, stage,
                                                  phase, math);
          else
            activation_gradient_epilogue<T, false>(p, acc, row0, w.row_end, w.n0, smem, full_at, empty, z_stages, stage,
                                                   phase, math);
        } else if constexpr (kEpi == Epilogue::store_float) {
          const T* bias = a.up_bias ? static_cast<const T*>(a.up_bias) + w.expert * p.n + w.n0 : nullptr;
          store_tile<float, T>(acc, static_cast<float*>(p.out) + row0 * p.ld_out + w.n0, p.ld_out, w.row_end - row0,
                               p.n - w.n0, bias);
        } else if (row0 + 64 <= w.row_end) {  // store_rows, 64 rows of the expert: staged
          store_staged<T>(acc, staging + math * kStagedGroupBytes, c_map, 0, row0, w.n0, math, pending);
        } else {
          store_tile<T, T>(acc, static_cast<T*>(p.out) + row0 * p.ld_out + w.n0, p.ld_out, w.row_end - row0, p.n - w.n0,
                           nullptr);
        }
      }
    }
    if constexpr (kStagedStore<kEpi>)
      if (pending && leader) cute::tma_store_wait<0>();  // the block's shared memory outlives the last copy's reads
  }
#else
  (void)c_map, (void)p;
  __trap();  // launched only on compute capability 9.0, where the sm_90a code exists
#endif
}

}  // namespace moekit::cuda::sm90_backward

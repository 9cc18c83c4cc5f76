// grouped_mm on the CPU: pairs sorted by expert, then one grouped product per projection over
// (expert, row block, column chunk) tasks shared by all threads. Each expert's weights are packed
// once into oneDNN's blocked layout (kept with the weight tensor's storage, so they live as long as
// the weights do) and reused by every call. The first projection's chunks hold gate and up columns
// of the same intermediate columns side by side, so the activation runs right after each chunk's
// product while its output is still in cache.
// Quantised weights are dequantised into the gemm dtype as they are packed (once, like any packing), so
// the products run at bf16 speed on exactly the dequantised weights; the packed copy costs bf16's memory
// next to the quantised bytes. FP8 weights with float scales (whose values bf16 cannot hold) multiply as
// codes instead: each 128-wide block's product of activation codes and weight codes is exact in its float
// sums, and the block's activation scale times its weight scale is applied to those sums (block-scaled
// codes; f32 products would cost twice bf16's time). They run on moekit's kernel (cpu/block_scaled_gemm.h,
// the weights packed as e4m3 bytes) where the CPU has AVX512-BF16, else on oneDNN with bf16 copies of the
// codes packed per block (see own_block_scaled_kernel).
// Decode-sized blocks read the quantised bytes in place (quantised gemv).
// Activations are quantised per row as they are gathered, and the hidden rows per 128-wide chunk right
// after the activation (a first-projection chunk is one activation group).
#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string_view>

#include "moekit/backends/builtin_backends.h"
#include "moekit/backends/cpu_expert_rows.h"
#include "moekit/backends/portable_backend.h"
#include "moekit/cpu/block_scaled_gemm.h"
#include "moekit/cpu/gemv.h"
#include "moekit/kernel_options.h"
#include "moekit/quantization.h"

namespace moekit::backends {
namespace {

// Intermediate columns per first-projection chunk (gate and up: 256 packed columns) and hidden
// columns per down-projection chunk: wide enough for oneDNN's kernels, narrow enough that an
// expert gives both threads several tasks.
constexpr int64_t kUpChunk = 128;
static_assert(kUpChunk % kActivationGroupSize == 0, "activation groups must not straddle first-projection chunks");
constexpr int64_t kDownChunk = 256;
// Rows per product: larger blocks reuse each packed chunk more while it is in cache.
constexpr int64_t kRowBlock = 512;
// Row counts above this are rounded up to a multiple of kRowRound (reading zeroed pad rows) so that
// only a few product shapes are ever compiled; small counts (decode) run exactly.
constexpr int64_t kExactRows = 8;
constexpr int64_t kRowRound = 16;

// Blocks of at most this many rows (decode) skip the packed product: one matrix-vector product per
// row over the weights where they lie reads them as a single sequential stream, which oneDNN's
// one-row product over the packed layout does not match (~25 vs ~32 GB/s here).
constexpr int64_t kGemvRows = 2;

// out[q] = row (first + q * step) of expert e's first (up) or second projection . v for q < count; weights
// not transposed (rows contiguous), read where they lie.
void gemv_weight_rows(const cpu::ExpertLayout& l, bool up, int64_t e, int64_t first, int64_t step, int64_t count,
                      const float* v, int64_t k_len, float* out) {
  if (l.quantized) {
    cpu::gemv_rows_quantized(up ? l.up_quantized(e) : l.down_quantized(e), first, step, v, out, count, k_len);
    return;
  }
  const cpu::MatrixView w = up ? l.up_matrix(e) : l.down_matrix(e);
  visit_float_dtype(up ? l.gate_up.dtype() : l.down.dtype(), [&](auto tag) {
    using W = typename decltype(tag)::type;
    cpu::gemv_rows(static_cast<const W*>(w.row(first)), w.stride_out * step, v, out, count, k_len);
  });
}

// A row of the gemm dtype as floats (converted into tmp when it is bf16).
const float* row_as_floats(const char* row, int64_t n, cpu::GemmDType dtype, std::vector<float>& tmp) {
  if (dtype == cpu::GemmDType::f32) return reinterpret_cast<const float*>(row);
  tmp.resize(static_cast<std::size_t>(n));
  const bf16* b = reinterpret_cast<const bf16*>(row);
  for (int64_t i = 0; i < n; ++i) tmp[static_cast<std::size_t>(i)] = to_float(b[i]);
  return tmp.data();
}

// A row of block-scaled codes (bf16) as the float values they stand for: code * its group's scale.
const float* codes_as_floats(const char* row, const float* scales, int64_t n, std::vector<float>& tmp) {
  tmp.resize(static_cast<std::size_t>(n));
  const bf16* b = reinterpret_cast<const bf16*>(row);
  for (int64_t i = 0; i < n; ++i) tmp[static_cast<std::size_t>(i)] = to_float(b[i]) * scales[i / kActivationGroupSize];
  return tmp.data();
}

int64_t rows_to_run(int64_t rows) {
  return rows <= kExactRows ? rows : (rows + kRowRound - 1) / kRowRound * kRowRound;
}

// One projection of every expert, packed in column chunks: chunks[e * per_expert + c].
struct PackedProjection {
  int64_t per_expert = 0;
  std::vector<std::unique_ptr<cpu::PackedWeights>> chunks;
  const cpu::PackedWeights& at(int64_t e, int64_t c) const {
    return *chunks[static_cast<std::size_t>(e * per_expert + c)];
  }
};

// The weight rows of first-projection chunk c, in the packed order: its gate columns, then its up columns
// (gated), or its columns.
std::vector<int64_t> up_chunk_outputs(const cpu::ExpertLayout& l, int64_t c) {
  const int64_t j0 = c * kUpChunk, width = std::min(kUpChunk, l.intermediate - j0);
  std::vector<int64_t> outputs;
  for (int64_t j = j0; j < j0 + width; ++j) outputs.push_back(l.has_gate ? l.gate_column(j) : j);
  if (l.has_gate)
    for (int64_t j = j0; j < j0 + width; ++j) outputs.push_back(l.up_column(j));
  return outputs;
}

// The weight rows (hidden columns) of second-projection chunk c.
std::vector<int64_t> down_chunk_outputs(const cpu::ExpertLayout& l, int64_t c) {
  const int64_t h0 = c * kDownChunk, width = std::min(kDownChunk, l.hidden - h0);
  std::vector<int64_t> outputs;
  for (int64_t h = h0; h < h0 + width; ++h) outputs.push_back(h);
  return outputs;
}

// Quantised weights also name their scales' bytes: packing dequantises with them. (Writing into the scales
// in place needs mark_modified() on the weights, as writing into the weights does.)
std::string pack_key(const char* what, const Tensor& w, const Tensor& scale, const cpu::ExpertLayout& l,
                     cpu::GemmDType g) {
  std::ostringstream os;
  os << "grouped_mm/" << what << "/" << static_cast<int>(g) << "/" << w.storage_offset_bytes() << "/"
     << shape_string(w.shape()) << "/" << dtype_name(w.dtype()) << "/" << l.has_gate << l.is_concatenated
     << l.is_transposed;
  if (scale.defined()) os << "/scales@" << scale.data() << "/" << dtype_name(scale.dtype());
  return os.str();
}

// Packs chunk c of every expert in parallel, in blocks of block_k along K: one block of k_len, or the 128-wide
// blocks of block-scaled codes, packed apart as entry (c * blocks + b) of the expert. outputs_of(c) lists the
// weight rows of chunk c in order, and gather(e, outputs, k0, width, rows) writes columns k0 .. k0 + width - 1
// of those rows of expert e in the gemm dtype.
template <typename Gather, typename Outputs>
std::shared_ptr<PackedProjection> pack(int64_t experts, int64_t chunks, int64_t k_len, int64_t block_k,
                                       cpu::GemmDType g, Gather&& gather, Outputs&& outputs_of) {
  const int64_t blocks = (k_len + block_k - 1) / block_k;
  auto packed = std::make_shared<PackedProjection>();
  packed->per_expert = chunks * blocks;
  packed->chunks.resize(static_cast<std::size_t>(experts * chunks * blocks));
#pragma omp parallel
  {
    std::vector<char> rows;
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < experts * chunks * blocks; ++task) {
      const int64_t e = task / (chunks * blocks), c = task / blocks % chunks, b = task % blocks;
      const int64_t k0 = b * block_k, width = std::min(block_k, k_len - k0);
      const std::vector<int64_t> outputs = outputs_of(c);
      rows.resize(outputs.size() * static_cast<std::size_t>(width) * cpu::gemm_dtype_size(g));
      gather(e, outputs, k0, width, rows.data());
      packed->chunks[static_cast<std::size_t>(task)] =
          std::make_unique<cpu::PackedWeights>(rows.data(), static_cast<int64_t>(outputs.size()), width, g);
    }
  }
  return packed;
}

// out [rows, cols] = the chunk's product over block-scaled codes: for each 128-wide block b of K, the
// product of the rows' codes a (bf16, row stride k_len; m rows run, the first `rows` kept) with the packed
// block (packed.at(e, first + b)), its float sums times a_scales[row, b] * the weight scale of each column
// (w.scale(outputs[col], 128 b)). partial holds m * cols floats; w_scales and block are scratch.
void multiply_block_scaled(const PackedProjection& packed, int64_t e, int64_t first, const cpu::QuantizedMatrix& w,
                           const std::vector<int64_t>& outputs, const char* a, int64_t k_len, int64_t m, int64_t rows,
                           const float* a_scales, int64_t a_scale_ld, float* out, float* partial,
                           std::vector<float>& w_scales, std::vector<bf16>& block) {
  const int64_t blocks = (k_len + kActivationGroupSize - 1) / kActivationGroupSize;
  const auto cols = static_cast<int64_t>(outputs.size());
  std::fill(out, out + rows * cols, 0.0f);
  w_scales.resize(static_cast<std::size_t>(cols));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kActivationGroupSize;
    // The block's columns of the rows, made contiguous: oneDNN falls back to its reference matmul for a
    // 128-deep bf16 product whose rows are strided (measured: 125 ms against 0.3 ms).
    const int64_t width = std::min(kActivationGroupSize, k_len - k0);
    block.resize(static_cast<std::size_t>(m * width));
    for (int64_t r = 0; r < m; ++r) {
      const auto* src = reinterpret_cast<const bf16*>(a) + r * k_len + k0;
      std::copy(src, src + width, block.data() + r * width);
    }
    packed.at(e, first + b).multiply(block.data(), width, m, partial, cols);
    for (int64_t q = 0; q < cols; ++q)
      w_scales[static_cast<std::size_t>(q)] = w.scale(outputs[static_cast<std::size_t>(q)], k0);
    for (int64_t r = 0; r < rows; ++r) {
      const float s = a_scales[r * a_scale_ld + b];
      const float* p = partial + r * cols;
      float* o = out + r * cols;
      for (int64_t q = 0; q < cols; ++q) o[q] += p[q] * (s * w_scales[static_cast<std::size_t>(q)]);
    }
  }
}

// The block-scaled products run on moekit's AVX512-BF16 kernel (block_scaled_gemm: the weights stay e4m3,
// half the bytes of a bf16 copy, converted per block in L1) where the CPU has AVX512-BF16 and VBMI, else as
// one oneDNN bf16 product per 128-wide block (multiply_block_scaled). KernelOptions::cpu_fp8_own_kernel false
// (MOEKIT_CPU_FP8_GEMM=onednn) picks the latter anyway (the tests run it on CPUs that have the kernel).
bool own_block_scaled_kernel() {
  return cpu::cpu_has_avx512_bf16() && kernel_options().cpu_fp8_own_kernel;
}

// One projection of every expert packed for block_scaled_gemm, per column chunk: chunks[e * per_expert + c].
struct BlockScaledProjection {
  int64_t per_expert = 0;
  std::vector<cpu::BlockScaledWeights> chunks;
  const cpu::BlockScaledWeights& at(int64_t e, int64_t c) const {
    return chunks[static_cast<std::size_t>(e * per_expert + c)];
  }
};

class GroupedMm final : public PortableBackend {
 public:
  GroupedMm() : PortableBackend(MOEKIT_CUDA_KERNELS(grouped_mm)) {}
  std::string_view name() const override { return "grouped_mm"; }
  std::string_view description() const override {
    return "pairs sorted by expert, one grouped product per projection over packed weights; best for many tokens";
  }

 protected:
  std::string cpu_kernel_path(const ExpertsProblem& p) const override {
    const std::string small = "; experts with at most 2 rows: matrix-vector products over the weights in place";
    if (cpu::uses_block_scaled_codes(p))
      return (own_block_scaled_kernel() ? "moekit's AVX512-BF16 block-scaled GEMM over e4m3 codes"
                                        : "oneDNN bf16 products per 128-wide block of e4m3 codes") +
             small;
    return std::string(p.config.quantization.quantized() ? "oneDNN grouped products over packed, dequantised weights"
                                                         : "oneDNN grouped products over packed weights") +
           small;
  }
  std::size_t cpu_workspace_bytes(const ExpertsProblem& p) const override {
    // Activations and hidden rows carry kRowRound pad rows for the rounded-up products.
    return cpu::RowBuffers(p, kRowRound, cpu::uses_block_scaled_codes(p)).total();
  }

  void cpu_forward(const ExpertsProblem& p, Tensor& out, void* workspace) override {
    const cpu::ExpertLayout layout(p);
    const bool codes = cpu::uses_block_scaled_codes(p);  // see multiply_block_scaled
    const cpu::RowBuffers z(p, kRowRound, codes);
    const cpu::ExpertRouting routing = cpu::route_by_expert(p.top_k_index, layout.experts);
    const int64_t E = layout.experts, H = z.hidden, I = z.intermediate;
    const std::size_t g = cpu::gemm_dtype_size(z.gemm);
    const int64_t up_chunks = (I + kUpChunk - 1) / kUpChunk, down_chunks = (H + kDownChunk - 1) / kDownChunk;
    const bool own = codes && own_block_scaled_kernel();
    const auto up = own ? nullptr : packed(layout, true, z.gemm, up_chunks, codes);
    const auto down = own ? nullptr : packed(layout, false, z.gemm, down_chunks, codes);
    const auto up_own = own ? packed_block_scaled(layout, true, up_chunks) : nullptr;
    const auto down_own = own ? packed_block_scaled(layout, false, down_chunks) : nullptr;
    const int64_t h_blocks = z.h_groups, i_blocks = z.i_groups;  // 128-wide blocks of K per projection

    char* x = z.x(workspace);
    char* hidden = z.hidden_rows(workspace);
    float* y = z.y(workspace);
    float* x_scales = codes ? z.x_scales(workspace) : nullptr;
    float* hidden_scales = codes ? z.hidden_scales(workspace) : nullptr;
    const int64_t rows = routing.rows();
    cpu::gather_rows(p.hidden_states, routing.row_token, z.gemm, x, layout.activations, x_scales);
    std::fill(x + static_cast<std::size_t>(rows * H) * g, x + static_cast<std::size_t>((rows + kRowRound) * H) * g, 0);
    std::fill(hidden + static_cast<std::size_t>(rows * I) * g,
              hidden + static_cast<std::size_t>((rows + kRowRound) * I) * g, 0);

    // (expert, first row, row count) blocks of the sorted rows.
    struct Block {
      int64_t e, first, rows;
    };
    std::vector<Block> blocks;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < routing.rows_of(e); r += kRowBlock)
        blocks.push_back({e, routing.offsets[e] + r, std::min(kRowBlock, routing.rows_of(e) - r)});
    const auto n_blocks = static_cast<int64_t>(blocks.size());

#pragma omp parallel
    {
      const auto scratch_floats = static_cast<std::size_t>(rows_to_run(kRowBlock) * std::max(2 * kUpChunk, kDownChunk));
      std::vector<float> scratch(scratch_floats), partial(codes && !own ? scratch_floats : 0), w_scales;
      std::vector<bf16> block;
      std::vector<float> chunk_bias, row_f32, activated(static_cast<std::size_t>(kUpChunk));
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < n_blocks * up_chunks; ++task) {
        const Block& b = blocks[static_cast<std::size_t>(task / up_chunks)];
        const int64_t c = task % up_chunks, j0 = c * kUpChunk, width = std::min(kUpChunk, I - j0);
        const int64_t cols = layout.has_gate ? 2 * width : width;
        if (b.rows <= kGemvRows && !layout.is_transposed) {
          const int64_t step = layout.is_concatenated ? 1 : 2;
          for (int64_t r = 0; r < b.rows; ++r) {
            const char* xr = x + static_cast<std::size_t>((b.first + r) * H) * g;
            const float* v = codes ? codes_as_floats(xr, x_scales + (b.first + r) * h_blocks, H, row_f32)
                                   : row_as_floats(xr, H, z.gemm, row_f32);
            float* out_row = scratch.data() + r * cols;
            gemv_weight_rows(layout, true, b.e, layout.has_gate ? layout.gate_column(j0) : j0, step, width, v, H,
                             out_row);
            if (layout.has_gate)
              gemv_weight_rows(layout, true, b.e, layout.up_column(j0), step, width, v, H, out_row + width);
          }
        } else if (own) {
          cpu::block_scaled_gemm(up_own->at(b.e, c), reinterpret_cast<const bf16*>(x) + b.first * H, H, b.rows,
                                 x_scales + b.first * h_blocks, h_blocks, scratch.data(), cols);
        } else if (codes) {
          multiply_block_scaled(*up, b.e, c * h_blocks, layout.up_quantized(b.e), up_chunk_outputs(layout, c),
                                x + static_cast<std::size_t>(b.first * H) * g, H, rows_to_run(b.rows), b.rows,
                                x_scales + b.first * h_blocks, h_blocks, scratch.data(), partial.data(), w_scales,
                                block);
        } else {
          up->at(b.e, c).multiply(x + static_cast<std::size_t>(b.first * H) * g, H, rows_to_run(b.rows), scratch.data(),
                                  cols);
        }
        if (layout.has_bias) {  // the chunk's bias columns, in the packed order, once per task
          chunk_bias.assign(static_cast<std::size_t>(cols), 0.0f);
          for (int64_t j = 0; j < width; ++j) {
            cpu::add_bias(layout.gate_up_bias, b.e, layout.has_gate ? layout.gate_column(j0 + j) : j0 + j, 1,
                          &chunk_bias[static_cast<std::size_t>(j)]);
            if (layout.has_gate)
              cpu::add_bias(layout.gate_up_bias, b.e, layout.up_column(j0 + j), 1,
                            &chunk_bias[static_cast<std::size_t>(width + j)]);
          }
        }
        for (int64_t r = 0; r < b.rows; ++r) {
          float* row = scratch.data() + r * cols;
          if (layout.has_bias)
            for (int64_t q = 0; q < cols; ++q) row[q] += chunk_bias[static_cast<std::size_t>(q)];
          char* dst = hidden + static_cast<std::size_t>((b.first + r) * I + j0) * g;
          cpu::activate_into(p.config, row, 1, row + width, 1, width, layout.activations, z.gemm, dst, activated.data(),
                             codes ? hidden_scales + (b.first + r) * i_blocks + j0 / kActivationGroupSize : nullptr);
        }
      }
      // The implicit barrier above: every hidden row is complete before the down projection.
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < n_blocks * down_chunks; ++task) {
        const Block& b = blocks[static_cast<std::size_t>(task / down_chunks)];
        const int64_t c = task % down_chunks, h0 = c * kDownChunk, cols = std::min(kDownChunk, H - h0);
        if (b.rows <= kGemvRows && !layout.is_transposed) {
          for (int64_t r = 0; r < b.rows; ++r) {
            const char* hr = hidden + static_cast<std::size_t>((b.first + r) * I) * g;
            const float* v = codes ? codes_as_floats(hr, hidden_scales + (b.first + r) * i_blocks, I, row_f32)
                                   : row_as_floats(hr, I, z.gemm, row_f32);
            gemv_weight_rows(layout, false, b.e, h0, 1, cols, v, I, scratch.data() + r * cols);
          }
        } else if (own) {
          cpu::block_scaled_gemm(down_own->at(b.e, c), reinterpret_cast<const bf16*>(hidden) + b.first * I, I, b.rows,
                                 hidden_scales + b.first * i_blocks, i_blocks, scratch.data(), cols);
        } else if (codes) {
          multiply_block_scaled(*down, b.e, c * i_blocks, layout.down_quantized(b.e), down_chunk_outputs(layout, c),
                                hidden + static_cast<std::size_t>(b.first * I) * g, I, rows_to_run(b.rows), b.rows,
                                hidden_scales + b.first * i_blocks, i_blocks, scratch.data(), partial.data(), w_scales,
                                block);
        } else {
          down->at(b.e, c).multiply(hidden + static_cast<std::size_t>(b.first * I) * g, I, rows_to_run(b.rows),
                                    scratch.data(), cols);
        }
        for (int64_t r = 0; r < b.rows; ++r) {
          float* dst = y + (b.first + r) * H + h0;
          std::copy(scratch.data() + r * cols, scratch.data() + (r + 1) * cols, dst);
          cpu::add_bias(layout.down_bias, b.e, h0, cols, dst);
        }
      }
    }
    cpu::combine_weighted(p, routing.pair_row, y, H, 0, routing.tokens, 0, out);
  }

 private:
  // Writes columns k0 .. k0 + width - 1 of rows `outputs` of expert e's first (up) or second projection in
  // the gemm dtype: converted or dequantised (whole rows), or as bf16 codes (block-scaled codes, any block).
  static auto row_gatherer(const cpu::ExpertLayout& l, bool up, int64_t k_len, cpu::GemmDType g, bool codes) {
    return [&l, up, k_len, g, codes](int64_t e, const std::vector<int64_t>& outputs, int64_t k0, int64_t width,
                                     void* dst) {
      if (codes) {
        cpu::gather_weight_codes(up ? l.up_quantized(e) : l.down_quantized(e), outputs, k0, width,
                                 static_cast<bf16*>(dst));
        return;
      }
      MOEKIT_CHECK(k0 == 0 && width == k_len, "grouped_mm: whole rows are packed unless packing codes");
      if (l.quantized)
        cpu::gather_weight_rows(up ? l.up_quantized(e) : l.down_quantized(e), outputs, k_len, g, dst);
      else
        cpu::gather_weight_rows(up ? l.up_matrix(e) : l.down_matrix(e), up ? l.gate_up.dtype() : l.down.dtype(),
                                outputs, k_len, g, dst);
    };
  }

  // Chunk c's products of one projection, packed once per weights (kept with their storage): whole rows, or
  // with block-scaled codes (g bf16) per 128-wide block of K.
  static std::shared_ptr<PackedProjection> packed(const cpu::ExpertLayout& l, bool up, cpu::GemmDType g, int64_t chunks,
                                                  bool codes) {
    const int64_t k_len = up ? l.hidden : l.intermediate;
    const Tensor& weights = up ? l.gate_up : l.down;
    const char* what = up ? (codes ? "up-codes" : "up") : (codes ? "down-codes" : "down");
    const std::string key = pack_key(what, weights, up ? l.gate_up_scale : l.down_scale, l, g);
    auto made = weights.storage()->attachment(key, [&]() -> std::shared_ptr<void> {
      return pack(l.experts, chunks, k_len, codes ? kActivationGroupSize : k_len, g,
                  row_gatherer(l, up, k_len, g, codes),
                  [&](int64_t c) { return up ? up_chunk_outputs(l, c) : down_chunk_outputs(l, c); });
    });
    return std::static_pointer_cast<PackedProjection>(made);
  }

  // The same chunks packed for block_scaled_gemm (FP8 weights with float scales), once per weights.
  static std::shared_ptr<BlockScaledProjection> packed_block_scaled(const cpu::ExpertLayout& l, bool up,
                                                                    int64_t chunks) {
    const int64_t k_len = up ? l.hidden : l.intermediate;
    const Tensor& weights = up ? l.gate_up : l.down;
    const std::string key = pack_key(up ? "up-block-scaled" : "down-block-scaled", weights,
                                     up ? l.gate_up_scale : l.down_scale, l, cpu::GemmDType::bf16);
    auto made = weights.storage()->attachment(key, [&]() -> std::shared_ptr<void> {
      auto packed = std::make_shared<BlockScaledProjection>();
      packed->per_expert = chunks;
      packed->chunks.resize(static_cast<std::size_t>(l.experts * chunks));
#pragma omp parallel for schedule(dynamic)
      for (int64_t task = 0; task < l.experts * chunks; ++task) {
        const int64_t e = task / chunks, c = task % chunks;
        packed->chunks[static_cast<std::size_t>(task)] =
            cpu::pack_block_scaled(up ? l.up_quantized(e) : l.down_quantized(e),
                                   up ? up_chunk_outputs(l, c) : down_chunk_outputs(l, c), k_len);
      }
      return packed;
    });
    return std::static_pointer_cast<BlockScaledProjection>(made);
  }
};

}  // namespace

std::shared_ptr<ExpertsBackend> make_grouped_mm() {
  return std::make_shared<GroupedMm>();
}

}  // namespace moekit::backends

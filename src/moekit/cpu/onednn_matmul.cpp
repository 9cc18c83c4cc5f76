#include "moekit/cpu/onednn_matmul.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

#include "moekit/error.h"

namespace moekit::cpu {
namespace {

using dnnl::memory;
using Dims = memory::dims;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// Streams are cheap handles; one per thread keeps concurrent executions independent.
dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

memory::data_type to_dnnl(GemmDType d) {
  return d == GemmDType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
}

// oneDNN multiplies bf16 only where the CPU has AVX-512 (its avx512_core and newer kernels); elsewhere
// (AVX2-only CPUs) it cannot create a bf16 product at all. There the bf16 operands are widened to f32
// and multiplied in f32: each product of two bf16 values is exact in f32 and the sums are f32 either
// way, so the results are those of a bf16 product up to the order of the sums.
bool bf16_products_supported() {
  static const bool supported = [] {
    try {
      const auto bf16 = memory::data_type::bf16;
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(memory::desc({16, 16}, bf16, memory::format_tag::ab),
                                                      memory::desc({16, 16}, bf16, memory::format_tag::ab),
                                                      memory::desc({16, 16}, memory::data_type::f32,
                                                                   memory::format_tag::ab)),
                                   cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return supported;
}

// The dtype oneDNN runs a product of `dtype` operands in.
GemmDType compute_dtype(GemmDType dtype) {
  return dtype == GemmDType::bf16 && !bf16_products_supported() ? GemmDType::f32 : dtype;
}

// count bf16 values at src into floats.
void widen_bf16(const void* src, std::size_t count, float* dst) {
  const auto* s = static_cast<const bf16*>(src);
  for (std::size_t i = 0; i < count; ++i) dst[i] = to_float(s[i]);
}

// a [m, k] (row stride lda) as f32 rows of k, in a buffer of the calling thread: the activation operand of
// a widened bf16 product.
const float* widened_rows(const void* a, int64_t lda, int64_t m, int64_t k) {
  thread_local std::vector<float> rows;
  rows.resize(static_cast<std::size_t>(m * k));
  for (int64_t r = 0; r < m; ++r)
    widen_bf16(static_cast<const bf16*>(a) + r * lda, static_cast<std::size_t>(k), rows.data() + r * k);
  return rows.data();
}

// The blocked weight layout oneDNN prefers for an [K, N] product, fixed per (K, N, dtype) so that one
// packing serves products of every row count. Chosen from a 64-row product.
memory::desc packed_layout(int64_t n, int64_t k, GemmDType dtype) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, GemmDType>, memory::desc> layouts;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_tuple(n, k, dtype);
  auto it = layouts.find(key);
  if (it != layouts.end()) return it->second;
  const auto dt = to_dnnl(dtype);
  dnnl::matmul::primitive_desc pd(
      dnnl::matmul::desc(memory::desc({64, k}, dt, memory::format_tag::ab),
                         memory::desc({k, n}, dt, memory::format_tag::any),
                         memory::desc({64, n}, memory::data_type::f32, memory::format_tag::ab)),
      cpu_engine());
  return layouts.emplace(key, pd.weights_desc()).first->second;
}

// Products are created once per thread and shape and reused (oneDNN's own cache also holds the JIT
// code, but creating a primitive still costs tens of microseconds).
struct ProductKey {
  int64_t m, n, k, lda, ldc, stride_k, stride_n;
  GemmDType dtype;
  bool packed;
  auto tie() const { return std::tie(m, n, k, lda, ldc, stride_k, stride_n, dtype, packed); }
  bool operator<(const ProductKey& o) const { return tie() < o.tie(); }
};

struct Product {
  dnnl::matmul primitive;
  memory::desc a, w, c;
};

const Product& product_for(const ProductKey& key, const memory::desc* packed) {
  thread_local std::map<ProductKey, Product> products;
  auto it = products.find(key);
  if (it != products.end()) return it->second;
  const auto dt = to_dnnl(key.dtype);
  Product p;
  p.a = memory::desc({key.m, key.k}, dt, Dims{key.lda, 1});
  p.w = packed ? *packed : memory::desc({key.k, key.n}, dt, Dims{key.stride_k, key.stride_n});
  p.c = memory::desc({key.m, key.n}, memory::data_type::f32, Dims{key.ldc, 1});
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.a, p.w, p.c), cpu_engine());
  p.primitive = dnnl::matmul(pd);
  return products.emplace(key, std::move(p)).first->second;
}

void execute(const Product& p, const void* a, const void* w, float* c) {
  auto& engine = cpu_engine();
  memory am(p.a, engine, const_cast<void*>(a));
  memory wm(p.w, engine, const_cast<void*>(w));
  memory cm(p.c, engine, c);
  auto& stream = thread_stream();
  p.primitive.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, cm}});
  stream.wait();
}

}  // namespace

GemmDType gemm_dtype_for(DType activation_dtype) {
  return activation_dtype == DType::bf16 ? GemmDType::bf16 : GemmDType::f32;
}

std::size_t gemm_dtype_size(GemmDType dtype) {
  return dtype == GemmDType::bf16 ? 2 : 4;
}

struct PackedWeights::Impl {
  memory::desc layout;
  memory packed;
};

PackedWeights::PackedWeights(const void* rows_nk, int64_t n, int64_t k, GemmDType dtype)
    : impl_(std::make_unique<Impl>()), n_(n), k_(k), dtype_(dtype) {
  MOEKIT_CHECK(n > 0 && k > 0, "PackedWeights: empty matrix ", n, "x", k);
  const GemmDType packed_dtype = compute_dtype(dtype);
  std::vector<float> widened;
  if (packed_dtype != dtype) {
    widened.resize(static_cast<std::size_t>(n * k));
    widen_bf16(rows_nk, widened.size(), widened.data());
    rows_nk = widened.data();
  }
  impl_->layout = packed_layout(n, k, packed_dtype);
  impl_->packed = memory(impl_->layout, cpu_engine());
  // The source is W^T row-major, i.e. W [K, N] with strides (1, K): oneDNN's "ba".
  memory source(memory::desc({k, n}, to_dnnl(packed_dtype), memory::format_tag::ba), cpu_engine(),
                const_cast<void*>(rows_nk));
  auto& stream = thread_stream();
  dnnl::reorder(source, impl_->packed).execute(stream, source, impl_->packed);
  stream.wait();
}

PackedWeights::~PackedWeights() = default;

std::size_t PackedWeights::bytes() const {
  return impl_->layout.get_size();
}

void PackedWeights::multiply(const void* a, int64_t lda, int64_t m, float* c, int64_t ldc) const {
  if (m == 0) return;
  const GemmDType compute = compute_dtype(dtype_);
  if (compute != dtype_) {
    a = widened_rows(a, lda, m, k_);
    lda = k_;
  }
  const ProductKey key{m, n_, k_, lda, ldc, 0, 0, compute, true};
  execute(product_for(key, &impl_->layout), a, impl_->packed.get_data_handle(), c);
}

void matmul_strided(const void* a, int64_t lda, int64_t m, const void* w, int64_t k, int64_t n, int64_t stride_k,
                    int64_t stride_n, GemmDType dtype, float* c, int64_t ldc) {
  if (m == 0) return;
  MOEKIT_CHECK(stride_k == 1 || stride_n == 1, "matmul_strided: one weight stride must be 1, got ", stride_k, ", ",
               stride_n);
  const GemmDType compute = compute_dtype(dtype);
  thread_local std::vector<float> widened_weights;
  if (compute != dtype) {
    a = widened_rows(a, lda, m, k);
    lda = k;
    // Every element W is read at, widened in place: the same strides then address the f32 copy.
    const auto extent = k > 0 && n > 0 ? static_cast<std::size_t>((k - 1) * stride_k + (n - 1) * stride_n + 1) : 0;
    widened_weights.resize(extent);
    widen_bf16(w, extent, widened_weights.data());
    w = widened_weights.data();
  }
  const ProductKey key{m, n, k, lda, ldc, stride_k, stride_n, compute, false};
  execute(product_for(key, nullptr), a, w, c);
}

}  // namespace moekit::cpu

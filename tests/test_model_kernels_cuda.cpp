// The CUDA kernels of the model runtime (cuda/model_kernels.h) against their CPU counterparts
// (model_ops and route), element by element: every dtype, odd sizes (scalar fallbacks) and aligned
// ones (16-byte paths), outputs poisoned before each run. f32 within 1e-5 relative, 16-bit within
// about one rounding of the dtype (1e-2 relative), copies exact; router ids exactly equal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "harness.h"
#include "moekit/cuda/model_kernels.h"
#include "moekit/model/model_ops.h"
#include "moekit/model/router.h"
#include "moekit/model/sampling.h"

namespace moekit {
namespace {

#define SKIP_WITHOUT_CUDA() \
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why

constexpr DType kDtypes[] = {DType::f32, DType::f16, DType::bf16};

// Element tolerance: |got - want| <= rtol * |want| + floor * max|want| (the floor covers results that
// cancel to near zero, where a different float summation order shows as a large relative error).
struct Tolerance {
  double rtol = 0, floor = 0;
};
constexpr Tolerance kExact{0, 0};
Tolerance tolerance_of(DType dtype) {
  return dtype == DType::f32 ? Tolerance{1e-5, 1e-5} : Tolerance{1e-2, 1e-3};
}

Tensor random_tensor(Shape shape, DType dtype, uint64_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = normal(rng);
  return t.to(dtype);
}

Tensor gpu(const Tensor& t) {
  return t.to(Device::cuda());
}
// An uninitialised device tensor filled with 0xFF bytes (NaN in every float dtype).
Tensor poisoned(Shape shape, DType dtype) {
  Tensor t = Tensor::empty(std::move(shape), dtype, Device::cuda());
  t.fill_bytes(0xFF);
  return t;
}
Tensor cpu(const Tensor& t) {
  synchronize(Device::cuda());
  return t.to(Device::cpu());
}

::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, Tolerance tol) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << shape_string(got.shape()) << " vs "
                                         << shape_string(want.shape());
  const std::vector<float> g = test::values_of(got), w = test::values_of(want);
  double scale = 0;
  for (float v : w)
    if (std::isfinite(v)) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  int64_t bad = 0, first = -1;
  for (std::size_t i = 0; i < g.size(); ++i) {
    bool ok;
    if (std::isnan(w[i]) || std::isnan(g[i]))
      ok = std::isnan(w[i]) && std::isnan(g[i]);
    else if (tol.rtol == 0 && tol.floor == 0)
      ok = g[i] == w[i];
    else
      ok = std::fabs(static_cast<double>(g[i]) - w[i]) <= tol.rtol * std::fabs(w[i]) + tol.floor * scale;
    if (!ok && bad++ == 0) first = static_cast<int64_t>(i);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << g.size() << " elements differ; first at " << first
                                       << ": got " << g[static_cast<std::size_t>(first)] << ", want "
                                       << w[static_cast<std::size_t>(first)] << " (max |want| " << scale << ")";
}

// Equal bytes (a captured step must reproduce a launched one exactly, not within a tolerance).
::testing::AssertionResult bitwise_equal(const Tensor& got, const Tensor& want) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << got.describe() << " vs " << want.describe();
  const Tensor g = cpu(got), w = cpu(want);
  const auto* a = static_cast<const unsigned char*>(g.data());
  const auto* b = static_cast<const unsigned char*>(w.data());
  for (std::size_t i = 0; i < g.nbytes(); ++i)
    if (a[i] != b[i]) return ::testing::AssertionFailure() << "byte " << i << " of " << g.nbytes() << " differs";
  return ::testing::AssertionSuccess();
}

// An int32 [1] on the GPU holding value: a step's position as the kernels read it from device memory.
Tensor device_int(int64_t value) {
  return gpu(test::ids_of({value}, {1}, DType::i32));
}

Tensor device_workspace(std::size_t bytes) {
  return Tensor::empty({static_cast<int64_t>(std::max<std::size_t>(bytes, 1))}, DType::u8, Device::cuda());
}

TEST(ModelKernelsCuda, EmbeddingCopiesRowsExactly) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : kDtypes)
    for (int64_t H : {64, 33, 8}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " H=" + std::to_string(H));
      const int64_t V = 97;
      const Tensor table = random_tensor({V, H}, dtype, 1);
      const std::vector<int32_t> ids = {0, 96, 5, 5, 41, 13, 96, 0, 77};
      const int64_t T = static_cast<int64_t>(ids.size());
      const Tensor ids_gpu = gpu(test::ids_of({ids.begin(), ids.end()}, {T}, DType::i32));
      const Tensor table_gpu = gpu(table);
      Tensor out = poisoned({T, H}, dtype);
      cuda::embedding_forward(table_gpu.data(), ids_gpu.data_as<int32_t>(), T, H, dtype, out.data(), nullptr);
      EXPECT_TRUE(all_close(cpu(out), model_ops::embedding(table, ids), kExact));
    }
}

TEST(ModelKernelsCuda, RmsNormMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : kDtypes)
    for (int64_t D : {64, 1000, 4099}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " D=" + std::to_string(D));
      const int64_t R = 7;
      const Tensor x = random_tensor({R, D}, dtype, 2 + D, 3.0f);
      const Tensor w = random_tensor({D}, dtype, 3 + D);
      const Tensor x_gpu = gpu(x), w_gpu = gpu(w);
      Tensor out = poisoned({R, D}, dtype);
      cuda::rms_norm_forward(x_gpu.data(), w_gpu.data(), R, D, 1e-6f, dtype, out.data(), nullptr);
      EXPECT_TRUE(all_close(cpu(out), model_ops::rms_norm(x, w, 1e-6), tolerance_of(dtype)));
    }
}

struct LinearCase {
  int64_t T, K, N;
  bool bias;
};

TEST(ModelKernelsCuda, LinearMatchesCpuAtDecodeAndPrefillSizes) {
  SKIP_WITHOUT_CUDA();
  // T <= 8: the weight-streaming kernel (K % 8 == 0: 16-byte loads, else the scalar path);
  // T > 8: the tensor-core GEMM (16-bit, K % 8 == 0) or the CUDA-core one (f32, odd K).
  const LinearCase cases[] = {
      {1, 4096, 1024, false}, {1, 2048, 37, true}, {2, 1000, 130, false}, {3, 4095, 65, true},     {5, 512, 300, false},
      {8, 2056, 513, true},   {9, 256, 64, false}, {300, 512, 384, true}, {333, 1000, 515, false}, {129, 77, 50, true}};
  for (DType dtype : kDtypes)
    for (const LinearCase& c : cases) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) +
                   " N=" + std::to_string(c.N) + (c.bias ? " bias" : ""));
      const Tensor x = random_tensor({c.T, c.K}, dtype, 10 + c.T);
      const Tensor w = random_tensor({c.N, c.K}, dtype, 20 + c.N, 0.05f);
      const Tensor b = c.bias ? random_tensor({c.N}, dtype, 30 + c.N) : Tensor();
      const Tensor x_gpu = gpu(x), w_gpu = gpu(w), b_gpu = c.bias ? gpu(b) : Tensor();
      Tensor workspace = device_workspace(cuda::linear_workspace_bytes(c.T, c.K, c.N));
      Tensor out = poisoned({c.T, c.N}, dtype);
      cuda::linear_forward(x_gpu.data(), w_gpu.data(), c.bias ? b_gpu.data() : nullptr, c.T, c.K, c.N, dtype,
                           out.data(), workspace.data(), nullptr);
      EXPECT_TRUE(all_close(cpu(out), model_ops::linear(x, w, b), tolerance_of(dtype)));

      // The float32 product (DeepSeek-V3's router logits): x.float() @ w.float()^T, no rounding.
      Tensor out32 = poisoned({c.T, c.N}, DType::f32);
      cuda::linear_forward_f32(x_gpu.data(), w_gpu.data(), c.T, c.K, c.N, dtype, out32.data_as<float>(),
                               workspace.data(), nullptr);
      EXPECT_TRUE(
          all_close(cpu(out32), model_ops::linear(x.to(DType::f32), w.to(DType::f32)), tolerance_of(DType::f32)));
    }
}

TEST(ModelKernelsCuda, AddAndClampMatchCpuExactly) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t n = 1003;
    Tensor h = random_tensor({n}, dtype, 40, 2.0f);
    const Tensor a = random_tensor({n}, dtype, 41, 2.0f);
    Tensor h_gpu = gpu(h);
    const Tensor a_gpu = gpu(a);
    cuda::add_in_place(h_gpu.data(), a_gpu.data(), n, dtype, nullptr);
    model_ops::add_in_place(h, a);
    EXPECT_TRUE(all_close(cpu(h_gpu), h, kExact));

    // NaN stays NaN through the clamp, as std::clamp leaves it.
    Tensor x = random_tensor({n}, DType::f32, 42, 3.0f);
    x.data_as<float>()[17] = std::numeric_limits<float>::quiet_NaN();
    x.data_as<float>()[18] = std::numeric_limits<float>::infinity();
    x = x.to(dtype);
    Tensor x_gpu = gpu(x);
    cuda::clamp_in_place(x_gpu.data(), n, 2.5f, dtype, nullptr);
    model_ops::clamp_in_place(x, 2.5f);
    EXPECT_TRUE(all_close(cpu(x_gpu), x, kExact));
  }
}

TEST(ModelKernelsCuda, CopyColumnsMatchesCpuAndLeavesTheRestOfDst) {
  SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t cols, begin, end, dst_cols, dst_begin;
  };
  // Unaligned (2-byte units), 4-byte units, and 16-byte units for every dtype.
  const Case cases[] = {{70, 13, 50, 60, 5}, {64, 2, 34, 40, 4}, {128, 16, 48, 64, 32}};
  for (DType dtype : kDtypes)
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " [" + std::to_string(c.begin) + ", " + std::to_string(c.end) +
                   ")");
      const int64_t R = 9, width = c.end - c.begin;
      const Tensor src = random_tensor({R, c.cols}, dtype, 50);
      const Tensor src_gpu = gpu(src);
      Tensor dst = poisoned({R, c.dst_cols}, dtype);
      cuda::copy_columns(src_gpu.data(), R, c.cols, c.begin, c.end, dst.data(), c.dst_cols, c.dst_begin, dtype,
                         nullptr);
      const Tensor got = cpu(dst);
      EXPECT_TRUE(all_close(got.slice(1, c.dst_begin, c.dst_begin + width).contiguous(),
                            model_ops::columns(src, c.begin, c.end), kExact));
      // Outside the copied columns dst keeps its poison.
      const std::vector<float> all = test::values_of(got);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < c.dst_cols; ++j)
          if (j < c.dst_begin || j >= c.dst_begin + width) {
            ASSERT_TRUE(std::isnan(all[static_cast<std::size_t>(r * c.dst_cols + j)])) << r << ", " << j;
          }
    }
}

TEST(ModelKernelsCuda, ConversionsMatchCpuExactly) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t n = 777;
    const Tensor f = random_tensor({n}, DType::f32, 60, 10.0f);
    const Tensor f_gpu = gpu(f);
    Tensor d = poisoned({n}, dtype);
    cuda::float_to_dtype(f_gpu.data_as<float>(), n, dtype, d.data(), nullptr);
    EXPECT_TRUE(all_close(cpu(d), f.to(dtype), kExact));
    Tensor back = poisoned({n}, DType::f32);
    cuda::dtype_to_float(d.data(), n, dtype, back.data_as<float>(), nullptr);
    EXPECT_TRUE(all_close(cpu(back), f.to(dtype).to(DType::f32), kExact));
  }
}

TEST(ModelKernelsCuda, SigmoidGateRoundsAsTheCpu) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t T = 300;
    const Tensor logits = random_tensor({T}, DType::f32, 70, 4.0f);
    const Tensor logits_gpu = gpu(logits);
    Tensor w = poisoned({T}, DType::f32);
    cuda::sigmoid_gate_forward(logits_gpu.data_as<float>(), T, dtype, w.data_as<float>(), nullptr);
    // moe_block.cpp: round(1 / (1 + exp(-round(logit)))) in the activation dtype.
    Tensor want = Tensor::empty({T}, DType::f32);
    visit_float_dtype(dtype, [&](auto tag) {
      using S = typename decltype(tag)::type;
      for (int64_t t = 0; t < T; ++t) {
        const float l = to_float(from_float<S>(logits.data_as<float>()[t]));
        want.data_as<float>()[t] = to_float(from_float<S>(1.0f / (1.0f + std::exp(-l))));
      }
    });
    // expf may differ from the CPU's in the last float bit, which can move a 16-bit rounding.
    EXPECT_TRUE(all_close(cpu(w), want, dtype == DType::f32 ? Tolerance{1e-6, 0} : Tolerance{1e-2, 0}));
  }
}

std::vector<float> default_inv_freq(int64_t half, double base) {
  std::vector<float> f(static_cast<std::size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    f[static_cast<std::size_t>(i)] =
        static_cast<float>(1.0 / std::pow(base, 2.0 * static_cast<double>(i) / (2 * half)));
  return f;
}

TEST(ModelKernelsCuda, RotaryMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t tokens, heads, head_stride, offset, half, positions_begin;
    bool interleaved;
    float attention_factor;
  };
  const Case cases[] = {
      {5, 4, 64, 0, 32, 0, false, 1.0f},      // Llama-style halves
      {3, 2, 128, 0, 64, 4000, false, 1.0f},  // far positions (large angles)
      {4, 3, 192, 128, 32, 17, true, 1.2f},   // DeepSeek: rope part after the nope part, interleaved
      {2, 5, 80, 8, 16, 9, false, 1.0f},      // partial rotary inside the head
      {1, 2, 576, 0, 288, 123, true, 0.9f},   // half above 256 would be refused; 288 checks the bound
  };
  for (DType dtype : kDtypes)
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " half=" + std::to_string(c.half) +
                   (c.interleaved ? " interleaved" : ""));
      if (c.half > 256) {
        EXPECT_TRUE(test::throws_error_with(
            [&] {
              cuda::rotary_forward(nullptr, c.tokens, c.heads, c.head_stride, c.offset, c.half, nullptr,
                                   c.attention_factor, c.interleaved, c.positions_begin, nullptr, dtype, nullptr);
            },
            {"half = 288"}));
        continue;
      }
      model_ops::RotaryTables rope;
      rope.inv_freq = default_inv_freq(c.half, 10000.0);
      rope.attention_factor = c.attention_factor;
      rope.interleaved = c.interleaved;
      Tensor x = random_tensor({c.tokens, c.heads * c.head_stride}, dtype, 80 + c.half);
      Tensor x_gpu = gpu(x);
      const Tensor inv_freq = gpu(test::tensor_of(rope.inv_freq, {c.half}));
      Tensor x_gpu_device_position = gpu(x);
      cuda::rotary_forward(x_gpu.data(), c.tokens, c.heads, c.head_stride, c.offset, c.half, inv_freq.data_as<float>(),
                           c.attention_factor, c.interleaved, c.positions_begin, nullptr, dtype, nullptr);
      // The position read from device memory (a captured decode step's): the same bits.
      const Tensor position = device_int(c.positions_begin);
      cuda::rotary_forward(x_gpu_device_position.data(), c.tokens, c.heads, c.head_stride, c.offset, c.half,
                           inv_freq.data_as<float>(), c.attention_factor, c.interleaved, 0, position.data_as<int32_t>(),
                           dtype, nullptr);
      EXPECT_TRUE(bitwise_equal(x_gpu_device_position, x_gpu));
      model_ops::apply_rotary(x, c.heads, c.head_stride, c.offset, rope, c.positions_begin);
      // cos/sin may differ in the last float bit (CUDA's cosf vs glibc's), which can move the rounding
      // of the 16-bit table by one unit: 1e-2 of the largest value covers it, and untouched columns
      // must still match exactly.
      const Tolerance tol = dtype == DType::f32 ? Tolerance{1e-5, 1e-6} : Tolerance{1e-2, 1e-2};
      EXPECT_TRUE(all_close(cpu(x_gpu), x, tol));
    }
}

struct AttentionCase {
  int64_t tokens, past, query_heads, key_heads, key_dim, value_dim, sliding_window;
  bool sinks;
};

// Runs one case with q in a row of extra width (a fused qkv projection's layout) and k, v interleaved
// in one cache [S, Hk, dk + dv], against model_ops::attention on the same (rounded) values.
void check_attention(const AttentionCase& c, DType dtype, uint64_t seed) {
  const int64_t T = c.tokens, S = c.past + T, Hq = c.query_heads, Hk = c.key_heads, dk = c.key_dim, dv = c.value_dim;
  const int64_t q_row = Hq * dk + 8, cache_head = dk + dv, cache_row = Hk * cache_head;
  const Tensor q = random_tensor({T, q_row}, dtype, seed);
  const Tensor cache = random_tensor({S, cache_row}, dtype, seed + 1);
  const Tensor sinks = random_tensor({Hq}, DType::f32, seed + 2, 2.0f);
  const std::vector<float> qf = test::values_of(q), cf = test::values_of(cache);
  std::vector<float> q_dense(static_cast<std::size_t>(T * Hq * dk)), k_dense(static_cast<std::size_t>(S * Hk * dk)),
      v_dense(static_cast<std::size_t>(S * Hk * dv));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < Hq * dk; ++i)
      q_dense[static_cast<std::size_t>(t * Hq * dk + i)] = qf[static_cast<std::size_t>(t * q_row + i)];
  for (int64_t j = 0; j < S; ++j)
    for (int64_t h = 0; h < Hk; ++h) {
      for (int64_t d = 0; d < dk; ++d)
        k_dense[static_cast<std::size_t>((j * Hk + h) * dk + d)] =
            cf[static_cast<std::size_t>(j * cache_row + h * cache_head + d)];
      for (int64_t d = 0; d < dv; ++d)
        v_dense[static_cast<std::size_t>((j * Hk + h) * dv + d)] =
            cf[static_cast<std::size_t>(j * cache_row + h * cache_head + dk + d)];
    }
  model_ops::AttentionShape shape;
  shape.tokens = T;
  shape.past = c.past;
  shape.query_heads = Hq;
  shape.key_heads = Hk;
  shape.key_dim = dk;
  shape.value_dim = dv;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(dk));
  shape.sliding_window = c.sliding_window;
  shape.sinks = c.sinks ? sinks.data_as<float>() : nullptr;
  const Tensor want = model_ops::attention(q_dense.data(), k_dense.data(), v_dense.data(), shape, dtype);

  const Tensor q_gpu = gpu(q), cache_gpu = gpu(cache), sinks_gpu = gpu(sinks);
  Tensor out = poisoned({T, Hq * dv}, dtype);
  cuda::AttentionArgs a;
  a.tokens = T;
  a.past = c.past;
  a.query_heads = Hq;
  a.key_heads = Hk;
  a.key_dim = dk;
  a.value_dim = dv;
  a.q_row = q_row;
  a.k_row = cache_row;
  a.k_head = cache_head;
  a.v_row = cache_row;
  a.v_head = cache_head;
  a.scale = shape.scale;
  a.sliding_window = c.sliding_window;
  a.sinks = c.sinks ? sinks_gpu.data_as<float>() : nullptr;
  a.dtype = dtype;
  a.q = q_gpu.data();
  a.k = cache_gpu.data();
  a.v = static_cast<const unsigned char*>(cache_gpu.data()) + dk * static_cast<int64_t>(dtype_size(dtype));
  a.out = out.data();
  cuda::attention_forward(a, nullptr);
  EXPECT_TRUE(all_close(cpu(out), want, tolerance_of(dtype)));

  // past read from device memory, with the keys in a cache allocated longer than S whose extra rows
  // hold NaN (a captured decode step's full-length cache): the same bits.
  Tensor long_cache = poisoned({S + 40, cache_row}, dtype);
  model_ops::write_rows(long_cache, 0, cache_gpu);
  const Tensor past = device_int(c.past);
  Tensor out_device_past = poisoned({T, Hq * dv}, dtype);
  a.past = 0;
  a.past_device = past.data_as<int32_t>();
  a.k = long_cache.data();
  a.v = static_cast<const unsigned char*>(long_cache.data()) + dk * static_cast<int64_t>(dtype_size(dtype));
  a.out = out_device_past.data();
  cuda::attention_forward(a, nullptr);
  EXPECT_TRUE(bitwise_equal(out_device_past, out));
}

TEST(ModelKernelsCuda, AttentionMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const AttentionCase cases[] = {
      {5, 0, 4, 4, 64, 64, 0, false},       // prefill from empty
      {3, 37, 8, 2, 128, 128, 0, false},    // past > 0, grouped-query attention
      {1, 3000, 4, 1, 128, 128, 0, false},  // decode against a long cache
      {20, 50, 4, 2, 64, 64, 16, false},    // sliding window
      {6, 10, 4, 2, 64, 64, 0, true},       // GPT-OSS sinks
      {7, 300, 4, 2, 64, 64, 128, true},    // both
      {4, 9, 2, 1, 36, 20, 0, false},       // odd head dims: scalar key loads
      {3, 65, 4, 4, 192, 128, 0, false},    // DeepSeek-V3's dk != dv
      {2, 40, 2, 2, 256, 256, 0, false},    // the largest head dim
  };
  for (DType dtype : kDtypes)
    for (const AttentionCase& c : cases) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " T=" + std::to_string(c.tokens) +
                   " past=" + std::to_string(c.past) + " Hq=" + std::to_string(c.query_heads) +
                   " Hk=" + std::to_string(c.key_heads) + " dk=" + std::to_string(c.key_dim) +
                   " dv=" + std::to_string(c.value_dim) + " window=" + std::to_string(c.sliding_window) +
                   (c.sinks ? " sinks" : ""));
      check_attention(c, dtype, 90 + static_cast<uint64_t>(c.past));
    }
}

// ---- Routers ----

struct RouterCase {
  RouterKind kind;
  int64_t tokens, experts, top_k, n_group, topk_group;
  bool norm;
  float scaling;
};

int kind_code(RouterKind kind) {
  return kind == RouterKind::softmax_topk ? 0 : kind == RouterKind::topk_softmax ? 1 : 2;
}

// Runs route() and route_forward on the same logits; ids exactly equal, weights within 1e-6 (relative
// above 1), NaN where the CPU gives NaN.
void check_router(const RouterCase& c, const std::vector<float>& logits, const std::vector<float>& bias) {
  RouterConfig config;
  config.kind = c.kind;
  config.num_experts = c.experts;
  config.top_k = c.top_k;
  config.norm_topk_prob = c.norm;
  config.n_group = c.n_group;
  config.topk_group = c.topk_group;
  config.routed_scaling_factor = c.scaling;
  const Tensor logits_cpu = test::tensor_of(logits, {c.tokens, c.experts});
  const Tensor bias_cpu = c.kind == RouterKind::deepseek_v3 ? test::tensor_of(bias, {c.experts}) : Tensor();
  const RouterOutput want = route(logits_cpu, config, bias_cpu);

  const Tensor logits_gpu = gpu(logits_cpu);
  const Tensor bias_gpu = bias_cpu.defined() ? gpu(bias_cpu) : Tensor();
  Tensor ids = poisoned({c.tokens, c.top_k}, DType::i64);
  Tensor weights = poisoned({c.tokens, c.top_k}, DType::f32);
  cuda::RouterArgs a;
  a.kind = kind_code(c.kind);
  a.tokens = c.tokens;
  a.experts = c.experts;
  a.top_k = c.top_k;
  a.n_group = c.n_group;
  a.topk_group = c.topk_group;
  a.norm_topk_prob = c.norm;
  a.routed_scaling_factor = c.scaling;
  a.logits = logits_gpu.data_as<float>();
  a.correction_bias = bias_gpu.defined() ? bias_gpu.data_as<float>() : nullptr;
  a.ids = ids.data_as<int64_t>();
  a.weights = weights.data_as<float>();
  cuda::route_forward(a, nullptr);
  const Tensor got_ids = cpu(ids), got_weights = cpu(weights);
  const int64_t* gi = got_ids.data_as<int64_t>();
  const int64_t* wi = want.top_k_index.data_as<int64_t>();
  const float* gw = got_weights.data_as<float>();
  const float* ww = want.top_k_weights.data_as<float>();
  int64_t reported = 0;
  for (int64_t i = 0; i < c.tokens * c.top_k && reported < 5; ++i) {
    const bool id_ok = gi[i] == wi[i];
    const bool weight_ok =
        (std::isnan(ww[i]) && std::isnan(gw[i])) || std::fabs(gw[i] - ww[i]) <= 1e-6 * std::max(1.0f, std::fabs(ww[i]));
    if (!id_ok || !weight_ok) {
      ADD_FAILURE() << "token " << i / c.top_k << " slot " << i % c.top_k << ": got expert " << gi[i] << " weight "
                    << gw[i] << ", want expert " << wi[i] << " weight " << ww[i];
      ++reported;
    }
  }
}

// Logits whose selection scores (and DeepSeek's group scores) are at least `gap` apart within each row,
// so that the devices' last-bit differences in exp cannot reorder them; rows are redrawn until so.
std::vector<float> separated_logits(const RouterCase& c, const std::vector<float>& bias, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  std::vector<float> logits(static_cast<std::size_t>(c.tokens * c.experts));
  auto separated = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    for (std::size_t i = 1; i < v.size(); ++i)
      if (v[i] - v[i - 1] < 1e-5 * std::max(1.0, std::fabs(v[i]))) return false;
    return true;
  };
  for (int64_t t = 0; t < c.tokens; ++t) {
    float* row = logits.data() + t * c.experts;
    for (;;) {
      std::vector<double> score(static_cast<std::size_t>(c.experts));
      for (int64_t e = 0; e < c.experts; ++e) {
        row[e] = uniform(rng);
        score[static_cast<std::size_t>(e)] =
            c.kind == RouterKind::deepseek_v3
                ? 1.0 / (1.0 + std::exp(-static_cast<double>(row[e]))) + bias[static_cast<std::size_t>(e)]
                : row[e];
      }
      bool ok = separated(score);
      if (ok && c.kind == RouterKind::deepseek_v3 && c.n_group > 1) {
        const int64_t G = c.experts / c.n_group;
        std::vector<double> groups;
        for (int64_t g = 0; g < c.n_group; ++g) {
          std::vector<double> s(score.begin() + g * G, score.begin() + (g + 1) * G);
          std::sort(s.rbegin(), s.rend());
          groups.push_back(s[0] + s[1]);
        }
        ok = separated(groups);
      }
      if (ok) break;
    }
  }
  return logits;
}

std::vector<float> random_bias(int64_t experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-0.1f, 0.1f);
  std::vector<float> b(static_cast<std::size_t>(experts));
  for (float& v : b) v = uniform(rng);
  return b;
}

TEST(ModelKernelsCuda, RoutersMatchCpu) {
  SKIP_WITHOUT_CUDA();
  const RouterCase cases[] = {
      {RouterKind::softmax_topk, 37, 64, 8, 1, 1, false, 1.0f},   // Qwen2-MoE
      {RouterKind::softmax_topk, 19, 128, 8, 1, 1, true, 1.0f},   // Qwen3-MoE
      {RouterKind::softmax_topk, 5, 8, 2, 1, 1, true, 1.0f},      // Mixtral
      {RouterKind::softmax_topk, 3, 60, 1, 1, 1, false, 1.0f},    // K = 1, E not a multiple of 32
      {RouterKind::softmax_topk, 2, 16, 16, 1, 1, true, 1.0f},    // K = E
      {RouterKind::topk_softmax, 17, 32, 4, 1, 1, false, 1.0f},   // GPT-OSS
      {RouterKind::topk_softmax, 4, 128, 16, 1, 1, false, 1.0f},  // K = 16
      {RouterKind::deepseek_v3, 23, 256, 8, 8, 4, true, 2.5f},    // DeepSeek-V3
      {RouterKind::deepseek_v3, 6, 64, 6, 1, 1, false, 1.0f},     // one group
      {RouterKind::deepseek_v3, 9, 96, 5, 48, 3, true, 1.5f},     // groups of two
      {RouterKind::deepseek_v3, 1, 256, 16, 8, 2, true, 1.0f},    // K = all of the two groups kept
  };
  uint64_t seed = 100;
  for (const RouterCase& c : cases) {
    SCOPED_TRACE(std::string(router_kind_name(c.kind)) + " E=" + std::to_string(c.experts) +
                 " K=" + std::to_string(c.top_k) + " n_group=" + std::to_string(c.n_group));
    const std::vector<float> bias = random_bias(c.experts, seed++);
    check_router(c, separated_logits(c, bias, seed++), bias);
  }
}

TEST(ModelKernelsCuda, RoutersBreakTiesAndRankNaNAsTheCpu) {
  SKIP_WITHOUT_CUDA();
  const int64_t E = 64;
  // Row 0: all equal (ids 0..K-1); row 1: four values repeated (ties everywhere); row 2: a NaN logit
  // (NaN ranks first); row 3: +inf (NaN softmax weights); row 4: -inf logits among finite ones.
  std::vector<float> logits(static_cast<std::size_t>(5 * E));
  for (int64_t e = 0; e < E; ++e) {
    logits[static_cast<std::size_t>(e)] = 0.5f;
    logits[static_cast<std::size_t>(E + e)] = static_cast<float>((e * 7) % 4);
    logits[static_cast<std::size_t>(2 * E + e)] = static_cast<float>(e % 5) - 2.0f;
    logits[static_cast<std::size_t>(3 * E + e)] = static_cast<float>(e % 3);
    logits[static_cast<std::size_t>(4 * E + e)] =
        e % 2 ? -std::numeric_limits<float>::infinity() : static_cast<float>(e % 6);
  }
  logits[static_cast<std::size_t>(2 * E + 40)] = std::numeric_limits<float>::quiet_NaN();
  logits[static_cast<std::size_t>(3 * E + 9)] = std::numeric_limits<float>::infinity();
  // DeepSeek: a bias of equal values per group makes equal group scores (the lower group wins).
  std::vector<float> bias(static_cast<std::size_t>(E));
  for (int64_t e = 0; e < E; ++e) bias[static_cast<std::size_t>(e)] = static_cast<float>((e / 8) % 2) * 0.25f;
  const RouterCase cases[] = {
      {RouterKind::softmax_topk, 5, E, 6, 1, 1, false, 1.0f}, {RouterKind::softmax_topk, 5, E, 6, 1, 1, true, 1.0f},
      {RouterKind::topk_softmax, 5, E, 6, 1, 1, false, 1.0f}, {RouterKind::deepseek_v3, 5, E, 6, 8, 3, true, 2.0f},
      {RouterKind::deepseek_v3, 5, E, 6, 1, 1, false, 1.0f},
  };
  for (const RouterCase& c : cases) {
    SCOPED_TRACE(std::string(router_kind_name(c.kind)) + " n_group=" + std::to_string(c.n_group) +
                 (c.norm ? " norm" : ""));
    check_router(c, logits, bias);
  }
}

TEST(ModelKernelsCuda, WriteRowsAtTakesTheRowFromDeviceMemory) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : kDtypes)
    for (int64_t C : {64, 33}) {  // 16-byte and 2-byte units
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " C=" + std::to_string(C));
      const int64_t R = 20, n = 3, row = 11;
      const Tensor src = random_tensor({n, C}, dtype, 90 + C);
      Tensor dst = poisoned({R, C}, dtype);
      const Tensor at = device_int(row);
      cuda::write_rows_at(gpu(src).data(), n, C, dst.data(), at.data_as<int32_t>(), dtype, nullptr);
      const Tensor got = cpu(dst);
      EXPECT_TRUE(all_close(got.slice(0, row, row + n).contiguous(), src, kExact));
      const std::vector<float> all = test::values_of(got);
      for (int64_t r = 0; r < R; ++r) {
        if (r >= row && r < row + n) continue;
        for (int64_t j = 0; j < C; ++j) ASSERT_TRUE(std::isnan(all[static_cast<std::size_t>(r * C + j)])) << r;
      }
    }
}

TEST(ModelKernelsCuda, ArgmaxPicksAsGreedyPickToken) {
  SKIP_WITHOUT_CUDA();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> rows = {
      {1, 3, 3, 2},           // ties: the first
      {kNaN, 2, 5, kNaN, 5},  // NaN is never picked while a number is there
      {kNaN, kNaN, kNaN},     // all NaN: the last (pick_token's scan ends there)
      {-kInf, -kInf},         // all -inf: the first
      {-kInf, kNaN, -3},      // -inf, NaN, a number
      {kInf, 1, kInf},        // +inf ties
      {7},
  };
  std::vector<float> vocabulary(151936);  // a real vocabulary size: every thread sees many values
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& v : vocabulary) v = normal(rng);
  vocabulary[151935] = 40.0f;
  vocabulary[70001] = 40.0f;  // the same largest value earlier: this one
  rows.push_back(vocabulary);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::vector<float>& row = rows[i];
    const int64_t V = static_cast<int64_t>(row.size());
    std::mt19937_64 unused;
    const int32_t want = pick_token(row, GenerationConfig(), unused);
    const Tensor got = model_ops::argmax(gpu(test::tensor_of(row, {1, V})));
    EXPECT_EQ(cpu(got).data_as<int32_t>()[0], want) << "row " << i;
  }
}

TEST(ModelKernelsCuda, FillWritesEveryElement) {
  SKIP_WITHOUT_CUDA();
  const Tensor ones = cpu(model_ops::full({37, 1}, DType::f32, 1.0, Device::cuda()));
  for (int64_t i = 0; i < 37; ++i) EXPECT_EQ(ones.data_as<float>()[i], 1.0f);
  const Tensor zeros = cpu(model_ops::full({1000}, DType::i64, 0, Device::cuda()));
  for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(zeros.data_as<int64_t>()[i], 0);
  EXPECT_TRUE(
      test::throws_error_with([] { model_ops::full({4}, DType::bf16, 0, Device::cuda()); }, {"f32, i32 or i64"}));
}

}  // namespace
}  // namespace moekit

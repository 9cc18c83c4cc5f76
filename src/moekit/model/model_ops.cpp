#include "moekit/model/model_ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "moekit/cpu/gemv.h"
#include "moekit/cpu/onednn_matmul.h"
#include "moekit/dtype.h"
#include "moekit/error.h"
#if MOEKIT_HAS_CUDA
#include "moekit/cuda/model_kernels.h"
#endif

namespace moekit::model_ops {
namespace {

void check_contiguous(const Tensor& t, const char* op, const char* name) {
  MOEKIT_CHECK(t.defined(), op, ": ", name, " is undefined");
  MOEKIT_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got ", t.describe());
  MOEKIT_CHECK(is_floating(t.dtype()), op, ": ", name, " holds ", dtype_name(t.dtype()), ", expected f32, f16 or bf16");
}

void check_same_device(const Tensor& a, const Tensor& b, const char* op, const char* name) {
  MOEKIT_CHECK(!b.defined() || a.device() == b.device(), op, ": ", name, " is on ", device_name(b.device()), ", not on ",
               device_name(a.device()));
}

thread_local Stream stream_of_thread;  // StreamScope's; null: the legacy default stream

#if MOEKIT_HAS_CUDA
cudaStream_t cuda_stream() {
  return static_cast<cudaStream_t>(stream_of_thread.handle);
}
#endif

#if !MOEKIT_HAS_CUDA
// A tensor on a GPU in a build without CUDA (cannot be made; kept so every branch is well-formed).
[[noreturn]] void no_cuda(const char* op) {
  MOEKIT_FAIL(op, ": this build of moekit has no CUDA support");
}
#endif

// Threads for a loop of `work` units of about `unit_flops` each: one thread for small work, where
// waking the others costs more than it saves.
int threads_for(int64_t work, double unit_flops) {
  if (work <= 1 || static_cast<double>(work) * unit_flops < 2e5) return 1;
  return static_cast<int>(std::min<int64_t>(work, omp_get_max_threads()));
}

// A float32 copy of a 16-bit weight, made once and kept with the weight's storage: oneDNN has no f16
// product on this CPU (see onednn_matmul.h), so f16 models multiply in float32.
const float* weight_as_f32(const Tensor& w) {
  const auto key = "model_ops/f32/" + std::to_string(w.storage_offset_bytes()) + "/" + shape_string(w.shape());
  const auto copy = w.storage()->attachment(key, [&]() -> std::shared_ptr<void> {
    return std::make_shared<Tensor>(w.to(DType::f32));
  });
  return static_cast<const Tensor*>(copy.get())->data_as<float>();
}

}  // namespace

StreamScope::StreamScope(Stream stream) : previous_(stream_of_thread) {
  stream_of_thread = stream;
}
StreamScope::~StreamScope() {
  stream_of_thread = previous_;
}
Stream current_stream() {
  return stream_of_thread;
}

std::vector<float> to_float_vector(const Tensor& x_any) {
  check_contiguous(x_any, "to_float_vector", "x");
  const Tensor x = x_any.device().is_cpu() ? x_any : x_any.to(Device::cpu());
  std::vector<float> out(static_cast<std::size_t>(x.numel()));
  visit_float_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* s = x.data_as<T>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = to_float(s[i]);
  });
  return out;
}

void check_token_ids(std::span<const int32_t> ids, int64_t vocab) {
  for (std::size_t t = 0; t < ids.size(); ++t)
    MOEKIT_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id ", ids[t], " at position ", t,
                 " is outside the vocabulary [0, ", vocab, ")");
}

Tensor embedding(const Tensor& table, std::span<const int32_t> ids) {
  check_contiguous(table, "embedding", "table");
  MOEKIT_CHECK(table.dim() == 2, "embedding: table must be [V, H], got ", table.describe());
  check_token_ids(ids, table.size(0));
  const Tensor host_ids =
      Tensor::from_blob(const_cast<int32_t*>(ids.data()), {static_cast<int64_t>(ids.size())}, DType::i32);
  return embedding(table, table.device().is_cuda() ? host_ids.to(table.device()) : host_ids);
}

Tensor embedding(const Tensor& table, const Tensor& ids) {
  check_contiguous(table, "embedding", "table");
  check_same_device(table, ids, "embedding", "ids");
  MOEKIT_CHECK(table.dim() == 2, "embedding: table must be [V, H], got ", table.describe());
  MOEKIT_CHECK(ids.dim() == 1 && ids.dtype() == DType::i32 && ids.is_contiguous(),
               "embedding: ids must be a contiguous i32 [T], got ", ids.describe());
  const int64_t T = ids.size(0), H = table.size(1);
  Tensor out = Tensor::empty({T, H}, table.dtype(), table.device());
  if (table.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    cuda::embedding_forward(table.data(), ids.data_as<int32_t>(), T, H, table.dtype(), out.data(), cuda_stream());
    return out;
#else
    no_cuda("embedding");
#endif
  }
  const int32_t* id = ids.data_as<int32_t>();
  check_token_ids({id, static_cast<std::size_t>(T)}, table.size(0));
  const std::size_t row = static_cast<std::size_t>(H) * dtype_size(table.dtype());
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(static_cast<unsigned char*>(out.data()) + static_cast<std::size_t>(t) * row,
                static_cast<const unsigned char*>(table.data()) + static_cast<std::size_t>(id[t]) * row, row);
  return out;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_contiguous(x, "rms_norm", "x");
  check_contiguous(weight, "rms_norm", "weight");
  check_same_device(x, weight, "rms_norm", "weight");
  MOEKIT_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
               "rms_norm: x must be [R, D] and weight [D], got ", x.describe(), " and ", weight.describe());
  const int64_t R = x.size(0), D = x.size(1);
  Tensor out = Tensor::empty({R, D}, x.dtype(), x.device());
  if (x.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    cuda::rms_norm_forward(x.data(), weight.data(), R, D, static_cast<float>(eps), x.dtype(), out.data(),
                           cuda_stream());
    return out;
#else
    no_cuda("rms_norm");
#endif
  }
  const std::vector<float> w = to_float_vector(weight);
  visit_float_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xs = x.data_as<T>();
    T* os = out.data_as<T>();
#pragma omp parallel for schedule(static) num_threads(threads_for(R, 4.0 * static_cast<double>(D)))
    for (int64_t r = 0; r < R; ++r) {
      const T* row = xs + r * D;
      float sum = 0;
      for (int64_t d = 0; d < D; ++d) {
        const float v = to_float(row[d]);
        sum += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t d = 0; d < D; ++d) {
        const float normalised = to_float(from_float<T>(to_float(row[d]) * inv));
        os[r * D + d] = from_float<T>(w[static_cast<std::size_t>(d)] * normalised);
      }
    }
  });
  return out;
}

namespace {

void check_linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_contiguous(x, "linear", "x");
  check_contiguous(weight, "linear", "weight");
  check_same_device(x, weight, "linear", "weight");
  check_same_device(x, bias, "linear", "bias");
  MOEKIT_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1),
               "linear: x must be [T, K] and weight [N, K], got ", x.describe(), " and ", weight.describe());
  MOEKIT_CHECK(x.dtype() == weight.dtype(), "linear: x holds ", dtype_name(x.dtype()), ", weight ",
               dtype_name(weight.dtype()), ": they must match");
  if (bias.defined()) {
    check_contiguous(bias, "linear", "bias");
    MOEKIT_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), "linear: bias must be [", weight.size(0),
                 "], got ", bias.describe());
  }
}

#if MOEKIT_HAS_CUDA
// The device scratch of one CUDA linear product.
Tensor linear_workspace(const Tensor& x, int64_t out_features) {
  const auto bytes = cuda::linear_workspace_bytes(x.size(0), x.size(1), out_features);
  return Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, x.device());
}
#endif

// x @ weight^T in float on the CPU: [T * N] values.
std::vector<float> cpu_product(const Tensor& x, const Tensor& weight) {
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  std::vector<float> acc(static_cast<std::size_t>(T * N));
  if (T <= 2) {
    // Decode: stream the weight once per row, split over threads by output rows.
    const std::vector<float> xf = to_float_vector(x);
    constexpr int64_t kRowsPerTask = 64;
    const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
    visit_float_dtype(weight.dtype(), [&](auto tag) {
      using W = typename decltype(tag)::type;
      const W* ws = weight.data_as<W>();
#pragma omp parallel for schedule(static) num_threads(threads_for(tasks, 2.0 * kRowsPerTask * static_cast<double>(K)))
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t n0 = task * kRowsPerTask, rows = std::min(kRowsPerTask, N - n0);
        for (int64_t t = 0; t < T; ++t)
          cpu::gemv_rows(ws + n0 * K, K, xf.data() + t * K, acc.data() + t * N + n0, rows, K);
      }
    });
  } else if (x.dtype() == DType::f16) {
    const std::vector<float> xf = to_float_vector(x);
    cpu::matmul_strided(xf.data(), K, T, weight_as_f32(weight), K, N, 1, K, cpu::GemmDType::f32, acc.data(), N);
  } else {
    // W^T (k, n) lies at weight[n * K + k]: read in place.
    cpu::matmul_strided(x.data(), K, T, weight.data(), K, N, 1, K, cpu::gemm_dtype_for(x.dtype()), acc.data(), N);
  }
  return acc;
}

}  // namespace

Tensor linear_f32(const Tensor& x, const Tensor& weight) {
  check_linear(x, weight, Tensor());
  const int64_t T = x.size(0), N = weight.size(0);
  Tensor out = Tensor::empty({T, N}, DType::f32, x.device());
  if (x.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    Tensor workspace = linear_workspace(x, N);
    cuda::linear_forward_f32(x.data(), weight.data(), T, x.size(1), N, x.dtype(), out.data_as<float>(),
                             workspace.data(), cuda_stream());
    return out;
#else
    no_cuda("linear_f32");
#endif
  }
  const std::vector<float> acc = cpu_product(x, weight);
  std::copy(acc.begin(), acc.end(), out.data_as<float>());
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_linear(x, weight, bias);
  const int64_t T = x.size(0), N = weight.size(0);
  if (x.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    Tensor out = Tensor::empty({T, N}, x.dtype(), x.device());
    Tensor workspace = linear_workspace(x, N);
    cuda::linear_forward(x.data(), weight.data(), bias.defined() ? bias.data() : nullptr, T, x.size(1), N, x.dtype(),
                         out.data(), workspace.data(), cuda_stream());
    return out;
#else
    no_cuda("linear");
#endif
  }
  const std::vector<float> acc = cpu_product(x, weight);
  const std::vector<float> b = bias.defined() ? to_float_vector(bias) : std::vector<float>();
  Tensor out = Tensor::empty({T, N}, x.dtype());
  visit_float_dtype(x.dtype(), [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    T_* os = out.data_as<T_>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const float v = acc[static_cast<std::size_t>(t * N + n)] + (b.empty() ? 0.0f : b[static_cast<std::size_t>(n)]);
        os[t * N + n] = from_float<T_>(v);
      }
  });
  return out;
}

void add_in_place(Tensor& h, const Tensor& a) {
  check_contiguous(h, "add_in_place", "h");
  check_contiguous(a, "add_in_place", "a");
  check_same_device(h, a, "add_in_place", "a");
  MOEKIT_CHECK(h.shape() == a.shape() && h.dtype() == a.dtype(), "add_in_place: ", h.describe(), " and ",
               a.describe(), " differ");
  if (h.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    cuda::add_in_place(h.data(), a.data(), h.numel(), h.dtype(), cuda_stream());
    return;
#else
    no_cuda("add_in_place");
#endif
  }
  visit_float_dtype(h.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* hs = h.data_as<T>();
    const T* as = a.data_as<T>();
    const int64_t n = h.numel();
    for (int64_t i = 0; i < n; ++i) hs[i] = from_float<T>(to_float(hs[i]) + to_float(as[i]));
  });
}

void clamp_in_place(Tensor& x, float limit) {
  check_contiguous(x, "clamp_in_place", "x");
  if (x.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    cuda::clamp_in_place(x.data(), x.numel(), limit, x.dtype(), cuda_stream());
    return;
#else
    no_cuda("clamp_in_place");
#endif
  }
  visit_float_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* xs = x.data_as<T>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) xs[i] = from_float<T>(std::clamp(to_float(xs[i]), -limit, limit));
  });
}

Tensor columns(const Tensor& x, int64_t begin, int64_t end) {
  check_contiguous(x, "columns", "x");
  MOEKIT_CHECK(x.dim() == 2 && 0 <= begin && begin <= end && end <= x.size(1), "columns: [", begin, ", ", end,
               ") of ", x.describe());
  if (x.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    Tensor out = Tensor::empty({x.size(0), end - begin}, x.dtype(), x.device());
    cuda::copy_columns(x.data(), x.size(0), x.size(1), begin, end, out.data(), end - begin, 0, x.dtype(),
                       cuda_stream());
    return out;
#else
    no_cuda("columns");
#endif
  }
  return x.slice(1, begin, end).contiguous();
}

void copy_columns(const Tensor& src, int64_t begin, int64_t end, Tensor& dst, int64_t dst_begin) {
  check_contiguous(src, "copy_columns", "src");
  check_contiguous(dst, "copy_columns", "dst");
  check_same_device(dst, src, "copy_columns", "src");
  MOEKIT_CHECK(src.dim() == 2 && dst.dim() == 2 && src.size(0) == dst.size(0) && src.dtype() == dst.dtype() &&
                   0 <= begin && begin <= end && end <= src.size(1) && dst_begin >= 0 &&
                   dst_begin + end - begin <= dst.size(1),
               "copy_columns: [", begin, ", ", end, ") of ", src.describe(), " to column ", dst_begin, " of ",
               dst.describe());
  if (dst.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    cuda::copy_columns(src.data(), src.size(0), src.size(1), begin, end, dst.data(), dst.size(1), dst_begin,
                       dst.dtype(), cuda_stream());
    return;
#else
    no_cuda("copy_columns");
#endif
  }
  const std::size_t es = dtype_size(src.dtype());
  for (int64_t r = 0; r < src.size(0); ++r)
    std::memcpy(static_cast<unsigned char*>(dst.data()) + static_cast<std::size_t>(r * dst.size(1) + dst_begin) * es,
                static_cast<const unsigned char*>(src.data()) + static_cast<std::size_t>(r * src.size(1) + begin) * es,
                static_cast<std::size_t>(end - begin) * es);
}

void write_rows(Tensor& dst, int64_t row, const Tensor& src, const int32_t* row_device) {
  check_contiguous(dst, "write_rows", "dst");
  check_contiguous(src, "write_rows", "src");
  check_same_device(dst, src, "write_rows", "src");
  MOEKIT_CHECK(dst.dim() == 2 && src.dim() == 2 && src.size(1) == dst.size(1) && dst.dtype() == src.dtype() &&
                   row >= 0 && row + src.size(0) <= dst.size(0),
               "write_rows: ", src.describe(), " at row ", row, " of ", dst.describe());
  if (dst.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    if (row_device != nullptr) {
      cuda::write_rows_at(src.data(), src.size(0), src.size(1), dst.data(), row_device, dst.dtype(), cuda_stream());
      return;
    }
    const int64_t n = src.numel();
    // One row of n elements, written at element row * C of dst.
    cuda::copy_columns(src.data(), 1, n, 0, n, dst.data(), dst.numel(), row * dst.size(1), dst.dtype(), cuda_stream());
    return;
#else
    (void)row_device;
    no_cuda("write_rows");
#endif
  }
  std::memcpy(static_cast<unsigned char*>(dst.data()) + static_cast<std::size_t>(row * dst.size(1)) *
                                                              dtype_size(dst.dtype()),
              src.data(), src.nbytes());
}

Tensor convert(const Tensor& x, DType dtype) {
  if (x.device().is_cpu()) return x.to(dtype);
#if MOEKIT_HAS_CUDA
  check_contiguous(x, "convert", "x");
  if (x.dtype() == dtype) return x;
  MOEKIT_CHECK(x.dtype() == DType::f32 || dtype == DType::f32, "convert on CUDA: ", dtype_name(x.dtype()), " -> ",
               dtype_name(dtype), " (one side must be f32)");
  Tensor out = Tensor::empty(x.shape(), dtype, x.device());
  if (x.dtype() == DType::f32) {
    cuda::float_to_dtype(x.data_as<float>(), x.numel(), dtype, out.data(), cuda_stream());
  } else {
    cuda::dtype_to_float(x.data(), x.numel(), x.dtype(), out.data_as<float>(), cuda_stream());
  }
  return out;
#else
  no_cuda("convert");
#endif
}

RouterOutput route_on_device(const Tensor& logits, const RouterConfig& config, const Tensor& correction_bias) {
  MOEKIT_CHECK(logits.device().is_cuda() && logits.dtype() == DType::f32 && logits.dim() == 2 &&
                   logits.size(1) == config.num_experts,
               "route_on_device: logits must be [T, ", config.num_experts, "] f32 on a GPU, got ", logits.describe());
#if MOEKIT_HAS_CUDA
  const int64_t T = logits.size(0), K = config.top_k;
  RouterOutput out{Tensor::empty({T, K}, DType::i64, logits.device()), Tensor::empty({T, K}, DType::f32, logits.device())};
  cuda::RouterArgs a;
  a.kind = config.kind == RouterKind::softmax_topk ? 0 : config.kind == RouterKind::topk_softmax ? 1 : 2;
  a.tokens = T;
  a.experts = config.num_experts;
  a.top_k = K;
  a.n_group = config.n_group;
  a.topk_group = config.topk_group;
  a.norm_topk_prob = config.norm_topk_prob;
  a.routed_scaling_factor = config.routed_scaling_factor;
  a.logits = logits.data_as<float>();
  if (config.kind == RouterKind::deepseek_v3) {
    MOEKIT_CHECK(correction_bias.defined() && correction_bias.device() == logits.device() &&
                     correction_bias.dtype() == DType::f32 && correction_bias.numel() == config.num_experts,
                 "route_on_device: deepseek_v3 needs correction_bias [E] f32 on the logits' GPU");
    a.correction_bias = correction_bias.data_as<float>();
  }
  a.ids = out.top_k_index.data_as<int64_t>();
  a.weights = out.top_k_weights.data_as<float>();
  if (T > 0) cuda::route_forward(a, cuda_stream());
  return out;
#else
  (void)correction_bias;
  no_cuda("route_on_device");
#endif
}

Tensor sigmoid_gate(const Tensor& logits_f32, DType dtype) {
#if MOEKIT_HAS_CUDA
  MOEKIT_CHECK(logits_f32.device().is_cuda() && logits_f32.dtype() == DType::f32, "sigmoid_gate: expected f32 ",
               "logits on a GPU, got ", logits_f32.describe());
  Tensor out = Tensor::empty({logits_f32.numel()}, DType::f32, logits_f32.device());
  cuda::sigmoid_gate_forward(logits_f32.data_as<float>(), logits_f32.numel(), dtype, out.data_as<float>(),
                             cuda_stream());
  return out;
#else
  (void)logits_f32;
  (void)dtype;
  no_cuda("sigmoid_gate");
#endif
}

Tensor full(const Shape& shape, DType dtype, double value, Device device) {
  Tensor out = Tensor::empty(shape, dtype, device);
  if (device.is_cuda()) {
#if MOEKIT_HAS_CUDA
    cuda::fill_forward(out.data(), out.numel(), dtype, value, cuda_stream());
    return out;
#else
    no_cuda("full");
#endif
  }
  visit_dtype_among<float, int32_t, int64_t>(dtype, "f32, i32 or i64 (full)", [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::fill(out.data_as<T>(), out.data_as<T>() + out.numel(), static_cast<T>(value));
  });
  return out;
}

Tensor argmax(const Tensor& logits) {
  MOEKIT_CHECK(logits.device().is_cuda() && logits.dtype() == DType::f32 && logits.is_contiguous() &&
                   logits.numel() > 0 && (logits.dim() == 1 || (logits.dim() == 2 && logits.size(0) == 1)),
               "argmax: expected float32 logits [1, V] on a GPU (the CPU picks with pick_token), got ",
               logits.describe());
#if MOEKIT_HAS_CUDA
  Tensor out = Tensor::empty({1}, DType::i32, logits.device());
  cuda::argmax_forward(logits.data_as<float>(), logits.numel(), out.data_as<int32_t>(), cuda_stream());
  return out;
#else
  no_cuda("argmax");
#endif
}

void apply_rotary(Tensor& x, int64_t heads, int64_t head_stride, int64_t offset, const RotaryTables& rope,
                  int64_t positions_begin, const int32_t* positions_begin_device) {
  check_contiguous(x, "apply_rotary", "x");
  const int64_t half = static_cast<int64_t>(rope.inv_freq.size()), T = x.size(0);
  MOEKIT_CHECK(x.dim() == 2 && x.size(1) == heads * head_stride && offset + 2 * half <= head_stride,
               "apply_rotary: x ", x.describe(), " does not hold ", heads, " heads of ", head_stride,
               " with ", 2 * half, " rotary values at ", offset);
  if (x.device().is_cuda()) {
#if MOEKIT_HAS_CUDA
    MOEKIT_CHECK(rope.inv_freq_device.defined() && rope.inv_freq_device.device() == x.device(),
                 "apply_rotary: the rotary tables have no copy on ", device_name(x.device()));
    cuda::rotary_forward(x.data(), T, heads, head_stride, offset, half, rope.inv_freq_device.data_as<float>(),
                         rope.attention_factor, rope.interleaved, positions_begin, positions_begin_device, x.dtype(),
                         cuda_stream());
    return;
#else
    (void)positions_begin_device;
    no_cuda("apply_rotary");
#endif
  }
  visit_float_dtype(x.dtype(), [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    T_* xs = x.data_as<T_>();
    std::vector<float> cos(static_cast<std::size_t>(half)), sin(cos.size()), rotated(2 * cos.size());
    for (int64_t t = 0; t < T; ++t) {
      const float position = static_cast<float>(positions_begin + t);
      for (int64_t i = 0; i < half; ++i) {
        // float32 as transformers: freqs = inv_freq * position, then cos/sin scaled, then the dtype.
        const float angle = rope.inv_freq[static_cast<std::size_t>(i)] * position;
        cos[static_cast<std::size_t>(i)] = to_float(from_float<T_>(std::cos(angle) * rope.attention_factor));
        sin[static_cast<std::size_t>(i)] = to_float(from_float<T_>(std::sin(angle) * rope.attention_factor));
      }
      for (int64_t h = 0; h < heads; ++h) {
        T_* v = xs + t * heads * head_stride + h * head_stride + offset;
        for (int64_t i = 0; i < half; ++i) {
          // Interleaved pairs (x[2i], x[2i+1]) come out de-interleaved (first halves, then second
          // halves), as transformers' apply_rotary_pos_emb_interleave writes them; q and k get the same
          // permutation, so their dot products are unchanged.
          const float a = to_float(rope.interleaved ? v[2 * i] : v[i]);
          const float b = to_float(rope.interleaved ? v[2 * i + 1] : v[i + half]);
          const float c = cos[static_cast<std::size_t>(i)], s = sin[static_cast<std::size_t>(i)];
          rotated[static_cast<std::size_t>(i)] = a * c - b * s;
          rotated[static_cast<std::size_t>(i + half)] = b * c + a * s;
        }
        for (int64_t i = 0; i < 2 * half; ++i) v[i] = from_float<T_>(rotated[static_cast<std::size_t>(i)]);
      }
    }
  });
}

Tensor attention(const float* q, const float* k, const float* v, const AttentionShape& s, DType dtype) {
  MOEKIT_CHECK(s.key_heads > 0 && s.query_heads % s.key_heads == 0, "attention: ", s.query_heads,
               " query heads are not a multiple of ", s.key_heads, " key heads");
  const int64_t T = s.tokens, groups = s.query_heads / s.key_heads;
  Tensor out = Tensor::empty({T, s.query_heads * s.value_dim}, dtype);
  visit_float_dtype(dtype, [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    T_* os = out.data_as<T_>();
    const int64_t work = T * s.query_heads;
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(work, 2.0 * static_cast<double>(s.past + T) * static_cast<double>(s.key_dim + s.value_dim)))
    for (int64_t item = 0; item < work; ++item) {
      const int64_t t = item / s.query_heads, h = item % s.query_heads, kh = h / groups;
      const int64_t position = s.past + t;
      const int64_t first = s.sliding_window > 0 ? std::max<int64_t>(0, position - s.sliding_window + 1) : 0;
      const float* qv = q + (t * s.query_heads + h) * s.key_dim;
      std::vector<float> scores(static_cast<std::size_t>(position + 1 - first));
      float max_score = s.sinks != nullptr ? s.sinks[h] : -std::numeric_limits<float>::infinity();
      for (int64_t j = first; j <= position; ++j) {
        const float* kv = k + (j * s.key_heads + kh) * s.key_dim;
        float dot = 0;
        for (int64_t d = 0; d < s.key_dim; ++d) dot += qv[d] * kv[d];
        scores[static_cast<std::size_t>(j - first)] = dot * s.scale;
        max_score = std::max(max_score, dot * s.scale);
      }
      float denominator = s.sinks != nullptr ? std::exp(s.sinks[h] - max_score) : 0.0f;
      for (float& score : scores) {
        score = std::exp(score - max_score);
        denominator += score;
      }
      std::vector<float> acc(static_cast<std::size_t>(s.value_dim), 0.0f);
      for (int64_t j = first; j <= position; ++j) {
        const float p = scores[static_cast<std::size_t>(j - first)] / denominator;
        const float* vv = v + (j * s.key_heads + kh) * s.value_dim;
        for (int64_t d = 0; d < s.value_dim; ++d) acc[static_cast<std::size_t>(d)] += p * vv[d];
      }
      T_* o = os + (t * s.query_heads + h) * s.value_dim;
      for (int64_t d = 0; d < s.value_dim; ++d) o[d] = from_float<T_>(acc[static_cast<std::size_t>(d)]);
    }
  });
  return out;
}

Tensor attention(const Tensor& q, const Tensor& k, int64_t k_row, int64_t k_head, const Tensor& v, int64_t v_row,
                 int64_t v_head, const AttentionShape& s) {
  check_contiguous(q, "attention", "q");
  check_same_device(q, k, "attention", "k");
  check_same_device(q, v, "attention", "v");
  MOEKIT_CHECK(q.device().is_cuda(), "attention: the tensor form runs on CUDA (the CPU takes float rows)");
  MOEKIT_CHECK(s.key_heads > 0 && s.query_heads % s.key_heads == 0, "attention: ", s.query_heads,
               " query heads are not a multiple of ", s.key_heads, " key heads");
#if MOEKIT_HAS_CUDA
  Tensor out = Tensor::empty({s.tokens, s.query_heads * s.value_dim}, q.dtype(), q.device());
  cuda::AttentionArgs a;
  a.tokens = s.tokens;
  a.past = s.past;
  a.past_device = s.past_device;
  a.query_heads = s.query_heads;
  a.key_heads = s.key_heads;
  a.key_dim = s.key_dim;
  a.value_dim = s.value_dim;
  a.q_row = s.query_heads * s.key_dim;
  a.k_row = k_row;
  a.k_head = k_head;
  a.v_row = v_row;
  a.v_head = v_head;
  a.scale = s.scale;
  a.sliding_window = s.sliding_window;
  a.sinks = s.sinks;
  a.dtype = q.dtype();
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.out = out.data();
  cuda::attention_forward(a, cuda_stream());
  return out;
#else
  (void)k_row;
  (void)k_head;
  (void)v_row;
  (void)v_head;
  no_cuda("attention");
#endif
}

}  // namespace moekit::model_ops

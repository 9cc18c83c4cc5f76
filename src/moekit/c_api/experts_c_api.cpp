// The C ABI of include/moekit/c_api.h: turns its plain structs into the experts interface's types and every
// exception into a return code and a per-thread message.
#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

#include "moekit/c_api.h"
#include "moekit/error.h"
#include "moekit/experts.h"

struct moekit_storage {
  std::shared_ptr<moekit::Storage> storage;
};

namespace {

using moekit::Device;
using moekit::DType;
using moekit::Shape;
using moekit::Tensor;

thread_local std::string last_error;

// Runs body, turning any exception into 1 and its message into last_error.
template <typename Body>
int guarded(Body&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown error";
  }
  return 1;
}

void copy_string(const std::string& s, char* buffer, std::size_t capacity) {
  if (buffer == nullptr || capacity == 0) return;
  const std::size_t n = std::min(s.size(), capacity - 1);
  std::memcpy(buffer, s.data(), n);
  buffer[n] = '\0';
}

Device to_device(int32_t type, int32_t index) {
  MOEKIT_CHECK(type == 0 || type == 1, "device_type must be 0 (cpu) or 1 (cuda), got ", type);
  MOEKIT_CHECK(index >= 0, "device_index must be >= 0, got ", index);
  return type == 0 ? Device::cpu() : Device::cuda(index);
}

// The view described by t, `what` naming it in errors; undefined when t.data is null.
Tensor to_tensor(const moekit_tensor& t, const char* what) {
  if (t.data == nullptr) return Tensor();
  MOEKIT_CHECK(t.ndim >= 0 && t.ndim <= MOEKIT_C_MAX_DIMS, what, ": ndim must be in [0, ", MOEKIT_C_MAX_DIMS, "], got ",
               t.ndim);
  MOEKIT_CHECK(t.dtype != nullptr, what, ": no dtype");
  const DType dtype = moekit::parse_dtype(t.dtype);
  const Device device = to_device(t.device_type, t.device_index);
  const Shape shape(t.shape, t.shape + t.ndim);
  const Shape strides(t.strides, t.strides + t.ndim);
  if (t.storage == nullptr) return Tensor::from_blob(t.data, shape, dtype, device, strides);
  const moekit::Storage& s = *t.storage->storage;
  MOEKIT_CHECK(s.device() == device, what, " is on ", moekit::device_name(device), " but its storage is on ",
               moekit::device_name(s.device()));
  const auto* base = static_cast<const char*>(s.data());
  const auto* data = static_cast<const char*>(t.data);
  MOEKIT_CHECK(data >= base && data <= base + s.bytes(), what, ": data does not lie inside its storage");
  return Tensor::from_storage(t.storage->storage, static_cast<std::size_t>(data - base), shape, dtype, strides);
}

moekit::ExpertsProblem to_problem(const moekit_experts_problem* p) {
  MOEKIT_CHECK(p != nullptr, "problem is null");
  moekit::ExpertsProblem problem;
  problem.hidden_states = to_tensor(p->hidden_states, "hidden_states");
  problem.top_k_index = to_tensor(p->top_k_index, "top_k_index");
  problem.top_k_weights = to_tensor(p->top_k_weights, "top_k_weights");
  problem.gate_up_proj = to_tensor(p->gate_up_proj, p->has_gate ? "gate_up_proj" : "up_proj");
  problem.down_proj = to_tensor(p->down_proj, "down_proj");
  problem.gate_up_proj_bias = to_tensor(p->gate_up_proj_bias, "gate_up_proj_bias");
  problem.down_proj_bias = to_tensor(p->down_proj_bias, "down_proj_bias");
  problem.gate_up_proj_scale_inv = to_tensor(p->gate_up_proj_scale_inv, "gate_up_proj_scale_inv");
  problem.down_proj_scale_inv = to_tensor(p->down_proj_scale_inv, "down_proj_scale_inv");
  moekit::ExpertsConfig& c = problem.config;
  c.activation = moekit::parse_activation(p->activation != nullptr ? p->activation : "silu");
  c.has_gate = p->has_gate != 0;
  c.has_bias = p->has_bias != 0;
  c.is_transposed = p->is_transposed != 0;
  c.is_concatenated = p->is_concatenated != 0;
  if (p->has_swiglu_limit != 0) c.swiglu_limit = p->swiglu_limit;
  c.swiglu_alpha = p->swiglu_alpha;
  c.quantization.weights = moekit::parse_weight_format(p->weight_format != nullptr ? p->weight_format : "none");
  c.quantization.activations =
      moekit::parse_activation_scheme(p->activation_scheme != nullptr ? p->activation_scheme : "dynamic");
  c.quantization.block_size = p->block_size;
  return problem;
}

// The named backend's answer for this problem: validation first (contract errors throw), then the device,
// then the problem.
moekit::Support problem_support(const moekit::ExpertsProblem& problem, const char* backend, bool backward) {
  MOEKIT_CHECK(backend != nullptr, "backend name is null");
  moekit::ExpertsBackend& b = moekit::ExpertsInterface::global().get(backend);
  moekit::validate(problem);
  const moekit::Support device = b.supports_device(problem.hidden_states.device());
  if (!device.ok) return device;
  return backward ? b.supports_backward(problem) : b.supports(problem);
}

Tensor workspace_tensor(void* workspace, std::size_t bytes, Device device) {
  if (workspace == nullptr) {
    MOEKIT_CHECK(bytes == 0, "workspace is null but workspace_bytes is ", bytes);
    return Tensor();
  }
  return Tensor::from_blob(workspace, {static_cast<int64_t>(bytes)}, DType::u8, device);
}

}  // namespace

extern "C" {

int moekit_c_abi_version(void) {
  return MOEKIT_C_ABI_VERSION;
}

const char* moekit_last_error(void) {
  return last_error.c_str();
}

int moekit_backend_names(char* buffer, size_t capacity, size_t* needed) {
  return guarded([&] {
    std::string list;
    for (const std::string& name : moekit::ExpertsInterface::global().names()) {
      if (!list.empty()) list += '\n';
      list += name;
    }
    if (needed != nullptr) *needed = list.size() + 1;
    copy_string(list, buffer, capacity);
  });
}

int moekit_backend_supports_device(const char* backend, int32_t device_type, int32_t device_index, int32_t* ok,
                                   char* reason, size_t capacity) {
  return guarded([&] {
    MOEKIT_CHECK(backend != nullptr && ok != nullptr, "backend and ok must not be null");
    const moekit::Support s =
        moekit::ExpertsInterface::global().get(backend).supports_device(to_device(device_type, device_index));
    *ok = s.ok ? 1 : 0;
    copy_string(s.reason, reason, capacity);
  });
}

int moekit_experts_supports(const moekit_experts_problem* problem, const char* backend, int32_t backward, int32_t* ok,
                            char* reason, size_t capacity) {
  return guarded([&] {
    MOEKIT_CHECK(ok != nullptr, "ok must not be null");
    const moekit::Support s = problem_support(to_problem(problem), backend, backward != 0);
    *ok = s.ok ? 1 : 0;
    copy_string(s.reason, reason, capacity);
  });
}

int moekit_experts_workspace_bytes(const moekit_experts_problem* problem, const char* backend, int32_t backward,
                                   size_t* bytes) {
  return guarded([&] {
    MOEKIT_CHECK(bytes != nullptr, "bytes must not be null");
    const moekit::ExpertsProblem p = to_problem(problem);
    const moekit::Support s = problem_support(p, backend, backward != 0);
    MOEKIT_CHECK(s.ok, "experts backend '", backend, "' cannot run ", backward != 0 ? "the backward of " : "",
                 "this problem: ", s.reason);
    moekit::ExpertsBackend& b = moekit::ExpertsInterface::global().get(backend);
    *bytes = backward != 0 ? b.backward_workspace_bytes(p) : b.workspace_bytes(p);
  });
}

int moekit_experts_forward(const moekit_experts_problem* problem, const char* backend, const moekit_tensor* out,
                           void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    MOEKIT_CHECK(backend != nullptr && out != nullptr && out->data != nullptr, "backend and out must be given");
    const moekit::ExpertsProblem p = to_problem(problem);
    const Device device = p.hidden_states.defined() ? p.hidden_states.device() : Device::cpu();
    moekit::experts_forward(p, backend, to_tensor(*out, "out"), moekit::Stream{stream},
                            workspace_tensor(workspace, workspace_bytes, device));
  });
}

}  // extern "C"

namespace {

// The caller's gradients of a backward call: every one is the caller's memory, none may be left for the library to
// allocate and drop.
moekit::ExpertsGradients caller_gradients(const moekit::ExpertsProblem& p, const moekit_experts_gradients* grads) {
  moekit::ExpertsGradients g;
  const auto required = [](const moekit_tensor& t, const char* what) {
    MOEKIT_CHECK(t.data != nullptr, what, " must be given");
    return to_tensor(t, what);
  };
  g.hidden_states = required(grads->hidden_states, "grad_hidden_states");
  g.top_k_weights = required(grads->top_k_weights, "grad_top_k_weights");
  g.gate_up_proj = required(grads->gate_up_proj, p.config.has_gate ? "grad_gate_up_proj" : "grad_up_proj");
  g.down_proj = required(grads->down_proj, "grad_down_proj");
  if (p.config.has_bias) {
    g.gate_up_proj_bias = required(grads->gate_up_proj_bias, "grad_gate_up_proj_bias");
    g.down_proj_bias = required(grads->down_proj_bias, "grad_down_proj_bias");
  } else {
    g.gate_up_proj_bias = to_tensor(grads->gate_up_proj_bias, "grad_gate_up_proj_bias");
    g.down_proj_bias = to_tensor(grads->down_proj_bias, "grad_down_proj_bias");
  }
  return g;
}

Device device_of(const moekit::ExpertsProblem& p) {
  return p.hidden_states.defined() ? p.hidden_states.device() : Device::cpu();
}

// A caller's buffer of kept activations (null only where it holds 0 bytes).
Tensor saved_tensor(const void* saved, std::size_t bytes, Device device) {
  if (saved == nullptr) {
    MOEKIT_CHECK(bytes == 0, "saved is null but saved_bytes is ", bytes);
    return Tensor::empty({0}, DType::u8, device);
  }
  return Tensor::from_blob(const_cast<void*>(saved), {static_cast<int64_t>(bytes)}, DType::u8, device);
}

}  // namespace

extern "C" {

int moekit_experts_backward(const moekit_experts_problem* problem, const char* backend, const moekit_tensor* grad_out,
                            const moekit_experts_gradients* grads, void* workspace, size_t workspace_bytes,
                            void* stream) {
  return guarded([&] {
    MOEKIT_CHECK(backend != nullptr && grad_out != nullptr && grads != nullptr,
                 "backend, grad_out and grads must be given");
    const moekit::ExpertsProblem p = to_problem(problem);
    moekit::experts_backward(p, to_tensor(*grad_out, "grad_out"), backend, caller_gradients(p, grads),
                             moekit::Stream{stream}, workspace_tensor(workspace, workspace_bytes, device_of(p)));
  });
}

int moekit_experts_saved_bytes(const moekit_experts_problem* problem, const char* backend, size_t* saved_bytes,
                               size_t* forward_workspace_bytes, size_t* backward_workspace_bytes) {
  return guarded([&] {
    MOEKIT_CHECK(saved_bytes != nullptr && forward_workspace_bytes != nullptr && backward_workspace_bytes != nullptr,
                 "saved_bytes, forward_workspace_bytes and backward_workspace_bytes must not be null");
    const moekit::ExpertsProblem p = to_problem(problem);
    const moekit::Support s = problem_support(p, backend, true);
    MOEKIT_CHECK(s.ok, "experts backend '", backend, "' cannot run the backward of this problem: ", s.reason);
    moekit::ExpertsBackend& b = moekit::ExpertsInterface::global().get(backend);
    *saved_bytes = b.saved_activation_bytes(p);
    *forward_workspace_bytes = b.saving_workspace_bytes(p);
    *backward_workspace_bytes = *saved_bytes > 0 ? b.saved_backward_workspace_bytes(p) : b.backward_workspace_bytes(p);
  });
}

int moekit_experts_forward_saving(const moekit_experts_problem* problem, const char* backend, const moekit_tensor* out,
                                  void* saved, size_t saved_bytes, void* workspace, size_t workspace_bytes,
                                  void* stream) {
  return guarded([&] {
    MOEKIT_CHECK(backend != nullptr && out != nullptr && out->data != nullptr, "backend and out must be given");
    const moekit::ExpertsProblem p = to_problem(problem);
    const Device device = device_of(p);
    moekit::experts_forward_saving(p, backend, to_tensor(*out, "out"), saved_tensor(saved, saved_bytes, device),
                                   moekit::Stream{stream}, workspace_tensor(workspace, workspace_bytes, device));
  });
}

int moekit_experts_backward_saved(const moekit_experts_problem* problem, const char* backend,
                                  const moekit_tensor* grad_out, const moekit_experts_gradients* grads,
                                  const void* saved, size_t saved_bytes, void* workspace, size_t workspace_bytes,
                                  void* stream) {
  return guarded([&] {
    MOEKIT_CHECK(backend != nullptr && grad_out != nullptr && grads != nullptr,
                 "backend, grad_out and grads must be given");
    const moekit::ExpertsProblem p = to_problem(problem);
    const Device device = device_of(p);
    moekit::experts_backward(p, to_tensor(*grad_out, "grad_out"), backend, caller_gradients(p, grads),
                             moekit::Stream{stream}, workspace_tensor(workspace, workspace_bytes, device),
                             saved_tensor(saved, saved_bytes, device));
  });
}

int moekit_storage_create(void* data, size_t bytes, int32_t device_type, int32_t device_index,
                          moekit_storage** storage) {
  return guarded([&] {
    MOEKIT_CHECK(storage != nullptr, "storage must not be null");
    MOEKIT_CHECK(data != nullptr || bytes == 0, "storage data is null but bytes is ", bytes);
    auto s = std::make_unique<moekit_storage>();
    s->storage = std::make_shared<moekit::Storage>(data, bytes, to_device(device_type, device_index),
                                                   std::function<void(void*)>());
    *storage = s.release();
  });
}

int moekit_storage_modified(moekit_storage* storage) {
  return guarded([&] {
    MOEKIT_CHECK(storage != nullptr, "storage must not be null");
    storage->storage->clear_attachments();
  });
}

void moekit_storage_release(moekit_storage* storage) {
  delete storage;
}

}  // extern "C"

// The registry of experts backends and the one call that runs a named backend.
#include <algorithm>
#include <mutex>

#include "moekit/backends/builtin_backends.h"
#include "moekit/core/device_memory.h"

namespace moekit {

struct ExpertsInterface::Impl {
  mutable std::mutex mutex;
  std::vector<std::shared_ptr<ExpertsBackend>> backends;
};

ExpertsInterface::ExpertsInterface() : impl_(std::make_shared<Impl>()) {
  // The built-in backends, in the order `moekit backends` lists them.
  register_backend(backends::make_eager());
  register_backend(backends::make_batched_mm());
  register_backend(backends::make_grouped_mm());
  register_backend(backends::make_deepgemm());
  register_backend(backends::make_deepgemm_megamoe());
  register_backend(backends::make_sonicmoe());
}

ExpertsInterface& ExpertsInterface::global() {
  static ExpertsInterface instance;
  return instance;
}

void ExpertsInterface::register_backend(std::shared_ptr<ExpertsBackend> backend) {
  MOEKIT_CHECK(backend != nullptr, "register_backend: null backend");
  const std::string name(backend->name());
  MOEKIT_CHECK(!name.empty(), "register_backend: a backend needs a name");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (const auto& b : impl_->backends)
    MOEKIT_CHECK(b->name() != name, "an experts backend named '", name, "' is already registered");
  impl_->backends.push_back(std::move(backend));
}

ExpertsBackend& ExpertsInterface::get(std::string_view name) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (const auto& b : impl_->backends)
    if (b->name() == name) return *b;
  std::string valid;
  for (const auto& b : impl_->backends) valid += std::string(valid.empty() ? "" : ", ") + std::string(b->name());
  MOEKIT_FAIL("unknown experts backend '", name, "'; valid: ", valid);
}

bool ExpertsInterface::contains(std::string_view name) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return std::any_of(impl_->backends.begin(), impl_->backends.end(), [&](const auto& b) { return b->name() == name; });
}

std::vector<std::string> ExpertsInterface::names() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<std::string> out;
  for (const auto& b : impl_->backends) out.emplace_back(b->name());
  return out;
}

std::string ExpertsBackend::kernel_path(const ExpertsProblem&) const {
  return std::string(name());
}

Support ExpertsBackend::supports_backward(const ExpertsProblem&) const {
  return Support::no("experts backend '" + std::string(name()) + "' has no backward pass");
}

std::size_t ExpertsBackend::backward_workspace_bytes(const ExpertsProblem&) const {
  return 0;
}

void ExpertsBackend::backward(const ExpertsProblem&, const Tensor&, ExpertsGradients&, void*, Stream) {
  MOEKIT_FAIL("experts backend '", name(), "' has no backward pass");
}

std::size_t ExpertsBackend::saved_activation_bytes(const ExpertsProblem&) const {
  return 0;
}

std::size_t ExpertsBackend::saving_workspace_bytes(const ExpertsProblem& problem) const {
  return workspace_bytes(problem);
}

std::size_t ExpertsBackend::saved_backward_workspace_bytes(const ExpertsProblem& problem) const {
  return backward_workspace_bytes(problem);
}

void ExpertsBackend::forward_saving(const ExpertsProblem& problem, Tensor& out, void*, void* workspace, Stream stream) {
  forward(problem, out, workspace, stream);
}

void ExpertsBackend::backward_saved(const ExpertsProblem& problem, const Tensor& grad_out, const void*,
                                    ExpertsGradients& grads, void* workspace, Stream stream) {
  backward(problem, grad_out, grads, workspace, stream);
}

namespace {

// A caller's workspace, checked, or one allocated for the call (none when bytes is 0).
void* prepare_workspace(Tensor& workspace, std::size_t bytes, Device device, std::string_view backend_name) {
  if (workspace.defined()) {
    MOEKIT_CHECK(workspace.device() == device && workspace.is_contiguous() && workspace.nbytes() >= bytes,
                 "workspace must be a contiguous tensor of at least ", bytes, " bytes on ", device_name(device),
                 " for backend '", backend_name, "', got ", workspace.describe());
  } else if (bytes > 0) {
    workspace = Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, device);
  }
  return bytes > 0 ? workspace.data() : nullptr;
}

// A caller's tensor for `what`, checked against the shape and dtype it must have, or a new one.
void prepare_output(Tensor& t, const Shape& shape, DType dtype, Device device, std::string_view what) {
  if (!t.defined()) {
    t = Tensor::empty(shape, dtype, device);
    return;
  }
  MOEKIT_CHECK(t.shape() == shape && t.dtype() == dtype && t.device() == device && t.is_contiguous(), what,
               " must be a contiguous ", dtype_name(dtype), shape_string(shape), " on ", device_name(device), ", got ",
               t.describe());
}

// A caller's buffer of saved activations: at least `bytes` on `device`, contiguous; `whence` ends the message.
void check_saved(const Tensor& saved, std::size_t bytes, Device device, std::string_view whence) {
  MOEKIT_CHECK(saved.device() == device && saved.is_contiguous() && saved.nbytes() >= bytes,
               "saved activations must be a contiguous tensor of at least ", bytes, " bytes on ", device_name(device),
               whence, ", got ", saved.describe());
}

}  // namespace

ExpertsGradients experts_backward(const ExpertsProblem& problem, const Tensor& grad_out, std::string_view backend_name,
                                  ExpertsGradients grads, Stream stream, Tensor workspace, Tensor saved) {
  ExpertsBackend& backend = ExpertsInterface::global().get(backend_name);
  const ExpertsShape shape = validate(problem);
  const Device device = problem.hidden_states.device();
  const Support device_support = backend.supports_device(device);
  MOEKIT_CHECK(device_support.ok, "experts backend '", backend_name, "' cannot run on ", device_name(device), ": ",
               device_support.reason);
  const Support support = backend.supports_backward(problem);
  MOEKIT_CHECK(support.ok, "experts backend '", backend_name,
               "' cannot run the backward of this problem: ", support.reason);
  const Shape th{shape.tokens, shape.hidden};
  MOEKIT_CHECK(grad_out.defined() && grad_out.shape() == th && grad_out.dtype() == problem.hidden_states.dtype() &&
                   grad_out.device() == device && grad_out.is_contiguous(),
               "grad_out must be a contiguous ", dtype_name(problem.hidden_states.dtype()), shape_string(th), " on ",
               device_name(device), ", got ", grad_out.describe());
  prepare_output(grads.hidden_states, th, problem.hidden_states.dtype(), device, "grad_hidden_states");
  prepare_output(grads.top_k_weights, problem.top_k_weights.shape(), problem.top_k_weights.dtype(), device,
                 "grad_top_k_weights");
  prepare_output(grads.gate_up_proj, problem.gate_up_proj.shape(), problem.gate_up_proj.dtype(), device,
                 problem.config.has_gate ? "grad_gate_up_proj" : "grad_up_proj");
  prepare_output(grads.down_proj, problem.down_proj.shape(), problem.down_proj.dtype(), device, "grad_down_proj");
  if (problem.config.has_bias) {
    prepare_output(grads.gate_up_proj_bias, problem.gate_up_proj_bias.shape(), problem.gate_up_proj_bias.dtype(),
                   device, "grad_gate_up_proj_bias");
    prepare_output(grads.down_proj_bias, problem.down_proj_bias.shape(), problem.down_proj_bias.dtype(), device,
                   "grad_down_proj_bias");
  } else {
    MOEKIT_CHECK(!grads.gate_up_proj_bias.defined() && !grads.down_proj_bias.defined(),
                 "bias gradients were given for a problem without has_bias");
  }
  const std::size_t saved_bytes = backend.saved_activation_bytes(problem);
  const bool use_saved = saved.defined() && saved_bytes > 0;
  if (use_saved)
    check_saved(
        saved, saved_bytes, device,
        " (what experts_forward_saving kept with backend '" + std::string(backend_name) + "' for this problem)");
  const std::size_t bytes =
      use_saved ? backend.saved_backward_workspace_bytes(problem) : backend.backward_workspace_bytes(problem);
  void* ws = prepare_workspace(workspace, bytes, device, backend_name);
  if (use_saved)
    backend.backward_saved(problem, grad_out, saved.data(), grads, ws, stream);
  else
    backend.backward(problem, grad_out, grads, ws, stream);
  return grads;
}

namespace {

// The named backend after experts_forward's checks of the problem: its validation, then whether the backend runs on
// its device and runs it (each failure thrown with the reason).
ExpertsBackend& checked_forward_backend(const ExpertsProblem& problem, std::string_view backend_name,
                                        ExpertsShape& shape) {
  ExpertsBackend& backend = ExpertsInterface::global().get(backend_name);
  shape = validate(problem);
  const Device device = problem.hidden_states.device();
  const Support device_support = backend.supports_device(device);
  MOEKIT_CHECK(device_support.ok, "experts backend '", backend_name, "' cannot run on ", device_name(device), ": ",
               device_support.reason);
  const Support support = backend.supports(problem);
  MOEKIT_CHECK(support.ok, "experts backend '", backend_name, "' cannot run this problem: ", support.reason);
  return backend;
}

}  // namespace

TrainingForward experts_forward_saving(const ExpertsProblem& problem, std::string_view backend_name, Tensor out,
                                       Tensor saved, Stream stream, Tensor workspace) {
  ExpertsShape shape;
  ExpertsBackend& backend = checked_forward_backend(problem, backend_name, shape);
  const Support support = backend.supports_backward(problem);
  MOEKIT_CHECK(support.ok, "experts backend '", backend_name,
               "' cannot run the backward of this problem, so keeps nothing for it: ", support.reason);
  const Device device = problem.hidden_states.device();
  prepare_output(out, {shape.tokens, shape.hidden}, problem.hidden_states.dtype(), device, "out");
  const std::size_t saved_bytes = backend.saved_activation_bytes(problem);
  if (saved.defined())
    check_saved(saved, saved_bytes, device, " for backend '" + std::string(backend_name) + "'");
  else
    saved = Tensor::empty({static_cast<int64_t>(saved_bytes)}, DType::u8, device);
  const std::size_t bytes = backend.saving_workspace_bytes(problem);
  backend.forward_saving(problem, out, saved_bytes > 0 ? saved.data() : nullptr,
                         prepare_workspace(workspace, bytes, device, backend_name), stream);
  return {out, saved};
}

std::string experts_kernel_path(const ExpertsProblem& problem, std::string_view backend_name) {
  ExpertsShape shape;
  return checked_forward_backend(problem, backend_name, shape).kernel_path(problem);
}

Tensor experts_forward(const ExpertsProblem& problem, std::string_view backend_name, Tensor out, Stream stream,
                       Tensor workspace) {
  ExpertsShape shape;
  ExpertsBackend& backend = checked_forward_backend(problem, backend_name, shape);
  const Device device = problem.hidden_states.device();
  if (out.defined()) {
    MOEKIT_CHECK(out.shape() == Shape({shape.tokens, shape.hidden}) && out.dtype() == problem.hidden_states.dtype() &&
                     out.device() == device && out.is_contiguous(),
                 "out must be a contiguous ", dtype_name(problem.hidden_states.dtype()),
                 shape_string({shape.tokens, shape.hidden}), " on ", device_name(device), ", got ", out.describe());
  } else {
    out = Tensor::empty({shape.tokens, shape.hidden}, problem.hidden_states.dtype(), device);
  }
  const std::size_t workspace_bytes = backend.workspace_bytes(problem);
  backend.forward(problem, out, prepare_workspace(workspace, workspace_bytes, device, backend_name), stream);
  return out;
}

}  // namespace moekit

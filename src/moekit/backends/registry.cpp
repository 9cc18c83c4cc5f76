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

Tensor experts_forward(const ExpertsProblem& problem, std::string_view backend_name, Tensor out, Stream stream,
                       Tensor workspace) {
  ExpertsBackend& backend = ExpertsInterface::global().get(backend_name);
  const ExpertsShape shape = validate(problem);
  const Device device = problem.hidden_states.device();
  const Support device_support = backend.supports_device(device);
  MOEKIT_CHECK(device_support.ok, "experts backend '", backend_name, "' cannot run on ", device_name(device), ": ",
               device_support.reason);
  const Support support = backend.supports(problem);
  MOEKIT_CHECK(support.ok, "experts backend '", backend_name, "' cannot run this problem: ", support.reason);
  if (out.defined()) {
    MOEKIT_CHECK(out.shape() == Shape({shape.tokens, shape.hidden}) && out.dtype() == problem.hidden_states.dtype() &&
                     out.device() == device && out.is_contiguous(),
                 "out must be a contiguous ", dtype_name(problem.hidden_states.dtype()),
                 shape_string({shape.tokens, shape.hidden}), " on ", device_name(device), ", got ", out.describe());
  } else {
    out = Tensor::empty({shape.tokens, shape.hidden}, problem.hidden_states.dtype(), device);
  }
  const std::size_t workspace_bytes = backend.workspace_bytes(problem);
  if (workspace.defined()) {
    MOEKIT_CHECK(workspace.device() == device && workspace.is_contiguous() && workspace.nbytes() >= workspace_bytes,
                 "workspace must be a contiguous tensor of at least ", workspace_bytes, " bytes on ",
                 device_name(device), " for backend '", backend_name, "', got ", workspace.describe());
  } else if (workspace_bytes > 0) {
    workspace = Tensor::empty({static_cast<int64_t>(workspace_bytes)}, DType::u8, device);
  }
  backend.forward(problem, out, workspace_bytes > 0 ? workspace.data() : nullptr, stream);
  return out;
}

}  // namespace moekit

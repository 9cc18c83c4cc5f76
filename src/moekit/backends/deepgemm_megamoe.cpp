// deepgemm_megamoe: registered by name so that users see it, and refused with the reason until
// its multi-GPU kernels land. It never computes anything.
#include <string>

#include "moekit/backends/builtin_backends.h"
#include "moekit/backends/quantized_support.h"

namespace moekit::backends {
namespace {

class NotYetAvailableBackend final : public ExpertsBackend {
 public:
  // ue8m0_on_blackwell: DESIGN §3's compute capability 10.x rule applies (deepgemm, deepgemm_megamoe).
  NotYetAvailableBackend(std::string name, std::string description, std::string reason, bool ue8m0_on_blackwell)
      : name_(std::move(name)),
        description_(std::move(description)),
        reason_(std::move(reason)),
        ue8m0_on_blackwell_(ue8m0_on_blackwell) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return description_; }
  Support supports_device(Device) const override { return Support::no(reason_); }
  Support supports(const ExpertsProblem& p) const override {
    // The rules that will hold once the kernels land come first, so their reasons are already the real ones.
    if (ue8m0_on_blackwell_)
      if (const auto cc = device_compute_capability(p.hidden_states.device()))
        if (Support s = blackwell_scale_support(p, *cc, name_); !s) return s;
    if (Support s = quantized_cuda_support(p, name_); !s) return s;
    return Support::no(reason_);
  }
  std::size_t workspace_bytes(const ExpertsProblem&) const override { return 0; }
  void forward(const ExpertsProblem&, Tensor&, void*, Stream) override {
    MOEKIT_FAIL("experts backend '", name_, "' is not available: ", reason_);
  }

 private:
  std::string name_, description_, reason_;
  bool ue8m0_on_blackwell_;
};

}  // namespace

std::shared_ptr<ExpertsBackend> make_deepgemm_megamoe() {
  return std::make_shared<NotYetAvailableBackend>(
      "deepgemm_megamoe", "expert-parallel dispatch + gated MLP + combine fused across GPUs",
      "not supported on this device: needs several GPUs with expert parallelism and a fused kernel that this "
      "version of moekit does not have yet",
      true);
}

}  // namespace moekit::backends

#include "moekit/backends/builtin_backends.h"
namespace moekit::backends {
namespace {
class Placeholder final : public ExpertsBackend {
 public:
  std::string_view name() const override { return "grouped_mm"; }
  std::string_view description() const override { return "placeholder"; }
  Support supports_device(Device) const override { return Support::no("placeholder"); }
  Support supports(const ExpertsProblem&) const override { return Support::no("placeholder"); }
  std::size_t workspace_bytes(const ExpertsProblem&) const override { return 0; }
  void forward(const ExpertsProblem&, Tensor&, void*, Stream) override { MOEKIT_FAIL("placeholder"); }
};
}  // namespace
std::shared_ptr<ExpertsBackend> make_grouped_mm() { return std::make_shared<Placeholder>(); }
}  // namespace moekit::backends

// The registry of experts backends: built-in names, errors for unknown names, user backends, refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/experts.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

using test::throws_error_with;

const std::vector<std::string> kBuiltinNames = {"eager",    "batched_mm",       "grouped_mm",
                                                "deepgemm", "deepgemm_megamoe", "sonicmoe"};
// What the unknown-name error lists; user backends registered by other tests may follow it.
constexpr const char* kBuiltinList = "eager, batched_mm, grouped_mm, deepgemm, deepgemm_megamoe, sonicmoe";

ExpertsProblem small_problem(DType dtype = DType::bf16) {
  RandomProblemOptions o;
  o.tokens = 5;
  o.hidden = 16;
  o.intermediate = 8;
  o.experts = 4;
  o.top_k = 2;
  o.dtype = dtype;
  o.seed = 7;
  return make_random_problem(o);
}

bool all_bytes_are(const Tensor& t, unsigned char value) {
  const auto* p = static_cast<const unsigned char*>(t.data());
  return std::all_of(p, p + t.nbytes(), [&](unsigned char b) { return b == value; });
}

TEST(Registry, BuiltinNamesInOrder) {
  const auto names = ExpertsInterface::global().names();
  ASSERT_GE(names.size(), kBuiltinNames.size());
  // User backends registered by other tests come after the built-in ones.
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + 6), kBuiltinNames);
  for (const auto& name : kBuiltinNames) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(ExpertsInterface::global().contains(name));
    ExpertsBackend& backend = ExpertsInterface::global().get(name);
    EXPECT_EQ(backend.name(), name);
    EXPECT_FALSE(backend.description().empty());
  }
  // Names are exact strings, as users already write them in transformers.
  EXPECT_FALSE(ExpertsInterface::global().contains("Grouped_MM"));
  EXPECT_FALSE(ExpertsInterface::global().contains("grouped-mm"));
}

TEST(Registry, UnknownNameListsTheValidOnes) {
  EXPECT_FALSE(ExpertsInterface::global().contains("flash"));
  EXPECT_TRUE(throws_error_with([] { ExpertsInterface::global().get("flash"); },
                                {"unknown experts backend 'flash'", kBuiltinList}));
  const ExpertsProblem p = small_problem();
  EXPECT_TRUE(
      throws_error_with([&] { experts_forward(p, "flash"); }, {"unknown experts backend 'flash'", kBuiltinList}));
  EXPECT_TRUE(throws_error_with([&] { experts_forward(p, ""); }, {"unknown experts backend ''", kBuiltinList}));
}

// The extension point: a backend written outside the library, registered under a new name, runs through
// experts_forward like a built-in one.
TEST(Registry, UserBackendRunsThroughExpertsForward) {
  test::ReferenceBackend& backend = test::registered_reference_backend();
  auto& registry = ExpertsInterface::global();
  EXPECT_TRUE(registry.contains(test::ReferenceBackend::kName));
  EXPECT_EQ(&registry.get(test::ReferenceBackend::kName), &backend);
  const auto names = registry.names();
  EXPECT_NE(std::find(names.begin() + 6, names.end(), test::ReferenceBackend::kName), names.end())
      << "a user backend is listed after the built-in ones";

  const ExpertsProblem p = small_problem(DType::f32);
  const int calls = backend.forward_calls;
  const Tensor out = experts_forward(p, test::ReferenceBackend::kName);
  EXPECT_EQ(backend.forward_calls, calls + 1);
  EXPECT_NE(backend.last_workspace, nullptr) << "experts_forward allocates the workspace the backend asked for";
  EXPECT_EQ(out.shape(), Shape({5, 16}));
  EXPECT_EQ(out.dtype(), DType::f32);
  const std::vector<double> reference = experts_reference(p);
  const std::vector<float> got = test::values_of(out);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], static_cast<float>(reference[i])) << i;

  // With a caller-provided output, experts_forward writes into it and returns it.
  Tensor given = Tensor::empty({5, 16}, DType::f32);
  given.fill_bytes(0xFF);
  const Tensor returned = experts_forward(p, test::ReferenceBackend::kName, given);
  EXPECT_EQ(returned.data(), given.data());
  EXPECT_EQ(test::values_of(given), got);
}

// A caller-provided workspace (for CUDA graph capture) reaches the backend as it is; one that is too small
// is refused before the backend runs.
TEST(Registry, CallerWorkspaceIsPassedThroughOrRefused) {
  test::ReferenceBackend& backend = test::registered_reference_backend();
  const ExpertsProblem p = small_problem(DType::f32);
  const Tensor workspace = Tensor::empty({test::ReferenceBackend::kWorkspaceBytes / 4}, DType::f32);  // any dtype
  experts_forward(p, test::ReferenceBackend::kName, Tensor(), Stream(), workspace);
  EXPECT_EQ(backend.last_workspace, workspace.data());
  const int calls = backend.forward_calls;
  EXPECT_TRUE(throws_error_with(
      [&] { experts_forward(p, test::ReferenceBackend::kName, Tensor(), Stream(), Tensor::empty({100}, DType::u8)); },
      {"workspace must be a contiguous tensor of at least 256 bytes on cpu for backend 'test_reference'", "u8[100]"}));
  EXPECT_EQ(backend.forward_calls, calls);
}

TEST(Registry, DuplicateRegistrationThrows) {
  test::registered_reference_backend();
  auto& registry = ExpertsInterface::global();
  const std::size_t count = registry.names().size();
  EXPECT_TRUE(throws_error_with([&] { registry.register_backend(std::make_shared<test::ReferenceBackend>()); },
                                {"'test_reference' is already registered"}));

  // A user backend may not take a built-in name either.
  class NamedBackend final : public ExpertsBackend {
   public:
    explicit NamedBackend(std::string name) : name_(std::move(name)) {}
    std::string_view name() const override { return name_; }
    std::string_view description() const override { return "a name only"; }
    Support supports_device(Device) const override { return Support::yes(); }
    Support supports(const ExpertsProblem&) const override { return Support::yes(); }
    std::size_t workspace_bytes(const ExpertsProblem&) const override { return 0; }
    void forward(const ExpertsProblem&, Tensor&, void*, Stream) override {}

   private:
    std::string name_;
  };
  EXPECT_TRUE(throws_error_with([&] { registry.register_backend(std::make_shared<NamedBackend>("grouped_mm")); },
                                {"'grouped_mm' is already registered"}));
  EXPECT_TRUE(
      throws_error_with([&] { registry.register_backend(std::make_shared<NamedBackend>("")); }, {"needs a name"}));
  EXPECT_TRUE(throws_error_with([&] { registry.register_backend(nullptr); }, {"null backend"}));
  EXPECT_EQ(registry.names().size(), count) << "a refused registration leaves the registry unchanged";
}

// A backend that declines: experts_forward must throw with the backend's reason and never call forward.
class DecliningBackend final : public ExpertsBackend {
 public:
  std::string_view name() const override { return "test_declines_f16"; }
  std::string_view description() const override { return "runs nothing; declines f16 problems"; }
  Support supports_device(Device device) const override {
    return device.is_cpu() ? Support::yes() : Support::no("CPU only");
  }
  Support supports(const ExpertsProblem& p) const override {
    return p.hidden_states.dtype() == DType::f16 ? Support::no("f16 is not implemented here") : Support::yes();
  }
  std::size_t workspace_bytes(const ExpertsProblem&) const override { return 0; }
  void forward(const ExpertsProblem&, Tensor& out, void*, Stream) override {
    ++forward_calls;
    out.fill_bytes(0);
  }
  int forward_calls = 0;
};

TEST(Registry, RefusedProblemThrowsWithTheReasonBeforeAnyWork) {
  static const auto backend = [] {
    auto b = std::make_shared<DecliningBackend>();
    ExpertsInterface::global().register_backend(b);
    return b;
  }();
  const ExpertsProblem p = small_problem(DType::f16);
  Tensor out = Tensor::empty({5, 16}, DType::f16);
  out.fill_bytes(0xFF);
  EXPECT_TRUE(throws_error_with(
      [&] { experts_forward(p, "test_declines_f16", out); },
      {"experts backend 'test_declines_f16' cannot run this problem", "f16 is not implemented here"}));
  EXPECT_EQ(backend->forward_calls, 0);
  EXPECT_TRUE(all_bytes_are(out, 0xFF)) << "the output was touched although the backend declined";
  experts_forward(small_problem(DType::bf16), "test_declines_f16");
  EXPECT_EQ(backend->forward_calls, 1);
}

// deepgemm, deepgemm_megamoe and sonicmoe cannot run on the CPU: they must say so with a reason,
// and experts_forward must stop before touching the output.
class UnavailableBackend : public ::testing::TestWithParam<std::string> {};

TEST_P(UnavailableBackend, RefusesTheCpuWithAReason) {
  ExpertsBackend& backend = ExpertsInterface::global().get(GetParam());
  const Support device = backend.supports_device(Device::cpu());
  EXPECT_FALSE(device.ok);
  EXPECT_NE(device.reason.find("not supported on this device"), std::string::npos) << device.reason;
  // "not supported on this device" alone does not tell the user what is missing.
  EXPECT_GT(device.reason.size(), std::string("not supported on this device: ").size() + 10) << device.reason;

  const ExpertsProblem p = small_problem();
  Tensor out = Tensor::empty({5, 16}, DType::bf16);
  out.fill_bytes(0xFF);
  EXPECT_TRUE(throws_error_with([&] { experts_forward(p, GetParam(), out); },
                                {"experts backend '" + GetParam() + "' cannot run on cpu", device.reason}));
  EXPECT_TRUE(all_bytes_are(out, 0xFF)) << "the output was touched before the refusal";
}

INSTANTIATE_TEST_SUITE_P(Registry, UnavailableBackend, ::testing::Values("deepgemm", "deepgemm_megamoe", "sonicmoe"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace moekit

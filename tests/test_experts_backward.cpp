// The backward of DESIGN §2b: the float64 reference backward against finite differences of the reference
// forward, then every backend with a backward, on every device, against the reference backward on the
// harness's case list (harness_cases.h), each gradient with the forward's tolerances by dtype. Backends and
// problems without a backward must say why.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "harness_cases.h"
#include "moekit/experts.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

using test::HarnessCase;

// ---------------------------------------------------------------------------------------------------------
// The reference backward against finite differences of the reference forward

// The finite-difference step, and the grid every input value is rounded to so that moving it by the step is
// exact in f32 (values below 16 in magnitude: 4 + 20 bits fit f32's 24). The step is small so that moving the
// inputs rarely carries a pre-activation across a kink (relu's 0, GPT-OSS's clamps at +-7).
constexpr double kStep = 1.0 / (1 << 20);

void round_to_grid(Tensor& t) {
  if (!t.defined()) return;
  float* v = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    v[i] = static_cast<float>(std::round(static_cast<double>(v[i]) / kStep) * kStep);
}

// L = <grad_out, out>, with out from the float64 reference.
double loss(const ExpertsProblem& p, const std::vector<double>& grad_out) {
  const std::vector<double> out = experts_reference(p);
  double sum = 0;
  for (std::size_t i = 0; i < out.size(); ++i) sum += grad_out[i] * out[i];
  return sum;
}

struct FiniteDifferenceCase {
  const char* name;
  test::ActivationChoice activation;
  bool has_gate, has_bias, transposed, concatenated;
};

class ReferenceBackward : public ::testing::TestWithParam<FiniteDifferenceCase> {};

// For each differentiable input, a random +-1 direction v: (L(x + h v) - L(x - h v)) / 2h must equal
// <gradient, v>. Central differences are exact for quadratics, so what is left is h^2 times the third
// derivative and double's rounding over 2h, both far below the bound; a wrong term in any gradient is of the
// order of the gradient itself.
TEST_P(ReferenceBackward, MatchesFiniteDifferences) {
  const FiniteDifferenceCase& fc = GetParam();
  RandomProblemOptions o;
  o.tokens = 9;
  o.hidden = 12;
  o.intermediate = 10;
  o.experts = 5;
  o.top_k = 3;
  o.dtype = DType::f32;
  o.sentinel_fraction = 0.2;
  o.seed = 77;
  o.config = test::make_config(fc.activation, fc.has_gate, fc.has_bias, fc.transposed, fc.concatenated);
  // GPT-OSS: inputs large enough that both clamps are active on a share of the values.
  if (o.config.swiglu_limit) o.input_scale = 16.0f;
  ExpertsProblem p = make_random_problem(o);
  for (Tensor* t :
       {&p.hidden_states, &p.top_k_weights, &p.gate_up_proj, &p.down_proj, &p.gate_up_proj_bias, &p.down_proj_bias})
    round_to_grid(*t);
  Tensor grad_out = Tensor::empty({o.tokens, o.hidden}, DType::f32);
  fill_uniform(grad_out, 1.0f, 5);
  std::vector<double> dy(static_cast<std::size_t>(grad_out.numel()));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = grad_out.data_as<float>()[i];
  const ReferenceGradients g = experts_reference_backward(p, grad_out);

  const double h = kStep;
  struct Input {
    const char* name;
    Tensor* tensor;
    const std::vector<double>* gradient;
  };
  std::vector<Input> inputs = {{"hidden_states", &p.hidden_states, &g.hidden_states},
                               {"top_k_weights", &p.top_k_weights, &g.top_k_weights},
                               {"gate_up_proj", &p.gate_up_proj, &g.gate_up_proj},
                               {"down_proj", &p.down_proj, &g.down_proj}};
  if (fc.has_bias) {
    inputs.push_back({"gate_up_proj_bias", &p.gate_up_proj_bias, &g.gate_up_proj_bias});
    inputs.push_back({"down_proj_bias", &p.down_proj_bias, &g.down_proj_bias});
  }
  uint64_t direction_seed = 11;
  for (const Input& in : inputs) {
    ASSERT_EQ(static_cast<std::size_t>(in.tensor->numel()), in.gradient->size()) << in.name;
    Tensor direction = Tensor::empty(in.tensor->shape(), DType::f32);
    fill_uniform(direction, 1.0f, direction_seed++);
    float* v = direction.data_as<float>();
    float* x = in.tensor->data_as<float>();
    double predicted = 0, magnitude = 0;
    for (int64_t i = 0; i < direction.numel(); ++i) {
      v[i] = v[i] < 0 ? -1.0f : 1.0f;
      predicted += v[i] * (*in.gradient)[static_cast<std::size_t>(i)];
      magnitude += std::abs((*in.gradient)[static_cast<std::size_t>(i)]);
    }
    const std::vector<float> original(x, x + in.tensor->numel());
    for (int64_t i = 0; i < direction.numel(); ++i) x[i] = original[static_cast<std::size_t>(i)] + h * v[i];
    const double plus = loss(p, dy);
    for (int64_t i = 0; i < direction.numel(); ++i) x[i] = original[static_cast<std::size_t>(i)] - h * v[i];
    const double minus = loss(p, dy);
    std::copy(original.begin(), original.end(), x);
    const double measured = (plus - minus) / (2 * h);
    ASSERT_GT(magnitude, 0) << in.name << ": an all-zero gradient checks nothing";
    EXPECT_NEAR(measured, predicted, 1e-6 * magnitude + 1e-9)
        << "d<grad_out, out> / d " << in.name << " along a random direction";
  }
}

std::vector<FiniteDifferenceCase> finite_difference_cases() {
  std::vector<FiniteDifferenceCase> cases;
  for (const auto& a : test::kActivations)
    for (bool has_gate : {true, false})
      for (bool has_bias : {false, true})
        for (bool transposed : {false, true})
          for (bool concatenated : {true, false}) {
            if (!has_gate && (a.clamped || !concatenated)) continue;
            cases.push_back({a.name, a, has_gate, has_bias, transposed, concatenated});
          }
  return cases;
}

std::string finite_difference_name(const ::testing::TestParamInfo<FiniteDifferenceCase>& info) {
  const FiniteDifferenceCase& c = info.param;
  return test::config_name(c.activation,
                           test::make_config(c.activation, c.has_gate, c.has_bias, c.transposed, c.concatenated));
}

INSTANTIATE_TEST_SUITE_P(Activations, ReferenceBackward, ::testing::ValuesIn(finite_difference_cases()),
                         finite_difference_name);

TEST(ReferenceBackwardDerivatives, ClampPassesNoGradientWhereActive) {
  ExpertsConfig c;
  c.swiglu_limit = 7.0f;
  const ActivationDerivatives above = reference_activation_derivatives(c, 7.5, 8.0);
  EXPECT_EQ(above.gate, 0.0) << "gate above the limit";
  EXPECT_EQ(above.up, 0.0) << "up above the limit";
  const ActivationDerivatives below = reference_activation_derivatives(c, 1.0, -7.5);
  EXPECT_NE(below.gate, 0.0);
  EXPECT_EQ(below.up, 0.0) << "up below -limit";
  const ActivationDerivatives inside = reference_activation_derivatives(c, 1.0, 2.0);
  EXPECT_GT(inside.gate, 0.0);
  EXPECT_GT(inside.up, 0.0);
}

TEST(ReferenceBackwardDerivatives, RefusesQuantisedProblems) {
  RandomProblemOptions o;
  o.hidden = 128;
  o.intermediate = 128;
  o.config.quantization.weights = WeightFormat::fp8_e4m3;
  const ExpertsProblem p = make_random_problem(o);
  const Tensor grad_out = Tensor::empty({o.tokens, o.hidden}, DType::bf16);
  EXPECT_TRUE(test::throws_error_with([&] { experts_reference_backward(p, grad_out); }, {"unquantised"}));
}

// ---------------------------------------------------------------------------------------------------------
// Every backend's backward against the reference backward

struct BackwardParam {
  std::string backend;
  Device device;
  HarnessCase c;
};

void PrintTo(const BackwardParam& p, std::ostream* os) {
  *os << p.backend << " on " << device_name(p.device) << ", case " << p.c.name;
}

std::string describe(const BackwardParam& p) {
  std::ostringstream os;
  const RandomProblemOptions& o = p.c.options;
  os << "backward of " << p.backend << " on " << device_name(p.device) << ", case " << p.c.name << " (T=" << o.tokens
     << " H=" << o.hidden << " I=" << o.intermediate << " E=" << o.experts << " K=" << o.top_k << " "
     << dtype_name(o.dtype) << " ids " << dtype_name(o.index_dtype) << " routing weights "
     << dtype_name(o.weights_dtype) << ", " << o.config.describe() << ", seed " << o.seed << ")";
  return os.str();
}

std::optional<std::string> device_skip_reason(const std::string& backend, Device device) {
  if (auto why = test::device_unavailable(device)) return device_name(device) + " is not available: " + *why;
  const Support s = ExpertsInterface::global().get(backend).supports_device(device);
  if (!s) return backend + " does not run on " + device_name(device) + ": " + s.reason;
  return std::nullopt;
}

// grad_out of a case: its own stream of values, in the dtype of hidden_states.
Tensor grad_out_of(const HarnessCase& c) {
  Tensor g = Tensor::empty({c.options.tokens, c.options.hidden}, DType::f32);
  fill_uniform(g, 1.0f, c.options.seed * 7 + 3);
  return g.to(c.options.dtype);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  const Tensor x = a.to(Device::cpu()), y = b.to(Device::cpu());
  return x.nbytes() == y.nbytes() && std::memcmp(x.data(), y.data(), x.nbytes()) == 0;
}

// The names of the gradients whose bytes differ between a and b ("" where every one is the same).
std::string differing_gradients(const ExpertsGradients& a, const ExpertsGradients& b) {
  std::string out;
  auto check = [&](const char* name, const Tensor& x, const Tensor& y) {
    if (!bitwise_equal(x, y)) out += out.empty() ? name : std::string(", ") + name;
  };
  check("grad_hidden_states", a.hidden_states, b.hidden_states);
  check("grad_top_k_weights", a.top_k_weights, b.top_k_weights);
  check("grad_gate_up_proj", a.gate_up_proj, b.gate_up_proj);
  check("grad_down_proj", a.down_proj, b.down_proj);
  check("grad_gate_up_proj_bias", a.gate_up_proj_bias, b.gate_up_proj_bias);
  check("grad_down_proj_bias", a.down_proj_bias, b.down_proj_bias);
  return out;
}

// Every gradient of grads against the reference's, at the case's tolerance.
void expect_gradients_match(const ExpertsGradients& grads, const ReferenceGradients& ref, const test::Tolerance& tol,
                            bool has_bias, const std::string& where) {
  struct Named {
    const char* name;
    const Tensor* got;
    const std::vector<double>* want;
  };
  std::vector<Named> all = {{"grad_hidden_states", &grads.hidden_states, &ref.hidden_states},
                            {"grad_top_k_weights", &grads.top_k_weights, &ref.top_k_weights},
                            {"grad_gate_up_proj", &grads.gate_up_proj, &ref.gate_up_proj},
                            {"grad_down_proj", &grads.down_proj, &ref.down_proj}};
  if (has_bias) {
    all.push_back({"grad_gate_up_proj_bias", &grads.gate_up_proj_bias, &ref.gate_up_proj_bias});
    all.push_back({"grad_down_proj_bias", &grads.down_proj_bias, &ref.down_proj_bias});
  }
  for (const Named& n : all) {
    const test::Comparison c = test::compare_gradient_with_reference(*n.got, *n.want, tol);
    EXPECT_TRUE(c.passed()) << n.name << ": " << c.summary() << "\n  " << where;
  }
}

class ExpertsBackwardHarness : public ::testing::TestWithParam<BackwardParam> {};

TEST_P(ExpertsBackwardHarness, MatchesReference) {
  const BackwardParam& p = GetParam();
  if (auto why = device_skip_reason(p.backend, p.device)) GTEST_SKIP() << *why;
  const std::string where = describe(p);
  const ExpertsProblem host_problem = test::make_case_problem(p.c);
  const Tensor host_grad_out = grad_out_of(p.c);
  const ExpertsProblem problem = test::problem_on(host_problem, p.device);
  const Tensor grad_out = host_grad_out.to(p.device);
  ExpertsBackend& backend = ExpertsInterface::global().get(p.backend);
  const Support support = backend.supports_backward(problem);
  if (!support) {
    if (test::is_portable_backend(p.backend))
      FAIL() << "a portable backend has no backward for a problem of the contract: " << support.reason << "\n  "
             << where;
    GTEST_SKIP() << p.backend << " has no backward for this problem: " << support.reason;
  }
  const ReferenceGradients ref = experts_reference_backward(host_problem, host_grad_out);

  ExpertsGradients grads = test::poisoned_gradients(problem, p.device);
  try {
    grads = experts_backward(problem, grad_out, p.backend, grads);
  } catch (const std::exception& e) {
    FAIL() << "experts_backward threw: " << e.what() << "\n  " << where;
  }
  synchronize(p.device);
  const test::Tolerance tol = test::tolerance_of(p.c);
  expect_gradients_match(grads, ref, tol, p.c.options.config.has_bias, where);

  // Sentinel slots have no routing-weight gradient and all-sentinel tokens no hidden-state gradient:
  // exactly zero, not merely small.
  const std::vector<float> gw = test::values_of(grads.top_k_weights.to(Device::cpu()));
  const std::vector<float> gx = test::values_of(grads.hidden_states.to(Device::cpu()));
  const int64_t K = p.c.options.top_k, H = p.c.options.hidden;
  for (int64_t t = 0; t < p.c.options.tokens; ++t)
    for (int64_t k = 0; k < K; ++k) {
      if (test::get_id(host_problem, t, k) < p.c.options.experts) continue;
      EXPECT_EQ(gw[static_cast<std::size_t>(t * K + k)], 0.0f) << "sentinel slot (" << t << ", " << k << ")";
    }
  for (int64_t t : p.c.all_sentinel_tokens)
    for (int64_t h = 0; h < H; ++h)
      ASSERT_EQ(gx[static_cast<std::size_t>(t * H + h)], 0.0f) << "all-sentinel token " << t << "\n  " << where;

  // Bitwise reproducible: a second run gives the very same bytes.
  ExpertsGradients again = experts_backward(problem, grad_out, p.backend, test::poisoned_gradients(problem, p.device));
  synchronize(p.device);
  EXPECT_EQ(differing_gradients(grads, again), "") << "differ run to run\n  " << where;

  // The Hopper backward (the backends that keep activations) on three blocks, so that each block takes many units
  // and the small cases wrap every ring, as model-sized problems do on a whole GPU (where a block takes dozens): the
  // same bytes, as no sum's order depends on the grid.
  if (backend.saved_activation_bytes(problem) == 0) return;
  {
    KernelOptions few = kernel_options();
    few.hopper_backward_blocks = 3;
    test::ScopedKernelOptions scoped(few);
    const ExpertsGradients on_few =
        experts_backward(problem, grad_out, p.backend, test::poisoned_gradients(problem, p.device));
    synchronize(p.device);
    EXPECT_EQ(differing_gradients(grads, on_few), "")
        << "differ between the backward on three blocks and the one on the whole GPU\n  " << where;
  }

  // A backend that keeps activations from the forward: the forward that keeps them still matches the reference, and
  // the backward that reads them matches it too, run to run bitwise.
  TrainingForward kept;
  try {
    kept = experts_forward_saving(problem, p.backend);
  } catch (const std::exception& e) {
    FAIL() << "experts_forward_saving threw: " << e.what() << "\n  " << where;
  }
  synchronize(p.device);
  EXPECT_GE(kept.saved.nbytes(), backend.saved_activation_bytes(problem));
  const test::Comparison out =
      test::compare_with_reference(kept.out.to(Device::cpu()), experts_reference(host_problem), tol);
  EXPECT_TRUE(out.passed()) << "out of the forward that keeps activations: " << out.summary() << "\n  " << where;
  const ExpertsGradients from_saved = experts_backward(
      problem, grad_out, p.backend, test::poisoned_gradients(problem, p.device), Stream(), Tensor(), kept.saved);
  const ExpertsGradients from_saved_again = experts_backward(
      problem, grad_out, p.backend, test::poisoned_gradients(problem, p.device), Stream(), Tensor(), kept.saved);
  synchronize(p.device);
  expect_gradients_match(from_saved, ref, tol, p.c.options.config.has_bias, where + ", from the kept activations");
  EXPECT_EQ(differing_gradients(from_saved, from_saved_again), "")
      << "differ run to run in the backward from kept activations\n  " << where;
}

// The unquantised cases (FP8 / FP4 training is out of scope; BackwardRefusals checks that they are refused)
// for every backend with a backward on each device; a device this machine lacks (or one the Hopper backends do not
// run on) gets one skipping test per backend, and a case a Hopper backend refuses skips with its reason.
std::vector<BackwardParam> backward_params(Device device) {
  std::vector<BackwardParam> params;
  for (const char* backend : {"eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe"}) {
    if (device_skip_reason(backend, device)) {
      params.push_back({backend, device, {"not_run_on_this_device", {}, {}}});
      continue;
    }
    for (const HarnessCase& c : test::all_cases())
      if (!c.options.config.quantization.quantized()) params.push_back({backend, device, c});
  }
  return params;
}

std::string backward_param_name(const ::testing::TestParamInfo<BackwardParam>& info) {
  return info.param.backend + "__" + info.param.c.name;
}

INSTANTIATE_TEST_SUITE_P(Cpu, ExpertsBackwardHarness, ::testing::ValuesIn(backward_params(Device::cpu())),
                         backward_param_name);
INSTANTIATE_TEST_SUITE_P(Cuda, ExpertsBackwardHarness, ::testing::ValuesIn(backward_params(Device::cuda(0))),
                         backward_param_name);

// ---------------------------------------------------------------------------------------------------------
// What has no backward says why; bad arguments are named

ExpertsProblem small_problem(DType dtype = DType::f32, bool has_bias = false) {
  RandomProblemOptions o;
  o.tokens = 4;
  o.hidden = 16;
  o.intermediate = 8;
  o.experts = 4;
  o.top_k = 2;
  o.dtype = dtype;
  o.config.has_bias = has_bias;
  return make_random_problem(o);
}

TEST(BackwardRefusals, QuantisedProblemsAreRefusedWithTheReason) {
  RandomProblemOptions o;
  o.hidden = 128;
  o.intermediate = 128;
  o.config.quantization.weights = WeightFormat::fp8_e4m3;
  const ExpertsProblem p = make_random_problem(o);
  const Tensor grad_out = Tensor::empty({o.tokens, o.hidden}, DType::bf16);
  for (const char* backend : {"eager", "batched_mm", "grouped_mm"}) {
    const Support s = ExpertsInterface::global().get(backend).supports_backward(p);
    EXPECT_FALSE(s.ok) << backend;
    EXPECT_NE(s.reason.find("out of scope"), std::string::npos) << backend << ": " << s.reason;
    EXPECT_TRUE(test::throws_error_with([&] { experts_backward(p, grad_out, backend); },
                                        {backend, "cannot run the backward", "FP8 / FP4 training"}));
  }
}

TEST(BackwardRefusals, BackendsWithoutABackwardSayWhy) {
  const ExpertsProblem p = small_problem();
  const Tensor grad_out = Tensor::empty({4, 16}, DType::f32);
  test::registered_reference_backend();  // a user backend that does not override the backward
  const Support s = test::registered_reference_backend().supports_backward(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("has no backward pass"), std::string::npos) << s.reason;
  EXPECT_TRUE(test::throws_error_with(
      [&] { experts_backward(p, grad_out, std::string(test::ReferenceBackend::kName)); }, {"has no backward pass"}));
}

TEST(BackwardArguments, GradOutMustMatchTheOutput) {
  const ExpertsProblem p = small_problem();
  EXPECT_TRUE(test::throws_error_with(
      [&] {
        experts_backward(p, Tensor::empty({4, 15}, DType::f32), "eager");
      },
      {"grad_out must be a contiguous f32[4, 16]"}));
  EXPECT_TRUE(test::throws_error_with(
      [&] {
        experts_backward(p, Tensor::empty({4, 16}, DType::bf16), "eager");
      },
      {"grad_out", "bf16"}));
  EXPECT_TRUE(test::throws_error_with([&] { experts_backward(p, Tensor(), "eager"); }, {"grad_out", "undefined"}));
}

TEST(BackwardArguments, GivenGradientsAreCheckedAndWrittenInPlace) {
  const ExpertsProblem p = small_problem();
  const Tensor grad_out = Tensor::empty({4, 16}, DType::f32);
  ExpertsGradients wrong;
  wrong.down_proj = Tensor::empty({4, 8, 16}, DType::f32);  // transposed shape for an untransposed problem
  EXPECT_TRUE(test::throws_error_with([&] { experts_backward(p, grad_out, "eager", wrong); }, {"grad_down_proj"}));
  ExpertsGradients bias;
  bias.down_proj_bias = Tensor::empty({4, 16}, DType::f32);
  EXPECT_TRUE(test::throws_error_with([&] { experts_backward(p, grad_out, "eager", bias); }, {"without has_bias"}));

  ExpertsGradients given = test::poisoned_gradients(p, Device::cpu());
  void* where = given.gate_up_proj.data();
  const ExpertsGradients out = experts_backward(p, grad_out, "grouped_mm", given);
  EXPECT_EQ(out.gate_up_proj.data(), where) << "a given gradient is written where it is, not replaced";
}

TEST(BackwardArguments, UnknownBackendListsTheValidOnes) {
  const ExpertsProblem p = small_problem();
  EXPECT_TRUE(test::throws_error_with(
      [&] {
        experts_backward(p, Tensor::empty({4, 16}, DType::f32), "nope");
      },
      {"unknown experts backend 'nope'", "grouped_mm"}));
}

// ---------------------------------------------------------------------------------------------------------
// Activations kept from the forward (experts_forward_saving -> experts_backward(..., saved))

TEST(SavedActivations, BackendsThatKeepNothingRunTheirUsualForwardAndBackward) {
  const ExpertsProblem p = small_problem(DType::f32, true);
  Tensor g = Tensor::empty({4, 16}, DType::f32);
  fill_uniform(g, 1.0f, 4);
  for (const char* backend : {"eager", "batched_mm", "grouped_mm"}) {
    EXPECT_EQ(ExpertsInterface::global().get(backend).saved_activation_bytes(p), 0u) << backend;
    const TrainingForward kept = experts_forward_saving(p, backend);
    EXPECT_EQ(kept.saved.nbytes(), 0u) << backend;
    EXPECT_TRUE(bitwise_equal(kept.out, experts_forward(p, backend))) << backend;
    const ExpertsGradients recomputed = experts_backward(p, g, backend);
    const ExpertsGradients with_saved = experts_backward(p, g, backend, {}, Stream(), Tensor(), kept.saved);
    EXPECT_EQ(differing_gradients(recomputed, with_saved), "") << backend;
  }
}

// A user backend that keeps kSavedBytes from its forward: records which of its entry points ran and what they saw.
class KeepingBackend final : public ExpertsBackend {
 public:
  static constexpr std::string_view kName = "test_keeping";
  static constexpr std::size_t kSavedBytes = 64;
  std::string_view name() const override { return kName; }
  std::string_view description() const override { return "keeps 64 bytes from its forward, registered by the tests"; }
  Support supports_device(Device device) const override {
    return device.is_cpu() ? Support::yes() : Support::no("CPU only");
  }
  Support supports(const ExpertsProblem&) const override { return Support::yes(); }
  std::size_t workspace_bytes(const ExpertsProblem&) const override { return 0; }
  void forward(const ExpertsProblem&, Tensor& out, void*, Stream) override {
    ++forward_calls;
    std::memset(out.data(), 0, out.nbytes());
  }
  Support supports_backward(const ExpertsProblem&) const override { return Support::yes(); }
  void backward(const ExpertsProblem&, const Tensor&, ExpertsGradients&, void*, Stream) override { ++backward_calls; }
  std::size_t saved_activation_bytes(const ExpertsProblem&) const override { return kSavedBytes; }
  void forward_saving(const ExpertsProblem& p, Tensor& out, void* saved, void* workspace, Stream s) override {
    forward(p, out, workspace, s);
    std::memset(saved, 0x5a, kSavedBytes);
  }
  void backward_saved(const ExpertsProblem&, const Tensor&, const void* saved, ExpertsGradients&, void*,
                      Stream) override {
    ++backward_saved_calls;
    last_saved_byte = *static_cast<const unsigned char*>(saved);
  }
  int forward_calls = 0, backward_calls = 0, backward_saved_calls = 0;
  unsigned last_saved_byte = 0;
};

KeepingBackend& registered_keeping_backend() {
  static KeepingBackend* backend = [] {
    auto b = std::make_shared<KeepingBackend>();
    ExpertsInterface::global().register_backend(b);
    return b.get();
  }();
  return *backend;
}

TEST(SavedActivations, KeptBytesReachTheBackwardThatReadsThem) {
  KeepingBackend& b = registered_keeping_backend();
  const std::string name(KeepingBackend::kName);
  const ExpertsProblem p = small_problem();
  const Tensor g = Tensor::empty({4, 16}, DType::f32);
  const TrainingForward kept = experts_forward_saving(p, name);
  ASSERT_EQ(kept.saved.nbytes(), KeepingBackend::kSavedBytes);
  EXPECT_EQ(kept.saved.data_as<uint8_t>()[63], 0x5a);
  const int saved_before = b.backward_saved_calls, plain_before = b.backward_calls;
  experts_backward(p, g, name, {}, Stream(), Tensor(), kept.saved);
  EXPECT_EQ(b.backward_saved_calls, saved_before + 1);
  EXPECT_EQ(b.last_saved_byte, 0x5au);
  experts_backward(p, g, name);  // nothing given: the backward that recomputes
  EXPECT_EQ(b.backward_calls, plain_before + 1);
  EXPECT_EQ(b.backward_saved_calls, saved_before + 1);

  // A caller's buffer is written in place; one too small, in the forward or the backward, is named.
  Tensor mine = Tensor::empty({80}, DType::u8);
  EXPECT_EQ(experts_forward_saving(p, name, Tensor(), mine).saved.data(), mine.data());
  const Tensor small = Tensor::empty({32}, DType::u8);
  EXPECT_TRUE(test::throws_error_with([&] { experts_forward_saving(p, name, Tensor(), small); },
                                      {"saved activations", "at least 64 bytes"}));
  EXPECT_TRUE(test::throws_error_with([&] { experts_backward(p, g, name, {}, Stream(), Tensor(), small); },
                                      {"saved activations", "at least 64 bytes", "experts_forward_saving"}));
}

TEST(SavedActivations, AForwardForABackwardThatCannotRunIsRefused) {
  const ExpertsProblem p = small_problem();
  test::registered_reference_backend();  // forward only
  EXPECT_TRUE(test::throws_error_with([&] { experts_forward_saving(p, std::string(test::ReferenceBackend::kName)); },
                                      {"cannot run the backward", "has no backward pass"}));
}

TEST(BackwardFlops, TwiceTheForward) {
  ExpertsShape s;
  s.tokens = 16;
  s.hidden = 2048;
  s.intermediate = 768;
  s.top_k = 8;
  EXPECT_DOUBLE_EQ(experts_backward_flops(s, true, 128), 12.0 * 128 * 2048 * 768);
}

}  // namespace
}  // namespace moekit

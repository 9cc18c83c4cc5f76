// The C ABI (moekit/c_api.h) through libmoekit_c.so: the same results as the C++ API, its errors as return codes
// with the C++ message, and weights registered as storages keeping their packed copies until marked modified.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "moekit/c_api.h"
#include "moekit/experts.h"
#include "moekit/testing/random_problem.h"

namespace moekit {
namespace {

moekit_tensor view(const Tensor& t, moekit_storage* storage = nullptr) {
  moekit_tensor c{};
  if (!t.defined()) return c;
  c.data = t.data();
  c.ndim = static_cast<int32_t>(t.dim());
  c.device_type = t.device().is_cuda() ? 1 : 0;
  c.device_index = t.device().index;
  c.dtype = dtype_name(t.dtype()).data();  // dtype names are NUL-terminated literals
  for (int64_t d = 0; d < t.dim(); ++d) {
    c.shape[d] = t.size(d);
    c.strides[d] = t.strides()[d];
  }
  c.storage = storage;
  return c;
}

moekit_experts_problem c_problem(const ExpertsProblem& p) {
  moekit_experts_problem c{};
  c.hidden_states = view(p.hidden_states);
  c.top_k_index = view(p.top_k_index);
  c.top_k_weights = view(p.top_k_weights);
  c.gate_up_proj = view(p.gate_up_proj);
  c.down_proj = view(p.down_proj);
  c.gate_up_proj_bias = view(p.gate_up_proj_bias);
  c.down_proj_bias = view(p.down_proj_bias);
  c.activation = activation_name(p.config.activation).data();
  c.has_gate = p.config.has_gate;
  c.has_bias = p.config.has_bias;
  c.is_transposed = p.config.is_transposed;
  c.is_concatenated = p.config.is_concatenated;
  c.swiglu_alpha = p.config.swiglu_alpha;
  c.weight_format = "none";
  c.activation_scheme = "dynamic";
  return c;
}

ExpertsProblem problem(uint64_t seed, bool bias, DType dtype = DType::f32) {
  RandomProblemOptions o;
  o.tokens = 7;
  o.hidden = 40;
  o.intermediate = 24;
  o.experts = 5;
  o.top_k = 2;
  o.dtype = dtype;
  o.config.has_bias = bias;
  o.seed = seed;
  return make_random_problem(o);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// The caller's gradient tensors of a problem (f32, the routing weights' dtype) and their C view.
struct CallerGradients {
  ExpertsGradients g;
  moekit_experts_gradients c;
  explicit CallerGradients(const ExpertsProblem& p) {
    g.hidden_states = Tensor::empty(p.hidden_states.shape(), DType::f32);
    g.top_k_weights = Tensor::empty(p.top_k_weights.shape(), p.top_k_weights.dtype());
    g.gate_up_proj = Tensor::empty(p.gate_up_proj.shape(), DType::f32);
    g.down_proj = Tensor::empty(p.down_proj.shape(), DType::f32);
    g.gate_up_proj_bias = Tensor::empty(p.gate_up_proj_bias.shape(), DType::f32);
    g.down_proj_bias = Tensor::empty(p.down_proj_bias.shape(), DType::f32);
    c = {view(g.hidden_states), view(g.top_k_weights),     view(g.gate_up_proj),
         view(g.down_proj),     view(g.gate_up_proj_bias), view(g.down_proj_bias)};
  }
  // Every gradient bitwise equal to the C++ API's.
  void expect_equal(const ExpertsGradients& expected) const {
    EXPECT_TRUE(bitwise_equal(g.hidden_states, expected.hidden_states));
    EXPECT_TRUE(bitwise_equal(g.top_k_weights, expected.top_k_weights));
    EXPECT_TRUE(bitwise_equal(g.gate_up_proj, expected.gate_up_proj));
    EXPECT_TRUE(bitwise_equal(g.down_proj, expected.down_proj));
    EXPECT_TRUE(bitwise_equal(g.gate_up_proj_bias, expected.gate_up_proj_bias));
    EXPECT_TRUE(bitwise_equal(g.down_proj_bias, expected.down_proj_bias));
  }
};

TEST(CApi, VersionAndBackendNames) {
  EXPECT_EQ(moekit_c_abi_version(), MOEKIT_C_ABI_VERSION);
  size_t needed = 0;
  ASSERT_EQ(moekit_backend_names(nullptr, 0, &needed), 0);
  std::vector<char> names(needed);
  ASSERT_EQ(moekit_backend_names(names.data(), names.size(), &needed), 0);
  EXPECT_STREQ(names.data(), "eager\nbatched_mm\ngrouped_mm\ndeepgemm\ndeepgemm_megamoe\nsonicmoe");
  int32_t ok = 1;
  char reason[256];
  ASSERT_EQ(moekit_backend_supports_device("deepgemm", 0, 0, &ok, reason, sizeof reason), 0);
  EXPECT_EQ(ok, 0);
  EXPECT_NE(std::string(reason), "");
}

TEST(CApi, ForwardAndBackwardEqualTheCppApi) {
  for (const char* backend : {"eager", "batched_mm", "grouped_mm"}) {
    SCOPED_TRACE(backend);
    const ExpertsProblem p = problem(3, true);
    const moekit_experts_problem c = c_problem(p);
    int32_t ok = 0;
    char reason[256];
    ASSERT_EQ(moekit_experts_supports(&c, backend, 1, &ok, reason, sizeof reason), 0) << moekit_last_error();
    ASSERT_EQ(ok, 1) << reason;
    size_t bytes = 0;
    ASSERT_EQ(moekit_experts_workspace_bytes(&c, backend, 0, &bytes), 0) << moekit_last_error();
    std::vector<unsigned char> workspace(bytes + 1);
    Tensor out = Tensor::empty(p.hidden_states.shape(), DType::f32);
    out.fill_bytes(0xff);
    const moekit_tensor c_out = view(out);
    ASSERT_EQ(moekit_experts_forward(&c, backend, &c_out, workspace.data(), bytes, nullptr), 0) << moekit_last_error();
    EXPECT_TRUE(bitwise_equal(out, experts_forward(p, backend)));

    const Tensor grad_out = problem(4, false).hidden_states;
    const ExpertsGradients expected = experts_backward(p, grad_out, backend);
    const CallerGradients g(p);
    ASSERT_EQ(moekit_experts_workspace_bytes(&c, backend, 1, &bytes), 0) << moekit_last_error();
    workspace.resize(bytes + 1);
    const moekit_tensor c_grad_out = view(grad_out);
    ASSERT_EQ(moekit_experts_backward(&c, backend, &c_grad_out, &g.c, workspace.data(), bytes, nullptr), 0)
        << moekit_last_error();
    g.expect_equal(expected);
  }
}

// The training step's calls: a backend that keeps nothing reports 0 bytes, and its forward_saving and
// backward_saved (with no buffer) are its forward and backward, bit for bit.
TEST(CApi, SavingForwardAndBackwardFromSavedOfABackendThatKeepsNothing) {
  const ExpertsProblem p = problem(6, true);
  const moekit_experts_problem c = c_problem(p);
  size_t saved = 1, forward_bytes = 0, backward_bytes = 0;
  ASSERT_EQ(moekit_experts_saved_bytes(&c, "grouped_mm", &saved, &forward_bytes, &backward_bytes), 0)
      << moekit_last_error();
  EXPECT_EQ(saved, 0u);
  std::vector<unsigned char> workspace(std::max(forward_bytes, backward_bytes) + 1);
  Tensor out = Tensor::empty(p.hidden_states.shape(), DType::f32);
  const moekit_tensor c_out = view(out);
  ASSERT_EQ(
      moekit_experts_forward_saving(&c, "grouped_mm", &c_out, nullptr, 0, workspace.data(), forward_bytes, nullptr), 0)
      << moekit_last_error();
  EXPECT_TRUE(bitwise_equal(out, experts_forward(p, "grouped_mm")));

  const Tensor grad_out = problem(7, false).hidden_states;
  const ExpertsGradients expected = experts_backward(p, grad_out, "grouped_mm");
  const CallerGradients g(p);
  const moekit_tensor c_grad_out = view(grad_out);
  ASSERT_EQ(moekit_experts_backward_saved(&c, "grouped_mm", &c_grad_out, &g.c, nullptr, 0, workspace.data(),
                                          backward_bytes, nullptr),
            0)
      << moekit_last_error();
  g.expect_equal(expected);

  // A null buffer with a size, and a backend without a backward, are errors that say so.
  EXPECT_EQ(
      moekit_experts_forward_saving(&c, "grouped_mm", &c_out, nullptr, 8, workspace.data(), forward_bytes, nullptr), 1);
  EXPECT_NE(std::string(moekit_last_error()).find("saved is null"), std::string::npos) << moekit_last_error();
  EXPECT_EQ(moekit_experts_saved_bytes(&c, "deepgemm_megamoe", &saved, &forward_bytes, &backward_bytes), 1);
  EXPECT_NE(std::string(moekit_last_error()).find("cannot run the backward"), std::string::npos) << moekit_last_error();
}

TEST(CApi, ErrorsAreReturnedWithTheirMessage) {
  const ExpertsProblem p = problem(5, false);
  moekit_experts_problem c = c_problem(p);
  size_t bytes = 0;
  EXPECT_EQ(moekit_experts_workspace_bytes(&c, "no_such_backend", 0, &bytes), 1);
  EXPECT_NE(std::string(moekit_last_error()).find("grouped_mm"), std::string::npos) << moekit_last_error();
  c.down_proj.shape[1] = 41;
  EXPECT_EQ(moekit_experts_workspace_bytes(&c, "grouped_mm", 0, &bytes), 1);
  EXPECT_NE(std::string(moekit_last_error()).find("down_proj"), std::string::npos) << moekit_last_error();
  c = c_problem(p);
  c.hidden_states.dtype = "f33";
  EXPECT_EQ(moekit_experts_workspace_bytes(&c, "grouped_mm", 0, &bytes), 1);
  EXPECT_NE(std::string(moekit_last_error()).find("f33"), std::string::npos) << moekit_last_error();
  c = c_problem(p);
  c.activation = "tanh";
  EXPECT_EQ(moekit_experts_workspace_bytes(&c, "grouped_mm", 0, &bytes), 1);
  EXPECT_NE(std::string(moekit_last_error()).find("tanh"), std::string::npos) << moekit_last_error();
  c = c_problem(p);
  const moekit_tensor out{};
  EXPECT_EQ(moekit_experts_forward(&c, "grouped_mm", &out, nullptr, 0, nullptr), 1);
  EXPECT_NE(std::string(moekit_last_error()).find("out"), std::string::npos) << moekit_last_error();
  int32_t ok = 1;
  char reason[256];
  EXPECT_EQ(moekit_experts_supports(&c, "deepgemm", 0, &ok, reason, sizeof reason), 0) << moekit_last_error();
  EXPECT_EQ(ok, 0);
}

// The CPU grouped_mm packs weights and attaches the packs to their storage, which a registered storage keeps
// from call to call: after a write to the weights, moekit_storage_modified drops them, and the result is that
// of the new weights (with the stale packs it is not).
TEST(CApi, RegisteredStorageKeepsPackedWeightsUntilModified) {
  ExpertsProblem p = problem(6, false, DType::bf16);
  const Tensor& w = p.gate_up_proj;
  moekit_storage* storage = nullptr;
  ASSERT_EQ(moekit_storage_create(w.data(), w.nbytes(), 0, 0, &storage), 0) << moekit_last_error();
  moekit_experts_problem c = c_problem(p);
  c.gate_up_proj = view(w, storage);
  const auto run = [&] {
    Tensor out = Tensor::empty(p.hidden_states.shape(), p.hidden_states.dtype());
    const moekit_tensor c_out = view(out);
    EXPECT_EQ(moekit_experts_forward(&c, "grouped_mm", &c_out, nullptr, 0, nullptr), 0) << moekit_last_error();
    return out;
  };
  // The C++ API's result for the weights as they are now, on a copy that has no packs yet.
  const auto expected = [&] {
    ExpertsProblem fresh = p;
    fresh.gate_up_proj = w.clone();
    return experts_forward(fresh, "grouped_mm");
  };
  const Tensor before = run();
  EXPECT_TRUE(bitwise_equal(before, expected()));
  bf16* values = w.data_as<bf16>();
  for (int64_t i = 0; i < w.numel(); ++i) values[i] = from_float<bf16>(2.0f * to_float(values[i]));
  ASSERT_EQ(moekit_storage_modified(storage), 0);
  const Tensor after = run();
  EXPECT_TRUE(bitwise_equal(after, expected()));
  EXPECT_FALSE(bitwise_equal(after, before));

  moekit_tensor outside = view(p.down_proj, storage);
  c.down_proj = outside;
  Tensor out = Tensor::empty(p.hidden_states.shape(), p.hidden_states.dtype());
  const moekit_tensor c_out = view(out);
  EXPECT_EQ(moekit_experts_forward(&c, "grouped_mm", &c_out, nullptr, 0, nullptr), 1);
  EXPECT_NE(std::string(moekit_last_error()).find("storage"), std::string::npos) << moekit_last_error();
  moekit_storage_release(storage);
}

}  // namespace
}  // namespace moekit

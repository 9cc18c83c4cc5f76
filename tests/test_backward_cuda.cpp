// The CUDA backward of grouped_mm, batched_mm and the Hopper backends never synchronises with the host and never
// allocates: a whole backward call is captured in a CUDA graph with its gradients and workspace given, then replayed
// with new activations, routing and grad_out written into the captured tensors, and every replay must match the float64
// reference backward of the inputs it saw. The correctness of every backend on every case is
// test_experts_backward.cpp's; this file also holds the backward's performance mode (disabled: run by hand on a
// GPU with --gtest_also_run_disabled_tests --gtest_filter='*BackwardCudaPerformance*'). Needs a CUDA device;
// skips elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/device.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

Tensor device_workspace(std::size_t bytes) {
  return Tensor::empty({static_cast<int64_t>(std::max<std::size_t>(bytes, 1))}, DType::u8, Device::cuda());
}

// A gradient on the device against its reference, rows being the last dimension (one token, one weight row).
void expect_matches(const char* name, const Tensor& got, const std::vector<double>& want, DType dtype,
                    const std::string& where) {
  const test::Comparison c = test::compare_with_reference(test::as_rows(got), want, test::tolerance_for(dtype));
  EXPECT_TRUE(c.passed()) << name << ": " << c.summary() << "\n  " << where;
}

class BackwardCudaGraph : public ::testing::TestWithParam<std::string> {};

// The capture and its replays; keep: the whole training step, experts_forward_saving and then the backward from the
// activations it kept (checked against the reference forward too), in one graph.
void replay_backward_graph(const std::string& backend, bool keep) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  if (const Support s = ExpertsInterface::global().get(backend).supports_device(Device::cuda()); !s)
    GTEST_SKIP() << backend << " does not run on this GPU: " << s.reason;
  RandomProblemOptions o;
  o.tokens = 48;
  o.hidden = 256;
  o.intermediate = 96;
  o.experts = 16;
  o.top_k = 4;
  o.dtype = DType::bf16;
  o.config.has_bias = true;
  o.seed = 21;
  const ExpertsProblem first = make_random_problem(o);
  ExpertsProblem captured = test::problem_on(first, Device::cuda());
  Tensor grad_out = Tensor::empty({o.tokens, o.hidden}, o.dtype, Device::cuda());
  ExpertsGradients grads = test::poisoned_gradients(captured, Device::cuda());
  ExpertsBackend& b = ExpertsInterface::global().get(backend);
  Tensor workspace =
      device_workspace(keep ? b.saved_backward_workspace_bytes(captured) : b.backward_workspace_bytes(captured));
  Tensor forward_workspace = device_workspace(b.saving_workspace_bytes(captured));
  Tensor out = Tensor::empty({o.tokens, o.hidden}, o.dtype, Device::cuda());
  Tensor saved = device_workspace(b.saved_activation_bytes(captured));
  DeviceStream stream(Device::cuda());
  synchronize(Device::cuda());

  CapturedGraph graph(stream, [&] {
    if (keep) experts_forward_saving(captured, backend, out, saved, stream.stream(), forward_workspace);
    experts_backward(captured, grad_out, backend, grads, stream.stream(), workspace, keep ? saved : Tensor());
  });

  for (uint64_t round = 0; round < 3; ++round) {
    RandomProblemOptions next = o;
    next.seed = 200 + round;
    ExpertsProblem fresh = make_random_problem(next);
    fresh.gate_up_proj = first.gate_up_proj;
    fresh.down_proj = first.down_proj;
    fresh.gate_up_proj_bias = first.gate_up_proj_bias;
    fresh.down_proj_bias = first.down_proj_bias;
    if (round == 2) {  // sentinels and most pairs on a few experts (the others get zero gradients)
      next.sentinel_fraction = 0.25;
      next.used_experts = 3;
      redraw_routing(fresh, next, 777);
    }
    Tensor fresh_grad_out = Tensor::empty({o.tokens, o.hidden}, DType::f32);
    fill_uniform(fresh_grad_out, 1.0f, 300 + round);
    fresh_grad_out = fresh_grad_out.to(o.dtype);
    copy_into(captured.hidden_states, fresh.hidden_states, stream);
    copy_into(captured.top_k_index, fresh.top_k_index, stream);
    copy_into(captured.top_k_weights, fresh.top_k_weights, stream);
    copy_into(grad_out, fresh_grad_out, stream);
    test::poison_gradients(grads);
    stream.synchronize();
    synchronize(Device::cuda());
    graph.replay();
    stream.synchronize();
    const ReferenceGradients ref = experts_reference_backward(fresh, fresh_grad_out);
    const std::string where =
        backend + (keep ? " (forward keeping activations, then backward)" : "") + " replay " + std::to_string(round);
    if (keep) {
      const test::Comparison c =
          test::compare_with_reference(out.to(Device::cpu()), experts_reference(fresh), test::tolerance_for(o.dtype));
      EXPECT_TRUE(c.passed()) << "out: " << c.summary() << "\n  " << where;
    }
    expect_matches("grad_hidden_states", grads.hidden_states, ref.hidden_states, o.dtype, where);
    expect_matches("grad_top_k_weights", grads.top_k_weights, ref.top_k_weights, o.dtype, where);
    expect_matches("grad_gate_up_proj", grads.gate_up_proj, ref.gate_up_proj, o.dtype, where);
    expect_matches("grad_down_proj", grads.down_proj, ref.down_proj, o.dtype, where);
    expect_matches("grad_gate_up_proj_bias", grads.gate_up_proj_bias, ref.gate_up_proj_bias, o.dtype, where);
    expect_matches("grad_down_proj_bias", grads.down_proj_bias, ref.down_proj_bias, o.dtype, where);
  }
}

TEST_P(BackwardCudaGraph, ReplaysWithNewInputsRoutingAndGradients) {
  replay_backward_graph(GetParam(), false);
}

// A training step in one graph: the forward that keeps activations for the backward, and the backward that reads them.
// Backends that keep nothing run their usual forward and backward here.
TEST_P(BackwardCudaGraph, TrainingStepWithKeptActivationsReplays) {
  replay_backward_graph(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Backends, BackwardCudaGraph,
                         ::testing::Values("grouped_mm", "batched_mm", "deepgemm", "sonicmoe"));

TEST(BackwardCudaGraphEager, CaptureFailsBecauseEagerSynchronises) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  RandomProblemOptions o;
  o.tokens = 8;
  o.dtype = DType::bf16;
  const ExpertsProblem p = test::problem_on(make_random_problem(o), Device::cuda());
  const Tensor grad_out = Tensor::empty({o.tokens, o.hidden}, o.dtype, Device::cuda());
  ExpertsGradients grads = test::poisoned_gradients(p, Device::cuda());
  Tensor workspace = device_workspace(ExpertsInterface::global().get("eager").backward_workspace_bytes(p));
  DeviceStream stream(Device::cuda());
  synchronize(Device::cuda());
  EXPECT_ANY_THROW(
      CapturedGraph(stream, [&] { experts_backward(p, grad_out, "eager", grads, stream.stream(), workspace); }));
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (!a.defined()) return !b.defined();
  const Tensor x = a.to(Device::cpu()), y = b.to(Device::cpu());
  return x.nbytes() == y.nbytes() && std::memcmp(x.data(), y.data(), x.nbytes()) == 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The performance mode: forward and backward of grouped_mm at the Qwen3-30B-A3B layer shape (issue 36's target:
// H 2048, I 768, E 128, K 8, 16,384 tokens, bf16), CUDA-event times of each (median of 10 after 2 warm-up calls,
// caller's workspace and gradients: nothing allocated in the timed calls), TFLOP/s by DESIGN's counts (forward 6,
// backward 12 * pairs * H * I), and two backward runs bitwise equal. MOEKIT_HOPPER_GEMM=0 times the portable
// forward on Hopper (this test times grouped_mm, whose backward is the portable one; `moekit bench --backward` times
// every backend).
TEST(BackwardCudaPerformance, DISABLED_Qwen3Layer) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  RandomProblemOptions o;
  o.tokens = 16384;
  o.hidden = 2048;
  o.intermediate = 768;
  o.experts = 128;
  o.top_k = 8;
  o.dtype = DType::bf16;
  o.seed = 5;
  const ExpertsProblem p = test::problem_on(make_random_problem(o), Device::cuda());
  Tensor grad_out = Tensor::empty({o.tokens, o.hidden}, DType::f32);
  fill_uniform(grad_out, 1.0f, 9);
  grad_out = grad_out.to(o.dtype).to(Device::cuda());
  ExpertsBackend& backend = ExpertsInterface::global().get("grouped_mm");
  Tensor out = Tensor::empty({o.tokens, o.hidden}, o.dtype, Device::cuda());
  Tensor forward_workspace = device_workspace(backend.workspace_bytes(p));
  Tensor backward_workspace = device_workspace(backend.backward_workspace_bytes(p));
  ExpertsGradients grads = test::poisoned_gradients(p, Device::cuda()),
                   again = test::poisoned_gradients(p, Device::cuda());
  DeviceStream stream(Device::cuda());
  DeviceTimer timer(stream);
  synchronize(Device::cuda());
  auto time_ms = [&](const std::function<void()>& call) {
    for (int i = 0; i < 2; ++i) call();
    std::vector<double> ms;
    for (int i = 0; i < 10; ++i) {
      timer.start();
      call();
      timer.stop();
      ms.push_back(timer.elapsed_ms());
    }
    return median(ms);
  };
  const double forward_ms = time_ms([&] { experts_forward(p, "grouped_mm", out, stream.stream(), forward_workspace); });
  const double backward_ms =
      time_ms([&] { experts_backward(p, grad_out, "grouped_mm", grads, stream.stream(), backward_workspace); });
  experts_backward(p, grad_out, "grouped_mm", again, stream.stream(), backward_workspace);
  stream.synchronize();
  EXPECT_TRUE(same_bytes(grads.hidden_states, again.hidden_states));
  EXPECT_TRUE(same_bytes(grads.top_k_weights, again.top_k_weights));
  EXPECT_TRUE(same_bytes(grads.gate_up_proj, again.gate_up_proj));
  EXPECT_TRUE(same_bytes(grads.down_proj, again.down_proj));

  ExpertsShape s;
  s.tokens = o.tokens;
  s.hidden = o.hidden;
  s.intermediate = o.intermediate;
  s.experts = o.experts;
  s.top_k = o.top_k;
  const double pairs = static_cast<double>(o.tokens * o.top_k);
  const double forward_flops = experts_flops(s, true, pairs), backward_flops = experts_backward_flops(s, true, pairs);
  std::cout << "qwen3-30b-a3b layer, 16384 tokens, bf16, grouped_mm: forward " << forward_ms << " ms ("
            << forward_flops / forward_ms * 1e-9 << " TFLOP/s), backward " << backward_ms << " ms ("
            << backward_flops / backward_ms * 1e-9 << " TFLOP/s), forward + backward " << forward_ms + backward_ms
            << " ms (" << (forward_flops + backward_flops) / (forward_ms + backward_ms) * 1e-9 << " TFLOP/s)\n";
}

}  // namespace
}  // namespace moekit

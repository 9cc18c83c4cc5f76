// batched_mm and grouped_mm on CUDA never synchronise with the host: a whole experts call is captured
// in a CUDA graph, then replayed with new inputs and new routing written into the captured tensors,
// and every replay must match the float64 reference of the inputs it saw.
#include "harness.h"
#include "moekit/device.h"
#include "moekit/random_problem.h"

namespace moekit {
namespace {

class CudaGraphCapture : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaGraphCapture, ReplaysWithNewInputsAndRouting) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  const std::string backend = GetParam();
  RandomProblemOptions o;
  o.tokens = 48;
  o.hidden = 256;
  o.intermediate = 96;
  o.experts = 16;
  o.top_k = 4;
  o.dtype = DType::bf16;
  o.seed = 11;
  const ExpertsProblem first = make_random_problem(o);
  ExpertsProblem captured = test::problem_on(first, Device::cuda());
  DeviceStream stream(Device::cuda());
  Tensor out = test::poisoned_output(captured, Device::cuda());
  const std::size_t bytes = ExpertsInterface::global().get(backend).workspace_bytes(captured);
  Tensor workspace = Tensor::empty({static_cast<int64_t>(std::max<std::size_t>(bytes, 1))}, DType::u8, Device::cuda());
  synchronize(Device::cuda());

  CapturedGraph graph(stream, [&] { experts_forward(captured, backend, out, stream.stream(), workspace); });

  for (uint64_t round = 0; round < 3; ++round) {
    // New activations and new routing (same weights), written into the captured input tensors.
    RandomProblemOptions next = o;
    next.seed = 100 + round;
    ExpertsProblem fresh = make_random_problem(next);
    fresh.gate_up_proj = first.gate_up_proj;
    fresh.down_proj = first.down_proj;
    if (round == 2) {  // sentinels and an expert taking most pairs in the last round
      next.sentinel_fraction = 0.25;
      next.used_experts = 3;
      redraw_routing(fresh, next, 999);
    }
    copy_into(captured.hidden_states, fresh.hidden_states, stream);
    copy_into(captured.top_k_index, fresh.top_k_index, stream);
    copy_into(captured.top_k_weights, fresh.top_k_weights, stream);
    out.fill_bytes(0xFF);
    stream.synchronize();
    synchronize(Device::cuda());
    graph.replay();
    stream.synchronize();
    const test::Comparison c =
        test::compare_with_reference(out.to(Device::cpu()), experts_reference(fresh), test::tolerance_for(o.dtype));
    EXPECT_TRUE(c.passed()) << backend << " replay " << round << ": " << c.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaGraphCapture, ::testing::Values("batched_mm", "grouped_mm"));

}  // namespace
}  // namespace moekit

// batched_mm, grouped_mm, deepgemm and sonicmoe on CUDA never synchronise with the host: a whole
// experts call is captured in a CUDA graph, then replayed with new inputs and new routing written into
// the captured tensors, and every replay must match the float64 reference of the inputs it saw. Also:
// captures that allocate from memory the graph owns, captures that fail, and the allocation counter
// that sizes a graph's memory.
#include <optional>
#include <string>

#include "harness.h"
#include "moekit/device.h"
#include "moekit/testing/random_problem.h"

namespace moekit {
namespace {

class CudaGraphCapture : public ::testing::TestWithParam<std::string> {};

// New activations and routing (the weights stay), written into the captured problem's inputs; out poisoned;
// one replay; out must match the reference of the new problem.
void replay_with(const ExpertsProblem& fresh, ExpertsProblem& captured, Tensor& out, CapturedGraph& graph,
                 const DeviceStream& stream, const std::string& what) {
  copy_into(captured.hidden_states, fresh.hidden_states, stream);
  copy_into(captured.top_k_index, fresh.top_k_index, stream);
  copy_into(captured.top_k_weights, fresh.top_k_weights, stream);
  out.fill_bytes(0xFF);
  stream.synchronize();
  synchronize(Device::cuda());
  graph.replay();
  stream.synchronize();
  const test::Comparison c =
      test::compare_with_reference(out.to(Device::cpu()), experts_reference(fresh),
                                   test::tolerance_for(fresh.hidden_states.dtype(), fresh.config.quantization.quantized()));
  EXPECT_TRUE(c.passed()) << what << ": " << c.summary();
}

// Why the backend does not run this problem here, or nothing: the Hopper backends run on compute
// capability 9.0 only and refuse elsewhere, with the reason.
std::optional<std::string> refusal(const std::string& backend, const ExpertsProblem& p) {
  const Support s = ExpertsInterface::global().get(backend).supports(p);
  if (s) return std::nullopt;
  return backend + " does not run here: " + s.reason;
}

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
  if (auto why = refusal(backend, captured)) GTEST_SKIP() << *why;
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
    replay_with(fresh, captured, out, graph, stream, backend + " replay " + std::to_string(round));
  }
}

// The same with block-quantised weights (FP8 with f32 and with ue8m0 scales, FP4), at a decode size and a
// prefill size: the quantised paths keep state between their launches (batched_mm's FP8 tensor-core path
// counts finished column tiles per group), which every replay must start afresh.
TEST_P(CudaGraphCapture, ReplaysQuantisedExpertsWithNewInputsAndRouting) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  const std::string backend = GetParam();
  struct Format {
    const char* name;
    WeightFormat weights;
    DType scales;
  };
  int ran = 0;
  std::string refused;
  for (const Format f : {Format{"fp8", WeightFormat::fp8_e4m3, DType::f32},
                         Format{"fp8 ue8m0", WeightFormat::fp8_e4m3, DType::ue8m0},
                         Format{"fp4", WeightFormat::fp4_e2m1, DType::ue8m0}})
    for (const int64_t tokens : {2, 40}) {
      RandomProblemOptions o;
      o.tokens = tokens;
      o.hidden = 384;
      o.intermediate = 256;
      o.experts = 12;
      o.top_k = 4;
      o.dtype = DType::bf16;
      o.config.quantization.weights = f.weights;
      o.scale_dtype = f.scales;
      o.seed = 31 + tokens;
      const ExpertsProblem first = make_random_problem(o);
      ExpertsProblem captured = test::problem_on(first, Device::cuda());
      const std::string what = backend + " " + f.name + " T=" + std::to_string(tokens);
      if (auto why = refusal(backend, captured)) {
        refused += what + ": " + *why + "; ";
        continue;
      }
      DeviceStream stream(Device::cuda());
      Tensor out = test::poisoned_output(captured, Device::cuda());
      const std::size_t bytes = ExpertsInterface::global().get(backend).workspace_bytes(captured);
      Tensor workspace =
          Tensor::empty({static_cast<int64_t>(std::max<std::size_t>(bytes, 1))}, DType::u8, Device::cuda());
      synchronize(Device::cuda());
      CapturedGraph graph(stream, [&] { experts_forward(captured, backend, out, stream.stream(), workspace); });
      for (uint64_t round = 0; round < 3; ++round) {
        RandomProblemOptions next = o;
        next.seed = 300 + round;
        if (round == 2) next.sentinel_fraction = 0.25;
        ExpertsProblem fresh = make_random_problem(next);
        fresh.gate_up_proj = first.gate_up_proj;
        fresh.down_proj = first.down_proj;
        fresh.gate_up_proj_scale_inv = first.gate_up_proj_scale_inv;
        fresh.down_proj_scale_inv = first.down_proj_scale_inv;
        replay_with(fresh, captured, out, graph, stream, what + " replay " + std::to_string(round));
      }
      ++ran;
    }
  if (ran == 0) GTEST_SKIP() << refused;
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaGraphCapture, ::testing::Values("batched_mm", "grouped_mm", "deepgemm", "sonicmoe"));

// Work that allocates (experts_forward making its own output and workspace) captured with memory of the
// graph's own, sized by counting one uncaptured run: the output tensor kept from the capture is rewritten
// by every replay, for new inputs and routing.
TEST_P(CudaGraphCapture, ReplaysWorkThatAllocatesFromTheGraphsMemory) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  const std::string backend = GetParam();
  RandomProblemOptions o;
  o.tokens = 5;
  o.hidden = 128;
  o.intermediate = 64;
  o.experts = 8;
  o.top_k = 2;
  o.dtype = DType::bf16;
  o.seed = 21;
  const ExpertsProblem first = make_random_problem(o);
  ExpertsProblem captured = test::problem_on(first, Device::cuda());
  if (auto why = refusal(backend, captured)) GTEST_SKIP() << *why;
  DeviceStream stream(Device::cuda(), /*ordered_with_default=*/true);
  std::size_t bytes = 0;
  {
    const DeviceAllocationCounter counter(Device::cuda());
    experts_forward(captured, backend, Tensor(), stream.stream());
    bytes = counter.bytes();
  }
  EXPECT_GE(bytes, 256u);  // the output at least
  Tensor out;
  CapturedGraph graph(
      stream, [&] { out = experts_forward(captured, backend, Tensor(), stream.stream()); }, bytes);
  ASSERT_TRUE(out.defined());
  for (uint64_t round = 0; round < 2; ++round) {
    RandomProblemOptions next = o;
    next.seed = 200 + round;
    ExpertsProblem fresh = make_random_problem(next);
    fresh.gate_up_proj = first.gate_up_proj;
    fresh.down_proj = first.down_proj;
    replay_with(fresh, captured, out, graph, stream, backend + " replay " + std::to_string(round));
  }
}

// A capture that cannot work fails with a clear error and leaves nothing behind: too little memory of the
// graph's own, and eager, which reads its counts back to the host. The GPU stays usable (no stale CUDA
// error surfaces at the next launch).
TEST(CudaGraph, FailedCapturesThrowAndLeaveTheGpuUsable) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  RandomProblemOptions o;
  o.tokens = 4;
  o.hidden = 64;
  o.intermediate = 32;
  o.experts = 4;
  o.top_k = 2;
  o.dtype = DType::bf16;
  o.seed = 3;
  const ExpertsProblem cpu_problem = make_random_problem(o);
  const ExpertsProblem problem = test::problem_on(cpu_problem, Device::cuda());
  DeviceStream stream(Device::cuda(), /*ordered_with_default=*/true);
  EXPECT_TRUE(test::throws_error_with(
      [&] {
        CapturedGraph graph(
            stream, [&] { experts_forward(problem, "batched_mm", Tensor(), stream.stream()); }, 256);
      },
      {"do not fit"}));
  Tensor out = Tensor::empty({o.tokens, o.hidden}, o.dtype, Device::cuda());
  Tensor workspace = Tensor::empty({static_cast<int64_t>(std::max<std::size_t>(
                                       ExpertsInterface::global().get("eager").workspace_bytes(problem), 1))},
                                   DType::u8, Device::cuda());
  EXPECT_THROW(CapturedGraph(stream, [&] { experts_forward(problem, "eager", out, stream.stream(), workspace); }),
               Error);
  // Launched as usual afterwards, every backend still runs and matches.
  for (const char* backend : {"eager", "batched_mm"}) {
    const Tensor got = experts_forward(problem, backend, Tensor(), stream.stream());
    stream.synchronize();
    const test::Comparison c = test::compare_with_reference(got.to(Device::cpu()), experts_reference(cpu_problem),
                                                            test::tolerance_for(o.dtype));
    EXPECT_TRUE(c.passed()) << backend << ": " << c.summary();
  }
}

// The counter behind a graph's memory, on any device: every tensor made while it lives, 256-byte
// aligned, none reused; tensors made before or after it are not counted.
TEST(DeviceAllocationCounter, CountsTheTensorsMadeWhileItLives) {
  const Tensor before = Tensor::empty({1000}, DType::f32);
  std::size_t outer_bytes = 0;
  {
    const DeviceAllocationCounter outer(Device::cpu());
    { const Tensor dropped = Tensor::empty({10}, DType::f32); }  // 40 bytes: 256
    const Tensor kept = Tensor::empty({100}, DType::f32);        // 400 bytes: 512
    std::size_t inner_bytes = 0;
    {
      const DeviceAllocationCounter inner(Device::cpu());
      const Tensor empty = Tensor::empty({0}, DType::bf16);  // still a distinct piece: 256
      inner_bytes = inner.bytes();
    }
    EXPECT_EQ(inner_bytes, 256u);
    outer_bytes = outer.bytes();
  }
  EXPECT_EQ(outer_bytes, 256u + 512u + 256u);  // nested counters both count
  const Tensor after = Tensor::empty({10}, DType::f32);
  EXPECT_EQ(after.numel(), 10);
}

}  // namespace
}  // namespace moekit

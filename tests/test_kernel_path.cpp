// Which kernels a call runs (experts_kernel_path, ExpertsBackend::kernel_path) and the switches that choose them
// (kernel_options.h): the path names the kernel family, changes when a switch changes what runs, and every path a
// switch selects still matches the float64 reference (CPU grouped_mm's FP8 switch: test_quantized_experts.cpp). The
// CUDA cases need a GPU (the Hopper ones compute capability 9.0) and skip elsewhere with the reason.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness.h"
#include "moekit/device.h"
#include "moekit/experts.h"
#include "moekit/kernel_options.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

RandomProblemOptions small_problem(int64_t tokens) {
  RandomProblemOptions o;
  o.tokens = tokens;
  o.hidden = 1024;
  o.intermediate = 256;
  o.experts = 16;
  o.top_k = 4;
  o.dtype = DType::bf16;
  o.seed = 11;
  return o;
}

TEST(KernelOptions, DescribeNamesEveryFieldAndSetRoundTrips) {
  KernelOptions o = kernel_options();
  o.hopper_clusters = !o.hopper_clusters;
  o.cpu_fp8_own_kernel = !o.cpu_fp8_own_kernel;
  {
    test::ScopedKernelOptions scoped(o);
    const KernelOptions now = kernel_options();
    EXPECT_EQ(now.hopper_clusters, o.hopper_clusters);
    EXPECT_EQ(now.cpu_fp8_own_kernel, o.cpu_fp8_own_kernel);
    const std::string text = describe(now);
    for (const char* field :
         {"grouped_mm_hopper_kernels=", "grouped_mm_gathered_rows=", "hopper_clusters=", "hopper_idle_padding=",
          "hopper_decode_streaming=", "hopper_backward_blocks=", "batched_mm_tensor_cores=", "cpu_fp8_own_kernel="})
      EXPECT_TRUE(contains(text, field)) << text;
    EXPECT_TRUE(contains(text, std::string("hopper_clusters=") + (o.hopper_clusters ? "1" : "0"))) << text;
  }
  EXPECT_EQ(kernel_options().hopper_clusters, !o.hopper_clusters);  // restored
}

TEST(KernelPath, CpuBackendsNameTheirKernels) {
  const ExpertsProblem p = make_random_problem(small_problem(8));
  EXPECT_TRUE(contains(experts_kernel_path(p, "eager"), "CPU oneDNN products per hit expert"));
  EXPECT_TRUE(contains(experts_kernel_path(p, "batched_mm"), "CPU per-pair gemv"));
  EXPECT_TRUE(contains(experts_kernel_path(p, "grouped_mm"), "CPU oneDNN grouped products"));
}

// The same checks as experts_forward: a backend that cannot run the problem throws with its reason.
TEST(KernelPath, RefusedProblemThrowsWithTheReason) {
  const ExpertsProblem p = make_random_problem(small_problem(8));
  EXPECT_TRUE(test::throws_error_with([&] { experts_kernel_path(p, "deepgemm"); }, {"deepgemm", "cannot run"}));
  EXPECT_TRUE(test::throws_error_with([&] { experts_kernel_path(p, "no_such_backend"); }, {"no_such_backend"}));
}

// On a GPU: each switch that selects another CUDA kernel family shows in the path, and the output still matches.
struct SwitchCase {
  const char* name;
  const char* backend;
  int64_t tokens;
  void (*flip)(KernelOptions&);
  const char* before;  // a part of the path with the default options
  const char* after;   // with the switch flipped
  bool hopper;         // needs compute capability 9.0
};

class KernelPathCuda : public ::testing::TestWithParam<SwitchCase> {};

TEST_P(KernelPathCuda, SwitchChangesThePathAndTheResultStillMatches) {
  const SwitchCase c = GetParam();
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  const ExpertsProblem host = make_random_problem(small_problem(c.tokens));
  const ExpertsProblem p = test::problem_on(host, Device::cuda());
  if (c.hopper) {
    const Support s = ExpertsInterface::global().get("deepgemm").supports(p);
    if (!s) GTEST_SKIP() << "the Hopper kernels do not run here: " << s.reason;
  }
  const std::vector<double> reference = experts_reference(host);
  KernelOptions defaults;  // every switch at its default
  for (const bool flipped : {false, true}) {
    KernelOptions k = defaults;
    if (flipped) c.flip(k);
    test::ScopedKernelOptions scoped(k);
    const std::string path = experts_kernel_path(p, c.backend);
    EXPECT_TRUE(contains(path, flipped ? c.after : c.before)) << (flipped ? "flipped: " : "default: ") << path;
    Tensor out = test::poisoned_output(p, Device::cuda());
    experts_forward(p, c.backend, out);
    synchronize(Device::cuda());
    const test::Comparison cmp =
        test::compare_with_reference(out.to(Device::cpu()), reference, test::tolerance_for(DType::bf16, false));
    EXPECT_TRUE(cmp.passed()) << path << ": " << cmp.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Switches, KernelPathCuda,
    ::testing::Values(SwitchCase{"grouped_mm_hopper_kernels", "grouped_mm", 256,
                                 [](KernelOptions& k) { k.grouped_mm_hopper_kernels = false; },
                                 "sonicmoe's kernels: Hopper TMA",
                                 "portable grouped GEMM (bf16) on mma.sync tensor cores", true},
                      SwitchCase{"grouped_mm_gathered_rows", "grouped_mm", 256,
                                 [](KernelOptions& k) { k.grouped_mm_gathered_rows = false; },
                                 "sonicmoe's kernels: Hopper TMA + wgmma grouped GEMM (bf16; token rows gathered",
                                 "deepgemm's kernels: Hopper TMA + wgmma grouped GEMM (bf16; token rows copied", true},
                      // 16,384 pairs, past the gathering range: deepgemm's variant either way.
                      SwitchCase{"grouped_mm_past_the_gathering_range", "grouped_mm", 4096,
                                 [](KernelOptions& k) { k.grouped_mm_gathered_rows = false; },
                                 "deepgemm's kernels: Hopper TMA", "deepgemm's kernels: Hopper TMA", true},
                      SwitchCase{"hopper_decode_streaming", "deepgemm", 2,
                                 [](KernelOptions& k) { k.hopper_decode_streaming = false; }, "decode size: batched_mm",
                                 "Hopper TMA + wgmma grouped GEMM (bf16; token rows copied", true},
                      SwitchCase{"hopper_clusters", "sonicmoe", 256,
                                 [](KernelOptions& k) { k.hopper_clusters = false; }, "clusters of 2 (up) / 1 (down)",
                                 "clusters of 1 (up) / 1 (down)", true}),
    [](const ::testing::TestParamInfo<SwitchCase>& c) { return std::string(c.param.name); });

}  // namespace
}  // namespace moekit

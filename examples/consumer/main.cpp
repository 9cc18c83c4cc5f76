// A program outside moekit, built against an installed moekit (find_package(moekit), moekit::moekit):
// one random experts problem through every backend that runs on the CPU, each checked against the float64
// reference, through the installed headers and library only.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "moekit/experts.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"
#include "moekit/version.h"

int main() {
  if (std::strcmp(moekit::version(), MOEKIT_VERSION_STRING) != 0) {
    std::fprintf(stderr, "consumer: headers of moekit %s but library %s\n", MOEKIT_VERSION_STRING, moekit::version());
    return 1;
  }
  moekit::RandomProblemOptions options;
  options.tokens = 37;
  options.dtype = moekit::DType::f32;
  options.seed = 11;
  const moekit::ExpertsProblem problem = moekit::make_random_problem(options);
  const std::vector<double> expected = moekit::experts_reference(problem);
  int ran = 0;
  int failed = 0;
  for (const std::string& name : moekit::ExpertsInterface::global().names()) {
    moekit::ExpertsBackend& backend = moekit::ExpertsInterface::global().get(name);
    if (!backend.supports_device(moekit::Device::cpu()).ok || !backend.supports(problem).ok) continue;
    const moekit::Tensor out = moekit::experts_forward(problem, name);
    const auto* got = static_cast<const float*>(out.data());
    double error = 0, norm = 0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      error += (got[i] - expected[i]) * (got[i] - expected[i]);
      norm += expected[i] * expected[i];
    }
    const double relative = std::sqrt(error / norm);
    const bool ok = out.numel() == static_cast<int64_t>(expected.size()) && relative < 1e-5;
    std::printf("consumer: %-12s relative L2 error %.3g %s\n", name.c_str(), relative, ok ? "ok" : "FAILED");
    ++ran;
    failed += ok ? 0 : 1;
  }
  std::printf("consumer: moekit %s, %d backends ran on the CPU, %d failed\n", moekit::version(), ran, failed);
  return ran > 0 && failed == 0 ? 0 : 1;
}

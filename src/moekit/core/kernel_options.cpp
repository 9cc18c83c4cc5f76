#include "moekit/kernel_options.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace moekit {
namespace {

// A non-negative integer from the environment; `fallback` where the variable is unset or (said on stderr) not one.
int env_count(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end == '\0' && n >= 0 && n <= 1 << 20) return static_cast<int>(n);
  std::fprintf(stderr, "moekit: ignoring %s=%s (not a count from 0 to 1048576)\n", name, v);
  return fallback;
}

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, value) == 0;
}

KernelOptions from_environment() {
  KernelOptions o;
  o.grouped_mm_hopper_kernels = !env_is("MOEKIT_HOPPER_GEMM", "0");
  o.grouped_mm_gathered_rows = !env_is("MOEKIT_GROUPED_MM_GATHER", "0");
  o.hopper_clusters = !env_is("MOEKIT_DEEPGEMM_CLUSTER", "1");
  o.hopper_idle_padding = !env_is("MOEKIT_HOPPER_IDLE_PADDING", "0");
  o.hopper_decode_streaming = !env_is("MOEKIT_HOPPER_DECODE_STREAMING", "0");
  o.hopper_backward_blocks = env_count("MOEKIT_HOPPER_BACKWARD_BLOCKS", 0);
  o.batched_mm_tensor_cores = !env_is("MOEKIT_BATCHED_MM_TENSOR_CORES", "0");
  o.cpu_fp8_own_kernel = !env_is("MOEKIT_CPU_FP8_GEMM", "onednn");
  return o;
}

struct State {
  std::mutex mutex;
  KernelOptions options = from_environment();
};

State& state() {
  static State s;
  return s;
}

}  // namespace

KernelOptions kernel_options() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  return s.options;
}

void set_kernel_options(const KernelOptions& options) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.options = options;
}

std::string describe(const KernelOptions& o) {
  std::string out;
  auto field = [&](const char* name, bool value) {
    if (!out.empty()) out += ' ';
    out += name;
    out += value ? "=1" : "=0";
  };
  field("grouped_mm_hopper_kernels", o.grouped_mm_hopper_kernels);
  field("grouped_mm_gathered_rows", o.grouped_mm_gathered_rows);
  field("hopper_clusters", o.hopper_clusters);
  field("hopper_idle_padding", o.hopper_idle_padding);
  field("hopper_decode_streaming", o.hopper_decode_streaming);
  if (!out.empty()) out += ' ';
  out += "hopper_backward_blocks=" + std::to_string(o.hopper_backward_blocks);
  field("batched_mm_tensor_cores", o.batched_mm_tensor_cores);
  field("cpu_fp8_own_kernel", o.cpu_fp8_own_kernel);
  return out;
}

}  // namespace moekit

// How fast one kernel can read N bytes on this GPU, timed as `moekit bench --graphs` times a layer (events
// around one CUDA-graph replay, median of many). The decode kernels are judged against the memory floor;
// this gives what a pure read reaches at their sizes, and the fixed cost of a replay (an empty kernel).
// Usage: moekit_cuda_stream_read [MB ...]   (default 25 75 150 600)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "moekit/cuda/device_math.cuh"  // load_stream_raw: the decode kernels' own weight load

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Each warp reads chunks of kLoads * 512 bytes (kLoads 16-byte loads per lane, all issued before any is
// used), chunk index warp, warp + warps, ... (a grid-stride loop: a grid larger than fits at once runs in
// waves); one value per block out so nothing is dropped.
template <int kLoads>
__global__ void __launch_bounds__(128) read_kernel(const uint4* __restrict__ data, int64_t chunks, float* out) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * 4;
  uint32_t acc = 0;
  for (int64_t c = blockIdx.x * 4 + threadIdx.x / 32; c < chunks; c += warps) {
    const uint4* p = data + c * kLoads * 32 + lane;
    uint4 v[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) v[l] = moekit::cuda::load_stream_raw(p + l * 32);
#pragma unroll
    for (int l = 0; l < kLoads; ++l) acc ^= v[l].x + v[l].y + v[l].z + v[l].w;
  }
  if (acc == 0x12345678u) out[blockIdx.x] = 1.0f;  // keeps the loads
}

__global__ void empty_kernel() {}

float median_replay_us(cudaGraphExec_t exec, cudaStream_t s) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  std::vector<float> t;
  for (int i = 0; i < 300; ++i) {
    check(cudaEventRecord(a, s), "record");
    check(cudaGraphLaunch(exec, s), "graph launch");
    check(cudaEventRecord(b, s), "record");
    check(cudaEventSynchronize(b), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "elapsed");
    if (i >= 20) t.push_back(ms * 1000.0f);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[t.size() / 2];
}

template <typename Launch>
float time_graph(cudaStream_t s, Launch launch) {
  cudaGraph_t g;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
  launch();
  check(cudaStreamEndCapture(s, &g), "end capture");
  check(cudaGraphInstantiate(&exec, g, 0), "instantiate");
  const float us = median_replay_us(exec, s);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> sizes_mb;
  for (int i = 1; i < argc; ++i) sizes_mb.push_back(std::atof(argv[i]));
  if (sizes_mb.empty()) sizes_mb = {25, 75, 150, 600};
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute");
  const double max_mb = *std::max_element(sizes_mb.begin(), sizes_mb.end());
  const size_t bytes = static_cast<size_t>(max_mb * 1e6) + (1 << 20);
  uint4* data = nullptr;
  float* out = nullptr;
  check(cudaMalloc(&data, bytes), "malloc");
  check(cudaMalloc(&out, 1 << 20), "malloc");
  check(cudaMemset(data, 1, bytes), "memset");
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const float empty = time_graph(s, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
  std::printf("empty kernel replay: %.2f us\n", empty);
  std::printf("%8s %-34s %9s %9s %12s\n", "MB", "reader", "us", "GB/s", "GB/s-empty");
  for (const double mb : sizes_mb) {
    const int64_t chunks16 = static_cast<int64_t>(mb * 1e6) / (16 * 512);
    const double moved = static_cast<double>(chunks16) * 16 * 512;
    const auto row = [&](const char* name, float us) {
      std::printf("%8.0f %-34s %9.2f %9.0f %12.0f\n", mb, name, us, moved / us / 1e3, moved / (us - empty) / 1e3);
    };
    for (int per_sm : {4, 8, 16}) {
      const int grid = sms * per_sm;
      char name[64];
      std::snprintf(name, sizeof name, "grid stride, %d blocks/SM, 16 loads", per_sm);
      row(name, time_graph(s, [&] { read_kernel<16><<<grid, 128, 0, s>>>(data, chunks16, out); }));
    }
    row("one chunk per warp, 16 loads",
        time_graph(s, [&] { read_kernel<16><<<static_cast<int>((chunks16 + 3) / 4), 128, 0, s>>>(data, chunks16, out); }));
    const int64_t chunks32 = chunks16 / 2;
    row("grid stride, 4 blocks/SM, 32 loads",
        time_graph(s, [&] { read_kernel<32><<<sms * 4, 128, 0, s>>>(data, chunks32, out); }));
    row("cudaMemcpyAsync (reads + writes)", time_graph(s, [&] {
          check(cudaMemcpyAsync(data + (bytes / 2 / 16), data, static_cast<size_t>(moved / 2), cudaMemcpyDeviceToDevice, s),
                "memcpy");
        }));
  }
  return 0;
}

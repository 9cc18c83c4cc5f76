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

// The access patterns of the decode kernels, without their arithmetic: a warp per tile of rows of
// row_bytes, reading each row in chunks, all of a chunk's loads issued before any is used. kMode:
//   0: 16 rows, lane (g, q) reads rows g and g + 8 at 16q + 64r (the FP8 tensor-core tile: 64 bytes of
//      8 rows an instruction, 512 bytes a row a chunk);
//   1: 8 rows, lane (g, q) reads row g at 16q + 64r, r < 16 (1 KB a row a chunk);
//   2: 16 rows, instruction r reads 512 contiguous bytes of row r (512 bytes a row a chunk);
//   3: 2 rows, 8 instructions of 512 contiguous bytes each (the bf16 stream kernel: 4 KB a row a chunk).
//   4: as 0, each load asking L2 for the whole 256-byte piece (load_stream_raw<256>, as the FP8 tile kernel).
template <int kMode>
__global__ void __launch_bounds__(128, 4) tile_kernel(const uint8_t* __restrict__ data, int64_t row_bytes,
                                                      int64_t tiles, float* out) {
  constexpr int kRows = kMode == 0 || kMode == 2 || kMode == 4 ? 16 : kMode == 1 ? 8 : 2;
  constexpr int kChunk = kMode == 0 || kMode == 2 || kMode == 4 ? 512 : kMode == 1 ? 1024 : 4096;
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  if (tile >= tiles) return;
  const uint8_t* base = data + tile * kRows * row_bytes;
  uint32_t acc = 0;
  for (int64_t c0 = 0; c0 < row_bytes; c0 += kChunk) {
    uint4 v[16];
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      int64_t r, k;  // row of the tile, byte of the row
      if constexpr (kMode == 0 || kMode == 4) r = g + 8 * (l % 2), k = c0 + 64 * (l / 2) + 16 * q;
      else if constexpr (kMode == 1) r = g, k = c0 + 64 * l + 16 * q;
      else if constexpr (kMode == 2) r = l, k = c0 + 16 * lane;
      else r = l / 8, k = c0 + 512 * (l % 8) + 16 * lane;
      v[l] = k >= row_bytes           ? make_uint4(0, 0, 0, 0)
             : kMode == 4 ? moekit::cuda::load_stream_raw<256>(base + r * row_bytes + k)
                          : moekit::cuda::load_stream_raw(base + r * row_bytes + k);
    }
#pragma unroll
    for (int l = 0; l < 16; ++l) acc ^= v[l].x + v[l].y + v[l].z + v[l].w;
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
  // MOEKIT_TILE_ROW_BYTES=R: the tile readers over rows of R bytes (7168: DeepSeek-V3's up rows in FP8).
  if (const char* r = std::getenv("MOEKIT_TILE_ROW_BYTES")) {
    const int64_t row_bytes = std::atoll(r);
    for (const double mb : sizes_mb) {
      const int64_t rows = static_cast<int64_t>(mb * 1e6) / row_bytes / 16 * 16;
      const double moved = static_cast<double>(rows) * row_bytes;
      const auto row = [&](const char* name, float us) {
        std::printf("%8.0f %-34s %9.2f %9.0f %12.0f\n", mb, name, us, moved / us / 1e3, moved / (us - empty) / 1e3);
      };
      const auto blocks = [&](int rows_per_tile) { return static_cast<int>((rows / rows_per_tile + 3) / 4); };
      const int64_t t16 = rows / 16, t8 = rows / 8, t2 = rows / 2;
      row("tile: 16 rows, mma layout", time_graph(s, [&] { tile_kernel<0><<<blocks(16), 128, 0, s>>>(reinterpret_cast<const uint8_t*>(data), row_bytes, t16, out); }));
      row("tile: 16 rows, mma layout, L2 256 B", time_graph(s, [&] { tile_kernel<4><<<blocks(16), 128, 0, s>>>(reinterpret_cast<const uint8_t*>(data), row_bytes, t16, out); }));
      row("tile: 8 rows, mma layout, 1 KB", time_graph(s, [&] { tile_kernel<1><<<blocks(8), 128, 0, s>>>(reinterpret_cast<const uint8_t*>(data), row_bytes, t8, out); }));
      row("tile: 16 rows, 512 B a load", time_graph(s, [&] { tile_kernel<2><<<blocks(16), 128, 0, s>>>(reinterpret_cast<const uint8_t*>(data), row_bytes, t16, out); }));
      row("tile: 2 rows, 4 KB chunks", time_graph(s, [&] { tile_kernel<3><<<blocks(2), 128, 0, s>>>(reinterpret_cast<const uint8_t*>(data), row_bytes, t2, out); }));
    }
    return 0;
  }
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

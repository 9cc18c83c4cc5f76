// Streams, timers and graphs on CUDA (and their CPU counterparts) for builds with CUDA.
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <optional>

#include "moekit/core/device_arena.h"
#include "moekit/device.h"

namespace moekit {
namespace {

void check(cudaError_t status, const char* what) {
  MOEKIT_CHECK(status == cudaSuccess, what, " failed: ", cudaGetErrorString(status));
}
cudaStream_t as_stream(void* h) {
  return static_cast<cudaStream_t>(h);
}
double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

DeviceStream::DeviceStream(Device device, bool ordered_with_default) : device_(device) {
  if (device.is_cpu()) return;
  std::string why;
  MOEKIT_CHECK(device_available(device, &why), "no stream on ", device_name(device), ": ", why);
  check(cudaSetDevice(device.index), "cudaSetDevice");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, ordered_with_default ? cudaStreamDefault : cudaStreamNonBlocking),
        "cudaStreamCreateWithFlags");
  handle_ = s;
}

DeviceStream::~DeviceStream() {
  if (handle_) (void)cudaStreamDestroy(as_stream(handle_));
}

void DeviceStream::synchronize() const {
  if (handle_) check(cudaStreamSynchronize(as_stream(handle_)), "cudaStreamSynchronize");
}

DeviceTimer::DeviceTimer(const DeviceStream& stream) : stream_(stream) {
  if (stream.device().is_cpu()) return;
  cudaEvent_t b, e;
  check(cudaEventCreate(&b), "cudaEventCreate");
  check(cudaEventCreate(&e), "cudaEventCreate");
  begin_ = b;
  end_ = e;
}

DeviceTimer::~DeviceTimer() {
  if (begin_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(begin_));
  if (end_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(end_));
}

void DeviceTimer::start() {
  if (begin_)
    check(cudaEventRecord(static_cast<cudaEvent_t>(begin_), as_stream(stream_.stream().handle)), "cudaEventRecord");
  else
    cpu_begin_ = now_ms();
}

void DeviceTimer::stop() {
  if (end_)
    check(cudaEventRecord(static_cast<cudaEvent_t>(end_), as_stream(stream_.stream().handle)), "cudaEventRecord");
  else
    cpu_end_ = now_ms();
}

double DeviceTimer::elapsed_ms() {
  if (!end_) return cpu_end_ - cpu_begin_;
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(end_)), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(begin_), static_cast<cudaEvent_t>(end_)),
        "cudaEventElapsedTime");
  return ms;
}

CapturedGraph::CapturedGraph(const DeviceStream& stream, const std::function<void()>& work, std::size_t memory_bytes)
    : stream_(stream) {
  MOEKIT_CHECK(stream.device().is_cuda(), "CUDA graphs need a CUDA stream, got ", device_name(stream.device()));
  cudaStream_t s = as_stream(stream.stream().handle);
  std::shared_ptr<DeviceArena> memory;
  if (memory_bytes > 0) memory = DeviceArena::make(stream.device(), memory_bytes);  // before the capture starts
  // A failed capture leaves its error as the thread's last CUDA error, where the next kernel launch's
  // check would find it: clear it, so that the caller can go on without the graph.
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  {
    // The scope closes after the capture ends: memory it defers freeing is freed outside the capture.
    std::optional<ArenaScope> scope;
    if (memory) scope.emplace(memory);
    std::exception_ptr thrown;
    try {
      work();
    } catch (...) {
      thrown = std::current_exception();
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(s, &graph);
    if (thrown || ended != cudaSuccess) {
      if (graph) (void)cudaGraphDestroy(graph);
      scope.reset();
      (void)cudaGetLastError();
      if (thrown) std::rethrow_exception(thrown);
      MOEKIT_FAIL("cudaStreamEndCapture failed: ", cudaGetErrorString(ended),
                  " (did the captured work synchronise, or allocate without memory of the graph's own?)");
    }
    graph_ = graph;
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, static_cast<cudaGraph_t>(graph_), 0);
  if (instantiated != cudaSuccess) {
    (void)cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
    graph_ = nullptr;
    (void)cudaGetLastError();
    MOEKIT_FAIL("cudaGraphInstantiate failed: ", cudaGetErrorString(instantiated));
  }
  exec_ = exec;
  memory_ = std::move(memory);
}

CapturedGraph::~CapturedGraph() {
  if (exec_) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) (void)cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
}

void CapturedGraph::replay() {
  check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), as_stream(stream_.stream().handle)), "cudaGraphLaunch");
}

void copy_into(Tensor& dst, const Tensor& src, const DeviceStream& stream) {
  MOEKIT_CHECK(dst.shape() == src.shape() && dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous(),
               "copy_into: ", dst.describe(), " <- ", src.describe(), " must match and be contiguous");
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    std::memcpy(dst.data(), src.data(), src.nbytes());
    return;
  }
  check(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault, as_stream(stream.stream().handle)),
        "cudaMemcpyAsync");
}

}  // namespace moekit

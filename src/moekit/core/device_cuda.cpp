// Streams, timers and graphs on CUDA (and their CPU counterparts) for builds with CUDA.
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>

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

DeviceStream::DeviceStream(Device device) : device_(device) {
  if (device.is_cpu()) return;
  std::string why;
  MOEKIT_CHECK(device_available(device, &why), "no stream on ", device_name(device), ": ", why);
  check(cudaSetDevice(device.index), "cudaSetDevice");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
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

CapturedGraph::CapturedGraph(const DeviceStream& stream, const std::function<void()>& work) : stream_(stream) {
  MOEKIT_CHECK(stream.device().is_cuda(), "CUDA graphs need a CUDA stream, got ", device_name(stream.device()));
  cudaStream_t s = as_stream(stream.stream().handle);
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  try {
    work();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    (void)cudaStreamEndCapture(s, &broken);
    if (broken) (void)cudaGraphDestroy(broken);
    throw;
  }
  cudaGraph_t graph = nullptr;
  check(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture (did the captured work synchronise or allocate?)");
  graph_ = graph;
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  exec_ = exec;
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

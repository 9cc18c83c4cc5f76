// Streams and timers for builds without CUDA: the CPU runs work synchronously, so a stream is a
// null handle and the timer reads a steady clock; graphs need CUDA and say so.
#include <chrono>
#include <cstring>

#include "moekit/core/device_memory.h"
#include "moekit/device.h"

namespace moekit {
namespace {
double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

DeviceStream::DeviceStream(Device device, bool) : device_(device) {
  MOEKIT_CHECK(device.is_cpu(), "no stream on ", device_name(device), ": ", kNoCudaReason);
}
DeviceStream::~DeviceStream() = default;
void DeviceStream::synchronize() const {}

DeviceTimer::DeviceTimer(const DeviceStream& stream) : stream_(stream) {}
DeviceTimer::~DeviceTimer() = default;
void DeviceTimer::start() {
  cpu_begin_ = now_ms();
}
void DeviceTimer::stop() {
  cpu_end_ = now_ms();
}
double DeviceTimer::elapsed_ms() {
  return cpu_end_ - cpu_begin_;
}

CapturedGraph::CapturedGraph(const DeviceStream& stream, const std::function<void()>&, std::size_t) : stream_(stream) {
  MOEKIT_FAIL("CUDA graphs: ", kNoCudaReason);
}
CapturedGraph::~CapturedGraph() = default;
void CapturedGraph::replay() {
  MOEKIT_FAIL("CUDA graphs: ", kNoCudaReason);
}

void copy_into(Tensor& dst, const Tensor& src, const DeviceStream&) {
  MOEKIT_CHECK(dst.shape() == src.shape() && dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous() &&
                   dst.device().is_cpu() && src.device().is_cpu(),
               "copy_into: ", dst.describe(), " <- ", src.describe(), " must match, be contiguous and on the CPU");
  std::memcpy(dst.data(), src.data(), src.nbytes());
}

}  // namespace moekit

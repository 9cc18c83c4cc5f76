// Streams, timing and CUDA graphs through the public API, so that tools and users can time and
// capture experts calls without touching the CUDA runtime themselves.
#pragma once

#include <functional>
#include <memory>

#include "moekit/experts.h"

namespace moekit {

// A stream on a device: the CPU "stream" is a null handle; on CUDA a new non-blocking stream.
class DeviceStream {
 public:
  explicit DeviceStream(Device device);
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  Stream stream() const { return {handle_}; }
  Device device() const { return device_; }
  void synchronize() const;

 private:
  Device device_;
  void* handle_ = nullptr;
};

// Elapsed time of the work queued on a stream between start() and stop(): CUDA events on a GPU,
// a steady clock (after the work) on the CPU.
class DeviceTimer {
 public:
  explicit DeviceTimer(const DeviceStream& stream);
  ~DeviceTimer();
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;
  void start();
  void stop();
  // Waits for stop() to complete and returns milliseconds.
  double elapsed_ms();

 private:
  const DeviceStream& stream_;
  void* begin_ = nullptr;
  void* end_ = nullptr;
  double cpu_begin_ = 0, cpu_end_ = 0;
};

// Work captured once on a CUDA stream and replayed as one graph launch. The captured calls must
// not allocate or synchronise (pass experts_forward a workspace); inputs are read from the same
// addresses on every replay, so write new inputs into the captured tensors to replay with them.
class CapturedGraph {
 public:
  CapturedGraph(const DeviceStream& stream, const std::function<void()>& work);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void replay();

 private:
  const DeviceStream& stream_;
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

// Copies src into dst (same shape and dtype, contiguous; any devices) in order on the stream.
void copy_into(Tensor& dst, const Tensor& src, const DeviceStream& stream);

}  // namespace moekit

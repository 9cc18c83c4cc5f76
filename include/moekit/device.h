// Streams, timing and CUDA graphs through the public API, so that tools and users can time and
// capture experts calls without touching the CUDA runtime themselves.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "moekit/experts.h"

namespace moekit {

// A stream on a device: the CPU "stream" is a null handle; on CUDA a new stream, by default non-blocking
// (independent of the default stream). ordered_with_default makes it a blocking stream instead: work on
// it and work on the legacy default stream, where moekit allocates, frees and copies tensors, run in the
// order they were queued, so tensors can be made and dropped around work on it without synchronising
// (the model runtime's stream); capturing such a stream fails loudly if anything touches the default
// stream during the capture, rather than leaving that work out of the graph.
class DeviceStream {
 public:
  explicit DeviceStream(Device device, bool ordered_with_default = false);
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

// Work captured once on a CUDA stream and replayed as one graph launch. The captured calls must not
// synchronise; inputs are read from the same addresses on every replay, so write new inputs into the
// captured tensors to replay with them. With memory_bytes = 0 they must not allocate either (pass
// experts_forward an output and a workspace). With memory_bytes > 0 the tensors that `work` makes
// (outputs, workspaces, intermediates) take their memory from a buffer of that size that the graph
// owns, in order and never reused, so every replay finds them where the capture put them; size it with
// a DeviceAllocationCounter around one uncaptured run of the same work. Tensors kept from the capture
// hold that memory (they stay valid after the graph is gone) and each replay rewrites them.
// A capture that fails (a call synchronised or allocated too much: moekit::Error; or the work threw: its
// exception) throws after ending the capture and leaves no CUDA error behind, so that the caller can run
// the work uncaptured instead.
class CapturedGraph {
 public:
  CapturedGraph(const DeviceStream& stream, const std::function<void()>& work, std::size_t memory_bytes = 0);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void replay();

 private:
  const DeviceStream& stream_;
  void* graph_ = nullptr;
  void* exec_ = nullptr;
  std::shared_ptr<void> memory_;  // the graph's own memory (memory_bytes > 0)
};

// Bytes of device memory that the tensors made on `device` by the calling thread take while the counter
// lives (each rounded up to 256 bytes, none reused): what a CapturedGraph of the same work needs as its
// own memory. The tensors are allocated as usual.
class DeviceAllocationCounter {
 public:
  explicit DeviceAllocationCounter(Device device);
  ~DeviceAllocationCounter();
  DeviceAllocationCounter(const DeviceAllocationCounter&) = delete;
  DeviceAllocationCounter& operator=(const DeviceAllocationCounter&) = delete;
  std::size_t bytes() const;

 private:
  struct Counting;
  std::unique_ptr<Counting> counting_;
};

// Copies src into dst (same shape and dtype, contiguous; any devices) in order on the stream.
void copy_into(Tensor& dst, const Tensor& src, const DeviceStream& stream);

}  // namespace moekit

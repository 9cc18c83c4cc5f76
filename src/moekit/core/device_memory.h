// Memory on a device: the one place that knows how CPU and CUDA memory are allocated and copied.
#pragma once

#include <cstddef>
#include <optional>

#include "moekit/tensor.h"

namespace moekit {

// Why CUDA cannot be used in a build without it.
inline constexpr const char* kNoCudaReason =
    "this build of moekit has no CUDA support (configured without it: nvcc not found or MOEKIT_CUDA=OFF)";

void* device_allocate(std::size_t bytes, Device device);
void device_free(void* data, Device device);
void device_copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes);
void device_memset(void* data, int value, std::size_t bytes, Device device);

struct ComputeCapability {
  int major = 0, minor = 0;
};
// The compute capability of a visible CUDA device; nothing for the CPU, a missing device or a build
// without CUDA.
std::optional<ComputeCapability> device_compute_capability(Device device);

}  // namespace moekit

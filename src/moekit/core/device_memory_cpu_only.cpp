// Device memory for builds without CUDA: CPU memory only; CUDA devices are refused with the reason.
#include <cstdlib>
#include <cstring>

#include "moekit/core/device_memory.h"
#include "moekit/core/host_memory.h"

namespace moekit {

void* device_allocate(std::size_t bytes, Device device) {
  MOEKIT_CHECK(device.is_cpu(), "cannot allocate on ", device_name(device), ": ", kNoCudaReason);
  return host_allocate(bytes);
}

void device_free(void* data, Device) {
  host_free(data);
}

void device_copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) {
  MOEKIT_CHECK(dst_device.is_cpu() && src_device.is_cpu(), "copy involving a CUDA device: ", kNoCudaReason);
  if (bytes) std::memcpy(dst, src, bytes);
}

void device_memset(void* data, int value, std::size_t bytes, Device device) {
  MOEKIT_CHECK(device.is_cpu(), "memset on ", device_name(device), ": ", kNoCudaReason);
  if (bytes) std::memset(data, value, bytes);
}

bool device_available(Device device, std::string* why_not) {
  if (device.is_cpu()) return true;
  if (why_not) *why_not = kNoCudaReason;
  return false;
}

std::optional<std::size_t> available_memory_bytes(Device device) {
  return device.is_cpu() ? host_available_bytes() : std::nullopt;
}

std::optional<ComputeCapability> device_compute_capability(Device) {
  return std::nullopt;
}

void synchronize(Device) {}

}  // namespace moekit

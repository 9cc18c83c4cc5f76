// Device memory for builds with CUDA. Device allocations are stream-ordered (cudaMallocAsync on the
// legacy default stream, which orders with every blocking stream), so that freeing a temporary
// workspace never waits for the GPU and memory is reused from the driver's pool.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "moekit/core/device_memory.h"
#include "moekit/core/host_memory.h"

namespace moekit {

namespace {

void check_cuda(cudaError_t status, const char* what) {
  MOEKIT_CHECK(status == cudaSuccess, what, " failed: ", cudaGetErrorString(status));
}

// Makes device the current device for the calling thread.
void use_device(Device device) {
  int current = -1;
  check_cuda(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device.index) check_cuda(cudaSetDevice(device.index), "cudaSetDevice");
}
}  // namespace

void* device_allocate(std::size_t bytes, Device device) {
  if (device.is_cpu()) {
    return host_allocate(bytes);
  }
  std::string why;
  MOEKIT_CHECK(device_available(device, &why), "cannot allocate on ", device_name(device), ": ", why);
  use_device(device);
  void* p = nullptr;
  const cudaError_t status = cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, cudaStreamLegacy);
  MOEKIT_CHECK(status == cudaSuccess, "out of memory on ", device_name(device), " allocating ", bytes,
               " bytes: ", cudaGetErrorString(status));
  return p;
}

void device_free(void* data, Device device) {
  if (device.is_cpu()) {
    host_free(data);
    return;
  }
  // Errors cannot be thrown from a deleter; a failed free leaks rather than aborting.
  (void)cudaFreeAsync(data, cudaStreamLegacy);
}

void device_copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Synchronous with respect to the host: a copy to the CPU is readable when this returns.
  check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
}

void device_memset(void* data, int value, std::size_t bytes, Device device) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memset(data, value, bytes);
    return;
  }
  use_device(device);
  check_cuda(cudaMemsetAsync(data, value, bytes, cudaStreamLegacy), "cudaMemsetAsync");
}

bool device_available(Device device, std::string* why_not) {
  if (device.is_cpu()) return true;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    if (why_not)
      *why_not = std::string("no CUDA GPU is visible (") +
                 (status != cudaSuccess ? cudaGetErrorString(status) : "0 devices") + ")";
    (void)cudaGetLastError();
    return false;
  }
  if (device.index >= count) {
    if (why_not)
      *why_not = "cuda:" + std::to_string(device.index) + " does not exist; " + std::to_string(count) +
                 " CUDA device(s) visible";
    return false;
  }
  return true;
}

std::optional<std::size_t> available_memory_bytes(Device device) {
  if (device.is_cpu()) return host_available_bytes();
  if (!device_available(device)) return std::nullopt;
  use_device(device);
  std::size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  return free;
}

std::optional<ComputeCapability> device_compute_capability(Device device) {
  if (!device_available(device)) return std::nullopt;
  ComputeCapability cc;
  if (cudaDeviceGetAttribute(&cc.major, cudaDevAttrComputeCapabilityMajor, device.index) != cudaSuccess ||
      cudaDeviceGetAttribute(&cc.minor, cudaDevAttrComputeCapabilityMinor, device.index) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  return cc;
}

void synchronize(Device device) {
  if (device.is_cpu()) return;
  use_device(device);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace moekit

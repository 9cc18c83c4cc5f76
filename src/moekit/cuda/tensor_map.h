// Tensor maps of the bulk tensor copy engine (TMA, sm_90): the host-side description of a tiled view
// of a tensor in device memory that a kernel receives as a __grid_constant__ parameter. Also the two
// device facts the Hopper launchers size and choose by (multiprocessors, compute capability 9.0), and
// the environment switches that keep an older kernel path.
#pragma once

#include <cuda.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "moekit/dtype.h"

namespace moekit::cuda {

// A view of `rank` dimensions (innermost first): sizes in elements, strides in bytes of dimensions
// 1..rank-1 (dimension 0 is contiguous), and the box one copy moves. Every stride must be a multiple
// of 16 bytes and the base 16-byte aligned; the box's inner extent is at most 128 bytes, which the
// 128-byte swizzle (the layout wgmma reads without bank conflicts) needs.
struct TensorMapShape {
  int rank = 2;
  std::array<uint64_t, 5> sizes{};
  std::array<uint64_t, 4> strides{};
  std::array<uint32_t, 5> box{};
  // f32 elements with the 128-byte swizzle too (the backward's float z tiles, which ld.shared reads by rows of a
  // warp's accumulator layout); by default f32 maps are unswizzled (the FP8 scales).
  bool swizzle_f32 = false;
};

// Encodes the map for bf16, f16 or f8_e4m3 elements with the 128-byte swizzle (the box's inner extent
// at most 128 bytes), or for f32 without swizzle unless shape.swizzle_f32; reads past the edges of the tensor fill the
// box with zeros. Throws naming the violated constraint.
CUtensorMap make_tensor_map(const void* base, DType dtype, const TensorMapShape& shape);

// The current device's ordinal.
int current_device();

// query() (a non-negative int) for the current device, asked once per device and then remembered in
// cache (devices past its size are asked every time). For host-side facts that cost more to ask the
// driver for on every call than a small kernel takes to run.
template <typename Query>
int once_per_device(std::array<int, 64>& cache, std::mutex& mutex, Query query) {
  const int device = current_device();
  if (device >= static_cast<int>(cache.size())) return query();
  std::lock_guard lock(mutex);
  if (cache[device] == 0) cache[device] = query() + 1;  // 0 marks "not asked yet"
  return cache[device] - 1;
}

// Lets `kernel` (a __global__ function) be launched on the current device with up to `bytes` of dynamic
// shared memory (cudaFuncAttributeMaxDynamicSharedMemorySize). The driver is asked only when the kernel
// needs more than it was last given on this device: the attribute is an upper bound, and asking on every
// call costs host time that a decode step's kernels do not take.
void allow_dynamic_shared_memory(const void* kernel, std::size_t bytes);

// Multiprocessors of the current device (cached per device).
int multiprocessor_count();
// The most shared memory one block may use on the current device, opted in (cached per device).
int max_shared_memory_per_block();
// Shared memory one multiprocessor has for its blocks, in all (cached per device).
int shared_memory_per_multiprocessor();
// Whether the current device is compute capability 9.0, where the sm_90a kernels run (cached).
bool device_is_sm90();

// Whether p is 16-byte aligned (the vector loads' requirement).
inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace moekit::cuda

// Tensor maps of the bulk tensor copy engine (TMA, sm_90): the host-side description of a tiled view
// of a tensor in device memory that a kernel receives as a __grid_constant__ parameter. Also the two
// device facts the Hopper launchers size and choose by (multiprocessors, compute capability 9.0).
#pragma once

#include <cuda.h>

#include <array>
#include <cstdint>

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
};

// Encodes the map for bf16, f16 or f8_e4m3 elements with the 128-byte swizzle (the box's inner extent
// at most 128 bytes), or for f32 without swizzle (scales); reads past the edges of the tensor fill the
// box with zeros. Throws naming the violated constraint.
CUtensorMap make_tensor_map(const void* base, DType dtype, const TensorMapShape& shape);

// Multiprocessors of the current device (cached per device).
int multiprocessor_count();
// Whether the current device is compute capability 9.0, where the sm_90a kernels run (cached).
bool device_is_sm90();

}  // namespace moekit::cuda

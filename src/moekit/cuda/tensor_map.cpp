#include "moekit/cuda/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <array>
#include <map>
#include <mutex>
#include <utility>

#include "moekit/cuda/cuda_check.h"

namespace moekit::cuda {
namespace {

// The driver's encoder, reached through the runtime so that moekit does not link libcuda itself
// (the runtime is linked statically and finds the driver at run time).
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MOEKIT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    MOEKIT_CHECK(found == cudaDriverEntryPointSuccess && p != nullptr,
                 "the CUDA driver has no cuTensorMapEncodeTiled (needs a CUDA 12 driver or newer)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace

CUtensorMap make_tensor_map(const void* base, DType dtype, const TensorMapShape& s) {
  CUtensorMapDataType type{};
  switch (dtype) {
    case DType::bf16:
      type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
      break;
    case DType::f16:
      type = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
      break;
    case DType::f8_e4m3:
      type = CU_TENSOR_MAP_DATA_TYPE_UINT8;  // the copy engine moves bytes; wgmma reads them as e4m3
      break;
    case DType::f32:
      type = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
      break;
    default:
      MOEKIT_FAIL("tensor map: bf16, f16, f8_e4m3 or f32 elements only, not ", dtype_name(dtype));
  }
  const bool swizzled = dtype != DType::f32 || s.swizzle_f32;
  const uint64_t element = dtype_size(dtype);
  MOEKIT_CHECK(s.rank >= 1 && s.rank <= 5, "tensor map: rank ", s.rank, " is outside 1..5");
  MOEKIT_CHECK((reinterpret_cast<uintptr_t>(base) & 15u) == 0, "tensor map: base address not 16-byte aligned");
  MOEKIT_CHECK(!swizzled || s.box[0] * element <= 128, "tensor map: inner box of ", s.box[0],
               " elements exceeds the 128-byte swizzle");
  MOEKIT_CHECK(s.box[0] * element % 16 == 0, "tensor map: inner box of ", s.box[0],
               " elements is not a multiple of 16 bytes");
  for (int d = 0; d < s.rank; ++d) {
    MOEKIT_CHECK(s.sizes[d] >= 1 && s.box[d] >= 1 && s.box[d] <= 256, "tensor map: dimension ", d, " size ", s.sizes[d],
                 " box ", s.box[d]);
    if (d > 0)
      MOEKIT_CHECK(s.strides[d - 1] % 16 == 0, "tensor map: stride of dimension ", d, " (", s.strides[d - 1],
                   " bytes) is not a multiple of 16");
  }
  std::array<cuuint32_t, 5> element_strides{1, 1, 1, 1, 1};
  CUtensorMap map{};
  const CUresult r = encoder()(&map, type, static_cast<cuuint32_t>(s.rank), const_cast<void*>(base), s.sizes.data(),
                               s.strides.data(), s.box.data(), element_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE,
                               swizzled ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOEKIT_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (error ", static_cast<int>(r), ") for a rank ", s.rank,
               " map with inner size ", s.sizes[0]);
  return map;
}

int current_device() {
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

namespace {

// One attribute of the current device, cached per device.
int cached_attribute(cudaDeviceAttr attr, std::array<int, 64>& cache, std::mutex& mutex) {
  return once_per_device(cache, mutex, [&] {
    int v = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, current_device()));
    return v;
  });
}

}  // namespace

void allow_dynamic_shared_memory(const void* kernel, std::size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, std::size_t> granted;  // (device, kernel) -> bytes
  const int device = current_device();
  std::lock_guard lock(mutex);
  std::size_t& given = granted[{device, kernel}];
  if (bytes <= given) return;
  MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  given = bytes;
}

int multiprocessor_count() {
  static std::mutex mutex;
  static std::array<int, 64> cache{};
  return cached_attribute(cudaDevAttrMultiProcessorCount, cache, mutex);
}

int max_shared_memory_per_block() {
  static std::mutex mutex;
  static std::array<int, 64> cache{};
  return cached_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, cache, mutex);
}

int shared_memory_per_multiprocessor() {
  static std::mutex mutex;
  static std::array<int, 64> cache{};
  return cached_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, cache, mutex);
}

bool device_is_sm90() {
  static std::mutex mutex;
  static std::array<int, 64> major{}, minor{};
  return cached_attribute(cudaDevAttrComputeCapabilityMajor, major, mutex) == 9 &&
         cached_attribute(cudaDevAttrComputeCapabilityMinor, minor, mutex) == 0;
}

}  // namespace moekit::cuda

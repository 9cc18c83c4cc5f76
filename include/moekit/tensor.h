// Tensor: a typed, strided view over a Storage. Owning tensors allocate their storage; views wrap
// memory that the caller owns (from_blob) or share the storage of another tensor (slices, reshapes).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <typeindex>
#include <unordered_map>
#include <vector>

#include "moekit/dtype.h"

namespace moekit {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  friend bool operator==(const Device&, const Device&) = default;
};

std::string device_name(Device device);  // "cpu", "cuda:0"
// Whether this build and machine can use the device (CUDA built in and such a GPU visible); if not,
// why_not says why.
bool device_available(Device device, std::string* why_not = nullptr);
// Bytes that new allocations on the device can take now: on the CPU the kernel's MemAvailable, lowered
// to what the process's cgroup memory limit leaves; on a GPU cudaMemGetInfo's free bytes. Nothing when
// it cannot be read (no /proc/meminfo, an unavailable device).
std::optional<std::size_t> available_memory_bytes(Device device);
// Waits until all work queued on the device is done (nothing on the CPU).
void synchronize(Device device);
Device parse_device(std::string_view name);

// A block of memory and what frees it. Derived data computed from the bytes (packed copies of expert
// weights, say) can be attached to a storage so that it lives exactly as long as the bytes do; call
// Tensor::mark_modified after writing into weights in place so those attachments are dropped.
class Storage {
 public:
  Storage(void* data, std::size_t bytes, Device device, std::function<void(void*)> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

  // Returns the attachment stored under key, creating it with make() on first use (thread-safe).
  std::shared_ptr<void> attachment(const std::string& key, const std::function<std::shared_ptr<void>()>& make);
  void clear_attachments();

 private:
  void* data_;
  std::size_t bytes_;
  Device device_;
  std::function<void(void*)> deleter_;
  std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<void>> attachments_;
};

using Shape = std::vector<int64_t>;

std::string shape_string(const Shape& shape);  // "[2, 3]"

class Tensor {
 public:
  // An undefined tensor: no storage. Used for optional inputs (biases).
  Tensor() = default;

  // A new, uninitialised, contiguous tensor.
  static Tensor empty(Shape shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::cpu());
  // A view of memory the caller owns and keeps alive; strides in elements (empty = contiguous).
  static Tensor from_blob(void* data, Shape shape, DType dtype, Device device = Device::cpu(), Shape strides = {});
  // A view of `shape` (strides in elements, empty = contiguous) starting offset_bytes into a storage whose
  // deleter keeps the bytes alive (a file mapping, say); every byte it reaches must lie inside the storage.
  static Tensor from_storage(std::shared_ptr<Storage> storage, std::size_t offset_bytes, Shape shape, DType dtype,
                             Shape strides = {});

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const;
  int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  std::size_t storage_offset_bytes() const { return offset_bytes_; }

  void* data() const;
  template <typename T>
  T* data_as() const {
    MOEKIT_CHECK(dtype_of<T>() == dtype_, "tensor holds ", dtype_name(dtype_), ", accessed as ",
                 dtype_name(dtype_of<T>()));
    return static_cast<T*>(data());
  }

  // Views sharing this tensor's storage.
  Tensor slice(int64_t dim, int64_t start, int64_t end) const;  // [start, end) along dim
  Tensor select(int64_t dim, int64_t index) const;              // drops dim
  Tensor reshape(Shape shape) const;                            // contiguous tensors only
  Tensor transpose(int64_t d0, int64_t d1) const;

  // A contiguous copy (same device). CPU only for now.
  Tensor contiguous() const;
  Tensor clone() const;
  // Element-wise conversion to another floating or index dtype (CPU).
  Tensor to(DType dtype) const;
  // Copies to another device (CPU <-> CUDA when built with CUDA).
  Tensor to(Device device) const;
  // Fills every byte with value (used to poison outputs in tests).
  void fill_bytes(uint8_t value);

  // Drops data derived from this tensor's bytes (packed weights); call after writing in place.
  void mark_modified() const;

  // "bf16[2, 3] on cpu"
  std::string describe() const;

 private:
  std::shared_ptr<Storage> storage_;
  std::size_t offset_bytes_ = 0;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::f32;
  Device device_;
};

}  // namespace moekit

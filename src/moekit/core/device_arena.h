// Memory for the tensors that work captured into a CUDA graph makes (device.h: CapturedGraph's own
// memory), and the count that sizes it (DeviceAllocationCounter).
//
// While an ArenaScope is open on a thread, that thread's new tensors on the arena's device take their
// memory from the arena: carved in order out of one buffer, 256-byte aligned, and never reused, because a
// graph replays its kernels with the addresses they were captured with, so what one kernel wrote must stay
// where the next one reads it. A tensor from the arena keeps the arena alive. A counting arena (capacity 0)
// hands out nothing: tensors are allocated as usual and used() adds up what an arena would need for the
// same allocations.
//
// Other memory freed on the thread while a carving scope is open is freed when the scope closes: on CUDA a
// free is queued on the default stream, which a capture in progress forbids touching.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "moekit/tensor.h"

namespace moekit {

class DeviceArena : public std::enable_shared_from_this<DeviceArena> {
 public:
  // capacity 0: counting only (no buffer).
  static std::shared_ptr<DeviceArena> make(Device device, std::size_t capacity);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  Device device() const { return device_; }
  bool counting() const { return capacity_ == 0; }
  std::size_t capacity() const { return capacity_; }
  std::size_t used() const { return used_; }  // bytes handed out (or counted), alignment included

  // The storage of a new tensor of `bytes` bytes: the next piece of the buffer; throws when it does not
  // fit. A counting arena only counts (device_storage then allocates as usual).
  std::shared_ptr<Storage> allocate(std::size_t bytes);
  void count(std::size_t bytes);

 private:
  DeviceArena(Device device, std::size_t capacity);
  Device device_;
  std::size_t capacity_ = 0, used_ = 0;
  void* buffer_ = nullptr;
};

// Opens an arena on the calling thread until destroyed. Scopes nest and must close on the thread that
// opened them, in reverse order: a new tensor comes from the innermost carving arena of its device, and
// every counting arena opened inside that one counts it.
class ArenaScope {
 public:
  explicit ArenaScope(std::shared_ptr<DeviceArena> arena);
  ~ArenaScope();
  ArenaScope(const ArenaScope&) = delete;
  ArenaScope& operator=(const ArenaScope&) = delete;

  // For the deleters of tensors not from an arena: while a carving scope for the device is open on this
  // thread, keeps p to free when the innermost one closes and returns true.
  static bool defer_free(void* p, Device device);

 private:
  friend std::shared_ptr<Storage> device_storage(std::size_t bytes, Device device);
  std::shared_ptr<DeviceArena> arena_;
  std::vector<void*> deferred_frees_;
};

// The storage of a new tensor: from the thread's innermost carving arena for the device, else
// device_allocate'd memory that device_free releases (when the scope closes, if a carving one is open on
// the freeing thread); counted by the counting arenas open inside.
std::shared_ptr<Storage> device_storage(std::size_t bytes, Device device);

}  // namespace moekit

#include "moekit/core/device_arena.h"

#include <algorithm>

#include "moekit/core/device_memory.h"
#include "moekit/device.h"
#include "moekit/error.h"

namespace moekit {
namespace {

// cudaMallocAsync's alignment, which the vectorised kernels (16-byte loads) rely on.
constexpr std::size_t kAlignment = 256;

std::size_t aligned(std::size_t bytes) {
  return (std::max<std::size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
}

// The scopes open on this thread, innermost last.
thread_local std::vector<ArenaScope*> open_scopes;

}  // namespace

std::shared_ptr<DeviceArena> DeviceArena::make(Device device, std::size_t capacity) {
  return std::shared_ptr<DeviceArena>(new DeviceArena(device, capacity));
}

DeviceArena::DeviceArena(Device device, std::size_t capacity) : device_(device), capacity_(capacity) {
  if (capacity_ > 0) buffer_ = device_allocate(capacity_, device_);
}

DeviceArena::~DeviceArena() {
  if (buffer_ != nullptr) device_free(buffer_, device_);
}

std::shared_ptr<Storage> DeviceArena::allocate(std::size_t bytes) {
  MOEKIT_CHECK(!counting(), "device arena on ", device_name(device_), ": a counting arena hands out no memory");
  const std::size_t size = aligned(bytes);
  MOEKIT_CHECK(size <= capacity_ - used_, "device arena on ", device_name(device_), ": ", bytes,
               " more bytes do not fit (", used_, " of ", capacity_,
               " used); the work allocates more than the run that sized the arena did");
  void* data = static_cast<unsigned char*>(buffer_) + used_;
  used_ += size;
  // The tensor keeps the arena's buffer alive; there is nothing to free piece by piece.
  return std::make_shared<Storage>(data, bytes, device_, [keep = shared_from_this()](void*) {});
}

void DeviceArena::count(std::size_t bytes) {
  used_ += aligned(bytes);
}

ArenaScope::ArenaScope(std::shared_ptr<DeviceArena> arena) : arena_(std::move(arena)) {
  MOEKIT_CHECK(arena_ != nullptr, "ArenaScope: no arena");
  open_scopes.push_back(this);
}

ArenaScope::~ArenaScope() {
  // Scopes close in reverse order of opening (they live on the stack of one thread).
  if (!open_scopes.empty() && open_scopes.back() == this) open_scopes.pop_back();
  for (void* p : deferred_frees_) device_free(p, arena_->device());
}

bool ArenaScope::defer_free(void* p, Device device) {
  for (auto it = open_scopes.rbegin(); it != open_scopes.rend(); ++it) {
    if ((*it)->arena_->device() != device || (*it)->arena_->counting()) continue;
    (*it)->deferred_frees_.push_back(p);
    return true;
  }
  return false;
}

std::shared_ptr<Storage> device_storage(std::size_t bytes, Device device) {
  // Every counting scope inside the innermost carving one counts; that one hands out the memory.
  for (auto it = open_scopes.rbegin(); it != open_scopes.rend(); ++it) {
    DeviceArena& arena = *(*it)->arena_;
    if (arena.device() != device) continue;
    if (!arena.counting()) return arena.allocate(bytes);
    arena.count(bytes);
  }
  void* data = device_allocate(bytes, device);
  return std::make_shared<Storage>(data, bytes, device, [device](void* p) {
    if (!ArenaScope::defer_free(p, device)) device_free(p, device);
  });
}

struct DeviceAllocationCounter::Counting {
  std::shared_ptr<DeviceArena> arena;
  ArenaScope scope;
  explicit Counting(std::shared_ptr<DeviceArena> a) : arena(a), scope(std::move(a)) {}
};

DeviceAllocationCounter::DeviceAllocationCounter(Device device)
    : counting_(std::make_unique<Counting>(DeviceArena::make(device, 0))) {}
DeviceAllocationCounter::~DeviceAllocationCounter() = default;
std::size_t DeviceAllocationCounter::bytes() const {
  return counting_->arena->used();
}

}  // namespace moekit

#include "moekit/core/host_memory.h"

#include <sys/mman.h>

#include <cstdlib>

#include "moekit/error.h"

namespace moekit {

namespace {
constexpr std::size_t kAlignment = 64;
constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kHugeThreshold = std::size_t{4} << 20;
}  // namespace

void* host_allocate(std::size_t bytes) {
  const bool huge = bytes >= kHugeThreshold;
  const std::size_t alignment = huge ? kHugePage : kAlignment;
  const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded);
  MOEKIT_CHECK(p != nullptr, "out of host memory allocating ", bytes, " bytes");
  // Advice only: where transparent huge pages are off, this fails harmlessly.
  if (huge) (void)madvise(p, rounded, MADV_HUGEPAGE);
  return p;
}

void host_free(void* data) {
  std::free(data);
}

}  // namespace moekit

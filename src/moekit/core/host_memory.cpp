#include "moekit/core/host_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

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

namespace {

// The number after "key:" in /proc/meminfo (kB), in bytes.
std::optional<std::size_t> meminfo_bytes(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string name;
  std::size_t kb = 0;
  std::string unit;
  while (in >> name >> kb) {
    std::getline(in, unit);
    if (name == key + ":") return kb * 1024;
  }
  return std::nullopt;
}

// One cgroup memory controller's files: v2's memory.max and memory.stat "anon", or v1's
// memory.limit_in_bytes and memory.stat "total_rss".
struct CgroupMemoryFiles {
  std::string limit, stat, anon_key;
};

// The process's memory cgroup from /proc/self/cgroup ("0::<path>" for v2, "<n>:memory:<path>" for v1);
// inside a container the path may not exist under /sys/fs/cgroup, whose top is then the container's.
std::optional<CgroupMemoryFiles> cgroup_memory_files() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  std::error_code ignored;
  auto pick = [&](const std::string& top, const std::string& path) {
    return std::filesystem::exists(top + path, ignored) ? top + path : top;
  };
  while (std::getline(in, line)) {
    if (line.starts_with("0::")) {
      const std::string dir = pick("/sys/fs/cgroup", line.substr(3));
      if (std::filesystem::exists(dir + "/memory.max", ignored))
        return CgroupMemoryFiles{dir + "/memory.max", dir + "/memory.stat", "anon"};
    } else if (const auto at = line.find(":memory:"); at != std::string::npos) {
      const std::string dir = pick("/sys/fs/cgroup/memory", line.substr(at + 8));
      return CgroupMemoryFiles{dir + "/memory.limit_in_bytes", dir + "/memory.stat", "total_rss"};
    }
  }
  return std::nullopt;
}

// The cgroup's memory limit less its anonymous memory: what the OOM killer lets the process still take.
// Page cache counts as free, as in MemAvailable, since the kernel reclaims it before killing (a mapped
// checkpoint's pages are page cache). Nothing where there is no limit.
std::optional<std::size_t> cgroup_room() {
  const std::optional<CgroupMemoryFiles> files = cgroup_memory_files();
  if (!files) return std::nullopt;
  std::ifstream limit_file(files->limit);
  std::string limit_text;
  if (!(limit_file >> limit_text) || limit_text == "max") return std::nullopt;
  std::size_t limit = 0;
  try {
    limit = static_cast<std::size_t>(std::stoull(limit_text));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  // v1 writes "no limit" as the largest page-aligned signed value.
  if (limit >= std::size_t{1} << 62) return std::nullopt;
  std::ifstream stat(files->stat);
  std::string key;
  std::size_t value = 0, anon = 0;
  while (stat >> key >> value)
    if (key == files->anon_key) anon = value;
  return limit > anon ? limit - anon : 0;
}

}  // namespace

std::optional<std::size_t> host_available_bytes() {
  std::optional<std::size_t> available = meminfo_bytes("MemAvailable");
  // A container's limit is often far below the machine's memory, and the OOM killer enforces it.
  if (const std::optional<std::size_t> room = cgroup_room()) available = available ? std::min(*available, *room) : room;
  return available;
}

}  // namespace moekit

// Host memory for tensors, shared by the CPU-only and CUDA builds.
#pragma once

#include <cstddef>
#include <optional>

namespace moekit {

// 64-byte aligned; blocks of 4 MB and more are 2 MB aligned and asked to be backed by huge pages
// (expert weights are streamed once per call, and 4 KB pages make every 4 KB of a stream a TLB miss).
void* host_allocate(std::size_t bytes);
void host_free(void* data);
// What available_memory_bytes(Device::cpu()) returns.
std::optional<std::size_t> host_available_bytes();

}  // namespace moekit

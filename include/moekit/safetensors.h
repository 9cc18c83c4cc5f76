// Safetensors files: a bounds-checked reader over a read-only memory mapping and a writer.
//
// Layout: u64 little-endian header length N | N bytes of JSON | data section. The JSON maps tensor
// names to {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative to the data section)
// and may hold "__metadata__", a string -> string map. Every byte of a file is untrusted: any
// inconsistency throws moekit::Error naming the file, the tensor or key, and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moekit/tensor.h"

namespace moekit {

// One tensor's entry in the header, as the file states it.
struct SafetensorsTensorInfo {
  std::string dtype_name;      // as in the file: "BF16", "F8_E4M3", "BOOL", ...
  std::optional<DType> dtype;  // empty for safetensors dtypes moekit has no type for (BOOL, I8, F64, ...)
  Shape shape;                 // as in the file; for F4 it counts 4-bit values (see SafetensorsFile::tensor)
  std::size_t begin = 0;       // byte range [begin, end) within the whole buffer (header included)
  std::size_t end = 0;
};

// A parsed and fully validated header: every tensor's byte range lies inside the buffer and matches
// its shape and dtype. Tensors may overlap or leave gaps; safetensors writers never do, but reading
// such a file is harmless.
struct SafetensorsHeader {
  std::map<std::string, SafetensorsTensorInfo> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"; empty when the file has none
  std::size_t data_start = 0;                   // 8 + header length
};

// The largest JSON header we accept (the limit the reference implementation uses).
inline constexpr std::size_t kSafetensorsMaxHeaderBytes = 100'000'000;

// Validates a whole safetensors buffer (header and every tensor's byte range). `source` names the
// buffer in error messages (the file path). Throws moekit::Error, never anything else.
SafetensorsHeader parse_safetensors(const uint8_t* data, std::size_t size, std::string_view source = "<buffer>");

// A validated safetensors file whose tensors are views of its bytes. Copies share the bytes; tensors
// keep them alive after the file object is gone.
class SafetensorsFile {
 public:
  // Maps the file read-only (mmap) and validates it.
  explicit SafetensorsFile(const std::string& path);
  // Takes ownership of an in-memory copy of a file (tests, fuzzing); `source` names it in errors.
  static SafetensorsFile from_bytes(std::vector<uint8_t> bytes, std::string source = "<buffer>");

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return header_.tensors.count(name) != 0; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const SafetensorsHeader& header() const { return header_; }
  // Throws naming the file and listing a few of the names it holds if there is no such tensor.
  const SafetensorsTensorInfo& info(const std::string& name) const;

  // A contiguous CPU view of the tensor's bytes that keeps the bytes alive. The bytes of a mapped
  // file are read-only: writing through the view faults, so clone() a tensor before modifying it.
  // A tensor whose bytes are not aligned to its element size is returned as an aligned copy, since
  // kernels read elements with natural alignment. F4 (4-bit values, two per byte) becomes an
  // f4_e2m1 tensor of packed pairs: the last dimension is halved, so it must be even. Throws for a
  // dtype moekit has no type for. Each call makes a new Storage, so data derived from the bytes and
  // attached to it (packed weights) lives as long as the returned tensor and its copies.
  Tensor tensor(const std::string& name) const;

 private:
  SafetensorsFile(std::shared_ptr<const void> owner, const uint8_t* data, std::size_t size, std::string path);

  std::shared_ptr<const void> owner_;  // the mapping or the byte vector
  const uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  std::string path_;
  SafetensorsHeader header_;
};

// Writes tensors (any moekit dtype, any device, any strides: a contiguous host copy is written) and
// string metadata. Names must be unique and not "__metadata__". Tensors are laid out by decreasing
// element size so that each starts aligned to its element size, without gaps, as the reference
// writer does; the header is padded with spaces to a multiple of 8 bytes. The file is written next
// to `path` and renamed into place, so a failed write never leaves a truncated file at `path`.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace moekit

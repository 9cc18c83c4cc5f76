// Safetensors reader and writer. No byte of a file is trusted: parse_safetensors is the one validation
// path for mapped files and in-memory buffers alike (the fuzzer drives it directly), and it throws only
// moekit::Error.
#include "moekit/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "moekit/io/json_input.h"

namespace moekit {
namespace {

using json = nlohmann::json;

// The dtypes of the safetensors format, their width in bits and the moekit type each one maps to.
// The widths of dtypes moekit has no type for are still needed to check those tensors' byte ranges,
// so that a checkpoint holding, say, a BOOL buffer still opens.
struct FormatDType {
  std::string_view name;
  uint64_t bits;
  std::optional<DType> dtype;
};

constexpr std::array<FormatDType, 20> kFormatDTypes = {{
    {"F32", 32, DType::f32},        {"F16", 16, DType::f16},      {"BF16", 16, DType::bf16},
    {"I32", 32, DType::i32},        {"I64", 64, DType::i64},      {"U8", 8, DType::u8},
    {"F8_E4M3", 8, DType::f8_e4m3}, {"F4", 4, DType::f4_e2m1},    {"F8_E8M0", 8, DType::ue8m0},
    {"BOOL", 8, std::nullopt},      {"I8", 8, std::nullopt},      {"F8_E5M2", 8, std::nullopt},
    {"I16", 16, std::nullopt},      {"U16", 16, std::nullopt},    {"U32", 32, std::nullopt},
    {"U64", 64, std::nullopt},      {"F64", 64, std::nullopt},    {"C64", 64, std::nullopt},
    {"F6_E2M3", 6, std::nullopt},   {"F6_E3M2", 6, std::nullopt},
}};

const FormatDType* find_format_dtype(std::string_view name) {
  for (const auto& f : kFormatDTypes)
    if (f.name == name) return &f;
  return nullptr;
}

const FormatDType& format_dtype_of(DType dtype) {
  for (const auto& f : kFormatDTypes)
    if (f.dtype == dtype) return f;
  MOEKIT_FAIL("dtype ", dtype_name(dtype), " has no safetensors name");
}

std::string format_dtype_names() {
  std::string names;
  for (const auto& f : kFormatDTypes) names += std::string(names.empty() ? "" : ", ") + std::string(f.name);
  return names;
}

// A JSON integer in [0, 2^64), or an error naming `what`.
uint64_t non_negative_integer(const json& v, std::string_view source, const std::string& name, const char* what) {
  MOEKIT_CHECK(!(v.is_number_integer() && !v.is_number_unsigned()), source, ": tensor '", name, "': ", what,
               " is negative: ", describe_json(v));
  MOEKIT_CHECK(v.is_number_unsigned(), source, ": tensor '", name, "': ", what,
               " must be a non-negative integer below 2^64, got ", describe_json(v));
  return v.get<uint64_t>();
}

SafetensorsTensorInfo parse_tensor_entry(const std::string& name, const json& entry, std::size_t data_start,
                                         std::size_t data_size, std::string_view source) {
  MOEKIT_CHECK(entry.is_object(), source, ": tensor '", name, "': expected an object with dtype, shape and ",
               "data_offsets, got ", describe_json(entry));
  for (const char* key : {"dtype", "shape", "data_offsets"})
    MOEKIT_CHECK(entry.contains(key), source, ": tensor '", name, "': missing key '", key, "'");

  SafetensorsTensorInfo info;
  const json& dtype = entry["dtype"];
  MOEKIT_CHECK(dtype.is_string(), source, ": tensor '", name, "': dtype must be a string, got ", describe_json(dtype));
  info.dtype_name = dtype.get<std::string>();
  const FormatDType* format = find_format_dtype(info.dtype_name);
  MOEKIT_CHECK(format != nullptr, source, ": tensor '", name, "': unknown dtype ", describe_json(dtype),
               "; safetensors dtypes: ", format_dtype_names());
  info.dtype = format->dtype;

  const json& shape = entry["shape"];
  MOEKIT_CHECK(shape.is_array(), source, ": tensor '", name, "': shape must be an array, got ", describe_json(shape));
  // The element count is bounded like Tensor's own (2^62), so every shape that passes can become a Tensor.
  constexpr uint64_t kMaxElements = uint64_t{1} << 62;
  uint64_t elements = 1;
  for (const json& d : shape) {
    const uint64_t dim = non_negative_integer(d, source, name, "a shape dimension");
    MOEKIT_CHECK(dim == 0 || elements <= kMaxElements / dim, source, ": tensor '", name,
                 "': shape has more than 2^62 elements");
    elements *= dim;
    info.shape.push_back(static_cast<int64_t>(dim));
  }

  const json& offsets = entry["data_offsets"];
  MOEKIT_CHECK(offsets.is_array() && offsets.size() == 2, source, ": tensor '", name,
               "': data_offsets must be an array [begin, end], got ", describe_json(offsets),
               offsets.is_array() ? " of size " + std::to_string(offsets.size()) : std::string());
  const uint64_t begin = non_negative_integer(offsets[0], source, name, "data_offsets begin");
  const uint64_t end = non_negative_integer(offsets[1], source, name, "data_offsets end");
  MOEKIT_CHECK(begin <= end, source, ": tensor '", name, "': data_offsets [", begin, ", ", end,
               ") has begin after end");
  MOEKIT_CHECK(end <= data_size, source, ": tensor '", name, "': data_offsets [", begin, ", ", end,
               ") run past the data section of ", data_size, " bytes");

  MOEKIT_CHECK(elements <= std::numeric_limits<uint64_t>::max() / format->bits, source, ": tensor '", name, "': shape ",
               shape_string(info.shape), " of ", info.dtype_name, " is too large");
  const uint64_t bits = elements * format->bits;
  MOEKIT_CHECK(bits % 8 == 0, source, ": tensor '", name, "': ", elements, " values of ", info.dtype_name,
               " do not fill whole bytes");
  MOEKIT_CHECK(bits / 8 == end - begin, source, ": tensor '", name, "': shape ", shape_string(info.shape), " of ",
               info.dtype_name, " needs ", bits / 8, " bytes but data_offsets [", begin, ", ", end, ") hold ",
               end - begin);
  info.begin = data_start + begin;
  info.end = data_start + end;
  return info;
}

std::map<std::string, std::string> parse_metadata(const json& metadata, std::string_view source) {
  MOEKIT_CHECK(metadata.is_object(), source, ": __metadata__ must be an object of strings, got ",
               describe_json(metadata));
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : metadata.items()) {
    MOEKIT_CHECK(value.is_string(), source, ": __metadata__ key '", key, "' must have a string value, got ",
                 describe_json(value));
    out.emplace(key, value.get<std::string>());
  }
  return out;
}

// Two tensors over the same bytes would alias: writing one (or loading it converted in place) changes
// the other, and no writer produces that. Empty tensors hold no bytes, so they may sit anywhere. Gaps
// are allowed.
void check_no_overlap(const SafetensorsHeader& header, std::string_view source) {
  std::vector<std::pair<const std::string*, const SafetensorsTensorInfo*>> ranges;
  ranges.reserve(header.tensors.size());
  for (const auto& [name, info] : header.tensors)
    if (info.begin < info.end) ranges.emplace_back(&name, &info);
  // Sorted by begin, ranges overlap only if two neighbours do.
  std::sort(ranges.begin(), ranges.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    const auto& [name_a, a] = ranges[i - 1];
    const auto& [name_b, b] = ranges[i];
    MOEKIT_CHECK(b->begin >= a->end, source, ": tensors '", *name_a, "' and '", *name_b, "' overlap: data_offsets [",
                 a->begin - header.data_start, ", ", a->end - header.data_start, ") and [",
                 b->begin - header.data_start, ", ", b->end - header.data_start, ")");
  }
}

// A read-only private mapping of a whole file; the file descriptor is not needed once mapped.
struct Mapping {
  void* address = nullptr;
  std::size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (address != nullptr) munmap(address, size);
  }
};

std::string errno_message() {
  return std::error_code(errno, std::generic_category()).message();
}

std::shared_ptr<const Mapping> map_read_only(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOEKIT_CHECK(fd >= 0, path, ": cannot open: ", errno_message());
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st {};
  MOEKIT_CHECK(fstat(fd, &st) == 0, path, ": cannot stat: ", errno_message());
  MOEKIT_CHECK(S_ISREG(st.st_mode), path, ": not a regular file");
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<std::size_t>(st.st_size);
  // An empty file cannot be mapped; parse_safetensors reports it as too short.
  if (mapping->size == 0) return mapping;
  void* address = mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
  MOEKIT_CHECK(address != MAP_FAILED, path, ": cannot map ", mapping->size, " bytes: ", errno_message());
  mapping->address = address;
  return mapping;
}

}  // namespace

SafetensorsHeader parse_safetensors(const uint8_t* data, std::size_t size, std::string_view source) {
  MOEKIT_CHECK(data != nullptr || size == 0, source, ": null buffer of ", size, " bytes");
  MOEKIT_CHECK(size >= 8, source, ": ", size, " bytes is too short for a safetensors file (it starts with an ",
               "8-byte header length)");
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{data[i]} << (8 * i);
  MOEKIT_CHECK(header_bytes <= kSafetensorsMaxHeaderBytes, source, ": header length ", header_bytes,
               " exceeds the limit of ", kSafetensorsMaxHeaderBytes, " bytes");
  MOEKIT_CHECK(header_bytes <= size - 8, source, ": header length ", header_bytes, " is larger than the file (",
               size - 8, " bytes follow the length field); the file is truncated or not safetensors");
  MOEKIT_CHECK(header_bytes > 0 && data[8] == '{', source, ": header must be a JSON object starting with '{'");

  // parse_json refuses repeated keys, so a tensor name, a metadata key or a field of an entry never
  // has a second value that would silently replace the first.
  const json root = parse_json(std::string_view(reinterpret_cast<const char*>(data) + 8, header_bytes),
                               std::string(source) + ": header");
  MOEKIT_CHECK(root.is_object(), source, ": header must be a JSON object, got ", describe_json(root));

  SafetensorsHeader header;
  header.data_start = 8 + static_cast<std::size_t>(header_bytes);
  const std::size_t data_size = size - header.data_start;
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__")
      header.metadata = parse_metadata(entry, source);
    else
      header.tensors.emplace(name, parse_tensor_entry(name, entry, header.data_start, data_size, source));
  }
  check_no_overlap(header, source);
  return header;
}

SafetensorsFile::SafetensorsFile(const std::string& path) {
  auto mapping = map_read_only(path);
  data_ = static_cast<const uint8_t*>(mapping->address);
  size_ = mapping->size;
  owner_ = std::move(mapping);
  path_ = path;
  header_ = parse_safetensors(data_, size_, path_);
}

SafetensorsFile::SafetensorsFile(std::shared_ptr<const void> owner, const uint8_t* data, std::size_t size,
                                 std::string path)
    : owner_(std::move(owner)), data_(data), size_(size), path_(std::move(path)) {
  header_ = parse_safetensors(data_, size_, path_);
}

SafetensorsFile SafetensorsFile::from_bytes(std::vector<uint8_t> bytes, std::string source) {
  auto owned = std::make_shared<const std::vector<uint8_t>>(std::move(bytes));
  const uint8_t* data = owned->data();
  const std::size_t size = owned->size();
  return SafetensorsFile(std::move(owned), data, size, std::move(source));
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(header_.tensors.size());
  for (const auto& [name, info] : header_.tensors) out.push_back(name);
  return out;
}

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = header_.tensors.find(name);
  if (it != header_.tensors.end()) return it->second;
  std::string held;
  std::size_t listed = 0;
  for (const auto& [n, i] : header_.tensors) {
    if (listed++ == 8) {
      held += ", ... (" + std::to_string(header_.tensors.size()) + " in all)";
      break;
    }
    held += (held.empty() ? "" : ", ") + n;
  }
  MOEKIT_FAIL(path_, ": no tensor named '", name, "'; the file holds: ", held.empty() ? "no tensors" : held);
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsTensorInfo& i = info(name);
  MOEKIT_CHECK(i.dtype.has_value(), path_, ": tensor '", name, "' has dtype ", i.dtype_name,
               ", which moekit has no type for");
  const DType dtype = *i.dtype;
  Shape shape = i.shape;
  if (dtype == DType::f4_e2m1) {
    MOEKIT_CHECK(!shape.empty() && shape.back() % 2 == 0, path_, ": F4 tensor '", name, "' ", shape_string(shape),
                 " needs an even last dimension: moekit holds 4-bit values as packed pairs along it");
    shape.back() /= 2;
  }
  const uint8_t* bytes = data_ + i.begin;
  const std::size_t nbytes = i.end - i.begin;
  if (nbytes != 0 && reinterpret_cast<uintptr_t>(bytes) % dtype_size(dtype) != 0) {
    Tensor copy = Tensor::empty(std::move(shape), dtype);
    std::memcpy(copy.data(), bytes, nbytes);
    return copy;
  }
  // The deleter frees nothing: it holds the file's bytes until the last view of them is gone.
  auto storage =
      std::make_shared<Storage>(const_cast<uint8_t*>(bytes), nbytes, Device::cpu(), [owner = owner_](void*) {});
  return Tensor::from_storage(std::move(storage), 0, std::move(shape), dtype);
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  struct Entry {
    const std::string* name;
    Tensor host;
    const FormatDType* format;
    Shape file_shape;
  };
  std::vector<Entry> entries;
  std::set<std::string_view> seen;
  for (const auto& [name, t] : tensors) {
    MOEKIT_CHECK(name != "__metadata__", path, ": a tensor cannot be named __metadata__ (the metadata key)");
    MOEKIT_CHECK(seen.insert(name).second, path, ": tensor name '", name, "' appears twice");
    MOEKIT_CHECK(t.defined(), path, ": tensor '", name, "' is undefined");
    Entry e{&name, t.to(Device::cpu()).contiguous(), &format_dtype_of(t.dtype()), t.shape()};
    if (t.dtype() == DType::f4_e2m1) {
      // moekit holds F4 as packed pairs; the format counts 4-bit values.
      MOEKIT_CHECK(!e.file_shape.empty(), path, ": f4_e2m1 tensor '", name,
                   "' must have at least one dimension (its last one holds packed pairs)");
      e.file_shape.back() *= 2;
    }
    entries.push_back(std::move(e));
  }
  // Widest elements first: with the data section 8-aligned, every tensor then starts aligned to its
  // element size without padding (the format allows no gaps between tensors).
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return dtype_size(a.host.dtype()) > dtype_size(b.host.dtype());
  });

  json header = json::object();
  std::size_t offset = 0;
  for (const Entry& e : entries) {
    const std::size_t bytes = e.host.nbytes();
    header[*e.name] = {{"dtype", e.format->name}, {"shape", e.file_shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    MOEKIT_FAIL(path, ": cannot encode the header (tensor names and metadata must be UTF-8): ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  const std::string temp_path = path + ".tmp" + std::to_string(getpid());
  struct RemoveUnlessKept {
    const std::string& path;
    bool keep = false;
    ~RemoveUnlessKept() {
      if (!keep) {
        std::error_code ignored;
        std::filesystem::remove(path, ignored);
      }
    }
  } cleanup{temp_path};
  {
    std::ofstream out(temp_path, std::ios::binary | std::ios::trunc);
    MOEKIT_CHECK(out.is_open(), path, ": cannot create ", temp_path, ": ", errno_message());
    std::array<char, 8> length{};
    for (std::size_t i = 0; i < 8; ++i) length[i] = static_cast<char>((uint64_t{text.size()} >> (8 * i)) & 0xffu);
    out.write(length.data(), length.size());
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const Entry& e : entries)
      if (e.host.nbytes() != 0)
        out.write(static_cast<const char*>(e.host.data()), static_cast<std::streamsize>(e.host.nbytes()));
    out.close();
    MOEKIT_CHECK(!out.fail(), path, ": writing ", temp_path, " failed: ", errno_message());
  }
  std::error_code ec;
  std::filesystem::rename(temp_path, path, ec);
  MOEKIT_CHECK(!ec, path, ": cannot move ", temp_path, " into place: ", ec.message());
  cleanup.keep = true;
}

}  // namespace moekit

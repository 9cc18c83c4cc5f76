// libFuzzer target for the safetensors reader. Any input must either parse or throw moekit::Error; a
// crash, a sanitizer report or any other exception escaping is a bug. Tensor views are built and read
// in full so that AddressSanitizer sees any byte range the parser let through past the input.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "moekit/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moekit::SafetensorsHeader header;
  try {
    header = moekit::parse_safetensors(data, size, "fuzz input");
  } catch (const moekit::Error&) {
    return 0;
  }
  // What parse_safetensors promises about every range it accepts.
  for (const auto& [name, info] : header.tensors)
    if (info.begin < header.data_start || info.begin > info.end || info.end > size) __builtin_trap();

  try {
    const auto file = moekit::SafetensorsFile::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz input");
    for (const auto& name : file.names()) {
      if (!file.info(name).dtype) continue;  // a safetensors dtype moekit has no type for
      moekit::Tensor t;
      try {
        t = file.tensor(name);
      } catch (const moekit::Error&) {
        continue;  // F4 with an odd last dimension
      }
      const auto* bytes = static_cast<const volatile uint8_t*>(t.data());
      uint8_t sum = 0;
      for (std::size_t i = 0; i < t.nbytes(); ++i) sum = static_cast<uint8_t>(sum + bytes[i]);
      (void)sum;
    }
  } catch (const moekit::Error&) {
    __builtin_trap();  // the bytes were accepted once; the same bytes must be accepted again
  }
  return 0;
}

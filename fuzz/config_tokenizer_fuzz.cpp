// libFuzzer target for the JSON a checkpoint brings besides its safetensors: every input is read both as
// a config.json (parse_json, then parse_model_config) and as a tokenizer.json (Tokenizer::from_json,
// then an encode and a decode). Each must succeed or throw moekit::Error; a crash, a sanitizer report
// or any other exception escaping is a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "moekit/io/json_input.h"
#include "moekit/model/model_config.h"
#include "moekit/tokenizer.h"

namespace {

void read_config(std::string_view text) {
  try {
    const nlohmann::json config = moekit::parse_json(text, "config.json");
    (void)moekit::parse_model_config(config);
  } catch (const moekit::Error&) {
  }
}

void read_tokenizer(std::string_view text) {
  std::vector<int32_t> ids;
  try {
    const moekit::Tokenizer tokenizer = moekit::Tokenizer::from_json(text, "tokenizer.json");
    ids = tokenizer.encode("Hello wörld <|im_end|> 12", true);
    // Ids the tokenizer gave back decode; so do ids past it (a padded model vocabulary).
    ids.push_back(static_cast<int32_t>(tokenizer.vocab_size()));
    (void)tokenizer.decode(ids, false);
    (void)tokenizer.decode(ids, true);
    moekit::DecodeStream stream(tokenizer);
    for (const int32_t id : ids) (void)stream.step(id);
    (void)stream.finish();
  } catch (const moekit::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  read_config(text);
  read_tokenizer(text);
  return 0;
}

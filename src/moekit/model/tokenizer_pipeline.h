// The components of a tokenizer.json around the model: normalizers, pre-tokenizers, post-processors and
// decoders, each built from its JSON object by one table per kind (the only list of supported types, which
// an error for any other type prints). Each behaves as the `tokenizers` library's component of the same
// type does on the ids and text (offsets, which moekit does not return, are not tracked).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moekit::tokenization {

// A piece of the text between the added-token split and the model.
struct Piece {
  std::string text;
  int32_t id = -1;        // >= 0: an added token, never normalized, pre-tokenized or split by the model
  bool at_start = false;  // begins at offset 0 of the original text (Metaspace's prepend_scheme "first")
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits, and may rewrite, every piece that is not an added token; drops pieces left empty.
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // The ids of one sequence -> the ids with the special tokens add_special_tokens adds.
  virtual void process(std::vector<int32_t>& ids) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // tokens -> tokens (decoders of a Sequence run one after the other); the text is their concatenation.
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

// Each returns nullptr for a JSON null and throws moekit::Error naming the component and its type for an
// unsupported type or a bad field.
std::unique_ptr<const Normalizer> make_normalizer(const nlohmann::json& config);
std::unique_ptr<const PreTokenizer> make_pre_tokenizer(const nlohmann::json& config);
std::unique_ptr<const PostProcessor> make_post_processor(const nlohmann::json& config);
std::unique_ptr<const Decoder> make_decoder(const nlohmann::json& config);

}  // namespace moekit::tokenization

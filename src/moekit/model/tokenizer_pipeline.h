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

// One step of the pipeline, applied in place to a Value. Every kind is one instantiation, so that one
// Sequence serves all four.
template <typename Value>
class Component {
 public:
  virtual ~Component() = default;
  virtual void apply(Value& value) const = 0;
};

// Text -> normalized text.
using Normalizer = Component<std::string>;
// Splits, and may rewrite, every piece that is not an added token; drops pieces left empty.
using PreTokenizer = Component<std::vector<Piece>>;
// The ids of one sequence -> the ids with the special tokens add_special_tokens adds.
using PostProcessor = Component<std::vector<int32_t>>;
// Tokens -> tokens (the decoders of a Sequence run one after the other); the text is their concatenation.
using Decoder = Component<std::vector<std::string>>;

// Each returns nullptr for a JSON null and throws moekit::Error naming the component and its type for an
// unsupported type or a bad field.
std::unique_ptr<const Normalizer> make_normalizer(const nlohmann::json& config);
std::unique_ptr<const PreTokenizer> make_pre_tokenizer(const nlohmann::json& config);
std::unique_ptr<const PostProcessor> make_post_processor(const nlohmann::json& config);
std::unique_ptr<const Decoder> make_decoder(const nlohmann::json& config);

}  // namespace moekit::tokenization

// The model runtime's tokenizer: reads a Hugging Face tokenizer.json (BPE models: byte-level as in GPT-2,
// Qwen and Llama-3, SentencePiece-style with byte fallback as in Llama-2 and Mixtral), encodes prompts and
// decodes generated ids, giving the ids and text the `tokenizers` library gives for the same file.
//
// Supported components of tokenizer.json (anything else is refused when the file is read, with an error
// naming the component and its type, never tokenized differently):
//   model           BPE: vocab, merges ("a b" strings or [a, b] pairs), unk_token, fuse_unk, byte_fallback,
//                   ignore_merges (no dropout, continuing_subword_prefix or end_of_word_suffix)
//   added_tokens    special and not, matched before the model; lstrip, rstrip, single_word, normalized
//   normalizer      NFC, NFD, NFKC, NFKD, Replace, Prepend, Sequence
//   pre_tokenizer   ByteLevel, Split (regex or string; every delimiter behaviour, invert), Metaspace, Sequence
//   post_processor  TemplateProcessing (the single-sequence template), ByteLevel, Sequence
//   decoder         ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence
// truncation and padding must be null (they would change a single encode's ids). Regexes are Oniguruma's, as
// tokenizers compiles them; the few constructs PCRE2 would read differently (\w, \b, \h, nested classes, \S
// inside a class) are refused. Added tokens must have the ids tokenizers gives them (the vocab's, else
// numbered on from the vocab), since the library renumbers others.
//
// A Tokenizer is immutable after loading; copies share it, and every method may be called from several
// threads at once. Errors are moekit::Error.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moekit {

class Tokenizer {
 public:
  // Reads a tokenizer.json.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  // The text of a tokenizer.json; `origin` names it in error messages.
  static Tokenizer from_json(std::string_view tokenizer_json, const std::string& origin = "tokenizer.json");
  // Reads dir/tokenizer.json and, when present, dir/tokenizer_config.json, of which only bos_token and
  // eos_token are read (a token string or an {"content": ...} object) for bos_token_id() / eos_token_id().
  // add_bos_token / add_eos_token are ignored, as transformers 5 ignores them when a tokenizer.json exists:
  // its post-processor alone decides what encode(text, true) adds.
  static Tokenizer from_directory(const std::filesystem::path& dir);

  // Ids of text. add_special_tokens runs the post-processor (e.g. a BOS prefix); special tokens written
  // in the text are matched either way. text must be valid UTF-8.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Text of ids; skip_special_tokens drops the added tokens marked special. An id >= 0 with no token (a
  // model vocabulary padded past the tokenizer's) decodes as nothing, as tokenizers' decode does; a
  // negative id throws. Byte sequences that are not UTF-8 come out as U+FFFD.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // One more than the largest id of the vocabulary and the added tokens.
  int64_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's string as the vocabulary holds it (byte-level tokens in their byte alphabet, "Ġhello");
  // for an added token with "normalized": true, its normalized content (as tokenizers gives it), which
  // token_to_id does not find: that takes the content as written.
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;  // an added token marked special

  // From tokenizer_config.json (from_directory); std::nullopt otherwise.
  std::optional<int32_t> bos_token_id() const;
  std::optional<int32_t> eos_token_id() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  friend class DecodeStream;
  std::shared_ptr<const Impl> impl_;
};

// Text of ids as they are generated, one at a time. step() returns only complete text: nothing while the
// decoded tail is an unfinished UTF-8 sequence (it ends in U+FFFD), then all of it at once. Each step
// decodes a short window of the last ids, so decoders that look at the first token (Strip, Metaspace)
// give the same text as decoding everything at once: step() outputs followed by finish() equal
// Tokenizer::decode of all ids.
class DecodeStream {
 public:
  explicit DecodeStream(Tokenizer tokenizer, bool skip_special_tokens = false);

  std::string step(int32_t id);  // "" when nothing is complete yet
  // What step() still holds back when generation ends: an unfinished sequence, as U+FFFD. Resets the
  // stream.
  std::string finish();

 private:
  Tokenizer tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> ids_;  // the window: context ids, then ids not yet returned as text
  std::string prefix_;        // decode of the window's first prefix_ids_ ids, all already returned
  std::size_t prefix_ids_ = 0;
};

}  // namespace moekit

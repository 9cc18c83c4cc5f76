// The BPE model of a tokenizer.json: a pre-tokenized word -> token ids, as the `tokenizers` library's BPE
// does it: the word's characters looked up one by one (a character missing from the vocabulary becomes its
// <0xXX> byte tokens with byte_fallback, else the unk token, fused with a preceding unk with fuse_unk, else
// nothing), then merged by a priority queue that always applies the lowest-ranked merge present, leftmost
// first. ignore_merges: a word that is itself in the vocabulary is that one token.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace moekit::tokenization {

// Hash of strings that also finds by string_view (no copy per lookup).
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
template <typename T>
using StringMap = std::unordered_map<std::string, T, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // model: the "model" object of tokenizer.json, of type BPE.
  explicit BpeModel(const nlohmann::json& model);

  // Words already tokenized during one encode (prompts repeat words); owned by the caller so that a
  // const model needs no lock and no cache outlives the call.
  using WordCache = StringMap<std::vector<int32_t>>;
  // Appends the ids of word.
  void tokenize(std::string_view word, WordCache& cache, std::vector<int32_t>& ids) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;                        // nullptr for an id the vocabulary lacks
  int64_t id_end() const { return static_cast<int64_t>(tokens_.size()); }  // one past the largest id

 private:
  struct Symbol {
    int32_t id;
    int32_t prev;    // index of the previous live symbol, -1 at the start
    int32_t next;    // index of the next live symbol, -1 at the end
    uint32_t bytes;  // 0: merged into its left neighbour
  };
  struct Merge {
    int32_t rank;  // position in the merges list: lower merges first
    int32_t id;    // the merged token
  };
  const Merge* find_merge(int32_t left, int32_t right) const;
  void merge(std::vector<Symbol>& symbols) const;
  int32_t unk_id() const;

  StringMap<int32_t> vocab_;
  std::vector<std::string> tokens_;  // by id; "" with has_token_ false where no token has the id
  std::vector<bool> has_token_;
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> merge
  std::optional<std::string> unk_token_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};  // <0xXX> token ids, -1 where the vocabulary has none
};

}  // namespace moekit::tokenization

// BPE: vocabulary and merges from tokenizer.json, and the merge loop.
#include "moekit/model/tokenizer_bpe.h"

#include <cstdio>
#include <limits>
#include <queue>

#include "moekit/error.h"
#include "moekit/model/tokenizer_json.h"
#include "moekit/model/tokenizer_text.h"

namespace moekit::tokenization {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

BpeModel::BpeModel(const nlohmann::json& model) {
  const JsonFields fields(model, "tokenizer.json: model 'BPE'");
  // Dropout samples merges at random; moekit tokenizes deterministically, as inference does.
  MOEKIT_CHECK(!fields.has("dropout") ||
                   (fields.required("dropout").is_number() && fields.required("dropout").get<double>() == 0.0),
               fields.where(), ": dropout ", JsonFields::show(fields.required("dropout")),
               " is not supported (only null or 0: inference never samples merges)");
  MOEKIT_CHECK(fields.string("continuing_subword_prefix", "").empty(), fields.where(),
               ": continuing_subword_prefix is not supported (only null)");
  MOEKIT_CHECK(fields.string("end_of_word_suffix", "").empty(), fields.where(),
               ": end_of_word_suffix is not supported (only null)");
  if (fields.has("unk_token")) unk_token_ = fields.string("unk_token");
  fuse_unk_ = fields.boolean("fuse_unk", false);
  byte_fallback_ = fields.boolean("byte_fallback", false);
  ignore_merges_ = fields.boolean("ignore_merges", false);

  const nlohmann::json& vocab = fields.object("vocab");
  vocab_.reserve(vocab.size());
  for (const auto& [token, id_value] : vocab.items()) {
    MOEKIT_CHECK(id_value.is_number_integer() && id_value.get<int64_t>() >= 0 &&
                     id_value.get<int64_t>() < std::numeric_limits<int32_t>::max(),
                 fields.where(), ": the vocab id of '", token, "' must be an integer in [0, 2^31 - 1), got ",
                 JsonFields::show(id_value));
    const auto id = static_cast<int32_t>(id_value.get<int64_t>());
    vocab_.emplace(token, id);
    if (static_cast<std::size_t>(id) >= tokens_.size()) {
      tokens_.resize(static_cast<std::size_t>(id) + 1);
      has_token_.resize(static_cast<std::size_t>(id) + 1, false);
    }
    MOEKIT_CHECK(!has_token_[id], fields.where(), ": the tokens '", tokens_[id], "' and '", token,
                 "' have the same id ", id);
    tokens_[id] = token;
    has_token_[id] = true;
  }

  const nlohmann::json& merges = fields.array("merges");
  merges_.reserve(merges.size());
  std::string merged;
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const nlohmann::json& merge = merges[rank];
    std::string_view left, right;
    if (merge.is_string()) {
      // The older form "left right": exactly one space, so neither side can hold one.
      const std::string& text = merge.get_ref<const std::string&>();
      const std::size_t space = text.find(' ');
      MOEKIT_CHECK(space != std::string::npos && text.find(' ', space + 1) == std::string::npos, fields.where(),
                   ": merge ", rank, " '", text, "' must be two tokens separated by one space");
      left = std::string_view(text).substr(0, space);
      right = std::string_view(text).substr(space + 1);
    } else {
      MOEKIT_CHECK(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(),
                   fields.where(), ": merge ", rank, " must be a string \"a b\" or a pair [\"a\", \"b\"], got ",
                   JsonFields::show(merge));
      left = merge[0].get_ref<const std::string&>();
      right = merge[1].get_ref<const std::string&>();
    }
    merged.assign(left).append(right);
    const auto id_of = [&](std::string_view token) {
      const auto it = vocab_.find(token);
      MOEKIT_CHECK(it != vocab_.end(), fields.where(), ": merge ", rank, " ('", left, "' + '", right,
                   "') names the token '", token, "', which is not in the vocab");
      return it->second;
    };
    const int32_t left_id = id_of(left);
    const int32_t right_id = id_of(right);
    // A pair listed twice keeps its last rank, as tokenizers' map of merges does.
    merges_.insert_or_assign(pair_key(left_id, right_id), Merge{static_cast<int32_t>(rank), id_of(merged)});
  }

  byte_ids_.fill(-1);
  if (byte_fallback_) {
    for (int byte = 0; byte < 256; ++byte) {
      std::array<char, 8> name{};
      std::snprintf(name.data(), name.size(), "<0x%02X>", byte);
      if (const auto id = token_to_id(name.data())) byte_ids_[byte] = *id;
    }
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= tokens_.size() || !has_token_[id]) return nullptr;
  return &tokens_[id];
}

const BpeModel::Merge* BpeModel::find_merge(int32_t left, int32_t right) const {
  const auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

int32_t BpeModel::unk_id() const {
  const auto id = token_to_id(*unk_token_);
  // tokenizers only fails here too, when an unknown character needs the unk token.
  MOEKIT_CHECK(id.has_value(), "tokenizer.json: model 'BPE': the unk_token '", *unk_token_,
               "' is not in the vocab, and the text has a character the vocab lacks");
  return *id;
}

void BpeModel::tokenize(std::string_view word, WordCache& cache, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (const auto id = token_to_id(word)) {
      ids.push_back(*id);
      return;
    }
  }
  if (const auto hit = cache.find(word); hit != cache.end()) {
    ids.insert(ids.end(), hit->second.begin(), hit->second.end());
    return;
  }

  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  const auto add = [&](int32_t id, std::size_t bytes) {
    const auto index = static_cast<int32_t>(symbols.size());
    if (!symbols.empty()) symbols.back().next = index;
    symbols.push_back({id, index - 1, -1, static_cast<uint32_t>(bytes)});
  };
  // An unknown run not yet added (bytes 0: none); with fuse_unk the next unknown character joins it.
  std::size_t unk_bytes = 0;
  int32_t unk = -1;
  const auto add_unk = [&] {
    if (unk_bytes > 0) add(unk, unk_bytes);
    unk_bytes = 0;
  };
  for (std::size_t pos = 0; pos < word.size();) {
    const std::size_t length = utf8_char_length(static_cast<unsigned char>(word[pos]));
    const std::string_view character = word.substr(pos, length);
    pos += length;
    if (const auto id = token_to_id(character)) {
      add_unk();
      add(*id, length);
      continue;
    }
    if (byte_fallback_) {
      bool all_bytes = true;
      for (const char byte : character) all_bytes = all_bytes && byte_ids_[static_cast<unsigned char>(byte)] >= 0;
      if (all_bytes) {
        // A pending unk stays pending (it is added after these bytes), as in tokenizers.
        for (const char byte : character) add(byte_ids_[static_cast<unsigned char>(byte)], 1);
        continue;
      }
    }
    if (!unk_token_) continue;  // no unk token: tokenizers drops the character
    if (unk_bytes == 0 || !fuse_unk_) {
      add_unk();
      unk = unk_id();
    }
    unk_bytes += length;
  }
  add_unk();

  merge(symbols);
  std::vector<int32_t>& word_ids = cache[std::string(word)];
  for (const Symbol& symbol : symbols)
    if (symbol.bytes != 0) word_ids.push_back(symbol.id);
  ids.insert(ids.end(), word_ids.begin(), word_ids.end());
}

void BpeModel::merge(std::vector<Symbol>& symbols) const {
  struct Candidate {
    int32_t rank;
    int32_t pos;  // the left symbol
    int32_t id;   // what the pair merges into
  };
  // The queue's top is the lowest rank, then the leftmost position.
  const auto after = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(after)> queue(after);
  const auto push = [&](int32_t pos) {
    const Symbol& left = symbols[pos];
    if (left.next < 0) return;
    if (const Merge* merge = find_merge(left.id, symbols[left.next].id)) queue.push({merge->rank, pos, merge->id});
  };
  for (int32_t pos = 0; pos + 1 < static_cast<int32_t>(symbols.size()); ++pos) push(pos);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    // Stale entries: the left symbol was merged away, has no right neighbour any more, or the pair
    // changed since the entry was queued.
    if (left.bytes == 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const Merge* merge = find_merge(left.id, right.id);
    if (merge == nullptr || merge->id != top.id) continue;

    left.id = top.id;
    left.bytes += right.bytes;
    left.next = right.next;
    right.bytes = 0;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push(left.prev);
    push(top.pos);
  }
}

}  // namespace moekit::tokenization

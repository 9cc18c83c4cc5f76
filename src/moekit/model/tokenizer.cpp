// Tokenizer: tokenizer.json -> the pipeline of the `tokenizers` library, run in its order:
//   1. added tokens whose "normalized" is false are found in the original text;
//   2. every other piece is normalized, then searched for the normalized added tokens;
//   3. the pre-tokenizer splits the remaining pieces; 4. the BPE model turns each into ids;
//   5. with add_special_tokens, the post-processor adds its special tokens.
// Decoding maps ids to token strings (skipping special added tokens on request) and runs the decoder.
#include "moekit/tokenizer.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "moekit/error.h"
#include "moekit/io/json_input.h"
#include "moekit/model/tokenizer_bpe.h"
#include "moekit/model/tokenizer_json.h"
#include "moekit/model/tokenizer_pipeline.h"
#include "moekit/model/tokenizer_text.h"

namespace moekit {

using tokenization::JsonFields;
using tokenization::Piece;
using json = nlohmann::json;

namespace {

struct AddedToken {
  std::string content;  // what token_to_id finds
  // What id_to_token and decode give: the content, normalized when the token is (as in tokenizers, where
  // a normalized added token decodes as it is matched).
  std::string text;
  int32_t id = 0;
  bool special = false;
  bool single_word = false;  // only where no word character touches it on either side
  bool lstrip = false;       // takes the whitespace before it
  bool rstrip = false;       // takes the whitespace after it
  bool normalized = false;   // matched in the normalized text (else in the original text)
};

// Finds a set of strings in a text as tokenizers' Aho-Corasick automaton with MatchKind::LeftmostLongest
// does: non-overlapping, left to right, at each position the longest string starting there (the earlier
// added one among equals).
class TokenMatcher {
 public:
  void add(std::string pattern, std::size_t token) {
    if (pattern.empty()) return;
    auto& candidates = by_first_byte_[static_cast<unsigned char>(pattern[0])];
    const auto shorter = std::find_if(candidates.begin(), candidates.end(),
                                      [&](const auto& other) { return other.first.size() < pattern.size(); });
    candidates.insert(shorter, {std::move(pattern), token});
  }

  struct Match {
    std::size_t start;
    std::size_t end;
    std::size_t token;
  };
  std::vector<Match> find_all(std::string_view text) const {
    std::vector<Match> matches;
    for (std::size_t pos = 0; pos < text.size();) {
      const auto& candidates = by_first_byte_[static_cast<unsigned char>(text[pos])];
      const auto found = std::find_if(candidates.begin(), candidates.end(), [&](const auto& candidate) {
        return text.substr(pos).starts_with(candidate.first);
      });
      if (found == candidates.end()) {
        ++pos;
        continue;
      }
      matches.push_back({pos, pos + found->first.size(), found->second});
      pos += found->first.size();
    }
    return matches;
  }

 private:
  std::array<std::vector<std::pair<std::string, std::size_t>>, 256> by_first_byte_;  // longest first
};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  MOEKIT_CHECK(file.good(), "Tokenizer: cannot open '", path.string(), "'");
  std::ostringstream text;
  text << file.rdbuf();
  MOEKIT_CHECK(!file.bad(), "Tokenizer: cannot read '", path.string(), "'");
  return text.str();
}

bool ends_with_replacement(std::string_view text) {
  return text.ends_with(tokenization::kReplacementChar);
}

}  // namespace

struct Tokenizer::Impl {
  Impl(const json& config, const std::string& origin);

  // Pieces of text: the added tokens matcher finds, with the text between them (tokenizers' find_matches
  // with its single_word, lstrip and rstrip rules).
  void split_added(std::string_view text, bool at_start, const TokenMatcher& matcher, std::vector<Piece>& out) const;
  const AddedToken* added_by_id(int32_t id) const {
    const auto it = added_index_by_id.find(id);
    return it == added_index_by_id.end() ? nullptr : &added[it->second];
  }
  // The token string of id; throws for an id nothing has.
  const std::string& token_of(int32_t id) const;
  // What decode makes of id: its token, or nullptr for an id >= 0 that has none; throws for a
  // negative id. tokenizers' decode skips ids with no token, so transformers decodes them as "", and
  // models pad their vocabulary past the tokenizer's (to a multiple of 64 or 128): a sampled id there
  // must not end generation. A negative id is no token id at all (tokenizers' ids are u32).
  const std::string* token_or_null(int32_t id) const;
  void check_post_processor() const;

  std::string origin;
  tokenization::BpeModel model;
  std::unique_ptr<const tokenization::Normalizer> normalizer;
  std::unique_ptr<const tokenization::PreTokenizer> pre_tokenizer;
  std::unique_ptr<const tokenization::PostProcessor> post_processor;
  std::unique_ptr<const tokenization::Decoder> decoder;
  std::vector<AddedToken> added;  // in the file's order
  std::unordered_map<int32_t, std::size_t> added_index_by_id;
  tokenization::StringMap<std::size_t> added_index_by_content;
  TokenMatcher original_matcher;    // added tokens with normalized false
  TokenMatcher normalized_matcher;  // the others, by their normalized content
  int64_t vocab_size = 0;
  std::optional<int32_t> bos;
  std::optional<int32_t> eos;
};

namespace {

const json& model_config(const json& config, const std::string& origin) {
  MOEKIT_CHECK(config.is_object(), origin, ": the top level must be a JSON object");
  const JsonFields fields(config, origin);
  const json& model = fields.object("model");
  // Files written before models carried a "type" are told apart by their fields; BPE's are its merges.
  const std::string type = model.contains("type") || !model.contains("merges")
                               ? tokenization::component_type(model, "model")
                               : std::string("BPE");
  MOEKIT_CHECK(type == "BPE", origin, ": model type '", type, "' is not supported (supported: BPE)");
  for (const char* key : {"truncation", "padding"})
    MOEKIT_CHECK(!fields.has(key), origin, ": '", key, "' must be null: it changes the ids of a single encode (",
                 JsonFields::show(config[key]), ")");
  return model;
}

}  // namespace

Tokenizer::Impl::Impl(const json& config, const std::string& origin_name)
    : origin(origin_name), model(model_config(config, origin_name)) {
  const JsonFields fields(config, origin);
  const auto component = [&](const char* key) -> const json& {
    static const json null_value;
    return config.contains(key) ? config[key] : null_value;
  };
  normalizer = tokenization::make_normalizer(component("normalizer"));
  pre_tokenizer = tokenization::make_pre_tokenizer(component("pre_tokenizer"));
  post_processor = tokenization::make_post_processor(component("post_processor"));
  decoder = tokenization::make_decoder(component("decoder"));

  // Added tokens keep their vocab id; those the vocab lacks are numbered from its size on, in the file's
  // order. That is how tokenizers numbers them whatever ids the file states, so a file that states others
  // is refused instead of being read with ids the library would not use.
  vocab_size = model.id_end();
  int64_t next_new_id = model.id_end();
  if (fields.has("added_tokens")) {
    for (const json& entry : fields.array("added_tokens")) {
      const JsonFields token(entry, origin + ": added token");
      AddedToken added_token{token.string("content"),
                             "",
                             0,
                             token.boolean("special", false),
                             token.boolean("single_word", false),
                             token.boolean("lstrip", false),
                             token.boolean("rstrip", false),
                             token.boolean("normalized", !token.boolean("special", false))};
      const int64_t stated_id = token.integer("id", -1);
      MOEKIT_CHECK(stated_id >= 0 && stated_id < INT32_MAX, origin, ": added token '", added_token.content,
                   "' needs an id in [0, 2^31 - 1), got ", stated_id);
      if (added_token.content.empty()) continue;  // tokenizers ignores an empty added token
      const auto vocab_id = model.token_to_id(added_token.content);
      const auto duplicate = added_index_by_content.find(added_token.content);
      const bool repeated = duplicate != added_index_by_content.end();
      const int64_t expected_id = repeated ? added[duplicate->second].id : vocab_id ? *vocab_id : next_new_id;
      MOEKIT_CHECK(stated_id == expected_id, origin, ": added token '", added_token.content, "' has id ", stated_id,
                   ", but tokenizers gives it id ", expected_id,
                   " (the vocab's id, else the next id after the vocab and the added tokens before it)");
      if (repeated) continue;
      if (!vocab_id) ++next_new_id;
      added_token.id = static_cast<int32_t>(stated_id);
      added_index_by_id.emplace(added_token.id, added.size());
      added_index_by_content.emplace(added_token.content, added.size());
      vocab_size = std::max<int64_t>(vocab_size, added_token.id + 1);
      added_token.text = added_token.content;
      if (added_token.normalized) {
        if (normalizer) normalizer->apply(added_token.text);
        normalized_matcher.add(added_token.text, added.size());
      } else {
        original_matcher.add(added_token.content, added.size());
      }
      added.push_back(std::move(added_token));
    }
  }
  check_post_processor();
}

void Tokenizer::Impl::check_post_processor() const {
  if (!post_processor) return;
  std::vector<int32_t> ids;  // with no input ids, the post-processor's output is its own special tokens
  post_processor->apply(ids);
  for (const int32_t id : ids) token_of(id);
}

const std::string& Tokenizer::Impl::token_of(int32_t id) const {
  const std::string* token = token_or_null(id);
  MOEKIT_CHECK(token != nullptr, "Tokenizer (", origin, "): id ", id, " is not in the vocabulary (", vocab_size, " ids",
               id >= 0 && id < vocab_size ? ", with gaps" : "", ")");
  return *token;
}

const std::string* Tokenizer::Impl::token_or_null(int32_t id) const {
  MOEKIT_CHECK(id >= 0, "Tokenizer (", origin, "): id ", id, " is negative; token ids start at 0");
  if (const AddedToken* token = added_by_id(id)) return &token->text;
  return model.id_to_token(id);
}

void Tokenizer::Impl::split_added(std::string_view text, bool at_start, const TokenMatcher& matcher,
                                  std::vector<Piece>& out) const {
  const auto push_text = [&](std::size_t start, std::size_t end) {
    if (end > start) out.push_back({std::string(text.substr(start, end - start)), -1, at_start && start == 0});
  };
  const auto char_before = [&](std::size_t pos) {
    std::size_t start = pos - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    return std::pair{tokenization::decode_utf8_at(text, start), start};
  };
  std::size_t done = 0;  // text before this offset is in out
  for (const TokenMatcher::Match& match : matcher.find_all(text)) {
    const AddedToken& token = added[match.token];
    std::size_t start = match.start, stop = match.end;
    if (token.single_word) {
      const bool word_before = start > 0 && tokenization::is_word_char(char_before(start).first);
      const bool word_after =
          stop < text.size() && tokenization::is_word_char(tokenization::decode_utf8_at(text, stop));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      // Whitespace already taken by the previous token's rstrip stays with it.
      while (start > done && tokenization::is_white_space(char_before(start).first)) start = char_before(start).second;
    }
    if (token.rstrip) {
      while (stop < text.size() && tokenization::is_white_space(tokenization::decode_utf8_at(text, stop)))
        stop += tokenization::utf8_char_length(static_cast<unsigned char>(text[stop]));
    }
    push_text(done, start);
    out.push_back({token.text, token.id, false});
    done = std::max(done, stop);
  }
  push_text(done, text.size());
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, const std::string& origin) {
  return Tokenizer(std::make_shared<const Impl>(parse_json(tokenizer_json, origin), origin));
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  return from_json(read_file(tokenizer_json), tokenizer_json.string());
}

Tokenizer Tokenizer::from_directory(const std::filesystem::path& dir) {
  const std::filesystem::path tokenizer_json = dir / "tokenizer.json";
  auto impl =
      std::make_shared<Impl>(parse_json(read_file(tokenizer_json), tokenizer_json.string()), tokenizer_json.string());
  const std::filesystem::path config_path = dir / "tokenizer_config.json";
  if (std::filesystem::exists(config_path)) {
    const std::string origin = config_path.string();
    const json config = parse_json(read_file(config_path), origin);
    const JsonFields fields(config, origin);
    // A token is written as its string or as an AddedToken object {"content": ...}.
    const auto token_id = [&](const char* key) -> std::optional<int32_t> {
      if (!fields.has(key)) return std::nullopt;
      const json& value = fields.required(key);
      const std::string content =
          value.is_object() ? JsonFields(value, origin + " " + key).string("content") : fields.string(key);
      const std::optional<int32_t> id = Tokenizer(impl).token_to_id(content);
      MOEKIT_CHECK(id.has_value(), origin, ": ", key, " '", content, "' is not in the vocabulary");
      return id;
    };
    impl->bos = token_id("bos_token");
    impl->eos = token_id("eos_token");
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& impl = *impl_;
  const std::size_t invalid = tokenization::find_invalid_utf8(text);
  MOEKIT_CHECK(invalid == std::string_view::npos, "Tokenizer::encode: the text is not valid UTF-8 (at byte ", invalid,
               ")");

  std::vector<Piece> original;
  impl.split_added(text, true, impl.original_matcher, original);
  std::vector<Piece> pieces;
  pieces.reserve(original.size());
  for (Piece& piece : original) {
    if (piece.id >= 0) {
      pieces.push_back(std::move(piece));
      continue;
    }
    if (impl.normalizer) impl.normalizer->apply(piece.text);
    impl.split_added(piece.text, piece.at_start, impl.normalized_matcher, pieces);
  }
  if (impl.pre_tokenizer) impl.pre_tokenizer->apply(pieces);

  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  tokenization::BpeModel::WordCache cache;
  for (const Piece& piece : pieces) {
    if (piece.id >= 0) {
      ids.push_back(piece.id);
    } else {
      impl.model.tokenize(piece.text, cache, ids);
    }
  }
  if (add_special_tokens && impl.post_processor) impl.post_processor->apply(ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& impl = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    const AddedToken* added = impl.added_by_id(id);
    if (skip_special_tokens && added != nullptr && added->special) continue;
    if (const std::string* token = impl.token_or_null(id)) tokens.push_back(*token);
  }
  if (!impl.decoder) {
    // tokenizers joins the tokens with spaces when there is no decoder.
    std::string text;
    for (std::size_t i = 0; i < tokens.size(); ++i) text += (i > 0 ? " " : "") + tokens[i];
    return text;
  }
  impl.decoder->apply(tokens);
  std::string text;
  for (const std::string& token : tokens) text += token;
  return text;
}

int64_t Tokenizer::vocab_size() const {
  return impl_->vocab_size;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto added = impl_->added_index_by_content.find(token);
  if (added != impl_->added_index_by_content.end()) return impl_->added[added->second].id;
  return impl_->model.token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  return impl_->token_of(id);
}

bool Tokenizer::is_special(int32_t id) const {
  const AddedToken* added = impl_->added_by_id(id);
  return added != nullptr && added->special;
}

std::optional<int32_t> Tokenizer::bos_token_id() const {
  return impl_->bos;
}
std::optional<int32_t> Tokenizer::eos_token_id() const {
  return impl_->eos;
}

DecodeStream::DecodeStream(Tokenizer tokenizer, bool skip_special_tokens)
    : tokenizer_(std::move(tokenizer)), skip_special_tokens_(skip_special_tokens) {}

// tokenizers' DecodeStream algorithm. The window holds the ids of the text returned last (context, so
// that decoders acting on the first token treat it alike in the prefix and in the whole) and the ids
// since; new text is the window's decode beyond the context's decode, returned once it does not end in
// U+FFFD (an unfinished UTF-8 sequence).
std::string DecodeStream::step(int32_t id) {
  tokenizer_.impl_->token_or_null(id);  // a bad id throws here, before it joins the window
  if (prefix_.empty() && !ids_.empty()) {
    // Nothing returned yet (or only an empty text): what the window has so far becomes the context once
    // it is complete.
    std::string text = tokenizer_.decode(ids_, skip_special_tokens_);
    if (!ends_with_replacement(text)) {
      prefix_ = std::move(text);
      prefix_ids_ = ids_.size();
    }
  }
  ids_.push_back(id);
  const std::string text = tokenizer_.decode(ids_, skip_special_tokens_);
  if (text.size() <= prefix_.size() || ends_with_replacement(text)) return "";
  MOEKIT_CHECK(text.starts_with(prefix_), "DecodeStream: decoding the window changed text already returned ('", prefix_,
               "' became '", text.substr(0, prefix_.size()), "'); the decoder cannot be streamed");
  std::string fresh = text.substr(prefix_.size());
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(prefix_ids_));
  prefix_ = tokenizer_.decode(ids_, skip_special_tokens_);
  prefix_ids_ = ids_.size();
  return fresh;
}

std::string DecodeStream::finish() {
  const std::string text = tokenizer_.decode(ids_, skip_special_tokens_);
  MOEKIT_CHECK(text.starts_with(prefix_), "DecodeStream: decoding the window changed text already returned ('", prefix_,
               "' became '", text.substr(0, prefix_.size()), "'); the decoder cannot be streamed");
  std::string rest = text.substr(prefix_.size());
  ids_.clear();
  prefix_.clear();
  prefix_ids_ = 0;
  return rest;
}

}  // namespace moekit

// Normalizers, pre-tokenizers, post-processors and decoders of tokenizer.json.
#include "moekit/model/tokenizer_pipeline.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include "moekit/error.h"
#include "moekit/model/tokenizer_json.h"
#include "moekit/model/tokenizer_text.h"

namespace moekit::tokenization {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------------------
// Shared pieces

// Non-overlapping occurrences of a non-empty literal, left to right.
std::vector<Regex::Match> find_literal(std::string_view text, std::string_view literal) {
  std::vector<Regex::Match> matches;
  for (std::size_t pos = text.find(literal); pos != std::string_view::npos;
       pos = text.find(literal, pos + literal.size()))
    matches.push_back({pos, pos + literal.size()});
  return matches;
}

// A "pattern" field: {"String": literal} or {"Regex": Oniguruma pattern}.
class Pattern {
 public:
  Pattern(const json& pattern, const std::string& where) {
    MOEKIT_CHECK(pattern.is_object() && pattern.size() == 1 && pattern.begin().value().is_string(), where,
                 ": the field 'pattern' must be {\"String\": ...} or {\"Regex\": ...}, got ",
                 JsonFields::show(pattern));
    const std::string& kind = pattern.begin().key();
    const std::string text = pattern.begin().value().get<std::string>();
    if (kind == "String") {
      literal_ = text;
    } else if (kind == "Regex") {
      regex_.emplace(text, where);
    } else {
      MOEKIT_FAIL(where, ": pattern kind '", kind, "' is not supported (String or Regex)");
    }
  }

  std::vector<Regex::Match> find_all(std::string_view text) const {
    if (regex_) return regex_->find_all(text);
    if (literal_.empty()) return {};  // tokenizers: an empty string never matches
    return find_literal(text, literal_);
  }

 private:
  std::string literal_;
  std::optional<Regex> regex_;
};

std::string replace_all(std::string_view text, const std::vector<Regex::Match>& matches, std::string_view content) {
  std::string out;
  out.reserve(text.size());
  std::size_t pos = 0;
  for (const Regex::Match& match : matches) {
    out.append(text.substr(pos, match.start - pos));
    out.append(content);
    pos = match.end;
  }
  out.append(text.substr(pos));
  return out;
}

// A field holding exactly one character (Metaspace's replacement, Strip's content).
std::string one_character(const JsonFields& fields, std::string_view key, std::string fallback) {
  std::string text = fields.string(key, std::move(fallback));
  MOEKIT_CHECK(!text.empty() && utf8_char_length(static_cast<unsigned char>(text[0])) == text.size(), fields.where(),
               ": the field '", key, "' must be one character, got '", text, "'");
  return text;
}

template <typename T>
struct Factory {
  std::string_view type;
  std::unique_ptr<const T> (*make)(const JsonFields& fields);
};

// The one dispatch from a component's "type" to its class, for each kind.
template <typename T, std::size_t N>
std::unique_ptr<const T> make_component(const json& config, std::string_view kind,
                                        const std::array<Factory<T>, N>& table) {
  if (config.is_null()) return nullptr;
  const std::string type = component_type(config, kind);
  for (const Factory<T>& factory : table)
    if (factory.type == type)
      return factory.make(JsonFields(config, "tokenizer.json: " + std::string(kind) + " '" + type + "'"));
  std::string supported;
  for (const Factory<T>& factory : table) supported += (supported.empty() ? "" : ", ") + std::string(factory.type);
  MOEKIT_FAIL("tokenizer.json: ", kind, " type '", type, "' is not supported (supported: ", supported, ")");
}

// A Sequence: the components listed under `key` (none null), applied in turn. A Sequence inside it is
// the same as its parts in its place, so nested Sequences are flattened here, with a stack of arrays
// instead of recursion: however deep the JSON nests them, building, applying and destroying stay one
// level deep.
template <typename Value>
class Sequence final : public Component<Value> {
 public:
  using Make = std::unique_ptr<const Component<Value>> (*)(const json& config);
  // kind: what make builds ("normalizer"), as errors name it.
  Sequence(const JsonFields& fields, std::string_view key, std::string_view kind, Make make) {
    struct Pending {
      const json* parts;
      std::size_t next;
    };
    std::vector<Pending> pending{{&fields.array(key), 0}};
    while (!pending.empty()) {
      Pending& top = pending.back();
      if (top.next == top.parts->size()) {
        pending.pop_back();
        continue;
      }
      const json& part = (*top.parts)[top.next++];
      MOEKIT_CHECK(!part.is_null(), fields.where(), ": an element of '", key, "' is null");
      if (component_type(part, kind) == "Sequence")
        pending.push_back({&JsonFields(part, fields.where()).array(key), 0});  // invalidates `top`
      else
        parts_.push_back(make(part));
    }
  }
  void apply(Value& value) const override {
    for (const auto& part : parts_) part->apply(value);
  }

 private:
  std::vector<std::unique_ptr<const Component<Value>>> parts_;
};

// ---------------------------------------------------------------------------------------------------------
// Normalizers

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void apply(std::string& text) const override { text = normalize_unicode(text, form_); }

 private:
  NormalForm form_;
};

template <NormalForm form>
std::unique_ptr<const Normalizer> make_unicode_normalizer(const JsonFields&) {
  return std::make_unique<UnicodeNormalizer>(form);
}

class ReplaceNormalizer final : public Normalizer {
 public:
  explicit ReplaceNormalizer(const JsonFields& fields)
      : pattern_(fields.required("pattern"), fields.where()), content_(fields.string("content")) {}
  void apply(std::string& text) const override { text = replace_all(text, pattern_.find_all(text), content_); }

 private:
  Pattern pattern_;
  std::string content_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(const JsonFields& fields) : prepend_(fields.string("prepend")) {}
  void apply(std::string& text) const override {
    if (!text.empty()) text.insert(0, prepend_);
  }

 private:
  std::string prepend_;
};

template <typename T, typename Base>
std::unique_ptr<const Base> make_from_fields(const JsonFields& fields) {
  return std::make_unique<T>(fields);
}

constexpr std::array<Factory<Normalizer>, 7> kNormalizers{{
    {"NFC", make_unicode_normalizer<NormalForm::nfc>},
    {"NFD", make_unicode_normalizer<NormalForm::nfd>},
    {"NFKC", make_unicode_normalizer<NormalForm::nfkc>},
    {"NFKD", make_unicode_normalizer<NormalForm::nfkd>},
    {"Replace", make_from_fields<ReplaceNormalizer, Normalizer>},
    {"Prepend", make_from_fields<PrependNormalizer, Normalizer>},
    {"Sequence",
     [](const JsonFields& fields) -> std::unique_ptr<const Normalizer> {
       return std::make_unique<Sequence<std::string>>(fields, "normalizers", "normalizer", make_normalizer);
     }},
}};

// ---------------------------------------------------------------------------------------------------------
// Pre-tokenizers

struct Range {
  std::size_t start;
  std::size_t end;
};

// tokenizers' SplitDelimiterBehavior: what becomes of each match when a text is split at the matches.
enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

SplitBehavior parse_behavior(const JsonFields& fields) {
  const std::string name = fields.string("behavior");
  constexpr std::array<std::pair<std::string_view, SplitBehavior>, 5> kBehaviors{{
      {"Removed", SplitBehavior::removed},
      {"Isolated", SplitBehavior::isolated},
      {"MergedWithPrevious", SplitBehavior::merged_with_previous},
      {"MergedWithNext", SplitBehavior::merged_with_next},
      {"Contiguous", SplitBehavior::contiguous},
  }};
  for (const auto& [key, behavior] : kBehaviors)
    if (key == name) return behavior;
  MOEKIT_FAIL(fields.where(), ": behavior '", name,
              "' is not supported (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

// The parts of a text of `length` bytes split at matches, as NormalizedString::split makes them. The
// text is first cut into spans alternating between matches and the text between them (invert swaps
// which are matches); behavior then drops, keeps or merges the match spans.
std::vector<Range> split_ranges(std::size_t length, const std::vector<Regex::Match>& matches, bool invert,
                                SplitBehavior behavior) {
  struct Span {
    Range range;
    bool match;
  };
  std::vector<Span> spans;
  spans.reserve(2 * matches.size() + 1);
  std::size_t pos = 0;
  for (const Regex::Match& match : matches) {
    if (match.start != pos) spans.push_back({{pos, match.start}, invert});
    spans.push_back({{match.start, match.end}, !invert});
    pos = match.end;
  }
  if (pos != length || spans.empty()) spans.push_back({{pos, length}, invert});

  std::vector<Range> ranges;
  ranges.reserve(spans.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::isolated:
      for (const Span& span : spans) ranges.push_back(span.range);
      break;
    case SplitBehavior::removed:
      for (const Span& span : spans)
        if (!span.match) ranges.push_back(span.range);
      break;
    case SplitBehavior::contiguous:
      // Neighbouring spans of the same kind become one (in practice: adjacent matches).
      for (const Span& span : spans) {
        if (span.match == previous_match && !ranges.empty()) {
          ranges.back().end = span.range.end;
        } else {
          ranges.push_back(span.range);
        }
        previous_match = span.match;
      }
      break;
    case SplitBehavior::merged_with_previous:
      for (const Span& span : spans) {
        if (span.match && !previous_match && !ranges.empty()) {
          ranges.back().end = span.range.end;
        } else {
          ranges.push_back(span.range);
        }
        previous_match = span.match;
      }
      break;
    case SplitBehavior::merged_with_next:
      for (auto span = spans.rbegin(); span != spans.rend(); ++span) {
        if (span->match && !previous_match && !ranges.empty()) {
          ranges.back().start = span->range.start;
        } else {
          ranges.push_back(span->range);
        }
        previous_match = span->match;
      }
      std::reverse(ranges.begin(), ranges.end());
      break;
  }
  return ranges;
}

// Replaces every piece that is not an added token by the non-empty ranges split(text, at_start) returns
// (split may rewrite text first). A part begins the original text when its piece did and it starts at 0.
template <typename Split>
void split_pieces(std::vector<Piece>& pieces, const Split& split) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& piece : pieces) {
    if (piece.id >= 0) {
      out.push_back(std::move(piece));
      continue;
    }
    for (const Range& range : split(piece.text, piece.at_start))
      if (range.end > range.start)
        out.push_back(
            {piece.text.substr(range.start, range.end - range.start), -1, piece.at_start && range.start == 0});
  }
  pieces = std::move(out);
}

// GPT-2's pre-tokenization regex (contractions, letters, digits, other symbols, each with an optional
// leading space; whitespace runs leave their last space to the next word).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  explicit ByteLevelPreTokenizer(const JsonFields& fields)
      : add_prefix_space_(fields.boolean("add_prefix_space", true)) {
    if (fields.boolean("use_regex", true)) regex_.emplace(kGpt2Pattern, fields.where());
  }

  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](std::string& text, bool) {
      if (add_prefix_space_ && text.front() != ' ') text.insert(0, " ");
      if (!regex_) return std::vector<Range>{{0, text.size()}};
      return split_ranges(text.size(), regex_->find_all(text), false, SplitBehavior::isolated);
    });
    // Every byte becomes the printable character standing for it in the vocabulary.
    for (Piece& piece : pieces) {
      if (piece.id >= 0) continue;
      std::string mapped;
      mapped.reserve(2 * piece.text.size());
      for (const char byte : piece.text) mapped += byte_level_char(static_cast<unsigned char>(byte));
      piece.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::optional<Regex> regex_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  explicit SplitPreTokenizer(const JsonFields& fields)
      : pattern_(fields.required("pattern"), fields.where()),
        behavior_(parse_behavior(fields)),
        invert_(fields.boolean("invert", false)) {}

  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](std::string& text, bool) {
      return split_ranges(text.size(), pattern_.find_all(text), invert_, behavior_);
    });
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// When Metaspace puts the replacement character in front of a piece.
enum class PrependScheme { always, first, never };

PrependScheme parse_prepend_scheme(const JsonFields& fields) {
  if (!fields.has("prepend_scheme")) {
    // Files older than prepend_scheme have add_prefix_space instead.
    return fields.boolean("add_prefix_space", true) ? PrependScheme::always : PrependScheme::never;
  }
  const std::string name = fields.string("prepend_scheme");
  if (name == "always") return PrependScheme::always;
  if (name == "first") return PrependScheme::first;
  if (name == "never") return PrependScheme::never;
  MOEKIT_FAIL(fields.where(), ": prepend_scheme '", name, "' is not supported (always, first, never)");
}

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  explicit MetaspacePreTokenizer(const JsonFields& fields)
      : replacement_(one_character(fields, "replacement", "\u2581")),
        scheme_(parse_prepend_scheme(fields)),
        split_(fields.boolean("split", true)) {}

  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](std::string& text, bool at_start) {
      text = replace_all(text, find_literal(text, " "), replacement_);
      const bool prepend = scheme_ == PrependScheme::always || (scheme_ == PrependScheme::first && at_start);
      if (prepend && !text.starts_with(replacement_)) text.insert(0, replacement_);
      if (!split_) return std::vector<Range>{{0, text.size()}};
      // Each replacement character starts a new piece.
      return split_ranges(text.size(), find_literal(text, replacement_), false, SplitBehavior::merged_with_next);
    });
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

constexpr std::array<Factory<PreTokenizer>, 4> kPreTokenizers{{
    {"ByteLevel", make_from_fields<ByteLevelPreTokenizer, PreTokenizer>},
    {"Split", make_from_fields<SplitPreTokenizer, PreTokenizer>},
    {"Metaspace", make_from_fields<MetaspacePreTokenizer, PreTokenizer>},
    {"Sequence",
     [](const JsonFields& fields) -> std::unique_ptr<const PreTokenizer> {
       return std::make_unique<Sequence<std::vector<Piece>>>(fields, "pretokenizers", "pre_tokenizer",
                                                             make_pre_tokenizer);
     }},
}};

// ---------------------------------------------------------------------------------------------------------
// Post-processors

// The single-sequence template: special tokens' ids around the sequence.
class TemplateProcessor final : public PostProcessor {
 public:
  explicit TemplateProcessor(const JsonFields& fields) {
    const json none = json::object();
    const json& special_tokens = fields.has("special_tokens") ? fields.object("special_tokens") : none;
    int sequences = 0;
    for (const json& item : fields.array("single")) {
      MOEKIT_CHECK(item.is_object() && item.size() == 1 && item.begin().value().is_object(), fields.where(),
                   ": a 'single' element must be {\"SpecialToken\": ...} or {\"Sequence\": ...}, got ",
                   JsonFields::show(item));
      const std::string& kind = item.begin().key();
      const JsonFields piece(item.begin().value(), fields.where() + " single " + kind);
      if (kind == "Sequence") {
        const std::string id = piece.string("id");
        MOEKIT_CHECK(id == "A", fields.where(), ": the single-sequence template names sequence '", id,
                     "' (only A exists)");
        parts_.push_back(Part{true, {}});
        ++sequences;
      } else if (kind == "SpecialToken") {
        const std::string name = piece.string("id");
        MOEKIT_CHECK(special_tokens.contains(name), fields.where(), ": the template's special token '", name,
                     "' is not in special_tokens");
        const JsonFields special(special_tokens[name], fields.where() + " special_tokens '" + name + "'");
        Part part{false, {}};
        for (const json& id : special.array("ids")) {
          MOEKIT_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() <= INT32_MAX,
                       special.where(), ": ids must be integers >= 0, got ", JsonFields::show(id));
          part.ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
        }
        parts_.push_back(std::move(part));
      } else {
        MOEKIT_FAIL(fields.where(), ": template element '", kind, "' is not supported (SpecialToken, Sequence)");
      }
    }
    MOEKIT_CHECK(sequences == 1, fields.where(), ": the single-sequence template must hold $A once, it holds it ",
                 sequences, " times");
  }

  void apply(std::vector<int32_t>& ids) const override {
    std::vector<int32_t> out;
    out.reserve(ids.size() + parts_.size());
    for (const Part& part : parts_) {
      const std::vector<int32_t>& source = part.sequence ? ids : part.ids;
      out.insert(out.end(), source.begin(), source.end());
    }
    ids = std::move(out);
  }

 private:
  struct Part {
    bool sequence;             // the input ids
    std::vector<int32_t> ids;  // else these special token ids
  };
  std::vector<Part> parts_;
};

// ByteLevel as a post-processor only trims offsets: the ids stay as they are.
class ByteLevelProcessor final : public PostProcessor {
 public:
  explicit ByteLevelProcessor(const JsonFields&) {}
  void apply(std::vector<int32_t>&) const override {}
};

constexpr std::array<Factory<PostProcessor>, 3> kPostProcessors{{
    {"TemplateProcessing", make_from_fields<TemplateProcessor, PostProcessor>},
    {"ByteLevel", make_from_fields<ByteLevelProcessor, PostProcessor>},
    {"Sequence",
     [](const JsonFields& fields) -> std::unique_ptr<const PostProcessor> {
       return std::make_unique<Sequence<std::vector<int32_t>>>(fields, "processors", "post_processor",
                                                               make_post_processor);
     }},
}};

// ---------------------------------------------------------------------------------------------------------
// Decoders

// All tokens -> one text: each token's characters back to the bytes they stand for (a token with a
// character outside the byte-level alphabet, such as an added token "<|im_end|>" in another script,
// is taken as its own UTF-8), then the bytes as UTF-8 with ill-formed parts as U+FFFD.
class ByteLevelDecoder final : public Decoder {
 public:
  explicit ByteLevelDecoder(const JsonFields&) {}
  void apply(std::vector<std::string>& tokens) const override {
    std::string bytes;
    std::string token_bytes;
    for (const std::string& token : tokens) {
      token_bytes.clear();
      bool mapped = true;
      for (std::size_t pos = 0; pos < token.size() && mapped;) {
        const auto byte = byte_level_byte(decode_utf8_at(token, pos));
        mapped = byte.has_value();
        if (mapped) token_bytes += static_cast<char>(*byte);
        pos += utf8_char_length(static_cast<unsigned char>(token[pos]));
      }
      bytes += mapped ? token_bytes : token;
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class ReplaceDecoder final : public Decoder {
 public:
  explicit ReplaceDecoder(const JsonFields& fields)
      : pattern_(fields.required("pattern"), fields.where()), content_(fields.string("content")) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) token = replace_all(token, pattern_.find_all(token), content_);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

// <0xHH> tokens -> their bytes: each run of them becomes its UTF-8 text, or one U+FFFD per byte when the
// run is not UTF-8 (unlike ByteLevel's one per ill-formed part).
class ByteFallbackDecoder final : public Decoder {
 public:
  explicit ByteFallbackDecoder(const JsonFields&) {}
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string run;
    const auto flush = [&] {
      if (run.empty()) return;
      if (is_valid_utf8(run)) {
        out.push_back(run);
      } else {
        for (std::size_t i = 0; i < run.size(); ++i) out.emplace_back(kReplacementChar);
      }
      run.clear();
    };
    for (std::string& token : tokens) {
      if (const auto byte = byte_token_value(token)) {
        run += static_cast<char>(*byte);
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    tokens = std::move(out);
  }

 private:
  static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  // "<0xHH>" -> HH. The two characters are read as Rust's u8::from_str_radix(_, 16) reads them, which
  // also takes "+H" (and either case).
  static std::optional<unsigned char> byte_token_value(std::string_view token) {
    if (token.size() != 6 || !token.starts_with("<0x") || token.back() != '>') return std::nullopt;
    const int high = token[3] == '+' ? 0 : hex_digit(token[3]);
    const int low = hex_digit(token[4]);
    if (high < 0 || low < 0) return std::nullopt;
    return static_cast<unsigned char>(16 * high + low);
  }
};

class FuseDecoder final : public Decoder {
 public:
  explicit FuseDecoder(const JsonFields&) {}
  void apply(std::vector<std::string>& tokens) const override {
    std::string text;
    for (const std::string& token : tokens) text += token;
    tokens.assign(1, std::move(text));
  }
};

// Removes up to `start` leading and `stop` trailing copies of one character from each token.
class StripDecoder final : public Decoder {
 public:
  explicit StripDecoder(const JsonFields& fields)
      : content_(one_character(fields, "content", " ")),
        start_(fields.integer("start", 0)),
        stop_(fields.integer("stop", 0)) {
    MOEKIT_CHECK(start_ >= 0 && stop_ >= 0, fields.where(), ": start and stop must be >= 0, got ", start_, " and ",
                 stop_);
  }
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      std::size_t begin = 0, end = token.size();
      for (int64_t i = 0; i < start_ && std::string_view(token).substr(begin).starts_with(content_); ++i)
        begin += content_.size();
      // tokenizers fails when the two cuts cross (a token of only the character); moekit leaves it empty.
      for (int64_t i = 0;
           i < stop_ && end >= begin + content_.size() && std::string_view(token).substr(0, end).ends_with(content_);
           ++i)
        end -= content_.size();
      token = token.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  int64_t start_;
  int64_t stop_;
};

// The replacement character back to a space; in the first token of a decode (where Metaspace put its
// prefix) every replacement character is dropped, unless the prepend scheme is "never".
class MetaspaceDecoder final : public Decoder {
 public:
  explicit MetaspaceDecoder(const JsonFields& fields)
      : replacement_(one_character(fields, "replacement", "\u2581")), scheme_(parse_prepend_scheme(fields)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = replace_all(tokens[i], find_literal(tokens[i], replacement_),
                              i == 0 && scheme_ != PrependScheme::never ? "" : " ");
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

constexpr std::array<Factory<Decoder>, 7> kDecoders{{
    {"ByteLevel", make_from_fields<ByteLevelDecoder, Decoder>},
    {"Replace", make_from_fields<ReplaceDecoder, Decoder>},
    {"ByteFallback", make_from_fields<ByteFallbackDecoder, Decoder>},
    {"Fuse", make_from_fields<FuseDecoder, Decoder>},
    {"Strip", make_from_fields<StripDecoder, Decoder>},
    {"Metaspace", make_from_fields<MetaspaceDecoder, Decoder>},
    {"Sequence",
     [](const JsonFields& fields) -> std::unique_ptr<const Decoder> {
       return std::make_unique<Sequence<std::vector<std::string>>>(fields, "decoders", "decoder", make_decoder);
     }},
}};

}  // namespace

std::unique_ptr<const Normalizer> make_normalizer(const json& config) {
  return make_component(config, "normalizer", kNormalizers);
}

std::unique_ptr<const PreTokenizer> make_pre_tokenizer(const json& config) {
  return make_component(config, "pre_tokenizer", kPreTokenizers);
}

std::unique_ptr<const PostProcessor> make_post_processor(const json& config) {
  return make_component(config, "post_processor", kPostProcessors);
}

std::unique_ptr<const Decoder> make_decoder(const json& config) {
  return make_component(config, "decoder", kDecoders);
}

}  // namespace moekit::tokenization

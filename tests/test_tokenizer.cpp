// Tokenizer: the fixtures of tests/fixtures/tokenizer (scripts/make_tokenizer_fixtures.py: six tokenizers
// configured like Qwen2's, GPT-2's, Llama-2's, a Metaspace one, Llama-3's and a mix of Split behaviours,
// each with what the `tokenizers` library returns for ~65 strings) must come out id for id and byte for
// byte: encode with and without special tokens, decode with and without skipping them, the chunks of
// the library's DecodeStream. Then round trips, the encode speed on a 100 kB prompt, and every refusal of
// a bad or unsupported tokenizer.json.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/model/tokenizer_pipeline.h"
#include "moekit/model/tokenizer_text.h"
#include "moekit/tokenizer.h"

namespace moekit {
namespace {

using json = nlohmann::json;
using test::throws_error_with;

const std::filesystem::path kFixtures = std::filesystem::path(MOEKIT_FIXTURES_DIR) / "tokenizer";
const std::vector<std::string> kTokenizers = {"qwen2", "gpt2", "llama", "metaspace", "llama3", "split_mix"};

json read_json(const std::filesystem::path& path) {
  std::ifstream file(path);
  EXPECT_TRUE(file.good()) << "cannot open " << path;
  return json::parse(file);
}

// The text of a case as JSON, so that failures show control characters and spaces.
std::string shown(const std::string& text) {
  return json(text).dump();
}

std::vector<int32_t> ids_of(const json& ids) {
  return ids.get<std::vector<int32_t>>();
}

class TokenizerFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    tokenizer_ = Tokenizer::from_file(kFixtures / GetParam() / "tokenizer.json");
    fixture_ = read_json(kFixtures / GetParam() / "cases.json");
    ASSERT_GT(fixture_["cases"].size(), 50u);
  }

  std::optional<Tokenizer> tokenizer_;
  json fixture_;
};

TEST_P(TokenizerFixture, EncodesAsTheLibrary) {
  for (const json& c : fixture_["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tokenizer_->encode(text, true), ids_of(c["ids"])) << "text " << shown(text);
    EXPECT_EQ(tokenizer_->encode(text, false), ids_of(c["ids_no_special"]))
        << "text " << shown(text) << ", add_special_tokens false";
  }
}

TEST_P(TokenizerFixture, DecodesAsTheLibrary) {
  for (const json& c : fixture_["cases"]) {
    const std::vector<int32_t> ids = ids_of(c["ids"]);
    EXPECT_EQ(tokenizer_->decode(ids, false), c["decoded"].get<std::string>()) << "text " << shown(c["text"]);
    EXPECT_EQ(tokenizer_->decode(ids, true), c["decoded_skip_special"].get<std::string>())
        << "text " << shown(c["text"]) << ", skip_special_tokens";
  }
  // Random ids: byte tokens out of order (ill-formed UTF-8), special tokens anywhere.
  for (const json& c : fixture_["decode_cases"]) {
    const std::vector<int32_t> ids = ids_of(c["ids"]);
    EXPECT_EQ(tokenizer_->decode(ids, false), c["text"].get<std::string>()) << "ids " << c["ids"].dump();
    EXPECT_EQ(tokenizer_->decode(ids, true), c["text_skip_special"].get<std::string>())
        << "ids " << c["ids"].dump() << ", skip_special_tokens";
  }
}

// Without a decoder the library joins the tokens with spaces.
TEST_P(TokenizerFixture, DecodesWithoutADecoderAsTheLibrary) {
  json config = read_json(kFixtures / GetParam() / "tokenizer.json");
  config["decoder"] = nullptr;
  const Tokenizer bare = Tokenizer::from_json(config.dump());
  for (const json& c : fixture_["decode_cases"]) {
    EXPECT_EQ(bare.decode(ids_of(c["ids"])), c["text_without_decoder"].get<std::string>()) << "ids " << c["ids"].dump();
  }
}

// The library's DecodeStream returns None or a chunk per id; moekit's step returns "" or the same chunk,
// every chunk is complete UTF-8, and with finish() they add up to the full decode.
TEST_P(TokenizerFixture, StreamsAsTheLibrary) {
  for (const json& c : fixture_["cases"]) {
    DecodeStream stream(*tokenizer_);
    std::string streamed;
    const std::vector<int32_t> ids = ids_of(c["ids"]);
    ASSERT_EQ(c["stream"].size(), ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::string chunk = stream.step(ids[i]);
      const json& expected = c["stream"][i];
      EXPECT_EQ(chunk, expected.is_null() ? std::string() : expected.get<std::string>())
          << "text " << shown(c["text"]) << ", id " << i;
      EXPECT_TRUE(tokenization::is_valid_utf8(chunk));
      EXPECT_FALSE(chunk.ends_with(tokenization::kReplacementChar)) << "text " << shown(c["text"]) << ", id " << i;
      streamed += chunk;
    }
    streamed += stream.finish();
    EXPECT_EQ(streamed, c["decoded"].get<std::string>()) << "text " << shown(c["text"]);
  }
}

TEST_P(TokenizerFixture, VocabularyAsTheLibrary) {
  EXPECT_EQ(tokenizer_->vocab_size(), fixture_["vocab_size"].get<int64_t>());
  const json& tokens = fixture_["id_to_token"];
  const json& exceptions = fixture_["token_to_id"];  // where token_to_id(id_to_token(id)) is not id
  ASSERT_EQ(static_cast<int64_t>(tokens.size()), tokenizer_->vocab_size());
  for (int32_t id = 0; id < tokenizer_->vocab_size(); ++id) {
    const std::string token = tokenizer_->id_to_token(id);
    EXPECT_EQ(token, tokens[id].get<std::string>()) << "id " << id;
    if (!exceptions.contains(token)) {
      EXPECT_EQ(tokenizer_->token_to_id(token), id) << "token " << shown(token);
    }
  }
  for (const auto& [token, id] : exceptions.items()) {
    EXPECT_EQ(tokenizer_->token_to_id(token), id.is_null() ? std::nullopt : std::optional<int32_t>(id.get<int32_t>()))
        << "token " << shown(token);
  }
  EXPECT_FALSE(tokenizer_->token_to_id("no such token in any vocabulary").has_value());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerFixture, ::testing::ValuesIn(kTokenizers));

// ICU's normal forms, as the library's NFC, NFD, NFKC and NFKD normalizers give them.
TEST(TokenizerNormalizers, UnicodeNormalFormsAsTheLibrary) {
  const json fixture = read_json(kFixtures / "normalizers.json");
  const std::vector<std::pair<std::string, tokenization::NormalForm>> forms = {
      {"NFC", tokenization::NormalForm::nfc},
      {"NFD", tokenization::NormalForm::nfd},
      {"NFKC", tokenization::NormalForm::nfkc},
      {"NFKD", tokenization::NormalForm::nfkd}};
  for (const auto& [name, form] : forms) {
    ASSERT_GT(fixture[name].size(), 50u) << name;
    for (const json& pair : fixture[name]) {
      EXPECT_EQ(tokenization::normalize_unicode(pair[0].get<std::string>(), form), pair[1].get<std::string>())
          << name << ", text " << shown(pair[0]);
    }
  }
}

// tokenizer_config.json next to tokenizer.json: its bos/eos tokens, and what transformers' AutoTokenizer
// encodes from the same directory (its add_eos_token: true is ignored, as transformers 5 ignores it).
TEST(TokenizerDirectory, ReadsTokenizerConfigAsTransformers) {
  const Tokenizer tokenizer = Tokenizer::from_directory(kFixtures / "llama");
  const json expected = read_json(kFixtures / "llama" / "cases.json")["transformers"];
  EXPECT_EQ(tokenizer.bos_token_id(), expected["bos_token_id"].get<int32_t>());
  EXPECT_EQ(tokenizer.eos_token_id(), expected["eos_token_id"].get<int32_t>());
  ASSERT_FALSE(expected["cases"].empty());
  for (const json& c : expected["cases"])
    EXPECT_EQ(tokenizer.encode(c["text"].get<std::string>()), ids_of(c["ids"])) << "text " << shown(c["text"]);

  const Tokenizer without_config = Tokenizer::from_file(kFixtures / "llama" / "tokenizer.json");
  EXPECT_FALSE(without_config.bos_token_id().has_value());
  EXPECT_FALSE(without_config.eos_token_id().has_value());
}

// Random strings of characters from many scripts, emoji, whitespace and control characters: decoding the
// encoding gives the text back for the tokenizers that lose nothing (no unk, no removing Split) — for
// Qwen2's after its NFC normalizer.
TEST(TokenizerRoundTrip, RandomTextComesBack) {
  const std::vector<char32_t> alphabet = {
      U'a',    U'Z',   U'0',   U'9',  U' ',   U'\t',  U'\n',  U'\r',  U'\'',  U'-',   U'.',    U'<',
      U'>',    U'|',   U'_',   0x00,  0x7F,   0xE9,   0xDF,   0x130,  0x131,  0x301,  0x308,   0x3A3,
      0x416,   0x5D0,  0x627,  0x915, 0x94D,  0x3042, 0x4E16, 0x754C, 0x9F98, 0xAC00, 0x1F600, 0x1F9EC,
      0x1F3FD, 0x200D, 0x2028, 0xA0,  0x3000, 0x180E, 0x85,   0xFB01, 0x2460, 0xFF21, 0x1D518, 0x10FFFD};
  std::mt19937 random(12345);
  std::vector<std::string> texts;
  for (int n = 0; n < 300; ++n) {
    std::string text;
    const int length = static_cast<int>(random() % 40);
    for (int i = 0; i < length; ++i) tokenization::append_utf8(text, alphabet[random() % alphabet.size()]);
    texts.push_back(text);
  }
  for (const std::string name : {"qwen2", "gpt2", "llama", "llama3"}) {
    const Tokenizer tokenizer = Tokenizer::from_file(kFixtures / name / "tokenizer.json");
    for (const std::string& text : texts) {
      const std::string expected =
          name == "qwen2" ? tokenization::normalize_unicode(text, tokenization::NormalForm::nfc) : text;
      EXPECT_EQ(tokenizer.decode(tokenizer.encode(text, false)), expected) << name << ", text " << shown(text);
    }
  }
}

// Byte fallback (llama) and byte-level (qwen2) split characters across ids: the stream holds them back
// until they are whole.
TEST(TokenizerStream, NeverReturnsPartOfACharacter) {
  const std::string text = "🧬 ꙮ 龘䶵 😀🎉 𝔘𝔫𝔦";
  for (const std::string name : {"llama", "qwen2"}) {
    const Tokenizer tokenizer = Tokenizer::from_file(kFixtures / name / "tokenizer.json");
    const std::vector<int32_t> ids = tokenizer.encode(text, false);
    DecodeStream stream(tokenizer);
    std::string streamed;
    int empty_steps = 0;
    for (const int32_t id : ids) {
      const std::string chunk = stream.step(id);
      EXPECT_TRUE(tokenization::is_valid_utf8(chunk) && !chunk.ends_with(tokenization::kReplacementChar))
          << name << ": chunk " << shown(chunk);
      empty_steps += chunk.empty() ? 1 : 0;
      streamed += chunk;
    }
    EXPECT_GT(empty_steps, 0) << name << ": every id completed a character, so nothing was tested";
    EXPECT_EQ(streamed + stream.finish(), text) << name;
  }
}

// finish() returns what never became whole; the stream then starts afresh.
TEST(TokenizerStream, FinishReturnsTheUnfinishedTail) {
  const Tokenizer tokenizer = Tokenizer::from_file(kFixtures / "llama" / "tokenizer.json");
  const std::optional<int32_t> lead = tokenizer.token_to_id("<0xF0>");  // first byte of a 4-byte character
  ASSERT_TRUE(lead.has_value());
  DecodeStream stream(tokenizer, true);
  EXPECT_EQ(stream.step(*lead), "");
  EXPECT_EQ(stream.finish(), tokenizer.decode(std::vector<int32_t>{*lead}));
  const std::vector<int32_t> ids = tokenizer.encode("again", false);
  std::string streamed;
  for (const int32_t id : ids) streamed += stream.step(id);
  EXPECT_EQ(streamed + stream.finish(), "again");
}

// ~100 kB prompts, well under a second each: the case texts in turn (words repeat, as in real prompts),
// and random words from several scripts (almost none repeats, so the per-encode word cache cannot help).
TEST(TokenizerSpeed, EncodesAHundredKilobytePrompt) {
  std::string random_words;
  std::mt19937 random(7);
  const std::u32string letters =
      U"etaoinshrdlucmfwypvbgkqjxzäöüßçğışéàèñДжиклмнопрстαβγδεζ你好世界机器学习日本語の한국어0123456789.,;!?-'\"";
  while (random_words.size() < 100'000) {
    const int length = 1 + static_cast<int>(random() % 12);
    for (int i = 0; i < length; ++i) tokenization::append_utf8(random_words, letters[random() % letters.size()]);
    random_words += random() % 10 == 0 ? "\n" : " ";
  }
  for (const std::string& name : kTokenizers) {
    const Tokenizer tokenizer = Tokenizer::from_file(kFixtures / name / "tokenizer.json");
    const json cases = read_json(kFixtures / name / "cases.json")["cases"];
    std::string case_texts;
    for (std::size_t i = 0; case_texts.size() < 100'000; ++i)
      case_texts += cases[i % cases.size()]["text"].get<std::string>() + "\n";
    for (const auto& [kind, prompt] :
         {std::pair{"case texts", &case_texts}, std::pair{"random words", &random_words}}) {
      tokenizer.encode(*prompt);  // warm-up
      const auto start = std::chrono::steady_clock::now();
      const std::vector<int32_t> ids = tokenizer.encode(*prompt);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("[ speed    ] %-10s %-12s %zu bytes -> %zu ids in %.2f ms (%.1f MB/s)\n", name.c_str(), kind,
                  prompt->size(), ids.size(), seconds * 1e3, prompt->size() / seconds / 1e6);
      EXPECT_LT(seconds, 1.0) << name << ", " << kind;
      EXPECT_GT(ids.size(), prompt->size() / 20) << name << ", " << kind;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Bad input: each a moekit::Error whose message names what is wrong.

json fixture_config(const std::string& name) {
  return read_json(kFixtures / name / "tokenizer.json");
}

Tokenizer load(const json& config) {
  return Tokenizer::from_json(config.dump(), "test.json");
}

TEST(TokenizerErrors, MissingFileAndMalformedJson) {
  EXPECT_TRUE(throws_error_with([] { Tokenizer::from_file("/no/such/dir/tokenizer.json"); },
                                {"cannot open", "/no/such/dir/tokenizer.json"}));
  EXPECT_TRUE(throws_error_with([] { Tokenizer::from_directory("/no/such/dir"); },
                                {"cannot open", "/no/such/dir/tokenizer.json"}));
  EXPECT_TRUE(throws_error_with([] { Tokenizer::from_json(R"({"model": {"type": "BPE", )", "broken.json"); },
                                {"broken.json", "not valid JSON"}));
  EXPECT_TRUE(throws_error_with([] { Tokenizer::from_json("[1, 2]", "array.json"); }, {"array.json", "object"}));
  EXPECT_TRUE(
      throws_error_with([] { Tokenizer::from_json("{}", "empty.json"); }, {"empty.json", "'model'", "missing"}));
}

TEST(TokenizerErrors, UnsupportedComponentsAreNamed) {
  const json base = fixture_config("qwen2");
  struct Case {
    const char* field;
    json value;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"normalizer", {{"type", "Lowercase"}}, {"normalizer type 'Lowercase' is not supported", "NFC"}},
      {"normalizer",
       {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFC"}}, {{"type", "StripAccents"}}})}},
       {"normalizer type 'StripAccents'"}},
      {"pre_tokenizer", {{"type", "Whitespace"}}, {"pre_tokenizer type 'Whitespace' is not supported", "Split"}},
      {"pre_tokenizer",
       {{"type", "Sequence"}, {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}}})}},
       {"pre_tokenizer type 'Digits'"}},
      {"post_processor", {{"type", "RobertaProcessing"}}, {"post_processor type 'RobertaProcessing'"}},
      {"decoder", {{"type", "WordPiece"}}, {"decoder type 'WordPiece' is not supported", "ByteFallback"}},
      {"decoder", {{"no_type", 1}}, {"decoder", "'type'"}},
      {"truncation", {{"max_length", 512}}, {"'truncation' must be null"}},
      {"padding", {{"strategy", "BatchLongest"}}, {"'padding' must be null"}},
      {"pre_tokenizer",
       {{"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}}, {"behavior", "Isolated"}},
       {"pre_tokenizer 'Split'", "\\w", "not support"}},
      {"pre_tokenizer",
       {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
       {"pre_tokenizer 'Split'", "(unclosed", "does not compile"}},
      {"pre_tokenizer",
       {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"}},
       {"pre_tokenizer 'Split'", "behavior 'Sideways'"}},
      {"pre_tokenizer",
       {{"type", "Metaspace"}, {"replacement", "_"}, {"prepend_scheme", "sometimes"}},
       {"pre_tokenizer 'Metaspace'", "prepend_scheme 'sometimes'"}},
      {"decoder",
       {{"type", "Strip"}, {"content", "ab"}, {"start", 1}, {"stop", 0}},
       {"decoder 'Strip'", "one character"}},
  };
  for (const Case& c : cases) {
    json config = base;
    config[c.field] = c.value;
    EXPECT_TRUE(throws_error_with([&] { load(config); }, c.parts)) << c.field << " = " << c.value.dump();
  }
}

TEST(TokenizerErrors, BadModelIsNamed) {
  const json base = fixture_config("qwen2");
  const auto expect_error = [&](const std::function<void(json&)>& edit, const std::vector<std::string>& parts) {
    json config = base;
    edit(config);
    EXPECT_TRUE(throws_error_with([&] { load(config); }, parts)) << parts.front();
  };
  expect_error([](json& c) { c["model"]["type"] = "Unigram"; }, {"model type 'Unigram' is not supported", "BPE"});
  expect_error(
      [](json& c) {
        c["model"]["merges"].push_back(json::array({"Ġ", "not_a_token"}));
      },
      {"model 'BPE'", "merge", "'not_a_token'", "not in the vocab"});
  expect_error([](json& c) { c["model"]["merges"].push_back("Ġ"); }, {"merge", "one space"});
  expect_error([](json& c) { c["model"]["merges"].push_back(json::array({"a"})); }, {"merge", "pair"});
  expect_error([](json& c) { c["model"]["vocab"]["duplicate"] = 5; }, {"same id 5", "'duplicate'"});
  expect_error([](json& c) { c["model"]["vocab"]["negative"] = -3; }, {"vocab id of 'negative'"});
  expect_error([](json& c) { c["model"].erase("vocab"); }, {"model 'BPE'", "'vocab'", "missing"});
  expect_error([](json& c) { c["model"]["dropout"] = 0.1; }, {"dropout", "not supported"});
  expect_error([](json& c) { c["model"]["continuing_subword_prefix"] = "##"; }, {"continuing_subword_prefix"});
  expect_error([](json& c) { c["model"]["byte_fallback"] = "yes"; }, {"'byte_fallback'", "true or false"});
  // An added token numbered other than tokenizers numbers it.
  expect_error([](json& c) { c["added_tokens"][0]["id"] = 5000; },
               {"added token '<|endoftext|>' has id 5000", "gives it id 1163"});
  expect_error(
      [](json& c) {
        c["post_processor"] = {
            {"type", "TemplateProcessing"},
            {"single", json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                    {{"SpecialToken", {{"id", "<x>"}, {"type_id", 0}}}}})},
            {"special_tokens",
             {{"<x>", {{"id", "<x>"}, {"ids", json::array({99999})}, {"tokens", json::array({"<x>"})}}}}}};
      },
      {"id 99999 is not in the vocabulary"});
}

TEST(TokenizerErrors, BadIdsAndTextAreNamed) {
  const Tokenizer tokenizer = Tokenizer::from_file(kFixtures / "qwen2" / "tokenizer.json");
  const auto size = static_cast<int32_t>(tokenizer.vocab_size());
  EXPECT_TRUE(throws_error_with([&] { tokenizer.decode(std::vector<int32_t>{1, -1}); }, {"id -1 is negative"}));
  EXPECT_TRUE(throws_error_with([&] { tokenizer.id_to_token(size + 7); },
                                {"id " + std::to_string(size + 7) + " is not in the vocabulary"}));
  EXPECT_TRUE(throws_error_with([&] { tokenizer.encode("ok \xC3\x28 bad"); }, {"not valid UTF-8", "byte 3"}));

  // A bad id leaves the stream as it was.
  DecodeStream stream(tokenizer);
  const std::vector<int32_t> ids = tokenizer.encode("Hello world", false);
  std::string streamed = stream.step(ids[0]);
  EXPECT_TRUE(throws_error_with([&] { stream.step(-3); }, {"id -3 is negative"}));
  for (std::size_t i = 1; i < ids.size(); ++i) streamed += stream.step(ids[i]);
  EXPECT_EQ(streamed + stream.finish(), "Hello world");
}

// A model's vocabulary is often padded past its tokenizer's (to a multiple of 64 or 128), and sampling
// can pick an id there. transformers decodes such ids as "" (tokenizers' decode skips ids it has no token
// for), so decode and the stream do too, and generation goes on.
TEST(TokenizerDecode, IdsPastTheTokenizerDecodeAsNothing) {
  for (const std::string& name : kTokenizers) {
    const Tokenizer tokenizer = Tokenizer::from_file(kFixtures / name / "tokenizer.json");
    const auto size = static_cast<int32_t>(tokenizer.vocab_size());
    const int32_t padded = (size + 127) / 128 * 128 + 128;  // past the tokenizer, within a padded vocab
    const std::vector<int32_t> hello = tokenizer.encode("Hello world", false);
    std::vector<int32_t> with_padding = {size, padded - 1};
    for (const int32_t id : hello) with_padding.insert(with_padding.end() - 1, {id, size + 1});
    EXPECT_EQ(tokenizer.decode(with_padding), tokenizer.decode(hello)) << name;
    EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{size}), "") << name;

    DecodeStream stream(tokenizer);
    std::string streamed;
    for (const int32_t id : with_padding) streamed += stream.step(id);
    EXPECT_EQ(streamed + stream.finish(), tokenizer.decode(hello)) << name;
  }
}

// `depth` Sequences listing their parts under `list_key`, one inside the other, around the JSON text
// `inner`. Built as text: a json value that deep cannot be dumped (dump recurses).
std::string nested_sequences(const std::string& list_key, const std::string& inner, int depth) {
  std::string text;
  for (int i = 0; i < depth; ++i) text += R"({"type": "Sequence", ")" + list_key + R"(": [)";
  text += inner;
  for (int i = 0; i < depth; ++i) text += "]}";
  return text;
}

// The fixture's tokenizer.json with `field` replaced by the JSON text `value`.
std::string with_component(const std::string& name, const std::string& field, const std::string& value) {
  json config = fixture_config(name);
  config[field] = "@component@";
  std::string text = config.dump();
  text.replace(text.find("\"@component@\""), std::string("\"@component@\"").size(), value);
  return text;
}

// qwen2's components, each wrapped in Sequences. In that file the normalizer (NFC) and the decoder
// (ByteLevel) hold no containers, and the pre-tokenizer is itself a Sequence whose Split holds a pattern
// object: 3 more levels.
struct NestedComponent {
  const char* field;
  const char* list_key;
  int wrappers_at_the_limit;  // each wrapper is an object and an array, under the top-level object
};
constexpr NestedComponent kNestedComponents[] = {
    {"normalizer", "normalizers", (128 - 2) / 2},
    {"pre_tokenizer", "pretokenizers", (128 - 2 - 3) / 2},
    {"decoder", "decoders", (128 - 2) / 2},
};

std::string nested_component(const NestedComponent& c, int wrappers) {
  return nested_sequences(c.list_key, fixture_config("qwen2")[c.field].dump(), wrappers);
}

// A Sequence inside 100,000 others overflowed the stack (the builder recursed once per level); the
// file is now refused when parsed, naming it and the limit.
TEST(TokenizerErrors, DeeplyNestedSequencesAreRefused) {
  for (const NestedComponent& c : kNestedComponents) {
    SCOPED_TRACE(c.field);
    const std::string text = with_component("qwen2", c.field, nested_component(c, 100000));
    EXPECT_TRUE(throws_error_with([&] { Tokenizer::from_json(text, "deep/tokenizer.json"); },
                                  {"deep/tokenizer.json: JSON nests deeper than 128 levels at " + std::string(c.field) +
                                       "." + c.list_key + "[0]." + c.list_key + "[0]",
                                   "..."}));
  }
}

// At the nesting limit the file loads, and the Sequences work as the component inside them.
TEST(TokenizerNesting, SequencesAtTheLimitWorkAsTheirParts) {
  const Tokenizer plain = Tokenizer::from_file(kFixtures / "qwen2" / "tokenizer.json");
  const std::string text = "Hello wo\xCC\x88rld, it's 2024!";  // o + combining diaeresis: NFC composes it
  const std::vector<int32_t> ids = plain.encode(text);
  for (const NestedComponent& c : kNestedComponents) {
    SCOPED_TRACE(c.field);
    const Tokenizer nested =
        Tokenizer::from_json(with_component("qwen2", c.field, nested_component(c, c.wrappers_at_the_limit)));
    EXPECT_EQ(nested.encode(text), ids);
    EXPECT_EQ(nested.decode(ids), plain.decode(ids));
    EXPECT_TRUE(throws_error_with(
        [&] {
          Tokenizer::from_json(with_component("qwen2", c.field, nested_component(c, c.wrappers_at_the_limit + 1)));
        },
        {"JSON nests deeper than 128 levels"}));
  }
}

// The builders flatten nested Sequences without recursion, so even a value built in memory (which no
// parse bounded) cannot overflow the stack.
TEST(TokenizerNesting, BuildersFlattenSequencesWithoutRecursion) {
  json sequence = {{"type", "NFC"}};
  for (int i = 0; i < 100000; ++i) {
    json outer = json::object();
    outer["type"] = "Sequence";
    outer["normalizers"] = json::array();
    outer["normalizers"].push_back(std::move(sequence));
    sequence = std::move(outer);
  }
  const auto normalizer = tokenization::make_normalizer(sequence);
  std::string composed = "e\xCC\x81";  // e + combining acute: NFC makes one character of it
  normalizer->apply(composed);
  EXPECT_EQ(composed, "\xC3\xA9");
}

TEST(TokenizerErrors, BadTokenizerConfigIsNamed) {
  const std::filesystem::path dir = test::temp_dir("tokenizer");
  std::filesystem::copy_file(kFixtures / "llama" / "tokenizer.json", dir / "tokenizer.json");
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": "<|not_here|>"})";
  EXPECT_TRUE(throws_error_with([&] { Tokenizer::from_directory(dir); },
                                {"tokenizer_config.json", "eos_token '<|not_here|>' is not in the vocabulary"}));
  std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": 1})";
  EXPECT_TRUE(throws_error_with([&] { Tokenizer::from_directory(dir); }, {"'bos_token' must be a string"}));
}

}  // namespace
}  // namespace moekit

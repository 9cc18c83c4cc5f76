// Text primitives of the tokenizer: UTF-8 walking and repair, the byte-level alphabet, Unicode properties
// and normalisation (ICU), and regular expressions (PCRE2).
//
// Unicode data comes from the system's ICU and PCRE2 (Debian 12: Unicode 14/15), the `tokenizers`
// library's from its Rust crates and Oniguruma; the two agree except on characters assigned in the newest
// Unicode versions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

struct pcre2_real_code_8;

namespace moekit::tokenization {

// UTF-8 of valid text.
inline std::size_t utf8_char_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}
char32_t decode_utf8_at(std::string_view text, std::size_t pos);  // the character starting at pos
void append_utf8(std::string& out, char32_t c);

// Offset of the first byte that is not part of a well-formed UTF-8 sequence; npos when all are.
std::size_t find_invalid_utf8(std::string_view bytes);
// bytes with each maximal ill-formed subsequence replaced by one U+FFFD (Unicode's "substitution of
// maximal subparts", which Rust's String::from_utf8_lossy does).
std::string utf8_lossy(std::string_view bytes);
bool is_valid_utf8(std::string_view bytes);

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// The byte-level alphabet of GPT-2's BPE: each byte has one printable character standing for it (bytes
// that are printable Latin-1 stand for themselves, the others map to U+0100 and up), so that any byte
// string is a string of visible characters and no byte is unknown to the vocabulary.
const std::string& byte_level_char(unsigned char byte);  // UTF-8 of the character standing for byte
std::optional<unsigned char> byte_level_byte(char32_t c);

// Unicode properties as the Rust code of `tokenizers` tests them.
bool is_white_space(char32_t c);  // White_Space (char::is_whitespace, regex \s)
bool is_word_char(char32_t c);    // the regex crate's Unicode \w: Alphabetic, M, Nd, Pc, Join_Control

enum class NormalForm { nfc, nfd, nfkc, nfkd };
std::string normalize_unicode(std::string_view text, NormalForm form);

// A compiled regular expression. tokenizers compiles its patterns with Oniguruma; PCRE2 with UTF and UCP
// reads the patterns tokenizer.json files use (\p{L}, \p{N}, (?i:...), lookahead (?!\S), {1,3}) the same
// way once \s is spelled out (see pcre2_pattern in the .cpp); constructs that would match differently are
// refused.
class Regex {
 public:
  // what names the component in error messages (a bad pattern is a moekit::Error).
  Regex(std::string_view pattern, const std::string& what);

  struct Match {
    std::size_t start;
    std::size_t end;
  };
  // Non-overlapping matches, left to right, in valid UTF-8 text.
  std::vector<Match> find_all(std::string_view text) const;

 private:
  std::shared_ptr<pcre2_real_code_8> code_;
  std::string what_;
};

}  // namespace moekit::tokenization

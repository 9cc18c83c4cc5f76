// UTF-8, the byte-level alphabet, Unicode properties and normalisation through ICU, regular expressions
// through PCRE2.
#include "moekit/model/tokenizer_text.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unicode/uchar.h>

#include <array>

#include "moekit/error.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace moekit::tokenization {

char32_t decode_utf8_at(std::string_view text, std::size_t pos) {
  const auto byte = [&](std::size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(text[pos + i])); };
  const char32_t lead = byte(0);
  switch (utf8_char_length(static_cast<unsigned char>(lead))) {
    case 1:
      return lead;
    case 2:
      return ((lead & 0x1F) << 6) | (byte(1) & 0x3F);
    case 3:
      return ((lead & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
    default:
      return ((lead & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) | (byte(3) & 0x3F);
  }
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

namespace {

// The length of the well-formed sequence at bytes[pos] (Unicode's table 3-7 of well-formed UTF-8), or 0
// when it is ill-formed; then *subpart is the length of its maximal subpart (the lead byte and the
// continuation bytes that could still have completed it), at least 1.
std::size_t well_formed_length(std::string_view bytes, std::size_t pos, std::size_t* subpart) {
  const auto lead = static_cast<unsigned char>(bytes[pos]);
  if (lead < 0x80) return 1;
  std::size_t continuation = 0;
  unsigned char low = 0x80, high = 0xBF;  // range of the first continuation byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    continuation = 1;
  } else if (lead == 0xE0) {
    continuation = 2, low = 0xA0;  // no overlong forms
  } else if (lead == 0xED) {
    continuation = 2, high = 0x9F;  // no surrogates
  } else if (lead >= 0xE1 && lead <= 0xEF) {
    continuation = 2;
  } else if (lead == 0xF0) {
    continuation = 3, low = 0x90;  // no overlong forms
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    continuation = 3;
  } else if (lead == 0xF4) {
    continuation = 3, high = 0x8F;  // nothing above U+10FFFF
  } else {
    *subpart = 1;
    return 0;
  }
  std::size_t i = 1;
  for (; i <= continuation && pos + i < bytes.size(); ++i) {
    const auto byte = static_cast<unsigned char>(bytes[pos + i]);
    if (byte < low || byte > high) break;
    low = 0x80, high = 0xBF;
  }
  if (i > continuation) return i;
  *subpart = i;
  return 0;
}

}  // namespace

std::size_t find_invalid_utf8(std::string_view bytes) {
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    std::size_t subpart = 0;
    const std::size_t length = well_formed_length(bytes, pos, &subpart);
    if (length == 0) return pos;
    pos += length;
  }
  return std::string_view::npos;
}

bool is_valid_utf8(std::string_view bytes) {
  return find_invalid_utf8(bytes) == std::string_view::npos;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    std::size_t subpart = 0;
    const std::size_t length = well_formed_length(bytes, pos, &subpart);
    if (length > 0) {
      out.append(bytes.substr(pos, length));
      pos += length;
    } else {
      out.append(kReplacementChar);
      pos += subpart;
    }
  }
  return out;
}

namespace {

struct ByteLevelAlphabet {
  std::array<std::string, 256> chars;
  std::array<int, 512> bytes;  // code point -> byte, -1 where none; every mapped code point is < 512

  ByteLevelAlphabet() {
    bytes.fill(-1);
    char32_t next_unprintable = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? static_cast<char32_t>(b) : next_unprintable++;
      append_utf8(chars[b], c);
      bytes[c] = b;
    }
  }
};

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

}  // namespace

const std::string& byte_level_char(unsigned char byte) {
  return byte_level_alphabet().chars[byte];
}

std::optional<unsigned char> byte_level_byte(char32_t c) {
  if (c >= 512) return std::nullopt;
  const int byte = byte_level_alphabet().bytes[c];
  if (byte < 0) return std::nullopt;
  return static_cast<unsigned char>(byte);
}

bool is_white_space(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE) != 0;
}

bool is_word_char(char32_t c) {
  const auto code_point = static_cast<UChar32>(c);
  return u_hasBinaryProperty(code_point, UCHAR_ALPHABETIC) || u_hasBinaryProperty(code_point, UCHAR_JOIN_CONTROL) ||
         (U_GET_GC_MASK(code_point) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

std::string normalize_unicode(std::string_view text, NormalForm form) {
  // ASCII is unchanged by every normal form: most prompts skip ICU entirely.
  bool ascii = true;
  for (const char c : text) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) return std::string(text);

  // ICU's instance of each NormalForm, in the enum's order.
  using Instance = const icu::Normalizer2* (*)(UErrorCode&);
  constexpr std::array<Instance, 4> kInstances = {&icu::Normalizer2::getNFCInstance, &icu::Normalizer2::getNFDInstance,
                                                  &icu::Normalizer2::getNFKCInstance,
                                                  &icu::Normalizer2::getNFKDInstance};
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* normalizer = kInstances[static_cast<std::size_t>(form)](status);
  MOEKIT_CHECK(U_SUCCESS(status), "tokenizer: ICU has no normaliser instance (", u_errorName(status), ")");
  // normalizeUTF8 works on UTF-8 directly (NFC and NFKC without a round trip through UTF-16).
  std::string out;
  out.reserve(text.size());
  icu::StringByteSink<std::string> sink(&out);
  normalizer->normalizeUTF8(0, icu::StringPiece(text.data(), static_cast<int32_t>(text.size())), sink, nullptr, status);
  MOEKIT_CHECK(U_SUCCESS(status), "tokenizer: ICU normalisation failed (", u_errorName(status), ")");
  return out;
}

namespace {

// Match data and a JIT stack per thread: a const Regex is shared by every thread encoding with it.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(16, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  // PCRE2's default JIT stack (32 kB) is too small for long runs under patterns with lookahead.
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);

  MatchScratch() {
    MOEKIT_CHECK(data != nullptr && context != nullptr && stack != nullptr, "tokenizer: out of memory for PCRE2");
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  MatchScratch(const MatchScratch&) = delete;
  MatchScratch& operator=(const MatchScratch&) = delete;
};

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buffer{};
  pcre2_get_error_message(code, buffer.data(), buffer.size());
  return reinterpret_cast<const char*>(buffer.data());
}

}  // namespace

namespace {

// An Oniguruma pattern (tokenizers compiles with Oniguruma's default syntax) as a PCRE2 pattern of the
// same matches. \s and \S name White_Space's members, which is Oniguruma's \s: PCRE2's also matches
// U+180E. \uHHHH, which PCRE2 lacks, becomes \x{HHHH}. Escapes that mean something else in PCRE2 (\h is a
// hex digit in Oniguruma) or whose word characters differ (\w, \b), and Oniguruma's nested classes, are
// refused rather than matched differently.
std::string pcre2_pattern(std::string_view pattern, const std::string& what) {
  constexpr std::string_view kSpace = "\\t-\\r\\x{85}\\p{Z}";
  const auto refuse = [&](std::string_view construct) {
    MOEKIT_FAIL(what, ": the regular expression '", pattern, "' uses ", construct,
                ", which moekit does not support (it would not match as in tokenizers' Oniguruma)");
  };
  std::string out;
  out.reserve(pattern.size() + 16);
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char escaped = pattern[++i];
      if (escaped == 's') {
        out += in_class ? std::string(kSpace) : "[" + std::string(kSpace) + "]";
      } else if (escaped == 'S') {
        if (in_class) refuse("\\S inside a character class");
        out += "[^" + std::string(kSpace) + "]";
      } else if (escaped == 'u' && i + 4 < pattern.size()) {
        out += "\\x{" + std::string(pattern.substr(i + 1, 4)) + "}";
        i += 4;
      } else if (std::string_view("hHwWbBRXK").find(escaped) != std::string_view::npos) {
        refuse(std::string("\\") + escaped);
      } else if (escaped == 'Q') {
        // Quoted text up to \E is copied as it is.
        const std::size_t end = pattern.find("\\E", i + 1);
        const std::size_t stop = end == std::string_view::npos ? pattern.size() : end + 2;
        out += "\\Q";
        out += pattern.substr(i + 1, stop - i - 1);
        i = stop - 1;
      } else {
        out += '\\';
        out += escaped;
      }
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
        const std::size_t end = pattern.find(":]", i + 2);
        if (end == std::string_view::npos) refuse("an unclosed POSIX class");
        out += pattern.substr(i, end + 2 - i);
        i = end + 1;
        continue;
      }
      if (c == '[') refuse("a nested character class");
      if (c == '&' && i + 1 < pattern.size() && pattern[i + 1] == '&') refuse("a class intersection (&&)");
      if (c == ']') in_class = false;
      out += c;
      continue;
    }
    out += c;
    if (c == '[') {
      in_class = true;
      // A leading ^ negates; a ] right after the opening (or after ^) is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
    }
  }
  return out;
}

}  // namespace

Regex::Regex(std::string_view pattern, const std::string& what) : what_(what) {
  const std::string translated = pcre2_pattern(pattern, what);
  int error = 0;
  PCRE2_SIZE offset = 0;
  // MULTILINE: in Oniguruma's syntax ^ and $ match at every line start and end.
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &error, &offset, nullptr);
  MOEKIT_CHECK(code != nullptr, what, ": the regular expression '", pattern,
               "' does not compile (PCRE2: ", pcre2_message(error), ", at offset ", offset, " of '", translated, "')");
  // Without JIT (an unsupported CPU) PCRE2's interpreter gives the same matches, only slower.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_.reset(code, pcre2_code_free);
}

std::vector<Regex::Match> Regex::find_all(std::string_view text) const {
  thread_local MatchScratch scratch;
  std::vector<Match> matches;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.empty() ? "" : text.data());
  std::size_t pos = 0;
  while (pos <= text.size()) {
    // The text was checked to be UTF-8 once, at encode(); checking again from pos on every call would
    // make the loop quadratic.
    const int rc =
        pcre2_match(code_.get(), subject, text.size(), pos, PCRE2_NO_UTF_CHECK, scratch.data, scratch.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    // rc == 0: the ovector is too small for every group, but the whole match (pair 0) is there.
    MOEKIT_CHECK(rc >= 0, what_, ": matching the regular expression failed (PCRE2: ", pcre2_message(rc), ")");
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.data);
    const std::size_t start = ovector[0], end = ovector[1];
    MOEKIT_CHECK(start <= end && start >= pos, what_, ": the regular expression gave a match that ends before it ",
                 "starts (\\K in a lookaround is not supported)");
    matches.push_back({start, end});
    if (end > start) {
      pos = end;
    } else {
      // An empty match: look again one character further on.
      if (end >= text.size()) break;
      pos = end + utf8_char_length(static_cast<unsigned char>(text[end]));
    }
  }
  return matches;
}

}  // namespace moekit::tokenization

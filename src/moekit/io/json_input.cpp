// Checked JSON reading (json_input.h): nlohmann's SAX parser (iterative) drives a builder that makes the
// value and checks it on the way, in one pass.
#include "moekit/io/json_input.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include "moekit/error.h"

namespace moekit {
namespace {

using json = nlohmann::json;

constexpr std::size_t kStringBytes = 64;     // of a string in describe_json
constexpr std::size_t kContainerChars = 80;  // of a container in describe_json
constexpr std::size_t kPathChars = 60;       // of the key path in an error
constexpr std::size_t kKeyBytes = 40;        // of one key in that path

// The length of the longest prefix of `text` of at most `limit` bytes that ends on a UTF-8 character
// boundary, so that a cut never leaves half a character.
std::size_t utf8_prefix(std::string_view text, std::size_t limit) {
  if (text.size() <= limit) return text.size();
  std::size_t n = limit;
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  return n;
}

// A string as a JSON string literal, cut at `limit` bytes with "..." inside the quotes.
void append_quoted(std::string& out, std::string_view text, std::size_t limit) {
  const std::size_t n = utf8_prefix(text, limit);
  // replace: a string built in memory need not be UTF-8, and an error message must not throw.
  out += json(std::string(text.substr(0, n))).dump(-1, ' ', false, json::error_handler_t::replace);
  if (n < text.size()) out.insert(out.size() - 1, "...");
}

void append_scalar(std::string& out, const json& value) {
  if (value.is_string())
    append_quoted(out, value.get_ref<const std::string&>(), kStringBytes);
  else
    out += value.dump();  // a number, boolean or null: no recursion
}

// One open container of the document being built.
struct Frame {
  json* container;
  const std::string* key = nullptr;  // objects: the key whose value comes next (the map's own copy)
  json* slot = nullptr;              // objects: that key's value
};

// The path from the root to the value being parsed, `rope_scaling.factor` or `decoder.decoders[2]`,
// cut after about kPathChars characters.
std::string key_path(const std::vector<Frame>& frames) {
  std::string path;
  for (const Frame& frame : frames) {
    if (path.size() > kPathChars) {
      path += "...";
      break;
    }
    if (frame.container->is_array()) {
      path += '[';
      path += std::to_string(frame.container->size() - 1);
      path += ']';
      continue;
    }
    const std::string& key = *frame.key;
    if (!path.empty()) path += '.';
    const bool plain = !key.empty() && key.size() <= kKeyBytes && std::all_of(key.begin(), key.end(), [](char c) {
      return c > ' ' && c < 0x7f && c != '"' && c != '[';
    });
    if (plain)
      path += key;
    else
      append_quoted(path, key, kKeyBytes);
  }
  return path.empty() ? "the top level" : path;
}

// nlohmann's SAX events -> a json value, as its own DOM parser builds one, with the checks on the way:
// containers deeper than kMaxJsonDepth and repeated keys (which the object's map shows as it inserts
// them) throw.
class Builder {
 public:
  Builder(std::string_view source, const JsonReadOptions& options) : source_(source), options_(options) {}

  json& result() { return result_; }

  bool null() { return scalar(json(nullptr)); }
  bool boolean(bool value) { return scalar(json(value)); }
  bool number_integer(json::number_integer_t value) { return scalar(json(value)); }
  bool number_unsigned(json::number_unsigned_t value) { return scalar(json(value)); }
  bool number_float(json::number_float_t value, const json::string_t&) { return scalar(json(value)); }
  bool string(json::string_t& value) { return scalar(json(std::move(value))); }
  bool binary(json::binary_t& value) { return scalar(json::binary(std::move(value))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(json::string_t& key) {
    Frame& top = frames_.back();
    const auto [it, inserted] = top.container->get_ref<json::object_t&>().try_emplace(std::move(key));
    top.key = &it->first;
    top.slot = &it->second;
    const int depth = static_cast<int>(frames_.size());
    MOEKIT_CHECK(inserted || (options_.allow_duplicate_key && options_.allow_duplicate_key(depth, it->first)), source_,
                 ": the key ", key_path(frames_),
                 " appears twice in its object (JSON readers differ in which one they keep)");
    if (options_.callback) options_.callback(depth, json::parse_event_t::key, json(it->first));
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    MOEKIT_FAIL(source_, ": not valid JSON: ", e.what());
  }

 private:
  // Puts a value where the document has it: the root, the current key's slot or the end of an array.
  json& place(json&& value) {
    if (frames_.empty()) return result_ = std::move(value);
    Frame& top = frames_.back();
    if (!top.container->is_array()) return *top.slot = std::move(value);
    auto& array = top.container->get_ref<json::array_t&>();
    array.push_back(std::move(value));
    return array.back();
  }

  bool scalar(json&& value) {
    const json& placed = place(std::move(value));
    if (options_.callback) options_.callback(static_cast<int>(frames_.size()), json::parse_event_t::value, placed);
    return true;
  }

  // A pointer to an array's last element stays valid while it is open: nothing is appended to that array
  // until it closes. Map nodes never move.
  bool open(json&& container) {
    json& placed = place(std::move(container));
    MOEKIT_CHECK(frames_.size() < static_cast<std::size_t>(kMaxJsonDepth), source_, ": JSON nests deeper than ",
                 kMaxJsonDepth, " levels at ", key_path(frames_));
    frames_.push_back(Frame{&placed});
    return true;
  }

  bool close() {
    frames_.pop_back();
    return true;
  }

  std::string_view source_;
  const JsonReadOptions& options_;
  std::vector<Frame> frames_;
  json result_;
};

}  // namespace

json parse_json(std::string_view text, std::string_view source, const JsonReadOptions& options) {
  Builder builder(source, options);
  json::sax_parse(text.begin(), text.end(), &builder);
  return std::move(builder.result());
}

json read_json_file(const std::filesystem::path& path, const JsonReadOptions& options) {
  std::ifstream in(path, std::ios::binary);
  MOEKIT_CHECK(in.is_open(), path.string(), ": cannot open: ", std::strerror(errno));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  MOEKIT_CHECK(!in.bad(), path.string(), ": cannot read: ", std::strerror(errno));
  return parse_json(text, path.string(), options);
}

std::string describe_json(const json& value) {
  std::string out;
  if (!value.is_structured()) {
    append_scalar(out, value);
    return out;
  }
  // Depth first with an explicit stack, stopping once the text is long enough: never deeper than
  // kContainerChars levels, whatever the value's depth.
  struct Open {
    const json* container;
    json::const_iterator next;
  };
  std::vector<Open> open;
  const auto start = [&](const json& container) {
    out += container.is_object() ? '{' : '[';
    open.push_back({&container, container.cbegin()});
  };
  start(value);
  while (!open.empty() && out.size() <= kContainerChars) {
    Open& top = open.back();
    if (top.next == top.container->cend()) {
      out += top.container->is_object() ? '}' : ']';
      open.pop_back();
      continue;
    }
    if (top.next != top.container->cbegin()) out += ',';
    if (top.container->is_object()) {
      append_quoted(out, top.next.key(), kStringBytes);
      out += ':';
    }
    const json& element = *top.next;
    ++top.next;  // before start(), which may move `top`
    if (element.is_structured())
      start(element);
    else
      append_scalar(out, element);
  }
  if (out.size() > kContainerChars || !open.empty()) {
    out.resize(utf8_prefix(out, kContainerChars));
    out += "...";
  }
  return out;
}

std::string describe_json_with_type(const json& value) {
  return std::string(value.type_name()) + " " + describe_json(value);
}

}  // namespace moekit

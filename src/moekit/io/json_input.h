// The one way moekit reads JSON from a checkpoint (config.json, the shard index, tokenizer.json, a
// safetensors header) or from a user (experts_implementation). Such JSON is untrusted, so beyond what
// nlohmann's parser checks:
//   - nesting is bounded: nlohmann parses any depth without recursion, but copying, comparing or
//     dumping a value recurses once per level, and so do the readers built on it; a document 100,000
//     levels deep would overflow the stack there;
//   - a key its object already holds is an error: a parsed object keeps only the last of two equal
//     keys, while other readers (and the writer's intent) may take the first.
// Errors are moekit::Error naming the source and the path of keys.
#pragma once

#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace moekit {

// The deepest nesting accepted, in arrays and objects. 128 is serde_json's recursion limit, which the
// Rust tokenizers and safetensors libraries (which write these files) read and write with: serde_json
// refuses a 128th level, so nothing they write or read nests deeper than 127.
inline constexpr int kMaxJsonDepth = 128;

struct JsonReadOptions {
  // Sees each key (event key, the key as a JSON string) and each scalar value (event value) in document
  // order, after the checks. depth: the number of containers open around it, 1 for the top level's keys.
  std::function<void(int depth, nlohmann::json::parse_event_t event, const nlohmann::json& parsed)> callback;
  // A repeated key is an error unless this returns true for its depth (1 for the top level's keys)
  // and key: for a caller that reports it better itself, as read_index names both shards of a
  // tensor listed twice. The parsed object then holds the last one.
  std::function<bool(int depth, const std::string& key)> allow_duplicate_key;
};

// Parses one JSON document. `source` names it in errors ("model.safetensors.index.json: ...").
nlohmann::json parse_json(std::string_view text, std::string_view source, const JsonReadOptions& options = {});

// Reads and parses a file; errors name the path.
nlohmann::json read_json_file(const std::filesystem::path& path, const JsonReadOptions& options = {});

// A JSON value for an error message, bounded whatever the value: scalars as JSON, strings cut at 64
// bytes, containers written without recursion up to about 80 characters and then "...".
std::string describe_json(const nlohmann::json& value);

// describe_json after the value's type: "array [1,2]", "string \"x\"".
std::string describe_json_with_type(const nlohmann::json& value);

}  // namespace moekit

// Typed access to the objects of a tokenizer.json. The file is untrusted input: every field is
// type-checked, and every error names the component ("pre_tokenizer 'Split'") and the field.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "moekit/error.h"
#include "moekit/io/json_input.h"

namespace moekit::tokenization {

class JsonFields {
 public:
  // where: the component, as error messages name it.
  JsonFields(const nlohmann::json& object, std::string where) : object_(object), where_(std::move(where)) {
    MOEKIT_CHECK(object_.is_object(), where_, " must be a JSON object, got ", show(object_));
  }

  const std::string& where() const { return where_; }

  // Present and not null (tokenizers reads a null field as absent).
  bool has(std::string_view key) const {
    const auto it = object_.find(key);
    return it != object_.end() && !it->is_null();
  }

  const nlohmann::json& required(std::string_view key) const {
    const auto it = object_.find(key);
    MOEKIT_CHECK(it != object_.end() && !it->is_null(), where_, ": the field '", key, "' is missing");
    return *it;
  }

  std::string string(std::string_view key) const { return as_string(key, required(key)); }
  std::string string(std::string_view key, std::string fallback) const {
    return has(key) ? as_string(key, required(key)) : std::move(fallback);
  }

  bool boolean(std::string_view key, bool fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& value = required(key);
    MOEKIT_CHECK(value.is_boolean(), where_, ": the field '", key, "' must be true or false, got ", show(value));
    return value.get<bool>();
  }

  int64_t integer(std::string_view key, int64_t fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& value = required(key);
    MOEKIT_CHECK(value.is_number_integer(), where_, ": the field '", key, "' must be an integer, got ", show(value));
    return value.get<int64_t>();
  }

  const nlohmann::json& array(std::string_view key) const {
    const nlohmann::json& value = required(key);
    MOEKIT_CHECK(value.is_array(), where_, ": the field '", key, "' must be an array, got ", show(value));
    return value;
  }

  const nlohmann::json& object(std::string_view key) const {
    const nlohmann::json& value = required(key);
    MOEKIT_CHECK(value.is_object(), where_, ": the field '", key, "' must be an object, got ", show(value));
    return value;
  }

  // A short rendering of a value for error messages.
  static std::string show(const nlohmann::json& value) { return describe_json_with_type(value); }

 private:
  std::string as_string(std::string_view key, const nlohmann::json& value) const {
    MOEKIT_CHECK(value.is_string(), where_, ": the field '", key, "' must be a string, got ", show(value));
    return value.get<std::string>();
  }

  const nlohmann::json& object_;
  std::string where_;
};

// The "type" of a component object: what its error messages start with, e.g. "normalizer 'NFC'".
inline std::string component_type(const nlohmann::json& component, std::string_view kind) {
  MOEKIT_CHECK(component.is_object(), "tokenizer.json: ", kind, " must be a JSON object or null, got ",
               JsonFields::show(component));
  const auto it = component.find("type");
  MOEKIT_CHECK(it != component.end() && it->is_string(), "tokenizer.json: ", kind, " ", JsonFields::show(component),
               " has no string field 'type'");
  return it->get<std::string>();
}

}  // namespace moekit::tokenization

// Command-line flags declared once (name, default, help) with a reader of each value, so that what a
// benchmark prints and stores as its options is exactly the declared flags; shared by the bench commands.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moekit::cli {

// Declares each flag once (name, default, help) and keeps a reader for its value, so that the options
// printed at the start and stored in the JSON are exactly the declared flags, in declaration order.
class FlagTable {
 public:
  explicit FlagTable(CLI::App* cmd) : cmd_(cmd) {}

  template <typename T>
  CLI::Option* add(const std::string& name, T& value, const std::string& help) {
    readers_.emplace_back(name, [&value] { return nlohmann::ordered_json(value); });
    if constexpr (std::is_same_v<T, bool>)
      return cmd_->add_flag(name, value, help);  // --graphs, no value
    else
      return cmd_->add_option(name, value, help)->capture_default_str();
  }

  nlohmann::ordered_json values() const {
    nlohmann::ordered_json j;
    for (const auto& [name, read] : readers_) j[name.substr(2)] = read();
    return j;
  }

  // The flags as a command line that repeats this run ("--tokens 1,8 --dtype bf16 ...").
  std::string command_line() const {
    std::string line;
    for (const auto& [name, read] : readers_) {
      const nlohmann::ordered_json v = read();
      if (v.is_boolean()) {  // a flag: present when true
        if (v.get<bool>()) line += (line.empty() ? "" : " ") + name;
        continue;
      }
      std::string text;
      if (v.is_array()) {
        for (const auto& item : v)
          text += (text.empty() ? "" : ",") + (item.is_string() ? item.get<std::string>() : item.dump());
      } else {
        text = v.is_string() ? v.get<std::string>() : v.dump();
      }
      line += (line.empty() ? "" : " ") + name + " " + (text.empty() ? "''" : text);
    }
    return line;
  }

 private:
  CLI::App* cmd_;
  std::vector<std::pair<std::string, std::function<nlohmann::ordered_json()>>> readers_;
};

// CLI11's own range checks print the whole numeric range of the type; this names the bound instead.
inline CLI::Validator at_least(double bound) {
  char bound_text[32];
  std::snprintf(bound_text, sizeof(bound_text), "%g", bound);
  return CLI::Validator(
      [bound, shown = std::string(bound_text)](std::string& text) {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool ok = !text.empty() && *end == '\0' && v >= bound;
        return ok ? std::string() : "must be a number >= " + shown + ", got " + text;
      },
      ">=" + std::string(bound_text));
}

}  // namespace moekit::cli

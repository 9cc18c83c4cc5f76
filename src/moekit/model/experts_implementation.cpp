#include "moekit/model/experts_implementation.h"

#include <nlohmann/json.hpp>

#include "moekit/experts.h"
#include "moekit/io/json_input.h"

namespace moekit {
namespace {

std::string join_keys(const std::map<std::string, std::string>& m) {
  std::string out;
  for (const auto& [k, v] : m) out += std::string(out.empty() ? "" : ", ") + "\"" + k + "\"";
  return out;
}

}  // namespace

ExpertsImplementation::ExpertsImplementation(const std::vector<std::string>& sub_configs,
                                             const std::string& default_backend) {
  ExpertsInterface::global().get(default_backend);  // throws listing the valid names
  backends_[""] = default_backend;
  for (const std::string& name : sub_configs) {
    MOEKIT_CHECK(!name.empty(), "a sub-config name cannot be empty (\"\" is the top-level model)");
    backends_[name] = default_backend;
  }
}

void ExpertsImplementation::set(std::string_view backend) {
  ExpertsInterface::global().get(backend);
  for (auto& [backbone, name] : backends_) name = std::string(backend);
}

void ExpertsImplementation::set(const std::map<std::string, std::string>& per_backbone) {
  // Check everything first, so that a bad entry changes nothing.
  for (const auto& [backbone, backend] : per_backbone) {
    MOEKIT_CHECK(backends_.count(backbone), "experts_implementation has no backbone \"", backbone,
                 "\"; valid keys: ", join_keys(backends_), " (\"\" is the top-level model)");
    ExpertsInterface::global().get(backend);
  }
  for (const auto& [backbone, backend] : per_backbone) backends_[backbone] = backend;
}

void ExpertsImplementation::set_from_text(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\n\r");
  if (first == std::string_view::npos || text[first] != '{') {
    set(text.substr(first == std::string_view::npos ? text.size() : first));
    return;
  }
  const nlohmann::json j = parse_json(text, "experts_implementation");
  std::map<std::string, std::string> per_backbone;
  for (const auto& [key, value] : j.items()) {
    MOEKIT_CHECK(value.is_string(), "experts_implementation[\"", key, "\"] must be a backend name, got ",
                 describe_json(value));
    per_backbone[key] = value.get<std::string>();
  }
  set(per_backbone);
}

const std::string& ExpertsImplementation::of(std::string_view backbone) const {
  const auto it = backends_.find(std::string(backbone));
  MOEKIT_CHECK(it != backends_.end(), "experts_implementation has no backbone \"", backbone,
               "\"; valid keys: ", join_keys(backends_));
  return it->second;
}

DecodePhaseSwitch::DecodePhaseSwitch(ExpertsImplementation& implementation, Device device)
    : implementation_(implementation) {
  if (!device.is_cuda()) return;
  std::map<std::string, std::string> to_batched;
  for (const auto& [backbone, backend] : implementation.get())
    if (backend == "grouped_mm") {
      saved_[backbone] = backend;
      to_batched[backbone] = "batched_mm";
    }
  implementation.set(to_batched);
}

DecodePhaseSwitch::~DecodePhaseSwitch() {
  // Restoring names that were valid a moment ago cannot fail; a destructor must not throw anyway.
  try {
    implementation_.set(saved_);
  } catch (...) {
  }
}

}  // namespace moekit

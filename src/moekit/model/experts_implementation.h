// Which experts backend each backbone of a model runs: the top-level model ("") and every sub-config
// ("text_config", "vision_config", ...), as transformers' experts_implementation /
// set_experts_implementation / get_experts_implementation, and the decode-phase switch of generate.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/tensor.h"

namespace moekit {

class ExpertsImplementation {
 public:
  // backbones: the sub-config names of the model ("" for the top level is always there). Every entry
  // starts as default_backend.
  explicit ExpertsImplementation(const std::vector<std::string>& sub_configs,
                                 const std::string& default_backend = "grouped_mm");

  // One backend for every backbone.
  void set(std::string_view backend);
  // The listed backbones only ("" = the top level); the others keep theirs. Unknown backbones or
  // backend names throw listing the valid ones, and then nothing changes.
  void set(const std::map<std::string, std::string>& per_backbone);
  // A bare name ("batched_mm") or a JSON object ({"": "eager", "text_config": "grouped_mm"}), as the
  // CLI's --experts-implementation takes it.
  void set_from_text(std::string_view text);

  // {"": ..., "<sub-config>": ...}: one entry per backbone.
  const std::map<std::string, std::string>& get() const { return backends_; }
  const std::string& of(std::string_view backbone) const;

 private:
  std::map<std::string, std::string> backends_;
};

// Generation's decode phase on a GPU: every grouped_mm entry (and only those) runs batched_mm, which
// is faster at few tokens; the original map comes back when the switch is destroyed, also when
// generation throws. On the CPU nothing changes (grouped_mm is the better backend at every size there).
class DecodePhaseSwitch {
 public:
  DecodePhaseSwitch(ExpertsImplementation& implementation, Device device);
  ~DecodePhaseSwitch();
  DecodePhaseSwitch(const DecodePhaseSwitch&) = delete;
  DecodePhaseSwitch& operator=(const DecodePhaseSwitch&) = delete;
  bool switched() const { return !saved_.empty(); }

 private:
  ExpertsImplementation& implementation_;
  std::map<std::string, std::string> saved_;  // the entries changed, with their original backends
};

}  // namespace moekit

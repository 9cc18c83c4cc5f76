// The flags every model command shares (--model, --device, --dtype, --experts-implementation, --dequantize)
// and the built-in random model that runs when --model is not given.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "moekit/model.h"

namespace moekit::cli {

struct ModelOptions {
  std::string model_dir;  // empty: the built-in model
  std::string device = "cpu";
  std::string dtype;  // empty: the checkpoint's own
  std::string experts_implementation = "grouped_mm";
  bool dequantize = false;  // quantised experts to the model dtype at load (LoadOptions::dequantize)
};

void add_model_options(CLI::App* cmd, ModelOptions& options);
// The checkpoint directory: --model, or the built-in model (the "tiny" random preset, seed 0, bf16),
// written on first use to $XDG_CACHE_HOME/moekit/builtin-tiny-v1 (default ~/.cache/moekit/...).
std::string resolve_model_dir(const ModelOptions& options);
LoadOptions load_options(const ModelOptions& options);
// "1,2,3" -> {1, 2, 3}; `what` names the flag in errors.
std::vector<int32_t> parse_token_list(const std::string& text, const std::string& what);

}  // namespace moekit::cli

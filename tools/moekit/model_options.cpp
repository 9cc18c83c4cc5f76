#include "model_options.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <unistd.h>

#include "moekit/error.h"

namespace moekit::cli {

namespace fs = std::filesystem;

void add_model_options(CLI::App* cmd, ModelOptions& o) {
  cmd->add_option("--model", o.model_dir,
                  "Checkpoint directory (config.json, safetensors); default: the built-in random model");
  cmd->add_option("--device", o.device, "cpu or cuda[:N]")->capture_default_str();
  cmd->add_option("--dtype", o.dtype, "f32, f16 or bf16 (default: the checkpoint's)");
  cmd->add_option("--experts-implementation", o.experts_implementation,
                  "Experts backend, or a JSON map {\"\": name, \"<sub-config>\": name}")
      ->capture_default_str();
  cmd->add_flag("--dequantize", o.dequantize,
                "Dequantise a pre-quantised checkpoint's FP8 / FP4 experts to the model dtype at load, so that "
                "every backend (CUDA ones too) runs them");
}

std::string resolve_model_dir(const ModelOptions& o) {
  if (!o.model_dir.empty()) return o.model_dir;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const fs::path cache = xdg != nullptr && *xdg != '\0' ? fs::path(xdg)
                         : home != nullptr && *home != '\0' ? fs::path(home) / ".cache"
                                                             : fs::temp_directory_path();
  const fs::path dir = cache / "moekit" / "builtin-tiny-v1";
  if (fs::exists(dir / "model.safetensors")) return dir.string();
  std::fprintf(stderr, "writing the built-in model (random qwen3_moe, preset tiny, seed 0) to %s\n", dir.c_str());
  // Written beside and renamed, so that an interrupted write never leaves a half model behind.
  const fs::path partial = dir.string() + ".partial." + std::to_string(::getpid());
  fs::remove_all(partial);
  write_random_model(partial.string(), {.preset = "tiny", .dtype = DType::bf16, .seed = 0});
  std::error_code ignored;
  fs::rename(partial, dir, ignored);  // another process may have won the race: its model is the same
  fs::remove_all(partial, ignored);
  MOEKIT_CHECK(fs::exists(dir / "model.safetensors"), "could not write the built-in model to ", dir.string());
  return dir.string();
}

LoadOptions load_options(const ModelOptions& o) {
  LoadOptions l;
  if (!o.dtype.empty()) l.dtype = parse_dtype(o.dtype);
  l.device = parse_device(o.device);
  l.experts_implementation = o.experts_implementation;
  l.dequantize = o.dequantize;
  return l;
}

std::vector<int32_t> parse_token_list(const std::string& text, const std::string& what) {
  std::vector<int32_t> out;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const std::size_t end = std::min(text.find(',', begin), text.size());
    int32_t value = 0;
    const char* first = text.data() + begin;
    const char* last = text.data() + end;
    const auto [ptr, ec] = std::from_chars(first, last, value);
    MOEKIT_CHECK(ec == std::errc() && ptr == last && first != last, what, ": '", std::string(first, last),
                 "' is not a token id (expected comma-separated integers, e.g. 1,2,3)");
    out.push_back(value);
    begin = end + 1;
  }
  return out;
}

}  // namespace moekit::cli

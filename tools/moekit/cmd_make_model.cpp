// moekit make-model: writes a random MoE checkpoint (for demos and benchmarks) in Hugging Face's layout.
#include <cstdio>
#include <string>

#include "moekit/commands.h"
#include "moekit/model.h"

namespace moekit::cli {
namespace {

struct MakeModelOptions {
  std::string out;
  std::string preset = "tiny";
  int64_t layers = 0;
  std::string dtype = "bf16";
  uint64_t seed = 0;
};

}  // namespace

void add_make_model_command(CLI::App& app) {
  auto o = std::make_shared<MakeModelOptions>();
  std::string presets;
  for (const auto& [name, description] : random_model_presets()) presets += "\n  " + name + ": " + description;
  CLI::App* cmd = app.add_subcommand("make-model", "Write a random qwen3_moe checkpoint. Presets:" + presets);
  cmd->add_option("--out", o->out, "Output directory")->required();
  cmd->add_option("--preset", o->preset, "Sizes")->capture_default_str();
  cmd->add_option("--layers", o->layers, "Decoder layers (0 = the preset's)")->capture_default_str();
  cmd->add_option("--dtype", o->dtype, "f32, f16 or bf16")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the weights")->capture_default_str();
  cmd->callback([o]() {
    write_random_model(o->out, {.preset = o->preset, .layers = o->layers, .dtype = parse_dtype(o->dtype),
                                .seed = o->seed, .progress = true});
    std::fprintf(stderr, "wrote %s\n", o->out.c_str());
  });
}

}  // namespace moekit::cli

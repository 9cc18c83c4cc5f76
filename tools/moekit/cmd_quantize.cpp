// moekit quantize: writes a copy of a float checkpoint with its expert weights block-quantised (FP8 / FP4).
#include <cstdio>
#include <string>

#include "moekit/commands.h"
#include "moekit/model.h"

namespace moekit::cli {
namespace {

struct QuantizeCommandOptions {
  std::string model;
  std::string out;
  std::string format = "fp8";
};

}  // namespace

void add_quantize_command(CLI::App& app) {
  auto o = std::make_shared<QuantizeCommandOptions>();
  CLI::App* cmd = app.add_subcommand(
      "quantize",
      "Write a copy of a bf16/f32 checkpoint with its expert weights block-quantised as transformers' "
      "\"fp8\" checkpoints store them (F8_E4M3 + weight_scale_inv)");
  cmd->add_option("--model", o->model, "Checkpoint directory to read")->required();
  cmd->add_option("--out", o->out, "Directory to write (must not hold a config.json)")->required();
  cmd->add_option("--format", o->format,
                  "fp8 (float32 scales per 128x128 block), fp8-ue8m0 (power-of-two scales), fp4 (e2m1, ue8m0 "
                  "scales per 32 values)")
      ->capture_default_str();
  cmd->callback([o]() {
    quantize_checkpoint(o->model, o->out, {.format = o->format, .progress = true});
    std::fprintf(stderr, "wrote %s (%s experts)\n", o->out.c_str(), o->format.c_str());
  });
}

}  // namespace moekit::cli

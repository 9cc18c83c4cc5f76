// moekit forward: logits [T, vocab] float32 for given token ids, written to a safetensors file (the
// form the model fixtures compare against).
#include <cstdio>
#include <string>

#include "moekit/commands.h"
#include "moekit/model.h"
#include "moekit/safetensors.h"
#include "model_options.h"

namespace moekit::cli {
namespace {

struct ForwardOptions {
  ModelOptions model;
  std::string tokens;
  std::string output;
};

void run_forward(const ForwardOptions& o) {
  const std::string dir = resolve_model_dir(o.model);
  const std::vector<int32_t> tokens = parse_token_list(o.tokens, "--tokens");
  CausalLM model = CausalLM::from_pretrained(dir, load_options(o.model));
  const Tensor logits = model.forward(tokens);
  save_safetensors(o.output, {{"logits", logits}}, {{"model", dir}, {"model_type", model.model_type()}});
  std::fprintf(stderr, "wrote logits [%lld, %lld] float32 to %s (%s)\n", static_cast<long long>(logits.size(0)),
               static_cast<long long>(logits.size(1)), o.output.c_str(), model.describe().c_str());
}

}  // namespace

void add_forward_command(CLI::App& app) {
  auto options = std::make_shared<ForwardOptions>();
  CLI::App* cmd = app.add_subcommand("forward", "Write a checkpoint's logits for token ids to a safetensors file");
  add_model_options(cmd, options->model);
  cmd->add_option("--tokens", options->tokens, "Token ids, e.g. 1,2,3")->required();
  cmd->add_option("--output", options->output, "Output safetensors file (tensor \"logits\" [T, vocab] f32)")
      ->required();
  cmd->callback([options]() { run_forward(*options); });
}

}  // namespace moekit::cli

// moekit generate: loads a checkpoint (or writes and loads the built-in random model), encodes the
// prompt with the checkpoint's tokenizer.json, generates, streams the text, and reports tokens/s of
// prefill and decode, the experts backends of each phase and whether decode replayed a CUDA graph.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "moekit/commands.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/tokenizer.h"
#include "model_options.h"

namespace moekit::cli {
namespace {

struct GenerateOptions {
  ModelOptions model;
  std::string prompt = "The experts of a mixture";
  std::string prompt_tokens;
  GenerationConfig generation;
  bool raw = false;         // print token ids instead of text
  bool ignore_eos = false;  // no default stop token (benchmarks: always max_new_tokens)
  int64_t warmup = 0;       // untimed generations first (benchmarks)
};

void run_generate(const GenerateOptions& o) {
  const std::string dir = resolve_model_dir(o.model);
  const auto load_start = std::chrono::steady_clock::now();
  CausalLM model = CausalLM::from_pretrained(dir, load_options(o.model));
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  std::fprintf(stderr, "model: %s (%s, loaded in %.2f s)\n", dir.c_str(), model.describe().c_str(), load_seconds);

  const bool has_tokenizer = std::filesystem::exists(std::filesystem::path(dir) / "tokenizer.json");
  std::optional<Tokenizer> tokenizer;
  if (has_tokenizer) tokenizer = Tokenizer::from_directory(dir);
  std::vector<int32_t> prompt;
  if (!o.prompt_tokens.empty()) {
    prompt = parse_token_list(o.prompt_tokens, "--prompt-tokens");
  } else {
    MOEKIT_CHECK(tokenizer.has_value(), dir, " has no tokenizer.json: give the prompt as --prompt-tokens 1,2,3");
    prompt = tokenizer->encode(o.prompt);
    MOEKIT_CHECK(!prompt.empty(), "the prompt encodes to no tokens");
  }

  GenerationConfig g = o.generation;
  if (g.stop_tokens.empty() && !o.ignore_eos && tokenizer && tokenizer->eos_token_id())
    g.stop_tokens = {*tokenizer->eos_token_id()};
  std::optional<DecodeStream> stream;
  const bool print_text = tokenizer.has_value() && !o.raw;
  if (print_text) {
    stream.emplace(*tokenizer, true);
    std::printf("%s", o.prompt_tokens.empty() ? o.prompt.c_str() : tokenizer->decode(prompt).c_str());
  }
  g.on_token = [&](int32_t token) {
    if (print_text) {
      std::printf("%s", stream->step(token).c_str());
    } else {
      std::printf("%d ", token);
    }
    std::fflush(stdout);
  };
  if (o.warmup > 0) {
    // One-time work (packing expert weights on the CPU, the first allocations on a GPU) stays out of
    // the timed run.
    GenerationConfig quiet = g;
    quiet.on_token = nullptr;
    for (int64_t i = 0; i < o.warmup; ++i) model.generate(prompt, quiet);
  }
  const GenerationResult r = model.generate(prompt, g);
  if (print_text) std::printf("%s", stream->finish().c_str());
  std::printf("\n");

  auto rate = [](int64_t tokens, double seconds) { return seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0; };
  std::fprintf(stderr, "prefill: %lld tokens in %.6f s (%.1f tokens/s), experts %s\n",
               static_cast<long long>(r.prefill_tokens), r.prefill_seconds, rate(r.prefill_tokens, r.prefill_seconds),
               experts_implementation_text(r.prefill_backends).c_str());
  const std::string graph = r.decode_graph               ? "on"
                            : !o.generation.decode_graph ? "off (--no-decode-graph)"
                                                         : "off (" + r.decode_graph_reason + ")";
  std::fprintf(stderr, "decode:  %lld tokens in %.6f s (%.1f tokens/s), experts %s, decode graph %s\n",
               static_cast<long long>(r.decode_tokens), r.decode_seconds, rate(r.decode_tokens, r.decode_seconds),
               r.decode_backends.empty() ? "(no decode step)" : experts_implementation_text(r.decode_backends).c_str(),
               graph.c_str());
  std::fprintf(stderr, "stopped: %s after %zu new tokens\n", r.stop_reason.c_str(), r.tokens.size());
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "generate", "Generate text with a Hugging Face MoE checkpoint (without --model: the built-in random model)");
  add_model_options(cmd, options->model);
  cmd->add_option("--prompt", options->prompt, "Prompt text (encoded with the checkpoint's tokenizer.json)")
      ->capture_default_str();
  cmd->add_option("--prompt-tokens", options->prompt_tokens, "Prompt as token ids, e.g. 1,2,3 (instead of --prompt)");
  cmd->add_option("--max-new-tokens", options->generation.max_new_tokens, "Tokens to generate at most")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--do-sample", options->generation.do_sample, "Sample instead of greedy decoding");
  cmd->add_option("--temperature", options->generation.temperature, "Sampling temperature")->capture_default_str();
  cmd->add_option("--top-k", options->generation.top_k, "Sample among the k most likely tokens (0 = all)")
      ->capture_default_str();
  cmd->add_option("--top-p", options->generation.top_p, "Sample among the most likely tokens of this mass")
      ->capture_default_str();
  cmd->add_option("--seed", options->generation.seed, "Sampling seed")->capture_default_str();
  cmd->add_option("--stop-tokens", options->generation.stop_tokens,
                  "Token ids that end generation (default: the tokenizer's end-of-sequence token)")
      ->delimiter(',');
  cmd->add_flag("--raw", options->raw, "Print token ids instead of text");
  cmd->add_flag("!--no-decode-switch", options->generation.decode_phase_switch,
                "On a GPU, keep grouped_mm for decode instead of switching to batched_mm");
  cmd->add_flag("!--no-decode-graph", options->generation.decode_graph,
                "On a GPU, launch every decode step's kernels instead of replaying one captured CUDA graph");
  cmd->add_flag("--ignore-eos", options->ignore_eos, "Do not stop at the tokenizer's end-of-sequence token");
  cmd->add_option("--warmup", options->warmup, "Untimed generations before the timed one (benchmarks)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->callback([options]() { run_generate(*options); });
}

}  // namespace moekit::cli

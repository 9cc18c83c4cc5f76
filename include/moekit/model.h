// The model runtime: Hugging Face MoE checkpoints (qwen2_moe, qwen3_moe, mixtral, olmoe, deepseek_v3, gpt_oss,
// and the language model of qwen3_vl_moe, text only) loaded from their directory, run as decoder-only
// language models with a KV cache, and generating text. The experts of every MoE layer run through a named experts
// backend (see experts.h), chosen per backbone when loading and switched at run time, as transformers'
// experts_implementation.
//
//   auto model = moekit::CausalLM::from_pretrained("Qwen3-30B-A3B", {.experts_implementation = "grouped_mm"});
//   auto out = model.generate(prompt_ids, {.max_new_tokens = 64});
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moekit/tensor.h"

namespace moekit {

struct LoadOptions {
  // f32, f16 or bf16; absent: the checkpoint's own (config.json's dtype / torch_dtype, else the dtype
  // of its embedding table).
  std::optional<DType> dtype;
  Device device = Device::cpu();
  // One backend name for every backbone, or a JSON object {"": name, "<sub-config>": name}.
  std::string experts_implementation = "grouped_mm";
  // A progress line on stderr while loading large checkpoints, and one line naming what was skipped on
  // purpose (a vision-language checkpoint's vision tower: describe() says it too).
  bool progress = true;
  // Pre-quantised checkpoints (config.json quantization_config, transformers' "fp8" method): false keeps
  // the experts FP8 / FP4 (run by the CPU batched_mm, grouped_mm and eager; on CUDA FP8 by batched_mm,
  // and on Hopper by deepgemm and grouped_mm with H and I multiples of 128; other CUDA backends and FP4
  // refuse them with a reason); true dequantises them to the model's dtype at load so that every backend
  // runs them.
  // FP8 experts whose intermediate size is not a multiple of 128 are always dequantised (their gate and
  // up rows do not share scale blocks once fused). Quantised dense linears are always dequantised.
  bool dequantize = false;
};

struct GenerationConfig {
  int64_t max_new_tokens = 32;
  bool do_sample = false;  // false: greedy (the first largest logit)
  float temperature = 1.0f;
  int64_t top_k = 0;    // 0: off
  float top_p = 1.0f;   // 1: off
  uint64_t seed = 0;    // sampling is reproducible for one seed
  std::vector<int32_t> stop_tokens;  // generation ends after producing one of these
  // On a GPU, run the decode phase of grouped_mm backbones with batched_mm (false: keep grouped_mm).
  bool decode_phase_switch = true;
  // On a GPU, capture one decode step into a CUDA graph and replay it for every later token, instead of
  // launching each step's kernels from the host (false: launch them). Outputs are bitwise the same either
  // way. Where a step cannot be captured (an experts backend that synchronises, such as eager; DeepSeek-V3's
  // latent attention) generation launches the kernels and GenerationResult says why.
  bool decode_graph = true;
  // Keep the float32 logits each new token was chosen from: GenerationResult::logits.
  bool output_logits = false;
  // Called with each new token as it is produced (streaming); may be empty.
  std::function<void(int32_t)> on_token;
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // the new tokens only
  std::string stop_reason;      // "stop token" | "max new tokens"
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  // The experts backend of each backbone during each phase (get_experts_implementation's form).
  std::map<std::string, std::string> prefill_backends, decode_backends;
  // Whether decode steps replayed a captured CUDA graph; if not, why not.
  bool decode_graph = false;
  std::string decode_graph_reason;
  // With GenerationConfig::output_logits: float32 [tokens.size(), vocab] on the host, row i the logits
  // token i was chosen from.
  Tensor logits;
};

// {"": "grouped_mm", "text_config": "eager"} as one line: "": grouped_mm, text_config: eager.
std::string experts_implementation_text(const std::map<std::string, std::string>& backends);

class CausalLM {
 public:
  // Reads dir/config.json and its safetensors; every error names the file, key or tensor. A tensor the
  // model does not use is an error, except a vision-language model's vision tower (model.visual.*), which
  // is skipped: only text tokens are run.
  static CausalLM from_pretrained(const std::string& dir, const LoadOptions& options = {});

  CausalLM(CausalLM&&) noexcept;
  CausalLM& operator=(CausalLM&&) noexcept;
  ~CausalLM();

  // One backend for every backbone, or per backbone ("" = the top level); unknown backends or
  // backbones throw listing the valid ones and change nothing.
  void set_experts_implementation(const std::string& name_or_json);
  void set_experts_implementation(const std::map<std::string, std::string>& per_backbone);
  std::map<std::string, std::string> get_experts_implementation() const;

  // Logits [T, vocab] float32 for the token ids, from an empty cache.
  Tensor forward(std::span<const int32_t> tokens);
  // Prefill with the prompt, then decode one token at a time. On a GPU, backbones running grouped_mm
  // run batched_mm for the decode phase and get grouped_mm back afterwards (also on error), and the
  // decode steps replay one captured CUDA graph (GenerationConfig::decode_graph), which the model keeps
  // for later calls while the decode backends and the cache buffers stay the same. The KV cache holds
  // every position of the generation from the start (on a GPU its buffers are kept between calls and
  // grow when a generation needs more).
  GenerationResult generate(std::span<const int32_t> prompt, const GenerationConfig& config);

  // The experts backend each MoE layer ran in the last forward step, in layer order (for tests and
  // reports).
  const std::vector<std::string>& last_step_backends() const;

  const std::string& model_type() const;
  DType dtype() const;
  Device device() const;
  int64_t vocab_size() const;
  int64_t num_layers() const;
  std::string describe() const;  // one line: type, sizes, dtype, device, backends

 private:
  struct Impl;
  explicit CausalLM(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Random checkpoints for demos, tests and benchmarks (qwen3_moe, written as transformers writes one:
// config.json, model.safetensors with per-expert tensors, and a byte-level tokenizer.json of 256 byte
// tokens plus <|endoftext|>, <|im_start|>, <|im_end|>). The same spec and seed give the same bytes.
struct RandomModelSpec {
  std::string preset = "tiny";  // see random_model_presets()
  int64_t layers = 0;           // 0: the preset's
  DType dtype = DType::bf16;
  uint64_t seed = 0;
  bool progress = false;        // a progress line on stderr
};
std::vector<std::pair<std::string, std::string>> random_model_presets();  // (name, description)
void write_random_model(const std::string& dir, const RandomModelSpec& spec);

// Writes a copy of the float checkpoint in src_dir (f32, f16 or bf16; single file or sharded) to dst_dir
// with its per-expert weights ("...experts.{i}.gate_proj/up_proj/down_proj.weight", Mixtral's w1/w3/w2)
// block-quantised as transformers' FP8 checkpoints store them: each weight as F8_E4M3 [N, K] with
// "<name>_scale_inv" float32 [ceil(N/128), ceil(K/128)], and config.json's quantization_config
// {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
// "modules_to_not_convert": [every other linear]}. Formats: "fp8"; "fp8-ue8m0" (power-of-two scales,
// "scale_fmt": "ue8m0"); "fp4" (moekit's variant, "expert_dtype": "fp4": F4 e2m1 weights, F8_E8M0 scales
// [N, ceil(K/32)]). Every other tensor is copied as it is into one model.safetensors; the other files
// (tokenizer, generation config) are copied. Refuses an already quantised checkpoint and a dst_dir that
// holds a config.json.
struct QuantizeOptions {
  std::string format = "fp8";  // fp8 | fp8-ue8m0 | fp4
  bool progress = true;        // a progress line on stderr
};
void quantize_checkpoint(const std::string& src_dir, const std::string& dst_dir, const QuantizeOptions& options = {});

}  // namespace moekit

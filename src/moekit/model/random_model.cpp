// Random MoE checkpoints written in Hugging Face's layout (config.json, model.safetensors with
// per-expert tensors as transformers saves them, a byte-level tokenizer.json), deterministic from a
// seed. They load through from_pretrained like any downloaded checkpoint, and transformers loads them
// too, so the benchmarks can run both on the same model.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moekit/checked_math.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/testing/random_problem.h"
#include "moekit/safetensors.h"
#include "moekit/model/weight_reader.h"

namespace moekit {
namespace {

using json = nlohmann::json;

struct Preset {
  const char* name;
  const char* description;
  int64_t vocab, hidden, layers, heads, kv_heads, head_dim, experts, top_k, moe_intermediate;
  double rope_theta;
};

// The byte-level tokenizer has 256 byte tokens and three special tokens: vocab 259 for the small model.
constexpr int64_t kByteTokens = 256;
constexpr const char* kSpecialTokens[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};

constexpr Preset kPresets[] = {
    {"tiny", "a small qwen3_moe (4 layers, hidden 256, 16 experts top-4) with a byte-level tokenizer", 259, 256, 4, 4,
     2, 64, 16, 4, 128, 10000.0},
    {"qwen3-30b-a3b", "Qwen3-30B-A3B's sizes (hidden 2048, 128 experts top-8, I 768, vocab 151936), 2 layers", 151936,
     2048, 2, 32, 4, 128, 128, 8, 768, 1e6},
};

const Preset& find_preset(const std::string& name) {
  std::string names;
  for (const Preset& p : kPresets) {
    if (name == p.name) return p;
    names += (names.empty() ? "" : ", ") + std::string(p.name);
  }
  MOEKIT_FAIL("random model: unknown preset '", name, "'; presets: ", names);
}

// GPT-2's byte-to-character map of byte-level BPE: printable bytes stand for themselves, the others
// for the characters from U+0100 on, so that every token is printable text.
std::string byte_token(int byte) {
  const bool printable = (byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || (byte >= 174 && byte <= 255);
  int code = byte;
  if (!printable) {
    int shifted = 0;
    for (int b = 0; b < byte; ++b)
      if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))) ++shifted;
    code = 256 + shifted;
  }
  std::string out;
  if (code < 0x80) {
    out += static_cast<char>(code);
  } else {
    out += static_cast<char>(0xC0 | (code >> 6));
    out += static_cast<char>(0x80 | (code & 0x3F));
  }
  return out;
}

json byte_level_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < kByteTokens; ++b) vocab[byte_token(b)] = b;
  json added = json::array();
  int id = kByteTokens;
  for (const char* special : kSpecialTokens) {
    vocab[special] = id;
    added.push_back({{"id", id++}, {"content", special}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  }
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                           {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
            {"ignore_merges", false}, {"vocab", vocab}, {"merges", json::array()}}}};
}

}  // namespace

std::vector<std::pair<std::string, std::string>> random_model_presets() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Preset& p : kPresets) out.emplace_back(p.name, p.description);
  return out;
}

void write_random_model(const std::string& dir, const RandomModelSpec& spec) {
  const Preset& p = find_preset(spec.preset);
  MOEKIT_CHECK(is_floating(spec.dtype), "random model: dtype must be f32, f16 or bf16, got ", dtype_name(spec.dtype));
  MOEKIT_CHECK(spec.layers >= 0, "random model: layers must be >= 0 (0 = the preset's), got ", spec.layers);
  const int64_t layers = spec.layers > 0 ? spec.layers : p.layers;
  const int64_t H = p.hidden, V = p.vocab, E = p.experts, I = p.moe_intermediate, hd = p.head_dim;
  // Every tensor is held until the file is written, so a layer count past memory is refused up front.
  const int64_t layer_values = 2 * H + 2 * (p.heads + p.kv_heads) * hd * H + 2 * hd + E * H + 3 * E * I * H;
  const std::string what = "make-model: a random " + std::string(p.name) + " model of " + std::to_string(layers) + " layers";
  const int64_t values = checked_add(checked_mul(layers, layer_values, what), 2 * V * H + H, what);
  require_memory(Device::cpu(), static_cast<std::size_t>(checked_mul(values, static_cast<int64_t>(dtype_size(spec.dtype)), what)),
                 what + " in " + std::string(dtype_name(spec.dtype)));
  namespace fs = std::filesystem;
  fs::create_directories(dir);

  const char* dtype_text = spec.dtype == DType::bf16 ? "bfloat16" : spec.dtype == DType::f16 ? "float16" : "float32";
  const json config = {{"architectures", {"Qwen3MoeForCausalLM"}},
                       {"model_type", "qwen3_moe"},
                       {"vocab_size", V},
                       {"hidden_size", H},
                       {"intermediate_size", 3 * H},
                       {"moe_intermediate_size", I},
                       {"num_hidden_layers", layers},
                       {"num_attention_heads", p.heads},
                       {"num_key_value_heads", p.kv_heads},
                       {"head_dim", hd},
                       {"num_experts", E},
                       {"num_experts_per_tok", p.top_k},
                       {"norm_topk_prob", true},
                       {"decoder_sparse_step", 1},
                       {"mlp_only_layers", json::array()},
                       {"hidden_act", "silu"},
                       {"rms_norm_eps", 1e-6},
                       {"rope_theta", p.rope_theta},
                       {"max_position_embeddings", 32768},
                       {"attention_bias", false},
                       {"tie_word_embeddings", false},
                       {"use_sliding_window", false},
                       {"bos_token_id", nullptr},
                       {"eos_token_id", kByteTokens},
                       {"dtype", dtype_text},
                       {"moekit_random_model", {{"preset", p.name}, {"seed", spec.seed}}}};
  std::ofstream(fs::path(dir) / "config.json") << config.dump(2) << "\n";
  std::ofstream(fs::path(dir) / "tokenizer.json") << byte_level_tokenizer().dump() << "\n";

  // Weights ~ U(-a, a) with a = sqrt(3 / fan_in) (unit variance through each projection); norm weights 1.
  std::vector<std::pair<std::string, Tensor>> tensors;
  uint64_t stream = spec.seed * 0x9e3779b97f4a7c15ull + 1;
  auto add = [&](const std::string& name, Shape shape, double fan_in) {
    Tensor t = Tensor::empty(std::move(shape), spec.dtype);
    fill_uniform(t, static_cast<float>(std::sqrt(3.0 / fan_in)), stream++);
    tensors.emplace_back(name, std::move(t));
  };
  auto add_ones = [&](const std::string& name, int64_t n) {
    Tensor t = Tensor::empty({n}, spec.dtype);
    visit_float_dtype(spec.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      std::fill(t.data_as<T>(), t.data_as<T>() + n, from_float<T>(1.0f));
    });
    tensors.emplace_back(name, std::move(t));
  };
  add("model.embed_tokens.weight", {V, H}, 3.0);  // unit-range embeddings
  add("lm_head.weight", {V, H}, static_cast<double>(H));
  add_ones("model.norm.weight", H);
  for (int64_t l = 0; l < layers; ++l) {
    if (spec.progress) std::fprintf(stderr, "\rwriting random model %s: layer %lld/%lld", p.name,
                                    static_cast<long long>(l + 1), static_cast<long long>(layers));
    const std::string q = "model.layers." + std::to_string(l) + ".";
    add_ones(q + "input_layernorm.weight", H);
    add_ones(q + "post_attention_layernorm.weight", H);
    add(q + "self_attn.q_proj.weight", {p.heads * hd, H}, static_cast<double>(H));
    add(q + "self_attn.k_proj.weight", {p.kv_heads * hd, H}, static_cast<double>(H));
    add(q + "self_attn.v_proj.weight", {p.kv_heads * hd, H}, static_cast<double>(H));
    add(q + "self_attn.o_proj.weight", {H, p.heads * hd}, static_cast<double>(p.heads * hd));
    add_ones(q + "self_attn.q_norm.weight", hd);
    add_ones(q + "self_attn.k_norm.weight", hd);
    add(q + "mlp.gate.weight", {E, H}, static_cast<double>(H) / 4.0);  // wider router logits: a clear top-k
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = q + "mlp.experts." + std::to_string(e) + ".";
      add(x + "gate_proj.weight", {I, H}, static_cast<double>(H));
      add(x + "up_proj.weight", {I, H}, static_cast<double>(H));
      add(x + "down_proj.weight", {H, I}, static_cast<double>(I));
    }
  }
  if (spec.progress) std::fprintf(stderr, "\n");
  save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors,
                   {{"format", "pt"}, {"moekit_random_model", p.name}});
}

}  // namespace moekit

// moekit quantize: a float checkpoint's per-expert weights block-quantised into transformers' FP8 layout
// (see quantize_checkpoint in model.h). The quantisation itself is quantize_weights (quantization.h), so a
// checkpoint written here loads back to exactly quantize -> dequantize of the original weights.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/model/checkpoint.h"
#include "moekit/quantization.h"
#include "moekit/safetensors.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;

// The checkpoint files rewritten here; every other regular file (tokenizer...) is copied.
bool is_rewritten(const std::string& file) {
  return file == "config.json" || file == "model.safetensors.index.json" || file.ends_with(".safetensors");
}

// Whether name is one expert's matrix: "...experts.{i}.<gate_proj|up_proj|down_proj|w1|w2|w3>.weight".
bool is_expert_weight(std::string_view name) {
  const std::size_t at = name.rfind(".experts.");
  if (at == std::string_view::npos) return false;
  std::string_view rest = name.substr(at + 9);
  const std::size_t dot = rest.find('.');
  if (dot == 0 || dot == std::string_view::npos ||
      rest.substr(0, dot).find_first_not_of("0123456789") != std::string_view::npos)
    return false;
  rest = rest.substr(dot + 1);
  for (std::string_view matrix :
       {"gate_proj.weight", "up_proj.weight", "down_proj.weight", "w1.weight", "w2.weight", "w3.weight"})
    if (rest == matrix) return true;
  return false;
}

}  // namespace

void quantize_checkpoint(const std::string& src_dir, const std::string& dst_dir, const QuantizeOptions& options) {
  const std::string& f = options.format;
  MOEKIT_CHECK(f == "fp8" || f == "fp8-ue8m0" || f == "fp4", "quantize: unknown format '", f,
               "'; valid formats: fp8, fp8-ue8m0, fp4");
  const WeightFormat format = f == "fp4" ? WeightFormat::fp4_e2m1 : WeightFormat::fp8_e4m3;
  const bool power_of_two = f != "fp8";
  const Checkpoint src(src_dir);
  MOEKIT_CHECK(!src.config().contains("quantization_config"), "quantize: ", src_dir,
               "/config.json already has a quantization_config: the checkpoint is quantised");
  std::error_code ec;
  MOEKIT_CHECK(fs::weakly_canonical(src_dir, ec) != fs::weakly_canonical(dst_dir, ec),
               "quantize: the output directory is the input directory (", dst_dir, ")");
  MOEKIT_CHECK(!fs::exists(fs::path(dst_dir) / "config.json"), "quantize: ", dst_dir,
               " already holds a config.json; choose an empty output directory");
  fs::create_directories(dst_dir, ec);
  MOEKIT_CHECK(!ec, "quantize: cannot create ", dst_dir, ": ", ec.message());

  const std::vector<std::string> names = src.tensor_names();
  std::size_t experts_total = 0;
  for (const auto& name : names) experts_total += is_expert_weight(name) ? 1 : 0;
  MOEKIT_CHECK(experts_total > 0, "quantize: ", src_dir, " has no per-expert weights (",
               "...experts.{i}.gate_proj/up_proj/down_proj.weight or w1/w2/w3.weight) to quantise");
  const bool live = options.progress && isatty(STDERR_FILENO) == 1;

  std::vector<std::pair<std::string, Tensor>> tensors;
  nlohmann::json not_converted = nlohmann::json::array();
  std::size_t done = 0;
  for (const auto& name : names) {
    Tensor t = src.tensor(name);
    if (!is_expert_weight(name)) {
      // transformers would quantise any other nn.Linear of an "fp8" checkpoint: name them as kept.
      if (t.dim() == 2 && name.ends_with(".weight") && name.find("norm") == std::string::npos)
        not_converted.push_back(name.substr(0, name.size() - 7));
      tensors.emplace_back(name, std::move(t));
      continue;
    }
    MOEKIT_CHECK(t.dim() == 2 && is_floating(t.dtype()), "quantize: ", name, " is ", t.describe(),
                 "; expert weights to quantise must be f32, f16 or bf16 matrices");
    const int64_t N = t.size(0), K = t.size(1);
    MOEKIT_CHECK(format != WeightFormat::fp4_e2m1 || K % 2 == 0, "quantize: ", name, " has ", K,
                 " columns; fp4 packs pairs along K, so it needs an even number");
    QuantizedWeights q = quantize_weights(t.reshape({1, N, K}), format, power_of_two ? DType::ue8m0 : DType::f32);
    const Tensor weights = q.weights.reshape({q.weights.size(1), q.weights.size(2)});
    Tensor scales = q.scale_inv.reshape({q.scale_inv.size(1), q.scale_inv.size(2)});
    // FP8 checkpoints store float32 scales (DeepSeek-V3.1's ue8m0 ones too, as powers of two); FP4's are F8_E8M0.
    if (format == WeightFormat::fp8_e4m3 && scales.dtype() == DType::ue8m0) {
      Tensor as_float = Tensor::empty(scales.shape(), DType::f32);
      for (int64_t i = 0; i < scales.numel(); ++i) as_float.data_as<float>()[i] = to_float(scales.data_as<ue8m0>()[i]);
      scales = as_float;
    }
    tensors.emplace_back(name, weights);
    tensors.emplace_back(name + "_scale_inv", scales);
    ++done;
    if (live) std::fprintf(stderr, "\rquantizing experts to %s: %zu/%zu", f.c_str(), done, experts_total);
  }
  if (options.progress)
    std::fprintf(stderr, "%squantizing experts to %s: %zu/%zu, writing %s\n", live ? "\r" : "", f.c_str(), done,
                 experts_total, dst_dir.c_str());
  save_safetensors((fs::path(dst_dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});

  nlohmann::json config = src.config();
  nlohmann::json quantization = {{"quant_method", "fp8"},
                                 {"activation_scheme", "dynamic"},
                                 {"weight_block_size", {kFp8BlockSize, kFp8BlockSize}},
                                 {"modules_to_not_convert", not_converted}};
  if (f == "fp8-ue8m0") quantization["scale_fmt"] = "ue8m0";
  if (f == "fp4") quantization["expert_dtype"] = "fp4";
  config["quantization_config"] = quantization;
  {
    std::ofstream out(fs::path(dst_dir) / "config.json", std::ios::binary);
    out << config.dump(2) << "\n";
    MOEKIT_CHECK(out.good(), "quantize: cannot write ", dst_dir, "/config.json");
  }
  for (const auto& entry : fs::directory_iterator(src_dir)) {
    const std::string file = entry.path().filename().string();
    if (!entry.is_regular_file() || is_rewritten(file)) continue;
    fs::copy_file(entry.path(), fs::path(dst_dir) / file, fs::copy_options::overwrite_existing, ec);
    MOEKIT_CHECK(!ec, "quantize: cannot copy ", entry.path().string(), " to ", dst_dir, ": ", ec.message());
  }
}

}  // namespace moekit

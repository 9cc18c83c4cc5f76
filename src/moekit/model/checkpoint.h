// A Hugging Face checkpoint directory: config.json and its safetensors (one file, or shards listed by
// model.safetensors.index.json), memory-mapped and checked once when opened. Tensors come out as
// read-only views of the mapped bytes unless a dtype conversion or an expert fusion has to copy them.
//
// Every error is a moekit::Error naming the file, the key or the tensor, and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/quantization.h"
#include "moekit/safetensors.h"
#include "moekit/tensor.h"

namespace moekit {

// One MoE layer's expert weights in the layout the experts backends take (ExpertsConfig defaults:
// gated, concatenated, not transposed): gate_up_proj [E, 2I, H] holds the gate rows [0, I) then the
// up rows [I, 2I); down_proj [E, H, I]. The biases are undefined tensors unless the checkpoint has them.
struct FusedExperts {
  Tensor gate_up_proj;
  Tensor down_proj;
  Tensor gate_up_proj_bias;  // [E, 2I]
  Tensor down_proj_bias;     // [E, H]
  // Quantised experts (quantized_experts): FP8 [E, ceil(2I/128), ceil(H/128)] and [E, ceil(H/128),
  // ceil(I/128)]; FP4 [E, 2I, ceil(H/32)] and [E, H, ceil(I/32)]; undefined otherwise.
  Tensor gate_up_proj_scale_inv;
  Tensor down_proj_scale_inv;
  bool has_gate = true;
};

class Checkpoint {
 public:
  // Reads dir/config.json and opens dir/model.safetensors or, if there is none, the shards named by
  // dir/model.safetensors.index.json (the single file wins when both exist, as in transformers).
  // The index must be consistent: every tensor of its weight map listed once and held by its shard,
  // no tensor held by two shards, shard names relative and inside dir. Tensors a shard holds that the
  // weight map does not list are not visible.
  explicit Checkpoint(const std::string& dir);

  const std::string& directory() const { return dir_; }

  const nlohmann::json& config() const { return config_; }
  // The object config[name] ("text_config", "vision_config"); throws listing sub_config_names().
  const nlohmann::json& sub_config(std::string_view name) const;
  // Keys of config whose value is an object that holds "model_type" or whose key ends in "_config".
  std::vector<std::string> sub_config_names() const;  // sorted

  bool contains(const std::string& name) const { return shard_of_.count(name) != 0; }
  std::vector<std::string> tensor_names() const;  // sorted
  // The mapped view (read-only bytes). A missing name throws suggesting up to 3 close names.
  Tensor tensor(const std::string& name) const;
  // Its dtype, shape and bytes as the header gives them, with nothing read.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  // Also checks the shape: "<name> has shape [..], expected [..]". For F4 tensors the shape counts packed
  // pairs (see SafetensorsFile::tensor).
  Tensor tensor(const std::string& name, const Shape& expected) const;
  // A contiguous CPU tensor in dtype (f32, f16 or bf16): the mapped view itself when the file already
  // holds that dtype, a converted copy otherwise. An empty `expected` skips the shape check (so a
  // scalar's shape cannot be checked here).
  // An f8_e4m3 matrix [N, K] with its block scales "<name>_scale_inv" (float [ceil(N/128), ceil(K/128)], as
  // transformers' FP8 checkpoints quantise dense linears) is dequantised to dtype: the model's dense ops
  // have no FP8 path. A missing or misshapen scale throws naming it.
  Tensor load(const std::string& name, DType dtype, const Shape& expected = {}) const;

  // The experts of one MoE layer under prefix ("model.layers.3.mlp.experts"), in dtype, recognising:
  //   fused:     {prefix}.gate_up_proj [E, 2I, H], {prefix}.down_proj [E, H, I], optional
  //              {prefix}.gate_up_proj_bias [E, 2I], {prefix}.down_proj_bias [E, H]; no copy if the
  //              dtype matches; or stored transposed, [E, H, 2I] and [E, I, H] (Qwen3-VL-MoE's
  //              published checkpoints; H != I), transposed into the layout above on load;
  //   per expert {prefix}.{i}.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]
  //              (Qwen, OLMoE, DeepSeek);
  //   per expert {prefix}.{i}.w1.weight (gate) [I, H], .w3.weight (up) [I, H], .w2.weight (down) [H, I]
  //              (Mixtral).
  // Per-expert weights are copied into new fused tensors (in parallel over experts, with a progress
  // line on stderr for copies over 256 MB). A missing or misshapen tensor, an expert index >= E, or
  // tensors of two layouts under one prefix throw naming the tensor.
  FusedExperts experts(const std::string& prefix, int64_t num_experts, int64_t hidden, int64_t intermediate,
                       DType dtype) const;

  // Pre-quantised per-expert weights (gate_proj/up_proj/down_proj or w1/w3/w2, each ".weight" with its
  // ".weight_scale_inv"), as transformers' FP8 checkpoints (DeepSeek-V3's layout) store them:
  //   FP8: weight F8_E4M3 [N, K], scale float32 (or F8_E8M0) [ceil(N/128), ceil(K/128)];
  //   FP4: weight F4 [N, K] (packed pairs: [N, K/2] here), scale F8_E8M0 (or float32 powers of two)
  //        [N, ceil(K/32)].
  // Fused into the layout of ExpertsProblem: gate_up [E, 2I, H] (gate rows, then up rows) and down
  // [E, H, I] with their scale_inv tensors, in ue8m0 when ue8m0_scales (FP4 always; float32 scales
  // that are not powers of two then throw, naming the tensor), else float32. FP8 gate and up rows share
  // 128-row scale blocks only when I is a multiple of 128, so otherwise this throws: load with
  // dequantize_to instead. With dequantize_to (f32, f16, bf16) each matrix is dequantised and fused like
  // experts() does, for any I; the scales are then undefined. Missing or misshapen tensors throw naming
  // them.
  FusedExperts quantized_experts(const std::string& prefix, int64_t num_experts, int64_t hidden, int64_t intermediate,
                                 WeightFormat format, bool ue8m0_scales,
                                 std::optional<DType> dequantize_to = std::nullopt) const;

 private:
  [[noreturn]] void fail_missing(const std::string& name) const;
  const SafetensorsFile& shard(const std::string& name) const;

  std::string dir_;
  nlohmann::json config_;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, std::size_t> shard_of_;  // tensor name -> index into shards_
};

}  // namespace moekit

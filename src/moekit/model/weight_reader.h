// How the model runtime reads a checkpoint's weights: every tensor through one reader, which records what
// was used so that leftovers can be reported, and which estimates from the headers alone what the
// weights will take once loaded, so that a model that cannot fit is refused before anything is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moekit/model/checkpoint.h"
#include "moekit/model/model_config.h"

namespace moekit {

// The tensors of a checkpoint that the model does not load, as transformers does not: rotary inv_freq
// buffers of old checkpoints and layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction
// layer) under layers_prefix ("model.layers."); and those skipped knowingly, under ignored_prefixes (a
// vision-language model's vision tower).
struct UnloadedWeights {
  int64_t num_layers = 0;
  std::string layers_prefix;
  std::vector<std::string> ignored_prefixes;

  // True for a tensor transformers ignores too.
  bool ignored_as_transformers_does(const std::string& name) const;
  // The entry of ignored_prefixes that name is under, or nullptr.
  const std::string* skipped_prefix(const std::string& name) const;
};

class WeightReader {
 public:
  WeightReader(const Checkpoint& checkpoint, DType dtype) : checkpoint_(checkpoint), dtype_(dtype) {}

  Tensor load(const std::string& name, const Shape& shape, std::optional<DType> dtype = std::nullopt);
  // Quantised experts stay quantised unless `dequantize` (ExpertsConfig follows: see load_weights).
  FusedExperts experts(const std::string& prefix, int64_t E, int64_t H, int64_t I, const CheckpointQuantization& q,
                       bool dequantize);
  bool contains(const std::string& name) const { return checkpoint_.contains(name); }
  bool any_under(const std::string& prefix) const;

  // Throws naming the checkpoint's tensors that no part of the model read, except `unloaded`'s;
  // returns how many were skipped under each of its ignored prefixes.
  std::map<std::string, int64_t> check_all_used(const UnloadedWeights& unloaded) const;

  // Bytes the weights take once loaded, from the checkpoint's headers: every tensor but `unloaded`'s, a
  // float one in the model's dtype, an FP8/FP4 one as it is stored when it stays quantised (experts
  // unless dequantize_experts) and in the model's dtype when it is dequantised (dense linears always).
  // Fusing per-expert weights copies them, and a view of the mapped file is memory too once read, so
  // every tensor counts.
  std::size_t loaded_bytes(const UnloadedWeights& unloaded, bool dequantize_experts) const;

 private:
  const Checkpoint& checkpoint_;
  DType dtype_;
  std::set<std::string> used_;
  std::vector<std::string> expert_prefixes_;
};

// "1.5 TiB", "23.9 GiB", "512.0 MiB", "12 bytes": sizes in error messages.
std::string format_bytes(std::size_t bytes);

// Throws "<what> needs <need> on <device> ... but <available> is available" when `need` is more than
// what the device can allocate now (available_memory_bytes); does nothing when that cannot be read.
void require_memory(Device device, std::size_t need, const std::string& what);

}  // namespace moekit

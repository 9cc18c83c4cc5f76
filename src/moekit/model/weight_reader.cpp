#include "moekit/model/weight_reader.h"

#include <algorithm>
#include <cstdio>

#include "moekit/checked_math.h"
#include "moekit/error.h"

namespace moekit {

bool UnloadedWeights::ignored_as_transformers_does(const std::string& name) const {
  if (name.ends_with("rotary_emb.inv_freq")) return true;
  if (!name.starts_with(layers_prefix)) return false;
  const std::size_t start = layers_prefix.size();
  const auto end = name.find('.', start);
  const std::string index = name.substr(start, end - start);
  // (More than 9 digits is past any layer count, and past what stoll takes.)
  return !index.empty() && index.find_first_not_of("0123456789") == std::string::npos &&
         (index.size() > 9 || std::stoll(index) >= num_layers);
}

const std::string* UnloadedWeights::skipped_prefix(const std::string& name) const {
  const auto it = std::find_if(ignored_prefixes.begin(), ignored_prefixes.end(),
                               [&](const std::string& prefix) { return name.starts_with(prefix); });
  return it == ignored_prefixes.end() ? nullptr : &*it;
}

Tensor WeightReader::load(const std::string& name, const Shape& shape, std::optional<DType> dtype) {
  used_.insert(name);
  used_.insert(name + "_scale_inv");  // an FP8 linear's block scales, read (and dequantised) with it
  return checkpoint_.load(name, dtype.value_or(dtype_), shape);
}

FusedExperts WeightReader::experts(const std::string& prefix, int64_t E, int64_t H, int64_t I,
                                   const CheckpointQuantization& q, bool dequantize) {
  expert_prefixes_.push_back(prefix + ".");
  if (q.experts == WeightFormat::none) return checkpoint_.experts(prefix, E, H, I, dtype_);
  return checkpoint_.quantized_experts(prefix, E, H, I, q.experts, q.ue8m0_scales,
                                       dequantize ? std::optional<DType>(dtype_) : std::nullopt);
}

bool WeightReader::any_under(const std::string& prefix) const {
  for (const auto& name : checkpoint_.tensor_names())
    if (name.starts_with(prefix)) return true;
  return false;
}

std::map<std::string, int64_t> WeightReader::check_all_used(const UnloadedWeights& unloaded) const {
  std::vector<std::string> unused;
  std::map<std::string, int64_t> ignored;
  for (const auto& name : checkpoint_.tensor_names()) {
    if (used_.count(name) != 0 || unloaded.ignored_as_transformers_does(name)) continue;
    bool in_experts = false;
    for (const auto& prefix : expert_prefixes_) in_experts = in_experts || name.starts_with(prefix);
    if (in_experts) continue;
    if (const std::string* skipped = unloaded.skipped_prefix(name)) {
      ++ignored[*skipped];
      continue;
    }
    unused.push_back(name);
  }
  if (unused.empty()) return ignored;
  std::string list;
  for (std::size_t i = 0; i < std::min<std::size_t>(unused.size(), 5); ++i) list += (i ? ", " : "") + unused[i];
  MOEKIT_FAIL(checkpoint_.directory(), ": ", unused.size(), " tensor(s) the model does not use: ", list,
              unused.size() > 5 ? ", ..." : "", " (a checkpoint of another architecture or config?)");
}

std::size_t WeightReader::loaded_bytes(const UnloadedWeights& unloaded, bool dequantize_experts) const {
  int64_t total = 0;
  const auto model_element = static_cast<int64_t>(dtype_size(dtype_));
  for (const auto& name : checkpoint_.tensor_names()) {
    if (unloaded.ignored_as_transformers_does(name) || unloaded.skipped_prefix(name) != nullptr) continue;
    const SafetensorsTensorInfo& info = checkpoint_.info(name);
    // A dtype moekit has no type for is refused when the tensor is loaded; here it counts as stored.
    const std::optional<DType> stored = info.dtype;
    const bool quantized = stored == DType::f8_e4m3 || stored == DType::f4_e2m1;
    const bool stays_quantized = quantized && !dequantize_experts && name.find(".experts.") != std::string::npos;
    auto bytes = static_cast<int64_t>(info.end - info.begin);
    // Block scales load as they are stored (float32 or ue8m0), whatever the model's dtype.
    if (((stored && is_floating(*stored)) || (quantized && !stays_quantized)) && !name.ends_with("_scale_inv")) {
      // The header's shape counts values (F4's too), and a validated header's count fits in 2^62.
      int64_t values = 1;
      for (int64_t d : info.shape) values *= d;
      bytes = checked_mul(values, model_element, name + "'s bytes in the model's dtype");
    }
    total = checked_add(total, bytes, "the checkpoint's weights in bytes");
  }
  return static_cast<std::size_t>(total);
}

std::string format_bytes(std::size_t bytes) {
  const double b = static_cast<double>(bytes);
  char text[64];
  if (b >= 1024.0 * 1024 * 1024 * 1024)
    std::snprintf(text, sizeof text, "%.1f TiB", b / (1024.0 * 1024 * 1024 * 1024));
  else if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(text, sizeof text, "%.1f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024)
    std::snprintf(text, sizeof text, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0)
    std::snprintf(text, sizeof text, "%.1f KiB", b / 1024.0);
  else
    std::snprintf(text, sizeof text, "%zu bytes", bytes);
  return text;
}

void require_memory(Device device, std::size_t need, const std::string& what) {
  const std::optional<std::size_t> available = available_memory_bytes(device);
  if (!available || need <= *available) return;
  MOEKIT_FAIL(what, " needs ", format_bytes(need), " (", need, " bytes) on ", device_name(device), " but ",
              format_bytes(*available), " is available", device.is_cpu() ? " (MemAvailable and the cgroup's limit)" : "");
}

}  // namespace moekit

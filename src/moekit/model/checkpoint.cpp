// The checkpoint loader. Files are untrusted: config.json and the index are checked key by key, the
// shards by SafetensorsFile, and every inconsistency between them throws naming the tensor and file.
#include "moekit/model/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <utility>

#include "moekit/checked_math.h"
#include "moekit/io/json_input.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// Fusing copies above this size print a progress line: small (test) checkpoints stay quiet.
constexpr std::size_t kProgressBytes = std::size_t{256} << 20;

// The dtypes tensors are converted between at load.
bool is_load_dtype(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

bool file_exists(const fs::path& path) {
  std::error_code ignored;
  return fs::exists(path, ignored);
}

// A comma-separated list of at most `limit` names, then how many there are in all.
template <typename Range>
std::string list_names(const Range& names, std::size_t limit) {
  std::string out;
  std::size_t count = 0;
  for (const auto& name : names) {
    if (count++ < limit) out += (out.empty() ? "" : ", ") + std::string(name);
  }
  if (count > limit) out += ", ... (" + std::to_string(count) + " in all)";
  return out;
}

// Parses a JSON file that must hold an object (json_input.h: bounded nesting, no repeated keys).
json read_json(const fs::path& path, const JsonReadOptions& options = {}) {
  json value = read_json_file(path, options);
  MOEKIT_CHECK(value.is_object(), path.string(), ": expected a JSON object, got a JSON ", value.type_name());
  return value;
}

// Configuration objects of a model that are not a backbone, though their key ends in "_config".
constexpr std::string_view kNotBackbones[] = {"quantization_config"};

bool is_sub_config(const std::string& key, const json& value) {
  for (std::string_view other : kNotBackbones)
    if (key == other) return false;
  return value.is_object() && (value.contains("model_type") || key.ends_with("_config"));
}

// Levenshtein distance, for suggesting names close to a missing one.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), std::size_t{0});
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// Up to `count` names closest to `name`: fewest edits first, then the longest common prefix.
std::vector<std::string> closest_names(const std::string& name, const std::map<std::string, std::size_t>& names,
                                       std::size_t count) {
  struct Candidate {
    std::size_t distance;
    std::size_t common_prefix;
    const std::string* name;
  };
  std::vector<Candidate> candidates;
  candidates.reserve(names.size());
  for (const auto& [other, shard] : names) {
    const auto mismatch = std::mismatch(name.begin(), name.end(), other.begin(), other.end());
    candidates.push_back({edit_distance(name, other), static_cast<std::size_t>(mismatch.first - name.begin()), &other});
  }
  const std::size_t n = std::min(count, candidates.size());
  std::partial_sort(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(n), candidates.end(),
                    [](const Candidate& a, const Candidate& b) {
                      if (a.distance != b.distance) return a.distance < b.distance;
                      if (a.common_prefix != b.common_prefix) return a.common_prefix > b.common_prefix;
                      return *a.name < *b.name;
                    });
  std::vector<std::string> out;
  for (std::size_t i = 0; i < n; ++i) out.push_back(*candidates[i].name);
  return out;
}

// The weight map of an index in file order, duplicates kept (a parsed json object keeps only the last
// of two equal keys, which would hide a tensor listed in two shards). Values that are not strings are
// recorded as empty and rejected by the caller.
struct IndexEntries {
  std::vector<std::pair<std::string, std::string>> entries;
  std::string top_key;
};

json read_index(const fs::path& path, IndexEntries& out) {
  JsonReadOptions options;
  // Keys of the top-level object have depth 1; those of the weight map, and its values, depth 2.
  options.callback = [&out](int depth, json::parse_event_t event, const json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      out.top_key = parsed.get<std::string>();
    } else if (depth == 2 && out.top_key == "weight_map") {
      if (event == json::parse_event_t::key)
        out.entries.emplace_back(parsed.get<std::string>(), std::string());
      else if (event == json::parse_event_t::value && parsed.is_string() && !out.entries.empty())
        out.entries.back().second = parsed.get<std::string>();
    }
  };
  // A tensor listed twice is reported by the caller, with both shards.
  options.allow_duplicate_key = [&out](int depth, const std::string&) {
    return depth == 2 && out.top_key == "weight_map";
  };
  return read_json(path, options);
}

// A shard name from an untrusted index must stay inside the checkpoint directory.
bool is_safe_relative_path(const std::string& name) {
  const fs::path path(name);
  if (name.empty() || path.is_absolute() || path.has_root_name()) return false;
  return std::none_of(path.begin(), path.end(), [](const fs::path& part) { return part == ".."; });
}

// Copies src (contiguous, CPU) into dst as dtype, converting through Tensor::to when the dtypes differ.
void copy_as(const Tensor& src, DType dtype, void* dst) {
  if (src.dtype() == dtype) {
    std::memcpy(dst, src.data(), src.nbytes());
    return;
  }
  const Tensor converted = src.to(dtype);
  std::memcpy(dst, converted.data(), converted.nbytes());
}

// The per-expert layouts: what follows "{prefix}.{i}." for the gate [I, H], up [I, H] and down [H, I]
// weights.
struct PerExpertLayout {
  std::string_view description;
  std::array<std::string_view, 3> names;
};
constexpr std::array<PerExpertLayout, 2> kPerExpertLayouts = {{
    {"per-expert gate_proj/up_proj/down_proj", {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}},
    {"per-expert w1/w3/w2 (Mixtral)", {"w1.weight", "w3.weight", "w2.weight"}},
}};
// What follows "{prefix}." in the fused layout.
constexpr std::array<std::string_view, 4> kFusedNames = {"gate_up_proj", "down_proj", "gate_up_proj_bias",
                                                         "down_proj_bias"};
constexpr std::size_t kFusedLayout = kPerExpertLayouts.size();  // layout ids: per-expert 0.., then fused

std::string_view layout_description(std::size_t layout) {
  return layout == kFusedLayout ? "fused gate_up_proj/down_proj" : kPerExpertLayouts[layout].description;
}

// Which layout a name under "{prefix}." belongs to, and its expert index for the per-expert ones.
struct NameLayout {
  std::size_t layout;
  int64_t expert = -1;
};
std::optional<NameLayout> classify(std::string_view rest) {
  if (std::find(kFusedNames.begin(), kFusedNames.end(), rest) != kFusedNames.end()) return NameLayout{kFusedLayout};
  const std::size_t dot = rest.find('.');
  if (dot == std::string_view::npos || dot == 0) return std::nullopt;
  int64_t expert = 0;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + dot, expert);
  if (ec != std::errc() || end != rest.data() + dot || expert < 0) return std::nullopt;
  const std::string_view tail = rest.substr(dot + 1);
  for (std::size_t layout = 0; layout < kPerExpertLayouts.size(); ++layout) {
    const auto& names = kPerExpertLayouts[layout].names;
    if (std::find(names.begin(), names.end(), tail) != names.end()) return NameLayout{layout, expert};
  }
  return std::nullopt;
}

// Block scales read from a file (float or F8_E8M0) as f32 or ue8m0; a float that is not a power of two
// does not become ue8m0 silently.
Tensor convert_scales(const Tensor& scales, DType to, const std::string& name) {
  MOEKIT_CHECK(is_load_dtype(scales.dtype()) || scales.dtype() == DType::ue8m0, name, " holds ",
               dtype_name(scales.dtype()), ", expected float32 or F8_E8M0 scales");
  const Tensor values = scales.dtype() == DType::ue8m0 ? Tensor() : scales.to(DType::f32);
  Tensor out = Tensor::empty(scales.shape(), to);
  for (int64_t i = 0; i < scales.numel(); ++i) {
    const float v = values.defined() ? values.data_as<float>()[i] : to_float(scales.data_as<ue8m0>()[i]);
    if (to == DType::f32) {
      out.data_as<float>()[i] = v;
      continue;
    }
    const ue8m0 code = from_float<ue8m0>(v);
    MOEKIT_CHECK(to_float(code) == v, name, " element ", i, " is ", v,
                 ", not a power of two, but the scales are ue8m0 (scale_fmt \"ue8m0\" or FP4 experts)");
    out.data_as<ue8m0>()[i] = code;
  }
  return out;
}

}  // namespace

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  const fs::path root(dir);
  std::error_code ec;
  MOEKIT_CHECK(fs::is_directory(root, ec), dir, ": not a directory");
  const fs::path config_path = root / kConfigFile;
  MOEKIT_CHECK(file_exists(config_path), dir, ": no ", kConfigFile, " (a Hugging Face checkpoint directory has one)");
  config_ = read_json(config_path);

  const fs::path single = root / kSingleFile;
  const fs::path index_path = root / kIndexFile;
  if (file_exists(single)) {
    shards_.emplace_back(single.string());
    for (const auto& [name, info] : shards_[0].header().tensors) shard_of_.emplace(name, 0);
    return;
  }
  MOEKIT_CHECK(file_exists(index_path), dir, ": no safetensors: neither ", kSingleFile, " nor ", kIndexFile, " exists");

  const std::string index_name = index_path.string();
  IndexEntries listed;
  const json index = read_index(index_path, listed);
  MOEKIT_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), index_name,
               ": expected a \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, std::size_t> shard_ids;  // shard file -> index into shards_
  std::map<std::string, std::string> first_listing;
  for (const auto& [name, shard_name] : listed.entries) {
    MOEKIT_CHECK(!shard_name.empty(), index_name, ": weight_map[\"", name, "\"] must name a shard file, got ",
                 describe_json(index["weight_map"][name]));
    const auto [first, inserted] = first_listing.emplace(name, shard_name);
    MOEKIT_CHECK(inserted, index_name, ": tensor '", name, "' is listed twice in the weight map, in shards ",
                 first->second, " and ", shard_name);
    MOEKIT_CHECK(is_safe_relative_path(shard_name), index_name, ": shard '", shard_name, "' of tensor '", name,
                 "' must be a relative path inside ", dir);
    auto shard_id = shard_ids.find(shard_name);
    if (shard_id == shard_ids.end()) {
      const fs::path shard_path = root / shard_name;
      MOEKIT_CHECK(file_exists(shard_path), dir, ": shard ", shard_name, " (listed in ", kIndexFile, " for tensor '",
                   name, "') does not exist");
      shards_.emplace_back(shard_path.string());
      shard_id = shard_ids.emplace(shard_name, shards_.size() - 1).first;
    }
    const SafetensorsFile& file = shards_[shard_id->second];
    MOEKIT_CHECK(file.contains(name), dir, ": tensor '", name, "' is listed in ", kIndexFile, " under shard ",
                 shard_name, ", which does not hold it");
    shard_of_.emplace(name, shard_id->second);
  }
  // A tensor held by two shards is ambiguous even where the index names one of them.
  std::map<std::string_view, std::size_t> holder;
  for (std::size_t s = 0; s < shards_.size(); ++s) {
    for (const auto& [name, info] : shards_[s].header().tensors) {
      const auto [other, inserted] = holder.emplace(name, s);
      MOEKIT_CHECK(inserted, dir, ": tensor '", name, "' is held by two shards, ", shards_[other->second].path(),
                   " and ", shards_[s].path());
    }
  }
}

const nlohmann::json& Checkpoint::sub_config(std::string_view name) const {
  const auto it = config_.find(std::string(name));
  if (it != config_.end() && is_sub_config(it.key(), *it)) return *it;
  const std::vector<std::string> names = sub_config_names();
  MOEKIT_FAIL(dir_, "/", kConfigFile, " has no sub-config '", name, "'; ",
              names.empty() ? std::string("it has none") : "its sub-configs: " + list_names(names, names.size()));
}

std::vector<std::string> Checkpoint::sub_config_names() const {
  std::vector<std::string> names;
  for (const auto& [key, value] : config_.items())
    if (is_sub_config(key, value)) names.push_back(key);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(shard_of_.size());
  for (const auto& [name, shard_id] : shard_of_) names.push_back(name);
  return names;
}

void Checkpoint::fail_missing(const std::string& name) const {
  if (shard_of_.empty()) MOEKIT_FAIL(dir_, ": no tensor named '", name, "'; the checkpoint holds no tensors");
  MOEKIT_FAIL(dir_, ": no tensor named '", name,
              "'; closest names: ", list_names(closest_names(name, shard_of_, 3), 3));
}

const SafetensorsFile& Checkpoint::shard(const std::string& name) const {
  const auto it = shard_of_.find(name);
  if (it == shard_of_.end()) fail_missing(name);
  return shards_[it->second];
}

Tensor Checkpoint::tensor(const std::string& name) const {
  return shard(name).tensor(name);
}

const SafetensorsTensorInfo& Checkpoint::info(const std::string& name) const {
  return shard(name).info(name);
}

Tensor Checkpoint::tensor(const std::string& name, const Shape& expected) const {
  Tensor t = tensor(name);
  MOEKIT_CHECK(t.shape() == expected, name, " has shape ", shape_string(t.shape()), ", expected ",
               shape_string(expected), " (in ", shard(name).path(), ")");
  return t;
}

Tensor Checkpoint::load(const std::string& name, DType dtype, const Shape& expected) const {
  MOEKIT_CHECK(is_load_dtype(dtype), "loading ", name, ": tensors load as f32, f16 or bf16, not ", dtype_name(dtype));
  Tensor t = expected.empty() ? tensor(name) : tensor(name, expected);
  if (t.dtype() == dtype) return t;
  if (t.dtype() == DType::f8_e4m3 && t.dim() == 2) {
    const std::string scale_name = name + "_scale_inv";
    MOEKIT_CHECK(contains(scale_name), dir_, ": ", name, " holds f8_e4m3 but its block scales ", scale_name,
                 " are missing");
    const int64_t N = t.size(0), K = t.size(1);
    const Shape scale_shape = weight_scale_shape(WeightFormat::fp8_e4m3, 1, N, K);
    Tensor scale = load(scale_name, DType::f32, {scale_shape[1], scale_shape[2]});
    return dequantize_weights(t.reshape({1, N, K}), scale.reshape(scale_shape), dtype).reshape({N, K});
  }
  MOEKIT_CHECK(is_load_dtype(t.dtype()), name, " holds ", dtype_name(t.dtype()), ", which does not convert to ",
               dtype_name(dtype), " (only f32, f16 and bf16 convert)");
  return t.to(dtype);
}

namespace {

// t [E, A, B] (contiguous, CPU) as a new contiguous [E, B, A]: each expert's matrix transposed in
// 32 x 32 blocks, experts in parallel.
Tensor transposed_matrices(const Tensor& t) {
  const int64_t E = t.shape()[0], A = t.shape()[1], B = t.shape()[2];
  Tensor out = Tensor::empty({E, B, A}, t.dtype());
  const auto es = static_cast<int64_t>(dtype_size(t.dtype()));
  const char* src = static_cast<const char*>(t.data());
  char* dst = static_cast<char*>(out.data());
  constexpr int64_t kBlock = 32;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t e = 0; e < E; ++e)
    for (int64_t a0 = 0; a0 < A; a0 += kBlock)
      for (int64_t b0 = 0; b0 < B; b0 += kBlock)
        for (int64_t a = a0; a < std::min(a0 + kBlock, A); ++a)
          for (int64_t b = b0; b < std::min(b0 + kBlock, B); ++b)
            std::memcpy(dst + ((e * B + b) * A + a) * es, src + ((e * A + a) * B + b) * es, static_cast<std::size_t>(es));
  return out;
}

}  // namespace

FusedExperts Checkpoint::experts(const std::string& prefix, int64_t num_experts, int64_t hidden, int64_t intermediate,
                                 DType dtype) const {
  MOEKIT_CHECK(num_experts > 0 && hidden > 0 && intermediate > 0, "experts of ", prefix,
               ": sizes must be positive, got num_experts ", num_experts, ", hidden ", hidden, ", intermediate ",
               intermediate);
  MOEKIT_CHECK(is_load_dtype(dtype), "experts of ", prefix, ": experts load as f32, f16 or bf16, not ",
               dtype_name(dtype));
  const int64_t E = num_experts, H = hidden, I = intermediate;
  const int64_t I2 = checked_mul(2, I, "experts of " + prefix + ": 2 x intermediate size");

  // Which layouts occur under the prefix: the first tensor of each, and the highest expert index.
  const std::string under = prefix + ".";
  std::array<std::string, kFusedLayout + 1> first_of;
  std::array<std::string, kFusedLayout + 1> highest_of;
  std::array<int64_t, kFusedLayout + 1> highest{};
  highest.fill(-1);
  std::vector<std::string_view> names_under;
  for (auto it = shard_of_.lower_bound(under); it != shard_of_.end() && it->first.starts_with(under); ++it) {
    names_under.push_back(it->first);
    const std::optional<NameLayout> found = classify(std::string_view(it->first).substr(under.size()));
    if (!found) continue;
    if (first_of[found->layout].empty()) first_of[found->layout] = it->first;
    if (found->expert > highest[found->layout]) {
      highest[found->layout] = found->expert;
      highest_of[found->layout] = it->first;
    }
  }
  std::vector<std::size_t> layouts;
  if (!first_of[kFusedLayout].empty()) layouts.push_back(kFusedLayout);
  for (std::size_t layout = 0; layout < kPerExpertLayouts.size(); ++layout)
    if (!first_of[layout].empty()) layouts.push_back(layout);
  if (layouts.empty()) {
    MOEKIT_FAIL(dir_, ": no expert weights under ", prefix, ": expected ", prefix, ".gate_up_proj and ", prefix,
                ".down_proj, or ", prefix, ".{i}.gate_proj/up_proj/down_proj.weight, or ", prefix,
                ".{i}.w1/w3/w2.weight; ",
                names_under.empty() ? "no tensor name starts with " + under
                                    : "tensors under it: " + list_names(names_under, 6));
  }
  if (layouts.size() > 1) {
    std::string seen;
    for (std::size_t layout : layouts)
      seen += (seen.empty() ? "" : "; ") + std::string(layout_description(layout)) + " (" + first_of[layout] + ")";
    MOEKIT_FAIL(dir_, ": ", prefix, " mixes expert layouts: ", seen);
  }

  FusedExperts out;
  const Shape gate_up_shape{E, I2, H};
  const Shape down_shape{E, H, I};
  if (layouts[0] == kFusedLayout) {
    // transformers 5 layout: loaded as it is (a view of the file when the dtype matches).
    using Required = std::pair<std::string, Shape>;
    for (const auto& [name, shape] :
         {Required{under + "gate_up_proj", gate_up_shape}, Required{under + "down_proj", down_shape}})
      MOEKIT_CHECK(contains(name), dir_, ": ", name, " is missing: expected ", shape_string(shape),
                   " (the fused expert layout needs gate_up_proj and down_proj)");
    // The same matrices stored transposed, gate_up [E, H, 2I] and down [E, I, H], as Qwen3-VL-MoE's
    // published checkpoints hold them (transformers transposes them on load, and so does this: the
    // backends' fast paths read [E, out, in]). Told apart by down's shape, which differs when H != I.
    const Shape transposed_gate_up{E, H, I2}, transposed_down{E, I, H};
    if (H != I && tensor(under + "down_proj").shape() == transposed_down) {
      out.gate_up_proj = transposed_matrices(load(under + "gate_up_proj", dtype, transposed_gate_up));
      out.down_proj = transposed_matrices(load(under + "down_proj", dtype, transposed_down));
    } else {
      out.gate_up_proj = load(under + "gate_up_proj", dtype, gate_up_shape);
      out.down_proj = load(under + "down_proj", dtype, down_shape);
    }
    const std::string gate_up_bias = under + "gate_up_proj_bias";
    const std::string down_bias = under + "down_proj_bias";
    MOEKIT_CHECK(contains(gate_up_bias) == contains(down_bias), dir_, ": ", prefix, " has ",
                 contains(gate_up_bias) ? gate_up_bias : down_bias, " but not ",
                 contains(gate_up_bias) ? down_bias : gate_up_bias, " (expert biases come in pairs)");
    if (contains(gate_up_bias)) {
      out.gate_up_proj_bias = load(gate_up_bias, dtype, {E, I2});
      out.down_proj_bias = load(down_bias, dtype, {E, H});
    }
    return out;
  }

  const PerExpertLayout& layout = kPerExpertLayouts[layouts[0]];
  MOEKIT_CHECK(highest[layouts[0]] < E, dir_, ": ", highest_of[layouts[0]], " is expert ", highest[layouts[0]],
               ", but the layer has ", E, " experts (0..", E - 1, ")");
  // Every lookup and check runs here, before the parallel copy, so that the copy itself cannot fail.
  const std::array<Shape, 3> shapes = {Shape{I, H}, Shape{I, H}, Shape{H, I}};
  std::vector<std::array<Tensor, 3>> sources(static_cast<std::size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    for (std::size_t j = 0; j < 3; ++j) {
      const std::string name = under + std::to_string(e) + "." + std::string(layout.names[j]);
      MOEKIT_CHECK(contains(name), dir_, ": ", name, " is missing: expected ", shape_string(shapes[j]), " for expert ",
                   e, " of ", E, " (", layout.description, " layout)");
      Tensor t = tensor(name, shapes[j]);
      MOEKIT_CHECK(t.dtype() == dtype || is_load_dtype(t.dtype()), name, " holds ", dtype_name(t.dtype()),
                   ", which does not convert to ", dtype_name(dtype));
      sources[static_cast<std::size_t>(e)][j] = std::move(t);
    }
  }

  out.gate_up_proj = Tensor::empty(gate_up_shape, dtype);
  out.down_proj = Tensor::empty(down_shape, dtype);
  const std::size_t matrix_bytes = static_cast<std::size_t>(I * H) * dtype_size(dtype);
  auto* gate_up = static_cast<char*>(out.gate_up_proj.data());
  auto* down = static_cast<char*>(out.down_proj.data());
  const bool progress = out.gate_up_proj.nbytes() + out.down_proj.nbytes() > kProgressBytes;
  const bool live_progress = progress && isatty(STDERR_FILENO) == 1;
  int64_t done = 0;
  std::exception_ptr failure;  // bad_alloc in a conversion; an exception must not leave the parallel region
#pragma omp parallel for schedule(dynamic)
  for (int64_t e = 0; e < E; ++e) {
    const auto& [gate, up, down_e] = sources[static_cast<std::size_t>(e)];
    const std::size_t at = static_cast<std::size_t>(e);
    try {
      copy_as(gate, dtype, gate_up + (2 * at) * matrix_bytes);    // rows [0, I): gate
      copy_as(up, dtype, gate_up + (2 * at + 1) * matrix_bytes);  // rows [I, 2I): up
      copy_as(down_e, dtype, down + at * matrix_bytes);
    } catch (...) {
#pragma omp critical(moekit_checkpoint_failure)
      if (!failure) failure = std::current_exception();
    }
#pragma omp critical(moekit_checkpoint_progress)
    {
      ++done;
      if (live_progress)
        std::fprintf(stderr, "\rfusing experts of %s: %lld/%lld", prefix.c_str(), static_cast<long long>(done),
                     static_cast<long long>(E));
    }
  }
  if (failure) std::rethrow_exception(failure);
  if (progress)
    std::fprintf(stderr, "%sfusing experts of %s: %lld/%lld\n", live_progress ? "\r" : "", prefix.c_str(),
                 static_cast<long long>(done), static_cast<long long>(E));
  return out;
}

FusedExperts Checkpoint::quantized_experts(const std::string& prefix, int64_t num_experts, int64_t hidden,
                                           int64_t intermediate, WeightFormat format, bool ue8m0_scales,
                                           std::optional<DType> dequantize_to) const {
  MOEKIT_CHECK(num_experts > 0 && hidden > 0 && intermediate > 0, "experts of ", prefix,
               ": sizes must be positive, got num_experts ", num_experts, ", hidden ", hidden, ", intermediate ",
               intermediate);
  MOEKIT_CHECK(format != WeightFormat::none, "quantized_experts of ", prefix, ": no weight format given");
  MOEKIT_CHECK(!dequantize_to || is_load_dtype(*dequantize_to), "experts of ", prefix,
               ": experts dequantise to f32, f16 or bf16, not ", dtype_name(*dequantize_to));
  const int64_t E = num_experts, H = hidden, I = intermediate;
  const int64_t I2 = checked_mul(2, I, "experts of " + prefix + ": 2 x intermediate size");
  const bool fp8 = format == WeightFormat::fp8_e4m3;
  const DType weight_dtype = fp8 ? DType::f8_e4m3 : DType::f4_e2m1;
  MOEKIT_CHECK(fp8 || (H % 2 == 0 && I % 2 == 0), "experts of ", prefix, ": FP4 weights pack pairs along K, so ",
               "hidden (", H, ") and intermediate (", I, ") must be even");
  MOEKIT_CHECK(dequantize_to || !fp8 || I % kFp8BlockSize == 0, dir_, ": the FP8 experts of ", prefix,
               " have intermediate size ", I,
               ", not a multiple of 128: gate and up rows do not share 128-row scale "
               "blocks when fused, so they cannot run quantised (load them dequantised)");
  const std::string under = prefix + ".";
  const PerExpertLayout* layout = nullptr;
  for (const PerExpertLayout& candidate : kPerExpertLayouts)
    if (contains(under + "0." + std::string(candidate.names[0]))) layout = &candidate;
  MOEKIT_CHECK(layout != nullptr, dir_, ": no quantised per-expert weights under ", prefix, ": expected ", prefix,
               ".{i}.gate_proj/up_proj/down_proj.weight (or w1/w3/w2) with their .weight_scale_inv",
               contains(under + "gate_up_proj") ? " (fused quantised experts are not supported)" : "");
  const DType scale_dtype = ue8m0_scales ? DType::ue8m0 : DType::f32;

  // Every lookup and check first; then the copies, which cannot fail.
  const std::array<std::pair<int64_t, int64_t>, 3> sizes = {{{I, H}, {I, H}, {H, I}}};
  std::vector<std::array<std::pair<Tensor, Tensor>, 3>> sources(static_cast<std::size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    for (std::size_t j = 0; j < 3; ++j) {
      const auto [N, K] = sizes[j];
      const std::string name = under + std::to_string(e) + "." + std::string(layout->names[j]);
      const std::string scale_name = name + "_scale_inv";
      const Shape weight_shape = quantized_weight_shape(format, 1, N, K);
      const Shape scale_shape = weight_scale_shape(format, 1, N, K);
      MOEKIT_CHECK(contains(name), dir_, ": ", name, " is missing: expected ", weight_format_name(format), " [", N,
                   ", ", K, "] for expert ", e, " of ", E);
      MOEKIT_CHECK(contains(scale_name), dir_, ": ", scale_name, " is missing: the block scales of ", name,
                   " (expected ", shape_string({scale_shape[1], scale_shape[2]}), ")");
      Tensor w = tensor(name, {weight_shape[1], weight_shape[2]});
      MOEKIT_CHECK(w.dtype() == weight_dtype, name, " holds ", dtype_name(w.dtype()), ", expected ",
                   dtype_name(weight_dtype), " (quantization_config says the experts are ", weight_format_name(format),
                   ")");
      Tensor s = tensor(scale_name, {scale_shape[1], scale_shape[2]});
      if (s.dtype() != scale_dtype) s = convert_scales(s, scale_dtype, scale_name);
      sources[static_cast<std::size_t>(e)][j] = {std::move(w), std::move(s)};
    }
  }

  FusedExperts out;
  if (dequantize_to) {
    const DType dtype = *dequantize_to;
    out.gate_up_proj = Tensor::empty({E, I2, H}, dtype);
    out.down_proj = Tensor::empty({E, H, I}, dtype);
    const std::size_t matrix_bytes = static_cast<std::size_t>(I * H) * dtype_size(dtype);
    auto* gate_up = static_cast<char*>(out.gate_up_proj.data());
    auto* down = static_cast<char*>(out.down_proj.data());
    for (int64_t e = 0; e < E; ++e) {
      const std::size_t at = static_cast<std::size_t>(e);
      std::array<Tensor, 3> dense;
      for (std::size_t j = 0; j < 3; ++j) {
        const auto& [w, s] = sources[at][j];
        dense[j] =
            dequantize_weights(w.reshape({1, w.size(0), w.size(1)}), s.reshape({1, s.size(0), s.size(1)}), dtype);
      }
      std::memcpy(gate_up + (2 * at) * matrix_bytes, dense[0].data(), matrix_bytes);
      std::memcpy(gate_up + (2 * at + 1) * matrix_bytes, dense[1].data(), matrix_bytes);
      std::memcpy(down + at * matrix_bytes, dense[2].data(), matrix_bytes);
    }
    return out;
  }
  // Quantised rows and scale rows concatenate: gate then up (FP8 with I % 128 == 0, so the gate's scale
  // rows end where the up rows begin; FP4 scales are per row).
  auto fuse = [&](std::initializer_list<std::size_t> parts, bool scales) {
    const Tensor& first = scales ? sources[0][*parts.begin()].second : sources[0][*parts.begin()].first;
    const int64_t rows = first.size(0) * static_cast<int64_t>(parts.size()), cols = first.size(1);
    Tensor fused = Tensor::empty({E, rows, cols}, first.dtype());
    auto* dst = static_cast<char*>(fused.data());
    for (int64_t e = 0; e < E; ++e)
      for (std::size_t j : parts) {
        const Tensor& t =
            scales ? sources[static_cast<std::size_t>(e)][j].second : sources[static_cast<std::size_t>(e)][j].first;
        std::memcpy(dst, t.data(), t.nbytes());
        dst += t.nbytes();
      }
    return fused;
  };
  out.gate_up_proj = fuse({0, 1}, false);
  out.gate_up_proj_scale_inv = fuse({0, 1}, true);
  out.down_proj = fuse({2}, false);
  out.down_proj_scale_inv = fuse({2}, true);
  return out;
}

}  // namespace moekit

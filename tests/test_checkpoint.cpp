// The checkpoint loader: tiny checkpoints written with save_safetensors and a hand-written config.json,
// in every layout it reads, and every inconsistency it must reject with a message naming the culprit.
#include <gtest/gtest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "moekit/model/checkpoint.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Tensors = std::vector<std::pair<std::string, Tensor>>;

fs::path temp_dir() {
  return test::temp_dir("moekit_checkpoint");
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

void write_config(const fs::path& dir, const json& config = {{"model_type", "qwen3_moe"}}) {
  write_text(dir / "config.json", config.dump(2));
}

// A single-file checkpoint.
fs::path make_checkpoint(const Tensors& tensors, const json& config = {{"model_type", "qwen3_moe"}}) {
  const fs::path dir = temp_dir();
  write_config(dir, config);
  save_safetensors((dir / "model.safetensors").string(), tensors);
  return dir;
}

// Values k / 4 with |k| <= 125 (7 significant bits), exact in f32, f16 and bf16, different for each
// seed so that a tensor copied to the wrong place shows.
Tensor pattern(const Shape& shape, int64_t seed, DType dtype = DType::f32) {
  Tensor t = Tensor::empty(shape, DType::f32);
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>((seed * 131 + i * 17) % 251 - 125) / 4;
  return t.to(dtype);
}

std::vector<float> values(const Tensor& t) {
  const Tensor f = t.to(DType::f32);
  const float* p = f.data_as<float>();
  return {p, p + f.numel()};
}

// Runs fn and expects a moekit::Error whose message contains every needle.
template <typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message does not mention \"" << needle << "\": " << e.what();
    return;
  }
  ADD_FAILURE() << "no moekit::Error thrown; expected one mentioning \"" << needles.front() << "\"";
}

// Per-expert weights gate [I, H], up [I, H], down [H, I] named "{prefix}.{e}.{names[j]}", seeded by
// (e, j) so that expected_* below can recompute them.
constexpr int64_t kE = 3, kH = 4, kI = 2;
const std::array<std::string, 3> kQwenNames = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};
const std::array<std::string, 3> kMixtralNames = {"w1.weight", "w3.weight", "w2.weight"};

int64_t seed_of(int64_t expert, int64_t which) {
  return 10 * expert + which;
}

Tensors per_expert(const std::string& prefix, const std::array<std::string, 3>& names, DType dtype) {
  Tensors out;
  for (int64_t e = 0; e < kE; ++e) {
    out.emplace_back(prefix + "." + std::to_string(e) + "." + names[0], pattern({kI, kH}, seed_of(e, 0), dtype));
    out.emplace_back(prefix + "." + std::to_string(e) + "." + names[1], pattern({kI, kH}, seed_of(e, 1), dtype));
    out.emplace_back(prefix + "." + std::to_string(e) + "." + names[2], pattern({kH, kI}, seed_of(e, 2), dtype));
  }
  return out;
}

// Checks fused tensors element by element against the per-expert sources: gate rows, then up rows.
void expect_fused_from_sources(const FusedExperts& fused) {
  ASSERT_EQ(fused.gate_up_proj.shape(), (Shape{kE, 2 * kI, kH}));
  ASSERT_EQ(fused.down_proj.shape(), (Shape{kE, kH, kI}));
  EXPECT_TRUE(fused.gate_up_proj.is_contiguous());
  EXPECT_FALSE(fused.gate_up_proj_bias.defined());
  EXPECT_FALSE(fused.down_proj_bias.defined());
  EXPECT_TRUE(fused.has_gate);
  const std::vector<float> gate_up = values(fused.gate_up_proj);
  const std::vector<float> down = values(fused.down_proj);
  for (int64_t e = 0; e < kE; ++e) {
    const std::vector<float> gate = values(pattern({kI, kH}, seed_of(e, 0)));
    const std::vector<float> up = values(pattern({kI, kH}, seed_of(e, 1)));
    const std::vector<float> down_e = values(pattern({kH, kI}, seed_of(e, 2)));
    for (int64_t r = 0; r < kI; ++r) {
      for (int64_t c = 0; c < kH; ++c) {
        const auto at = static_cast<std::size_t>(r * kH + c);
        EXPECT_EQ(gate_up[static_cast<std::size_t>((e * 2 * kI + r) * kH + c)], gate[at])
            << "gate: expert " << e << " row " << r << " col " << c;
        EXPECT_EQ(gate_up[static_cast<std::size_t>((e * 2 * kI + kI + r) * kH + c)], up[at])
            << "up: expert " << e << " row " << r << " col " << c;
      }
    }
    for (int64_t i = 0; i < kH * kI; ++i)
      EXPECT_EQ(down[static_cast<std::size_t>(e * kH * kI + i)], down_e[static_cast<std::size_t>(i)])
          << "down: expert " << e << " element " << i;
  }
}

TEST(Checkpoint, SingleFileGivesMappedViews) {
  const fs::path dir = make_checkpoint({{"model.norm.weight", pattern({4}, 1)},
                                        {"lm_head.weight", pattern({6, 4}, 2, DType::bf16)},
                                        {"model.embed_tokens.weight", pattern({6, 4}, 3)}});
  const Checkpoint ckpt(dir.string());
  EXPECT_EQ(ckpt.config().at("model_type"), "qwen3_moe");
  EXPECT_EQ(ckpt.tensor_names(),
            (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}));
  EXPECT_TRUE(ckpt.contains("model.norm.weight"));
  EXPECT_FALSE(ckpt.contains("model.norm"));

  const Tensor head = ckpt.tensor("lm_head.weight", {6, 4});
  EXPECT_EQ(head.dtype(), DType::bf16);
  EXPECT_EQ(values(head), values(pattern({6, 4}, 2)));
  // Same dtype: the view of the mapped bytes, no copy.
  EXPECT_EQ(ckpt.load("lm_head.weight", DType::bf16).data(), head.data());
  EXPECT_EQ(ckpt.load("model.norm.weight", DType::f32, {4}).data(), ckpt.tensor("model.norm.weight").data());
}

TEST(Checkpoint, ConvertsDtypesAtLoad) {
  const fs::path dir = make_checkpoint({{"a.bf16", pattern({3, 5}, 4, DType::bf16)},
                                        {"b.f32", pattern({5, 3}, 5, DType::f32)},
                                        {"c.f16", pattern({7}, 6, DType::f16)},
                                        {"ids", Tensor::zeros({2}, DType::i32)}});
  const Checkpoint ckpt(dir.string());

  const Tensor a = ckpt.load("a.bf16", DType::f32, {3, 5});
  EXPECT_EQ(a.dtype(), DType::f32);
  EXPECT_NE(a.data(), ckpt.tensor("a.bf16").data());
  EXPECT_EQ(values(a), values(pattern({3, 5}, 4)));

  const Tensor b = ckpt.load("b.f32", DType::bf16);
  EXPECT_EQ(b.dtype(), DType::bf16);
  EXPECT_EQ(b.shape(), (Shape{5, 3}));
  EXPECT_EQ(values(b), values(pattern({5, 3}, 5)));

  const Tensor c = ckpt.load("c.f16", DType::bf16);
  EXPECT_EQ(c.dtype(), DType::bf16);
  EXPECT_EQ(values(c), values(pattern({7}, 6)));

  expect_error([&] { ckpt.load("a.bf16", DType::f32, {5, 3}); }, {"a.bf16 has shape [3, 5], expected [5, 3]"});
  expect_error([&] { ckpt.load("ids", DType::f32); }, {"ids holds i32", "does not convert"});
  expect_error([&] { ckpt.load("a.bf16", DType::i32); }, {"f32, f16 or bf16"});
}

TEST(Checkpoint, OpensShardsThroughTheIndex) {
  const fs::path dir = temp_dir();
  write_config(dir);
  save_safetensors((dir / "model-00001-of-00002.safetensors").string(),
                   {{"model.embed_tokens.weight", pattern({6, 4}, 1)}, {"model.norm.weight", pattern({4}, 2)}});
  save_safetensors((dir / "model-00002-of-00002.safetensors").string(), {{"lm_head.weight", pattern({6, 4}, 3)}});
  const json index = {{"metadata", {{"total_size", 216}}},
                      {"weight_map",
                       {{"model.embed_tokens.weight", "model-00001-of-00002.safetensors"},
                        {"model.norm.weight", "model-00001-of-00002.safetensors"},
                        {"lm_head.weight", "model-00002-of-00002.safetensors"}}}};
  write_text(dir / "model.safetensors.index.json", index.dump(2));

  const Checkpoint ckpt(dir.string());
  EXPECT_EQ(ckpt.tensor_names(),
            (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}));
  EXPECT_EQ(values(ckpt.tensor("lm_head.weight", {6, 4})), values(pattern({6, 4}, 3)));
  EXPECT_EQ(values(ckpt.tensor("model.norm.weight")), values(pattern({4}, 2)));
  EXPECT_EQ(values(ckpt.load("model.embed_tokens.weight", DType::bf16)), values(pattern({6, 4}, 1)));
}

TEST(Checkpoint, ListsAndReturnsSubConfigs) {
  const json config = {
      {"model_type", "qwen3_vl_moe"},       {"text_config", {{"model_type", "qwen3_vl_moe_text"}, {"hidden_size", 64}}},
      {"vision_config", {{"depth", 2}}},    {"audio_encoder", {{"model_type", "whisper"}}},
      {"rope_scaling", {{"type", "yarn"}}}, {"architectures", {"Qwen3VLMoeForConditionalGeneration"}},
      {"quantization_config", {{"quant_method", "fp8"}}}};
  const Checkpoint ckpt(make_checkpoint({{"x", pattern({1}, 0)}}, config).string());
  EXPECT_EQ(ckpt.sub_config_names(), (std::vector<std::string>{"audio_encoder", "text_config", "vision_config"}));
  EXPECT_EQ(ckpt.sub_config("text_config").at("hidden_size"), 64);
  EXPECT_EQ(ckpt.sub_config("vision_config").at("depth"), 2);
  expect_error([&] { ckpt.sub_config("speech_config"); },
               {"no sub-config 'speech_config'", "audio_encoder, text_config, vision_config"});
  // Objects that are not sub-configs (quantization_config ends in "_config" but is no backbone).
  expect_error([&] { ckpt.sub_config("rope_scaling"); }, {"no sub-config 'rope_scaling'"});
  expect_error([&] { ckpt.sub_config("quantization_config"); }, {"no sub-config 'quantization_config'"});

  const Checkpoint plain(make_checkpoint({{"x", pattern({1}, 0)}}).string());
  EXPECT_TRUE(plain.sub_config_names().empty());
  expect_error([&] { plain.sub_config("text_config"); }, {"no sub-config 'text_config'", "it has none"});
}

TEST(Checkpoint, FusesPerExpertQwenWeights) {
  const std::string prefix = "model.layers.3.mlp.experts";
  Tensors tensors = per_expert(prefix, kQwenNames, DType::bf16);
  tensors.emplace_back("model.layers.3.mlp.gate.weight", pattern({kE, kH}, 99));
  const Checkpoint ckpt(make_checkpoint(tensors).string());
  {
    SCOPED_TRACE("bf16 file as f32");
    const FusedExperts fused = ckpt.experts(prefix, kE, kH, kI, DType::f32);
    EXPECT_EQ(fused.gate_up_proj.dtype(), DType::f32);
    expect_fused_from_sources(fused);
  }
  {
    SCOPED_TRACE("bf16 file as bf16");
    const FusedExperts fused = ckpt.experts(prefix, kE, kH, kI, DType::bf16);
    EXPECT_EQ(fused.down_proj.dtype(), DType::bf16);
    expect_fused_from_sources(fused);
  }
}

TEST(Checkpoint, FusesPerExpertMixtralWeights) {
  const std::string prefix = "model.layers.0.block_sparse_moe.experts";
  const Checkpoint ckpt(make_checkpoint(per_expert(prefix, kMixtralNames, DType::f32)).string());
  const FusedExperts fused = ckpt.experts(prefix, kE, kH, kI, DType::bf16);
  EXPECT_EQ(fused.gate_up_proj.dtype(), DType::bf16);
  expect_fused_from_sources(fused);
}

TEST(Checkpoint, LoadsFusedExpertsAsTheyAre) {
  const std::string prefix = "model.layers.1.mlp.experts";
  const Checkpoint ckpt(make_checkpoint({{prefix + ".gate_up_proj", pattern({kE, 2 * kI, kH}, 1, DType::bf16)},
                                         {prefix + ".down_proj", pattern({kE, kH, kI}, 2, DType::bf16)},
                                         {prefix + ".gate_up_proj_bias", pattern({kE, 2 * kI}, 3, DType::bf16)},
                                         {prefix + ".down_proj_bias", pattern({kE, kH}, 4, DType::bf16)}})
                            .string());
  const FusedExperts same = ckpt.experts(prefix, kE, kH, kI, DType::bf16);
  EXPECT_EQ(same.gate_up_proj.data(), ckpt.tensor(prefix + ".gate_up_proj").data());
  EXPECT_EQ(same.down_proj.data(), ckpt.tensor(prefix + ".down_proj").data());
  EXPECT_EQ(same.gate_up_proj_bias.data(), ckpt.tensor(prefix + ".gate_up_proj_bias").data());
  EXPECT_EQ(same.down_proj_bias.data(), ckpt.tensor(prefix + ".down_proj_bias").data());

  const FusedExperts converted = ckpt.experts(prefix, kE, kH, kI, DType::f32);
  EXPECT_EQ(converted.gate_up_proj.dtype(), DType::f32);
  EXPECT_EQ(values(converted.gate_up_proj), values(pattern({kE, 2 * kI, kH}, 1)));
  EXPECT_EQ(values(converted.down_proj), values(pattern({kE, kH, kI}, 2)));
  EXPECT_EQ(values(converted.gate_up_proj_bias), values(pattern({kE, 2 * kI}, 3)));
  EXPECT_EQ(values(converted.down_proj_bias), values(pattern({kE, kH}, 4)));

  expect_error([&] { ckpt.experts(prefix, kE, kH, kI + 1, DType::f32); },
               {prefix + ".gate_up_proj has shape [3, 4, 4], expected [3, 6, 4]"});
}

TEST(Checkpoint, FusedExpertsNeedBothWeightsAndBothBiases) {
  const std::string prefix = "model.layers.1.mlp.experts";
  const Checkpoint no_down(make_checkpoint({{prefix + ".gate_up_proj", pattern({kE, 2 * kI, kH}, 1)}}).string());
  expect_error([&] { no_down.experts(prefix, kE, kH, kI, DType::f32); },
               {prefix + ".down_proj is missing", "[3, 4, 2]"});
  const Checkpoint one_bias(make_checkpoint({{prefix + ".gate_up_proj", pattern({kE, 2 * kI, kH}, 1)},
                                             {prefix + ".down_proj", pattern({kE, kH, kI}, 2)},
                                             {prefix + ".down_proj_bias", pattern({kE, kH}, 4)}})
                                .string());
  expect_error([&] { one_bias.experts(prefix, kE, kH, kI, DType::f32); }, {"but not " + prefix + ".gate_up_proj_bias"});
}

TEST(Checkpoint, RejectsBrokenPerExpertWeights) {
  const std::string prefix = "model.layers.2.mlp.experts";
  {
    SCOPED_TRACE("missing expert 2's up_proj");
    Tensors tensors = per_expert(prefix, kQwenNames, DType::f32);
    std::erase_if(tensors, [&](const auto& t) { return t.first == prefix + ".2.up_proj.weight"; });
    const Checkpoint ckpt(make_checkpoint(tensors).string());
    expect_error([&] { ckpt.experts(prefix, kE, kH, kI, DType::f32); },
                 {prefix + ".2.up_proj.weight is missing", "[2, 4]", "expert 2 of 3"});
  }
  {
    SCOPED_TRACE("fewer experts than the config says");
    const Checkpoint ckpt(make_checkpoint(per_expert(prefix, kMixtralNames, DType::f32)).string());
    expect_error([&] { ckpt.experts(prefix, kE + 1, kH, kI, DType::f32); },
                 {prefix + ".3.w1.weight is missing", "[2, 4]"});
    expect_error([&] { ckpt.experts(prefix, kE - 1, kH, kI, DType::f32); },
                 {prefix + ".2.w", "is expert 2, but the layer has 2 experts"});
  }
  {
    SCOPED_TRACE("wrong shape of expert 1's down_proj");
    Tensors tensors = per_expert(prefix, kQwenNames, DType::f32);
    for (auto& [name, t] : tensors)
      if (name == prefix + ".1.down_proj.weight") t = pattern({kI, kH}, 0);
    const Checkpoint ckpt(make_checkpoint(tensors).string());
    expect_error([&] { ckpt.experts(prefix, kE, kH, kI, DType::f32); },
                 {prefix + ".1.down_proj.weight has shape [2, 4], expected [4, 2]"});
  }
  {
    SCOPED_TRACE("mixed layouts");
    Tensors tensors = per_expert(prefix, kQwenNames, DType::f32);
    tensors.emplace_back(prefix + ".0.w1.weight", pattern({kI, kH}, 0));
    const Checkpoint ckpt(make_checkpoint(tensors).string());
    expect_error([&] { ckpt.experts(prefix, kE, kH, kI, DType::f32); },
                 {"mixes expert layouts", prefix + ".0.down_proj.weight", prefix + ".0.w1.weight"});
  }
  {
    SCOPED_TRACE("mixed fused and per-expert");
    Tensors tensors = per_expert(prefix, kQwenNames, DType::f32);
    tensors.emplace_back(prefix + ".gate_up_proj", pattern({kE, 2 * kI, kH}, 0));
    const Checkpoint ckpt(make_checkpoint(tensors).string());
    expect_error([&] { ckpt.experts(prefix, kE, kH, kI, DType::f32); },
                 {"mixes expert layouts", prefix + ".gate_up_proj"});
  }
  {
    SCOPED_TRACE("no known layout");
    const Checkpoint ckpt(make_checkpoint({{prefix + ".0.fc1.weight", pattern({kI, kH}, 0)},
                                           {prefix + ".0.fc2.weight", pattern({kH, kI}, 0)}})
                              .string());
    expect_error([&] { ckpt.experts(prefix, kE, kH, kI, DType::f32); },
                 {"no expert weights under " + prefix, prefix + ".0.fc1.weight, " + prefix + ".0.fc2.weight"});
    expect_error([&] { ckpt.experts("model.layers.9.mlp.experts", kE, kH, kI, DType::f32); },
                 {"no tensor name starts with model.layers.9.mlp.experts."});
  }
}

TEST(Checkpoint, MissingTensorSuggestsCloseNames) {
  const Checkpoint ckpt(make_checkpoint({{"model.layers.0.mlp.gate.weight", pattern({4, 2}, 0)},
                                         {"model.layers.1.mlp.gate.weight", pattern({4, 2}, 0)},
                                         {"model.layers.0.self_attn.q_proj.weight", pattern({4, 4}, 0)},
                                         {"lm_head.weight", pattern({4, 4}, 0)}})
                            .string());
  expect_error([&] { ckpt.tensor("model.layers.0.mlp.gates.weight"); },
               {"no tensor named 'model.layers.0.mlp.gates.weight'",
                "closest names: model.layers.0.mlp.gate.weight, model.layers.1.mlp.gate.weight"});
  expect_error(
      [&] {
        ckpt.tensor("model.layers.0.mlp.gate.weight", {2, 4});
      },
      {"model.layers.0.mlp.gate.weight has shape [4, 2], expected [2, 4]"});
}

TEST(Checkpoint, RejectsMissingFiles) {
  {
    SCOPED_TRACE("no config.json");
    const fs::path dir = temp_dir();
    save_safetensors((dir / "model.safetensors").string(), {{"x", pattern({1}, 0)}});
    expect_error([&] { Checkpoint{dir.string()}; }, {dir.string(), "no config.json"});
  }
  {
    SCOPED_TRACE("no safetensors");
    const fs::path dir = temp_dir();
    write_config(dir);
    expect_error([&] { Checkpoint{dir.string()}; },
                 {dir.string(), "model.safetensors nor model.safetensors.index.json"});
  }
  {
    SCOPED_TRACE("config.json is not JSON");
    const fs::path dir = temp_dir();
    write_text(dir / "config.json", "{\"model_type\": ");
    expect_error([&] { Checkpoint{dir.string()}; }, {"config.json: not valid JSON"});
  }
  expect_error([&] { Checkpoint{(temp_dir() / "absent").string()}; }, {"absent: not a directory"});
}

// A sharded checkpoint whose index is `index_text`; shard 1 holds a and b, shard 2 holds c.
fs::path make_sharded(const std::string& index_text, const Tensors& extra_in_shard2 = {}) {
  const fs::path dir = temp_dir();
  write_config(dir);
  save_safetensors((dir / "s1.safetensors").string(), {{"a", pattern({2}, 1)}, {"b", pattern({2}, 2)}});
  Tensors shard2 = {{"c", pattern({2}, 3)}};
  shard2.insert(shard2.end(), extra_in_shard2.begin(), extra_in_shard2.end());
  save_safetensors((dir / "s2.safetensors").string(), shard2);
  write_text(dir / "model.safetensors.index.json", index_text);
  return dir;
}

TEST(Checkpoint, RejectsInconsistentIndexes) {
  const auto open = [](const fs::path& dir) { return Checkpoint(dir.string()); };
  EXPECT_EQ(open(make_sharded(R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors",
                                  "c": "s2.safetensors"}})"))
                .tensor_names()
                .size(),
            3u);
  expect_error([&] { open(make_sharded(R"({"weight_map": {"a": "s1.safetensors", "c": "s3.safetensors"}})")); },
               {"shard s3.safetensors", "for tensor 'c'", "does not exist"});
  expect_error([&] { open(make_sharded(R"({"weight_map": {"a": "s1.safetensors", "d": "s2.safetensors"}})")); },
               {"tensor 'd'", "under shard s2.safetensors, which does not hold it"});
  expect_error([&] { open(make_sharded(R"({"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}})")); },
               {"tensor 'a' is listed twice", "s1.safetensors and s2.safetensors"});
  expect_error(
      [&] {
        open(make_sharded(R"({"weight_map": {"a": "s1.safetensors", "c": "s2.safetensors"}})",
                          {{"a", pattern({2}, 9)}}));
      },
      {"tensor 'a' is held by two shards", "s1.safetensors", "s2.safetensors"});
  expect_error([&] { open(make_sharded(R"({"weight_map": {"a": "../s1.safetensors"}})")); },
               {"shard '../s1.safetensors' of tensor 'a' must be a relative path"});
  expect_error([&] { open(make_sharded(R"({"weight_map": {"a": 1}})")); }, {"weight_map[\"a\"] must name a shard"});
  expect_error([&] { open(make_sharded(R"({"metadata": {}})")); }, {"expected a \"weight_map\" object"});
  expect_error([&] { open(make_sharded(R"({"weight_map": )")); }, {"model.safetensors.index.json: not valid JSON"});
}

}  // namespace
}  // namespace moekit

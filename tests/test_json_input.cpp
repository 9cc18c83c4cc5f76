// Checked JSON reading (src/moekit/io/json_input.h): the nesting limit and repeated keys, as the helper
// reports them and as the checkpoint's readers of config.json and the shard index do; and
// describe_json, which error messages print values with.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/io/json_input.h"
#include "moekit/model/checkpoint.h"
#include "moekit/model/model_config.h"
#include "moekit/safetensors.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::throws_error_with;

const std::string kLimit = "deeper than " + std::to_string(kMaxJsonDepth) + " levels";

// `depth` arrays, one inside the other, around 1.
std::string nested_arrays(int depth) {
  return std::string(static_cast<std::size_t>(depth), '[') + "1" + std::string(static_cast<std::size_t>(depth), ']');
}

// `depth` objects {"a": ...}, one inside the other, around 1.
std::string nested_objects(int depth) {
  std::string text;
  for (int i = 0; i < depth; ++i) text += R"({"a":)";
  return text + "1" + std::string(static_cast<std::size_t>(depth), '}');
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

TEST(JsonInput, ParsesDocumentsAtTheDepthLimit) {
  EXPECT_EQ(parse_json(nested_arrays(kMaxJsonDepth), "arrays.json").dump().size(), 2u * kMaxJsonDepth + 1);
  const json objects = parse_json(nested_objects(kMaxJsonDepth), "objects.json");
  const json* inner = &objects;
  for (int i = 0; i < kMaxJsonDepth; ++i) inner = &(*inner)["a"];
  EXPECT_EQ(*inner, 1);
}

TEST(JsonInput, RefusesDocumentsDeeperThanTheLimit) {
  EXPECT_TRUE(throws_error_with([] { parse_json(nested_arrays(kMaxJsonDepth + 1), "arrays.json"); },
                                {"arrays.json: JSON nests " + kLimit + " at [0][0][0]", "..."}));
  EXPECT_TRUE(throws_error_with([] { parse_json(nested_objects(100000), "objects.json"); },
                                {"objects.json: JSON nests " + kLimit + " at a.a.a.a", "..."}));
  // The path is short whatever the depth, and names array elements by index.
  try {
    parse_json(R"({"k": [0, 1, )" + nested_objects(200) + "]}", "mixed.json");
    ADD_FAILURE() << "did not throw";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("at k[2].a.a"), std::string::npos) << message;
    EXPECT_LT(message.size(), 300u) << message;
  }
}

TEST(JsonInput, RefusesRepeatedKeysNamingTheirPath) {
  EXPECT_TRUE(
      throws_error_with([] { parse_json(R"({"a": 1, "a": 2})", "top.json"); }, {"top.json: the key a appears twice"}));
  EXPECT_TRUE(throws_error_with([] { parse_json(R"({"x": [{}, {"b": {"c": 1, "c": 1}}]})", "deep.json"); },
                                {"deep.json: the key x[1].b.c appears twice"}));
  // Equal keys in different objects are not repeats.
  EXPECT_NO_THROW(parse_json(R"({"a": {"a": 1}, "b": {"a": 2}, "c": [{"a": 3}, {"a": 4}]})", "ok.json"));
  // A caller may take repeats over (read_index does, to name both shards); the last one is kept.
  JsonReadOptions options;
  options.allow_duplicate_key = [](int depth, const std::string& key) { return depth == 2 && key == "t"; };
  EXPECT_EQ(parse_json(R"({"m": {"t": 1, "t": 2}})", "index.json", options)["m"]["t"], 2);
  EXPECT_TRUE(throws_error_with([&] { parse_json(R"({"t": 1, "t": 2})", "index.json", options); },
                                {"the key t appears twice"}));
}

TEST(JsonInput, CallsTheCallersCallbackForKeysAndScalars) {
  std::vector<std::string> seen;
  JsonReadOptions options;
  options.callback = [&seen](int depth, json::parse_event_t event, const json& parsed) {
    seen.push_back(std::to_string(depth) + (event == json::parse_event_t::key ? " key " : " value ") + parsed.dump());
  };
  const json value = parse_json(R"({"b": 1, "a": {"c": [true, "s"]}})", "cb.json", options);
  EXPECT_EQ(seen, (std::vector<std::string>{"1 key \"b\"", "1 value 1", "1 key \"a\"", "2 key \"c\"", "3 value true",
                                            "3 value \"s\""}));
  EXPECT_EQ(value, json::parse(R"({"a": {"c": [true, "s"]}, "b": 1})"));
}

TEST(JsonInput, ErrorsNameTheSource) {
  EXPECT_TRUE(throws_error_with([] { parse_json("{\"a\": ", "broken.json"); }, {"broken.json: not valid JSON"}));
  EXPECT_TRUE(throws_error_with([] { read_json_file("/no/such/file.json"); }, {"/no/such/file.json: cannot open"}));
  const fs::path path = test::temp_dir("json_input") / "deep.json";
  write_text(path, nested_arrays(1000));
  EXPECT_TRUE(throws_error_with([&] { read_json_file(path); }, {path.string() + ": JSON nests " + kLimit}));
}

TEST(JsonInput, DescribesValuesBriefly) {
  EXPECT_EQ(describe_json(json(3)), "3");
  EXPECT_EQ(describe_json(json(nullptr)), "null");
  EXPECT_EQ(describe_json(json("q\"x")), R"("q\"x")");
  EXPECT_EQ(describe_json(json(std::string(100, 'z'))), "\"" + std::string(64, 'z') + "...\"");
  // A cut never splits a UTF-8 character: 63 bytes, then a two-byte one.
  EXPECT_EQ(describe_json(json(std::string(63, 'z') + "\xC3\xA9 tail")), "\"" + std::string(63, 'z') + "...\"");
  EXPECT_EQ(describe_json(json::parse(R"({"a": [1, 2], "b": "x"})")), R"({"a":[1,2],"b":"x"})");
  EXPECT_EQ(describe_json(json::array()), "[]");
  EXPECT_EQ(describe_json_with_type(json::parse("[1]")), "array [1]");
  EXPECT_EQ(describe_json_with_type(json("s")), "string \"s\"");
  // Long or deep containers are cut near 80 characters without recursing: this one is built in memory,
  // far deeper than any parsed document may be.
  json deep = 1;
  for (int i = 0; i < 100000; ++i) deep = json::array({std::move(deep)});
  const std::string described = describe_json(deep);
  EXPECT_EQ(described, std::string(80, '[') + "...");
  EXPECT_LE(describe_json(json(std::vector<int>(1000, 7))).size(), 84u);
}

// The checked parse's value is nlohmann's own on a document the size of a large tokenizer.json. Both
// times are printed for reading; a speed bound belongs in a benchmark, not in an assertion.
TEST(JsonInput, ALargeDocumentParsesAsNlohmannAloneDoes) {
  // About the shape of a large tokenizer.json: a vocab of 150,000 keys and as many merges.
  std::string text = R"({"model": {"vocab": {)";
  for (int i = 0; i < 150000; ++i) text += (i ? ",\"" : "\"") + std::to_string(i) + "tok\":" + std::to_string(i);
  text += R"(}, "merges": [)";
  for (int i = 0; i < 150000; ++i) text += (i ? ",\"" : "\"") + std::to_string(i) + " t\"";
  text += "]}}";
  const auto start = std::chrono::steady_clock::now();
  const json value = parse_json(text, "large.json");
  const double checked = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto plain_start = std::chrono::steady_clock::now();
  const json plain = json::parse(text);
  const double unchecked = std::chrono::duration<double>(std::chrono::steady_clock::now() - plain_start).count();
  EXPECT_EQ(value, plain);
  std::printf("parse of %zu bytes: %.3f s checked, %.3f s with nlohmann alone\n", text.size(), checked, unchecked);
}

// config.json and the index, read by Checkpoint.
fs::path checkpoint_dir(const std::string& config_text) {
  const fs::path dir = test::temp_dir("json_input");
  write_text(dir / "config.json", config_text);
  return dir;
}

TEST(JsonInputCheckpoint, DeepConfigIsRefusedNamingTheFile) {
  const fs::path dir = checkpoint_dir(R"({"model_type": "qwen3_moe", "rope_scaling": )" + nested_objects(100000) + "}");
  EXPECT_TRUE(throws_error_with([&] { Checkpoint{dir.string()}; },
                                {(dir / "config.json").string(), "JSON nests " + kLimit + " at rope_scaling.a.a"}));
}

TEST(JsonInputCheckpoint, RepeatedConfigKeyIsRefused) {
  const fs::path dir = checkpoint_dir(R"({"model_type": "qwen3_moe", "hidden_size": 8, "hidden_size": 16})");
  EXPECT_TRUE(throws_error_with([&] { Checkpoint{dir.string()}; }, {"config.json: the key hidden_size appears twice"}));
}

TEST(JsonInputCheckpoint, DeepIndexValueIsRefusedNamingTheFile) {
  const fs::path dir = checkpoint_dir(R"({"model_type": "qwen3_moe"})");
  write_text(dir / "model.safetensors.index.json",
             R"({"weight_map": {"model.embed_tokens.weight": )" + nested_arrays(100000) + "}}");
  EXPECT_TRUE(throws_error_with(
      [&] { Checkpoint{dir.string()}; },
      {"model.safetensors.index.json: JSON nests " + kLimit + " at weight_map.model.embed_tokens.weight[0][0]"}));
}

TEST(JsonInputCheckpoint, IndexStillNamesBothShardsOfATensorListedTwice) {
  const fs::path dir = checkpoint_dir(R"({"model_type": "qwen3_moe"})");
  save_safetensors((dir / "s1.safetensors").string(), {{"a", Tensor::zeros({2}, DType::f32)}});
  write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}})");
  EXPECT_TRUE(throws_error_with([&] { Checkpoint{dir.string()}; },
                                {"tensor 'a' is listed twice", "s1.safetensors and s2.safetensors"}));
  // Elsewhere in the index a repeated key is the helper's error.
  write_text(dir / "model.safetensors.index.json", R"({"weight_map": {}, "weight_map": {}})");
  EXPECT_TRUE(throws_error_with([&] { Checkpoint{dir.string()}; },
                                {"model.safetensors.index.json: the key weight_map appears twice"}));
}

TEST(JsonInputCheckpoint, BadIndexValueIsDescribedBriefly) {
  const fs::path dir = checkpoint_dir(R"({"model_type": "qwen3_moe"})");
  write_text(dir / "model.safetensors.index.json",
             R"({"weight_map": {"a": )" + nested_arrays(kMaxJsonDepth - 2) + "}}");
  EXPECT_TRUE(throws_error_with([&] { Checkpoint{dir.string()}; },
                                {"weight_map[\"a\"] must name a shard file, got [[[[", "..."}));
}

TEST(JsonInputModelConfig, ErrorsDescribeDeepValuesBriefly) {
  json config = read_json_file(fs::path(MOEKIT_FIXTURES_DIR) / "models" / "qwen3_moe" / "config.json");
  config["hidden_size"] = json::parse(nested_arrays(kMaxJsonDepth - 1));
  try {
    parse_model_config(config);
    ADD_FAILURE() << "did not throw";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("'hidden_size' must be an integer, got array [[[["), std::string::npos) << message;
    EXPECT_LT(message.size(), 300u) << message;
  }
}

}  // namespace
}  // namespace moekit

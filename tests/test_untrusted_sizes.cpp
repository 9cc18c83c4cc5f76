// Sizes from untrusted input: products of config values that leave int64 are errors naming the fields
// (never undefined behaviour), a model or KV cache that cannot fit in memory is refused with the numbers
// before anything is allocated, and a num_hidden_layers far past what the checkpoint holds fails at its
// first missing tensor rather than in std::bad_alloc.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moekit/checked_math.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/model/weight_reader.h"
#include "moekit/safetensors.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace moekit;

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// The message of the moekit::Error that fn throws, or "no error".
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

TEST(CheckedMath, ResultsInRangeAndErrorsNamingWhatOverflowed) {
  EXPECT_EQ(checked_mul(3, 5, "x"), 15);
  EXPECT_EQ(checked_mul(-4, kMax / 4, "x"), -4 * (kMax / 4));
  EXPECT_EQ(checked_add(kMax - 1, 1, "x"), kMax);
  const std::string mul = error_of([] { checked_mul(int64_t{1} << 32, int64_t{1} << 31, "heads x head_dim"); });
  EXPECT_CONTAINS(mul, "heads x head_dim: 4294967296 x 2147483648 does not fit in 64 bits");
  EXPECT_CONTAINS(error_of([] { checked_add(kMax, 1, "positions"); }), "positions: ");
  EXPECT_CONTAINS(error_of([] { checked_mul(std::numeric_limits<int64_t>::min(), -1, "m"); }), "does not fit");
}

TEST(AvailableMemory, TheCpuReportsSome) {
  const auto bytes = available_memory_bytes(Device::cpu());
  ASSERT_TRUE(bytes.has_value());
  EXPECT_GT(*bytes, std::size_t{0});
}

TEST(AvailableMemory, RequireMemoryRefusesWithTheNumbers) {
  EXPECT_NO_THROW(require_memory(Device::cpu(), 1, "one byte"));
  const std::size_t available = *available_memory_bytes(Device::cpu());
  const std::string error = error_of([&] { require_memory(Device::cpu(), available * 4, "the test's tensor"); });
  EXPECT_CONTAINS(error, "the test's tensor needs ");
  EXPECT_CONTAINS(error, std::to_string(available * 4) + " bytes) on cpu but ");
  EXPECT_CONTAINS(error, " is available");
}

TEST(FormatBytes, PicksTheUnit) {
  EXPECT_EQ(format_bytes(12), "12 bytes");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(std::size_t{3} << 20), "3.0 MiB");
  EXPECT_EQ(format_bytes(std::size_t{24} << 30), "24.0 GiB");
}

// A copy of the qwen3_moe fixture checkpoint (float32, 3 layers) whose config.json a test edits.
class UntrustedSizes : public ::testing::Test {
 protected:
  void SetUp() override {
    const fs::path fixture = fs::path(MOEKIT_FIXTURES_DIR) / "models" / "qwen3_moe";
    dir_ = fs::temp_directory_path() / ("moekit_sizes_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(fixture / "model.safetensors", dir_ / "model.safetensors");
    std::ifstream in(fixture / "config.json");
    config_ = json::parse(in);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write_config() const { std::ofstream(dir_ / "config.json") << config_.dump(2); }
  std::string load_error(const LoadOptions& options = {}) const {
    write_config();
    return error_of([&] { CausalLM::from_pretrained(dir_.string(), options); });
  }

  fs::path dir_;
  json config_;
};

TEST_F(UntrustedSizes, HeadsTimesHeadDimThatOverflowsIsNamed) {
  config_["head_dim"] = int64_t{1} << 62;
  const std::string error = load_error();
  EXPECT_CONTAINS(error, "num_attention_heads x head_dim: 4 x 4611686018427387904 does not fit in 64 bits");
}

TEST_F(UntrustedSizes, IntermediateSizeThatOverflowsWhenDoubledIsNamed) {
  config_["moe_intermediate_size"] = kMax / 2 + 1;
  EXPECT_CONTAINS(load_error(), "2 x intermediate size: 2 x 4611686018427387904 does not fit in 64 bits");
}

TEST_F(UntrustedSizes, LayersFarPastTheCheckpointFailAtTheFirstMissingOne) {
  config_["num_hidden_layers"] = 60'000;
  EXPECT_CONTAINS(load_error(), "no tensor named 'model.layers.3.");
  config_["num_hidden_layers"] = 1'000'000'000;
  EXPECT_CONTAINS(load_error(), "field 'num_hidden_layers' must be <= 65536 (moekit's bound on the layer count), "
                                "got 1000000000");
}

TEST_F(UntrustedSizes, MaxNewTokensThatOverflowsThePositionCountIsNamed) {
  write_config();
  CausalLM model = CausalLM::from_pretrained(dir_.string());
  GenerationConfig g;
  g.max_new_tokens = kMax;
  const std::vector<int32_t> prompt = {5, 6, 7};
  EXPECT_CONTAINS(error_of([&] { model.generate(prompt, g); }),
                  "generate: prompt tokens + max_new_tokens - 1: 3 + 9223372036854775806 does not fit in 64 bits");
  // One token fewer fits in int64, but not the cache's bytes.
  EXPECT_CONTAINS(error_of([&] { model.generate(std::vector<int32_t>{5}, g); }), "does not fit in 64 bits");
}

TEST_F(UntrustedSizes, KvCacheThatCannotFitIsRefusedBeforeGenerating) {
  write_config();
  CausalLM model = CausalLM::from_pretrained(dir_.string());
  GenerationConfig g;
  // 3 layers x 2 x 2 heads x 16 x 4 bytes = 768 bytes a position on the CPU: 2^40 positions are 768 TiB.
  g.max_new_tokens = int64_t{1} << 40;
  bool produced = false;
  g.on_token = [&](int32_t) { produced = true; };
  const std::string error = error_of([&] { model.generate(std::vector<int32_t>{5, 6}, g); });
  EXPECT_CONTAINS(error, "generate: the KV cache for 1099511627777 positions (2 prompt tokens + max_new_tokens "
                         "1099511627776) needs 768.0 TiB");
  EXPECT_FALSE(produced);
}

// The fixture's tensors and one more, of `extra_bytes` that the file holds as a hole (no disk, no memory):
// a checkpoint bigger than the machine, with nothing read.
void write_with_sparse_extra(const fs::path& source, const fs::path& target, std::size_t extra_bytes) {
  SafetensorsFile f(source.string());
  json header = json::object();
  std::vector<char> data;
  for (const auto& name : f.names()) {
    const SafetensorsTensorInfo& info = f.info(name);
    const std::size_t begin = data.size();
    const Tensor t = f.tensor(name);
    const char* bytes = static_cast<const char*>(t.data());
    data.insert(data.end(), bytes, bytes + t.nbytes());
    header[name] = {{"dtype", info.dtype_name}, {"shape", info.shape}, {"data_offsets", {begin, data.size()}}};
  }
  const std::size_t rows = extra_bytes / (4096 * 2) + 1;
  header["model.layers.0.mlp.extra.weight"] = {
      {"dtype", "BF16"}, {"shape", {rows, 4096}}, {"data_offsets", {data.size(), data.size() + rows * 4096 * 2}}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(target, std::ios::binary);
  const uint64_t length = text.size();
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << text;
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  fs::resize_file(target, 8 + text.size() + data.size() + rows * 4096 * 2);
}

TEST_F(UntrustedSizes, WeightsThatCannotFitAreRefusedBeforeLoading) {
  const std::size_t available = *available_memory_bytes(Device::cpu());
  write_with_sparse_extra(fs::path(MOEKIT_FIXTURES_DIR) / "models" / "qwen3_moe" / "model.safetensors",
                          dir_ / "model.safetensors", 2 * available);
  // bf16 stored, loaded as f32: twice the file's bytes.
  const std::string error = load_error({.dtype = DType::f32});
  EXPECT_CONTAINS(error, "from_pretrained: " + dir_.string() + " in f32 (its weights) needs ");
  EXPECT_CONTAINS(error, " on cpu but ");
  EXPECT_CONTAINS(error, " is available");
  // Kept in bf16 it is still twice what the machine has.
  EXPECT_CONTAINS(load_error({.dtype = DType::bf16}), " in bf16 (its weights) needs ");
}

}  // namespace

// The same refusals against a GPU's free memory.
class UntrustedSizesCuda : public UntrustedSizes {
 protected:
  void SetUp() override {
    std::string why;
    if (!device_available(Device::cuda(), &why)) GTEST_SKIP() << "no GPU: " << why;
    UntrustedSizes::SetUp();
  }
};

TEST_F(UntrustedSizesCuda, KvCacheThatCannotFitIsRefusedBeforeGenerating) {
  write_config();
  CausalLM model = CausalLM::from_pretrained(dir_.string(), {.device = Device::cuda()});
  GenerationConfig g;
  g.max_new_tokens = int64_t{1} << 40;  // the cache in float32 on the GPU too: 768 TiB
  const std::string error = error_of([&] { model.generate(std::vector<int32_t>{5, 6}, g); });
  EXPECT_CONTAINS(error, "generate: the KV cache for 1099511627777 positions");
  EXPECT_CONTAINS(error, "needs 768.0 TiB");
  EXPECT_CONTAINS(error, " on cuda:0 but ");
  // A generation that fits still runs after the refusal.
  g.max_new_tokens = 4;
  EXPECT_EQ(model.generate(std::vector<int32_t>{5, 6}, g).tokens.size(), 4u);
}

TEST_F(UntrustedSizesCuda, WeightsThatCannotFitAreRefusedBeforeLoading) {
  const std::optional<std::size_t> available = available_memory_bytes(Device::cuda());
  ASSERT_TRUE(available.has_value());
  write_with_sparse_extra(fs::path(MOEKIT_FIXTURES_DIR) / "models" / "qwen3_moe" / "model.safetensors",
                          dir_ / "model.safetensors", *available + (std::size_t{1} << 30));
  const std::string error = load_error({.dtype = DType::bf16, .device = Device::cuda()});
  EXPECT_CONTAINS(error, " in bf16 (its weights) needs ");
  EXPECT_CONTAINS(error, " on cuda:0 but ");
}

// The safetensors reader and writer, and the `moekit experts` command that runs a layer from such files.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>

#include "harness.h"
#include "moekit/safetensors.h"
#include "moekit/testing/random_problem.h"
#include "moekit/testing/reference.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  return test::temp_dir("moekit_safetensors");
}

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const uint8_t* data, std::size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// A safetensors buffer from a header text and a data section of `data_bytes` bytes (0, 1, 2, ...).
std::vector<uint8_t> make_buffer(const std::string& header, std::size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes);
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>((uint64_t{header.size()} >> (8 * i)) & 0xff);
  if (!header.empty()) std::memcpy(out.data() + 8, header.data(), header.size());
  for (std::size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = static_cast<uint8_t>(i);
  return out;
}

// Runs fn and expects a moekit::Error whose message contains `needle`. Any other exception escapes and
// fails the test; so would a crash.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message does not mention \"" << needle << "\": " << e.what();
    return;
  }
  ADD_FAILURE() << "no moekit::Error thrown; expected one mentioning \"" << needle << "\"";
}

void expect_parse_error(const std::string& header, std::size_t data_bytes, const std::string& needle) {
  const std::vector<uint8_t> buffer = make_buffer(header, data_bytes);
  SCOPED_TRACE(header);
  expect_error([&] { parse_safetensors(buffer.data(), buffer.size(), "test.safetensors"); }, needle);
}

Tensor random_bytes_tensor(const Shape& shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<uint8_t*>(t.data());
  for (std::size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return ca.nbytes() == cb.nbytes() && (ca.nbytes() == 0 || std::memcmp(ca.data(), cb.data(), ca.nbytes()) == 0);
}

constexpr DType kAllDTypes[] = {DType::f32, DType::f16,     DType::bf16,    DType::i32,  DType::i64,
                                DType::u8,  DType::f8_e4m3, DType::f4_e2m1, DType::ue8m0};

TEST(Safetensors, RoundTripsEveryDtypeAndShape) {
  const fs::path path = temp_dir() / "all.safetensors";
  std::mt19937 rng(1);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (DType dtype : kAllDTypes) {
    std::vector<Shape> shapes = {{2, 3}, {5}, {0}, {3, 0, 2}, {1, 1, 7}};
    // A 0-d f4_e2m1 tensor would be half a byte: the writer refuses it (tested below).
    if (dtype != DType::f4_e2m1) shapes.push_back({});
    for (std::size_t i = 0; i < shapes.size(); ++i)
      tensors.emplace_back(std::string(dtype_name(dtype)) + "_" + std::to_string(i),
                           random_bytes_tensor(shapes[i], dtype, rng));
  }
  save_safetensors(path, tensors);

  const SafetensorsFile file(path);
  EXPECT_EQ(file.names().size(), tensors.size());
  EXPECT_TRUE(file.metadata().empty());
  for (const auto& [name, original] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(file.contains(name));
    const SafetensorsTensorInfo& info = file.info(name);
    ASSERT_TRUE(info.dtype.has_value());
    EXPECT_EQ(*info.dtype, original.dtype());
    // The name written is one parse_dtype maps back to the same type.
    EXPECT_EQ(parse_dtype(info.dtype_name), original.dtype());
    Shape file_shape = original.shape();
    if (original.dtype() == DType::f4_e2m1) file_shape.back() *= 2;  // the format counts 4-bit values
    EXPECT_EQ(info.shape, file_shape);

    const Tensor t = file.tensor(name);
    EXPECT_EQ(t.dtype(), original.dtype());
    EXPECT_EQ(t.shape(), original.shape());
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_TRUE(t.device().is_cpu());
    EXPECT_TRUE(same_bytes(t, original));
    // The writer orders tensors so that each starts aligned to its element size: a view, not a copy.
    if (t.nbytes() != 0) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % dtype_size(t.dtype()), 0u);
    }
  }
}

TEST(Safetensors, HeaderIsPaddedWithSpacesToEightBytes) {
  const fs::path path = temp_dir() / "pad.safetensors";
  save_safetensors(path, {{"x", Tensor::zeros({3}, DType::u8)}}, {{"k", "v"}});
  const std::vector<uint8_t> bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{bytes[static_cast<std::size_t>(i)]} << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 3);
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  const std::size_t last = header.find_last_not_of(' ');
  ASSERT_NE(last, std::string::npos);
  EXPECT_EQ(header[last], '}');
  EXPECT_EQ(header[0], '{');
}

TEST(Safetensors, WritesNonContiguousTensorsAsContiguousCopies) {
  const fs::path path = temp_dir() / "strided.safetensors";
  std::mt19937 rng(2);
  const Tensor base = random_bytes_tensor({4, 6}, DType::f32, rng);
  const Tensor transposed = base.transpose(0, 1);
  const Tensor sliced = base.slice(1, 1, 5);
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_FALSE(sliced.is_contiguous());
  save_safetensors(path, {{"transposed", transposed}, {"sliced", sliced}});
  const SafetensorsFile file(path);
  EXPECT_EQ(file.tensor("transposed").shape(), Shape({6, 4}));
  EXPECT_TRUE(same_bytes(file.tensor("transposed"), transposed.clone()));
  EXPECT_TRUE(same_bytes(file.tensor("sliced"), sliced.clone()));
}

TEST(Safetensors, MetadataRoundTrips) {
  const fs::path path = temp_dir() / "meta.safetensors";
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"empty", ""}, {"unicode", "r\xc3\xa9sum\xc3\xa9 \xe2\x9c\x93"}, {"quote\"key", "a\nb\\c"}};
  save_safetensors(path, {{"x", Tensor::zeros({2}, DType::f32)}}, metadata);
  EXPECT_EQ(SafetensorsFile(path).metadata(), metadata);
}

TEST(Safetensors, FileWithNoTensors) {
  const fs::path path = temp_dir() / "none.safetensors";
  save_safetensors(path, {}, {{"only", "metadata"}});
  const SafetensorsFile file(path);
  EXPECT_TRUE(file.names().empty());
  EXPECT_EQ(file.metadata().at("only"), "metadata");
}

TEST(Safetensors, TensorsKeepTheMappingAlive) {
  const fs::path path = temp_dir() / "alive.safetensors";
  std::mt19937 rng(3);
  const Tensor original = random_bytes_tensor({16, 16}, DType::bf16, rng);
  save_safetensors(path, {{"w", original}});
  Tensor view;
  {
    const SafetensorsFile file(path);
    view = file.tensor("w");
  }
  fs::remove(path);  // the mapping outlives the directory entry too
  EXPECT_TRUE(same_bytes(view, original));
  EXPECT_TRUE(same_bytes(view.clone(), original));
}

TEST(Safetensors, WriterRejectsBadInput) {
  const fs::path dir = temp_dir();
  const Tensor x = Tensor::zeros({2}, DType::f32);
  expect_error([&] { save_safetensors(dir / "a", {{"x", x}, {"x", x}}); }, "'x' appears twice");
  expect_error([&] { save_safetensors(dir / "b", {{"__metadata__", x}}); }, "__metadata__");
  expect_error([&] { save_safetensors(dir / "c", {{"u", Tensor()}}); }, "'u' is undefined");
  expect_error(
      [&] {
        save_safetensors(dir / "d", {{"f4", Tensor::zeros({}, DType::f4_e2m1)}});
      },
      "at least one dimension");
  expect_error([&] { save_safetensors(dir / "e", {{"bad\xff", x}}); }, "UTF-8");
  expect_error([&] { save_safetensors((dir / "no_such_dir" / "f").string(), {{"x", x}}); }, "cannot create");
  // A failed write leaves nothing behind.
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(Safetensors, EveryTruncationIsAnError) {
  const fs::path dir = temp_dir();
  const fs::path path = dir / "full.safetensors";
  save_safetensors(path, {{"a", Tensor::zeros({3}, DType::f32)}, {"b", Tensor::zeros({2, 2}, DType::bf16)}},
                   {{"k", "v"}});
  const std::vector<uint8_t> bytes = read_bytes(path);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{bytes[static_cast<std::size_t>(i)]} << (8 * i);
  const fs::path cut = dir / "cut.safetensors";
  for (std::size_t size = 0; size < bytes.size(); ++size) {
    SCOPED_TRACE("truncated to " + std::to_string(size) + " of " + std::to_string(bytes.size()) + " bytes");
    write_bytes(cut, bytes.data(), size);
    const char* expected = size < 8                  ? "too short"
                           : size < 8 + header_bytes ? "larger than the file"
                                                     : "run past the data section";
    expect_error([&] { SafetensorsFile{cut.string()}; }, expected);
  }
}

TEST(Safetensors, RejectsBadHeaderLength) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  std::vector<uint8_t> buffer = make_buffer(header, 2);
  buffer[0] = static_cast<uint8_t>(header.size() + 3);  // 1 byte more than the file holds
  expect_error([&] { parse_safetensors(buffer.data(), buffer.size(), "f"); }, "larger than the file");
  buffer[0] = 0;
  expect_error([&] { parse_safetensors(buffer.data(), buffer.size(), "f"); }, "starting with '{'");
  std::fill(buffer.begin(), buffer.begin() + 8, uint8_t{0xff});
  expect_error([&] { parse_safetensors(buffer.data(), buffer.size(), "f"); }, "exceeds the limit");
  expect_error([&] { parse_safetensors(nullptr, 0, "f"); }, "too short");
}

TEST(Safetensors, RejectsBadJson) {
  expect_parse_error(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2])", 2, "not valid JSON");
  expect_parse_error("{\"a\": \"\xff\xfe\"}", 0, "not valid JSON");  // invalid UTF-8
  expect_parse_error("{} trailing", 0, "not valid JSON");
  expect_parse_error("[1, 2]", 0, "starting with '{'");
  expect_parse_error(R"({"a": 1})", 0, "tensor 'a': expected an object");
}

TEST(Safetensors, RefusesDeepNestingNamingTheFileAndTheLimit) {
  const auto nested = [](std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  // The 100,000 levels are refused at parse time (a stack overflow before the limit existed).
  expect_parse_error("{\"a\":" + nested(100000) + "}", 0,
                     "test.safetensors: header: JSON nests deeper than 128 levels at a[0][0]");
  expect_parse_error(R"({"__metadata__": {"k": )" + nested(100000) + "}}", 0,
                     "deeper than 128 levels at __metadata__.k");
  // At the limit (the header object and 127 arrays) the header parses, and the entry is reported.
  expect_parse_error("{\"a\":" + nested(127) + "}", 0,
                     "tensor 'a': expected an object with dtype, shape and data_offsets, got [[[[");
}

TEST(Safetensors, RefusesRepeatedKeysNamingThem) {
  const std::string w = R"("w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]})";
  expect_parse_error("{" + w + ", " + w + "}", 2, "test.safetensors: header: the key w appears twice");
  // A second activation in the metadata ran as the last one before.
  expect_parse_error(R"({"__metadata__": {"activation": "silu", "activation": "gelu"}})", 0,
                     "the key __metadata__.activation appears twice");
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2], "dtype": "I8"}})", 2,
                     "the key w.dtype appears twice");
}

TEST(Safetensors, RejectsBadTensorEntries) {
  const auto entry = [](const std::string& dtype, const std::string& shape, const std::string& offsets) {
    return R"({"w": {"dtype": )" + dtype + R"(, "shape": )" + shape + R"(, "data_offsets": )" + offsets + "}}";
  };
  expect_parse_error(entry(R"("Q7")", "[2]", "[0, 2]"), 2, "tensor 'w': unknown dtype \"Q7\"");
  expect_parse_error(entry("7", "[2]", "[0, 2]"), 2, "dtype must be a string");
  expect_parse_error(entry(R"("F32")", "[2, 3]", "[0, 20]"), 24, "needs 24 bytes but data_offsets [0, 20) hold 20");
  expect_parse_error(entry(R"("F32")", "[2]", "[0, 12]"), 8, "run past the data section of 8 bytes");
  expect_parse_error(entry(R"("F32")", "[0]", "[9, 9]"), 8, "run past the data section");
  expect_parse_error(entry(R"("U8")", "[2]", "[4, 2]"), 8, "begin after end");
  expect_parse_error(entry(R"("U8")", "[-2]", "[0, 2]"), 8, "a shape dimension is negative: -2");
  expect_parse_error(entry(R"("U8")", "[2.5]", "[0, 2]"), 8, "a shape dimension must be a non-negative integer");
  expect_parse_error(entry(R"("U8")", R"(["2"])", "[0, 2]"), 8, "a shape dimension must be a non-negative integer");
  expect_parse_error(entry(R"("U8")", "[2]", "[-1, 2]"), 8, "data_offsets begin is negative");
  expect_parse_error(entry(R"("U8")", "[2]", "[0, 1e30]"), 8, "data_offsets end must be a non-negative integer");
  expect_parse_error(entry(R"("U8")", "[2]", "[0, 18446744073709551616]"), 8, "data_offsets end must be");
  expect_parse_error(entry(R"("U8")", "[2]", "[0, 2, 4]"), 8, "data_offsets must be an array [begin, end]");
  expect_parse_error(entry(R"("U8")", "2", "[0, 2]"), 8, "shape must be an array");
  expect_parse_error(entry(R"("U8")", "[4294967296, 4294967296]", "[0, 2]"), 8, "more than 2^62 elements");
  expect_parse_error(entry(R"("F64")", "[1152921504606846976, 8]", "[0, 2]"), 8, "more than 2^62 elements");
  expect_parse_error(entry(R"("F64")", "[4611686018427387904]", "[0, 2]"), 8, "is too large");
  expect_parse_error(entry(R"("F4")", "[3]", "[0, 2]"), 8, "do not fill whole bytes");
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [2]}})", 8, "tensor 'w': missing key 'data_offsets'");
  expect_parse_error(R"({"w": {"shape": [2], "data_offsets": [0, 2]}})", 8, "tensor 'w': missing key 'dtype'");
  expect_parse_error(R"({"w": {"dtype": "U8", "data_offsets": [0, 2]}})", 8, "tensor 'w': missing key 'shape'");
  expect_parse_error(R"({"__metadata__": {"k": 1}})", 0, "__metadata__ key 'k' must have a string value");
  expect_parse_error(R"({"__metadata__": ["k"]})", 0, "__metadata__ must be an object");
}

TEST(Safetensors, ErrorsNameTheFile) {
  const fs::path dir = temp_dir();
  const std::vector<uint8_t> buffer = make_buffer(R"({"w": {"dtype": "U8", "shape": [3], "data_offsets": [0, 2]}})", 2);
  write_bytes(dir / "named.safetensors", buffer.data(), buffer.size());
  expect_error([&] { SafetensorsFile{(dir / "named.safetensors").string()}; }, "named.safetensors: tensor 'w'");
  expect_error([&] { SafetensorsFile{(dir / "missing.safetensors").string()}; }, "missing.safetensors: cannot open");
  expect_error([&] { SafetensorsFile{dir.string()}; }, "not a regular file");
}

TEST(Safetensors, AllowsGapsAndEmptyTensorsAnywhere) {
  // An unused byte between two tensors, and empty tensors at offsets others' bytes cover.
  const std::vector<uint8_t> buffer = make_buffer(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                                                  R"( "e": {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]},)"
                                                  R"( "f": {"dtype": "U8", "shape": [0, 3], "data_offsets": [0, 0]},)"
                                                  R"( "c": {"dtype": "U8", "shape": [], "data_offsets": [5, 6]}})",
                                                  6);
  const SafetensorsFile file = SafetensorsFile::from_bytes(buffer);
  EXPECT_EQ(file.tensor("a").numel(), 4);
  EXPECT_EQ(file.tensor("e").numel(), 0);
  EXPECT_EQ(file.tensor("f").numel(), 0);
  EXPECT_EQ(file.tensor("c").dim(), 0);
  EXPECT_EQ(*static_cast<const uint8_t*>(file.tensor("c").data()), 5);
}

TEST(Safetensors, RefusesOverlappingTensorsNamingBoth) {
  const auto entry = [](const std::string& name, int begin, int end) {
    return "\"" + name + R"(": {"dtype": "U8", "shape": [)" + std::to_string(end - begin) + R"(], "data_offsets": [)" +
           std::to_string(begin) + ", " + std::to_string(end) + "]}";
  };
  // The same bytes twice, one range inside another, and a partial overlap of the last two of three.
  expect_parse_error("{" + entry("a", 0, 4) + ", " + entry("b", 0, 4) + "}", 4,
                     "tensors 'a' and 'b' overlap: data_offsets [0, 4) and [0, 4)");
  expect_parse_error("{" + entry("outer", 0, 8) + ", " + entry("inner", 2, 3) + "}", 8,
                     "tensors 'outer' and 'inner' overlap: data_offsets [0, 8) and [2, 3)");
  expect_parse_error("{" + entry("x", 0, 2) + ", " + entry("y", 2, 6) + ", " + entry("z", 5, 8) + "}", 8,
                     "tensors 'y' and 'z' overlap: data_offsets [2, 6) and [5, 8)");
}

TEST(Safetensors, CopiesMisalignedTensorsIntoAlignedMemory) {
  // One pad byte in the header leaves an F32 tensor at an odd address.
  std::string header = R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::vector<uint8_t> buffer = make_buffer(header, 9);
  const SafetensorsFile file = SafetensorsFile::from_bytes(buffer);
  const Tensor x = file.tensor("x");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(x.data()) % 4, 0u);
  EXPECT_EQ(std::memcmp(x.data(), buffer.data() + 8 + header.size() + 1, 8), 0);
}

TEST(Safetensors, DtypesWithoutAMoekitTypeParseButDoNotLoad) {
  const std::vector<uint8_t> buffer =
      make_buffer(R"({"mask": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]},)"
                  R"( "odd": {"dtype": "F4", "shape": [1, 3], "data_offsets": [3, 5]}})",
                  5);
  // "odd" has 3 four-bit values in 2 bytes: that does not fill whole bytes either.
  expect_error([&] { SafetensorsFile::from_bytes(buffer); }, "do not fill whole bytes");

  const std::vector<uint8_t> ok = make_buffer(R"({"mask": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]},)"
                                              R"( "odd": {"dtype": "F4", "shape": [2, 3], "data_offsets": [3, 6]}})",
                                              6);
  const SafetensorsFile file = SafetensorsFile::from_bytes(ok, "ok.safetensors");
  EXPECT_FALSE(file.info("mask").dtype.has_value());
  EXPECT_EQ(file.info("mask").dtype_name, "BOOL");
  expect_error([&] { file.tensor("mask"); }, "ok.safetensors: tensor 'mask' has dtype BOOL");
  expect_error([&] { file.tensor("odd"); }, "needs an even last dimension");
  expect_error([&] { file.info("nope"); }, "no tensor named 'nope'; the file holds: mask, odd");
}

// Random bytes and random mutations of a valid file: only moekit::Error, never a crash or another
// exception (the fuzzer does this at scale; this keeps a cheap version in every test run).
TEST(Safetensors, GarbageNeverCrashes) {
  const fs::path path = temp_dir() / "seed.safetensors";
  save_safetensors(path, {{"a", Tensor::zeros({3, 2}, DType::bf16)}, {"b", Tensor::zeros({1}, DType::i64)}},
                   {{"k", "v"}});
  const std::vector<uint8_t> seed = read_bytes(path);
  std::mt19937 rng(4);
  for (int round = 0; round < 3000; ++round) {
    std::vector<uint8_t> bytes = seed;
    if (round % 3 == 0) {
      bytes.resize(rng() % 96);
      for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    } else {
      for (int flips = 1 + static_cast<int>(rng() % 4); flips > 0; --flips)
        bytes[rng() % bytes.size()] = static_cast<uint8_t>(" {}[]\",:0123456789-e.FUI"[rng() % 25]);
    }
    try {
      const SafetensorsFile file = SafetensorsFile::from_bytes(bytes);
      for (const auto& name : file.names()) {
        if (!file.info(name).dtype) continue;
        const Tensor t = file.tensor(name);
        EXPECT_LE(t.nbytes(), bytes.size());
      }
    } catch (const Error&) {
    }
  }
}

// `moekit experts`: write a problem to a file, run the built binary, compare `out` with the float64
// reference (DESIGN section 6 tolerances).
#ifdef MOEKIT_CLI_PATH

using test::CliResult;
using test::run_cli;

// The problem's tensors under the names `moekit experts` reads, and its configuration as metadata.
std::vector<std::pair<std::string, Tensor>> problem_tensors(const ExpertsProblem& p) {
  const bool gate = p.config.has_gate;
  std::vector<std::pair<std::string, Tensor>> t = {{"hidden_states", p.hidden_states},
                                                   {"top_k_index", p.top_k_index},
                                                   {"top_k_weights", p.top_k_weights},
                                                   {gate ? "gate_up_proj" : "up_proj", p.gate_up_proj},
                                                   {"down_proj", p.down_proj}};
  if (p.config.has_bias) {
    t.emplace_back(gate ? "gate_up_proj_bias" : "up_proj_bias", p.gate_up_proj_bias);
    t.emplace_back("down_proj_bias", p.down_proj_bias);
  }
  return t;
}

std::map<std::string, std::string> config_metadata(const ExpertsConfig& c) {
  const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  std::map<std::string, std::string> m = {{"activation", std::string(activation_name(c.activation))},
                                          {"is_transposed", flag(c.is_transposed)},
                                          {"is_concatenated", flag(c.is_concatenated)},
                                          {"has_gate", flag(c.has_gate)},
                                          {"has_bias", flag(c.has_bias)},
                                          {"swiglu_alpha", std::to_string(c.swiglu_alpha)},
                                          {"swiglu_limit", "none"}};
  if (c.swiglu_limit) m["swiglu_limit"] = std::to_string(*c.swiglu_limit);
  return m;
}

struct CliCase {
  std::string name;
  RandomProblemOptions options;
  bool write_metadata = true;  // false: rely on the command's defaults
};

// Keeps test names short and stable (gtest would otherwise print the case's bytes, pointers included).
void PrintTo(const CliCase& c, std::ostream* os) {
  *os << c.name;
}

std::vector<CliCase> cli_cases() {
  std::vector<CliCase> cases;
  {
    CliCase c{"defaults", {}, false};
    c.options.tokens = 9;
    c.options.hidden = 64;
    c.options.intermediate = 48;
    c.options.experts = 6;
    c.options.top_k = 2;
    cases.push_back(c);
  }
  {
    // GPT-OSS-like: biases, transposed interleaved weights, clamped SwiGLU, i32 ids, bf16 routing
    // weights and some expert-parallel sentinels.
    CliCase c{"gpt_oss_layout", {}, true};
    c.options.tokens = 12;
    c.options.hidden = 40;
    c.options.intermediate = 24;
    c.options.experts = 5;
    c.options.top_k = 3;
    c.options.index_dtype = DType::i32;
    c.options.weights_dtype = DType::bf16;
    c.options.sentinel_fraction = 0.2;
    c.options.config.has_bias = true;
    c.options.config.is_transposed = true;
    c.options.config.is_concatenated = false;
    c.options.config.swiglu_limit = 7.0f;
    c.options.seed = 11;
    cases.push_back(c);
  }
  {
    CliCase c{"ungated_relu2_f32", {}, true};
    c.options.tokens = 5;
    c.options.hidden = 33;
    c.options.intermediate = 17;
    c.options.experts = 4;
    c.options.top_k = 1;
    c.options.dtype = DType::f32;
    c.options.config.has_gate = false;
    c.options.config.activation = Activation::relu2;
    c.options.seed = 12;
    cases.push_back(c);
  }
  {
    CliCase c{"gelu_f16_one_token", {}, true};
    c.options.tokens = 1;
    c.options.hidden = 24;
    c.options.intermediate = 16;
    c.options.experts = 8;
    c.options.top_k = 4;
    c.options.dtype = DType::f16;
    c.options.config.activation = Activation::gelu;
    c.options.seed = 13;
    cases.push_back(c);
  }
  return cases;
}

const std::vector<std::string> kCpuBackends = {"eager", "batched_mm", "grouped_mm"};

class CliExperts : public testing::TestWithParam<std::tuple<std::string, CliCase>> {};

TEST_P(CliExperts, SafetensorsRoundTripMatchesReference) {
  const auto& [backend, c] = GetParam();
  const fs::path dir = temp_dir();
  const ExpertsProblem problem = make_random_problem(c.options);
  save_safetensors(dir / "in.safetensors", problem_tensors(problem),
                   c.write_metadata ? config_metadata(problem.config) : std::map<std::string, std::string>{});

  const CliResult r = run_cli("experts --input '" + (dir / "in.safetensors").string() + "' --backend " + backend +
                                  " --output '" + (dir / "out.safetensors").string() + "'",
                              dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("backend=" + backend), std::string::npos) << r.output;

  const SafetensorsFile out_file((dir / "out.safetensors").string());
  ASSERT_EQ(out_file.names(), std::vector<std::string>{"out"});
  const Tensor out = out_file.tensor("out");
  const int64_t T = c.options.tokens, H = c.options.hidden;
  ASSERT_EQ(out.shape(), Shape({T, H}));
  ASSERT_EQ(out.dtype(), c.options.dtype);

  const std::vector<double> ref = experts_reference(problem);
  const Tensor got = out.to(DType::f32);
  const float* g = got.data_as<float>();
  // f32: DESIGN's 1e-5 overall; per token we allow 1e-4 for rounding in small rows.
  const bool f32 = c.options.dtype == DType::f32;
  const double overall_tol = f32 ? 1e-5 : 2e-2, token_tol = f32 ? 1e-4 : 5e-2;
  double err2 = 0, ref2 = 0;
  for (int64_t t = 0; t < T; ++t) {
    double token_err2 = 0, token_ref2 = 0;
    for (int64_t h = 0; h < H; ++h) {
      const double d = static_cast<double>(g[t * H + h]) - ref[static_cast<std::size_t>(t * H + h)];
      token_err2 += d * d;
      token_ref2 += ref[static_cast<std::size_t>(t * H + h)] * ref[static_cast<std::size_t>(t * H + h)];
    }
    // A token whose slots are all sentinels must come out exactly zero.
    EXPECT_LE(std::sqrt(token_err2) / std::max(std::sqrt(token_ref2), 1e-30), token_tol) << "token " << t;
    err2 += token_err2;
    ref2 += token_ref2;
  }
  EXPECT_LE(std::sqrt(err2 / ref2), overall_tol);
}

INSTANTIATE_TEST_SUITE_P(CpuBackends, CliExperts,
                         testing::Combine(testing::ValuesIn(kCpuBackends), testing::ValuesIn(cli_cases())),
                         [](const auto& p) { return std::get<0>(p.param) + "_" + std::get<1>(p.param).name; });

// `moekit experts --grad-output`: the gradients written beside `out`, under their inputs' names, each against
// the float64 reference backward with the harness's bounds.
class CliExpertsBackward : public testing::TestWithParam<std::tuple<std::string, CliCase>> {};

TEST_P(CliExpertsBackward, GradientsMatchReference) {
  const auto& [backend, c] = GetParam();
  const fs::path dir = temp_dir();
  const ExpertsProblem problem = make_random_problem(c.options);
  save_safetensors(dir / "in.safetensors", problem_tensors(problem),
                   c.write_metadata ? config_metadata(problem.config) : std::map<std::string, std::string>{});
  Tensor grad_out = Tensor::empty({c.options.tokens, c.options.hidden}, DType::f32);
  fill_uniform(grad_out, 1.0f, 99);
  grad_out = grad_out.to(c.options.dtype);
  save_safetensors(dir / "grad.safetensors", {{"grad_out", grad_out}}, {});

  const CliResult r = run_cli("experts --input '" + (dir / "in.safetensors").string() + "' --grad-output '" +
                                  (dir / "grad.safetensors").string() + "' --backend " + backend + " --output '" +
                                  (dir / "out.safetensors").string() + "'",
                              dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("forward+backward"), std::string::npos) << r.output;

  const ReferenceGradients ref = experts_reference_backward(problem, grad_out);
  const bool gate = c.options.config.has_gate;
  std::vector<std::pair<std::string, const std::vector<double>*>> expected = {
      {"grad_hidden_states", &ref.hidden_states},
      {"grad_top_k_weights", &ref.top_k_weights},
      {gate ? "grad_gate_up_proj" : "grad_up_proj", &ref.gate_up_proj},
      {"grad_down_proj", &ref.down_proj}};
  if (c.options.config.has_bias) {
    expected.emplace_back(gate ? "grad_gate_up_proj_bias" : "grad_up_proj_bias", &ref.gate_up_proj_bias);
    expected.emplace_back("grad_down_proj_bias", &ref.down_proj_bias);
  }
  const SafetensorsFile out_file((dir / "out.safetensors").string());
  EXPECT_EQ(out_file.names().size(), expected.size() + 1) << "out and one tensor per gradient";
  ASSERT_TRUE(out_file.contains("out"));
  for (const auto& [name, want] : expected) {
    ASSERT_TRUE(out_file.contains(name)) << name;
    const test::Comparison cmp =
        test::compare_gradient_with_reference(out_file.tensor(name), *want, test::tolerance_for(c.options.dtype));
    EXPECT_TRUE(cmp.passed()) << name << ": " << cmp.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(CpuBackends, CliExpertsBackward,
                         testing::Combine(testing::ValuesIn(kCpuBackends), testing::ValuesIn(cli_cases())),
                         [](const auto& p) { return std::get<0>(p.param) + "_" + std::get<1>(p.param).name; });

TEST(CliExpertsBackwardInput, GradOutFileIsChecked) {
  const fs::path dir = temp_dir();
  RandomProblemOptions o;
  o.tokens = 3;
  o.hidden = 16;
  o.intermediate = 8;
  o.experts = 4;
  const ExpertsProblem problem = make_random_problem(o);
  save_safetensors(dir / "in.safetensors", problem_tensors(problem), {});
  auto run = [&](const std::vector<std::pair<std::string, Tensor>>& grad_tensors) {
    save_safetensors(dir / "grad.safetensors", grad_tensors, {});
    return run_cli("experts --input '" + (dir / "in.safetensors").string() + "' --grad-output '" +
                       (dir / "grad.safetensors").string() + "' --backend grouped_mm --output '" +
                       (dir / "out.safetensors").string() + "'",
                   dir);
  };
  CliResult r = run({{"grad_out", Tensor::zeros({3, 15}, DType::bf16)}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("grad_out must be bf16[3, 16]"), std::string::npos) << r.output;
  r = run({{"grad_out", Tensor::zeros({3, 16}, DType::bf16)}, {"extra", Tensor::zeros({1}, DType::f32)}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("unexpected tensor 'extra'"), std::string::npos) << r.output;
  r = run({{"gradient", Tensor::zeros({3, 16}, DType::bf16)}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("unexpected tensor 'gradient'"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out.safetensors"));
}

// Input errors are reported (naming the key or tensor) before any backend runs.
class CliExpertsInput : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_dir();
    RandomProblemOptions o;
    o.tokens = 3;
    o.hidden = 16;
    o.intermediate = 8;
    o.experts = 4;
    problem_ = make_random_problem(o);
  }
  // Writes the problem (plus `extra` tensors, minus `drop`) with `metadata`, runs the command, and
  // expects it to fail with a message containing `needle`.
  void expect_failure(const std::map<std::string, std::string>& metadata, const std::string& needle,
                      const std::vector<std::pair<std::string, Tensor>>& extra = {}, const std::string& drop = "") {
    auto tensors = problem_tensors(problem_);
    std::erase_if(tensors, [&](const auto& t) { return t.first == drop; });
    tensors.insert(tensors.end(), extra.begin(), extra.end());
    save_safetensors(dir_ / "in.safetensors", tensors, metadata);
    const CliResult r = run_cli("experts --input '" + (dir_ / "in.safetensors").string() +
                                    "' --backend eager --output '" + (dir_ / "out.safetensors").string() + "'",
                                dir_);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << "expected \"" << needle << "\" in: " << r.output;
    EXPECT_FALSE(fs::exists(dir_ / "out.safetensors"));
  }
  fs::path dir_;
  ExpertsProblem problem_;
};

TEST_F(CliExpertsInput, BadBoolNamesTheKey) {
  expect_failure({{"has_bias", "yes"}}, "metadata key 'has_bias' must be \"true\" or \"false\", got \"yes\"");
}

TEST_F(CliExpertsInput, BadNumberNamesTheKey) {
  expect_failure({{"swiglu_limit", "7x"}}, "metadata key 'swiglu_limit' must be a finite number");
}

TEST_F(CliExpertsInput, UnknownActivationNamesTheKey) {
  expect_failure({{"activation", "tanh"}}, "metadata key 'activation'");
}

TEST_F(CliExpertsInput, UnknownKeyIsNamed) {
  expect_failure({{"colour", "blue"}}, "unknown metadata key 'colour'");
}

TEST_F(CliExpertsInput, BiasWithoutHasBiasIsAnError) {
  expect_failure({}, "bias tensor 'down_proj_bias' but metadata has_bias",
                 {{"down_proj_bias", Tensor::zeros({4, 16}, DType::bf16)}});
}

TEST_F(CliExpertsInput, HasBiasWithoutBiasIsAnError) {
  expect_failure({{"has_bias", "true"}}, "missing tensor 'gate_up_proj_bias' (needed: has_bias is true)");
}

TEST_F(CliExpertsInput, UngatedWeightWithGateIsAnError) {
  expect_failure({}, "'up_proj' (experts without a gate) but metadata has_gate", {{"up_proj", problem_.gate_up_proj}},
                 "gate_up_proj");
}

TEST_F(CliExpertsInput, StrayTensorIsNamed) {
  expect_failure({}, "unexpected tensor 'router_logits'", {{"router_logits", Tensor::zeros({3, 4}, DType::f32)}});
}

TEST_F(CliExpertsInput, MissingTensorIsNamed) {
  expect_failure({}, "missing tensor 'down_proj'", {}, "down_proj");
}

TEST_F(CliExpertsInput, MissingFileIsNamed) {
  const CliResult r = run_cli("experts --input '" + (dir_ / "nope.safetensors").string() +
                                  "' --backend eager --output '" + (dir_ / "out.safetensors").string() + "'",
                              dir_);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("nope.safetensors: cannot open"), std::string::npos) << r.output;
}

// transformers' own experts modules (Qwen3MoeExperts; GptOssExperts: transposed, interleaved, biased,
// clamped SwiGLU) on fixed inputs, computed by scripts/make_experts_fixtures.py with transformers 5.17
// on the CPU: every CPU backend, through `moekit experts`, must give transformers' output within the
// dtype's tolerance. This checks the contract against the system it mirrors, not only against our
// own reading of it in the float64 reference.
class TransformersFixture : public testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(TransformersFixture, CliOutputMatchesTransformers) {
  const auto& [fixture, backend] = GetParam();
  const fs::path dir = temp_dir();
  const fs::path base = fs::path(MOEKIT_FIXTURES_DIR) / "experts" / fixture;
  const CliResult r = run_cli("experts --input '" + base.string() + ".input.safetensors' --backend " + backend +
                                  " --output '" + (dir / "out.safetensors").string() + "'",
                              dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Tensor out = SafetensorsFile((dir / "out.safetensors").string()).tensor("out");
  const Tensor expected = SafetensorsFile(base.string() + ".expected.safetensors").tensor("out");
  ASSERT_EQ(out.shape(), expected.shape());
  ASSERT_EQ(out.dtype(), expected.dtype());
  const std::vector<float> want = test::values_of(expected);
  const test::Comparison c = test::compare_with_reference(out, std::vector<double>(want.begin(), want.end()),
                                                          test::tolerance_for(expected.dtype()));
  EXPECT_TRUE(c.passed()) << fixture << " with " << backend << ": " << c.summary();
}

std::string fixture_test_name(const testing::TestParamInfo<std::tuple<std::string, std::string>>& param) {
  return std::get<0>(param.param) + "_" + std::get<1>(param.param);
}

INSTANTIATE_TEST_SUITE_P(CpuBackends, TransformersFixture,
                         testing::Combine(testing::Values("qwen3_moe_f32", "qwen3_moe_bf16", "gpt_oss_f32",
                                                          "gpt_oss_bf16"),
                                          testing::ValuesIn(kCpuBackends)),
                         fixture_test_name);

#endif  // MOEKIT_CLI_PATH

}  // namespace
}  // namespace moekit

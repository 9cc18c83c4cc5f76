// The model runtime against transformers: tiny random checkpoints of every supported architecture, saved
// by transformers 5.17 with its logits and greedy tokens for a fixed prompt
// (scripts/make_model_fixtures.py). In float32 on the CPU our logits must match within 1e-4 relative
// L2 error (every row too) and our greedy tokens must be identical, with every CPU experts backend; in
// bf16 the logits must match transformers' bf16 run within bf16 tolerances. Also: switching backends at
// run time, the decode-phase switch staying off on the CPU, sampling, bad checkpoints, and on a GPU the
// decode steps replayed from one captured CUDA graph against the same steps launched one by one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/safetensors.h"

namespace fs = std::filesystem;
using namespace moekit;

namespace {

// qwen3_vl_moe: a vision-language checkpoint whose language model runs on text tokens only.
const std::vector<std::string> kModels = {
    "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v3_no_q_lora", "gpt_oss", "qwen3_vl_moe"};
const std::vector<std::string> kCpuBackends = {"eager", "batched_mm", "grouped_mm"};

std::string model_dir(const std::string& name) {
  return std::string(MOEKIT_FIXTURES_DIR) + "/models/" + name;
}

struct Expected {
  std::vector<int32_t> prompt, greedy;
  Tensor logits, logits_bf16;
};

Expected load_expected(const std::string& name) {
  SafetensorsFile f(model_dir(name) + "/expected.safetensors");
  Expected e;
  const Tensor prompt = f.tensor("prompt"), greedy = f.tensor("greedy");
  e.prompt.assign(prompt.data_as<int32_t>(), prompt.data_as<int32_t>() + prompt.numel());
  e.greedy.assign(greedy.data_as<int32_t>(), greedy.data_as<int32_t>() + greedy.numel());
  e.logits = f.tensor("logits");
  if (f.contains("logits_bf16")) e.logits_bf16 = f.tensor("logits_bf16");  // not in the FP8 fixtures
  return e;
}

using test::relative_l2;

void expect_logits_close(const Tensor& ours, const Tensor& theirs, double overall, double per_row) {
  ASSERT_EQ(ours.shape(), theirs.shape());
  const int64_t T = theirs.size(0);
  EXPECT_LE(relative_l2(ours, theirs, 0, T), overall);
  for (int64_t t = 0; t < T; ++t) EXPECT_LE(relative_l2(ours, theirs, t, t + 1), per_row) << "token " << t;
}

class CausalLMTransformers : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(CausalLMTransformers, Float32LogitsAndGreedyTokensMatch) {
  const auto& [name, backend] = GetParam();
  const Expected e = load_expected(name);
  CausalLM model = CausalLM::from_pretrained(model_dir(name), {.experts_implementation = backend});
  EXPECT_EQ(model.dtype(), DType::f32);
  expect_logits_close(model.forward(e.prompt), e.logits, 1e-4, 1e-4);

  GenerationConfig g;
  g.max_new_tokens = static_cast<int64_t>(e.greedy.size());
  const GenerationResult r = model.generate(e.prompt, g);
  EXPECT_EQ(r.tokens, e.greedy);
  EXPECT_EQ(r.stop_reason, "max new tokens");
  EXPECT_EQ(r.prefill_tokens, static_cast<int64_t>(e.prompt.size()));
  EXPECT_EQ(r.decode_tokens, g.max_new_tokens - 1);
}

TEST_P(CausalLMTransformers, Bf16LogitsAsCloseToFloat32AsTransformersBf16) {
  const auto& [name, backend] = GetParam();
  const Expected e = load_expected(name);
  CausalLM model =
      CausalLM::from_pretrained(model_dir(name), {.dtype = DType::bf16, .experts_implementation = backend});
  EXPECT_EQ(model.dtype(), DType::bf16);
  const Tensor ours = model.forward(e.prompt);
  // bf16 rounds at every operation, and over several layers a rounding can flip a token's choice of
  // experts, so two correct bf16 runs need not agree within a per-operation tolerance: transformers'
  // own bf16 run drifts from its float32 logits by 1.5% (mixtral) to 41% (deepseek_v3, whose first MoE
  // layer alone moves 42% in transformers' bf16 while its gate logits move 1.6%). The bar: our bf16
  // logits are no further from the float32 logits than transformers' bf16 logits are (with 50% slack:
  // different rounding points give errors of the same size, not the same errors),
  // or within the DESIGN §6 bf16 bound of 2e-2.
  const int64_t T = ours.size(0);
  const double theirs = relative_l2(e.logits_bf16, e.logits, 0, T);
  EXPECT_LE(relative_l2(ours, e.logits, 0, T), std::max(1.5 * theirs, 2e-2)) << "transformers' bf16: " << theirs;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CausalLMTransformers,
                         ::testing::Combine(::testing::ValuesIn(kModels), ::testing::ValuesIn(kCpuBackends)),
                         [](const auto& p) { return std::get<0>(p.param) + "_" + std::get<1>(p.param); });

// Pre-quantised FP8 checkpoints written by `moekit quantize` from the deepseek_v3 (float32 scales) and
// qwen3_moe (ue8m0 scales) fixtures (scripts/make_fp8_fixtures.py): transformers loaded them as
// fine-grained FP8 checkpoints and, with no GPU, dequantised them (q * scale_inv in float32) for its
// reference logits. moekit loads the same files; their intermediate sizes are not multiples of 128, so
// it dequantises the experts too (LoadOptions::dequantize), and both compute the same float32 model.
class CausalLMFp8Transformers : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(CausalLMFp8Transformers, DequantisedLogitsAndGreedyTokensMatch) {
  const auto& [name, backend] = GetParam();
  const Expected e = load_expected(name);
  for (bool dequantize : {false, true}) {
    SCOPED_TRACE(dequantize ? "dequantize = true" : "dequantize = false");
    CausalLM model =
        CausalLM::from_pretrained(model_dir(name), {.experts_implementation = backend, .dequantize = dequantize});
    expect_logits_close(model.forward(e.prompt), e.logits, 1e-4, 1e-4);
    GenerationConfig g;
    g.max_new_tokens = static_cast<int64_t>(e.greedy.size());
    EXPECT_EQ(model.generate(e.prompt, g).tokens, e.greedy);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CausalLMFp8Transformers,
                         ::testing::Combine(::testing::Values("deepseek_v3_fp8", "qwen3_moe_fp8_ue8m0"),
                                            ::testing::ValuesIn(kCpuBackends)),
                         [](const auto& p) { return std::get<0>(p.param) + "_" + std::get<1>(p.param); });

// The same fixtures with the whole model on a GPU (every layer's dense operations, routers and experts
// on CUDA); skipped where there is none.
class CausalLMTransformersCuda : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    std::string why;
    if (!device_available(Device::cuda(0), &why)) GTEST_SKIP() << "no GPU: " << why;
  }
};

TEST_P(CausalLMTransformersCuda, Float32LogitsAndGreedyTokensMatch) {
  const auto& [name, backend] = GetParam();
  const Expected e = load_expected(name);
  CausalLM model =
      CausalLM::from_pretrained(model_dir(name), {.device = Device::cuda(0), .experts_implementation = backend});
  EXPECT_TRUE(model.device().is_cuda());
  expect_logits_close(model.forward(e.prompt), e.logits, 1e-4, 1e-4);
  GenerationConfig g;
  g.max_new_tokens = static_cast<int64_t>(e.greedy.size());
  EXPECT_EQ(model.generate(e.prompt, g).tokens, e.greedy);
}

TEST_P(CausalLMTransformersCuda, Bf16LogitsAsCloseToFloat32AsTransformersBf16) {
  const auto& [name, backend] = GetParam();
  const Expected e = load_expected(name);
  CausalLM model = CausalLM::from_pretrained(
      model_dir(name), {.dtype = DType::bf16, .device = Device::cuda(0), .experts_implementation = backend});
  const Tensor ours = model.forward(e.prompt);
  const int64_t T = ours.size(0);
  const double theirs = relative_l2(e.logits_bf16, e.logits, 0, T);  // see the CPU test above
  EXPECT_LE(relative_l2(ours, e.logits, 0, T), std::max(1.5 * theirs, 2e-2)) << "transformers' bf16: " << theirs;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CausalLMTransformersCuda,
                         ::testing::Combine(::testing::ValuesIn(kModels), ::testing::ValuesIn(kCpuBackends)),
                         [](const auto& p) { return std::get<0>(p.param) + "_" + std::get<1>(p.param); });

// On a GPU, a model loaded with grouped_mm prefills with it, decodes with batched_mm, and gets
// grouped_mm back afterwards; entries that are not grouped_mm are left alone.
TEST(CausalLMCuda, DecodePhaseSwitchesGroupedToBatched) {
  std::string why;
  if (!device_available(Device::cuda(0), &why)) GTEST_SKIP() << "no GPU: " << why;
  const Expected e = load_expected("qwen3_moe");
  CausalLM model = CausalLM::from_pretrained(model_dir("qwen3_moe"),
                                             {.device = Device::cuda(0), .experts_implementation = "grouped_mm"});
  GenerationConfig g;
  g.max_new_tokens = 4;
  std::vector<std::vector<std::string>> per_step;
  g.on_token = [&](int32_t) { per_step.push_back(model.last_step_backends()); };
  const GenerationResult r = model.generate(e.prompt, g);
  const std::map<std::string, std::string> grouped{{"", "grouped_mm"}}, batched{{"", "batched_mm"}};
  EXPECT_EQ(r.prefill_backends, grouped);
  EXPECT_EQ(r.decode_backends, batched);
  ASSERT_EQ(per_step.size(), 4u);
  // The first token comes from the prefill step; the next ones from decode steps.
  EXPECT_EQ(per_step[0], (std::vector<std::string>{"grouped_mm", "grouped_mm"}));
  for (std::size_t i = 1; i < per_step.size(); ++i)
    EXPECT_EQ(per_step[i], (std::vector<std::string>{"batched_mm", "batched_mm"})) << "step " << i;
  EXPECT_EQ(model.get_experts_implementation(), grouped);
  EXPECT_EQ(r.tokens, std::vector<int32_t>(e.greedy.begin(), e.greedy.begin() + 4));

  // A failure during decode restores grouped_mm too.
  GenerationConfig failing = g;
  int calls = 0;
  failing.on_token = [&](int32_t) {
    if (++calls == 2) throw std::runtime_error("interrupted");
  };
  EXPECT_THROW(model.generate(e.prompt, failing), std::runtime_error);
  EXPECT_EQ(model.get_experts_implementation(), grouped);

  // Switched off by the caller: grouped_mm decodes too.
  GenerationConfig unswitched = g;
  unswitched.on_token = nullptr;
  unswitched.decode_phase_switch = false;
  EXPECT_EQ(model.generate(e.prompt, unswitched).decode_backends, grouped);

  // eager is not switched.
  model.set_experts_implementation("eager");
  EXPECT_EQ(model.generate(e.prompt, g).decode_backends, (std::map<std::string, std::string>{{"", "eager"}}));
}

// Bytes equal: a replayed decode step runs the launched step's kernels with the same arguments, so its
// logits must be the same bits, not merely close.
::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.shape() != b.shape() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << (a.defined() ? a.describe() : "undefined") << " vs "
                                         << (b.defined() ? b.describe() : "undefined");
  const auto* x = static_cast<const unsigned char*>(a.data());
  const auto* y = static_cast<const unsigned char*>(b.data());
  for (std::size_t i = 0; i < a.nbytes(); ++i)
    if (x[i] != y[i])
      return ::testing::AssertionFailure()
             << "first difference in logits row " << i / 4 / a.size(1) << ", column " << i / 4 % a.size(1);
  return ::testing::AssertionSuccess();
}

bool is_mla(const std::string& name) {
  return name.starts_with("deepseek_v3");
}

// Every fixture on a GPU, with and without the decode-phase switch, in float32 and bf16: generate with
// decode graphs on (the first call captures the second decode step, the second call replays the kept
// graph from the first decode step) gives the tokens and, for every new token, the float32 logits bit
// for bit of generate with graphs off. DeepSeek-V3's latent attention is not captured and says why.
class CausalLMDecodeGraphCuda : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  void SetUp() override {
    std::string why;
    if (!device_available(Device::cuda(0), &why)) GTEST_SKIP() << "no GPU: " << why;
  }
};

TEST_P(CausalLMDecodeGraphCuda, ReplaysGiveTheLaunchedTokensAndLogitsBitwise) {
  const auto& [name, decode_switch] = GetParam();
  const Expected e = load_expected(name);
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    CausalLM model = CausalLM::from_pretrained(
        model_dir(name), {.dtype = dtype, .device = Device::cuda(0), .experts_implementation = "grouped_mm"});
    GenerationConfig g;
    g.max_new_tokens = static_cast<int64_t>(e.greedy.size());  // 7 decode steps
    g.decode_phase_switch = decode_switch;
    g.output_logits = true;
    g.decode_graph = false;
    const GenerationResult launched = model.generate(e.prompt, g);
    EXPECT_FALSE(launched.decode_graph);
    EXPECT_NE(launched.decode_graph_reason.find("decode_graph is false"), std::string::npos)
        << launched.decode_graph_reason;
    ASSERT_EQ(launched.logits.shape(), (Shape{g.max_new_tokens, model.vocab_size()}));
    // The greedy pick on the GPU is transformers' greedy choice.
    if (dtype == DType::f32) {
      EXPECT_EQ(launched.tokens, e.greedy);
    }

    g.decode_graph = true;
    std::vector<std::vector<std::string>> per_step;
    g.on_token = [&](int32_t) { per_step.push_back(model.last_step_backends()); };
    for (const char* call : {"capturing call", "replaying call"}) {
      SCOPED_TRACE(call);
      per_step.clear();
      const GenerationResult r = model.generate(e.prompt, g);
      EXPECT_EQ(r.decode_graph, !is_mla(name)) << r.decode_graph_reason;
      if (is_mla(name)) {
        EXPECT_NE(r.decode_graph_reason.find("latent attention"), std::string::npos);
      }
      EXPECT_EQ(r.tokens, launched.tokens);
      EXPECT_TRUE(bitwise_equal(r.logits, launched.logits));
      EXPECT_EQ(r.decode_backends, launched.decode_backends);
      EXPECT_EQ(r.decode_tokens, g.max_new_tokens - 1);
      // Replayed steps report the backends of the step they replay.
      const std::string decode_backend = decode_switch ? "batched_mm" : "grouped_mm";
      ASSERT_EQ(per_step.size(), e.greedy.size());
      for (std::size_t i = 1; i < per_step.size(); ++i)
        for (const std::string& b : per_step[i]) EXPECT_EQ(b, decode_backend) << "step " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CausalLMDecodeGraphCuda,
                         ::testing::Combine(::testing::ValuesIn(kModels), ::testing::Bool()), [](const auto& p) {
                           return std::get<0>(p.param) + (std::get<1>(p.param) ? "_decode_switch" : "_no_switch");
                         });

// Sampling with a seed (the row comes back to the host each step) and stop tokens give the same with and
// without graphs; the kept graph is captured again when the cache buffers or the decode backends change.
TEST(CausalLMCuda, DecodeGraphSamplesStopsAndRecapturesAsLaunchedSteps) {
  std::string why;
  if (!device_available(Device::cuda(0), &why)) GTEST_SKIP() << "no GPU: " << why;
  const Expected e = load_expected("gpt_oss");  // sinks, sliding windows, biased experts
  CausalLM model = CausalLM::from_pretrained(model_dir("gpt_oss"), {.dtype = DType::bf16, .device = Device::cuda(0)});
  auto both = [&](GenerationConfig g, const std::string& what) {
    SCOPED_TRACE(what);
    g.output_logits = true;
    g.decode_graph = false;
    const GenerationResult launched = model.generate(e.prompt, g);
    g.decode_graph = true;
    const GenerationResult captured = model.generate(e.prompt, g);
    EXPECT_EQ(captured.tokens, launched.tokens);
    EXPECT_EQ(captured.stop_reason, launched.stop_reason);
    EXPECT_TRUE(bitwise_equal(captured.logits, launched.logits));
    return captured;
  };
  GenerationConfig sampled;
  sampled.max_new_tokens = 10;
  sampled.do_sample = true;
  sampled.temperature = 1.3f;
  sampled.top_k = 20;
  sampled.seed = 11;
  EXPECT_TRUE(both(sampled, "sampled").decode_graph);
  GenerationConfig longer = sampled;
  longer.max_new_tokens = 30;  // a larger cache: new buffers, so the graph is captured again
  EXPECT_TRUE(both(longer, "longer").decode_graph);
  GenerationConfig stopping;
  stopping.max_new_tokens = 8;
  const std::vector<int32_t> greedy = model.generate(e.prompt, stopping).tokens;
  stopping.stop_tokens = {greedy[5]};
  const GenerationResult stopped = both(stopping, "stop token");
  EXPECT_EQ(stopped.stop_reason, "stop token");
  EXPECT_LE(stopped.tokens.size(), 6u);
  GenerationConfig unswitched = longer;  // grouped_mm decodes: other backends, so captured again
  unswitched.decode_phase_switch = false;
  const GenerationResult grouped = both(unswitched, "grouped_mm decode");
  EXPECT_TRUE(grouped.decode_graph);
  EXPECT_EQ(grouped.decode_backends, (std::map<std::string, std::string>{{"", "grouped_mm"}}));
}

// eager reads its per-expert counts back to the host, so its decode step cannot be captured: generation
// goes on launching the kernels, says why, and gives the same bits as with graphs off; the model does not
// try again with the same backends, and the GPU is left clean for a backend that can be captured.
TEST(CausalLMCuda, DecodeGraphFallsBackForABackendThatCannotBeCaptured) {
  std::string why;
  if (!device_available(Device::cuda(0), &why)) GTEST_SKIP() << "no GPU: " << why;
  const Expected e = load_expected("qwen3_moe");
  CausalLM model =
      CausalLM::from_pretrained(model_dir("qwen3_moe"), {.device = Device::cuda(0), .experts_implementation = "eager"});
  GenerationConfig g;
  g.max_new_tokens = static_cast<int64_t>(e.greedy.size());
  g.output_logits = true;
  g.decode_graph = false;
  const GenerationResult launched = model.generate(e.prompt, g);
  g.decode_graph = true;
  for (const char* call : {"first call", "second call"}) {
    SCOPED_TRACE(call);
    const GenerationResult r = model.generate(e.prompt, g);
    EXPECT_FALSE(r.decode_graph);
    EXPECT_NE(r.decode_graph_reason.find("could not be captured"), std::string::npos) << r.decode_graph_reason;
    EXPECT_NE(r.decode_graph_reason.find("eager"), std::string::npos) << r.decode_graph_reason;
    EXPECT_EQ(r.tokens, e.greedy);
    EXPECT_TRUE(bitwise_equal(r.logits, launched.logits));
  }
  model.set_experts_implementation("batched_mm");
  const GenerationResult r = model.generate(e.prompt, g);
  EXPECT_TRUE(r.decode_graph) << r.decode_graph_reason;
  EXPECT_EQ(r.tokens, e.greedy);
}

TEST(CausalLM, NoDecodeGraphOnTheCpuAndLogitsAreKept) {
  const Expected e = load_expected("mixtral");
  CausalLM model = CausalLM::from_pretrained(model_dir("mixtral"));
  GenerationConfig g;
  g.max_new_tokens = 5;
  g.output_logits = true;
  const GenerationResult r = model.generate(e.prompt, g);
  EXPECT_FALSE(r.decode_graph);
  EXPECT_NE(r.decode_graph_reason.find("CPU"), std::string::npos) << r.decode_graph_reason;
  ASSERT_EQ(r.logits.shape(), (Shape{5, model.vocab_size()}));
  // Row i is what token i was picked from (greedy: its first largest value), and row 0 is the last row
  // of the prompt's forward (computed alone there, so equal to rounding).
  for (int64_t i = 0; i < 5; ++i) {
    const float* row = r.logits.data_as<float>() + i * model.vocab_size();
    EXPECT_EQ(std::max_element(row, row + model.vocab_size()) - row, r.tokens[static_cast<std::size_t>(i)]) << i;
  }
  const Tensor prompt_logits = model.forward(e.prompt);
  const int64_t last = static_cast<int64_t>(e.prompt.size()) - 1;
  EXPECT_LE(relative_l2(r.logits.slice(0, 0, 1), prompt_logits.slice(0, last, last + 1).contiguous(), 0, 1), 1e-5);
  g.decode_graph = false;
  g.output_logits = false;
  const GenerationResult off = model.generate(e.prompt, g);
  EXPECT_NE(off.decode_graph_reason.find("decode_graph is false"), std::string::npos) << off.decode_graph_reason;
  EXPECT_FALSE(off.logits.defined());
}

TEST(CausalLM, DecodeWithCacheMatchesFullForward) {
  // The logits of the last decode step equal the full forward's last row over prompt + generated.
  const Expected e = load_expected("deepseek_v3");
  CausalLM model = CausalLM::from_pretrained(model_dir("deepseek_v3"));
  std::vector<int32_t> sequence = e.prompt;
  sequence.insert(sequence.end(), e.greedy.begin(), e.greedy.end());
  const Tensor full = model.forward(sequence);
  for (std::size_t n = 1; n <= e.greedy.size(); ++n) {
    const int64_t row = static_cast<int64_t>(e.prompt.size() + n - 2);
    const float* r = full.data_as<float>() + row * full.size(1);
    int64_t best = 0;
    for (int64_t v = 1; v < full.size(1); ++v)
      if (r[v] > r[best]) best = v;
    EXPECT_EQ(best, e.greedy[n - 1]) << "generated token " << n;
  }
}

TEST(CausalLM, SwitchesExpertsBackendAtRunTime) {
  const Expected e = load_expected("qwen3_moe");
  CausalLM model = CausalLM::from_pretrained(model_dir("qwen3_moe"), {.experts_implementation = "eager"});
  EXPECT_EQ(model.get_experts_implementation(), (std::map<std::string, std::string>{{"", "eager"}}));
  const Tensor a = model.forward(e.prompt);
  // Layer 1 is dense (mlp_only_layers): two MoE layers ran.
  EXPECT_EQ(model.last_step_backends(), (std::vector<std::string>{"eager", "eager"}));
  model.set_experts_implementation("batched_mm");
  const Tensor b = model.forward(e.prompt);
  EXPECT_EQ(model.last_step_backends(), (std::vector<std::string>{"batched_mm", "batched_mm"}));
  model.set_experts_implementation(std::map<std::string, std::string>{{"", "grouped_mm"}});
  const Tensor c = model.forward(e.prompt);
  EXPECT_EQ(model.last_step_backends(), (std::vector<std::string>{"grouped_mm", "grouped_mm"}));
  EXPECT_LE(relative_l2(a, b, 0, a.size(0)), 1e-5);
  EXPECT_LE(relative_l2(a, c, 0, a.size(0)), 1e-5);

  try {
    model.set_experts_implementation("no_such_backend");
    FAIL() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("grouped_mm"), std::string::npos) << err.what();
  }
  EXPECT_THROW(model.set_experts_implementation(std::map<std::string, std::string>{{"text_config", "eager"}}), Error);
  EXPECT_EQ(model.get_experts_implementation(), (std::map<std::string, std::string>{{"", "grouped_mm"}}));
}

TEST(CausalLM, NothingSwitchesForDecodeOnTheCpu) {
  const Expected e = load_expected("olmoe");
  CausalLM model = CausalLM::from_pretrained(model_dir("olmoe"), {.experts_implementation = "grouped_mm"});
  GenerationConfig g;
  g.max_new_tokens = 3;
  const GenerationResult r = model.generate(e.prompt, g);
  EXPECT_EQ(r.prefill_backends, (std::map<std::string, std::string>{{"", "grouped_mm"}}));
  EXPECT_EQ(r.decode_backends, r.prefill_backends);
  EXPECT_EQ(model.last_step_backends(), (std::vector<std::string>{"grouped_mm", "grouped_mm"}));
  EXPECT_EQ(model.get_experts_implementation(), r.prefill_backends);
}

TEST(CausalLM, StopTokensEndGeneration) {
  const Expected e = load_expected("mixtral");
  CausalLM model = CausalLM::from_pretrained(model_dir("mixtral"));
  GenerationConfig g;
  g.max_new_tokens = 8;
  g.stop_tokens = {e.greedy[2]};
  std::vector<int32_t> streamed;
  g.on_token = [&](int32_t t) { streamed.push_back(t); };
  const GenerationResult r = model.generate(e.prompt, g);
  std::vector<int32_t> expected(e.greedy.begin(), e.greedy.begin() + 3);
  // The stop token may occur earlier in the greedy sequence.
  for (std::size_t i = 0; i < 3; ++i)
    if (e.greedy[i] == e.greedy[2]) {
      expected.assign(e.greedy.begin(), e.greedy.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      break;
    }
  EXPECT_EQ(r.tokens, expected);
  EXPECT_EQ(streamed, expected);
  EXPECT_EQ(r.stop_reason, "stop token");
}

TEST(CausalLM, SamplingIsSeededAndTopKOneIsGreedy) {
  const Expected e = load_expected("qwen2_moe");
  CausalLM model = CausalLM::from_pretrained(model_dir("qwen2_moe"));
  GenerationConfig g;
  g.max_new_tokens = 6;
  g.do_sample = true;
  g.temperature = 1.5f;
  g.seed = 7;
  const auto a = model.generate(e.prompt, g).tokens, b = model.generate(e.prompt, g).tokens;
  EXPECT_EQ(a, b);
  bool any_differs = false;
  for (uint64_t seed = 8; seed < 14 && !any_differs; ++seed) {
    g.seed = seed;
    any_differs = model.generate(e.prompt, g).tokens != a;
  }
  EXPECT_TRUE(any_differs) << "six seeds at temperature 1.5 all drew the same tokens";
  g.top_k = 1;
  EXPECT_EQ(model.generate(e.prompt, g).tokens, std::vector<int32_t>(e.greedy.begin(), e.greedy.begin() + 6));
  g.top_k = 0;
  g.top_p = 1e-6f;  // only the most likely token survives
  EXPECT_EQ(model.generate(e.prompt, g).tokens, std::vector<int32_t>(e.greedy.begin(), e.greedy.begin() + 6));

  g.temperature = 0;
  EXPECT_THROW(model.generate(e.prompt, g), Error);
  g.temperature = 1;
  g.top_p = 1.5f;
  EXPECT_THROW(model.generate(e.prompt, g), Error);
  EXPECT_THROW(model.generate(std::vector<int32_t>{}, GenerationConfig()), Error);
}

TEST(CausalLM, VisionLanguageModelRunsItsTextModelAndSkipsTheVisionTower) {
  const std::string dir = model_dir("qwen3_vl_moe");
  int64_t vision_tensors = 0;
  for (const auto& name : SafetensorsFile(dir + "/model.safetensors").names())
    vision_tensors += name.starts_with("model.visual.") ? 1 : 0;
  ASSERT_GT(vision_tensors, 0);
  CausalLM model = CausalLM::from_pretrained(dir, {.experts_implementation = "eager", .progress = false});
  EXPECT_EQ(model.model_type(), "qwen3_vl_moe_text");
  EXPECT_EQ(model.num_layers(), 3);
  const std::string described = model.describe();
  EXPECT_NE(described.find("ignored " + std::to_string(vision_tensors) + " tensor(s) under model.visual."),
            std::string::npos)
      << described;
  // The MoE layers belong to the text_config backbone: setting the top level alone changes nothing.
  const Expected e = load_expected("qwen3_vl_moe");
  EXPECT_EQ(model.get_experts_implementation(),
            (std::map<std::string, std::string>{{"", "eager"}, {"text_config", "eager"}, {"vision_config", "eager"}}));
  model.set_experts_implementation(std::map<std::string, std::string>{{"", "batched_mm"}});
  model.forward(e.prompt);
  EXPECT_EQ(model.last_step_backends(), (std::vector<std::string>{"eager", "eager"}));  // layer 1 is dense
  model.set_experts_implementation(std::map<std::string, std::string>{{"text_config", "batched_mm"}});
  model.forward(e.prompt);
  EXPECT_EQ(model.last_step_backends(), (std::vector<std::string>{"batched_mm", "batched_mm"}));
}

// A copy of a fixture checkpoint whose model.safetensors the test rewrites.
class BrokenCheckpoint : public ::testing::Test {
 protected:
  virtual std::string fixture() const { return "qwen3_moe"; }
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moekit_broken_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(model_dir(fixture()) + "/config.json", dir_ / "config.json");
    SafetensorsFile f(model_dir(fixture()) + "/model.safetensors");
    for (const auto& name : f.names()) tensors_.emplace_back(name, f.tensor(name).clone());
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write() const { save_safetensors((dir_ / "model.safetensors").string(), tensors_); }
  std::string load_error() const {
    try {
      CausalLM::from_pretrained(dir_.string());
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  }

  fs::path dir_;
  std::vector<std::pair<std::string, Tensor>> tensors_;
};

TEST_F(BrokenCheckpoint, MissingTensorIsNamed) {
  std::erase_if(tensors_, [](const auto& t) { return t.first == "model.layers.2.self_attn.k_norm.weight"; });
  write();
  EXPECT_NE(load_error().find("model.layers.2.self_attn.k_norm.weight"), std::string::npos) << load_error();
}

TEST_F(BrokenCheckpoint, ExtraTensorIsNamed) {
  tensors_.emplace_back("model.layers.0.self_attn.surprise.weight", Tensor::zeros({4}, DType::f32));
  write();
  EXPECT_NE(load_error().find("model.layers.0.self_attn.surprise.weight"), std::string::npos) << load_error();
}

TEST_F(BrokenCheckpoint, WrongShapeIsNamed) {
  for (auto& [name, t] : tensors_)
    if (name == "model.layers.0.self_attn.o_proj.weight") t = Tensor::zeros({48, 63}, DType::f32);
  write();
  const std::string error = load_error();
  EXPECT_NE(error.find("model.layers.0.self_attn.o_proj.weight"), std::string::npos) << error;
  EXPECT_NE(error.find("[48, 63]"), std::string::npos) << error;
}

TEST_F(BrokenCheckpoint, UnknownModelTypeListsSupported) {
  write();
  std::ifstream in(dir_ / "config.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  const auto at = text.find("\"qwen3_moe\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 11, "\"llama4_moe\"");
  std::ofstream(dir_ / "config.json") << text;
  const std::string error = load_error();
  EXPECT_NE(error.find("llama4_moe"), std::string::npos) << error;
  EXPECT_NE(error.find("deepseek_v3"), std::string::npos) << error;
}

TEST_F(BrokenCheckpoint, CorruptFileIsNamed) {
  write();
  fs::resize_file(dir_ / "model.safetensors", fs::file_size(dir_ / "model.safetensors") / 2);
  EXPECT_NE(load_error().find("model.safetensors"), std::string::npos) << load_error();
}

class BrokenVisionLanguageCheckpoint : public BrokenCheckpoint {
 protected:
  std::string fixture() const override { return "qwen3_vl_moe"; }
};

TEST_F(BrokenVisionLanguageCheckpoint, VisionTensorsAreSkippedOthersAreNamed) {
  // Any tensor of the vision tower is skipped, even one the tower does not have.
  tensors_.emplace_back("model.visual.blocks.7.surprise.weight", Tensor::zeros({4}, DType::f32));
  write();
  EXPECT_EQ(load_error(), "no error");
  for (const char* extra : {"model.language_model.layers.0.self_attn.surprise.weight", "model.audio_tower.proj.weight",
                            "model.layers.0.input_layernorm.weight"}) {
    tensors_.emplace_back(extra, Tensor::zeros({4}, DType::f32));
    write();
    const std::string error = load_error();
    EXPECT_NE(error.find("does not use"), std::string::npos) << error;
    EXPECT_NE(error.find(extra), std::string::npos) << error;
    tensors_.pop_back();
  }
}

// Qwen3-VL-MoE's published checkpoints store the fused experts transposed ([E, H, 2I], [E, I, H]): the
// same matrices stored that way must load into the same model, giving bitwise the same logits.
TEST_F(BrokenVisionLanguageCheckpoint, TransposedFusedExpertsLoadAsTheSameModel) {
  const std::vector<int32_t> tokens{3, 17, 42, 5, 9};
  const Tensor expected = CausalLM::from_pretrained(model_dir(fixture())).forward(tokens);
  int transposed = 0;
  for (auto& [name, t] : tensors_)
    if (name.ends_with("mlp.experts.gate_up_proj") || name.ends_with("mlp.experts.down_proj")) {
      t = t.transpose(1, 2).contiguous();
      ++transposed;
    }
  ASSERT_GT(transposed, 0) << "the fixture has no fused experts to transpose";
  write();
  const Tensor got = CausalLM::from_pretrained(dir_.string()).forward(tokens);
  ASSERT_EQ(got.shape(), expected.shape());
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.nbytes()), 0) << "logits differ after transposing the experts";
}

TEST_F(BrokenVisionLanguageCheckpoint, MissingLanguageModelTensorIsNamed) {
  std::erase_if(tensors_,
                [](const auto& t) { return t.first == "model.language_model.layers.2.mlp.experts.down_proj"; });
  write();
  EXPECT_NE(load_error().find("model.language_model.layers.2.mlp.experts"), std::string::npos) << load_error();
}

TEST(CausalLM, OutOfVocabularyTokenIsNamed) {
  CausalLM model = CausalLM::from_pretrained(model_dir("mixtral"));
  try {
    model.forward(std::vector<int32_t>{5, 96, 7});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("96"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("position 1"), std::string::npos) << e.what();
  }
}

}  // namespace

// moekit bench-gemm: times the Hopper grouped GEMM alone (the kernel of deepgemm's projections, without
// routing, row placement, activation quantisation or combine) on the projections of model shapes, in
// DeepGEMM's contiguous layout (or, with --masked, its masked decode layout) with every group holding the
// same number of rows, and sets each result beside DeepGEMM's own figure on the same GPU (issue 6 asks
// for >= 0.95x of it). Each row also gives the rate at which the weights were read (decode-sized cases
// are bound by it).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/bench_presets.h"
#include "moekit/bench_report.h"
#include "moekit/checked_math.h"
#include "moekit/commands.h"
#include "moekit/device.h"
#include "moekit/flag_table.h"
#include "moekit/hopper_gemm.h"
#include "moekit/kernel_options.h"
#include "moekit/testing/random_problem.h"

namespace moekit::cli {
namespace {

// Without --groups, each case holds this many rows in all, as DeepGEMM's contiguous tests do (4 x 8192,
// 8 x 4096): G = 32768 / rows per expert (128 experts at 256 rows, 16 at 2048).
constexpr int64_t kDefaultTotalRows = 32768;
// The L2 flush between timed calls: a copy of this many bytes (read and written) evicts the H200's 60 MB.
constexpr int64_t kFlushBytes = int64_t{128} << 20;

struct GemmBenchOptions {
  std::vector<std::string> shapes{"deepseek-v3", "qwen3-30b-a3b"};
  std::vector<std::string> projections{"gate_up", "down"};
  std::vector<int64_t> rows_per_expert{256, 512, 1024, 2048};
  int64_t groups = 0;
  std::vector<std::string> formats{"bf16", "fp8"};
  std::vector<std::string> epilogues{"store", "gated"};
  std::string device = "cuda";
  int warmup = 5;
  int repeats = 20;
  bool no_flush_l2 = false;
  bool masked = false;
  uint64_t seed = 0;
  std::string json_path = "bench-results/bench_gemm.json";
};

struct GemmBenchCommand {
  GemmBenchOptions options;
  std::unique_ptr<FlagTable> flags;
};

// DeepGEMM 2.6.1's grouped GEMM (m-grouped contiguous, GEMM only, bf16 output) measured on our H200, as
// issue 6 quotes it: a range over the cases where it gives no single figure. Rows per expert outside
// the listed ones have no figure.
struct DeepGemmFigure {
  std::string_view format;  // bf16, or fp8 for both scale formats
  std::string_view shape;
  std::string_view projection;
  std::array<int64_t, 3> rows_per_expert;  // 0: unused slot
  double low, high;                        // TFLOP/s
};

constexpr std::array<DeepGemmFigure, 6> kDeepGemmFigures{{
    {"bf16", "deepseek-v3", "gate_up", {512, 1024, 2048}, 760, 811},
    {"bf16", "deepseek-v3", "down", {512, 1024, 2048}, 760, 811},
    {"bf16", "qwen3-30b-a3b", "gate_up", {256, 0, 0}, 648, 648},
    {"bf16", "qwen3-30b-a3b", "gate_up", {512, 0, 0}, 719, 719},
    {"fp8", "deepseek-v3", "gate_up", {512, 1024, 2048}, 1143, 1430},
    {"fp8", "deepseek-v3", "down", {512, 1024, 2048}, 1143, 1430},
}};

std::optional<DeepGemmFigure> deepgemm_figure(const std::string& format, const std::string& shape,
                                              const std::string& projection, int64_t rows_per_expert) {
  const std::string_view family = format == "bf16" ? "bf16" : "fp8";
  for (const DeepGemmFigure& f : kDeepGemmFigures) {
    const bool rows =
        std::find(f.rows_per_expert.begin(), f.rows_per_expert.end(), rows_per_expert) != f.rows_per_expert.end();
    if (f.format == family && f.shape == shape && f.projection == projection && rows) return f;
  }
  return std::nullopt;
}

// One projection of a model's expert layer as a GEMM: N outputs, K deep.
struct GemmShape {
  std::string shape, projection;
  int64_t n = 0, k = 0;
};

GemmShape gemm_shape(const std::string& shape, const std::string& projection) {
  const auto preset =
      std::find_if(kShapePresets.begin(), kShapePresets.end(), [&](const ShapePreset& p) { return p.name == shape; });
  MOEKIT_CHECK(preset != kShapePresets.end(), "unknown shape '", shape, "'");
  if (projection == "gate_up") return {shape, projection, 2 * preset->intermediate, preset->hidden};
  MOEKIT_CHECK(projection == "down", "unknown projection '", projection, "'; valid: gate_up, down");
  return {shape, projection, preset->hidden, preset->intermediate};
}

// Operands on the device for up to max_groups groups: every group's weights are one random expert's,
// copied (the values do not change the time; each group still has weights of its own to read).
struct Weights {
  Tensor weights, scales;  // [G, N, K]; FP8 [G, N / 128, K / 128]
};

Weights make_weights(const GemmShape& s, const std::string& format, int64_t max_groups, uint64_t seed,
                     const DeviceStream& stream) {
  Tensor one = Tensor::empty({1, s.n, s.k}, DType::f32);
  fill_uniform(one, 1.0f / std::sqrt(static_cast<float>(s.k)), seed);
  Tensor one_scales;
  if (format == "bf16") {
    one = one.to(DType::bf16).to(stream.device());
  } else {
    const QuantizedWeights q =
        quantize_weights(one, WeightFormat::fp8_e4m3, format == "fp8-ue8m0" ? DType::ue8m0 : DType::f32);
    one = q.weights.to(stream.device());
    one_scales = q.scale_inv.to(stream.device());
  }
  Weights w;
  w.weights = Tensor::empty({max_groups, s.n, s.k}, one.dtype(), stream.device());
  if (one_scales.defined())
    w.scales = Tensor::empty({max_groups, one_scales.size(1), one_scales.size(2)}, one_scales.dtype(), stream.device());
  for (int64_t g = 0; g < max_groups; ++g) {
    Tensor dst = w.weights.slice(0, g, g + 1);
    copy_into(dst, one, stream);
    if (!one_scales.defined()) continue;
    Tensor dst_scales = w.scales.slice(0, g, g + 1);
    copy_into(dst_scales, one_scales, stream);
  }
  stream.synchronize();  // the sources are freed on return
  return w;
}

// The row matrix of G groups of m rows each in the contiguous layout (every group the same random rows),
// FP8 quantised per row and 128-wide group as the layer quantises them; padding rows are zero.
// Masked: G blocks of max_m = m rounded up to 128 rows, masked_m = m for every group.
GroupedGemmProblem make_problem(const GemmShape& s, const std::string& format, const Weights& w, int64_t groups,
                                int64_t m, bool masked, uint64_t seed, Device device) {
  GroupedGemmProblem p;
  // Every group holds m rows, so group g starts at tile g * max_m / 128 in both layouts: the masked
  // layout's rows are the contiguous one's, seen as [G, max_m, K].
  const Tensor offsets = contiguous_tile_offsets(std::vector<int64_t>(static_cast<std::size_t>(groups), m));
  const int64_t max_m = (m + 127) / 128 * 128;
  const int32_t* o = offsets.data_as<int32_t>();
  const int64_t M = int64_t{o[groups]} * 128, K = s.k;
  Tensor x = Tensor::empty({m, K}, DType::f32);
  fill_uniform(x, 1.0f, seed + 1);
  if (format == "bf16") {
    const Tensor xb = x.to(DType::bf16);
    Tensor rows = Tensor::zeros({M, K}, DType::bf16);
    for (int64_t g = 0; g < groups; ++g)
      std::memcpy(rows.data_as<bf16>() + int64_t{o[g]} * 128 * K, xb.data(), xb.nbytes());
    p.rows = rows.to(device);
  } else {
    const int64_t blocks = K / 128;
    Tensor codes = Tensor::zeros({m, K}, DType::f8_e4m3), scales = Tensor::empty({m, blocks}, DType::f32);
    std::vector<float> dequantized(static_cast<std::size_t>(K));
    for (int64_t r = 0; r < m; ++r)
      quantize_activations(x.data_as<float>() + r * K, K, format == "fp8-ue8m0", dequantized.data(),
                           codes.data_as<f8_e4m3>() + r * K, scales.data_as<float>() + r * blocks);
    Tensor rows = Tensor::zeros({M, K}, DType::f8_e4m3), row_scales = Tensor::empty({blocks, M}, DType::f32);
    std::fill_n(row_scales.data_as<float>(), blocks * M, 1.0f);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = int64_t{o[g]} * 128;
      std::memcpy(rows.data_as<f8_e4m3>() + first * K, codes.data(), codes.nbytes());
      for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < blocks; ++b)
          row_scales.data_as<float>()[b * M + first + r] = scales.data_as<float>()[r * blocks + b];
    }
    p.rows = rows.to(device);
    p.row_scales = row_scales.to(device);
    p.weight_scales = w.scales.slice(0, 0, groups);
  }
  p.weights = w.weights.slice(0, 0, groups);
  if (masked) {
    Tensor masked_m = Tensor::empty({groups}, DType::i32);
    std::fill_n(masked_m.data_as<int32_t>(), groups, static_cast<int32_t>(m));
    p.masked_m = masked_m.to(device);
    p.rows = p.rows.reshape({groups, max_m, K});
  } else {
    p.tile_offsets = offsets.to(device);
  }
  return p;
}

struct GemmRow {
  std::string format, shape, projection, epilogue;
  int64_t groups = 0, rows_per_expert = 0, n = 0, k = 0;
  double flops = 0, weight_bytes = 0, median_ms = 0, min_ms = 0, max_ms = 0;
  int runs = 0;
  std::optional<DeepGemmFigure> reference;
  double tflops() const { return flops / (median_ms * 1e-3) / 1e12; }
  double weight_tbs() const { return weight_bytes / (median_ms * 1e-3) / 1e12; }
};

std::string ratio_text(const GemmRow& r) {
  if (!r.reference) return "-";
  char buf[32];
  const double lo = r.tflops() / r.reference->high, hi = r.tflops() / r.reference->low;
  if (r.reference->low == r.reference->high)
    std::snprintf(buf, sizeof(buf), "%.2fx", lo);
  else
    std::snprintf(buf, sizeof(buf), "%.2f-%.2fx", lo, hi);
  return buf;
}

std::string reference_text(const GemmRow& r) {
  if (!r.reference) return "-";
  char buf[32];
  if (r.reference->low == r.reference->high)
    std::snprintf(buf, sizeof(buf), "%.0f", r.reference->low);
  else
    std::snprintf(buf, sizeof(buf), "%.0f-%.0f", r.reference->low, r.reference->high);
  return buf;
}

void print_header() {
  std::printf("%-9s %-13s %-7s %-5s %4s %5s %5s %5s %9s %8s %9s %11s %10s\n", "format", "shape", "proj", "epi", "G",
              "m", "N", "K", "us", "TFLOP/s", "DeepGEMM", "ratio", "weights TB/s");
}

void print_row(const GemmRow& r) {
  std::printf("%-9s %-13s %-7s %-5s %4lld %5lld %5lld %5lld %9.1f %8.1f %9s %11s %10.2f\n", r.format.c_str(),
              r.shape.c_str(), r.projection.c_str(), r.epilogue.c_str(), static_cast<long long>(r.groups),
              static_cast<long long>(r.rows_per_expert), static_cast<long long>(r.n), static_cast<long long>(r.k),
              r.median_ms * 1e3, r.tflops(), reference_text(r).c_str(), ratio_text(r).c_str(), r.weight_tbs());
  std::fflush(stdout);
}

nlohmann::ordered_json row_json(const GemmRow& r) {
  nlohmann::ordered_json j;
  j["format"] = r.format;
  j["shape"] = r.shape;
  j["projection"] = r.projection;
  j["epilogue"] = r.epilogue;
  j["groups"] = r.groups;
  j["rows_per_expert"] = r.rows_per_expert;
  j["n"] = r.n;
  j["k"] = r.k;
  j["flops"] = r.flops;
  j["median_ms"] = r.median_ms;
  j["min_ms"] = r.min_ms;
  j["max_ms"] = r.max_ms;
  j["runs"] = r.runs;
  j["tflops"] = r.tflops();
  j["weight_bytes"] = r.weight_bytes;
  j["weight_tb_per_s"] = r.weight_tbs();
  if (r.reference) {
    j["deepgemm_tflops_low"] = r.reference->low;
    j["deepgemm_tflops_high"] = r.reference->high;
    j["ratio_to_high"] = r.tflops() / r.reference->high;
    j["ratio_to_low"] = r.tflops() / r.reference->low;
  }
  return j;
}

void run(GemmBenchCommand& state) {
  const GemmBenchOptions& o = state.options;
  const Device device = parse_device(o.device);
  auto groups_for = [&](int64_t m) { return o.groups > 0 ? o.groups : std::max<int64_t>(1, kDefaultTotalRows / m); };
  // The operands' largest product: every row of the layout (groups x m padded to 128) by the widest K.
  int64_t widest_k = 0;
  for (const ShapePreset& p : kShapePresets) widest_k = std::max({widest_k, p.hidden, p.intermediate});
  for (const int64_t m : o.rows_per_expert)
    checked_mul(checked_mul(groups_for(m), checked_add(m, 127, "bench-gemm: --rows-per-expert padded to 128"),
                            "bench-gemm: --groups x --rows-per-expert"),
                widest_k, "bench-gemm: the row matrix's elements, rows x K");
  if (const Support s = hopper_grouped_gemm_supports_device(device); !s) MOEKIT_FAIL("bench-gemm: ", s.reason);
  MOEKIT_CHECK(!o.rows_per_expert.empty() && !o.shapes.empty() && !o.projections.empty() && !o.formats.empty() &&
                   !o.epilogues.empty(),
               "bench-gemm: --rows-per-expert, --shapes, --projections, --format and --epilogue need a value each");
  MOEKIT_CHECK(o.repeats >= 1, "bench-gemm: --repeats must be at least 1");
  // Ordered with the default stream, where tensors are allocated, filled and freed: the operands made
  // between cases are ready before the stream reads them.
  DeviceStream stream(device, /*ordered_with_default=*/true);
  DeviceTimer timer(stream);
  Tensor flush_src, flush_dst;
  if (!o.no_flush_l2) {
    flush_src = Tensor::zeros({kFlushBytes}, DType::u8, device);
    flush_dst = Tensor::empty({kFlushBytes}, DType::u8, device);
  }
  int64_t max_groups = 0;
  for (const int64_t m : o.rows_per_expert) max_groups = std::max(max_groups, groups_for(m));

  std::printf("moekit bench-gemm %s\n", state.flags->command_line().c_str());
  std::printf("kernel options: %s\n", describe(kernel_options()).c_str());
  std::printf("device: %s; the Hopper grouped GEMM alone, %s layout, median of %d calls after %d warm-up%s\n",
              device_name(device).c_str(), o.masked ? "masked" : "contiguous", o.repeats, o.warmup,
              o.no_flush_l2 ? "" : ", L2 flushed before each call (as DeepGEMM's bench_kineto)");
  std::printf(
      "DeepGEMM: 2.6.1 on the same H200 as quoted in issue 6 (ranges where it gives none per case); ratio = "
      "ours / DeepGEMM (over a range: ours / its high - ours / its low)\n\n");
  print_header();
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const std::string& format : o.formats) {
    for (const std::string& shape : o.shapes) {
      for (const std::string& projection : o.projections) {
        const GemmShape s = gemm_shape(shape, projection);
        const Weights w = make_weights(s, format, max_groups, o.seed, stream);
        for (const int64_t m : o.rows_per_expert) {
          const int64_t groups = groups_for(m);
          GroupedGemmProblem p = make_problem(s, format, w, groups, m, o.masked, o.seed, device);
          for (const std::string& epilogue : o.epilogues) {
            if (epilogue == "gated" && projection != "gate_up") continue;  // a gated epilogue pairs gate and up rows
            // gated: the layer's first projection, which with FP8 writes e4m3 codes and their scales.
            p.epilogue = epilogue != "gated" ? GroupedGemmEpilogue::store
                         : format == "bf16"  ? GroupedGemmEpilogue::gated
                                             : GroupedGemmEpilogue::gated_e4m3;
            if (const Support ok = hopper_grouped_gemm_supports(p); !ok) MOEKIT_FAIL("bench-gemm: ", ok.reason);
            Tensor out = Tensor::empty(grouped_gemm_out_shape(p), grouped_gemm_out_dtype(p), device);
            Tensor out_scales;
            if (p.epilogue == GroupedGemmEpilogue::gated_e4m3)
              out_scales = Tensor::empty(grouped_gemm_out_scales_shape(p), DType::f32, device);
            // The flush queued ahead of the start event also hides the host's launch time from the events.
            auto run_once = [&] {
              if (flush_src.defined()) copy_into(flush_dst, flush_src, stream);
              timer.start();
              hopper_grouped_gemm(p, out, out_scales, stream.stream());
              timer.stop();
              return timer.elapsed_ms();
            };
            for (int i = 0; i < o.warmup; ++i) run_once();
            std::vector<double> samples;
            for (int i = 0; i < o.repeats; ++i) samples.push_back(run_once());
            GemmRow r{format, shape, projection, epilogue, groups, m, s.n, s.k};
            r.flops = 2.0 * static_cast<double>(groups * m) * static_cast<double>(s.n) * static_cast<double>(s.k);
            r.weight_bytes = static_cast<double>(p.weights.nbytes()) +
                             (p.weight_scales.defined() ? static_cast<double>(p.weight_scales.nbytes()) : 0.0);
            r.median_ms = median(samples);
            r.min_ms = *std::min_element(samples.begin(), samples.end());
            r.max_ms = *std::max_element(samples.begin(), samples.end());
            r.runs = o.repeats;
            r.reference = deepgemm_figure(format, shape, projection, m);
            print_row(r);
            rows.push_back(row_json(r));
          }
        }
      }
    }
  }
  if (o.json_path.empty()) return;
  nlohmann::ordered_json root;
  root["command"] = "moekit bench-gemm " + state.flags->command_line();
  root["options"] = state.flags->values();
  root["device"] = device_name(device);
  root["kernel_options"] = describe(kernel_options());
  root["rows"] = rows;
  write_text_file(o.json_path, root.dump(2) + "\n");
  std::printf("\nwrote %s\n", o.json_path.c_str());
}

}  // namespace

void add_bench_gemm_command(CLI::App& app) {
  auto state = std::make_shared<GemmBenchCommand>();
  CLI::App* cmd = app.add_subcommand(
      "bench-gemm",
      "Time the Hopper grouped GEMM alone (deepgemm's projections without routing, gather, activation or combine) "
      "on model shapes, beside DeepGEMM's figures; compute capability 9.0 GPUs only");
  state->flags = std::make_unique<FlagTable>(cmd);
  FlagTable& f = *state->flags;
  GemmBenchOptions& o = state->options;
  std::vector<std::string> shape_names;
  for (const ShapePreset& p : kShapePresets) shape_names.emplace_back(p.name);
  f.add("--shapes", o.shapes, "Model shapes (bench's presets) whose projections run as GEMMs")
      ->delimiter(',')
      ->check(CLI::IsMember(shape_names));
  f.add("--projections", o.projections, "gate_up: N = 2I, K = H; down: N = H, K = I")
      ->delimiter(',')
      ->check(CLI::IsMember({"gate_up", "down"}));
  f.add("--rows-per-expert", o.rows_per_expert, "Rows m of every group (padded to a multiple of 128 in the layout)")
      ->delimiter(',')
      ->check(at_least(1));
  f.add("--groups", o.groups, "Groups G; 0 = 32768 rows in all (G = 32768 / m), as DeepGEMM's contiguous tests")
      ->check(at_least(0));
  f.add("--format", o.formats,
        "bf16; fp8 = e4m3 with f32 128x128 weight scales and 1x128 row scales; fp8-ue8m0 = the same with ue8m0 "
        "weight scales and power-of-two row scales")
      ->delimiter(',')
      ->check(CLI::IsMember({"bf16", "fp8", "fp8-ue8m0"}));
  f.add("--epilogue", o.epilogues,
        "store = plain bf16 rows (what DeepGEMM's figures measure); gated = silu(gate) * up as the layer's first "
        "projection stores it (gate_up only; with FP8 as e4m3 codes and a scale per row and 128 outputs)")
      ->delimiter(',')
      ->check(CLI::IsMember({"store", "gated"}));
  f.add("--device", o.device, "cuda or cuda:N (a compute capability 9.0 GPU)");
  f.add("--warmup", o.warmup, "Untimed calls per case")->check(at_least(0));
  f.add("--repeats", o.repeats, "Timed calls per case; the median is reported")->check(at_least(1));
  f.add("--no-flush-l2", o.no_flush_l2, "Do not evict L2 (a copy of 128 MiB) before each timed call");
  f.add("--masked", o.masked,
        "DeepGEMM's masked layout (decode): rows [G, max_m, K] with max_m = m rounded up to 128 and masked_m = m "
        "on the device, instead of the contiguous one");
  f.add("--seed", o.seed, "Seed of weights and rows");
  f.add("--json", o.json_path, "Results file (empty: none)");
  cmd->callback([state] { run(*state); });
}

}  // namespace moekit::cli

// moekit bench: times experts backends on model-sized problems and reports, per DESIGN §7, the median
// time, FLOP/s, bandwidth against the memory floor and the ratio to the best backend at each token count.
// This file holds the flags, the memory check and the timing loop; bench_report.{h,cpp} presents rows.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moekit/bench_machine.h"
#include "moekit/bench_presets.h"
#include "moekit/bench_report.h"
#include "moekit/checked_math.h"
#include "moekit/commands.h"
#include "moekit/device.h"
#include "moekit/experts.h"
#include "moekit/flag_table.h"
#include "moekit/kernel_options.h"
#include "moekit/testing/random_problem.h"

namespace moekit::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Every option of one run. Zero in a numeric field means "work it out" (see each flag's help).
struct BenchOptions {
  std::vector<std::string> shapes{"qwen3-30b-a3b"};
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t experts = 0;
  int64_t top_k = 0;
  std::vector<int64_t> tokens{1, 8, 64, 512, 4096};
  std::vector<std::string> backends{"eager", "batched_mm", "grouped_mm"};
  std::string dtype = "bf16";
  std::string weights = "bf16";
  std::string device = "cpu";
  int warmup = 3;
  int repeats = 0;
  double max_seconds_per_case = 3.0;
  uint64_t seed = 0;
  std::string json_path = "bench-results/bench.json";
  std::string plot_path = "bench-results/bench.svg";
  double memory_bandwidth_gbs = 0;
  double max_memory_gb = 0;
  bool graphs = false;
  bool backward = false;
  bool recompute = false;
};

// Adaptive repeats: this many runs make a stable median for fast cases...
constexpr int kEnoughRuns = 20;
// ...once they also cover this much time, so that timer resolution and frequency ramps wash out...
constexpr double kSettleMs = 100;
// ...and a case never gets fewer runs than this unless one call alone overruns the time budget.
constexpr int kMinRuns = 3;
constexpr int kMaxRuns = 1000;

struct BenchCommand {
  BenchOptions options;
  CLI::App* cmd = nullptr;
  std::unique_ptr<FlagTable> flags;
};

// --- Progress --------------------------------------------------------------------------------------------

// "[3/15] qwen3-30b-a3b T=512 grouped_mm ..." on stderr. On a terminal the line is rewritten in place and
// cleared before table rows print; redirected, each case gets its own line for the log.
class Progress {
 public:
  explicit Progress(std::size_t total) : total_(total), tty_(isatty(STDERR_FILENO) != 0) {}
  void announce(const std::string& what) {
    ++done_;
    std::fprintf(stderr, "%s[%zu/%zu] %s ...%s", tty_ ? "\r\033[K" : "", done_, total_, what.c_str(), tty_ ? "" : "\n");
    std::fflush(stderr);
  }
  void skip(std::size_t cases) { done_ += cases; }
  void clear() {
    if (tty_) std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  }

 private:
  std::size_t total_;
  std::size_t done_ = 0;
  bool tty_;
};

// --- Shapes and memory ------------------------------------------------------------------------------------

// Also rewrites o.shapes to what runs, so that the printed options repeat the run.
std::vector<BenchShape> resolve_shapes(BenchOptions& o, const CLI::App& cmd) {
  const bool all_sizes = o.hidden > 0 && o.intermediate > 0 && o.experts > 0 && o.top_k > 0;
  // All four sizes without --shape describe one custom layer rather than a change to the default preset.
  if (all_sizes && cmd.count("--shape") == 0) o.shapes = {"custom"};
  // Listed beside 'custom', presets keep their sizes: the size flags then describe the custom shape only.
  const bool has_custom = std::find(o.shapes.begin(), o.shapes.end(), "custom") != o.shapes.end();
  const bool any_size = !has_custom && (o.hidden > 0 || o.intermediate > 0 || o.experts > 0 || o.top_k > 0);
  std::vector<BenchShape> shapes;
  for (const std::string& name : o.shapes) {
    if (name == "custom") {
      MOEKIT_CHECK(all_sizes, "--shape custom needs all of --hidden, --intermediate, --experts and --top-k");
      shapes.push_back({"custom", o.hidden, o.intermediate, o.experts, o.top_k});
      continue;
    }
    const auto preset =
        std::find_if(kShapePresets.begin(), kShapePresets.end(), [&](const ShapePreset& p) { return p.name == name; });
    MOEKIT_CHECK(preset != kShapePresets.end(), "unknown shape '", name, "'");
    BenchShape s{std::string(preset->name), preset->hidden, preset->intermediate, preset->experts, preset->top_k};
    if (any_size) {
      // The name records what was overridden, so rows never pass for the real model's sizes.
      std::string changed;
      const auto override_size = [&](int64_t value, int64_t& field, const char* label) {
        if (value <= 0) return;
        field = value;
        changed += (changed.empty() ? "" : ",") + std::string(label) + "=" + std::to_string(value);
      };
      override_size(o.hidden, s.hidden, "H");
      override_size(o.intermediate, s.intermediate, "I");
      override_size(o.experts, s.experts, "E");
      override_size(o.top_k, s.top_k, "K");
      s.name += "[" + changed + "]";
    }
    MOEKIT_CHECK(s.top_k <= s.experts, s.name, ": top-k ", s.top_k, " is larger than the number of experts ",
                 s.experts);
    shapes.push_back(std::move(s));
  }
  // The sweep's largest product of sizes is gate_up_proj's element count; with it in int64, all are.
  for (const BenchShape& s : shapes)
    checked_mul(checked_mul(s.experts, checked_mul(2, s.intermediate, s.name + ": 2 x intermediate"),
                            s.name + ": experts x 2 x intermediate"),
                s.hidden, s.name + ": gate_up_proj's elements, experts x 2 x intermediate x hidden");
  return shapes;
}

// How the expert weights are stored (--weights): unquantised in the activation dtype, or block-quantised.
struct WeightStorage {
  WeightFormat format = WeightFormat::none;
  DType scale_dtype = DType::f32;
};

WeightStorage parse_weight_storage(const std::string& name) {
  if (name == "fp8") return {WeightFormat::fp8_e4m3, DType::f32};
  if (name == "fp8-ue8m0") return {WeightFormat::fp8_e4m3, DType::ue8m0};
  if (name == "fp4") return {WeightFormat::fp4_e2m1, DType::ue8m0};
  MOEKIT_CHECK(name == "bf16", "unknown --weights '", name, "'; valid: bf16, fp8, fp8-ue8m0, fp4");
  return {};
}

// Bytes of one projection's stored weights [E, N, K] and their scales.
double projection_bytes(const WeightStorage& w, DType dtype, int64_t experts, int64_t rows, int64_t cols) {
  const double values = static_cast<double>(experts) * static_cast<double>(rows) * static_cast<double>(cols);
  if (w.format == WeightFormat::none) return values * static_cast<double>(dtype_size(dtype));
  const Shape scales = weight_scale_shape(w.format, experts, rows, cols);
  const double scale_count = static_cast<double>(scales[0] * scales[1] * scales[2]);
  return values * (w.format == WeightFormat::fp4_e2m1 ? 0.5 : 1.0) +
         scale_count * static_cast<double>(dtype_size(w.scale_dtype));
}

// Bytes a shape holds for the whole sweep, before any backend's workspace.
struct MemoryNeed {
  double weights = 0;      // gate_up_proj + down_proj (and their scales when quantised)
  double activations = 0;  // hidden states, output and routing at the largest token count
};

MemoryNeed memory_need(const BenchShape& s, DType dtype, const WeightStorage& w, int64_t max_tokens) {
  const double d = static_cast<double>(dtype_size(dtype));
  const double H = static_cast<double>(s.hidden);
  const double T = static_cast<double>(max_tokens), K = static_cast<double>(s.top_k);
  MemoryNeed need;
  need.weights = projection_bytes(w, dtype, s.experts, 2 * s.intermediate, s.hidden) +
                 projection_bytes(w, dtype, s.experts, s.hidden, s.intermediate);
  // Hidden states and output, plus two routings (the problem's own and one redrawn per token count),
  // each with i64 ids and f32 weights.
  need.activations = 2.0 * T * H * d + 2.0 * T * K * (8.0 + 4.0);
  return need;
}

// Address space that reads as zeros and commits no memory, so that backends can size their workspace
// for a shape (workspace_bytes takes a problem) before its weights exist.
class ZeroPages {
 public:
  explicit ZeroPages(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 1)) {
    data_ = mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    MOEKIT_CHECK(data_ != MAP_FAILED, "cannot reserve ", gb(static_cast<double>(bytes_)), " of address space");
  }
  ~ZeroPages() { munmap(data_, bytes_); }
  ZeroPages(const ZeroPages&) = delete;
  ZeroPages& operator=(const ZeroPages&) = delete;
  void* data() const { return data_; }

 private:
  std::size_t bytes_;
  void* data_;
};

RandomProblemOptions problem_options(const BenchShape& s, DType dtype, const WeightStorage& w, int64_t tokens,
                                     uint64_t seed) {
  RandomProblemOptions r;
  r.config.quantization.weights = w.format;
  r.scale_dtype = w.scale_dtype;
  r.tokens = tokens;
  r.hidden = s.hidden;
  r.intermediate = s.intermediate;
  r.experts = s.experts;
  r.top_k = s.top_k;
  r.dtype = dtype;
  r.seed = seed;
  return r;
}

// The largest workspace any of the backends asks for at the largest token count, and whose it is.
std::pair<std::size_t, std::string> largest_workspace(const BenchShape& s, DType dtype, const WeightStorage& w,
                                                      Device device, int64_t max_tokens,
                                                      const std::vector<std::string>& backends) {
  const RandomProblemOptions o = problem_options(s, dtype, w, max_tokens, 0);
  const auto d = static_cast<std::size_t>(dtype_size(dtype));
  const auto weight_elems = static_cast<std::size_t>(s.experts * 2 * s.intermediate * s.hidden);
  const auto hidden_elems = static_cast<std::size_t>(max_tokens * s.hidden);
  ZeroPages zeros(std::max(weight_elems, hidden_elems) * d);
  ExpertsProblem p;
  p.hidden_states = Tensor::from_blob(zeros.data(), {max_tokens, s.hidden}, dtype, device);
  if (w.format == WeightFormat::none) {
    p.gate_up_proj = Tensor::from_blob(zeros.data(), {s.experts, 2 * s.intermediate, s.hidden}, dtype, device);
    p.down_proj = Tensor::from_blob(zeros.data(), {s.experts, s.hidden, s.intermediate}, dtype, device);
  } else {
    // Quantised weights and scales take no more bytes than the unquantised weights the zeros cover.
    const DType q = w.format == WeightFormat::fp8_e4m3 ? DType::f8_e4m3 : DType::f4_e2m1;
    const int64_t N = 2 * s.intermediate, H = s.hidden, I = s.intermediate, E = s.experts;
    p.config.quantization.weights = w.format;
    p.gate_up_proj = Tensor::from_blob(zeros.data(), quantized_weight_shape(w.format, E, N, H), q, device);
    p.down_proj = Tensor::from_blob(zeros.data(), quantized_weight_shape(w.format, E, H, I), q, device);
    p.gate_up_proj_scale_inv =
        Tensor::from_blob(zeros.data(), weight_scale_shape(w.format, E, N, H), w.scale_dtype, device);
    p.down_proj_scale_inv =
        Tensor::from_blob(zeros.data(), weight_scale_shape(w.format, E, H, I), w.scale_dtype, device);
  }
  redraw_routing(p, o, 0);
  if (!device.is_cpu()) {
    p.top_k_index = p.top_k_index.to(device);
    p.top_k_weights = p.top_k_weights.to(device);
  }
  validate(p);
  std::pair<std::size_t, std::string> largest{0, ""};
  for (const std::string& name : backends) {
    ExpertsBackend& b = ExpertsInterface::global().get(name);
    if (!b.supports_device(device) || !b.supports(p)) continue;
    const std::size_t bytes = b.workspace_bytes(p);
    if (bytes > largest.first) largest = {bytes, name};
  }
  return largest;
}

// --- One case ------------------------------------------------------------------------------------------------

struct TimingPlan {
  int warmup = 0;
  int repeats = 0;  // 0: adaptive
  double budget_ms = 0;
};

// Runs warm-up then timed calls of run_once (returning ms) and fills the row's timing fields.
// predicted_ms (0: unknown) is what one call should take, from the same backend at a smaller token count.
void time_case(const std::function<double()>& run_once, const TimingPlan& plan, double predicted_ms, BenchRow& row) {
  std::vector<double> samples;
  const auto finish = [&] {
    row.runs = static_cast<int>(samples.size());
    row.median_ms = median(samples);
    row.min_ms = *std::min_element(samples.begin(), samples.end());
    row.max_ms = *std::max_element(samples.begin(), samples.end());
  };
  if (plan.repeats > 0) {  // explicit counts are honoured exactly, whatever they cost
    for (int i = 0; i < plan.warmup; ++i, ++row.warmup_runs) run_once();
    for (int i = 0; i < plan.repeats; ++i) samples.push_back(run_once());
    finish();
    return;
  }
  double spent = 0;  // in warm-up calls
  if (predicted_ms >= plan.budget_ms) {
    // One call alone should overrun the budget: a single call keeps the sweep to minutes, one-time work
    // (weight packing) already happened at the smaller token count, and at these durations run-to-run
    // noise is small next to the differences being measured.
    const double t = run_once();
    if (t >= plan.budget_ms) {
      samples.push_back(t);
      finish();
      return;
    }
    // Far faster than predicted: the backend changed kernels between the two token counts (decode
    // streaming at 8 tokens, the grouped GEMM at 4,096), so this was that kernel's first, cold call; it
    // counts as a warm-up and the case is timed as usual.
    spent += t;
    ++row.warmup_runs;
  }
  // Warm-up absorbs one-time work (weight packing, first-touch page faults); once it has used the case's
  // budget, more of it would only delay the sweep.
  for (; row.warmup_runs < plan.warmup && spent < plan.budget_ms; ++row.warmup_runs) spent += run_once();
  double elapsed = 0;
  for (;;) {
    const double t = run_once();
    samples.push_back(t);
    elapsed += t;
    const int n = static_cast<int>(samples.size());
    if (n >= kMaxRuns || (n >= kEnoughRuns && elapsed >= kSettleMs)) break;
    if (n == 1 && t >= plan.budget_ms) break;                  // the first timed call already used the budget
    if (n >= kMinRuns && elapsed + t > plan.budget_ms) break;  // the next call would overrun it
  }
  finish();
}

// Routed pairs (ids < E) and distinct experts they touch: the FLOP count and the memory floor both
// follow the routing actually drawn, not its expectation.
std::pair<double, int64_t> routing_stats(const Tensor& top_k_index, int64_t experts) {
  std::vector<bool> touched(static_cast<std::size_t>(experts), false);
  double pairs = 0;
  visit_index_dtype(top_k_index.dtype(), [&](auto tag) {
    using Index = typename decltype(tag)::type;
    const Index* ids = top_k_index.data_as<Index>();
    for (int64_t i = 0; i < top_k_index.numel(); ++i) {
      if (ids[i] < 0 || ids[i] >= experts) continue;
      ++pairs;
      touched[static_cast<std::size_t>(ids[i])] = true;
    }
  });
  return {pairs, static_cast<int64_t>(std::count(touched.begin(), touched.end(), true))};
}

// --- The sweep -----------------------------------------------------------------------------------------------

// One run of `moekit bench`: resolved options, the report being filled and where rows are printed.
class Sweep {
 public:
  explicit Sweep(BenchCommand& state);
  void run();

 private:
  void run_shape(const BenchShape& shape);
  // Routing and sizes of one token count, shared by the backends' rows.
  BenchRow case_row(const BenchShape& shape, const ExpertsProblem& problem, const ExpertsProblem& base) const;
  void time_backend(const std::string& name, const ExpertsProblem& problem, double resident_bytes, BenchRow& row);
  void refuse(const BenchShape& shape, const std::string& why);
  void save();

  BenchOptions& o_;
  Device device_;
  DType dtype_;
  WeightStorage weights_;
  std::string weights_label_;  // "bf16 expert weights", "fp8 (e4m3, f32 scales) expert weights"
  double budget_bytes_ = 0;
  BenchReport report_;
  std::vector<BenchShape> shapes_;
  std::unique_ptr<TablePrinter> table_;
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<DeviceStream> stream_;
  // Per backend, the median and routed pairs at the previous token count of the current shape: time grows
  // at most about linearly in pairs, so this predicts which calls will overrun the budget before running them.
  std::map<std::string, std::pair<double, double>> previous_;
};

Sweep::Sweep(BenchCommand& state)
    : o_(state.options),
      device_(parse_device(o_.device)),
      dtype_(parse_dtype(o_.dtype)),
      weights_(parse_weight_storage(o_.weights)) {
  weights_label_ = weights_.format == WeightFormat::none
                       ? o_.dtype
                       : o_.weights + " (" + std::string(weight_format_name(weights_.format)) + ", " +
                             std::string(dtype_name(weights_.scale_dtype)) + " scales; " + o_.dtype + " activations)";
  stream_ = std::make_unique<DeviceStream>(device_);
  for (const std::string& name : o_.backends) ExpertsInterface::global().get(name);  // throws with the valid names
  MOEKIT_CHECK(!o_.tokens.empty() && !o_.backends.empty(), "--tokens and --backends need at least one value");
  // Ascending token counts: the largest sizes the shape's shared buffers, and predictions come from below.
  std::sort(o_.tokens.begin(), o_.tokens.end());
  o_.tokens.erase(std::unique(o_.tokens.begin(), o_.tokens.end()), o_.tokens.end());
  shapes_ = resolve_shapes(o_, *state.cmd);

  const double load_at_start = load_average();
  // Resolve the "work it out" defaults before printing, so that the printed options repeat this run.
  std::string bandwidth_source = "--memory-bandwidth-gbs";
  if (o_.memory_bandwidth_gbs <= 0) {
    std::fprintf(stderr, "measuring memory bandwidth ...\n");
    if (device_.is_cpu()) {
      o_.memory_bandwidth_gbs = round_to_tenth(measure_copy_bandwidth_gbs());
      bandwidth_source = "measured: memcpy of 256 MiB split over " + std::to_string(hardware_threads()) +
                         " threads, best of 5, read + write bytes counted";
    } else {
      o_.memory_bandwidth_gbs = round_to_tenth(measure_device_copy_bandwidth_gbs(*stream_));
      bandwidth_source = "measured: device-to-device copy of 2 GiB, best of 10, read + write bytes counted";
    }
  }
  const double available_bytes = proc_kb_field_bytes("/proc/meminfo", "MemAvailable");
  std::string budget_source = "--max-memory-gb";
  if (o_.max_memory_gb <= 0 && !device_.is_cpu()) {
    // No public query of free device memory: assume an H200-class card and leave room for the runtime.
    o_.max_memory_gb = 120;
    budget_source = "default for a GPU (pass --max-memory-gb for a smaller card)";
  }
  if (o_.max_memory_gb <= 0) {
    MOEKIT_CHECK(available_bytes > 0, "cannot read MemAvailable from /proc/meminfo; pass --max-memory-gb");
    // The rest stays free for the OS and for what backends allocate outside the workspace they declare.
    o_.max_memory_gb = round_to_tenth(0.8 * available_bytes / 1e9);
    budget_source = "80% of MemAvailable";
  }
  budget_bytes_ = o_.max_memory_gb * 1e9;

  report_.options = state.flags->values();
  const std::string cpu_model = proc_field("/proc/cpuinfo", "model name");
  report_.machine["cpu_model"] = cpu_model;
  report_.machine["hardware_threads"] = hardware_threads();
  report_.machine["device"] = device_name(device_);
  report_.machine["memory_bandwidth_gbs"] = o_.memory_bandwidth_gbs;
  report_.machine["memory_bandwidth_source"] = bandwidth_source;
  report_.machine["mem_available_gb"] = available_bytes / 1e9;
  report_.machine["memory_budget_gb"] = o_.max_memory_gb;
  report_.machine["memory_budget_source"] = budget_source;
  report_.machine["load_average_at_start"] = load_at_start;
  report_.machine["started_utc"] = utc_timestamp();
  report_.unit = device_.is_cpu() ? FlopUnit{"GFLOP/s", 1e9} : FlopUnit{"TFLOP/s", 1e12};
  report_.title =
      std::string(o_.backward ? "moekit bench (forward + backward): " : "moekit bench: ") +
      (weights_.format == WeightFormat::none ? o_.dtype : o_.weights + " weights, " + o_.dtype + " activations") +
      " on " + device_name(device_) + " (" + (cpu_model.empty() ? "unknown cpu" : cpu_model) + ", " +
      std::to_string(hardware_threads()) + " threads)";
  report_.shapes = shapes_;

  std::printf("moekit bench %s\n", state.flags->command_line().c_str());
  std::printf("machine: %s, %u threads; memory bandwidth %.1f GB/s (%s); memory budget %s (%s)\n", cpu_model.c_str(),
              hardware_threads(), o_.memory_bandwidth_gbs, bandwidth_source.c_str(), gb(budget_bytes_).c_str(),
              budget_source.c_str());
  report_.kernel_options = describe(kernel_options());
  std::printf("kernel options: %s\n", report_.kernel_options.c_str());
  if (load_at_start >= 0.5) {
    std::printf(
        "note: load average %.1f on %u threads: other processes are using the cores, so times are inflated "
        "and noisy\n",
        load_at_start, hardware_threads());
  }
  std::fflush(stdout);

  std::size_t shape_width = 0, backend_width = 0;
  for (const auto& s : shapes_) shape_width = std::max(shape_width, s.name.size());
  for (const auto& b : o_.backends) backend_width = std::max(backend_width, b.size());
  table_ = std::make_unique<TablePrinter>(stdout, report_.unit, shape_width, backend_width);
  progress_ = std::make_unique<Progress>(shapes_.size() * o_.tokens.size() * o_.backends.size());
}

void Sweep::run() {
  for (const BenchShape& shape : shapes_) {
    try {
      run_shape(shape);
    } catch (const std::exception& e) {  // out of memory while filling weights, say: the other shapes still run
      refuse(shape, shape.name + " failed: " + e.what());
    }
    save();  // after every shape, so that an interrupted sweep keeps what it measured
  }
  progress_->clear();
  if (!o_.json_path.empty()) std::printf("\nwrote %s", o_.json_path.c_str());
  if (!o_.plot_path.empty()) std::printf("%s%s", o_.json_path.empty() ? "\nwrote " : " and ", o_.plot_path.c_str());
  if (!o_.json_path.empty() || !o_.plot_path.empty()) std::printf("\n");
  // A backend that cannot run a case is a row of the table, not a failure; a case that threw, or a shape
  // that could not run at all, is: scripts that drive the bench must not read an empty sweep as success.
  const auto failed = std::count_if(report_.rows.begin(), report_.rows.end(),
                                    [](const BenchRow& r) { return r.status == RowStatus::failed; });
  const std::size_t refused = report_.refused_shapes.size();
  MOEKIT_CHECK(failed == 0 && refused == 0, "bench: ", failed, " case(s) failed and ", refused, " of ", shapes_.size(),
               " shape(s) did not run (see the messages and rows above)");
}

void Sweep::refuse(const BenchShape& shape, const std::string& why) {
  progress_->clear();
  std::printf("\n%s\n", why.c_str());
  std::fflush(stdout);
  report_.refused_shapes.push_back({{"shape", shape.name}, {"reason", why}});
  const std::size_t done = static_cast<std::size_t>(std::count_if(
      report_.rows.begin(), report_.rows.end(), [&](const BenchRow& r) { return r.shape == shape.name; }));
  progress_->skip(o_.tokens.size() * o_.backends.size() - done);
}

void Sweep::save() {
  report_.machine["load_average_at_end"] = load_average();
  report_.machine["peak_rss_gb"] = proc_kb_field_bytes("/proc/self/status", "VmHWM") / 1e9;
  if (!o_.json_path.empty()) write_json(report_, o_.json_path);
  if (!o_.plot_path.empty()) write_svg(report_, o_.plot_path);
}

void Sweep::run_shape(const BenchShape& shape) {
  const int64_t max_tokens = o_.tokens.back();
  const MemoryNeed need = memory_need(shape, dtype_, weights_, max_tokens);
  if (need.weights > budget_bytes_) {
    refuse(shape, shape.name + " needs " + gb(need.weights) + " of " + weights_label_ +
                      " expert weights, more than the " + gb(budget_bytes_) + " available (--max-memory-gb); skipped");
    return;
  }
  if (need.weights + need.activations > budget_bytes_) {
    refuse(shape, shape.name + " needs " + gb(need.weights) + " of " + weights_label_ + " expert weights and " +
                      gb(need.activations) + " of activations at T=" + std::to_string(max_tokens) + ", more than the " +
                      gb(budget_bytes_) + " available (--max-memory-gb); skipped");
    return;
  }
  const auto [max_workspace, workspace_owner] =
      largest_workspace(shape, dtype_, weights_, device_, max_tokens, o_.backends);
  progress_->clear();
  std::printf(
      "\n%s: H=%lld I=%lld E=%lld K=%lld, %s; %s expert weights + %s activations + %s workspace%s\n",
      shape.name.c_str(), static_cast<long long>(shape.hidden), static_cast<long long>(shape.intermediate),
      static_cast<long long>(shape.experts), static_cast<long long>(shape.top_k), weights_label_.c_str(),
      gb(need.weights).c_str(), gb(need.activations).c_str(), gb(static_cast<double>(max_workspace)).c_str(),
      workspace_owner.empty() ? "" : (" (" + workspace_owner + " at T=" + std::to_string(max_tokens) + ")").c_str());
  std::fflush(stdout);

  // Weights are drawn once per shape at the largest token count; each token count shares them and gets the
  // first T hidden rows and a routing of its own.
  std::fprintf(stderr, "filling %s of random %s expert weights for %s ...\n", gb(need.weights).c_str(),
               weights_label_.c_str(), shape.name.c_str());
  // base stays on the CPU (its routing statistics are read there); the weights go to the device once.
  const ExpertsProblem base = make_random_problem(problem_options(shape, dtype_, weights_, max_tokens, o_.seed));
  const Tensor device_up = base.gate_up_proj.to(device_), device_down = base.down_proj.to(device_);
  table_->print_header();
  previous_.clear();
  for (const int64_t tokens : o_.tokens) {
    ExpertsProblem problem = base;
    problem.hidden_states = base.hidden_states.slice(0, 0, tokens);
    redraw_routing(problem, problem_options(shape, dtype_, weights_, tokens, o_.seed),
                   o_.seed + static_cast<uint64_t>(tokens));
    const BenchRow shared = case_row(shape, problem, base);  // reads the ids while they are on the CPU
    if (!device_.is_cpu()) {
      problem.hidden_states = problem.hidden_states.to(device_);
      problem.top_k_index = problem.top_k_index.to(device_);
      problem.top_k_weights = problem.top_k_weights.to(device_);
      problem.gate_up_proj = device_up;
      problem.down_proj = device_down;
      if (problem.gate_up_proj_scale_inv.defined()) {  // small: copied per token count
        problem.gate_up_proj_scale_inv = problem.gate_up_proj_scale_inv.to(device_);
        problem.down_proj_scale_inv = problem.down_proj_scale_inv.to(device_);
      }
    }
    std::vector<BenchRow> group;
    for (const std::string& name : o_.backends) {
      progress_->announce(shape.name + " T=" + std::to_string(tokens) + " " + name);
      BenchRow row = shared;
      row.backend = name;
      time_backend(name, problem, need.weights + need.activations, row);
      row.rss_gb = proc_kb_field_bytes("/proc/self/status", "VmRSS") / 1e9;
      group.push_back(std::move(row));
    }
    fill_speedups(group);
    progress_->clear();
    table_->print_rows(group);
    report_.rows.insert(report_.rows.end(), group.begin(), group.end());
  }
}

BenchRow Sweep::case_row(const BenchShape& shape, const ExpertsProblem& problem, const ExpertsProblem& base) const {
  const ExpertsShape sizes = validate(problem);
  const auto [pairs, touched] = routing_stats(problem.top_k_index, shape.experts);
  BenchRow row;
  row.shape = shape.name;
  row.tokens = sizes.tokens;
  row.routed_pairs = pairs;
  row.experts_touched = touched;
  row.flops = experts_flops(sizes, problem.config.has_gate, pairs);
  if (o_.backward) row.flops += experts_backward_flops(sizes, problem.config.has_gate, pairs);
  // DESIGN §7's floor: every touched expert's weights read once (quantised: their stored bytes and scales),
  // hidden states read and output written once.
  auto bytes = [](const Tensor& t) { return t.defined() ? static_cast<double>(t.nbytes()) : 0.0; };
  const double expert_bytes = (bytes(base.gate_up_proj) + bytes(base.down_proj) + bytes(base.gate_up_proj_scale_inv) +
                               bytes(base.down_proj_scale_inv)) /
                              static_cast<double>(sizes.experts);
  const double row_bytes = static_cast<double>(sizes.hidden) * static_cast<double>(dtype_size(dtype_));
  row.floor_bytes = static_cast<double>(touched) * expert_bytes + static_cast<double>(sizes.tokens) * row_bytes * 2.0;
  // Forward + backward: each touched expert's weights read by both and its gradients written once; x read by
  // both, out written, grad_out read and grad_x written.
  if (o_.backward)
    row.floor_bytes =
        3.0 * static_cast<double>(touched) * expert_bytes + static_cast<double>(sizes.tokens) * row_bytes * 5.0;
  row.floor_ms = row.floor_bytes / (o_.memory_bandwidth_gbs * 1e9) * 1e3;
  return row;
}

void Sweep::time_backend(const std::string& name, const ExpertsProblem& problem, double resident_bytes, BenchRow& row) {
  ExpertsBackend& backend = ExpertsInterface::global().get(name);
  Support support = backend.supports_device(device_);
  if (support) support = backend.supports(problem);
  if (support && o_.backward) support = backend.supports_backward(problem);
  if (!support) {
    row.status = RowStatus::skipped;
    row.reason = support.reason;
    return;
  }
  row.kernel = backend.kernel_path(problem);
  row.workspace_bytes = backend.workspace_bytes(problem);
  // --backward: the forward keeps what the backend saves for its backward (none: it recomputes), unless --recompute.
  const std::size_t saved_bytes = o_.backward && !o_.recompute ? backend.saved_activation_bytes(problem) : 0;
  const std::size_t backward_workspace = !o_.backward      ? 0
                                         : saved_bytes > 0 ? backend.saved_backward_workspace_bytes(problem)
                                                           : backend.backward_workspace_bytes(problem);
  if (saved_bytes > 0) {
    row.workspace_bytes = backend.saving_workspace_bytes(problem);
    row.kernel += "; backward from the forward's kept activations (" + gb(static_cast<double>(saved_bytes)) + ")";
  }
  auto bytes = [](const Tensor& t) { return t.defined() ? static_cast<double>(t.nbytes()) : 0.0; };
  const double out_bytes = static_cast<double>(row.tokens * problem.hidden_states.size(1)) * dtype_size(dtype_);
  const double gradient_bytes = o_.backward ? out_bytes * 2 + bytes(problem.top_k_weights) +
                                                  bytes(problem.gate_up_proj) + bytes(problem.down_proj) +
                                                  bytes(problem.gate_up_proj_bias) + bytes(problem.down_proj_bias)
                                            : 0.0;  // grad_out and the gradients
  // One workspace for the forward and the backward, as a training step reuses it: the backward runs after the forward
  // on the same stream and reads nothing of the forward's workspace (what it needs from the forward is `saved`).
  const std::size_t call_workspace = std::max(row.workspace_bytes, backward_workspace);
  row.call_memory_bytes =
      out_bytes + static_cast<double>(call_workspace) + static_cast<double>(saved_bytes) + gradient_bytes;
  const double total = resident_bytes + row.call_memory_bytes;
  if (total > budget_bytes_) {
    row.status = RowStatus::skipped;
    row.reason = "needs " + gb(row.call_memory_bytes) + " for out, workspace and gradients, " + gb(total) +
                 " in all, more than the " + gb(budget_bytes_) + " available (--max-memory-gb)";
    return;
  }
  if (o_.graphs && name == "eager") {
    row.status = RowStatus::skipped;
    row.reason = "eager reads the per-expert counts back to the host, so it cannot be captured in a CUDA graph";
    return;
  }
  try {
    Tensor out = Tensor::empty({row.tokens, problem.hidden_states.size(1)}, dtype_, device_);
    // The workspace is allocated once, outside the timed region, as a serving loop would.
    Tensor workspace =
        Tensor::empty({static_cast<int64_t>(std::max<std::size_t>(call_workspace, 1))}, DType::u8, device_);
    // With --backward, grad_out and the gradients too, allocated once.
    Tensor grad_out, saved;
    ExpertsGradients grads;
    if (o_.backward) {
      grad_out = Tensor::empty(out.shape(), DType::f32);
      fill_uniform(grad_out, 1.0f, o_.seed + 17);
      grad_out = grad_out.to(dtype_).to(device_);
      grads = experts_backward(problem, grad_out, name, ExpertsGradients(), stream_->stream());  // allocates them
      if (saved_bytes > 0) saved = Tensor::empty({static_cast<int64_t>(saved_bytes)}, DType::u8, device_);
    }
    const auto call = [&] {
      if (saved_bytes > 0)
        experts_forward_saving(problem, name, out, saved, stream_->stream(), workspace);
      else
        experts_forward(problem, name, out, stream_->stream(), workspace);
      if (o_.backward) experts_backward(problem, grad_out, name, grads, stream_->stream(), workspace, saved);
    };
    DeviceTimer timer(*stream_);
    std::unique_ptr<CapturedGraph> graph;
    if (o_.graphs) graph = std::make_unique<CapturedGraph>(*stream_, call);
    // On a GPU, the host's part of each call too: what it takes to enqueue the call's work. Each timed call starts
    // on an idle GPU, so where this approaches the call's time the kernels wait for their launches.
    std::vector<double> host_ms;
    const auto run_once = [&] {
      timer.start();
      const auto enqueue_start = std::chrono::steady_clock::now();
      if (graph)
        graph->replay();
      else
        call();
      host_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - enqueue_start).count());
      timer.stop();
      return timer.elapsed_ms();
    };
    const auto prev = previous_.find(name);
    const double predicted_ms =
        prev == previous_.end() ? 0.0 : prev->second.first * std::max(1.0, row.routed_pairs / prev->second.second);
    time_case(run_once, TimingPlan{o_.warmup, o_.repeats, o_.max_seconds_per_case * 1e3}, predicted_ms, row);
    if (device_.is_cuda() && row.runs > 0 && host_ms.size() >= static_cast<std::size_t>(row.runs))
      row.host_enqueue_ms = median(std::vector<double>(host_ms.end() - row.runs, host_ms.end()));  // the timed calls
    previous_[name] = {row.median_ms, std::max(1.0, row.routed_pairs)};
  } catch (const std::exception& e) {
    row.status = RowStatus::failed;
    row.reason = e.what();
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto state = std::make_shared<BenchCommand>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Time experts backends on model-sized problems: ms, FLOP/s, GB/s against the memory floor, ratio to "
      "the best backend; writes JSON and an SVG plot");
  state->cmd = cmd;
  state->flags = std::make_unique<FlagTable>(cmd);
  FlagTable& f = *state->flags;
  BenchOptions& o = state->options;

  std::vector<std::string> shape_names;
  std::string preset_list;
  for (const ShapePreset& p : kShapePresets) {
    shape_names.emplace_back(p.name);
    preset_list += "\n  " + std::string(p.name) + " (H=" + std::to_string(p.hidden) +
                   ", I=" + std::to_string(p.intermediate) + ", E=" + std::to_string(p.experts) +
                   ", K=" + std::to_string(p.top_k) + ")";
  }
  shape_names.emplace_back("custom");
  f.add("--shape", o.shapes,
        "Expert-layer shapes, comma-separated or repeated; 'custom' takes --hidden/--intermediate/--experts/--top-k:" +
            preset_list)
      ->delimiter(',')
      ->check(CLI::IsMember(shape_names));
  f.add("--hidden", o.hidden,
        "H; 0 keeps the preset's. Size flags change the listed presets, or describe 'custom' when it is listed "
        "(all four sizes and no --shape also mean custom)")
      ->check(at_least(0));
  f.add("--intermediate", o.intermediate, "I per expert; 0 keeps the preset's")->check(at_least(0));
  f.add("--experts", o.experts, "E; 0 keeps the preset's")->check(at_least(0));
  f.add("--top-k", o.top_k, "K experts per token; 0 keeps the preset's")->check(at_least(0));
  f.add("--tokens", o.tokens, "Token counts T, comma-separated or repeated")->delimiter(',')->check(at_least(1));
  f.add("--backends", o.backends, "Backends to time, comma-separated or repeated")->delimiter(',');
  f.add("--dtype", o.dtype, "Activation dtype (and weight dtype with --weights bf16)")
      ->check(CLI::IsMember({"bf16", "f16", "f32"}));
  f.add("--weights", o.weights,
        "Expert weights: bf16 = unquantised, stored in --dtype; fp8 = e4m3 with f32 128x128 block scales; "
        "fp8-ue8m0 = e4m3 with ue8m0 block scales; fp4 = e2m1 pairs with a ue8m0 scale per 32. Quantised runs "
        "quantise activations per token and 128-wide group; the floor counts the stored bytes and scales")
      ->check(CLI::IsMember({"bf16", "fp8", "fp8-ue8m0", "fp4"}));
  f.add("--device", o.device, "cpu, cuda or cuda:N");
  f.add("--warmup", o.warmup, "Untimed calls per case before timing (stops early once they use the case's time budget)")
      ->check(at_least(0));
  f.add("--repeats", o.repeats,
        "Timed calls per case; 0 = adaptive: at least 20 for fast cases, within --max-seconds-per-case, at least 3 "
        "(1 when a single call overruns the budget). The median is reported")
      ->check(at_least(0));
  f.add("--max-seconds-per-case", o.max_seconds_per_case, "Time budget of one case for adaptive repeats")
      ->check(at_least(0.001));
  f.add("--seed", o.seed, "Seed of weights, inputs and routing");
  f.add("--json", o.json_path, "Results file (empty: none)");
  f.add("--plot", o.plot_path, "SVG plot of time against tokens, one panel per shape (empty: none)");
  f.add("--graphs", o.graphs,
        "Capture each call in a CUDA graph once and time its replays (launch gaps gone; CUDA only; eager "
        "cannot be captured)");
  f.add("--backward", o.backward,
        "Time forward + backward (DESIGN §2b) per call: FLOPs 18·pairs·H·I gated (6 forward, 12 backward); the floor "
        "reads the touched weights twice and writes their gradients; call GB adds the gradients and what the forward "
        "keeps, with one workspace for both calls (the larger of the two), as a training step reuses it");
  f.add("--recompute", o.recompute,
        "With --backward: run the backward that recomputes what it needs, also for backends whose forward can keep "
        "activations for it (deepgemm, sonicmoe keep z; the kernel column says so and call GB counts them)");
  f.add("--memory-bandwidth-gbs", o.memory_bandwidth_gbs,
        "Memory bandwidth for the floor, GB/s; 0 = measure with a large multi-threaded memcpy at start")
      ->check(at_least(0));
  f.add("--max-memory-gb", o.max_memory_gb,
        "Shapes (and cases) needing more memory than this are skipped; 0 = 80% of MemAvailable")
      ->check(at_least(0));

  cmd->callback([state] { Sweep(*state).run(); });
}

}  // namespace moekit::cli

// The results of `moekit bench`: rows, the printed table, the JSON file and the SVG plot.
// Plain data only: nothing here knows about tensors or backends, so the timing loop (cmd_bench.cpp)
// and the presentation change independently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moekit::cli {

// The sizes of one benchmarked expert layer.
struct BenchShape {
  std::string name;
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int64_t experts = 0;       // E
  int64_t top_k = 0;         // K
};

enum class RowStatus { ok, skipped, failed };

// One (shape, tokens, backend) case.
struct BenchRow {
  std::string shape;
  int64_t tokens = 0;
  std::string backend;
  std::string kernel;  // the backend's kernel_path for the case (what ran); empty when it was skipped
  RowStatus status = RowStatus::ok;
  std::string reason;  // why it was skipped or failed

  // Timing, milliseconds per call; valid when status == ok.
  double median_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
  int runs = 0;
  int warmup_runs = 0;
  double host_enqueue_ms = 0;  // GPU: median host time to enqueue a timed call (0: not measured, as on the CPU)

  // What the call had to do (DESIGN §7); known for every row, timed or not.
  double routed_pairs = 0;      // (token, slot) pairs with an id < E
  int64_t experts_touched = 0;  // distinct experts that received at least one pair
  double flops = 0;
  double floor_bytes = 0;  // touched experts' weights + hidden states in and out
  double floor_ms = 0;     // floor_bytes over the memory bandwidth
  std::size_t workspace_bytes = 0;
  // What one call holds beyond its inputs: out and the workspace, and with --backward the gradients and the
  // backward's workspace (nothing is saved between the two: the backward recomputes what it needs).
  double call_memory_bytes = 0;
  double rss_gb = 0;  // resident memory of the process after the case

  double speedup_vs_best = 0;  // best median / this median within the (shape, tokens) group; 1 for the best
};

// FLOP/s are shown in one unit per device so columns compare at a glance.
struct FlopUnit {
  std::string name;  // "GFLOP/s"
  double scale = 1;  // FLOP/s per unit
};

// Fills speedup_vs_best over one (shape, tokens) group of rows.
void fill_speedups(std::vector<BenchRow>& group);

// Prints rows as aligned columns, one group at a time, so results show while the sweep runs.
class TablePrinter {
 public:
  TablePrinter(std::FILE* out, FlopUnit unit, std::size_t shape_width, std::size_t backend_width);
  void print_header() const;
  void print_rows(const std::vector<BenchRow>& rows) const;

 private:
  std::FILE* out_;
  FlopUnit unit_;
  int shape_width_;
  int backend_width_;
};

// Everything one run produced.
struct BenchReport {
  nlohmann::ordered_json options;  // every flag, as resolved for the run
  nlohmann::ordered_json machine;  // cpu model, threads, bandwidth, memory
  std::string kernel_options;      // describe(kernel_options()) for the run
  std::string title;               // the plot's heading
  FlopUnit unit;
  std::vector<BenchShape> shapes;                      // in run order, including refused ones
  std::vector<nlohmann::ordered_json> refused_shapes;  // {"shape", "reason"}
  std::vector<BenchRow> rows;
};

// The median of timing samples (non-empty).
double median(std::vector<double> samples);

// Writes text to path, creating its directory when missing; throws moekit::Error when it cannot.
void write_text_file(const std::string& path, const std::string& text);

// Both create the file's directory when missing and throw moekit::Error when the file cannot be written.
void write_json(const BenchReport& report, const std::string& path);
// Time per call against tokens, both log scale: one panel per shape that has results, one line per backend.
void write_svg(const BenchReport& report, const std::string& path);

}  // namespace moekit::cli

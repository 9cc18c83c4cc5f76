#include "moekit/bench_report.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "moekit/error.h"

namespace moekit::cli {
namespace {

const char* status_name(RowStatus status) {
  switch (status) {
    case RowStatus::ok:
      return "ok";
    case RowStatus::skipped:
      return "skipped";
    case RowStatus::failed:
      return "failed";
  }
  return "?";
}

// Three or four significant digits without exponents: readable for values from 0.001 to 100000.
std::string format_number(double v) {
  char buf[32];
  const double a = std::fabs(v);
  // Thresholds sit just below the powers of ten so that 99.97 prints as "100", not "100.0".
  const char* format = a >= 99.95 ? "%.0f" : a >= 9.995 ? "%.1f" : a >= 0.9995 ? "%.2f" : a >= 0.01 ? "%.3f" : "%.2g";
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

// Two decimals, as ratios are read ("0.52x"), keeping one significant digit for very slow backends.
std::string format_ratio(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), v >= 0.01 ? "%.2fx" : "%.1gx", v);
  return buf;
}

double seconds(double ms) {
  return ms * 1e-3;
}

double flop_rate(const BenchRow& row, const FlopUnit& unit) {
  return row.flops / seconds(row.median_ms) / unit.scale;
}
double floor_gbs(const BenchRow& row) {
  return row.floor_bytes / seconds(row.median_ms) / 1e9;
}
double floor_percent(const BenchRow& row) {
  return 100.0 * row.floor_ms / row.median_ms;
}

void create_parent_directory(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
  MOEKIT_CHECK(!ec, "cannot create directory ", parent.string(), ": ", ec.message());
}

}  // namespace

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void write_text_file(const std::string& path, const std::string& text) {
  create_parent_directory(path);
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  MOEKIT_CHECK(file.good(), "cannot open ", path, " for writing");
  file << text;
  file.close();
  MOEKIT_CHECK(file.good(), "failed writing ", path);
}

namespace {

nlohmann::ordered_json row_to_json(const BenchRow& row) {
  nlohmann::ordered_json j;
  j["shape"] = row.shape;
  j["tokens"] = row.tokens;
  j["backend"] = row.backend;
  if (!row.kernel.empty()) j["kernel"] = row.kernel;
  j["status"] = status_name(row.status);
  if (row.status != RowStatus::ok) j["reason"] = row.reason;
  if (row.status == RowStatus::ok) {
    j["median_ms"] = row.median_ms;
    j["min_ms"] = row.min_ms;
    j["max_ms"] = row.max_ms;
    j["runs"] = row.runs;
    j["warmup_runs"] = row.warmup_runs;
    if (row.host_enqueue_ms > 0) j["host_enqueue_ms"] = row.host_enqueue_ms;
    j["flops_per_second"] = row.flops / seconds(row.median_ms);
    j["floor_gb_per_second"] = floor_gbs(row);
    j["floor_percent"] = floor_percent(row);
    j["speedup_vs_best"] = row.speedup_vs_best;
    j["workspace_bytes"] = row.workspace_bytes;
    j["call_memory_bytes"] = row.call_memory_bytes;
    j["rss_gb"] = row.rss_gb;
  }
  j["routed_pairs"] = row.routed_pairs;
  j["experts_touched"] = row.experts_touched;
  j["flops"] = row.flops;
  j["floor_bytes"] = row.floor_bytes;
  j["floor_ms"] = row.floor_ms;
  return j;
}

// --- SVG ---------------------------------------------------------------------------------------------

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Colours that stay distinct for the colour-blind and in greyscale print (the matplotlib "tab10" order).
constexpr const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

// A log10 axis mapping [lo, hi] (values, not logs) onto pixels [p0, p1].
struct LogAxis {
  double lo, hi, p0, p1;
  double map(double v) const {
    return p0 + (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo)) * (p1 - p0);
  }
};

// Decades covering [lo, hi], and 2x/5x steps too when the range is narrow enough that decades alone
// would leave the axis with one or two labels.
std::vector<double> log_ticks(double lo, double hi) {
  const int d0 = static_cast<int>(std::floor(std::log10(lo)));
  const int d1 = static_cast<int>(std::ceil(std::log10(hi)));
  const bool fine = d1 - d0 <= 2;
  std::vector<double> ticks;
  for (int d = d0; d <= d1; ++d) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m != 1.0 && !fine) continue;
      const double v = m * std::pow(10.0, d);
      if (v >= lo * 0.999 && v <= hi * 1.001) ticks.push_back(v);
    }
  }
  return ticks;
}

// Greedy word wrap; a word longer than a line gets a line of its own.
std::vector<std::string> wrap_words(const std::string& text, std::size_t max_chars) {
  std::vector<std::string> lines;
  std::istringstream words(text);
  std::string word, line;
  while (words >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > max_chars) {
      lines.push_back(line);
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

std::string tick_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

class SvgWriter {
 public:
  void line(double x1, double y1, double x2, double y2, const char* stroke, double width, bool dashed = false) {
    os_ << "<line x1=\"" << x1 << "\" y1=\"" << y1 << "\" x2=\"" << x2 << "\" y2=\"" << y2 << "\" stroke=\"" << stroke
        << "\" stroke-width=\"" << width << "\"" << (dashed ? " stroke-dasharray=\"3,3\"" : "") << "/>\n";
  }
  void rect(double x, double y, double w, double h, const char* fill, const char* stroke) {
    os_ << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << h << "\" fill=\"" << fill
        << "\" stroke=\"" << stroke << "\"/>\n";
  }
  void circle(double x, double y, double r, const char* fill) {
    os_ << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"" << r << "\" fill=\"" << fill << "\"/>\n";
  }
  void polyline(const std::vector<std::pair<double, double>>& points, const char* stroke) {
    os_ << "<polyline fill=\"none\" stroke=\"" << stroke << "\" stroke-width=\"2\" points=\"";
    for (const auto& [x, y] : points) os_ << x << "," << y << " ";
    os_ << "\"/>\n";
  }
  // anchor: start | middle | end. rotate: degrees around (x, y).
  void text(double x, double y, const std::string& s, int size, const char* anchor = "start", double rotate = 0,
            const char* weight = "normal") {
    os_ << "<text x=\"" << x << "\" y=\"" << y << "\" font-size=\"" << size << "\" text-anchor=\"" << anchor
        << "\" font-weight=\"" << weight << "\"";
    if (rotate != 0) os_ << " transform=\"rotate(" << rotate << " " << x << " " << y << ")\"";
    os_ << ">" << xml_escape(s) << "</text>\n";
  }
  std::string finish(double width, double height) const {
    std::ostringstream doc;
    doc << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
        << "\" viewBox=\"0 0 " << width << " " << height
        << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n"
        << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
        << os_.str() << "</svg>\n";
    return doc.str();
  }

 private:
  std::ostringstream os_;
};

// Panel geometry in pixels.
constexpr double kPanelWidth = 520, kPanelHeight = 360;
constexpr double kPlotLeft = 72, kPlotRight = 16, kPlotTop = 34, kPlotBottom = 48;

void draw_panel(SvgWriter& svg, double x0, double y0, const BenchShape& shape, const std::vector<const BenchRow*>& rows,
                const LogAxis& tokens_axis_template, const std::vector<double>& token_ticks,
                const std::map<std::string, std::size_t>& colour_of) {
  const double left = x0 + kPlotLeft, right = x0 + kPanelWidth - kPlotRight;
  const double top = y0 + kPlotTop, bottom = y0 + kPanelHeight - kPlotBottom;
  char sizes[128];
  std::snprintf(sizes, sizeof(sizes), "  (H=%lld I=%lld E=%lld K=%lld)", static_cast<long long>(shape.hidden),
                static_cast<long long>(shape.intermediate), static_cast<long long>(shape.experts),
                static_cast<long long>(shape.top_k));
  svg.text(x0 + kPanelWidth / 2, y0 + 20, shape.name + sizes, 14, "middle", 0, "bold");
  svg.rect(left, top, right - left, bottom - top, "none", "#444");

  LogAxis x = tokens_axis_template;
  x.p0 = left;
  x.p1 = right;
  for (double t : token_ticks) {
    const double px = x.map(t);
    svg.line(px, top, px, bottom, "#ddd", 1);
    svg.line(px, bottom, px, bottom + 4, "#444", 1);
    svg.text(px, bottom + 17, tick_label(t), 11, "middle");
  }
  svg.text((left + right) / 2, bottom + 38, "tokens per call (log scale)", 12, "middle");
  svg.text(x0 + 16, (top + bottom) / 2, "time per call, ms (log scale)", 12, "middle", -90);

  double lo = 0, hi = 0;
  for (const BenchRow* r : rows) {
    if (r->status != RowStatus::ok) continue;
    lo = lo == 0 ? r->median_ms : std::min(lo, r->median_ms);
    hi = std::max(hi, r->median_ms);
  }
  if (hi == 0) {
    svg.text((left + right) / 2, (top + bottom) / 2, "no timed results (see the table for reasons)", 13, "middle");
    return;
  }
  // Whole decades keep the grid lines on round numbers.
  const LogAxis y{std::pow(10.0, std::floor(std::log10(lo))), std::pow(10.0, std::ceil(std::log10(hi * 1.0001))),
                  bottom, top};
  for (double v : log_ticks(y.lo, y.hi)) {
    const double py = y.map(v);
    svg.line(left, py, right, py, "#ddd", 1);
    svg.line(left - 4, py, left, py, "#444", 1);
    svg.text(left - 7, py + 4, tick_label(v), 11, "end");
  }

  std::map<std::string, std::vector<std::pair<double, double>>> lines;
  for (const BenchRow* r : rows) {
    if (r->status == RowStatus::ok)
      lines[r->backend].push_back({x.map(static_cast<double>(r->tokens)), y.map(r->median_ms)});
  }
  for (auto& [backend, points] : lines) {
    std::sort(points.begin(), points.end());
    const char* colour = kPalette[colour_of.at(backend) % std::size(kPalette)];
    if (points.size() > 1) svg.polyline(points, colour);
    for (const auto& [px, py] : points) svg.circle(px, py, 3.5, colour);
  }
}

}  // namespace

void fill_speedups(std::vector<BenchRow>& group) {
  double best = 0;
  for (const BenchRow& r : group) {
    if (r.status == RowStatus::ok && (best == 0 || r.median_ms < best)) best = r.median_ms;
  }
  for (BenchRow& r : group) r.speedup_vs_best = r.status == RowStatus::ok ? best / r.median_ms : 0;
}

TablePrinter::TablePrinter(std::FILE* out, FlopUnit unit, std::size_t shape_width, std::size_t backend_width)
    : out_(out),
      unit_(std::move(unit)),
      shape_width_(static_cast<int>(std::max<std::size_t>(shape_width, 5))),
      backend_width_(static_cast<int>(std::max<std::size_t>(backend_width, 7))) {}

void TablePrinter::print_header() const {
  std::fprintf(out_, "%-*s %6s  %-*s %10s %9s %8s %8s %8s %5s %8s  %s\n", shape_width_, "shape", "tokens",
               backend_width_, "backend", "ms", unit_.name.c_str(), "GB/s", "% floor", "vs best", "runs", "call GB",
               "kernel");
  std::fflush(out_);
}

void TablePrinter::print_rows(const std::vector<BenchRow>& rows) const {
  for (const BenchRow& r : rows) {
    std::fprintf(out_, "%-*s %6lld  %-*s ", shape_width_, r.shape.c_str(), static_cast<long long>(r.tokens),
                 backend_width_, r.backend.c_str());
    if (r.status == RowStatus::ok) {
      std::fprintf(out_, "%10s %9s %8s %8s %8s %5d %8s  %s\n", format_number(r.median_ms).c_str(),
                   format_number(flop_rate(r, unit_)).c_str(), format_number(floor_gbs(r)).c_str(),
                   format_number(floor_percent(r)).c_str(), format_ratio(r.speedup_vs_best).c_str(), r.runs,
                   format_number(r.call_memory_bytes / 1e9).c_str(), r.kernel.c_str());
    } else {
      std::fprintf(out_, "%s: %s\n", status_name(r.status), r.reason.c_str());
    }
  }
  std::fflush(out_);
}

void write_json(const BenchReport& report, const std::string& path) {
  nlohmann::ordered_json root;
  root["tool"] = "moekit bench";
  root["options"] = report.options;
  root["machine"] = report.machine;
  root["kernel_options"] = report.kernel_options;
  root["flop_unit"] = report.unit.name;
  root["shapes"] = nlohmann::ordered_json::array();
  for (const BenchShape& s : report.shapes) {
    root["shapes"].push_back({{"name", s.name},
                              {"hidden", s.hidden},
                              {"intermediate", s.intermediate},
                              {"experts", s.experts},
                              {"top_k", s.top_k}});
  }
  root["refused_shapes"] = report.refused_shapes;
  root["rows"] = nlohmann::ordered_json::array();
  for (const BenchRow& r : report.rows) root["rows"].push_back(row_to_json(r));
  write_text_file(path, root.dump(2) + "\n");
}

void write_svg(const BenchReport& report, const std::string& path) {
  // Backends keep one colour across panels, in order of first appearance.
  std::map<std::string, std::size_t> colour_of;
  std::vector<std::string> backends;
  std::map<std::string, bool> has_results;
  double t_lo = 0, t_hi = 0;
  for (const BenchRow& r : report.rows) {
    if (colour_of.emplace(r.backend, backends.size()).second) backends.push_back(r.backend);
    has_results[r.backend] = has_results[r.backend] || r.status == RowStatus::ok;
    const double t = static_cast<double>(r.tokens);
    t_lo = t_lo == 0 ? t : std::min(t_lo, t);
    t_hi = std::max(t_hi, t);
  }
  std::vector<const BenchShape*> panels;
  for (const BenchShape& s : report.shapes) {
    if (std::any_of(report.rows.begin(), report.rows.end(), [&](const BenchRow& r) { return r.shape == s.name; })) {
      panels.push_back(&s);
    }
  }
  if (t_lo == 0) t_lo = t_hi = 1;
  std::vector<double> token_ticks;
  for (const BenchRow& r : report.rows) token_ticks.push_back(static_cast<double>(r.tokens));
  std::sort(token_ticks.begin(), token_ticks.end());
  token_ticks.erase(std::unique(token_ticks.begin(), token_ticks.end()), token_ticks.end());
  // Half a step of margin on each side so the end points do not sit on the frame.
  const LogAxis tokens_axis{t_lo / 1.6, t_hi * 1.6, 0, 1};

  const std::size_t columns = std::clamp<std::size_t>(panels.size(), 1, 2);
  const std::size_t panel_rows = (panels.size() + columns - 1) / columns;
  const double panels_width = kPanelWidth * static_cast<double>(columns);
  // Wide enough for the title and legend even with a single panel, which is then centred.
  const double width = std::max(panels_width, 680.0);
  const double panels_left = (width - panels_width) / 2;

  // Legend entries flow left to right and wrap; label widths are estimated at 7.5 px a character.
  struct LegendEntry {
    double x, y;
    std::string label;
    const char* colour;
  };
  std::vector<LegendEntry> legend;
  double lx = 20, ly = 46;
  for (const std::string& b : backends) {
    const std::string label = has_results[b] ? b : b + " (no results)";
    const double entry_width = 44 + 7.5 * static_cast<double>(label.size());
    if (lx + entry_width > width && lx > 20) {
      lx = 20;
      ly += 22;
    }
    legend.push_back({lx, ly, label, kPalette[colour_of[b] % std::size(kPalette)]});
    lx += entry_width;
  }
  const double header = ly + 18;
  std::vector<std::string> footer_lines;
  for (const auto& refused : report.refused_shapes) {
    const auto max_chars =
        static_cast<std::size_t>((width - 24) / 6.8);  // 12 px text averages under 6.8 px a character
    for (const std::string& line : wrap_words("not run: " + refused.value("reason", std::string()), max_chars)) {
      footer_lines.push_back(line);
    }
  }
  const double footer = 18.0 * static_cast<double>(footer_lines.size()) + 10;
  const double height = header + kPanelHeight * static_cast<double>(panel_rows) + footer;

  SvgWriter svg;
  svg.text(width / 2, 22, report.title, 15, "middle", 0, "bold");
  for (const LegendEntry& e : legend) {
    svg.line(e.x, e.y, e.x + 24, e.y, e.colour, 2);
    svg.circle(e.x + 12, e.y, 3.5, e.colour);
    svg.text(e.x + 30, e.y + 4, e.label, 12);
  }

  for (std::size_t i = 0; i < panels.size(); ++i) {
    std::vector<const BenchRow*> rows;
    for (const BenchRow& r : report.rows) {
      if (r.shape == panels[i]->name) rows.push_back(&r);
    }
    const double x0 = panels_left + kPanelWidth * static_cast<double>(i % columns);
    const double y0 = header + kPanelHeight * static_cast<double>(i / columns);
    draw_panel(svg, x0, y0, *panels[i], rows, tokens_axis, token_ticks, colour_of);
  }
  double fy = header + kPanelHeight * static_cast<double>(panel_rows) + 14;
  for (const std::string& line : footer_lines) {
    svg.text(12, fy, line, 12);
    fy += 18;
  }
  write_text_file(path, svg.finish(width, height));
}

}  // namespace moekit::cli

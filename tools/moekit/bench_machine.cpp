// What the bench records about the machine it runs on: /proc fields, load, the copy bandwidth of memory and
// of the device, the time; and how it prints byte counts.
#include "moekit/bench_machine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <thread>
#include <vector>

namespace moekit::cli {

using Clock = std::chrono::steady_clock;

// The value of "key: value" lines in /proc files; empty when missing (not Linux, or no such key).
std::string proc_field(const char* file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const auto start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? std::string() : line.substr(start);
  }
  return {};
}

// "/proc/... kB" fields in bytes; 0 when unknown.
double proc_kb_field_bytes(const char* file, const std::string& key) {
  const std::string v = proc_field(file, key);
  return v.empty() ? 0.0 : std::atof(v.c_str()) * 1024.0;
}

// The 1-minute load average; other processes competing for the cores inflate every time measured.
double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = 0;
  in >> load;
  return load;
}

// Resolved defaults are printed as flags that repeat the run; a tenth is all the precision they carry.
double round_to_tenth(double v) {
  return std::round(v * 10.0) / 10.0;
}

unsigned hardware_threads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

// DRAM copy bandwidth with every hardware thread copying its share, as the backends use every thread.
double measure_copy_bandwidth_gbs() {
  // 256 MiB per buffer is far beyond any last-level cache, so this measures memory, not cache.
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  std::vector<char> src(kBytes, 1), dst(kBytes, 0);  // written here so page faults stay out of the timing
  const unsigned threads = hardware_threads();
  const std::size_t chunk = kBytes / threads;
  double best_s = std::numeric_limits<double>::infinity();
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (unsigned i = 0; i < threads; ++i) {
      const std::size_t begin = i * chunk, size = i + 1 == threads ? kBytes - begin : chunk;
      pool.emplace_back([&, begin, size] { std::memcpy(dst.data() + begin, src.data() + begin, size); });
    }
    for (auto& t : pool) t.join();
    best_s = std::min(best_s, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // A copy reads and writes every byte; counting both is the STREAM convention behind DESIGN §7's figures.
  return 2.0 * static_cast<double>(kBytes) / best_s / 1e9;
}

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Device copy bandwidth: a 2 GiB device-to-device copy timed with events, read + write bytes counted.
double measure_device_copy_bandwidth_gbs(const DeviceStream& stream) {
  const int64_t bytes = int64_t{1} << 31;
  Tensor src = Tensor::zeros({bytes}, DType::u8, stream.device());
  Tensor dst = Tensor::empty({bytes}, DType::u8, stream.device());
  synchronize(stream.device());
  DeviceTimer timer(stream);
  double best_ms = 1e30;
  for (int i = 0; i < 10; ++i) {
    timer.start();
    copy_into(dst, src, stream);
    timer.stop();
    best_ms = std::min(best_ms, timer.elapsed_ms());
  }
  return 2.0 * static_cast<double>(bytes) / (best_ms * 1e-3) / 1e9;
}

// Decimal units, as memory budgets and bandwidths are quoted.
std::string gb(double bytes) {
  char buf[32];
  if (bytes < 1e9) {
    std::snprintf(buf, sizeof(buf), "%.3g MB", bytes / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), bytes >= 10e9 ? "%.1f GB" : "%.2f GB", bytes / 1e9);
  }
  return buf;
}

}  // namespace moekit::cli

// What the bench records about the machine it runs on (see bench_machine.cpp).
#pragma once

#include <string>

#include "moekit/device.h"

namespace moekit::cli {

// The value of "key: value" lines in /proc files; empty when missing (not Linux, or no such key).
std::string proc_field(const char* file, const std::string& key);
// "/proc/... kB" fields in bytes; 0 when unknown.
double proc_kb_field_bytes(const char* file, const std::string& key);
// The 1-minute load average; other processes competing for the cores inflate every time measured.
double load_average();
// Resolved defaults are printed as flags that repeat the run; a tenth is all the precision they carry.
double round_to_tenth(double v);
unsigned hardware_threads();
// DRAM copy bandwidth with every hardware thread copying its share, as the backends use every thread.
double measure_copy_bandwidth_gbs();
std::string utc_timestamp();
// Device copy bandwidth: a 2 GiB device-to-device copy timed with events, read + write bytes counted.
double measure_device_copy_bandwidth_gbs(const DeviceStream& stream);
// Decimal units, as memory budgets and bandwidths are quoted.
std::string gb(double bytes);

}  // namespace moekit::cli

#include "moekit/commands.h"
namespace moekit::cli {
void add_bench_command(CLI::App& app) { app.add_subcommand("bench", "placeholder"); }
}  // namespace moekit::cli

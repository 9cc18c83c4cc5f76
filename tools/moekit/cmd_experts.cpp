#include "moekit/commands.h"
namespace moekit::cli {
void add_experts_command(CLI::App& app) { app.add_subcommand("experts", "placeholder"); }
}  // namespace moekit::cli

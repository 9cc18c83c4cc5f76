// The moekit command-line tool: each subcommand registers its flags (name, default, help, once) and
// its action on the app. The tool uses only the public API in include/moekit/.
#pragma once

#include <CLI/CLI.hpp>

namespace moekit::cli {

void add_backends_command(CLI::App& app);
void add_experts_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_bench_gemm_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_forward_command(CLI::App& app);
void add_make_model_command(CLI::App& app);
void add_quantize_command(CLI::App& app);

}  // namespace moekit::cli

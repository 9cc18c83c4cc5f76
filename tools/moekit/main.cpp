#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "moekit/commands.h"
#include "moekit/error.h"
#include "moekit/version.h"

int main(int argc, char** argv) {
  CLI::App app{"moekit: Mixture-of-Experts expert layers through interchangeable backends"};
  app.set_version_flag("--version", std::string("moekit ") + moekit::version());
  app.require_subcommand(1);
  moekit::cli::add_backends_command(app);
  moekit::cli::add_experts_command(app);
  moekit::cli::add_bench_command(app);
  moekit::cli::add_bench_gemm_command(app);
  moekit::cli::add_generate_command(app);
  moekit::cli::add_forward_command(app);
  moekit::cli::add_make_model_command(app);
  moekit::cli::add_quantize_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const moekit::Error& e) {
    std::fprintf(stderr, "moekit: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    // Where memory runs out outside moekit's own allocations, which say how much they asked for.
    std::fprintf(stderr, "moekit: error: out of memory (std::bad_alloc)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moekit: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// moekit backends: every registered backend, whether it can run here, and why not.
#include <cstdio>

#include "moekit/commands.h"
#include "moekit/experts.h"

namespace moekit::cli {

void add_backends_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("backends", "List the experts backends, whether each can run here, and why not");
  auto device_name_flag = std::make_shared<std::string>("cpu");
  cmd->add_option("--device", *device_name_flag, "Device to ask about: cpu, cuda or cuda:N")->capture_default_str();
  cmd->callback([device_name_flag] {
    const Device device = parse_device(*device_name_flag);
    auto& registry = ExpertsInterface::global();
    std::printf("%-18s %-6s %s\n", "backend", ("on " + device_name(device)).c_str(), "what it does");
    for (const auto& name : registry.names()) {
      const ExpertsBackend& b = registry.get(name);
      const Support s = b.supports_device(device);
      std::printf("%-18s %-6s %s%s%s\n", name.c_str(), s.ok ? "yes" : "no", std::string(b.description()).c_str(),
                  s.ok ? "" : "\n                          why not: ", s.ok ? "" : s.reason.c_str());
    }
  });
}

}  // namespace moekit::cli

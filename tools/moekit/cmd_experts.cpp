// moekit experts: runs one experts call on the tensors of a safetensors file and writes `out` [T, H]; with
// --grad-output (a file holding grad_out [T, H]) also its backward, and writes the gradients beside `out`.
// The layer configuration comes from the file's __metadata__; anything the tool would otherwise have to
// guess (an unknown key, a bias without has_bias, a stray tensor) is an error rather than ignored, so
// that a file never runs with a configuration other than the one its writer meant.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moekit/commands.h"
#include "moekit/experts.h"
#include "moekit/safetensors.h"

namespace moekit::cli {
namespace {

// `what` names the file and the key in errors.
bool parse_bool(const std::string& what, const std::string& value) {
  if (value == "true") return true;
  if (value == "false") return false;
  MOEKIT_FAIL(what, " must be \"true\" or \"false\", got \"", value, "\"");
}

float parse_finite_float(const std::string& what, const std::string& value) {
  float v = 0;
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, v);
  MOEKIT_CHECK(ec == std::errc() && ptr == end && std::isfinite(v), what, " must be a finite number, got \"", value,
               "\"");
  return v;
}

// The metadata keys the tool understands, each with what it sets; defaults are ExpertsConfig's.
struct MetadataKey {
  const char* name;
  void (*apply)(ExpertsConfig& config, const std::string& what, const std::string& value);
};

constexpr MetadataKey kMetadataKeys[] = {
    {"activation",
     [](ExpertsConfig& c, const std::string& what, const std::string& v) {
       try {
         c.activation = parse_activation(v);
       } catch (const Error& e) {
         MOEKIT_FAIL(what, ": ", e.what());
       }
     }},
    {"is_transposed",
     [](ExpertsConfig& c, const std::string& w, const std::string& v) { c.is_transposed = parse_bool(w, v); }},
    {"is_concatenated",
     [](ExpertsConfig& c, const std::string& w, const std::string& v) { c.is_concatenated = parse_bool(w, v); }},
    {"has_gate", [](ExpertsConfig& c, const std::string& w, const std::string& v) { c.has_gate = parse_bool(w, v); }},
    {"has_bias", [](ExpertsConfig& c, const std::string& w, const std::string& v) { c.has_bias = parse_bool(w, v); }},
    {"swiglu_alpha",
     [](ExpertsConfig& c, const std::string& w, const std::string& v) { c.swiglu_alpha = parse_finite_float(w, v); }},
    {"swiglu_limit",
     [](ExpertsConfig& c, const std::string& w, const std::string& v) {
       c.swiglu_limit = v == "none" ? std::nullopt : std::optional<float>(parse_finite_float(w, v));
     }},
    // Written by safetensors users such as transformers' save_pretrained ("pt"); says nothing about the layer.
    {"format", [](ExpertsConfig&, const std::string&, const std::string&) {}},
};

ExpertsConfig config_from_metadata(const SafetensorsFile& file) {
  ExpertsConfig config;
  for (const auto& [key, value] : file.metadata()) {
    const MetadataKey* known = nullptr;
    for (const auto& k : kMetadataKeys)
      if (key == k.name) known = &k;
    if (known == nullptr) {
      std::string valid;
      for (const auto& k : kMetadataKeys) valid += std::string(valid.empty() ? "" : ", ") + k.name;
      MOEKIT_FAIL(file.path(), ": unknown metadata key '", key, "'; valid: ", valid);
    }
    known->apply(config, file.path() + ": metadata key '" + key + "'", value);
  }
  return config;
}

// The tensors an input file holds for this configuration, and where each goes in the problem.
struct InputTensor {
  std::string name;
  Tensor ExpertsProblem::*field;
  const char* why;  // why the configuration needs it, for the "missing" error
};

std::vector<InputTensor> expected_tensors(const ExpertsConfig& c) {
  std::vector<InputTensor> t = {
      {"hidden_states", &ExpertsProblem::hidden_states, "always"},
      {"top_k_index", &ExpertsProblem::top_k_index, "always"},
      {"top_k_weights", &ExpertsProblem::top_k_weights, "always"},
      {c.has_gate ? "gate_up_proj" : "up_proj", &ExpertsProblem::gate_up_proj,
       c.has_gate ? "has_gate is true" : "has_gate is false"},
      {"down_proj", &ExpertsProblem::down_proj, "always"},
  };
  if (c.has_bias) {
    t.push_back(
        {c.has_gate ? "gate_up_proj_bias" : "up_proj_bias", &ExpertsProblem::gate_up_proj_bias, "has_bias is true"});
    t.push_back({"down_proj_bias", &ExpertsProblem::down_proj_bias, "has_bias is true"});
  }
  return t;
}

// Why a tensor the file holds is not one this configuration takes.
[[noreturn]] void reject_tensor(const SafetensorsFile& file, const std::string& name, const ExpertsConfig& c,
                                const std::vector<InputTensor>& expected) {
  const bool is_bias = name == "gate_up_proj_bias" || name == "up_proj_bias" || name == "down_proj_bias";
  MOEKIT_CHECK(!(is_bias && !c.has_bias), file.path(), ": the file holds bias tensor '", name,
               "' but metadata has_bias is not \"true\"; set has_bias or drop the tensor");
  MOEKIT_CHECK(!((name == "up_proj" || name == "up_proj_bias") && c.has_gate), file.path(), ": the file holds '", name,
               "' (experts without a gate) but metadata has_gate is not \"false\"");
  MOEKIT_CHECK(!((name == "gate_up_proj" || name == "gate_up_proj_bias") && !c.has_gate), file.path(),
               ": the file holds '", name, "' (gated experts) but metadata has_gate is \"false\"");
  std::string valid;
  for (const auto& e : expected) valid += (valid.empty() ? "" : ", ") + e.name;
  MOEKIT_FAIL(file.path(), ": unexpected tensor '", name, "'; with this metadata the file must hold exactly: ", valid);
}

ExpertsProblem load_problem(const SafetensorsFile& file) {
  ExpertsProblem problem;
  problem.config = config_from_metadata(file);
  const std::vector<InputTensor> expected = expected_tensors(problem.config);
  for (const std::string& name : file.names()) {
    const bool wanted = std::any_of(expected.begin(), expected.end(), [&](const auto& e) { return e.name == name; });
    if (!wanted) reject_tensor(file, name, problem.config, expected);
  }
  for (const InputTensor& e : expected) {
    MOEKIT_CHECK(file.contains(e.name), file.path(), ": missing tensor '", e.name, "' (needed: ", e.why, ")");
    problem.*e.field = file.tensor(e.name);
  }
  return problem;
}

struct ExpertsFlags {
  std::string input;
  std::string grad_output;
  std::string backend;
  std::string device = "cpu";
  std::string output;
};

// grad_out from its file: exactly one tensor, grad_out, shaped and typed as the layer's output.
Tensor load_grad_out(const std::string& path, const ExpertsProblem& problem, const ExpertsShape& shape) {
  const SafetensorsFile file(path);
  for (const std::string& name : file.names())
    MOEKIT_CHECK(name == "grad_out", file.path(), ": unexpected tensor '", name,
                 "'; a --grad-output file holds exactly one tensor, grad_out");
  MOEKIT_CHECK(file.contains("grad_out"), file.path(), ": missing tensor 'grad_out' (the gradient of out)");
  Tensor g = file.tensor("grad_out");
  const Shape want{shape.tokens, shape.hidden};
  MOEKIT_CHECK(g.shape() == want && g.dtype() == problem.hidden_states.dtype(), file.path(),
               ": grad_out must be ", dtype_name(problem.hidden_states.dtype()), shape_string(want),
               " (the dtype and shape of out), got ", g.describe());
  return g;
}

// The gradients under the names of the inputs they belong to (DESIGN §2b), on the CPU.
std::vector<std::pair<std::string, Tensor>> gradient_tensors(const ExpertsProblem& p, const ExpertsGradients& g) {
  const bool gate = p.config.has_gate;
  std::vector<std::pair<std::string, Tensor>> t = {{"grad_hidden_states", g.hidden_states},
                                                   {"grad_top_k_weights", g.top_k_weights},
                                                   {gate ? "grad_gate_up_proj" : "grad_up_proj", g.gate_up_proj},
                                                   {"grad_down_proj", g.down_proj}};
  if (p.config.has_bias) {
    t.emplace_back(gate ? "grad_gate_up_proj_bias" : "grad_up_proj_bias", g.gate_up_proj_bias);
    t.emplace_back("grad_down_proj_bias", g.down_proj_bias);
  }
  for (auto& [name, tensor] : t) tensor = tensor.to(Device::cpu());
  return t;
}

void run_experts(const ExpertsFlags& flags) {
  // Checked first so that a misspelt name is reported with the valid ones before any file is read.
  ExpertsInterface::global().get(flags.backend);
  const Device device = parse_device(flags.device);

  const SafetensorsFile file(flags.input);
  ExpertsProblem problem = load_problem(file);
  const ExpertsShape shape = validate(problem);
  check_routing_ids(problem);
  const bool backward = !flags.grad_output.empty();
  Tensor grad_out = backward ? load_grad_out(flags.grad_output, problem, shape) : Tensor();
  if (backward) {  // before any work, as for the forward
    const Support s = ExpertsInterface::global().get(flags.backend).supports_backward(problem);
    MOEKIT_CHECK(s.ok, "experts backend '", flags.backend, "' cannot run the backward of this problem: ", s.reason);
  }
  if (!device.is_cpu()) {
    if (backward) grad_out = grad_out.to(device);
    for (Tensor* t : {&problem.hidden_states, &problem.top_k_index, &problem.top_k_weights, &problem.gate_up_proj,
                      &problem.down_proj, &problem.gate_up_proj_bias, &problem.down_proj_bias})
      if (t->defined()) *t = t->to(device);
  }

  const auto start = std::chrono::steady_clock::now();
  const Tensor out = experts_forward(problem, flags.backend);
  ExpertsGradients grads;
  if (backward) grads = experts_backward(problem, grad_out, flags.backend);
  synchronize(device);  // on a GPU the call returns before its work is done
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  std::vector<std::pair<std::string, Tensor>> tensors = {{"out", out.to(Device::cpu())}};
  if (backward)
    for (auto& named : gradient_tensors(problem, grads)) tensors.push_back(std::move(named));
  save_safetensors(flags.output, tensors, {{"backend", flags.backend}});
  std::printf(
      "experts: backend=%s device=%s T=%lld H=%lld I=%lld E=%lld K=%lld dtype=%s %s time=%.3f ms (one cold call)\n",
      flags.backend.c_str(), device_name(device).c_str(), static_cast<long long>(shape.tokens),
      static_cast<long long>(shape.hidden), static_cast<long long>(shape.intermediate),
      static_cast<long long>(shape.experts), static_cast<long long>(shape.top_k),
      std::string(dtype_name(problem.hidden_states.dtype())).c_str(), backward ? "forward+backward" : "forward", ms);
}

}  // namespace

void add_experts_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "experts",
      "Run one experts call on the tensors of a safetensors file (hidden_states, top_k_index, top_k_weights, "
      "gate_up_proj or up_proj, down_proj, optional biases; configuration in __metadata__: activation, "
      "is_transposed, is_concatenated, has_gate, has_bias, swiglu_alpha, swiglu_limit) and write `out` [T, H]; "
      "with --grad-output also its backward");
  auto flags = std::make_shared<ExpertsFlags>();
  cmd->add_option("--input", flags->input, "Input safetensors file")->required();
  cmd->add_option("--grad-output", flags->grad_output,
                  "Safetensors file holding grad_out [T, H]: also run the backward and write grad_hidden_states, "
                  "grad_top_k_weights, grad_gate_up_proj (grad_up_proj), grad_down_proj and the bias gradients");
  cmd->add_option("--backend", flags->backend, "Experts backend (see `moekit backends`)")->required();
  cmd->add_option("--device", flags->device, "Device to run on: cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--output", flags->output, "Output safetensors file; gets out (and the gradients)")->required();
  cmd->callback([flags] { run_experts(*flags); });
}

}  // namespace moekit::cli

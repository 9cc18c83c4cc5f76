// CausalLM's decode steps as one CUDA graph (causal_lm_impl.h).
#include "moekit/model/causal_lm_impl.h"

namespace moekit {

namespace ops = model_ops;

std::string CausalLM::Impl::decode_graph_refusal() const {
  if (!device.is_cuda()) return "the model runs on the CPU";
  if (config.model_type == "deepseek_v3")
    return "deepseek_v3's latent attention expands every cached latent each step, so the step's sizes grow "
           "with the cache";
  return "";
}

std::vector<const void*> CausalLM::Impl::cache_buffers() const {
  std::vector<const void*> buffers;
  for (const LayerCache& lc : cache) {
    buffers.push_back(lc.first_device.data());
    buffers.push_back(lc.second_device.data());
  }
  return buffers;
}

DecodeRun CausalLM::Impl::start_decode(const GenerationConfig& g) {
  DecodeRun run;
  if (!g.decode_graph) {
    run.why_not = "GenerationConfig::decode_graph is false";
  } else if (const std::string refusal = decode_graph_refusal(); !refusal.empty()) {
    run.why_not = refusal;
  } else if (!uncapturable_reason.empty() && uncapturable_backends == experts_implementation.get()) {
    run.why_not = uncapturable_reason;
  } else {
    run.graphs = true;
  }
  return run;
}

Tensor CausalLM::Impl::decode(int32_t token, DecodeRun& run) {
  const std::span<const int32_t> tokens(&token, 1);
  if (!run.graphs) return step(tokens, 1);
  if (decode_graph && decode_graph->backends == experts_implementation.get() && decode_graph->caches == cache_buffers())
    return replay(tokens, run);
  if (run.memory_bytes == 0) {
    const DeviceAllocationCounter counter(device);
    Tensor logits = step(tokens, 1);
    run.memory_bytes = counter.bytes();
    return logits;
  }
  const Tensor inputs = write_step_inputs(tokens);
  auto captured = std::make_unique<DecodeGraph>();
  try {
    // The legacy default stream, where steps are otherwise launched, cannot be captured.
    const ops::StreamScope on_model_stream(stream->stream());
    captured->graph = std::make_unique<CapturedGraph>(
        *stream, [&] { captured->logits = run_step(tokens, inputs, 1); }, run.memory_bytes);
  } catch (const Error& e) {
    // Nothing ran and nothing moved (the capture only recorded): launch this step and the next ones.
    run.graphs = false;
    uncapturable_backends = experts_implementation.get();
    uncapturable_reason = "the decode step with experts " + experts_implementation_text(uncapturable_backends) +
                          " could not be captured: " + e.what();
    run.why_not = uncapturable_reason;
    return step(tokens, 1);
  }
  captured->backends = experts_implementation.get();
  captured->caches = cache_buffers();
  captured->step_backends = last_step_backends;
  decode_graph = std::move(captured);
  return replay(tokens, run);
}

Tensor CausalLM::Impl::replay(std::span<const int32_t> tokens, DecodeRun& run) {
  write_step_inputs(tokens);  // into decode_state, which the graph reads
  decode_graph->graph->replay();
  cached_positions += 1;
  last_step_backends = decode_graph->step_backends;
  run.replayed = true;
  return decode_graph->logits;
}

}  // namespace moekit

// CausalLM's implementation (model.h), shared by the units that define it: causal_lm.cpp (loading, the forward
// step, sampling, the public API), causal_lm_weights.cpp (the weights of each layer, and their move to the GPU),
// causal_lm_attention.cpp (the KV cache, grouped-query and multi-head latent attention) and
// causal_lm_decode_graph.cpp (decode steps captured into a CUDA graph and replayed).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>

#include "moekit/checked_math.h"
#include "moekit/device.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/model/checkpoint.h"
#include "moekit/model/experts_implementation.h"
#include "moekit/model/model_config.h"
#include "moekit/model/model_ops.h"
#include "moekit/model/moe_block.h"
#include "moekit/model/rotary.h"
#include "moekit/model/sampling.h"
#include "moekit/model/weight_reader.h"

namespace moekit {

struct AttentionWeights {
  // Grouped-query attention; sinks [Hq] (GPT-OSS) with float copies for the CPU and the GPU.
  Tensor q_proj, q_bias, k_proj, k_bias, v_proj, v_bias, o_proj, o_bias, q_norm, k_norm, sinks;
  std::vector<float> sinks_host;
  Tensor sinks_device;
  int64_t sliding_window = 0;  // this layer's window (0: full attention)
  // DeepSeek-V3 multi-head latent attention (q_proj above when q_lora_rank is 0).
  Tensor q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj;
};

struct LayerWeights {
  Tensor input_norm, post_attention_norm;
  AttentionWeights attention;
  bool moe = false;
  MoeBlockWeights moe_block;
  Tensor mlp_gate, mlp_up, mlp_down;  // the dense MLP of a dense layer
};

// One layer's cache: per position, `first` then `second` values (keys and values of grouped-query
// attention; MLA's latent and rotated key). On the CPU in float (holding values already rounded to the
// dtype), growing; on a GPU as [capacity, row] tensors of the dtype, allocated at their full length up
// front (reset_cache) so that a captured decode step finds them at the same addresses on every replay.
struct LayerCache {
  std::vector<float> first, second;
  Tensor first_device, second_device;

  // a, b [T, row] at positions [row, row + T); on a GPU the kernels read row from row_device.
  void append(const Tensor& a, const Tensor& b, int64_t row, const int32_t* row_device) {
    if (a.device().is_cuda()) {
      model_ops::write_rows(first_device, row, a, row_device);
      model_ops::write_rows(second_device, row, b, row_device);
      return;
    }
    for (auto [t, dst] : {std::pair{&a, &first}, std::pair{&b, &second}}) {
      const std::vector<float> values = model_ops::to_float_vector(*t);
      dst->insert(dst->end(), values.begin(), values.end());
    }
  }
};

// A decode step captured into a CUDA graph, kept by the model so that later generate calls replay it too
// while what it was captured with is unchanged.
struct DecodeGraph {
  std::map<std::string, std::string> backends;  // the experts backends of the captured step
  std::vector<const void*> caches;              // the cache buffers its kernels write and read
  std::unique_ptr<CapturedGraph> graph;
  Tensor logits;                           // float32 [1, V] on the GPU, rewritten by each replay
  std::vector<std::string> step_backends;  // last_step_backends of the captured step
};

// One generate call's decode phase on a GPU, as far as CUDA graphs go.
struct DecodeRun {
  bool graphs = false;           // still capturing or replaying; false: every step launches its kernels
  std::size_t memory_bytes = 0;  // what the first (uncaptured) decode step allocated: the graph's memory
  bool replayed = false;
  std::string why_not;  // why the steps were not replayed (GenerationResult::decode_graph_reason)
};

// Keys and values of one position of one layer's grouped-query attention cache.
inline int64_t kv_heads_width(const ModelConfig& c) {
  return checked_mul(c.num_key_value_heads, c.head_dim, "num_key_value_heads x head_dim");
}

struct CausalLM::Impl {
  Checkpoint checkpoint;
  ModelConfig config;
  DType dtype = DType::bf16;
  Device device = Device::cpu();
  ExpertsImplementation experts_implementation;
  Tensor embed_tokens, final_norm, lm_head;
  std::vector<LayerWeights> layers;
  model_ops::RotaryTables rotary;
  float scale = 1.0f;
  std::vector<LayerCache> cache;
  int64_t cached_positions = 0;
  int64_t cache_capacity = 0;  // GPU: positions the cache buffers hold
  std::vector<std::string> last_step_backends;
  bool dequantize_experts = false;  // quantised experts turned into dtype at load
  // Tensors not loaded on purpose, per prefix (a vision-language checkpoint's vision tower).
  std::map<std::string, int64_t> ignored_weights;
  // GPU: the stream the decode step is captured and replayed on (ordered with the legacy default stream,
  // where tensors are allocated and freed and steps are otherwise launched, so no synchronisation is
  // needed between the two), the inputs of one-token steps in device memory, the captured decode step,
  // and the last decode backends whose step could not be captured, with the reason.
  std::unique_ptr<DeviceStream> stream;
  Tensor decode_state;              // int32 [2]: the step's first position, then its token
  std::vector<int32_t> state_host;  // the host side of the last copy into a step's inputs (kept until it ran)
  std::unique_ptr<DecodeGraph> decode_graph;
  std::map<std::string, std::string> uncapturable_backends;
  std::string uncapturable_reason;

  Impl(const std::string& dir, const LoadOptions& options);

  void load_weights();

  UnloadedWeights unloaded_weights() const;

  // "ignored 38 tensors under model.visual. (not loaded: text-only model)", or "" when none were.
  std::string ignored_weights_text() const;

  void load_attention(WeightReader& r, const std::string& p, AttentionWeights& a) const;

  void load_moe(WeightReader& r, const std::string& p, MoeBlockWeights& m) const;

  // Every weight to the model's GPU (loaded and fused on the host first, then copied once).
  void move_weights_to_device();

  // The values a cache holds per position of a layer: keys and values, or MLA's latent and rotated key.
  std::pair<int64_t, int64_t> cache_rows() const;

  // Bytes of the cache at `positions`: on a GPU in the dtype, on the CPU in float.
  std::size_t cache_bytes(int64_t positions) const;

  // Empties the cache. On a GPU its buffers hold `capacity` positions from then on (kept when they
  // already hold as many, so that a captured decode step stays valid across generate calls).
  void reset_cache(int64_t capacity);

  // T new queries at the cache's next positions, with the model's attention scale.
  model_ops::AttentionShape attention_shape(int64_t T, int64_t query_heads, int64_t key_heads, int64_t key_dim,
                                            int64_t value_dim) const;

  // Grouped-query attention of x [T, H]; appends the new keys and values to the layer's cache. position:
  // GPU, the step's first position in device memory.
  Tensor gqa(const AttentionWeights& a, const Tensor& x, LayerCache& lc, const int32_t* position) const;

  // DeepSeek-V3's multi-head latent attention of x [T, H]. Its GPU path sizes tensors by the cache length
  // (every cached latent is expanded each step), so it is never captured: see decode_graph_refusal.
  Tensor mla(const AttentionWeights& a, const Tensor& x, LayerCache& lc, const int32_t* position) const;

  // Runs tokens at the next positions of the cache; returns the float32 logits of the last `logit_rows`
  // tokens [rows, V], on the model's device.
  Tensor step(std::span<const int32_t> tokens, int64_t logit_rows);

  // Checks the tokens and the room left in the cache. On a GPU, returns the step's inputs as its kernels
  // read them: int32 [1 + T] in device memory, the step's first position (the positions cached) then the
  // ids, written by one copy on the model's stream; one-token steps always use decode_state, the inputs
  // of a captured decode step.
  Tensor write_step_inputs(std::span<const int32_t> tokens);

  // The forward step itself, from the embedding to the logits, without moving cached_positions. On a GPU
  // it reads the tokens and the first position from `inputs` (write_step_inputs), so that the same
  // launches, captured once, serve every decode step; only tokens.size() is used there.
  Tensor run_step(std::span<const int32_t> tokens, const Tensor& inputs, int64_t logit_rows);

  // Blocks until the model's queued work is done.
  void synchronize() const { moekit::synchronize(device); }

  // The next token from float32 logits [1, V] on the model's device, with one synchronisation: on a GPU
  // a greedy pick runs there and only the index comes back; sampling reads the row. kept: where to append
  // the row (GenerationConfig::output_logits), or null.
  int32_t pick(const Tensor& logits, const GenerationConfig& g, std::mt19937_64& rng, std::vector<float>* kept);

  // ---- Decode steps as one CUDA graph ----
  // A decode step launches dozens of small kernels; on a GPU they are captured once into a CUDA graph and
  // the graph is replayed for every later token, so that decode is no longer bound by launching them.
  // The graph stays valid from step to step because nothing it launches depends on the step: the token
  // and the first position come from decode_state (written by one copy before each replay), the kernels
  // read the position from there (rotary angles, the row the keys and values go to, how many keys
  // attention loops over), the cache buffers are allocated at full length up front, and the tensors the
  // step makes come from memory that the graph owns (CapturedGraph's memory), sized by the first decode
  // step, which runs uncaptured under a DeviceAllocationCounter. The second step is captured (on the
  // model's stream: the legacy default stream, where steps are otherwise launched, cannot be); the replays
  // run the same kernels with the same arguments as launching them would, so outputs are bitwise the
  // same. Whether a step can be captured is found out by trying: a backend that synchronises (eager reads
  // its counts back) makes the capture fail, and generation goes on launching kernels (also on later
  // calls with the same backends), with the reason in GenerationResult::decode_graph_reason.

  // Why the decode steps of this model cannot be captured whatever the backend, or "".
  std::string decode_graph_refusal() const;

  std::vector<const void*> cache_buffers() const;

  DecodeRun start_decode(const GenerationConfig& g);

  // One decode step for `token`: replayed, captured, measured or launched (see above).
  Tensor decode(int32_t token, DecodeRun& run);

  Tensor replay(std::span<const int32_t> tokens, DecodeRun& run);
};

}  // namespace moekit

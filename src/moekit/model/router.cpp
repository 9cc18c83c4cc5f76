#include "moekit/model/router.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "moekit/error.h"

namespace moekit {
namespace {

// One selectable value: an expert (or a group) and its selection score.
struct Candidate {
  float score;
  int64_t index;
};

// The order of torch.topk(largest=True) made total: a larger score first, NaN above every number (torch
// compares with `isnan(a) && !isnan(b) || a > b`), and equal scores (NaN with NaN) by the lower index.
bool ranks_before(const Candidate& a, const Candidate& b) {
  const bool a_nan = std::isnan(a.score), b_nan = std::isnan(b.score);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.score != b.score) return a.score > b.score;
  return a.index < b.index;
}

// Moves the k best candidates to the front, best first.
void select_top(std::span<Candidate> candidates, int64_t k) {
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(), ranks_before);
}

// In place over a row: x = exp(x - max) / sum. The max propagates NaN (so a NaN row stays NaN, as in
// torch's softmax); an all -inf or a +inf row gives NaN through inf - inf, also as torch does.
void softmax(std::span<float> x) {
  float max = -std::numeric_limits<float>::infinity();
  for (float v : x)
    if (std::isnan(v) || v > max) {
      max = v;
      if (std::isnan(v)) break;
    }
  float sum = 0.0f;
  for (float& v : x) {
    v = std::exp(v - max);
    sum += v;
  }
  for (float& v : x) v /= sum;
}

float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

void divide_by_sum(std::span<float> w, float epsilon) {
  float sum = 0.0f;
  for (float v : w) sum += v;
  sum += epsilon;
  for (float& v : w) v /= sum;
}

// The sum of the two best candidates of a group (a linear scan, no sort), as transformers'
// `.topk(2, dim=-1)[0].sum(dim=-1)`.
float top2_sum(std::span<const Candidate> group) {
  Candidate first = group[0], second = group[1];
  if (ranks_before(second, first)) std::swap(first, second);
  for (const Candidate& c : group.subspan(2)) {
    if (ranks_before(c, first)) {
      second = first;
      first = c;
    } else if (ranks_before(c, second)) {
      second = c;
    }
  }
  return first.score + second.score;
}

// Per-thread scratch, allocated before the parallel region so that no allocation happens inside it.
struct Scratch {
  explicit Scratch(int64_t experts, int64_t groups) {
    values.reserve(static_cast<std::size_t>(experts));
    choice.reserve(static_cast<std::size_t>(experts));
    candidates.reserve(static_cast<std::size_t>(experts));
    group_scores.reserve(static_cast<std::size_t>(groups));
  }
  std::vector<float> values;          // [E]: softmax probabilities or sigmoid scores
  std::vector<Candidate> choice;      // [E]: deepseek_v3's s + bias, by expert id
  std::vector<Candidate> candidates;  // the experts that may be chosen, then the top K first
  std::vector<Candidate> group_scores;
};

// Writes the K best candidates' ids to ids and their scores to weights, best first.
void take_top(std::vector<Candidate>& candidates, int64_t K, int64_t* ids, float* weights) {
  select_top(candidates, K);
  for (int64_t k = 0; k < K; ++k) {
    ids[k] = candidates[static_cast<std::size_t>(k)].index;
    weights[k] = candidates[static_cast<std::size_t>(k)].score;
  }
}

// One token: row [E] (float32) -> ids [K], weights [K]. bias holds E values for deepseek_v3 (checked by
// validate) and is empty otherwise.
void route_token(const float* row, std::span<const float> bias, const RouterConfig& config, Scratch& scratch,
                 int64_t* ids, float* weights) {
  const int64_t E = config.num_experts, K = config.top_k;
  const auto k_weights = std::span<float>(weights, static_cast<std::size_t>(K));
  std::vector<float>& values = scratch.values;
  std::vector<Candidate>& candidates = scratch.candidates;
  candidates.clear();

  switch (config.kind) {
    case RouterKind::softmax_topk: {
      values.assign(row, row + E);
      softmax(values);
      for (int64_t e = 0; e < E; ++e) candidates.push_back({values[static_cast<std::size_t>(e)], e});
      take_top(candidates, K, ids, weights);
      if (config.norm_topk_prob) divide_by_sum(k_weights, 0.0f);
      return;
    }
    case RouterKind::topk_softmax: {
      for (int64_t e = 0; e < E; ++e) candidates.push_back({row[e], e});
      take_top(candidates, K, ids, weights);
      softmax(k_weights);
      return;
    }
    case RouterKind::deepseek_v3: {
      // values: the sigmoid scores s, which become the weights; choice: c = s + bias, which selects.
      std::vector<Candidate>& choice = scratch.choice;
      values.resize(static_cast<std::size_t>(E));
      choice.clear();
      for (int64_t e = 0; e < E; ++e) {
        const float s = sigmoid(row[e]);
        values[static_cast<std::size_t>(e)] = s;
        choice.push_back({s + bias[static_cast<std::size_t>(e)], e});
      }
      if (config.n_group == 1) {
        candidates.assign(choice.begin(), choice.end());
      } else {
        // Only the experts of the topk_group best groups (by the sum of their two best c) compete.
        const auto G = static_cast<std::size_t>(E / config.n_group);
        const std::span<const Candidate> all(choice);
        std::vector<Candidate>& group_scores = scratch.group_scores;
        group_scores.clear();
        for (int64_t g = 0; g < config.n_group; ++g)
          group_scores.push_back({top2_sum(all.subspan(static_cast<std::size_t>(g) * G, G)), g});
        select_top(group_scores, config.topk_group);
        for (int64_t j = 0; j < config.topk_group; ++j) {
          const auto kept =
              all.subspan(static_cast<std::size_t>(group_scores[static_cast<std::size_t>(j)].index) * G, G);
          candidates.insert(candidates.end(), kept.begin(), kept.end());
        }
      }
      take_top(candidates, K, ids, weights);
      for (int64_t k = 0; k < K; ++k) weights[k] = values[static_cast<std::size_t>(ids[k])];
      if (config.norm_topk_prob) divide_by_sum(k_weights, 1e-20f);
      for (float& w : k_weights) w *= config.routed_scaling_factor;
      return;
    }
  }
}

void check_inputs(const Tensor& logits, const RouterConfig& config, const Tensor& correction_bias) {
  const std::string_view kind = router_kind_name(config.kind);
  MOEKIT_CHECK(logits.defined(), "route: logits is undefined");
  MOEKIT_CHECK(logits.dim() == 2, "route: logits must be [T, E], got ", logits.describe());
  MOEKIT_CHECK(logits.dtype() == DType::f32 || logits.dtype() == DType::f16 || logits.dtype() == DType::bf16,
               "route: logits must be f32, f16 or bf16, got ", logits.describe());
  MOEKIT_CHECK(logits.device().is_cpu(), "route: logits must be on the cpu, got ", logits.describe());
  MOEKIT_CHECK(logits.is_contiguous(), "route: logits must be contiguous, got ", logits.describe());
  const int64_t E = logits.size(1);
  MOEKIT_CHECK(E == config.num_experts, "route: logits ", logits.describe(), " has E = ", E,
               " experts, but config.num_experts = ", config.num_experts);
  MOEKIT_CHECK(config.top_k >= 1 && config.top_k <= E, "route: config.top_k = ", config.top_k,
               " must lie in [1, E = ", E, "]");

  if (config.kind != RouterKind::deepseek_v3) {
    MOEKIT_CHECK(!correction_bias.defined(), "route: correction_bias is for deepseek_v3 only, but was given (",
                 correction_bias.describe(), ") to a ", kind, " router");
    return;
  }
  MOEKIT_CHECK(config.n_group >= 1 && E % config.n_group == 0, "route: config.n_group = ", config.n_group,
               " must be >= 1 and divide E = ", E);
  const int64_t G = E / config.n_group;
  MOEKIT_CHECK(config.n_group == 1 || G >= 2, "route: groups of E / n_group = ", E, " / ", config.n_group, " = ", G,
               " expert; a group's score sums its top-2 experts, so groups need at least 2");
  MOEKIT_CHECK(config.topk_group >= 1 && config.topk_group <= config.n_group,
               "route: config.topk_group = ", config.topk_group, " must lie in [1, n_group = ", config.n_group, "]");
  MOEKIT_CHECK(config.top_k <= config.topk_group * G, "route: config.top_k = ", config.top_k, " is larger than the ",
               config.topk_group * G, " experts that topk_group = ", config.topk_group, " groups of ", G, " keep");
  MOEKIT_CHECK(correction_bias.defined(), "route: deepseek_v3 needs correction_bias [", E,
               "] f32 (e_score_correction_bias), got none");
  MOEKIT_CHECK(correction_bias.dim() == 1 && correction_bias.size(0) == E && correction_bias.dtype() == DType::f32 &&
                   correction_bias.device().is_cpu() && correction_bias.is_contiguous(),
               "route: correction_bias must be f32[", E, "] on cpu, contiguous, got ", correction_bias.describe());
}

}  // namespace

std::string_view router_kind_name(RouterKind kind) {
  switch (kind) {
    case RouterKind::softmax_topk:
      return "softmax_topk";
    case RouterKind::topk_softmax:
      return "topk_softmax";
    case RouterKind::deepseek_v3:
      return "deepseek_v3";
  }
  return "unknown";
}

std::string RouterConfig::describe() const {
  std::string s = detail::concat(router_kind_name(kind), " E=", num_experts, " K=", top_k,
                                 " norm_topk_prob=", norm_topk_prob ? "true" : "false");
  if (kind == RouterKind::deepseek_v3)
    s += detail::concat(" n_group=", n_group, " topk_group=", topk_group,
                        " routed_scaling_factor=", routed_scaling_factor);
  return s;
}

RouterOutput route(const Tensor& logits, const RouterConfig& config, const Tensor& correction_bias) {
  check_inputs(logits, config, correction_bias);
  const int64_t T = logits.size(0), E = config.num_experts, K = config.top_k;
  // 16-bit logits are widened once (exactly); all routing math is float32.
  const Tensor logits_f32 = logits.dtype() == DType::f32 ? logits : logits.to(DType::f32);
  const float* rows = logits_f32.data_as<float>();
  const std::span<const float> bias =
      correction_bias.defined() ? std::span<const float>(correction_bias.data_as<float>(), static_cast<std::size_t>(E))
                                : std::span<const float>();

  RouterOutput out{Tensor::empty({T, K}, DType::i64), Tensor::empty({T, K}, DType::f32)};
  int64_t* ids = out.top_k_index.data_as<int64_t>();
  float* weights = out.top_k_weights.data_as<float>();
  // No more threads than tokens (decode routes one token: one thread, one scratch).
  const int threads = static_cast<int>(std::clamp<int64_t>(T, 1, omp_get_max_threads()));
  std::vector<Scratch> scratch;  // built in place: copies would drop the reserved capacity
  for (int i = 0; i < threads; ++i) scratch.emplace_back(E, config.n_group);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; ++t)
    route_token(rows + t * E, bias, config, scratch[static_cast<std::size_t>(omp_get_thread_num())], ids + t * K,
                weights + t * K);
  return out;
}

}  // namespace moekit

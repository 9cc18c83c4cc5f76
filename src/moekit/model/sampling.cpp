#include "moekit/model/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "moekit/error.h"

namespace moekit {

void validate_generation_config(const GenerationConfig& c) {
  MOEKIT_CHECK(c.max_new_tokens >= 0, "generation: max_new_tokens must be >= 0, got ", c.max_new_tokens);
  MOEKIT_CHECK(c.top_k >= 0, "generation: top_k must be >= 0 (0 = off), got ", c.top_k);
  MOEKIT_CHECK(c.top_p > 0.0f && c.top_p <= 1.0f, "generation: top_p must be in (0, 1], got ", c.top_p);
  MOEKIT_CHECK(!c.do_sample || (c.temperature > 0.0f && std::isfinite(c.temperature)),
               "generation: temperature must be a positive number when sampling, got ", c.temperature);
}

int32_t pick_token(std::span<const float> logits, const GenerationConfig& c, std::mt19937_64& rng) {
  MOEKIT_CHECK(!logits.empty(), "pick_token: no logits");
  const std::size_t V = logits.size();
  if (!c.do_sample) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < V; ++i)
      if (std::isnan(logits[best]) || logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  }
  constexpr float kRemoved = -std::numeric_limits<float>::infinity();
  std::vector<float> scores(V);
  for (std::size_t i = 0; i < V; ++i) scores[i] = std::isnan(logits[i]) ? kRemoved : logits[i] / c.temperature;
  if (c.top_k > 0 && static_cast<std::size_t>(c.top_k) < V) {
    std::vector<float> sorted = scores;
    std::nth_element(sorted.begin(), sorted.begin() + (c.top_k - 1), sorted.end(), std::greater<float>());
    const float kth = sorted[static_cast<std::size_t>(c.top_k - 1)];
    for (float& s : scores)
      if (s < kth) s = kRemoved;
  }
  const float max_score = *std::max_element(scores.begin(), scores.end());
  MOEKIT_CHECK(max_score > kRemoved, "pick_token: every logit is NaN or -inf");
  std::vector<double> p(V);
  double total = 0;
  for (std::size_t i = 0; i < V; ++i) total += p[i] = std::exp(static_cast<double>(scores[i] - max_score));
  for (double& v : p) v /= total;
  if (c.top_p < 1.0f) {
    // The most likely tokens, in descending order, until their probability reaches top_p.
    std::vector<std::size_t> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return p[a] > p[b]; });
    double kept = 0;
    std::size_t n = 0;
    while (n < V && (n == 0 || kept < static_cast<double>(c.top_p))) kept += p[order[n++]];
    for (std::size_t i = n; i < V; ++i) p[order[i]] = 0;
    for (double& v : p) v /= kept;
  }
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  double u = uniform(rng), cumulative = 0;
  std::size_t last_nonzero = 0;
  for (std::size_t i = 0; i < V; ++i) {
    if (p[i] <= 0) continue;
    last_nonzero = i;
    cumulative += p[i];
    if (u < cumulative) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last_nonzero);  // rounding left u just above the total
}

}  // namespace moekit

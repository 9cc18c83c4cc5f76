#include "moekit/model/rotary.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "moekit/error.h"

namespace moekit {
namespace {

// YaRN's attention-temperature term: 0.1 * mscale * ln(factor) + 1 for factor > 1.
double yarn_mscale(double factor, double mscale) {
  return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

}  // namespace

model_ops::RotaryTables rotary_tables(const ModelConfig& c) {
  const int64_t dim = c.model_type == "deepseek_v3" ? c.qk_rope_head_dim : c.head_dim;
  MOEKIT_CHECK(dim % 2 == 0, "rotary embedding: dimension ", dim, " is odd");
  const auto& s = c.rope_scaling;
  model_ops::RotaryTables out;
  out.interleaved = c.rope_interleave;
  out.inv_freq.resize(static_cast<std::size_t>(dim / 2));
  // float32 throughout, as torch computes base ** (arange(0, dim, 2).float() / dim).
  const float base = static_cast<float>(c.rope_theta);
  std::vector<float> pos_freq(out.inv_freq.size());
  for (std::size_t i = 0; i < pos_freq.size(); ++i)
    pos_freq[i] = std::pow(base, static_cast<float>(2 * i) / static_cast<float>(dim));
  if (s.type != "yarn") {
    const float factor = s.type == "linear" ? static_cast<float>(s.factor) : 1.0f;
    for (std::size_t i = 0; i < pos_freq.size(); ++i) out.inv_freq[i] = 1.0f / pos_freq[i] / factor;
    return out;
  }
  // YaRN: frequencies above the correction range keep their value (extrapolation), those below it are
  // divided by factor (interpolation), with a linear ramp in between.
  const double factor = s.factor;
  if (s.attention_factor > 0) {
    out.attention_factor = static_cast<float>(s.attention_factor);
  } else if (s.mscale != 0 && s.mscale_all_dim != 0) {
    out.attention_factor = static_cast<float>(yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim));
  } else {
    out.attention_factor = static_cast<float>(yarn_mscale(factor, 1.0));
  }
  const double original = static_cast<double>(s.original_max_position_embeddings);
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(c.rope_theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // as transformers, against a zero-width ramp
  for (std::size_t i = 0; i < pos_freq.size(); ++i) {
    const float ramp = std::clamp(static_cast<float>((static_cast<double>(i) - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolation = 1.0f - ramp;
    const float inv_extrapolated = 1.0f / pos_freq[i];
    const float inv_interpolated = 1.0f / (static_cast<float>(factor) * pos_freq[i]);
    out.inv_freq[i] = inv_interpolated * (1 - extrapolation) + inv_extrapolated * extrapolation;
  }
  return out;
}

float attention_scale(const ModelConfig& c) {
  if (c.model_type != "deepseek_v3") return 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  double scale = std::pow(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim), -0.5);
  const auto& s = c.rope_scaling;
  if (s.type != "default" && s.mscale_all_dim != 0) {
    const double m = yarn_mscale(s.factor, s.mscale_all_dim);
    scale *= m * m;
  }
  return static_cast<float>(scale);
}

}  // namespace moekit

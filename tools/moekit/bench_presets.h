// Expert-layer sizes of well-known MoE checkpoints (from their config.json), for `moekit bench --shape`.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace moekit::cli {

struct ShapePreset {
  std::string_view name;
  int64_t hidden;        // hidden_size
  int64_t intermediate;  // moe_intermediate_size (Mixtral: intermediate_size)
  int64_t experts;       // routed experts only; shared experts are a dense MLP, not an experts call
  int64_t top_k;         // num_experts_per_tok
};

inline constexpr std::array<ShapePreset, 4> kShapePresets{{
    {"qwen1.5-moe-a2.7b", 2048, 1408, 60, 4},
    {"qwen3-30b-a3b", 2048, 768, 128, 8},
    {"mixtral-8x7b", 4096, 14336, 8, 2},
    {"deepseek-v3", 7168, 2048, 256, 8},
}};

}  // namespace moekit::cli

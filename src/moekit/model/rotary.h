// The rotary position embedding of a model config: transformers' default, linear and YaRN frequency
// tables (modeling_rope_utils), and the attention scale that DeepSeek-V3 derives from YaRN's mscale.
#pragma once

#include "moekit/model/model_config.h"
#include "moekit/model/model_ops.h"

namespace moekit {

// inv_freq over the rotary dimension (head_dim; DeepSeek-V3: qk_rope_head_dim) and the cos/sin factor.
model_ops::RotaryTables rotary_tables(const ModelConfig& config);

// The factor that multiplies q . k: head_dim^-0.5 (DeepSeek-V3: (qk_nope + qk_rope)^-0.5, times
// mscale(factor, mscale_all_dim)^2 under YaRN scaling).
float attention_scale(const ModelConfig& config);

}  // namespace moekit

#!/usr/bin/env python3
"""Makes tests/fixtures/routers/: router logits and the experts and weights transformers' own routers
(Qwen3MoeTopKRouter, GptOssTopKRouter, DeepseekV3TopkRouter) pick for them, on the CPU in float32.
Run with scripts/reference_python.sh (see scripts/setup_reference_env.sh). transformers is the
yardstick only, never a dependency of moekit.
"""
import os

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "routers")
T, H = 64, 32


def save(name, logits, weights, indices, metadata, extra=None):
    os.makedirs(OUT, exist_ok=True)
    tensors = {"logits": logits.float().contiguous(), "weights": weights.float().contiguous(),
               "indices": indices.to(torch.int64).contiguous()}
    tensors.update(extra or {})
    metadata = {k: str(v) for k, v in metadata.items()}
    metadata["transformers"] = __import__("transformers").__version__
    save_file(tensors, os.path.join(OUT, name + ".safetensors"), metadata=metadata)
    print(name, tuple(logits.shape), tuple(indices.shape))


def qwen3(name, norm, seed):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    g = torch.Generator().manual_seed(seed)
    config = Qwen3MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, H, generator=g))
        logits, weights, indices = router(torch.randn(T, H, generator=g))
    save(name, logits, weights, indices, {"kind": "softmax_topk", "top_k": 4, "norm_topk_prob": str(norm).lower()})


def gpt_oss(name, seed):
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    g = torch.Generator().manual_seed(seed)
    config = GptOssConfig(hidden_size=H, num_local_experts=16, num_experts_per_tok=4)
    router = GptOssTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, H, generator=g))
        router.bias.copy_(torch.randn(16, generator=g))
        logits, weights, indices = router(torch.randn(T, H, generator=g))
    save(name, logits, weights, indices, {"kind": "topk_softmax", "top_k": 4, "norm_topk_prob": "false"})


def deepseek_v3(name, seed):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    g = torch.Generator().manual_seed(seed)
    E, K, groups, kept = 32, 6, 8, 3
    config = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=groups,
                              topk_group=kept, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    bias = torch.randn(E, generator=g) * 0.3  # negative values included: masked experts must never win
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g))
        router.e_score_correction_bias.copy_(bias)
        logits, weights, indices = router(torch.randn(T, H, generator=g))
    save(name, logits, weights, indices,
         {"kind": "deepseek_v3", "top_k": K, "norm_topk_prob": "true", "n_group": groups, "topk_group": kept,
          "routed_scaling_factor": 2.5}, {"correction_bias": bias.float()})


if __name__ == "__main__":
    qwen3("qwen3_moe_norm", True, 1)
    qwen3("qwen3_moe_plain", False, 2)
    gpt_oss("gpt_oss", 3)
    deepseek_v3("deepseek_v3", 4)

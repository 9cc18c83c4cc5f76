#!/usr/bin/env python3
"""Makes tests/fixtures/experts/: experts-layer inputs in `moekit experts`'s format and the output
transformers' own experts modules compute for them (the eager implementation, on the CPU).

transformers is the yardstick only, never a dependency of moekit. Run with torch and transformers
importable, e.g. after scripts/setup_reference_env.sh:
    scripts/reference_python.sh scripts/make_experts_fixtures.py
"""
import os
import sys

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "experts")


def routing(tokens, experts, top_k, generator):
    # K distinct experts per token; softmax-normalised positive weights (f32), as a router gives.
    scores = torch.rand(tokens, experts, generator=generator)
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.rand(tokens, top_k, generator=generator), dim=-1)
    return index.to(torch.int64), weights.to(torch.float32)


def save(name, tensors, metadata, expected):
    os.makedirs(OUT, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(OUT, name + ".input.safetensors"),
              metadata=metadata)
    save_file({"out": expected.contiguous()}, os.path.join(OUT, name + ".expected.safetensors"),
              metadata={"transformers": __import__("transformers").__version__, "torch": torch.__version__})
    print(name, {k: tuple(v.shape) for k, v in tensors.items()}, "->", tuple(expected.shape))


def run_and_save(name, experts, dtype, shape, generator, weight_names, metadata):
    """Runs transformers' experts module on fresh inputs and routing, and saves inputs, weights and output."""
    H, E, K, T = shape
    experts = experts.to(dtype)
    x = torch.randn(T, H, generator=generator).to(dtype)
    index, weights = routing(T, E, K, generator)
    with torch.no_grad():
        out = experts(x, index, weights.to(dtype))
    tensors = {"hidden_states": x, "top_k_index": index, "top_k_weights": weights.to(dtype)}
    tensors.update({n: getattr(experts, n).data for n in weight_names})
    save(name, tensors, metadata, out)


def qwen3_experts(name, dtype, seed):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    H, I, E, K, T = 64, 48, 8, 2, 16
    g = torch.Generator().manual_seed(seed)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                            hidden_act="silu")
    config._experts_implementation = "eager"
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5)
        experts.down_proj.copy_(torch.randn(E, H, I, generator=g) / I ** 0.5)
    run_and_save(name, experts, dtype, (H, E, K, T), g, ["gate_up_proj", "down_proj"], {"activation": "silu"})


def gpt_oss_experts(name, dtype, seed):
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    H, I, E, K, T = 64, 32, 8, 4, 16
    g = torch.Generator().manual_seed(seed)
    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config)
    with torch.no_grad():
        # Scaled so that gate and up values go past the clamp limit (7) for some columns.
        experts.gate_up_proj.copy_(torch.randn(E, H, 2 * I, generator=g) * 1.5)
        experts.gate_up_proj_bias.copy_(torch.randn(E, 2 * I, generator=g))
        experts.down_proj.copy_(torch.randn(E, I, H, generator=g) / I ** 0.5)
        experts.down_proj_bias.copy_(torch.randn(E, H, generator=g))
    run_and_save(name, experts, dtype, (H, E, K, T), g,
                 ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"],
                 {"activation": "silu", "is_transposed": "true", "is_concatenated": "false", "has_bias": "true",
                  "swiglu_limit": "7.0", "swiglu_alpha": "1.702"})


if __name__ == "__main__":
    torch.manual_seed(0)
    qwen3_experts("qwen3_moe_f32", torch.float32, 1)
    qwen3_experts("qwen3_moe_bf16", torch.bfloat16, 2)
    gpt_oss_experts("gpt_oss_f32", torch.float32, 3)
    gpt_oss_experts("gpt_oss_bf16", torch.bfloat16, 4)
    sys.exit(0)

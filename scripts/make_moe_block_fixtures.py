#!/usr/bin/env python3
"""Makes tests/fixtures/moe_block/: tiny random MoE blocks built with transformers' own classes
(Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock with its sigmoid-gated shared expert, DeepseekV3MoE with
grouped routing, a correction bias and one shared expert), on the CPU in float32 with the eager experts.
Each file holds the block's weights under the names of moekit::MoeBlockWeights' fields (the experts as
experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]), the input "hidden" [T, H] and
transformers' output "output" [T, H]; the router config is in the metadata.
Run with scripts/reference_python.sh (see scripts/setup_reference_env.sh). transformers is the
yardstick only, never a dependency of moekit.
"""
import os

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "moe_block")
T, H, E, I = 16, 32, 8, 16


def randomise(module, g):
    # Direct construction leaves some parameters uninitialised: every one gets fixed random values.
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            scale = 1.0 if name.startswith("gate.") or name == "shared_expert_gate.weight" else 0.25
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def save(name, block, hidden, output, metadata, shared_prefix=None, extra=None):
    os.makedirs(OUT, exist_ok=True)
    tensors = {"hidden": hidden, "output": output, "router_weight": block.gate.weight,
               "experts.gate_up_proj": block.experts.gate_up_proj, "experts.down_proj": block.experts.down_proj}
    if shared_prefix is not None:
        shared = getattr(block, shared_prefix)
        tensors.update({"shared_gate_proj": shared.gate_proj.weight, "shared_up_proj": shared.up_proj.weight,
                        "shared_down_proj": shared.down_proj.weight})
    tensors.update(extra or {})
    tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
    metadata = {k: str(v) for k, v in metadata.items()}
    metadata["transformers"] = __import__("transformers").__version__
    metadata["torch"] = torch.__version__
    path = os.path.join(OUT, name + ".safetensors")
    save_file(tensors, path, metadata=metadata)
    print(name, {k: tuple(v.shape) for k, v in tensors.items()}, os.path.getsize(path), "bytes")


def run(block, g):
    hidden = torch.randn(1, T, H, generator=g)
    with torch.no_grad():
        output = block(hidden)
    if isinstance(output, tuple):
        output = output[0]
    return hidden.view(T, H), output.reshape(T, H)


def qwen3_moe(seed):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    g = torch.Generator().manual_seed(seed)
    config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I,
                            norm_topk_prob=True, hidden_act="silu")
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config).eval()
    randomise(block, g)
    hidden, output = run(block, g)
    save("qwen3_moe", block, hidden, output, {"kind": "softmax_topk", "top_k": 2, "norm_topk_prob": "true"})


def qwen2_moe(seed):
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    g = torch.Generator().manual_seed(seed)
    config = Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I,
                            shared_expert_intermediate_size=24, norm_topk_prob=False, hidden_act="silu")
    config._experts_implementation = "eager"
    block = Qwen2MoeSparseMoeBlock(config).eval()
    randomise(block, g)
    hidden, output = run(block, g)
    save("qwen2_moe_shared", block, hidden, output, {"kind": "softmax_topk", "top_k": 2, "norm_topk_prob": "false"},
         shared_prefix="shared_expert", extra={"shared_expert_gate": block.shared_expert_gate.weight})


def deepseek_v3(seed):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    g = torch.Generator().manual_seed(seed)
    K, groups, kept = 3, 4, 2
    config = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                              n_group=groups, topk_group=kept, n_shared_experts=1, norm_topk_prob=True,
                              routed_scaling_factor=2.5, hidden_act="silu")
    config._experts_implementation = "eager"
    block = DeepseekV3MoE(config).eval()
    randomise(block, g)
    bias = torch.randn(E, generator=g) * 0.3  # nonzero, negative values included
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(bias)
    hidden, output = run(block, g)
    save("deepseek_v3", block, hidden, output,
         {"kind": "deepseek_v3", "top_k": K, "norm_topk_prob": "true", "n_group": groups, "topk_group": kept,
          "routed_scaling_factor": 2.5}, shared_prefix="shared_experts", extra={"correction_bias": bias})


if __name__ == "__main__":
    qwen3_moe(11)
    qwen2_moe(12)
    deepseek_v3(13)

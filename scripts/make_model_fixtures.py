#!/usr/bin/env python3
"""Makes tests/fixtures/models/: tiny random checkpoints of every architecture the model runtime runs,
saved by transformers itself (save_pretrained: config.json + model.safetensors, per-expert tensors as
transformers writes them), each with transformers' own outputs for a fixed prompt in expected.safetensors:

  prompt          [T] int32         the prompt's token ids
  logits          [T, V] float32    the float32 model's logits for the prompt (attn_implementation="eager")
  greedy          [N] int32         greedy generate(prompt, max_new_tokens=N, do_sample=False), new tokens only
  logits_bf16     [T, V] float32    the same checkpoint loaded with from_pretrained(dtype=torch.bfloat16)

The weights are drawn wider than transformers' initialiser (std 0.02 gives near-uniform routers whose
top-k choice a rounding could flip) and the router and correction biases get random values too.

Run:  scripts/reference_python.sh scripts/make_model_fixtures.py [NAME ...]   (see scripts/setup_reference_env.sh)
      (NAME: only these fixtures are rewritten; none: all of them)
transformers is the yardstick only, never a dependency of moekit.
"""
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "models")
VOCAB, PROMPT_LEN, NEW_TOKENS = 96, 11, 8

COMMON = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=4, max_position_embeddings=256,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)

MODELS = {
    # per-head q/k norm; layer 1 dense (mlp_only_layers), norm_topk_prob on
    "qwen3_moe": dict(COMMON, model_type="qwen3_moe", num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                      intermediate_size=40, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1], rope_theta=10000.0),
    # q/k/v biases, sigmoid-gated shared expert, no renormalisation
    "qwen2_moe": dict(COMMON, model_type="qwen2_moe", num_hidden_layers=2, num_key_value_heads=2,
                      intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    # sliding window shorter than the prompt; per-expert w1/w3/w2 under block_sparse_moe
    "mixtral": dict(COMMON, model_type="mixtral", num_hidden_layers=2, num_key_value_heads=2, intermediate_size=24,
                    num_local_experts=6, num_experts_per_tok=2, sliding_window=5, rope_theta=1e6),
    # whole-projection q/k norm, clip_qkv
    "olmoe": dict(COMMON, model_type="olmoe", num_hidden_layers=2, num_key_value_heads=4, intermediate_size=24,
                  num_experts=8, num_experts_per_tok=3, clip_qkv=1.5, norm_topk_prob=False),
    # MLA with q compression, YaRN rope (mscale), one dense layer first, grouped sigmoid router, shared expert
    "deepseek_v3": dict(COMMON, model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4,
                        intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
                        kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12,
                        routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    # DeepSeek without q compression and without YaRN
    "deepseek_v3_no_q_lora": dict(COMMON, model_type="deepseek_v3", num_hidden_layers=2, num_key_value_heads=4,
                                  intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
                                  num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=2,
                                  first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=1.0, norm_topk_prob=False),
    # attention sinks, alternating sliding-window (window 4) and full layers, biased clamped experts stored
    # transposed and interleaved, top-k-then-softmax router with a bias, YaRN rope
    "gpt_oss": dict(COMMON, model_type="gpt_oss", num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                    intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, sliding_window=4,
                    swiglu_limit=7.0),
    # a vision-language wrapper: the language model (qwen3_moe's text model with fused experts and
    # interleaved multimodal rope sections) under text_config and model.language_model.*, a tiny vision
    # tower under vision_config and model.visual.*; run on text tokens only (no pixel values)
    "qwen3_vl_moe": dict(model_type="qwen3_vl_moe", tie_word_embeddings=False,
                         text_config=dict(COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                                          intermediate_size=40, moe_intermediate_size=16, num_experts=8,
                                          num_experts_per_tok=2, mlp_only_layers=[1],
                                          rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                               mrope_section=[4, 2, 2], mrope_interleaved=True)),
                         vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                            patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                                            out_hidden_size=48, num_position_embeddings=16,
                                            deepstack_visual_indexes=[0])),
}


def randomise(model, g):
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "gate.weight" in name or "router" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / fan_in ** 0.5 if p.dim() > 1 else 0.1))
        for buf_name, b in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def main(names):
    for name in names:
        if name not in MODELS:
            sys.exit(f"unknown fixture '{name}'; known: {', '.join(MODELS)}")
    for index, (name, spec) in enumerate(MODELS.items()):
        if names and name not in names:
            continue
        spec = dict(spec)
        model_type = spec.pop("model_type")
        config = AutoConfig.for_model(model_type, **spec)
        config._attn_implementation = "eager"
        g = torch.Generator().manual_seed(1000 + index)
        # Vision-language models are not AutoModelForCausalLM; their text-only forward is the language model's.
        auto_class = AutoModelForImageTextToText if "text_config" in spec else AutoModelForCausalLM
        model = auto_class.from_config(config, attn_implementation="eager").eval()
        randomise(model, g)
        prompt = torch.randint(3, VOCAB, (1, PROMPT_LEN), generator=g)
        with torch.no_grad():
            logits = model(prompt).logits[0].float()
            greedy = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                    eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:]
        directory = os.path.join(OUT, name)
        shutil.rmtree(directory, ignore_errors=True)
        model.save_pretrained(directory, safe_serialization=True)
        os.remove(os.path.join(directory, "generation_config.json"))
        # As users load it: from_pretrained(dtype=bfloat16) (model.to() would also round the rotary
        # inv_freq buffers, which from_pretrained keeps in float32).
        model_bf16 = auto_class.from_pretrained(directory, dtype=torch.bfloat16,
                                                          attn_implementation="eager").eval()
        with torch.no_grad():
            logits_bf16 = model_bf16(prompt).logits[0].float()
        top2 = logits.topk(2, dim=-1).values
        tensors = {"prompt": prompt[0].to(torch.int32), "logits": logits.contiguous(),
                   "greedy": greedy.to(torch.int32).contiguous(), "logits_bf16": logits_bf16.contiguous()}
        metadata = {"transformers": __import__("transformers").__version__, "torch": torch.__version__,
                    "smallest_top2_gap": f"{(top2[:, 0] - top2[:, 1]).min().item():.4g}"}
        save_file(tensors, os.path.join(directory, "expected.safetensors"), metadata=metadata)
        with open(os.path.join(directory, "config.json")) as f:
            written = json.load(f)
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        print(f"  bf16 vs float32 logits: relative L2 {((logits_bf16 - logits).norm() / logits.norm()).item():.4f}")
        print(f"{name}: {written['model_type']} dtype={written.get('dtype')} {size} bytes, greedy {greedy.tolist()}, "
              f"smallest top-2 logit gap {metadata['smallest_top2_gap']}")


if __name__ == "__main__":
    main(sys.argv[1:])

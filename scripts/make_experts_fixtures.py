#!/usr/bin/env python3
"""Makes tests/fixtures/experts/: experts-layer inputs in `moekit experts`'s format and the output
transformers' own experts modules compute for them (the eager implementation, on the CPU), and for the
backward a fixed gradient of that output with the gradients torch autograd computes through the same module.

Per fixture NAME:
    NAME.input.safetensors           the layer's inputs and weights, configuration in __metadata__
    NAME.expected.safetensors        out
    NAME.grad_out.safetensors        grad_out [T, H] alone (what `moekit experts --grad-output` reads)
    NAME.expected_grads.safetensors  grad_hidden_states, grad_top_k_weights, grad_<weight> for each weight
                                     and bias of the input file, each in that tensor's dtype and layout

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


def versions():
    return {"transformers": __import__("transformers").__version__, "torch": torch.__version__}


def save(name, tensors, metadata, expected):
    os.makedirs(OUT, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(OUT, name + ".input.safetensors"),
              metadata=metadata)
    save_file({"out": expected.contiguous()}, os.path.join(OUT, name + ".expected.safetensors"), metadata=versions())
    print(name, {k: tuple(v.shape) for k, v in tensors.items()}, "->", tuple(expected.shape))


def autograd_gradients(experts, tensors, weight_names, grad_out, expected_out):
    """d<grad_out, out> with respect to hidden_states, top_k_weights and the module's weights and biases, by
    torch autograd through transformers' own forward, in the fixture's dtype (as a bf16 training step runs)."""
    x = tensors["hidden_states"].clone().requires_grad_(True)
    w = tensors["top_k_weights"].clone().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    experts.requires_grad_(True)
    out = experts(x, tensors["top_k_index"], w)
    # The gradients must belong to the very output the .expected file holds, not to a different computation.
    if not torch.equal(out.detach(), expected_out):
        raise SystemExit("the forward with autograd differs from the saved forward; the gradients would not match it")
    out.backward(grad_out)
    grads = {"grad_hidden_states": x.grad, "grad_top_k_weights": w.grad}
    for n in weight_names:
        p = getattr(experts, n)
        # A parameter that no token reaches gets no .grad at all; its gradient is zero.
        grads["grad_" + n] = p.grad if p.grad is not None else torch.zeros_like(p)
    for n, g in grads.items():
        source = tensors[n[len("grad_"):]]
        assert g.shape == source.shape and g.dtype == source.dtype, (n, g.shape, g.dtype, source.shape, source.dtype)
    return grads


def save_backward(name, grad_out, grads):
    save_file({"grad_out": grad_out.contiguous()}, os.path.join(OUT, name + ".grad_out.safetensors"))
    save_file({k: v.detach().contiguous() for k, v in grads.items()},
              os.path.join(OUT, name + ".expected_grads.safetensors"), metadata=versions())
    print(name, "backward:", ", ".join(grads))


def run_and_save(name, experts, dtype, shape, generator, weight_names, metadata, adjust=None):
    """Runs transformers' experts module on fresh inputs and routing, and saves inputs, weights and output; then
    its backward for a fixed grad_out, and saves grad_out and the gradients."""
    H, E, K, T = shape
    experts = experts.to(dtype)
    x = torch.randn(T, H, generator=generator).to(dtype)
    index, weights = routing(T, E, K, generator)
    if adjust is not None:
        adjust(experts, x, index, dtype)
    with torch.no_grad():
        out = experts(x, index, weights.to(dtype))
    tensors = {"hidden_states": x, "top_k_index": index, "top_k_weights": weights.to(dtype)}
    tensors.update({n: getattr(experts, n).data for n in weight_names})
    save(name, tensors, metadata, out)
    # Drawn after everything above, so that the inputs stay those the forward fixtures always had.
    grad_out = torch.randn(T, H, generator=generator).to(dtype)
    save_backward(name, grad_out, autograd_gradients(experts, tensors, weight_names, grad_out, out))


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


# Stored mantissa bits: a value v of the dtype has neighbours 2^(exponent(v) - bits) apart.
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def spacing(values, dtype):
    """The distance between neighbouring values of dtype at |values| (at least that at 1)."""
    values = torch.as_tensor(values, dtype=torch.float64)
    _, exponent = torch.frexp(values.abs().clamp(min=1.0))  # |v| = m * 2^exponent, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(values), exponent - 1 - MANTISSA_BITS[dtype])


def keep_clear_of_clamp_kinks(experts, x, index, dtype):
    """Moves gate_up_proj_bias entries so that no routed pre-activation lies where rounding decides a clamp.

    GPT-OSS clamps gate at +limit and up at +-limit, and the gradient jumps there (full slope inside, zero
    where the clamp is active). transformers computes the pre-activation in the fixture's dtype, rounding
    x @ W and then the bias sum to it, so a pre-activation within that rounding of a kink lands on either side
    of it by chance: its gradient element is then all or nothing, and in bf16 a handful of such elements move
    whole rows of grad_hidden_states and grad_gate_up_proj by 25-40%, as much as a wrong expert does. The
    forward does not care (the clamp is continuous). Each entry moves by the smallest multiple of 1/16 that keeps
    every token routed to its expert at least twice transformers' worst rounding (a step of x @ W plus a step at
    the limit) from each kink; the clamps stay active on a share of the values as before."""
    limit = experts.limit
    W = experts.gate_up_proj.detach().double()  # [E, H, 2I]: transposed, gate and up interleaved
    bias = experts.gate_up_proj_bias.detach().double().clone()
    moved = 0
    for e in range(W.shape[0]):
        tokens = (index == e).any(dim=-1).nonzero().flatten()
        if tokens.numel() == 0:
            continue
        product = x[tokens].double() @ W[e]  # [tokens, 2I]
        margin = spacing(product, dtype) + spacing(limit, dtype)
        for c in range(W.shape[2]):
            kinks = (limit,) if c % 2 == 0 else (-limit, limit)  # even columns are gate, odd are up
            for step in [0] + [s * sign for s in range(1, 33) for sign in (1, -1)]:
                # The candidate as the dtype stores it, so the check holds for the bias the module uses.
                candidate = torch.tensor(bias[e, c].item() + step / 16).to(dtype).double().item()
                z = product[:, c] + candidate
                if all(bool(((z - k).abs() > margin[:, c]).all()) for k in kinks):
                    moved += candidate != bias[e, c].item()
                    bias[e, c] = candidate
                    break
            else:
                raise SystemExit(f"no bias within +-2 keeps expert {e} column {c} clear of the clamp kinks")
    with torch.no_grad():
        experts.gate_up_proj_bias.copy_(bias.to(dtype))
    print(f"  moved {moved} gate_up_proj_bias entries clear of the clamp kinks")


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
                  "swiglu_limit": "7.0", "swiglu_alpha": "1.702"}, adjust=keep_clear_of_clamp_kinks)


if __name__ == "__main__":
    torch.manual_seed(0)
    qwen3_experts("qwen3_moe_f32", torch.float32, 1)
    qwen3_experts("qwen3_moe_bf16", torch.bfloat16, 2)
    gpt_oss_experts("gpt_oss_f32", torch.float32, 3)
    gpt_oss_experts("gpt_oss_bf16", torch.bfloat16, 4)
    sys.exit(0)

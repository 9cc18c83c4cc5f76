"""moekit.transformers: transformers models whose experts run on moekit (DESIGN §9).

The tiny random checkpoints of tests/fixtures/models load with experts_implementation="moekit_<backend>"
and must match the same checkpoint loaded with transformers' "eager": logits, greedy tokens, and one
training step's gradients, then the logits after an optimizer step (which catches stale packed weights).
Also: set_experts_implementation switching at run time, register(override_builtin=True), the refusals,
GPT-OSS's clamped SwiGLU with its clamps active, and FP8 experts through FP8ExpertsInterface.

Runs against the installed (or staged) moekit package:
    PYTHONPATH=build-cpu/python scripts/reference_python.sh -m unittest discover -s python/tests -p 'test_transformers.py'
CUDA cases skip without a GPU.
"""

import contextlib
import functools
import json
import os
import unittest
from unittest import mock

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig
from transformers.integrations.finegrained_fp8 import (
    ALL_FP8_EXPERTS_FUNCTIONS,
    FP8Experts,
    FP8ExpertsInterface,
    fp8_grouped_mm_experts_forward,
)
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    ExpertsInterface,
    batched_mm_experts_forward,
    grouped_mm_experts_forward,
    use_experts_implementation,
)

import moekit
import moekit.torch
import moekit.transformers as mt

HAS_CUDA = torch.cuda.is_available()
MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "models")
# Every float fixture (the *_fp8* ones load dequantised without a GPU: nothing of FP8 would run here).
FIXTURES = sorted(d for d in os.listdir(MODELS) if "fp8" not in d)
CPU_BACKENDS = ("eager", "batched_mm", "grouped_mm")
NEW_TOKENS = 8
# float32: the backends sum the same products in another order, so a few ulps per layer.
F32_ROW_TOLERANCE = 1e-4
F32_GRAD_TOLERANCE = 1e-4
# bf16 (DESIGN §6): relative L2 overall and for the worst single token (row).
BF16_TOLERANCE, BF16_ROW_TOLERANCE = 2e-2, 5e-2


def load(name, implementation, dtype=torch.float32, device="cpu"):
    directory = os.path.join(MODELS, name)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    # Vision-language models are not AutoModelForCausalLM; their text-only forward is the language model's.
    auto_class = AutoModelForImageTextToText if "text_config" in config else AutoModelForCausalLM
    model = auto_class.from_pretrained(directory, dtype=dtype, attn_implementation="eager",
                                       experts_implementation=implementation)
    return model.to(device).eval()


def prompt(name, device="cpu"):
    return load_file(os.path.join(MODELS, name, "expected.safetensors"))["prompt"].long()[None].to(device)


def greedy(model, ids):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def training_batch(device="cpu"):
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 96, (2, 10), generator=g).to(device)


def train_step(model, ids):
    """One step: the loss's gradients, an SGD step, then the logits of the updated model on ids."""
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.5)
    model.eval()
    with torch.no_grad():
        after = model(ids).logits.float()
    return grads, after


@functools.lru_cache(maxsize=None)
def eager_reference(name):
    """transformers' eager run of a fixture: logits, greedy tokens, gradients, logits after the step."""
    model = load(name, "eager")
    ids = prompt(name)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    tokens = greedy(model, ids)
    grads, after = train_step(model, training_batch())
    return logits, tokens, grads, after


@contextlib.contextmanager
def counting_moekit_calls():
    """The backend of every moekit.torch.experts call made inside (moekit.transformers looks the function
    up at each call, so the wrapper sees them all)."""
    calls = []
    real = moekit.torch.experts

    def counted(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    with mock.patch.object(moekit.torch, "experts", counted):
        yield calls


def row_errors(actual, expected):
    actual, expected = actual.double().reshape(-1, actual.shape[-1]), expected.double().reshape(-1, expected.shape[-1])
    return (actual - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-30)


class Assertions(unittest.TestCase):
    def assert_rows_close(self, actual, expected, tolerance, what):
        self.assertFalse(torch.isnan(actual).any().item(), f"{what}: NaN")
        worst = row_errors(actual, expected).max().item()
        self.assertLessEqual(worst, tolerance, f"{what}: worst row relative L2 error {worst:.3g} > {tolerance}")

    def assert_bf16_close(self, actual, expected, what, tolerance=BF16_TOLERANCE, row_tolerance=BF16_ROW_TOLERANCE):
        self.assertFalse(torch.isnan(actual).any().item(), f"{what}: NaN")
        a, e = actual.double(), expected.double()
        overall = ((a - e).norm() / e.norm()).item()
        self.assertLessEqual(overall, tolerance, f"{what}: relative L2 error {overall:.3g} > {tolerance}")
        self.assert_rows_close(actual, expected, row_tolerance, what)

    def assert_grads_close(self, grads, expected, tolerance, what):
        self.assertEqual(set(grads), set(expected))
        scale = max((g.norm().item() for g in expected.values() if g is not None), default=1.0)
        for name, reference in expected.items():
            grad = grads[name]
            if reference is None or grad is None:
                # Unused parameters: no gradient in one run and none (or zeros) in the other.
                other = reference if grad is None else grad
                self.assertTrue(other is None or not other.any().item(), f"{what}: {name}: gradient in one run only")
                continue
            self.assertFalse(torch.isnan(grad).any().item(), f"{what}: {name}: NaN gradient")
            error = (grad.double() - reference.double()).norm().item()
            # Relative per parameter, with a floor far below any real gradient of the model for the
            # parameters whose true gradient is 0 (experts no token was routed to).
            bound = tolerance * reference.norm().item() + 1e-9 * scale
            self.assertLessEqual(error, bound, f"{what}: {name}: gradient error {error:.3g} > {bound:.3g} "
                                               f"(reference norm {reference.norm().item():.3g})")


# ---------------------------------------------------------------------------------------------------------
# Every fixture with every CPU backend, against transformers' eager.


class FixtureModels(Assertions):
    def check_fixture(self, name, backend):
        logits, tokens, grads, after = eager_reference(name)
        model = load(name, f"moekit_{backend}")
        self.assertEqual(model.get_experts_implementation()[""], f"moekit_{backend}")
        ids = prompt(name)
        with counting_moekit_calls() as calls, torch.no_grad():
            ours = model(ids).logits[0].float()
        self.assertTrue(calls and set(calls) == {backend}, f"moekit ran {calls}")
        self.assert_rows_close(ours, logits, F32_ROW_TOLERANCE, f"{name} {backend} logits")
        self.assertEqual(greedy(model, ids), tokens, f"{name} {backend}: greedy tokens")
        our_grads, our_after = train_step(model, training_batch())
        self.assert_grads_close(our_grads, grads, F32_GRAD_TOLERANCE, f"{name} {backend}")
        self.assert_rows_close(our_after, after, F32_ROW_TOLERANCE, f"{name} {backend} logits after a step")


def _add_fixture_tests():
    for name in FIXTURES:
        for backend in CPU_BACKENDS:
            setattr(FixtureModels, f"test_{name}_{backend}",
                    lambda self, name=name, backend=backend: self.check_fixture(name, backend))


_add_fixture_tests()


# ---------------------------------------------------------------------------------------------------------
# Registration, switching, overriding.


class Registration(Assertions):
    def test_names_registered_in_both_interfaces(self):
        for backend in mt.BACKENDS:
            for interface in (ExpertsInterface, FP8ExpertsInterface):
                self.assertIs(interface._global_mapping[f"moekit_{backend}"], mt.FORWARDS[backend])
        self.assertIs(ExpertsInterface._global_mapping["grouped_mm"], grouped_mm_experts_forward)

    def test_megamoe_says_why_it_does_not_run(self):
        model = load("qwen3_moe", "moekit_deepgemm_megamoe")
        with self.assertRaises(moekit.Error) as caught, torch.no_grad():
            model(prompt("qwen3_moe"))
        self.assertIn("deepgemm_megamoe", str(caught.exception))
        self.assertIn("expert parallelism", str(caught.exception))

    def test_unknown_name_lists_moekit_names(self):
        with self.assertRaises(ValueError) as caught:
            load("qwen3_moe", "moekit_no_such_backend")
        self.assertIn("moekit_grouped_mm", str(caught.exception))

    def test_set_experts_implementation_switches_at_run_time(self):
        logits = eager_reference("qwen3_moe")[0]
        model = load("qwen3_moe", "eager")
        ids = prompt("qwen3_moe")
        for implementation in ("moekit_grouped_mm", "moekit_batched_mm", "eager", "moekit_eager"):
            model.set_experts_implementation(implementation)
            self.assertEqual(model.get_experts_implementation()[""], implementation)
            with counting_moekit_calls() as calls, torch.no_grad():
                ours = model(ids).logits[0].float()
            # qwen3_moe's fixture: layers 0 and 2 are MoE layers, layer 1 is dense.
            expected = [] if implementation == "eager" else [implementation[len("moekit_"):]] * 2
            self.assertEqual(calls, expected, implementation)
            self.assert_rows_close(ours, logits, F32_ROW_TOLERANCE, implementation)

    def test_set_experts_implementation_reaches_the_text_model(self):
        model = load("qwen3_vl_moe", "eager")
        model.set_experts_implementation("moekit_batched_mm")
        self.assertEqual(model.get_experts_implementation()["text_config"], "moekit_batched_mm")
        with counting_moekit_calls() as calls, torch.no_grad():
            model(prompt("qwen3_vl_moe"))
        self.assertEqual(set(calls), {"batched_mm"})
        model.set_experts_implementation({"text_config": "moekit_grouped_mm"})
        with counting_moekit_calls() as calls, torch.no_grad():
            model(prompt("qwen3_vl_moe"))
        self.assertEqual(set(calls), {"grouped_mm"})

    def test_override_builtin(self):
        logits = eager_reference("qwen3_moe")[0]
        try:
            mt.register(override_builtin=True)
            mt.register(override_builtin=True)  # twice: the saved originals stay transformers' own
            for interface, names in mt.BUILTIN_NAMES.items():
                for name in names:
                    self.assertIs(interface._global_mapping[name], mt.FORWARDS[name], f"{interface.__name__} {name}")
            model = load("qwen3_moe", "grouped_mm")
            ids = prompt("qwen3_moe")
            with counting_moekit_calls() as calls, torch.no_grad():
                ours = model(ids).logits[0].float()
            self.assertEqual(calls, ["grouped_mm"] * 2)
            self.assert_rows_close(ours, logits, F32_ROW_TOLERANCE, "grouped_mm overridden")
            model.set_experts_implementation("batched_mm")
            with counting_moekit_calls() as calls, torch.no_grad():
                model(ids)
            self.assertEqual(calls, ["batched_mm"] * 2)
        finally:
            mt.register(override_builtin=False)
        self.assertIs(ExpertsInterface._global_mapping["grouped_mm"], grouped_mm_experts_forward)
        self.assertIs(ExpertsInterface._global_mapping["batched_mm"], batched_mm_experts_forward)
        self.assertIs(FP8ExpertsInterface._global_mapping["grouped_mm"], fp8_grouped_mm_experts_forward)
        with counting_moekit_calls() as calls, torch.no_grad():
            load("qwen3_moe", "grouped_mm")(prompt("qwen3_moe"))
        self.assertEqual(calls, [])


class Compile(Assertions):
    def test_fullgraph_forward_and_backward(self):
        # aot_eager: dynamo traces the whole model (the adapter included, no graph break) and AOTAutograd
        # the backward, through moekit's fake and autograd registrations, without needing a C++ compiler.
        for name in ("qwen3_moe", "gpt_oss"):
            with self.subTest(fixture=name):
                logits, _, grads, _ = eager_reference(name)
                model = load(name, "moekit_grouped_mm")
                compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
                with torch.no_grad():
                    ours = compiled(prompt(name)).logits[0].float()
                self.assert_rows_close(ours, logits, F32_ROW_TOLERANCE, f"{name} compiled logits")
                model.train()
                ids = training_batch()
                compiled(input_ids=ids, labels=ids).loss.backward()
                our_grads = {n: p.grad for n, p in model.named_parameters()}
                self.assert_grads_close(our_grads, grads, F32_GRAD_TOLERANCE, f"{name} compiled")


# ---------------------------------------------------------------------------------------------------------
# What moekit cannot run: the reason, before any work.


def experts_module(name="qwen3_moe", layer=0, **config_changes):
    """The experts module of a fixture's layer, in float32 (the model built from the fixture's config)."""
    directory = os.path.join(MODELS, name)
    model = load(name, "eager") if not config_changes else AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(directory, **config_changes))
    return model.model.layers[layer].mlp.experts


def routing(tokens, experts, top_k, hidden, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return x.to(device), idx.to(device), w.to(device)


class Refusals(Assertions):
    def test_hopper_backends_on_the_cpu(self):
        model = load("qwen3_moe", "moekit_deepgemm")
        for implementation in ("moekit_deepgemm", "moekit_sonicmoe"):
            model.set_experts_implementation(implementation)
            with self.assertRaises(moekit.Error) as caught, torch.no_grad():
                model(prompt("qwen3_moe"))
            self.assertIn(implementation[len("moekit_"):], str(caught.exception))

    def test_activation_moekit_has_not(self):
        experts = experts_module(hidden_act="gelu_new")
        x, idx, w = routing(3, 8, 2, 48)
        with self.assertRaises(moekit.Error) as caught:
            ALL_EXPERTS_FUNCTIONS["moekit_grouped_mm"](experts, x, idx, w)
        self.assertIn("gelu_new", str(caught.exception))

    def test_each_activation_maps(self):
        for hf_name, ours in mt.ACTIVATIONS.items():
            experts = experts_module(hidden_act=hf_name)
            _, _, kwargs = mt.experts_arguments(experts, "grouped_mm")
            self.assertEqual(kwargs["activation"], ours, hf_name)

    def test_gate_moekit_does_not_know(self):
        class ClampedExperts(torch.nn.Module):
            def __init__(self, config):
                super().__init__()
                self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 16, 8))
                self.down_proj = torch.nn.Parameter(torch.randn(4, 8, 8))
                self.act_fn = torch.nn.SiLU()
                self.num_experts = 4

            def _apply_gate(self, gate_up):
                gate, up = gate_up.chunk(2, dim=-1)
                return self.act_fn(gate.clamp(max=7.0)) * up

            def forward(self, hidden_states, top_k_index, top_k_weights):
                raise NotImplementedError

        experts = use_experts_implementation(ClampedExperts)(PretrainedConfig(hidden_act="silu"))
        x, idx, w = routing(3, 4, 2, 8)
        with self.assertRaises(moekit.Error) as caught:
            ALL_EXPERTS_FUNCTIONS["moekit_grouped_mm"](experts, x, idx, w)
        self.assertIn("_apply_gate", str(caught.exception))

    def test_layout_the_gate_does_not_read(self):
        experts = experts_module("gpt_oss")
        experts.is_concatenated = True  # GPT-OSS's gate reads interleaved rows
        x, idx, w = routing(3, 6, 2, 48)
        with self.assertRaises(moekit.Error) as caught:
            ALL_EXPERTS_FUNCTIONS["moekit_grouped_mm"](experts, x, idx, w)
        self.assertIn("is_concatenated", str(caught.exception))


# ---------------------------------------------------------------------------------------------------------
# GPT-OSS's clamped SwiGLU (DESIGN §2) with the clamps active, against GptOssExperts' own forward.


class GptOssClamp(Assertions):
    def test_clamped_swiglu_matches_gpt_oss(self):
        experts = experts_module("gpt_oss")
        with torch.no_grad():
            experts.gate_up_proj.mul_(6.0)  # gate and up values past the limit (7) on many rows
            experts.gate_up_proj_bias.mul_(6.0)
        _, _, kwargs = mt.experts_arguments(experts, "grouped_mm")
        self.assertEqual((kwargs["swiglu_alpha"], kwargs["swiglu_limit"]), (1.702, 7.0))
        self.assertEqual((kwargs["is_transposed"], kwargs["is_concatenated"]), (True, False))
        x, idx, w = routing(24, 6, 2, 48, seed=3)
        pre = torch.einsum("th,thn->tn", x, experts.gate_up_proj[idx[:, 0]]) + experts.gate_up_proj_bias[idx[:, 0]]
        self.assertGreater((pre.abs() > experts.limit).float().mean().item(), 0.05, "the clamps are not active")

        original_forward = type(experts).forward.__wrapped__

        def run(fn):
            inputs = [x.clone().requires_grad_(), w.clone().requires_grad_()]
            experts.zero_grad(set_to_none=True)
            out = fn(experts, inputs[0], idx, inputs[1])
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            grads = {"hidden_states": inputs[0].grad, "top_k_weights": inputs[1].grad}
            grads.update({n: p.grad.clone() for n, p in experts.named_parameters()})
            return out.detach(), grads

        expected, expected_grads = run(original_forward)
        for backend in CPU_BACKENDS:
            out, grads = run(ALL_EXPERTS_FUNCTIONS[f"moekit_{backend}"])
            self.assert_rows_close(out, expected, 1e-5, f"gpt_oss experts {backend}")
            self.assert_grads_close(grads, expected_grads, 1e-5, f"gpt_oss experts {backend}")


# ---------------------------------------------------------------------------------------------------------
# FP8 experts (DESIGN §3) through FP8ExpertsInterface: transformers' FP8Experts module filled with weights
# quantised here, against a reading of moekit's FP8 contract in plain torch.


def quantize_fp8(w, ue8m0):
    """[E, N, K] float -> e4m3 weights and 128 x 128 block scales_inv (float32, or float8_e8m0fnu)."""
    E, N, K = w.shape
    NB, KB = -(-N // 128), -(-K // 128)
    padded = F.pad(w, (0, KB * 128 - K, 0, NB * 128 - N)).view(E, NB, 128, KB, 128)
    amax = padded.abs().amax(dim=(2, 4)).clamp_min(1e-12)
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (padded / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(E, NB * 128, KB * 128)[:, :N, :K]
    return q.contiguous(), (scale.to(torch.float8_e8m0fnu) if ue8m0 else scale)


def dequantize_fp8(q, scale_inv):
    E, N, K = q.shape
    s = scale_inv.float().repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :K]
    return q.float() * s


def quantize_activations(x, power_of_two):
    """moekit quantises activations per row per 128 columns: scale max(amax / 448, FLT_MIN) (1 for an
    all-zero group), rounded up to a power of two when the weight scales are UE8M0."""
    T, K = x.shape
    groups = F.pad(x.float(), (0, -(-K // 128) * 128 - K)).view(T, -1, 128)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = (amax / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).view(T, -1)[:, :K]


def fp8_reference_forward(self, hidden_states, top_k_index, top_k_weights):
    """An FP8Experts module's experts as moekit's contract reads them, in float32, on the CPU: torch's CUDA
    kernels round some x / scale -> e4m3 conversions otherwise than its CPU ones (seen on the H200), which
    would make the reference depend on the device."""
    cpu = lambda t: t.detach().cpu()
    up = dequantize_fp8(cpu(self.gate_up_proj), cpu(self.gate_up_proj_scale_inv))
    down = dequantize_fp8(cpu(self.down_proj), cpu(self.down_proj_scale_inv))
    pow2 = self.gate_up_proj_scale_inv.dtype == torch.float8_e8m0fnu
    x = quantize_activations(cpu(hidden_states), pow2)
    idx, w = cpu(top_k_index), cpu(top_k_weights)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        e = idx[:, k]
        h = torch.einsum("tk,tnk->tn", x, up[e])
        gate, u = h.chunk(2, dim=-1)
        a = quantize_activations(F.silu(gate) * u, pow2)
        out += w[:, k, None].float() * torch.einsum("tk,tnk->tn", a, down[e])
    return out.to(hidden_states.dtype).to(hidden_states.device)


@functools.lru_cache(maxsize=None)
def fp8_experts_class():
    # As transformers' replace_with_fp8_linear makes it (the decorator changes FP8Experts in place, so once).
    return use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)


def fp8_experts(hidden, intermediate, experts, ue8m0, seed=0, device="cpu", **options):
    config = PretrainedConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                              hidden_act="silu")
    options.setdefault("block_size", [128, 128])
    module = fp8_experts_class()(config, scale_fmt="ue8m0" if ue8m0 else "float", **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, shape in (("gate_up_proj", (experts, 2 * intermediate, hidden)),
                            ("down_proj", (experts, hidden, intermediate))):
            q, s = quantize_fp8(torch.randn(shape, generator=g) / shape[-1] ** 0.5, ue8m0)
            setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, name + "_scale_inv", torch.nn.Parameter(s, requires_grad=False))
    return module.to(device)


class Fp8Experts(Assertions):
    device = "cpu"
    backends = CPU_BACKENDS
    # The CPU backends quantise exactly as the reading above: only the bf16 output's rounding differs.
    tolerance, row_tolerance = 5e-3, 1e-2
    # H = 320: a partial 128-wide block along K; I a multiple of 128, so gate and up rows keep separate scale
    # blocks when fused (what moekit needs, as in the checkpoints it runs).
    hidden, tokens = 320, 37

    def test_fp8_experts_match_the_contract(self):
        for ue8m0 in (False, True):
            module = fp8_experts(self.hidden, 128, 8, ue8m0, device=self.device)
            x, idx, w = routing(self.tokens, 8, 2, self.hidden, seed=5, dtype=torch.bfloat16, device=self.device)
            expected = fp8_reference_forward(module, x, idx, w)
            for backend in self.backends:
                with self.subTest(ue8m0=ue8m0, backend=backend):
                    out = ALL_FP8_EXPERTS_FUNCTIONS[f"moekit_{backend}"](module, x, idx, w)
                    self.assertEqual(out.dtype, torch.bfloat16)
                    self.assert_bf16_close(out.float(), expected.float(),
                                           f"FP8 {self.device} {backend} ue8m0={ue8m0}", self.tolerance,
                                           self.row_tolerance)

    def test_static_activations_refused(self):
        module = fp8_experts(128, 128, 4, False, activation_scheme="static", device=self.device)
        x, idx, w = routing(3, 4, 2, 128, dtype=torch.bfloat16, device=self.device)
        with self.assertRaises(moekit.Error) as caught:
            ALL_FP8_EXPERTS_FUNCTIONS["moekit_grouped_mm"](module, x, idx, w)
        self.assertIn("static", str(caught.exception))

    def test_other_block_size_refused(self):
        module = fp8_experts(128, 128, 4, False, block_size=[64, 64], device=self.device)
        x, idx, w = routing(3, 4, 2, 128, dtype=torch.bfloat16, device=self.device)
        with self.assertRaises(moekit.Error) as caught:
            ALL_FP8_EXPERTS_FUNCTIONS["moekit_grouped_mm"](module, x, idx, w)
        self.assertIn("block_size", str(caught.exception))

    def test_gate_and_up_scale_blocks_apart_refused(self):
        # transformers loads gate_proj and up_proj with block scales of their own and concatenates them:
        # with I = 24 gate_up_proj_scale_inv is [E, 2, 1] (one row per half), with I = 100 it is [E, 2, 1]
        # too, the shape of a 128-row grid over the 200 fused rows but not its meaning. Both are refused.
        for intermediate in (24, 100):
            with self.subTest(intermediate=intermediate):
                module = fp8_experts(48, intermediate, 4, False, device=self.device)
                with torch.no_grad():
                    s = module.gate_up_proj_scale_inv
                    halves = torch.cat([s[:, :1], s[:, :1]], dim=1)
                    module.gate_up_proj_scale_inv = torch.nn.Parameter(halves, requires_grad=False)
                self.assertEqual(tuple(module.gate_up_proj_scale_inv.shape), (4, 2, 1))
                x, idx, w = routing(3, 4, 2, 48, dtype=torch.bfloat16, device=self.device)
                with self.assertRaises(moekit.Error) as caught:
                    ALL_FP8_EXPERTS_FUNCTIONS["moekit_grouped_mm"](module, x, idx, w)
                self.assertIn(f"intermediate size {intermediate}", str(caught.exception))

    def test_clamp_without_alpha_refused(self):
        config = PretrainedConfig(hidden_size=128, moe_intermediate_size=128, num_experts=4, hidden_act="silu",
                                  swiglu_limit=7.0)
        module = fp8_experts_class()(config, block_size=[128, 128])
        with self.assertRaises(moekit.Error) as caught:
            mt.experts_arguments(module, "grouped_mm")
        self.assertIn("limit", str(caught.exception))


# ---------------------------------------------------------------------------------------------------------
# CUDA (the GPU machine): the fixtures in float32, every backend in bf16 against transformers' grouped_mm,
# the decode switch, FP8.


@unittest.skipUnless(HAS_CUDA, "no CUDA GPU")
class CudaFixtureModels(Assertions):
    def check_fixture_f32(self, name, backend):
        logits, tokens, grads, after = eager_reference(name)
        model = load(name, f"moekit_{backend}", device="cuda")
        ids = prompt(name, "cuda")
        with torch.no_grad():
            ours = model(ids).logits[0].float().cpu()
        self.assert_rows_close(ours, logits, F32_ROW_TOLERANCE, f"{name} {backend} CUDA logits")
        self.assertEqual(greedy(model, ids), tokens, f"{name} {backend} CUDA greedy tokens")
        our_grads, our_after = train_step(model, training_batch("cuda"))
        our_grads = {n: (g.cpu() if g is not None else None) for n, g in our_grads.items()}
        self.assert_grads_close(our_grads, grads, F32_GRAD_TOLERANCE, f"{name} {backend} CUDA")
        self.assert_rows_close(our_after.cpu(), after, F32_ROW_TOLERANCE, f"{name} {backend} CUDA after a step")

    def test_bf16_backends_against_transformers_grouped_mm(self):
        name = "qwen3_moe"
        reference = load(name, "grouped_mm", dtype=torch.bfloat16, device="cuda")
        ids = prompt(name, "cuda")
        with torch.no_grad():
            expected = reference(ids).logits[0].float()
        for backend in ("grouped_mm", "batched_mm", "deepgemm", "sonicmoe"):
            with self.subTest(backend=backend):
                model = load(name, f"moekit_{backend}", dtype=torch.bfloat16, device="cuda")
                with counting_moekit_calls() as calls, torch.no_grad():
                    ours = model(ids).logits[0].float()
                self.assertEqual(set(calls), {backend})
                self.assert_bf16_close(ours, expected, f"{name} bf16 {backend}")

    def test_bf16_training_step_against_transformers_grouped_mm(self):
        name = "qwen3_moe"
        ids = training_batch("cuda")
        expected, _ = train_step(load(name, "grouped_mm", dtype=torch.bfloat16, device="cuda"), ids)
        for backend in ("grouped_mm", "batched_mm"):
            with self.subTest(backend=backend):
                grads, _ = train_step(load(name, f"moekit_{backend}", dtype=torch.bfloat16, device="cuda"), ids)
                for param, reference in expected.items():
                    if reference is not None and reference.norm() > 0:
                        error = ((grads[param].float() - reference.float()).norm() / reference.float().norm()).item()
                        self.assertLessEqual(error, 5e-2, f"bf16 {backend} {param}: gradient error {error:.3g}")

    def test_override_builtin_decode_switch_runs_moekit(self):
        # On a GPU generate() switches grouped_mm to batched_mm for the decode phase: with the builtin names
        # bound to moekit, prefill runs moekit's grouped_mm and decode moekit's batched_mm.
        try:
            mt.register(override_builtin=True)
            model = load("qwen3_moe", "grouped_mm", dtype=torch.bfloat16, device="cuda")
            with counting_moekit_calls() as calls:
                greedy(model, prompt("qwen3_moe", "cuda"))
            self.assertEqual(calls[:2], ["grouped_mm"] * 2)
            self.assertEqual(set(calls[2:]), {"batched_mm"})
            self.assertEqual(model.get_experts_implementation()[""], "grouped_mm")
        finally:
            mt.register(override_builtin=False)

    def test_fp8_fixture_through_fp8_interface(self):
        # The FP8 fixtures have intermediate sizes of 24 and 16: transformers fuses gate and up with block
        # scales of their own, so moekit must refuse them with that reason (its FP8 kernels are checked by
        # Fp8ExpertsCuda below); transformers' loading puts FP8Experts modules in place.
        for name in (d for d in os.listdir(MODELS) if "fp8" in d):
            with self.subTest(fixture=name):
                model = load(name, "moekit_grouped_mm", dtype=torch.bfloat16, device="cuda")
                experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
                self.assertTrue(experts, f"{name}: no FP8Experts modules")
                with self.assertRaises(moekit.Error) as caught, torch.no_grad():
                    model(prompt(name, "cuda"))
                self.assertIn("not a multiple of 128", str(caught.exception))


def _add_cuda_fixture_tests():
    for name in FIXTURES:
        for backend in ("grouped_mm", "batched_mm"):
            setattr(CudaFixtureModels, f"test_{name}_{backend}_f32",
                    lambda self, name=name, backend=backend: self.check_fixture_f32(name, backend))


_add_cuda_fixture_tests()


@unittest.skipUnless(HAS_CUDA, "no CUDA GPU (transformers quantises to FP8 at load only on a GPU)")
class Fp8CheckpointCuda(Assertions):
    """A model quantised to FP8 by transformers as it loads (FineGrainedFP8Config, 128 x 128 blocks, the
    format of DeepSeek's and Qwen's FP8 checkpoints) runs its FP8Experts on moekit's FP8 kernels, through
    FP8ExpertsInterface: its logits against the same loaded model with the plain-torch reading of moekit's
    FP8 contract as its experts."""

    def test_quantised_at_load_runs_on_moekit(self):
        import tempfile

        from transformers import FineGrainedFP8Config, Qwen3MoeConfig

        config = Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[], tie_word_embeddings=False)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        FP8ExpertsInterface.register("test_fp8_reference", fp8_reference_forward)
        ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(3)).cuda()
        with tempfile.TemporaryDirectory() as directory:
            model.save_pretrained(directory)
            quantised = AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.bfloat16, device_map="cuda", attn_implementation="eager",
                # Only the experts: transformers' FP8 linear layers need the `kernels` package's kernels,
                # which the GPU machine lacks, and they are not what this test is about.
                quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128),
                                                         modules_to_not_convert=["lm_head", ".*self_attn", "mlp.gate"]),
                experts_implementation="moekit_grouped_mm").eval()
        experts = [m for m in quantised.modules() if isinstance(m, FP8Experts)]
        self.assertEqual(len(experts), 2, "transformers did not make FP8Experts of the experts")
        self.assertEqual(experts[0].gate_up_proj.dtype, torch.float8_e4m3fn)
        for backend in ("grouped_mm", "batched_mm", "deepgemm"):
            with self.subTest(backend=backend):
                quantised.set_experts_implementation(f"moekit_{backend}")
                with counting_moekit_calls() as calls, torch.no_grad():
                    ours = quantised(ids).logits[0].float()
                self.assertEqual(calls, [backend] * 2, f"moekit ran {calls}")
                quantised.set_experts_implementation("test_fp8_reference")
                with torch.no_grad():
                    reference = quantised(ids).logits[0].float()
                self.assert_bf16_close(ours, reference, f"FP8 checkpoint, moekit_{backend}")


@unittest.skipUnless(HAS_CUDA, "no CUDA GPU")
class Fp8ExpertsCuda(Fp8Experts):
    device = "cuda"
    backends = ("grouped_mm", "batched_mm", "deepgemm")
    # Another summation order can move an intermediate across an e4m3 rounding boundary: DESIGN §6's bf16.
    tolerance, row_tolerance = BF16_TOLERANCE, BF16_ROW_TOLERANCE
    # deepgemm needs H and I multiples of 128 for FP8.
    hidden, tokens = 256, 300


if __name__ == "__main__":
    unittest.main()

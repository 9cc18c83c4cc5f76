"""moekit.torch.experts against a plain-torch float64 reading of the contract (DESIGN §2, §2b, §6).

Runs against the installed (or staged) moekit package:
    PYTHONPATH=build-cpu/python scripts/reference_python.sh -m unittest discover -s python/tests
CUDA cases skip without a GPU.
"""

import dataclasses
import gc
import math
import unittest
from typing import Optional

import torch
import torch.nn.functional as F

import moekit
import moekit.torch as mt

HAS_CUDA = torch.cuda.is_available()
CPU_BACKENDS = ("eager", "batched_mm", "grouped_mm")
INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------------------
# The reference: a direct reading of DESIGN §2 in float64, differentiated by torch's autograd (§2b).


def reference_activation(h, activation, has_gate, is_concatenated, alpha, limit):
    if not has_gate:
        return _act(h, activation)
    half = h.shape[-1] // 2
    gate, up = (h[:, :half], h[:, half:]) if is_concatenated else (h[:, 0::2], h[:, 1::2])
    if limit is not None:
        # GPT-OSS: clamp, then (u + 1) * g * sigmoid(alpha * g); a clamped value has zero gradient.
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    return _act(gate, activation) * up


def _act(x, activation):
    if activation == "silu":
        return F.silu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "relu":
        return F.relu(x)
    if activation == "relu2":
        return F.relu(x) ** 2
    raise ValueError(activation)


def reference_experts(
    x,
    idx,
    w,
    gate_up,
    down,
    b1=None,
    b2=None,
    *,
    activation="silu",
    has_gate=True,
    is_transposed=False,
    is_concatenated=True,
    swiglu_alpha=1.702,
    swiglu_limit=None,
):
    """out[t] = sum_k w[t,k] * (down_e . act(gate_up_e . x[t] + b1_e) + b2_e), e = idx[t,k], in float64;
    ids >= E contribute nothing (so their routing weights get zero gradient)."""
    E = gate_up.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(idx.shape[1]):
        e = idx[:, k].long()
        real = e < E
        e = torch.where(real, e, torch.zeros_like(e))
        if is_transposed:
            h = torch.einsum("th,thn->tn", x, gate_up[e])
        else:
            h = torch.einsum("th,tnh->tn", x, gate_up[e])
        if b1 is not None:
            h = h + b1[e]
        a = reference_activation(h, activation, has_gate, is_concatenated, swiglu_alpha, swiglu_limit)
        if is_transposed:
            y = torch.einsum("ti,tih->th", a, down[e])
        else:
            y = torch.einsum("ti,thi->th", a, down[e])
        if b2 is not None:
            y = y + b2[e]
        out = out + (w[:, k] * real)[:, None] * y
    return out


# ---------------------------------------------------------------------------------------------------------
# Cases: the harness's list in small (DESIGN §6).


@dataclasses.dataclass
class Case:
    T: int = 7
    H: int = 40
    I: int = 24
    E: int = 5
    K: int = 2
    dtype: torch.dtype = torch.float32
    weights_dtype: Optional[torch.dtype] = None  # top_k_weights; None: the dtype of hidden_states
    index_dtype: torch.dtype = torch.int64
    activation: str = "silu"
    has_gate: bool = True
    is_transposed: bool = False
    is_concatenated: bool = True
    bias: bool = False
    swiglu_limit: Optional[float] = None
    swiglu_alpha: Optional[float] = None
    sentinels: bool = False
    one_expert: Optional[int] = None  # this expert takes every token (slot 0)

    def describe(self):
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


CASES = [
    Case(),
    Case(dtype=torch.bfloat16, weights_dtype=torch.float32),
    Case(dtype=torch.bfloat16, index_dtype=torch.int32, is_concatenated=False),
    Case(activation="gelu", is_transposed=True),
    Case(dtype=torch.bfloat16, activation="gelu_pytorch_tanh", is_transposed=True, is_concatenated=False),
    # f32 tells gelu's tanh approximation from erf (they differ by ~1e-3, inside the bf16 tolerance).
    Case(T=6, H=48, I=20, activation="gelu_pytorch_tanh", is_concatenated=False),
    Case(activation="relu2", has_gate=False, bias=True),
    Case(dtype=torch.bfloat16, activation="relu", has_gate=False, is_transposed=True),
    Case(activation="relu", bias=True, index_dtype=torch.int32),
    Case(T=9, H=24, I=40, E=3, K=3, dtype=torch.float16, activation="gelu"),
    # GPT-OSS: interleaved, transposed, with biases and the clamped SwiGLU.
    Case(is_transposed=True, is_concatenated=False, bias=True, swiglu_limit=1.5, swiglu_alpha=1.702),
    Case(dtype=torch.bfloat16, is_transposed=True, is_concatenated=False, bias=True, swiglu_limit=1.5),
    Case(T=11, sentinels=True, index_dtype=torch.int32),
    Case(T=11, dtype=torch.bfloat16, sentinels=True, bias=True),
    Case(T=1, K=1),
    Case(T=1, K=4, E=8, dtype=torch.bfloat16, sentinels=True),
    Case(T=9, K=1, one_expert=3),
    Case(T=13, K=2, one_expert=0, dtype=torch.bfloat16, is_transposed=True),
    Case(T=33, H=64, I=48, E=6, K=2, bias=True),
]


def make_inputs(case, seed, device="cpu"):
    """Fresh random inputs for the case; weights as leaf tensors in the case's dtype."""
    g = torch.Generator().manual_seed(seed)
    c = case
    N = 2 * c.I if c.has_gate else c.I
    # The clamp cases scale the first projection up so that the limit is active on part of the values.
    up_scale = (3.0 if c.swiglu_limit is not None else 1.0) / math.sqrt(c.H)

    def randn(*shape, scale=1.0, dtype=c.dtype):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)

    x = randn(c.T, c.H)
    gate_up = randn(c.E, c.H, N, scale=up_scale) if c.is_transposed else randn(c.E, N, c.H, scale=up_scale)
    down = randn(c.E, c.I, c.H, scale=1 / math.sqrt(c.I)) if c.is_transposed else randn(c.E, c.H, c.I, scale=1 / math.sqrt(c.I))
    b1 = randn(c.E, N, scale=0.2) if c.bias else None
    b2 = randn(c.E, c.H, scale=0.2) if c.bias else None
    # Distinct experts per token, as a top-k router picks them.
    idx = torch.argsort(torch.rand(c.T, c.E, generator=g), dim=1)[:, : c.K]
    if c.one_expert is not None:
        # Slot 0 of every token goes to that expert; where a token had it in another slot, that slot takes
        # the token's old slot-0 expert, so each row stays distinct.
        idx = torch.where(idx == c.one_expert, idx[:, :1].expand_as(idx), idx)
        idx[:, 0] = c.one_expert
    if c.sentinels:
        # About a third of the slots are expert-parallel sentinels, from E itself to the dtype's largest.
        big = INT32_MAX if c.index_dtype == torch.int32 else 2**62
        choices = torch.tensor([c.E, c.E + 3, big])
        mask = torch.rand(c.T, c.K, generator=g) < 0.35
        mask[0, 0] = True  # at least one
        idx = torch.where(mask, choices[torch.randint(0, 3, (c.T, c.K), generator=g)], idx)
    idx = idx.to(c.index_dtype).to(device)
    w = torch.softmax(torch.randn(c.T, c.K, generator=g, dtype=torch.float64), dim=1)
    w = w.to(c.weights_dtype or c.dtype).to(device)
    grad_out = randn(c.T, c.H)
    return dict(x=x, idx=idx, w=w, gate_up=gate_up, down=down, b1=b1, b2=b2, grad_out=grad_out)


def op_kwargs(case, backend):
    kw = dict(
        backend=backend,
        activation=case.activation,
        has_gate=case.has_gate,
        is_transposed=case.is_transposed,
        is_concatenated=case.is_concatenated,
    )
    if case.swiglu_limit is not None:
        kw["swiglu_limit"] = case.swiglu_limit
        if case.swiglu_alpha is not None:
            kw["swiglu_alpha"] = case.swiglu_alpha
    return kw


def run_moekit(case, inputs, backend, grad=True, save_activations=None):
    """moekit's out and, with grad, the gradients (x, w, gate_up, down, b1, b2)."""
    leaves = {k: v.detach().clone().requires_grad_(grad) if v is not None else None for k, v in inputs.items() if k not in ("idx", "grad_out")}
    out = mt.experts(
        leaves["x"],
        inputs["idx"],
        leaves["w"],
        leaves["gate_up"],
        leaves["down"],
        gate_up_proj_bias=leaves["b1"],
        down_proj_bias=leaves["b2"],
        save_activations=save_activations,
        **op_kwargs(case, backend),
    )
    if not grad:
        return out, None
    wrt = [leaves[k] for k in ("x", "w", "gate_up", "down", "b1", "b2") if leaves[k] is not None]
    grads = torch.autograd.grad(out, wrt, inputs["grad_out"])
    return out, grads


def run_reference(case, inputs):
    leaves = {
        k: v.detach().cpu().double().requires_grad_(True) if v is not None else None
        for k, v in inputs.items()
        if k not in ("idx", "grad_out")
    }
    out = reference_experts(
        leaves["x"],
        inputs["idx"].cpu(),
        leaves["w"],
        leaves["gate_up"],
        leaves["down"],
        leaves["b1"],
        leaves["b2"],
        activation=case.activation,
        has_gate=case.has_gate,
        is_transposed=case.is_transposed,
        is_concatenated=case.is_concatenated,
        swiglu_alpha=case.swiglu_alpha if case.swiglu_alpha is not None else 1.702,
        swiglu_limit=case.swiglu_limit,
    )
    wrt = [leaves[k] for k in ("x", "w", "gate_up", "down", "b1", "b2") if leaves[k] is not None]
    grads = torch.autograd.grad(out, wrt, inputs["grad_out"].cpu().double())
    return out, grads


GRAD_NAMES = ("grad_hidden_states", "grad_top_k_weights", "grad_gate_up_proj", "grad_down_proj", "grad_gate_up_proj_bias", "grad_down_proj_bias")


def assert_matches(test, got, ref, dtype, what):
    """DESIGN §6 tolerances: f32 rel. L2 <= 1e-5; bf16/f16 <= 2e-2 overall and <= 5e-2 per row (a token's
    row, or an expert's for weight gradients: one wrong expert must not hide in a global norm)."""
    test.assertEqual(tuple(got.shape), tuple(ref.shape), what)
    got = got.detach().cpu().double()
    ref = ref.detach().double()
    test.assertFalse(torch.isnan(got).any().item(), f"{what}: NaN")
    ref_norm = ref.norm().item()
    error = (got - ref).norm().item() / max(ref_norm, 1e-300)
    overall = 1e-5 if dtype == torch.float32 else 2e-2
    test.assertLessEqual(error, overall, f"{what}: rel. L2 error {error:.3g} > {overall}")
    if dtype != torch.float32 and got.dim() > 1:
        rows_got = got.reshape(got.shape[0], -1)
        rows_ref = ref.reshape(ref.shape[0], -1)
        # A row whose reference is zero (an expert no token chose) must come out zero as well.
        row_errors = (rows_got - rows_ref).norm(dim=1) / (rows_ref.norm(dim=1) + 1e-6 * ref_norm)
        worst = row_errors.max().item()
        test.assertLessEqual(worst, 5e-2, f"{what}: row {row_errors.argmax().item()} rel. error {worst:.3g} > 5e-2")


class ContractTest:
    """The contract cases on one device, for a list of backends (mixed into the TestCases below)."""

    device = "cpu"
    backends = CPU_BACKENDS

    def check_case(self, case, backend, seed, save_activations=None):
        inputs = make_inputs(case, seed, self.device)
        out, grads = run_moekit(case, inputs, backend, save_activations=save_activations)
        ref_out, ref_grads = run_reference(case, inputs)
        self.assertEqual(out.dtype, case.dtype)
        self.assertEqual(out.device.type, torch.device(self.device).type)
        assert_matches(self, out, ref_out, case.dtype, "out")
        names = [n for n in GRAD_NAMES if case.bias or "bias" not in n]
        for name, g, r in zip(names, grads, ref_grads):
            assert_matches(self, g, r, case.dtype, name)
        # Sentinel slots get exactly zero routing-weight gradient (DESIGN §2b).
        sentinel = inputs["idx"].long() >= case.E
        if sentinel.any():
            self.assertTrue(torch.all(grads[1][sentinel] == 0).item(), "grad_top_k_weights is not zero at sentinels")
        # The gradients keep their inputs' dtypes.
        self.assertEqual(grads[1].dtype, inputs["w"].dtype)
        self.assertEqual(grads[2].dtype, inputs["gate_up"].dtype)

    def test_contract_cases(self):
        for b, backend in enumerate(self.backends):
            for i, case in enumerate(CASES):
                with self.subTest(backend=backend, case=case.describe()):
                    self.check_case(case, backend, seed=1000 * b + i)


class CpuContractTest(ContractTest, unittest.TestCase):
    pass


@unittest.skipUnless(HAS_CUDA, "no CUDA GPU")
class CudaContractTest(ContractTest, unittest.TestCase):
    device = "cuda"

    def test_hopper_backends_forward_backward_bf16(self):
        # deepgemm and sonicmoe: Hopper, bf16, rows of multiples of 128 (H=256, I=128); out and every gradient
        # (their wgmma backward) against the float64 reference.
        cases = [
            Case(T=37, H=256, I=128, E=8, K=2, dtype=torch.bfloat16),
            Case(T=5, H=256, I=128, E=4, K=2, dtype=torch.bfloat16, sentinels=True, index_dtype=torch.int32),
            Case(T=64, H=256, I=128, E=6, K=3, dtype=torch.bfloat16, one_expert=2),
        ]
        for backend in ("deepgemm", "sonicmoe"):
            info = {b.name: b for b in mt.backends("cuda")}[backend]
            if not info.ok:
                self.skipTest(f"{backend} does not run on this GPU: {info.reason}")
            for i, case in enumerate(cases):
                with self.subTest(backend=backend, case=case.describe()):
                    self.check_case(case, backend, seed=500 + i)

    def test_hopper_backends_keep_activations_or_recompute(self):
        # The forward where a gradient is recorded keeps the backend's bytes (moekit::experts_training); the
        # backward reads them. Both that and save_activations=False (recompute) against the float64 reference.
        case = Case(T=40, H=256, I=128, E=8, K=2, dtype=torch.bfloat16)
        for backend in ("deepgemm", "sonicmoe"):
            info = {b.name: b for b in mt.backends("cuda")}[backend]
            if not info.ok:
                self.skipTest(f"{backend} does not run on this GPU: {info.reason}")
            inputs = make_inputs(case, 610, "cuda")
            out, saved = torch.ops.moekit.experts_training(
                inputs["x"], inputs["idx"], inputs["w"], inputs["gate_up"], inputs["down"], None, None, None, None,
                backend, case.activation, case.has_gate, case.is_transposed, case.is_concatenated, 1.702, None, "none")
            self.assertGreater(saved.numel(), 0, f"{backend} kept nothing for its backward")
            self.assertEqual(saved.dtype, torch.uint8)
            for save in (True, False):
                with self.subTest(backend=backend, save_activations=save):
                    self.check_case(case, backend, seed=610, save_activations=save)

    def test_cuda_graph_capture_forward_backward(self):
        case = Case(T=24, H=64, I=48, E=6, K=2, dtype=torch.bfloat16, bias=True)
        inputs = make_inputs(case, 77, "cuda")

        def leaves():
            return tuple(inputs[k].clone().requires_grad_(True) for k in ("x", "w", "gate_up", "down", "b1", "b2"))

        def step(wrt):
            x, w, gate_up, down, b1, b2 = wrt
            out = mt.experts(x, inputs["idx"], w, gate_up, down, gate_up_proj_bias=b1, down_proj_bias=b2, backend="grouped_mm")
            return (out,) + torch.autograd.grad(out, wrt, inputs["grad_out"])

        # The eager run has leaves of its own: a leaf's gradient node remembers the stream it was first used
        # on, and one used on the legacy default stream cannot take part in a capture.
        eager = [t.clone() for t in step(leaves())]
        # Warm up on a side stream, as torch.cuda.graph's documentation asks, then capture.
        wrt = leaves()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(wrt)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(wrt)
        for t in captured:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for name, got, want in zip(("out",) + GRAD_NAMES, captured, eager):
            self.assertTrue(torch.equal(got, want), f"{name}: the graph's replay differs from eager")


# ---------------------------------------------------------------------------------------------------------


class OpcheckTest(unittest.TestCase):
    """torch.library.opcheck: schema, fake kernels, autograd registration, AOT dispatch."""

    def _args(self, case, seed, backend="grouped_mm"):
        inputs = make_inputs(case, seed)
        req = lambda t: t.clone().requires_grad_(True) if t is not None else None  # noqa: E731
        args = (
            req(inputs["x"]),
            inputs["idx"],
            req(inputs["w"]),
            req(inputs["gate_up"]),
            req(inputs["down"]),
            req(inputs["b1"]),
            req(inputs["b2"]),
            None,
            None,
            backend,
            case.activation,
            case.has_gate,
            case.is_transposed,
            case.is_concatenated,
            case.swiglu_alpha if case.swiglu_alpha is not None else 1.702,
            case.swiglu_limit,
            "none",
        )
        return args, inputs["grad_out"]

    def test_opcheck_forward(self):
        cases = [
            (Case(T=5, H=16, I=8, E=3), "grouped_mm"),
            (Case(T=4, H=24, I=8, E=4, bias=True, is_transposed=True, is_concatenated=False, swiglu_limit=1.5), "batched_mm"),
            (Case(T=3, H=16, I=12, E=3, has_gate=False, activation="relu2", dtype=torch.bfloat16, sentinels=True), "eager"),
        ]
        for i, (case, backend) in enumerate(cases):
            with self.subTest(case=case.describe(), backend=backend):
                args, _ = self._args(case, 10 + i, backend)
                torch.library.opcheck(torch.ops.moekit.experts.default, args)

    def test_opcheck_backward(self):
        cases = [Case(T=5, H=16, I=8, E=3), Case(T=4, H=16, I=8, E=4, bias=True, index_dtype=torch.int32, sentinels=True)]
        for i, case in enumerate(cases):
            with self.subTest(case=case.describe()):
                args, grad_out = self._args(case, 20 + i)
                detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                torch.library.opcheck(torch.ops.moekit.experts_backward.default, (grad_out,) + detached)


    def test_opcheck_training_forward_and_saved_backward(self):
        case = Case(T=5, H=16, I=8, E=3, bias=True)
        args, grad_out = self._args(case, 30)
        torch.library.opcheck(torch.ops.moekit.experts_training.default, args)
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        _, saved = torch.ops.moekit.experts_training(*detached)
        torch.library.opcheck(torch.ops.moekit.experts_backward_saved.default, (grad_out, saved) + detached)


class SaveActivationsTest(unittest.TestCase):
    """Which op experts() runs where a gradient is recorded, and what it gives (CPU: the portable backends
    keep nothing, so both routes compute the same)."""

    case = Case(T=9, H=16, I=8, E=4, K=2, bias=True)

    def ops_run(self, grad, **kwargs):
        inputs = make_inputs(self.case, 40)
        names = []

        class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "moekit":
                    names.append(func._opname)
                return func(*args, **(kwargs or {}))

        with Recorder():
            out, grads = run_moekit(self.case, inputs, "grouped_mm", grad=grad, **kwargs)
        return names, out, grads

    def test_training_op_where_a_gradient_is_recorded(self):
        names, out, grads = self.ops_run(grad=True)
        self.assertEqual(names, ["experts_training", "experts_backward_saved"])
        names, out_recomputed, grads_recomputed = self.ops_run(grad=True, save_activations=False)
        self.assertEqual(names, ["experts", "experts_backward"])
        self.assertTrue(torch.equal(out, out_recomputed))
        for name, a, b in zip(GRAD_NAMES, grads, grads_recomputed):
            self.assertTrue(torch.equal(a, b), f"{name}: kept and recomputed differ")
        names, _, _ = self.ops_run(grad=False)
        self.assertEqual(names, ["experts"])

    def test_process_default(self):
        try:
            mt.set_save_activations(False)
            self.assertEqual(self.ops_run(grad=True)[0], ["experts", "experts_backward"])
            self.assertEqual(self.ops_run(grad=True, save_activations=True)[0], ["experts_training", "experts_backward_saved"])
        finally:
            mt.set_save_activations(True)

    def test_saved_bytes_of_another_problem_are_refused(self):
        inputs = make_inputs(self.case, 41)
        args = (inputs["x"], inputs["idx"], inputs["w"], inputs["gate_up"], inputs["down"], inputs["b1"], inputs["b2"],
                None, None, "grouped_mm", "silu", True, False, True, 1.702, None, "none")
        with self.assertRaises(moekit.Error) as e:
            torch.ops.moekit.experts_backward_saved(inputs["grad_out"], torch.zeros(64, dtype=torch.uint8), *args)
        self.assertIn("keeps 0 uint8 bytes", str(e.exception))


class PackingCacheTest(unittest.TestCase):
    """CPU packs are made once per weights and rebuilt after in-place writes (issue 35)."""

    def setUp(self):
        self.case = Case(T=40, H=64, I=48, E=4, K=2, dtype=torch.bfloat16)
        self.inputs = make_inputs(self.case, 4242)

    def _run(self, gate_up, down, backend):
        i = self.inputs
        with torch.no_grad():
            return mt.experts(i["x"], i["idx"], i["w"], gate_up, down, backend=backend)

    def test_same_weights_bitwise_equal_and_in_place_update_seen(self):
        for backend in CPU_BACKENDS:
            with self.subTest(backend=backend):
                gate_up = torch.nn.Parameter(self.inputs["gate_up"].clone())
                down = torch.nn.Parameter(self.inputs["down"].clone())
                first = self._run(gate_up, down, backend)
                second = self._run(gate_up, down, backend)
                self.assertTrue(torch.equal(first, second), "the same weights gave different results")
                # An optimizer-like in-place update: a stale pack would return `first` again.
                with torch.no_grad():
                    gate_up.add_(torch.randn_like(gate_up) * 0.5)
                    down.mul_(-1.5)
                updated = self._run(gate_up, down, backend)
                self.assertFalse(torch.equal(updated, first), "the result ignored an in-place weight update")
                inputs = dict(self.inputs, gate_up=gate_up.detach(), down=down.detach())
                ref, _ = run_reference(self.case, inputs)
                assert_matches(self, updated, ref, self.case.dtype, f"{backend} out after the update")

    def test_optimizer_step_seen(self):
        case = Case(T=24, H=32, I=16, E=3, K=2)
        inputs = make_inputs(case, 99)
        gate_up = torch.nn.Parameter(inputs["gate_up"].clone())
        down = torch.nn.Parameter(inputs["down"].clone())
        optimizer = torch.optim.SGD([gate_up, down], lr=0.2)
        before = gate_up.detach().clone()
        for _ in range(2):
            out = mt.experts(inputs["x"], inputs["idx"], inputs["w"], gate_up, down)
            (out * inputs["grad_out"]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        self.assertGreater((gate_up.detach() - before).norm().item(), 0.1 * before.norm().item(), "the steps moved nothing")
        with torch.no_grad():
            got = mt.experts(inputs["x"], inputs["idx"], inputs["w"], gate_up, down)
        ref, _ = run_reference(case, dict(inputs, gate_up=gate_up.detach(), down=down.detach()))
        assert_matches(self, got, ref, case.dtype, "out after two SGD steps")

    def test_inference_mode_weights(self):
        # Inference tensors have no version counter; they still run, and through the cache.
        with torch.inference_mode():
            gate_up = self.inputs["gate_up"].clone()
            down = self.inputs["down"].clone()
            first = mt.experts(self.inputs["x"], self.inputs["idx"], self.inputs["w"], gate_up, down)
            second = mt.experts(self.inputs["x"], self.inputs["idx"], self.inputs["w"], gate_up, down)
        self.assertTrue(torch.equal(first, second))
        ref, _ = run_reference(self.case, self.inputs)
        assert_matches(self, first, ref, self.case.dtype, "out in inference mode")

    def test_new_scales_rebuild_quantised_packs(self):
        # FP8 packs are dequantised with the scales but belong to the weights: writing the scales in place
        # must drop them too.
        case = Case(T=16, H=128, I=128, E=2, K=1, dtype=torch.bfloat16)
        inputs = make_inputs(case, 31)
        gate_up = (inputs["gate_up"].float() * 16).to(torch.float8_e4m3fn)
        down = (inputs["down"].float() * 16).to(torch.float8_e4m3fn)
        # UE8M0 scales (2^(b - 127)), with which the CPU packs dequantise: 2^-4 each.
        s1 = torch.full((case.E, 2, 1), 127 - 4, dtype=torch.uint8)
        s2 = torch.full((case.E, 1, 1), 127 - 4, dtype=torch.uint8)

        def run():
            with torch.no_grad():
                return mt.experts(inputs["x"], inputs["idx"], inputs["w"], gate_up, down, gate_up_proj_scale_inv=s1, down_proj_scale_inv=s2)

        first = run()
        s2.add_(1)  # 2^-3: doubles every output
        second = run()
        rel = ((second.double() - 2 * first.double()).norm() / (2 * first.double()).norm()).item()
        self.assertLess(rel, 1e-2, "the output ignored new down_proj scales")

    def test_entries_die_with_their_weights(self):
        gc.collect()
        before = len(mt._weights)
        gate_up = self.inputs["gate_up"].clone()
        down = self.inputs["down"].clone()
        self._run(gate_up, down, "grouped_mm")
        self._run(gate_up, down, "grouped_mm")
        self.assertEqual(len(mt._weights), before + 2, "one handle per weight tensor, reused across calls")
        del gate_up, down
        gc.collect()
        self.assertEqual(len(mt._weights), before, "handles outlived their weights")


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp4_codes_to_float(packed):
    """[..., K/2] int8 pairs (element 2j in the low nibble) -> [..., K] float64 e2m1 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)
    b = packed.view(torch.uint8).long()
    return torch.stack([table[b & 15], table[b >> 4]], dim=-1).flatten(-2)


def fp8_block_quantise(w):
    """[E, N, K] -> e4m3 codes and float32 scale_inv [E, ceil(N/128), ceil(K/128)] (amax / 448 per block)."""
    E, N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    padded = torch.zeros(E, nb * 128, kb * 128, dtype=torch.float64)
    padded[:, :N, :K] = w.double()
    blocks = padded.reshape(E, nb, 128, kb, 128)
    scale = (blocks.abs().amax(dim=(2, 4)) / 448).clamp(min=1e-12).float()
    codes = (blocks / scale.double()[:, :, None, :, None]).reshape(E, nb * 128, kb * 128)[:, :N, :K]
    return codes.to(torch.float8_e4m3fn), scale


def fp8_dequantise(codes, scale):
    expanded = scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return codes.double() * expanded[:, : codes.shape[1], : codes.shape[2]]


class QuantisedTest(unittest.TestCase):
    """FP8 / FP4 experts (DESIGN §3) through the op: that it hands the library the right bytes, dtypes and
    scales. The library quantises activations to e4m3 on the fly, so the product against dequantised
    weights is a few per cent off; a misread nibble or scale is off by order one."""

    tolerance = 0.08

    def _check(self, case, inputs, gate_up, down, s1, s2, ref_gate_up, ref_down, backend):
        with torch.no_grad():
            out = mt.experts(
                inputs["x"], inputs["idx"], inputs["w"], gate_up, down, backend=backend, gate_up_proj_scale_inv=s1, down_proj_scale_inv=s2
            )
        ref = reference_experts(inputs["x"].double(), inputs["idx"], inputs["w"].double(), ref_gate_up, ref_down)
        error = ((out.double() - ref).norm() / ref.norm()).item()
        self.assertLess(error, self.tolerance, f"rel. L2 error {error:.3g} against the dequantised weights")

    def test_fp8_block_scaled(self):
        case = Case(T=9, H=256, I=160, E=3, K=2, dtype=torch.bfloat16)
        inputs = make_inputs(case, 71)
        gate_up, s1 = fp8_block_quantise(inputs["gate_up"])
        down, s2 = fp8_block_quantise(inputs["down"])
        self.assertEqual(tuple(s1.shape), (3, 3, 2))
        ref_gate_up, ref_down = fp8_dequantise(gate_up, s1), fp8_dequantise(down, s2)
        for backend in ("batched_mm", "grouped_mm"):
            with self.subTest(backend=backend):
                self._check(case, inputs, gate_up, down, s1, s2, ref_gate_up, ref_down, backend)

    def test_fp4_packed(self):
        case = Case(T=7, H=64, I=96, E=3, K=2, dtype=torch.bfloat16)
        inputs = make_inputs(case, 72)
        g = torch.Generator().manual_seed(73)

        def weights(n, k):
            codes = torch.randint(0, 256, (case.E, n, k // 2), generator=g, dtype=torch.uint8).view(torch.int8)
            scales = (127 + torch.randint(-6, -2, (case.E, n, k // 32), generator=g)).to(torch.uint8)
            values = fp4_codes_to_float(codes) * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, 2)
            return codes, scales, values

        gate_up, s1, ref_gate_up = weights(2 * case.I, case.H)
        down, s2, ref_down = weights(case.H, case.I)
        scale_dtypes = [torch.uint8] + ([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else [])
        for backend in ("batched_mm", "grouped_mm"):
            for scale_dtype in scale_dtypes:
                with self.subTest(backend=backend, scale_dtype=scale_dtype):
                    self._check(case, inputs, gate_up, down, s1.view(scale_dtype), s2.view(scale_dtype), ref_gate_up, ref_down, backend)


class CompileTest(unittest.TestCase):
    def test_compile_fullgraph_forward_backward(self):
        case = Case(T=12, H=32, I=24, E=4, K=2, bias=True, is_transposed=True, is_concatenated=False, swiglu_limit=1.5)
        inputs = make_inputs(case, 3)

        def layer(x, idx, w, gate_up, down, b1, b2):
            out = mt.experts(
                x, idx, w, gate_up, down, gate_up_proj_bias=b1, down_proj_bias=b2, **op_kwargs(case, "grouped_mm")
            )
            return out * 2.0

        def run(fn):
            leaves = [inputs[k].clone().requires_grad_(True) for k in ("x", "w", "gate_up", "down", "b1", "b2")]
            x, w, gate_up, down, b1, b2 = leaves
            out = fn(x, inputs["idx"], w, gate_up, down, b1, b2)
            return (out,) + torch.autograd.grad(out, leaves, inputs["grad_out"])

        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        eager_results = run(layer)
        compiled_results = run(compiled)
        for name, got, want in zip(("out",) + GRAD_NAMES, compiled_results, eager_results):
            self.assertTrue(torch.equal(got, want), f"{name}: compiled differs from eager")


@unittest.skipUnless(HAS_CUDA, "no CUDA GPU")
class CudaCompileTest(unittest.TestCase):
    """torch.compile(mode="reduce-overhead") on CUDA: inductor with CUDA graphs around the op, as
    transformers' generate() compiles a decode step over a static cache."""

    def test_reduce_overhead_replays_cuda_graphs(self):
        from torch._dynamo.utils import counters

        case = Case(T=8, H=64, I=48, E=6, K=2, dtype=torch.bfloat16, sentinels=True)
        inputs = make_inputs(case, 91, "cuda")
        kwargs = op_kwargs(case, "grouped_mm")

        def layer(x, idx, w, gate_up, down):
            return mt.experts(x, idx, w, gate_up, down, **kwargs) * 2.0

        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
        weights = (inputs["gate_up"].detach(), inputs["down"].detach())
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            # Warm-up, recording, then replays, each with new activations and routing weights.
            for step in range(5):
                x = torch.randn(case.T, case.H, generator=g).to("cuda", case.dtype)
                w = torch.rand(case.T, case.K, generator=g).to("cuda", inputs["w"].dtype)
                got = compiled(x, inputs["idx"], w, *weights).clone()
                want = layer(x, inputs["idx"], w, *weights)
                self.assertTrue(torch.equal(got, want), f"step {step}: the compiled layer differs from eager")
        skips = dict(counters["inductor"])
        self.assertFalse({k: v for k, v in skips.items() if "cudagraph_skips" in k},
                         f"inductor did not use CUDA graphs: {skips}")


class ArgumentTest(unittest.TestCase):
    def setUp(self):
        self.case = Case(T=3, H=16, I=8, E=3)
        self.inputs = make_inputs(self.case, 5)

    def _call(self, **overrides):
        i = dict(self.inputs)
        kw = {k: overrides.pop(k) for k in list(overrides) if k not in i}
        i.update(overrides)
        return mt.experts(i["x"], i["idx"], i["w"], i["gate_up"], i["down"], **kw)

    def test_unknown_backend_lists_valid_ones(self):
        with self.assertRaises(moekit.Error) as e:
            self._call(backend="no_such_backend")
        message = str(e.exception)
        self.assertIn("no_such_backend", message)
        for name in CPU_BACKENDS:
            self.assertIn(name, message)

    def test_wrong_shape_names_the_tensor(self):
        with self.assertRaises(moekit.Error) as e:
            self._call(down=self.inputs["down"][:, :, :5].contiguous())
        self.assertIn("down_proj", str(e.exception))
        with self.assertRaises(moekit.Error) as e:
            self._call(w=self.inputs["w"][:2].contiguous())
        self.assertIn("top_k_weights", str(e.exception))

    def test_cuda_only_backend_on_cpu_gives_the_reason(self):
        infos = {b.name: b for b in mt.backends("cpu")}
        self.assertFalse(infos["deepgemm"].ok)
        self.assertTrue(infos["deepgemm"].reason)
        with self.assertRaises(moekit.Error) as e:
            self._call(backend="deepgemm")
        self.assertIn("deepgemm", str(e.exception))
        self.assertIn(infos["deepgemm"].reason, str(e.exception))

    def test_swiglu_alpha_needs_a_limit(self):
        with self.assertRaises(moekit.Error) as e:
            self._call(swiglu_alpha=1.702)
        self.assertIn("swiglu_limit", str(e.exception))

    def test_one_bias_only(self):
        # The C ABI's has_bias covers both projections: a lone bias gets a zero partner and no gradient.
        c = self.case
        for which in ("b1", "b2"):
            with self.subTest(bias=which):
                inputs = make_inputs(dataclasses.replace(c, bias=True), 6)
                inputs["b1" if which == "b2" else "b2"] = None
                bias = inputs[which].clone().requires_grad_(True)
                x = inputs["x"].clone().requires_grad_(True)
                name = "gate_up_proj_bias" if which == "b1" else "down_proj_bias"
                out = mt.experts(x, inputs["idx"], inputs["w"], inputs["gate_up"], inputs["down"], **{name: bias})
                grads = torch.autograd.grad(out, [x, bias], inputs["grad_out"])
                ref_x = inputs["x"].double().requires_grad_(True)
                ref_bias = inputs[which].double().requires_grad_(True)
                biases = {"b1": None, "b2": None, which: ref_bias}
                ref = reference_experts(ref_x, inputs["idx"], inputs["w"].double(), inputs["gate_up"].double(), inputs["down"].double(), biases["b1"], biases["b2"])
                ref_grads = torch.autograd.grad(ref, [ref_x, ref_bias], inputs["grad_out"].double())
                assert_matches(self, out, ref, c.dtype, "out")
                assert_matches(self, grads[0], ref_grads[0], c.dtype, "grad_hidden_states")
                assert_matches(self, grads[1], ref_grads[1], c.dtype, f"grad_{name}")

    def test_no_tokens(self):
        x = self.inputs["x"][:0].clone().requires_grad_(True)
        gate_up = self.inputs["gate_up"].clone().requires_grad_(True)
        out = mt.experts(x, self.inputs["idx"][:0], self.inputs["w"][:0], gate_up, self.inputs["down"])
        self.assertEqual(tuple(out.shape), (0, self.case.H))
        (grad,) = torch.autograd.grad(out.sum(), [gate_up])
        self.assertTrue(torch.all(grad == 0).item())

    def test_unsupported_dtype_names_the_tensor(self):
        with self.assertRaises(moekit.Error) as e:
            self._call(x=self.inputs["x"].double())
        self.assertIn("hidden_states", str(e.exception))

    def test_quantised_backward_is_refused(self):
        # FP8 weights with UE8M0 block scales (DESIGN §3): the forward runs, the backward says why not.
        c = self.case
        gate_up = self.inputs["gate_up"].to(torch.float8_e4m3fn)
        down = self.inputs["down"].to(torch.float8_e4m3fn)
        s1 = torch.full((c.E, 1, 1), 127, dtype=torch.uint8)  # 2^0
        s2 = torch.full((c.E, 1, 1), 127, dtype=torch.uint8)
        x = self.inputs["x"].clone().requires_grad_(True)
        out = mt.experts(x, self.inputs["idx"], self.inputs["w"], gate_up, down, gate_up_proj_scale_inv=s1, down_proj_scale_inv=s2)
        self.assertEqual(out.shape, x.shape)
        with self.assertRaises(moekit.Error) as e:
            out.sum().backward()
        self.assertIn("backward", str(e.exception))


class DirectCallTest(unittest.TestCase):
    """experts() calls the op's body itself where the dispatcher would only call it (no gradient, no
    tracing, plain tensors), and remembers weights' views and workspace sizes: the same answers as the
    dispatched op, and every change of the weights still seen."""

    def setUp(self):
        self.case = Case(T=6, H=32, I=16, E=4, K=2)
        self.inputs = make_inputs(self.case, 77)

    def _args(self, gate_up, down, backend="grouped_mm"):
        i = self.inputs
        return (i["x"], i["idx"], i["w"], gate_up, down, None, None, None, None, backend, "silu", True, False,
                True, 1.702, None, "none")

    def test_direct_call_equals_the_dispatched_op(self):
        gate_up = torch.nn.Parameter(self.inputs["gate_up"].clone())
        down = torch.nn.Parameter(self.inputs["down"].clone())
        for backend in CPU_BACKENDS:
            with self.subTest(backend=backend):
                args = self._args(gate_up, down, backend)
                with torch.no_grad():
                    self.assertTrue(mt._runs_directly(args[:9]))
                    direct = mt.experts(*args[:5], backend=backend)
                    dispatched = torch.ops.moekit.experts(*args)
                self.assertTrue(torch.equal(direct, dispatched))
                # With gradients wanted the call goes through the op and its autograd.
                self.assertFalse(mt._runs_directly(args[:9]))
                out = mt.experts(*args[:5], backend=backend)
                self.assertIsNotNone(out.grad_fn)
                self.assertTrue(torch.equal(out.detach(), direct))

    def test_fake_and_meta_tensors_go_through_the_op(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            i = {k: mode.from_tensor(v) if v is not None else None for k, v in self.inputs.items()}
            with torch.no_grad():
                out = mt.experts(i["x"], i["idx"], i["w"], i["gate_up"], i["down"])
        self.assertEqual(type(out).__name__, "FakeTensor")
        self.assertEqual(tuple(out.shape), (self.case.T, self.case.H))
        meta = {k: v.to("meta") if v is not None else None for k, v in self.inputs.items()}
        with torch.no_grad():
            out = mt.experts(meta["x"], meta["idx"], meta["w"], meta["gate_up"], meta["down"])
        self.assertTrue(out.is_meta)
        self.assertEqual(tuple(out.shape), (self.case.T, self.case.H))

    def test_remembered_views_follow_the_weights(self):
        gate_up = torch.nn.Parameter(self.inputs["gate_up"].clone())
        down = torch.nn.Parameter(self.inputs["down"].clone())

        def run():
            with torch.no_grad():
                return mt.experts(self.inputs["x"], self.inputs["idx"], self.inputs["w"], gate_up, down)

        def check(what):
            got = run()
            ref, _ = run_reference(self.case, dict(self.inputs, gate_up=gate_up.detach(), down=down.detach()))
            assert_matches(self, got, ref, self.case.dtype, what)
            return got

        first = check("out")
        self.assertTrue(torch.equal(run(), first))
        # New memory behind the same Parameter object (.data = ...), then an in-place write.
        gate_up.data = self.inputs["gate_up"].clone() * -2
        self.assertFalse(torch.equal(check("out after .data ="), first))
        with torch.no_grad():
            down.mul_(0.5)
        check("out after an in-place write")
        # A view of the weights (another object over the same storage), and the weights again.
        with torch.no_grad():
            of_view = mt.experts(self.inputs["x"], self.inputs["idx"], self.inputs["w"], gate_up[:], down[:])
        self.assertTrue(torch.equal(of_view, run()), "a view of the weights gave another result")

    def test_refusals_are_not_remembered(self):
        gate_up, down = self.inputs["gate_up"], self.inputs["down"]
        for _ in range(2):
            with self.assertRaises(moekit.Error) as e:
                with torch.no_grad():
                    mt.experts(self.inputs["x"], self.inputs["idx"], self.inputs["w"], gate_up, down, backend="deepgemm")
            self.assertIn("deepgemm", str(e.exception))


class PackageTest(unittest.TestCase):
    def test_version_and_names(self):
        self.assertEqual(moekit.__version__, "0.1.0")
        names = moekit.backend_names()
        for name in CPU_BACKENDS + ("deepgemm", "sonicmoe"):
            self.assertIn(name, names)
        infos = mt.backends("cpu")
        self.assertEqual([b.name for b in infos], names)
        for b in infos:
            if b.name in CPU_BACKENDS:
                self.assertTrue(b.ok, f"{b.name} should run on the CPU: {b.reason}")


if __name__ == "__main__":
    unittest.main()

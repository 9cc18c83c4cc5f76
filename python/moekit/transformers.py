"""moekit's experts backends inside Hugging Face transformers (DESIGN §9).

    import moekit.transformers
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit_grouped_mm")
    model.set_experts_implementation("moekit_batched_mm")

Importing this module registers moekit_eager, moekit_batched_mm, moekit_grouped_mm, moekit_deepgemm,
moekit_sonicmoe and moekit_deepgemm_megamoe (which refuses, with its reason, until moekit has expert
parallelism) in transformers' ExpertsInterface (transformers.integrations.moe) and in its
FP8ExpertsInterface (transformers.integrations.finegrained_fp8). transformers calls a backend as
fn(experts_module, hidden_states, top_k_index, top_k_weights); the function below reads the module's
weights and flags (the attributes use_experts_implementation sets) and runs moekit.torch.experts, which is
differentiable, so training works as well as inference.

How transformers 5.17's registry behaves, which is why no patching is needed:
- ExpertsInterface and FP8ExpertsInterface are GeneralInterfaces: `register(name, fn)` is a classmethod
  doing `cls._global_mapping.update({name: fn})`, so it adds new names and overwrites existing ones
  (transformers' own "grouped_mm", ...), and each of the two classes has its own `_global_mapping`.
- from_pretrained(experts_implementation=...) and set_experts_implementation(...) accept a name that is a
  key of either mapping (PreTrainedModel.get_correct_experts_implementation): registering is enough.
- An FP8 experts module looks its name up in FP8ExpertsInterface only and raises a KeyError for a name
  missing there, so every moekit name is registered in both; moekit itself says which backend runs which
  weight format.
- generate() switches "grouped_mm" (that exact string) to "batched_mm" for the decode phase on a GPU;
  register(override_builtin=True) binds those names to moekit, so that switch runs on moekit kernels.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers.activations import ACT2CLS
from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
from transformers.integrations.moe import ExpertsInterface

from . import Error
from . import torch as moekit_torch

# moekit's backends, each registered as "moekit_<backend>".
# deepgemm_megamoe is expert-parallel across GPUs; until moekit has it, its name runs nothing and says why.
BACKENDS = ("eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe", "deepgemm_megamoe")

# transformers' own names that register(override_builtin=True) binds to moekit's backend of the same name.
BUILTIN_NAMES = {
    ExpertsInterface: ("grouped_mm", "batched_mm", "deepgemm", "sonicmoe"),
    FP8ExpertsInterface: ("grouped_mm", "batched_mm", "deepgemm"),
}

# transformers' activation names (ACT2FN) that moekit runs, with moekit's name for each (DESIGN §2).
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
    "relu2": "relu2",
}


def _activation_class(name):
    entry = ACT2CLS[name]
    return entry[0] if isinstance(entry, tuple) else entry


# An experts module applies self.act_fn, an instance of the class ACT2FN makes for config.hidden_act: the
# class says what the module computes even where the activation came from another config field.
_ACTIVATION_BY_CLASS = {_activation_class(name): moekit_name for name, moekit_name in ACTIVATIONS.items()}


@dataclasses.dataclass(frozen=True)
class _Gate:
    """What an experts class's `_apply_gate` computes on the first projection's output."""

    concatenated: bool  # reads gate rows then up rows (chunk); False: interleaved g0, u0, g1, u1, ...
    alpha: str | None = None  # module attributes of the GPT-OSS clamped SwiGLU; None: act_fn(g) * u
    limit: str | None = None
    # FP8Experts: the clamped SwiGLU where the module's swiglu_alpha is set, act_fn(g) * u where neither it nor
    # `limit` is, and a clamped act_fn (not moekit's) where only `limit` is.
    fp8_experts: bool = False


# The gates moekit knows, by the function transformers defines (module, qualified name). Each was read in
# transformers 5.17's source; a gate not listed here is refused rather than guessed.
_GATES = {
    ("transformers.integrations.moe", "_default_apply_gate"): _Gate(concatenated=True),
    # gate, up = x[..., ::2], x[..., 1::2]; g = g.clamp(max=limit); u = u.clamp(-limit, limit);
    # (u + 1) * g * sigmoid(g * alpha): DESIGN §2's clamped variant, interleaved.
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts._apply_gate"):
        _Gate(concatenated=False, alpha="alpha", limit="limit"),
    # The same math on chunk(2) halves.
    ("transformers.models.openai_privacy_filter.modeling_openai_privacy_filter",
     "OpenAIPrivacyFilterExperts._apply_gate"): _Gate(concatenated=True, alpha="alpha", limit="limit"),
    ("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl", "MiniMaxM3VLExperts._apply_gate"):
        _Gate(concatenated=True, alpha="swiglu_alpha", limit="swiglu_limit"),
    ("transformers.integrations.finegrained_fp8", "FP8Experts._apply_gate"):
        _Gate(concatenated=True, alpha="swiglu_alpha", limit="swiglu_limit", fp8_experts=True),
}

# The block of FP8 weight scales moekit reads (DESIGN §3).
_FP8_BLOCK = 128


def _where(module):
    return f"moekit cannot run {type(module).__name__}"


@torch.compiler.assume_constant_result
def _known_gate(fn):
    """The _Gate of an `_apply_gate` function, or the reason moekit refuses it. torch.compile runs this as
    Python while tracing and keeps the result as a constant: dynamo does not trace reads of a function's
    __qualname__ faithfully (they compare unequal), which would refuse every module under compile."""
    key = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
    gate = _GATES.get(key)
    if gate is not None:
        return gate
    return (f"its gate {key[0]}.{key[1]} is not one moekit knows the math of; moekit runs act_fn(gate) * up "
            "(transformers' default _apply_gate) and GPT-OSS's clamped SwiGLU")


def _gate(module):
    fn = getattr(type(module), "_apply_gate", None)
    if fn is None:
        raise Error(f"{_where(module)}: it has has_gate = True but no _apply_gate (it was not decorated "
                    "with transformers' use_experts_implementation)")
    gate = _known_gate(fn)
    if isinstance(gate, str):
        raise Error(f"{_where(module)}: {gate}")
    if gate.fp8_experts:
        if getattr(module, "swiglu_alpha", None) is not None:
            return gate
        limit = getattr(module, "limit", None)
        if limit is not None:
            raise Error(f"{_where(module)}: with limit = {limit!r} and no swiglu_alpha its gate is "
                        "act_fn(gate.clamp(max=limit)) * up.clamp(-limit, limit), which is not one of moekit's "
                        "activations (the clamped SwiGLU it runs is GPT-OSS's, with swiglu_alpha)")
        return _Gate(concatenated=True)
    return gate


def _config_activation(module):
    config = getattr(module, "config", None)
    for field in ("hidden_activation", "hidden_act"):
        if getattr(config, field, None) is not None:
            return field, getattr(config, field)
    return "hidden_act", None


def _activation(module):
    act_fn = getattr(module, "act_fn", None)
    if act_fn is not None:
        found = _ACTIVATION_BY_CLASS.get(type(act_fn))
        if found is not None:
            return found
        # The config is read on this path only: a config attribute costs microseconds per decode step.
        field, name = _config_activation(module)
        raise Error(f"{_where(module)}: its activation act_fn = {type(act_fn).__name__} (config.{field} = "
                    f"{name!r}) is not one of moekit's; it runs {', '.join(ACTIVATIONS)}")
    field, name = _config_activation(module)
    if name not in ACTIVATIONS:
        raise Error(f"{_where(module)}: config.{field} = {name!r} is not one of moekit's activations; it runs "
                    f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _weight_format(module, weight):
    """moekit's weight_format for an FP8Experts module's weights (DESIGN §3), after its refusals."""
    if weight.dtype == torch.float8_e4m3fn:
        block = getattr(module, "block_size", None)
        if block is None or tuple(block) != (_FP8_BLOCK, _FP8_BLOCK):
            raise Error(f"{_where(module)}: block_size = {block!r}; moekit reads FP8 e4m3 weights with one scale "
                        f"per {_FP8_BLOCK} x {_FP8_BLOCK} block (weight_block_size [{_FP8_BLOCK}, {_FP8_BLOCK}])")
        return "fp8_e4m3"
    if weight.dtype == torch.int8:
        return "fp4_e2m1"  # two e2m1 values per byte, low nibble first, one UE8M0 scale per 32 along K
    raise Error(f"{_where(module)}: its quantised weights are {weight.dtype}; moekit runs FP8 e4m3 "
                "(float8_e4m3fn) and FP4 e2m1 packed in int8")


def _activation_dtype(weight, hidden_states):
    # transformers' own backends cast the activations to the weights' dtype (autocast can hand float32 to
    # bf16 experts); quantised weights keep the activations' dtype.
    return weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 else hidden_states.dtype


def experts_arguments(module, backend):
    """The keyword arguments of moekit.torch.experts (beside the three inputs) for a transformers experts
    module, or moekit.Error naming what moekit cannot run."""
    has_gate = bool(getattr(module, "has_gate", True))
    has_bias = bool(getattr(module, "has_bias", False))
    is_transposed = bool(getattr(module, "is_transposed", False))
    is_concatenated = bool(getattr(module, "is_concatenated", True))
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up, down = getattr(module, up_name, None), getattr(module, "down_proj", None)
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise Error(f"{_where(module)}: it has no {up_name} and down_proj tensors (has_gate = {has_gate})")
    # transformers' backends treat ids >= num_experts as expert-parallel sentinels, moekit ids >= the weights'
    # expert count: the two must agree (transformers' expert-parallel sharding keeps them equal).
    num_experts = getattr(module, "num_experts", up.shape[0])
    if num_experts != up.shape[0]:
        raise Error(f"{_where(module)}: num_experts = {num_experts} but {up_name} holds {up.shape[0]} experts "
                    f"(shape {list(up.shape)}); moekit's sentinel ids start at the weights' expert count")

    kwargs = dict(backend=backend, has_gate=has_gate, is_transposed=is_transposed,
                  is_concatenated=is_concatenated)
    if has_gate:
        gate = _gate(module)
        if gate.concatenated != is_concatenated:
            layout = "gate rows then up rows" if gate.concatenated else "interleaved gate and up rows"
            raise Error(f"{_where(module)}: is_concatenated = {is_concatenated} but its _apply_gate reads {layout}")
        if gate.alpha is not None:
            alpha, limit = getattr(module, gate.alpha, None), getattr(module, gate.limit, None)
            if alpha is None or limit is None:
                raise Error(f"{_where(module)}: its clamped SwiGLU needs {gate.alpha} and {gate.limit}, got "
                            f"{gate.alpha} = {alpha!r}, {gate.limit} = {limit!r}")
            kwargs.update(activation="silu", swiglu_alpha=float(alpha), swiglu_limit=float(limit))
        else:
            kwargs.update(activation=_activation(module))
    else:
        kwargs.update(activation=_activation(module))

    if has_bias:
        up_bias = getattr(module, up_name + "_bias", None)
        down_bias = getattr(module, "down_proj_bias", None)
        if up_bias is None or down_bias is None:
            raise Error(f"{_where(module)}: has_bias = True but {up_name}_bias = {type(up_bias).__name__}, "
                        f"down_proj_bias = {type(down_bias).__name__}")
        kwargs.update(gate_up_proj_bias=up_bias, down_proj_bias=down_bias)

    if not up.dtype.is_floating_point or up.element_size() == 1:
        scheme = getattr(module, "activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise Error(f"{_where(module)}: activation_scheme = {scheme!r}; moekit quantises activations on the "
                        "fly per token and 128-wide group (\"dynamic\"), it has no static activation scales")
        up_scale = getattr(module, up_name + "_scale_inv", None)
        down_scale = getattr(module, "down_proj_scale_inv", None)
        if up_scale is None or down_scale is None:
            raise Error(f"{_where(module)}: its weights are {up.dtype} but it has no {up_name}_scale_inv and "
                        "down_proj_scale_inv")
        weight_format = _weight_format(module, up)
        if weight_format == "fp8_e4m3":
            _check_fp8_scales(module, up_name, up, up_scale, has_gate)
            _check_fp8_scales(module, "down_proj", down, down_scale, False)
        kwargs.update(weight_format=weight_format, gate_up_proj_scale_inv=up_scale, down_proj_scale_inv=down_scale)
    return up, down, kwargs


def _check_fp8_scales(module, name, weight, scale, fused_gate_up):
    experts, rows, cols = weight.shape
    if fused_gate_up and (rows // 2) % _FP8_BLOCK != 0:
        # transformers loads per-expert gate_proj and up_proj with their own block scales and concatenates
        # them (FP8Experts' min_sf_out=2): with I not a multiple of 128 the halves' blocks are not 128-row
        # blocks of the fused rows, whatever the scale tensor's shape, so no moekit scale grid holds them
        # (moekit's own checkpoint loader refuses these experts for the same reason).
        raise Error(f"{_where(module)}: {name} {list(weight.shape)} has intermediate size {rows // 2}, not a "
                    f"multiple of {_FP8_BLOCK}: the gate and up halves have block scales of their own "
                    f"({name}_scale_inv {list(scale.shape)}), which {_FP8_BLOCK}-row blocks of the fused rows "
                    "cannot express; load the checkpoint dequantised (FineGrainedFP8Config(dequantize=True))")
    expected = (experts, -(-rows // _FP8_BLOCK), -(-cols // _FP8_BLOCK))
    if tuple(scale.shape) != expected:
        raise Error(f"{_where(module)}: {name}_scale_inv is {list(scale.shape)}, but moekit reads one scale per "
                    f"{_FP8_BLOCK} x {_FP8_BLOCK} block of {name} {list(weight.shape)}, {list(expected)}")


def _make_forward(backend):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        up, down, kwargs = experts_arguments(self, backend)
        dtype = _activation_dtype(up, hidden_states)
        x = hidden_states.to(dtype)
        # The contract takes routing weights in float32 or the activations' dtype.
        w = top_k_weights if top_k_weights.dtype in (torch.float32, dtype) else top_k_weights.float()
        # Looked up on the module at each call (not bound at import), so a wrapper around
        # moekit.torch.experts sees every call.
        out = moekit_torch.experts(x, top_k_index, w, up, down, **kwargs)
        return out.to(hidden_states.dtype)

    forward.__name__ = f"moekit_{backend}_experts_forward"
    forward.__qualname__ = forward.__name__
    forward.__doc__ = (f"transformers experts backend: runs the module through moekit's {backend} "
                       "(moekit.torch.experts); see moekit.transformers.")
    forward.moekit_backend = backend
    return forward


# One function per backend, the same object in both interfaces.
FORWARDS = {backend: _make_forward(backend) for backend in BACKENDS}

# transformers' own functions under the names override_builtin rebinds, as they were before moekit
# rebound them, so that register(override_builtin=False) can put them back.
_builtin_functions = {}


def is_moekit_forward(fn):
    """Whether fn is one of moekit's registered experts functions."""
    return getattr(fn, "moekit_backend", None) is not None and FORWARDS.get(fn.moekit_backend) is fn


def register(override_builtin=False):
    """Registers moekit_<backend> for every moekit backend in transformers' ExpertsInterface and
    FP8ExpertsInterface. override_builtin=True also binds transformers' own names (grouped_mm, batched_mm,
    deepgemm, sonicmoe; the FP8 interface's grouped_mm, batched_mm, deepgemm) to moekit's backend of the
    same name, so that a model loaded with experts_implementation="grouped_mm" and generate()'s decode switch
    to batched_mm run on moekit; override_builtin=False puts transformers' functions back where moekit had
    rebound them (names another library rebound are left alone). Called with False on import."""
    for interface, names in BUILTIN_NAMES.items():
        for backend in BACKENDS:
            interface.register(f"moekit_{backend}", FORWARDS[backend])
        for name in names:
            current = interface._global_mapping.get(name)
            if override_builtin:
                if not is_moekit_forward(current):
                    _builtin_functions[(interface, name)] = current
                interface.register(name, FORWARDS[name])
            elif is_moekit_forward(current) and (interface, name) in _builtin_functions:
                original = _builtin_functions.pop((interface, name))
                if original is None:  # a name this transformers did not have; GeneralInterface has no unregister
                    del interface._global_mapping[name]
                else:
                    interface.register(name, original)


register(override_builtin=False)

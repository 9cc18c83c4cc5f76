"""moekit's experts as a PyTorch op (DESIGN §9): `moekit.torch.experts(...)`.

`torch.library` custom ops carry the contract of DESIGN §2 and §2b:
- `moekit::experts` (the forward), with a fake kernel for torch.compile and autograd through
- `moekit::experts_backward`, moekit's own backward, itself an op with a fake kernel, so that a compiled
  graph's backward holds it as one node;
- `moekit::experts_training`, the forward where a gradient is recorded: it also returns the bytes the
  backend keeps for its backward (uint8; empty where it keeps nothing), which autograd hands to
- `moekit::experts_backward_saved`, the backward that reads them instead of recomputing.
All run on torch's current CUDA stream with workspace from torch's caching allocator and never wait for
the device (the `eager` backend excepted, DESIGN §2), so they can be captured in CUDA graphs.
"""

import contextlib
import dataclasses
import functools
import threading
import weakref
from typing import List, Optional, Tuple

import torch

from . import Error, _capi

Tensor = torch.Tensor

# The C dtype string of each torch dtype, by the role a tensor plays: the same byte means an FP4 pair in a
# weight and a power-of-two scale in a scale tensor (DESIGN §3).
_ACTIVATION_DTYPES = {
    torch.float32: b"f32",
    torch.float16: b"f16",
    torch.bfloat16: b"bf16",
}
_INDEX_DTYPES = {torch.int32: b"i32", torch.int64: b"i64"}
_WEIGHT_DTYPES = {
    **_ACTIVATION_DTYPES,
    torch.float8_e4m3fn: b"f8_e4m3",
    torch.int8: b"f4_e2m1",  # two e2m1 values per byte, element 2j in the low nibble
    torch.uint8: b"f4_e2m1",
}
_SCALE_DTYPES = {torch.float32: b"f32", torch.uint8: b"ue8m0"}
if hasattr(torch, "float8_e8m0fnu"):
    _SCALE_DTYPES[torch.float8_e8m0fnu] = b"ue8m0"

# Roles of the problem's tensors; the weights are the tensors whose derived data (CPU packs) is cached.
_ROLES = {
    "hidden_states": _ACTIVATION_DTYPES,
    "top_k_index": _INDEX_DTYPES,
    "top_k_weights": _ACTIVATION_DTYPES,
    "gate_up_proj": _WEIGHT_DTYPES,
    "down_proj": _WEIGHT_DTYPES,
    "gate_up_proj_bias": _ACTIVATION_DTYPES,
    "down_proj_bias": _ACTIVATION_DTYPES,
    "gate_up_proj_scale_inv": _SCALE_DTYPES,
    "down_proj_scale_inv": _SCALE_DTYPES,
    "out": _ACTIVATION_DTYPES,
    "grad_out": _ACTIVATION_DTYPES,
}

# The GPT-OSS checkpoints' alpha, also the C++ default (ExpertsConfig::swiglu_alpha).
_DEFAULT_SWIGLU_ALPHA = 1.702


def _device(t: Tensor, name: str) -> Tuple[int, int]:
    if t.is_cuda:
        return _capi.DEVICE_CUDA, t.get_device()
    if t.is_cpu:
        return _capi.DEVICE_CPU, 0
    raise Error(f"{name} is on {t.device}; moekit runs on cpu and cuda tensors")


def _c_dtype(t: Tensor, name: str) -> bytes:
    role = _ROLES[name]
    dtype = role.get(t.dtype)
    if dtype is None:
        valid = ", ".join(str(d) for d in role)
        raise Error(f"{name} has dtype {t.dtype}, which moekit does not take there; valid: {valid}")
    return dtype


_ABSENT = _capi.ABSENT  # data NULL: the C ABI's absent tensor


def _view(t: Optional[Tensor], name: str, storage=None) -> bytes:
    if t is None:
        return _ABSENT
    if t.dim() > _capi.MAX_DIMS:
        raise Error(f"{name} has {t.dim()} dimensions, more than any experts tensor: {tuple(t.shape)}")
    device_type, device_index = _device(t, name)
    return _capi.tensor(t.data_ptr(), t.shape, t.stride(), _c_dtype(t, name), device_type, device_index, storage)


class _StorageCache:
    """moekit_storage handles of weight tensors, so that the CPU backends pack each weight once rather than
    on every call (DESIGN §9, issue 35).

    Keyed by the tensor's whole storage (address, size, device): every view of one parameter shares one
    handle. An entry dies with the tensor it was made for (weakref.finalize), and remembers the tensor's
    `_version`, which in-place writes bump (an optimizer step under no_grad): a changed version tells the
    library to rebuild what it derived from the bytes. Writes that bypass the version counter (through
    `.data`, from outside torch, or into inference tensors, which have no counter) are not seen; call
    `invalidate_weights()` after those.
    """

    class _Entry:
        __slots__ = ("key", "handle", "owner", "owner_version", "seen_version", "finalizer")

    def __init__(self):
        self._entries = {}
        # id(tensor) -> the view last made of it while it owned its entry: a model passes the same
        # Parameter objects on every call, and rebuilding their views costs more than the kernel at 1 token.
        self._views = {}
        # Reentrant: a finalizer can run (garbage collection) while this thread holds the lock.
        self._lock = threading.RLock()

    def view(self, t: Tensor, name: str, modified: bool = False):
        """The C view of weight t with its handle, and whether its bytes changed since the last call."""
        key = id(t)
        cached = self._views.get(key)
        if cached is not None and not modified:
            ref, entry, data_ptr, shape, strides, version, view = cached
            # The same live tensor, still the owner of its entry, with the same memory, layout and version.
            if (ref() is t and entry.owner() is t and self._entries.get(entry.key) is entry and t.data_ptr() == data_ptr
                    and t.shape == shape and t.stride() == strides and _version(t) == version):
                return view, False
        handle, changed = self.handle(t, name, modified)
        result = _view(t, name, handle)
        entry = self._entries.get(_storage_key(t)) if handle is not None else None
        if entry is not None and entry.owner() is t:
            with self._lock:
                self._views[key] = (weakref.ref(t, functools.partial(self._drop_view, key)), entry, t.data_ptr(),
                                    t.shape, t.stride(), _version(t), result)
        return result, changed

    def _drop_view(self, key, ref):
        with self._lock:
            cached = self._views.get(key)
            if cached is not None and cached[0] is ref:
                del self._views[key]

    def handle(self, t: Tensor, name: str, modified: bool = False):
        """The handle for t's storage, telling the library the bytes changed when t's version moved on or
        when `modified` says so (the weights' packs also depend on their scales). Returns (handle, whether
        the bytes changed since the last call)."""
        key = _storage_key(t)
        if key is None:
            return None, False
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                owner = entry.owner()
                # The owner moved to other memory (set_, .data = ...) and this address now holds another
                # tensor's bytes: the entry describes memory it no longer knows.
                if owner is None or owner.untyped_storage().data_ptr() != key[0]:
                    self._forget(key, entry)
                    entry = None
            if entry is None:
                return self._create(key, t, name).handle, False
            # Views share their base's version counter, but an alias made with .data has its own: both the
            # owner's counter and the caller's are compared.
            owner_version = _version(owner)
            seen_version = _version(t)
            changed = owner_version != entry.owner_version or seen_version != entry.seen_version
            if changed or modified:
                _capi.storage_modified(entry.handle)
                entry.owner_version = owner_version
                entry.seen_version = seen_version
            return entry.handle, changed

    def _create(self, key, t, name):
        device_type, device_index = _device(t, name)
        entry = self._Entry()
        entry.key = key
        entry.handle = _capi.storage_create(key[0], key[1], device_type, device_index)
        entry.owner = weakref.ref(t)
        entry.owner_version = entry.seen_version = _version(t)
        entry.finalizer = weakref.finalize(t, self._drop, key, entry.handle)
        # At interpreter exit the library may already be unloading; the process frees everything anyway.
        entry.finalizer.atexit = False
        self._entries[key] = entry
        return entry

    def _forget(self, key, entry):
        if self._entries.get(key) is entry:
            del self._entries[key]
        # detach() answers None when the finalizer has run already: the handle is released then.
        if entry.finalizer.detach() is not None:
            _capi.storage_release(entry.handle)

    def _drop(self, key, handle):
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.handle == handle:
                del self._entries[key]
        _capi.storage_release(handle)

    def clear(self):
        with self._lock:
            self._views.clear()
            for key, entry in list(self._entries.items()):
                self._forget(key, entry)

    def __len__(self):
        return len(self._entries)


def _storage_key(t: Tensor):
    """What identifies t's whole storage (every view of one parameter shares it); None when empty."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    return (storage.data_ptr(), nbytes, t.device) if nbytes != 0 else None


def _version(t: Tensor):
    # Inference tensors (made under torch.inference_mode) have no version counter.
    return None if t.is_inference() else t._version


_weights = _StorageCache()


def invalidate_weights():
    """Forgets every weight's derived data (CPU packs): for weights written behind torch's back."""
    _weights.clear()


def _weight_view(t: Optional[Tensor], name: str, modified: bool = False):
    """The view of a weight, with its cached storage handle, and whether its bytes changed since last use."""
    if t is None:
        return _ABSENT, False
    return _weights.view(t, name, modified)


# The configuration's strings as the C ABI's bytes, encoded once.
_encoded = functools.lru_cache(maxsize=None)(str.encode)


def _problem(tensors, config) -> bytes:
    """The C problem of the ops' inputs: the nine tensors (hidden_states .. down_proj_scale_inv) and the
    configuration (activation .. weight_format), as the bytes of moekit_experts_problem, and the views."""
    (
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        gate_up_proj_bias,
        down_proj_bias,
        gate_up_proj_scale_inv,
        down_proj_scale_inv,
    ) = tensors
    # Packs of quantised weights are dequantised with their scales and attached to the weights' storage,
    # so new scales must drop the weights' packs too.
    up_scales, up_scales_changed = _weight_view(gate_up_proj_scale_inv, "gate_up_proj_scale_inv")
    down_scales, down_scales_changed = _weight_view(down_proj_scale_inv, "down_proj_scale_inv")
    views = (
        _view(hidden_states, "hidden_states"),
        _view(top_k_index, "top_k_index"),
        _view(top_k_weights, "top_k_weights"),
        _weight_view(gate_up_proj, "gate_up_proj", up_scales_changed)[0],
        _weight_view(down_proj, "down_proj", down_scales_changed)[0],
        _weight_view(gate_up_proj_bias, "gate_up_proj_bias")[0],
        _weight_view(down_proj_bias, "down_proj_bias")[0],
        up_scales,
        down_scales,
    )
    return _capi.problem(views, _config_bytes(config, gate_up_proj_bias is not None)), views


@functools.lru_cache(maxsize=1024)
def _config_bytes(config, has_bias: bool) -> bytes:
    activation, has_gate, is_transposed, is_concatenated, swiglu_alpha, swiglu_limit, weight_format = config
    return _capi.config(activation, has_gate, has_bias, is_transposed, is_concatenated, swiglu_limit, swiglu_alpha,
                        weight_format)


class _WorkspaceSizes:
    """Workspace bytes by problem signature, so that a call whose signature was seen before makes one C
    call, the forward or backward, which checks the problem and its workspace again itself. Only problems
    the backend said it runs are remembered; a new signature asks it first, with its reason when it cannot.
    The signature: backend, direction, configuration, the shapes and dtypes of the (contiguous) per-token
    inputs, and the weights' views whole (memory, layout, dtype, device: packed once per weight, so their
    bytes hash once)."""

    LIMIT = 4096  # signatures remembered; past it the table starts over (prefill sees a length per prompt)

    def __init__(self):
        self._bytes = {}

    def get(self, problem, views, backend: bytes, backward: bool, tensors, config) -> int:
        """The workspace bytes of the forward (backward False) or of the backward that recomputes."""
        return self._remembered(problem, views, backend, backward, tensors, config)

    def training(self, problem, views, backend: bytes, tensors, config) -> Tuple[int, int, int]:
        """(saved, forward workspace, backward workspace) bytes of a training step: the forward keeps `saved`
        bytes for the backward, which reads them in place of recomputing. saved is 0 where the backend keeps
        nothing, and where it has no backward for the problem: then the forward runs as in inference and the
        backward, when it comes, refuses with its reason."""
        return self._remembered(problem, views, backend, "training", tensors, config)

    def _remembered(self, problem, views, backend, direction, tensors, config):
        hidden_states, top_k_index, top_k_weights = tensors[:3]
        key = (backend, direction, config, hidden_states.shape, hidden_states.dtype, top_k_index.shape,
               top_k_index.dtype, top_k_weights.dtype, views[3:])
        value = self._bytes.get(key)
        if value is None:
            value = self._ask(problem, views, backend, direction, tensors, config)
            if len(self._bytes) >= self.LIMIT:
                self._bytes.clear()
            self._bytes[key] = value
        return value

    def _ask(self, problem, views, backend, direction, tensors, config):
        if direction == "training":
            saved = forward_ws = backward_ws = 0
            if _capi.experts_supports(problem, backend, True)[0]:
                saved, forward_ws, backward_ws = _capi.experts_saved_bytes(problem, backend)
            if saved == 0:
                forward_ws = self.get(problem, views, backend, False, tensors, config)
                backward_ws = 0
            return saved, forward_ws, backward_ws
        ok, reason = _capi.experts_supports(problem, backend, direction)
        if not ok:
            what = "the backward of " if direction else ""
            raise Error(f"moekit backend '{backend.decode()}' cannot run {what}this problem: {reason}")
        return _capi.experts_workspace_bytes(problem, backend, direction)


_workspace_sizes = _WorkspaceSizes()


def _inputs(hidden_states, top_k_index, top_k_weights, *weights):
    """The ops' nine tensors with the small per-token inputs made contiguous (the contract's layout); the
    weights are never copied: a non-contiguous weight is refused by the library, naming it."""
    return (hidden_states.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous(), *weights)


def _workspace(nbytes: int, device: torch.device):
    """A workspace of nbytes from torch's caching allocator and its address; (None, 0) for none."""
    if nbytes == 0:
        return None, 0
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return workspace, workspace.data_ptr()


def _stream(device: torch.device) -> int:
    # The calls queue on torch's current stream, so torch's allocator (which frees stream-ordered) and
    # CUDA graph capture both see the work where they expect it.
    if device.type == "cuda":
        return torch._C._cuda_getCurrentRawStream(device.index)
    return 0


_NO_GUARD = contextlib.nullcontext()


def _on_device(device: torch.device):
    # The library launches its kernels on the calling thread's current device: make it the tensors' one.
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        return torch.cuda.device(device)
    return _NO_GUARD


def _no_tokens(hidden_states: Tensor) -> bool:
    # An empty tensor's data pointer is NULL, which the C ABI reads as an absent tensor: a call with no
    # tokens (an expert-parallel rank that received none) is answered here, with nothing to compute.
    return hidden_states.dim() == 2 and hidden_states.shape[0] == 0


def _empty_like(t: Tensor) -> Tensor:
    # Gradients and outputs are contiguous in their input's shape and dtype (c_api.h).
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _experts_forward(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    gate_up_proj_bias: Optional[Tensor],
    down_proj_bias: Optional[Tensor],
    gate_up_proj_scale_inv: Optional[Tensor],
    down_proj_scale_inv: Optional[Tensor],
    backend: str,
    activation: str,
    has_gate: bool,
    is_transposed: bool,
    is_concatenated: bool,
    swiglu_alpha: float,
    swiglu_limit: Optional[float],
    weight_format: str,
) -> Tensor:
    return _run_forward(False, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                        gate_up_proj_bias, down_proj_bias, gate_up_proj_scale_inv, down_proj_scale_inv, backend,
                        activation, has_gate, is_transposed, is_concatenated, swiglu_alpha, swiglu_limit,
                        weight_format)[0]


def _run_forward(saving, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_bias,
                 down_proj_bias, gate_up_proj_scale_inv, down_proj_scale_inv, backend, *config):
    """The two forward ops' body: (out, saved), saved being, with `saving`, the bytes the backend keeps for
    its backward (uint8, empty where it keeps nothing), else None."""
    tensors = _inputs(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_bias,
                      down_proj_bias, gate_up_proj_scale_inv, down_proj_scale_inv)
    hidden_states = tensors[0]
    device = hidden_states.device
    out = _empty_like(hidden_states)
    if _no_tokens(hidden_states):
        return out, torch.empty(0, dtype=torch.uint8, device=device) if saving else None
    problem, views = _problem(tensors, config)
    name = _encoded(backend)
    saved = None
    if saving:
        saved_bytes, nbytes, _ = _workspace_sizes.training(problem, views, name, tensors, config)
        saved = torch.empty(saved_bytes, dtype=torch.uint8, device=device)
    else:
        nbytes = _workspace_sizes.get(problem, views, name, False, tensors, config)
    workspace, address = _workspace(nbytes, device)
    with _on_device(device):
        if saved is not None and saved.numel() > 0:
            _capi.experts_forward_saving(problem, name, _view(out, "out"), saved.data_ptr(), saved.numel(), address,
                                         nbytes, _stream(device))
        else:
            _capi.experts_forward(problem, name, _view(out, "out"), address, nbytes, _stream(device))
    del workspace  # freed stream-ordered after the queued call
    return out, saved


_experts_op = torch.library.custom_op("moekit::experts", _experts_forward, mutates_args=())


@_experts_op.register_fake
def _experts_fake(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *args):
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


@torch.library.custom_op("moekit::experts_training", mutates_args=())
def _experts_training_op(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    gate_up_proj_bias: Optional[Tensor],
    down_proj_bias: Optional[Tensor],
    gate_up_proj_scale_inv: Optional[Tensor],
    down_proj_scale_inv: Optional[Tensor],
    backend: str,
    activation: str,
    has_gate: bool,
    is_transposed: bool,
    is_concatenated: bool,
    swiglu_alpha: float,
    swiglu_limit: Optional[float],
    weight_format: str,
) -> Tuple[Tensor, Tensor]:
    """The forward of a training step: out, and the bytes the backend keeps for its backward (uint8, empty
    where it keeps nothing and recomputes), which moekit::experts_backward_saved reads."""
    return _run_forward(True, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                        gate_up_proj_bias, down_proj_bias, gate_up_proj_scale_inv, down_proj_scale_inv, backend,
                        activation, has_gate, is_transposed, is_concatenated, swiglu_alpha, swiglu_limit,
                        weight_format)


@_experts_training_op.register_fake
def _experts_training_fake(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *args):
    # How many bytes a backend keeps depends on the backend and the problem, which only the library knows:
    # to the tracer it is a size of its own.
    saved_bytes = torch.library.get_ctx().new_dynamic_size()
    return (torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            hidden_states.new_empty(saved_bytes, dtype=torch.uint8))


def _run_backward(grad_out, saved, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                  gate_up_proj_bias, down_proj_bias, gate_up_proj_scale_inv, down_proj_scale_inv, *config):
    """The two backward ops' body: from `saved` where it holds bytes, else recomputing the forward's rows."""
    grad_out = grad_out.contiguous()
    tensors = _inputs(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_bias,
                      down_proj_bias, gate_up_proj_scale_inv, down_proj_scale_inv)
    hidden_states, _, top_k_weights = tensors[:3]
    has_bias = gate_up_proj_bias is not None
    if _no_tokens(hidden_states):
        # No token reached a weight: their gradients are zero.
        return (
            _empty_like(hidden_states),
            _empty_like(top_k_weights),
            torch.zeros_like(gate_up_proj, memory_format=torch.contiguous_format),
            torch.zeros_like(down_proj, memory_format=torch.contiguous_format),
            torch.zeros_like(gate_up_proj_bias) if has_bias else hidden_states.new_empty(0),
            torch.zeros_like(down_proj_bias) if has_bias else hidden_states.new_empty(0),
        )
    backend, config = config[0], config[1:]
    # The backend says whether it runs this problem before any gradient is allocated.
    device = hidden_states.device
    problem, views = _problem(tensors, config)
    name = _encoded(backend)
    from_saved = saved is not None and saved.numel() > 0
    if from_saved:
        saved_bytes, _, nbytes = _workspace_sizes.training(problem, views, name, tensors, config)
        if saved.numel() != saved_bytes or saved.dtype != torch.uint8 or saved.device != device:
            raise Error(f"moekit::experts_backward_saved: saved is {saved.dtype} [{saved.numel()}] on {saved.device}, "
                        f"but backend '{backend}' keeps {saved_bytes} uint8 bytes on {device} for this problem: "
                        "pass what moekit::experts_training returned for the same inputs")
    else:
        nbytes = _workspace_sizes.get(problem, views, name, True, tensors, config)
    grads = [
        _empty_like(hidden_states),
        _empty_like(top_k_weights),
        _empty_like(gate_up_proj),
        _empty_like(down_proj),
        _empty_like(gate_up_proj_bias) if has_bias else hidden_states.new_empty(0),
        _empty_like(down_proj_bias) if has_bias else hidden_states.new_empty(0),
    ]
    grad_views = _capi.gradients((
        _view(grads[0], "hidden_states"),
        _view(grads[1], "top_k_weights"),
        _view(grads[2], "gate_up_proj"),
        _view(grads[3], "down_proj"),
        _view(grads[4], "gate_up_proj_bias") if has_bias else _ABSENT,
        _view(grads[5], "down_proj_bias") if has_bias else _ABSENT,
    ))
    workspace, address = _workspace(nbytes, device)
    with _on_device(device):
        if from_saved:
            _capi.experts_backward_saved(problem, name, _view(grad_out, "grad_out"), grad_views,
                                         saved.contiguous().data_ptr(), saved_bytes, address, nbytes, _stream(device))
        else:
            _capi.experts_backward(problem, name, _view(grad_out, "grad_out"), grad_views, address, nbytes,
                                   _stream(device))
    del workspace
    return tuple(grads)


@torch.library.custom_op("moekit::experts_backward", mutates_args=())
def _experts_backward_op(
    grad_out: Tensor,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    gate_up_proj_bias: Optional[Tensor],
    down_proj_bias: Optional[Tensor],
    gate_up_proj_scale_inv: Optional[Tensor],
    down_proj_scale_inv: Optional[Tensor],
    backend: str,
    activation: str,
    has_gate: bool,
    is_transposed: bool,
    is_concatenated: bool,
    swiglu_alpha: float,
    swiglu_limit: Optional[float],
    weight_format: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients for (hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_proj_bias,
    down_proj_bias), recomputing the forward's rows; the bias gradients are empty tensors when there are no
    biases."""
    return _run_backward(grad_out, None, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                         gate_up_proj_bias, down_proj_bias, gate_up_proj_scale_inv, down_proj_scale_inv, backend,
                         activation, has_gate, is_transposed, is_concatenated, swiglu_alpha, swiglu_limit,
                         weight_format)


@torch.library.custom_op("moekit::experts_backward_saved", mutates_args=())
def _experts_backward_saved_op(
    grad_out: Tensor,
    saved: Tensor,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    gate_up_proj_bias: Optional[Tensor],
    down_proj_bias: Optional[Tensor],
    gate_up_proj_scale_inv: Optional[Tensor],
    down_proj_scale_inv: Optional[Tensor],
    backend: str,
    activation: str,
    has_gate: bool,
    is_transposed: bool,
    is_concatenated: bool,
    swiglu_alpha: float,
    swiglu_limit: Optional[float],
    weight_format: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """moekit::experts_backward reading what moekit::experts_training kept (saved) for the same inputs; an
    empty `saved` (a backend that keeps nothing) recomputes."""
    return _run_backward(grad_out, saved, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                         gate_up_proj_bias, down_proj_bias, gate_up_proj_scale_inv, down_proj_scale_inv, backend,
                         activation, has_gate, is_transposed, is_concatenated, swiglu_alpha, swiglu_limit,
                         weight_format)


def _backward_fake(grad_out, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_bias,
                   down_proj_bias, *config):
    def like(t):
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    has_bias = gate_up_proj_bias is not None
    return (
        like(hidden_states),
        like(top_k_weights),
        like(gate_up_proj),
        like(down_proj),
        like(gate_up_proj_bias) if has_bias else hidden_states.new_empty(0),
        like(down_proj_bias) if has_bias else hidden_states.new_empty(0),
    )


_experts_backward_op.register_fake(_backward_fake)


@_experts_backward_saved_op.register_fake
def _experts_backward_saved_fake(grad_out, saved, *args):
    return _backward_fake(grad_out, *args)


_TENSOR_INPUTS = 9  # hidden_states .. down_proj_scale_inv, then the configuration
_CONFIG_INPUTS = 8  # backend .. weight_format


def _gradients(tensors, grads):
    """The autograd gradients of the ops' inputs from the backward op's six results."""
    g_hidden, g_weights, g_gate_up, g_down, g_gate_up_bias, g_down_bias = grads
    has_bias = tensors[5] is not None
    return (
        g_hidden,
        None,  # top_k_index is not differentiable
        g_weights,
        g_gate_up,
        g_down,
        g_gate_up_bias if has_bias else None,
        g_down_bias if has_bias else None,
        None,  # scales
        None,
    ) + (None,) * _CONFIG_INPUTS


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_TENSOR_INPUTS])
    ctx.config = inputs[_TENSOR_INPUTS:]


def _backward(ctx, grad_out):
    tensors = ctx.saved_tensors
    return _gradients(tensors, torch.ops.moekit.experts_backward(grad_out, *tensors, *ctx.config))


_experts_op.register_autograd(_backward, setup_context=_setup_context)


def _setup_training_context(ctx, inputs, output):
    # The kept bytes live as long as the graph's node: until the backward ran (or the graph is dropped).
    ctx.save_for_backward(output[1], *inputs[:_TENSOR_INPUTS])
    ctx.config = inputs[_TENSOR_INPUTS:]


def _training_backward(ctx, grad_out, _grad_saved):
    saved, *tensors = ctx.saved_tensors
    return _gradients(tensors, torch.ops.moekit.experts_backward_saved(grad_out, saved, *tensors, *ctx.config))


_experts_training_op.register_autograd(_training_backward, setup_context=_setup_training_context)


def _infer_weight_format(gate_up_proj: Tensor) -> str:
    if gate_up_proj.dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if gate_up_proj.dtype in (torch.int8, torch.uint8):
        return "fp4_e2m1"
    return "none"


def experts(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    *,
    backend: str = "grouped_mm",
    activation: str = "silu",
    has_gate: bool = True,
    is_transposed: bool = False,
    is_concatenated: bool = True,
    gate_up_proj_bias: Optional[Tensor] = None,
    down_proj_bias: Optional[Tensor] = None,
    swiglu_alpha: Optional[float] = None,
    swiglu_limit: Optional[float] = None,
    gate_up_proj_scale_inv: Optional[Tensor] = None,
    down_proj_scale_inv: Optional[Tensor] = None,
    weight_format: Optional[str] = None,
    save_activations: Optional[bool] = None,
) -> Tensor:
    """The experts of one MoE layer (DESIGN §2): for each token t,
    out[t] = sum_k top_k_weights[t, k] * (down_e . act(gate_up_e . x[t] + b1_e) + b2_e), e = top_k_index[t, k];
    ids >= E (the number of experts) are expert-parallel sentinels that contribute nothing.

    hidden_states [T, H] f32/f16/bf16; top_k_index [T, K] int32/int64; top_k_weights [T, K] f32 or the
    dtype of hidden_states; gate_up_proj [E, 2I, H] ([E, H, 2I] with is_transposed; up_proj [E, I, H] with
    has_gate=False); down_proj [E, H, I] ([E, I, H] transposed); biases [E, 2I] and [E, H].
    activation: silu, gelu, gelu_pytorch_tanh, relu, relu2; swiglu_limit (and swiglu_alpha, default 1.702)
    selects GPT-OSS's clamped SwiGLU. Quantised experts (DESIGN §3): float8_e4m3fn weights or int8/uint8
    packed FP4 pairs [E, N, K/2], with their *_scale_inv; weight_format None infers the format from the
    weights' dtype. Differentiable in hidden_states, top_k_weights, the weights and the biases (unquantised
    experts) through moekit's backward.

    save_activations (None: the process default, set_save_activations, initially True): where a gradient is
    recorded, let the backend keep what its backward would otherwise recompute. deepgemm and sonicmoe keep
    the float pre-activations z = x.gate_up^T + b1 (T*K * 2I * 4 bytes per layer, 0.81 GB at Qwen3-30B-A3B
    with 16,384 tokens) until the backward has run, which then skips its z product; the portable backends keep nothing.
    False recomputes z in the backward: less memory, a slower backward.
    """
    if swiglu_limit is None and swiglu_alpha is not None:
        raise Error("swiglu_alpha is given without swiglu_limit; the GPT-OSS clamped SwiGLU needs both (or only the limit)")
    if weight_format is None:
        weight_format = _infer_weight_format(gate_up_proj)
    # The C ABI has one has_bias for both projections (transformers' modules have both or neither); a
    # single bias gets a zero partner, whose gradient is dropped.
    if (gate_up_proj_bias is None) != (down_proj_bias is None):
        if gate_up_proj_bias is None:
            n = gate_up_proj.shape[1] if not is_transposed else gate_up_proj.shape[2]
            gate_up_proj_bias = down_proj_bias.new_zeros((gate_up_proj.shape[0], n))
        else:
            down_proj_bias = gate_up_proj_bias.new_zeros((down_proj.shape[0], hidden_states.shape[-1]))
    args = (
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        gate_up_proj_bias,
        down_proj_bias,
        gate_up_proj_scale_inv,
        down_proj_scale_inv,
        backend,
        activation,
        has_gate,
        is_transposed,
        is_concatenated,
        float(swiglu_alpha) if swiglu_alpha is not None else _DEFAULT_SWIGLU_ALPHA,
        float(swiglu_limit) if swiglu_limit is not None else None,
        weight_format,
    )
    if _runs_directly(args[:_TENSOR_INPUTS]):
        return _experts_forward(*args)
    if _save_activations if save_activations is None else save_activations:
        if _records_gradient(args[:_TENSOR_INPUTS]):
            return _experts_training_op(*args)[0]
    return _experts_op(*args)


_save_activations = True


def set_save_activations(enabled: bool) -> None:
    """The default of experts(save_activations=...) in this process, for callers that do not pass it (the
    transformers backends of moekit.transformers): False trades the backward's speed for the memory of the
    kept activations."""
    global _save_activations
    _save_activations = bool(enabled)


def _records_gradient(tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# Tensor types the op's body takes as they are: Parameter only marks a tensor as a module's weight.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _runs_directly(tensors) -> bool:
    """Whether experts() may call the op's body itself rather than through torch's dispatcher, which costs
    several times the kernels' time at one token. Only where the dispatcher would do nothing but call it:
    not while torch.compile traces, no torch function or dispatch mode (fake tensors, functionalisation,
    FlopCounterMode), no profiler (which names the op), no gradient to record, and plain cpu or cuda tensors
    (not fake, meta or other subclasses)."""
    if (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or torch._C._len_torch_dispatch_stack() != 0 or torch.autograd._profiler_enabled()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TENSORS or t.is_meta or (grad and t.requires_grad)):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    name: str
    ok: bool  # whether it runs on the device, in this build and on this machine
    reason: str  # why not, when it does not


def backends(device="cpu") -> List[BackendInfo]:
    """Every registered backend, with whether it runs on the device and why not."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
        device_type = _capi.DEVICE_CUDA
    elif device.type == "cpu":
        index, device_type = 0, _capi.DEVICE_CPU
    else:
        raise Error(f"moekit runs on cpu and cuda devices, not {device}")
    infos = []
    for name in _capi.backend_names():
        ok, reason = _capi.backend_supports_device(name, device_type, index)
        infos.append(BackendInfo(name, ok, reason))
    return infos


__all__ = ["BackendInfo", "backends", "experts", "invalidate_weights", "set_save_activations"]

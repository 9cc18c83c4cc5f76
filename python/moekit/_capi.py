"""ctypes bindings of moekit's C ABI (include/moekit/c_api.h).

The structures below mirror the header field for field; MOEKIT_C_ABI_VERSION guards them, so a library
of another version is refused at load rather than read with the wrong layout. Everything here takes plain
values (addresses, shapes, dtype strings): torch stays out of this module so that the bindings serve any
caller, and moekit.torch turns tensors into these values.
"""

import ctypes
import os
import struct

from . import Error

ABI_VERSION = 1  # MOEKIT_C_ABI_VERSION of the header these structures mirror
MAX_DIMS = 4  # MOEKIT_C_MAX_DIMS

DEVICE_CPU = 0
DEVICE_CUDA = 1

# Reasons and names are written into caller buffers and truncated to fit; backend reasons are one or two
# sentences, so this never cuts one short in practice.
_REASON_CAPACITY = 4096

LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib", "libmoekit_c.so")


class Tensor(ctypes.Structure):
    """moekit_tensor: a view (data pointer, shape, strides in elements) of memory the caller owns."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("ndim", ctypes.c_int32),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("dtype", ctypes.c_char_p),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
        ("storage", ctypes.c_void_p),
    ]


class ExpertsProblem(ctypes.Structure):
    """moekit_experts_problem: the tensors and configuration of one experts call (DESIGN §2, §3)."""

    _fields_ = [
        ("hidden_states", Tensor),
        ("top_k_index", Tensor),
        ("top_k_weights", Tensor),
        ("gate_up_proj", Tensor),
        ("down_proj", Tensor),
        ("gate_up_proj_bias", Tensor),
        ("down_proj_bias", Tensor),
        ("gate_up_proj_scale_inv", Tensor),
        ("down_proj_scale_inv", Tensor),
        ("activation", ctypes.c_char_p),
        ("has_gate", ctypes.c_int32),
        ("has_bias", ctypes.c_int32),
        ("is_transposed", ctypes.c_int32),
        ("is_concatenated", ctypes.c_int32),
        ("has_swiglu_limit", ctypes.c_int32),
        ("swiglu_limit", ctypes.c_float),
        ("swiglu_alpha", ctypes.c_float),
        ("reserved", ctypes.c_int32),
        ("weight_format", ctypes.c_char_p),
        ("activation_scheme", ctypes.c_char_p),
        ("block_size", ctypes.c_int64),
    ]


class ExpertsGradients(ctypes.Structure):
    """moekit_experts_gradients: where the backward writes each gradient (DESIGN §2b)."""

    _fields_ = [
        ("hidden_states", Tensor),
        ("top_k_weights", Tensor),
        ("gate_up_proj", Tensor),
        ("down_proj", Tensor),
        ("gate_up_proj_bias", Tensor),
        ("down_proj_bias", Tensor),
    ]


def _load():
    if not os.path.isfile(LIBRARY_PATH):
        raise ImportError(
            f"moekit's C library is missing: {LIBRARY_PATH} does not exist; install a built moekit package "
            "(./scripts/build.sh stages one under build*/python) rather than importing the source tree"
        )
    try:
        lib = ctypes.CDLL(LIBRARY_PATH)
    except OSError as e:
        raise ImportError(f"moekit's C library {LIBRARY_PATH} failed to load: {e}") from e

    lib.moekit_c_abi_version.argtypes = []
    lib.moekit_c_abi_version.restype = ctypes.c_int
    version = lib.moekit_c_abi_version()
    if version != ABI_VERSION:
        # Reading structs of another layout would pass garbage pointers to the kernels: refuse instead.
        raise ImportError(
            f"{LIBRARY_PATH} has C ABI version {version} but this moekit package was written for version "
            f"{ABI_VERSION}; install a package and library built together"
        )

    size_p = ctypes.POINTER(ctypes.c_size_t)
    int32_p = ctypes.POINTER(ctypes.c_int32)
    # Problems, tensors and gradients cross as the bytes of their structures (packed below): ctypes hands a
    # bytes object to a char* parameter as a pointer to its buffer, without a copy.
    problem_p = tensor_p = gradients_p = ctypes.c_char_p
    void_p = ctypes.c_void_p
    signatures = {
        "moekit_last_error": ([], ctypes.c_char_p),
        "moekit_backend_names": ([ctypes.c_char_p, ctypes.c_size_t, size_p], ctypes.c_int),
        "moekit_backend_supports_device": (
            [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, int32_p, ctypes.c_char_p, ctypes.c_size_t],
            ctypes.c_int,
        ),
        "moekit_experts_supports": (
            [problem_p, ctypes.c_char_p, ctypes.c_int32, int32_p, ctypes.c_char_p, ctypes.c_size_t],
            ctypes.c_int,
        ),
        "moekit_experts_workspace_bytes": ([problem_p, ctypes.c_char_p, ctypes.c_int32, size_p], ctypes.c_int),
        "moekit_experts_forward": (
            [problem_p, ctypes.c_char_p, tensor_p, void_p, ctypes.c_size_t, void_p],
            ctypes.c_int,
        ),
        "moekit_experts_backward": (
            [problem_p, ctypes.c_char_p, tensor_p, gradients_p, void_p, ctypes.c_size_t, void_p],
            ctypes.c_int,
        ),
        "moekit_experts_saved_bytes": ([problem_p, ctypes.c_char_p, size_p, size_p, size_p], ctypes.c_int),
        "moekit_experts_forward_saving": (
            [problem_p, ctypes.c_char_p, tensor_p, void_p, ctypes.c_size_t, void_p, ctypes.c_size_t, void_p],
            ctypes.c_int,
        ),
        "moekit_experts_backward_saved": (
            [problem_p, ctypes.c_char_p, tensor_p, gradients_p, void_p, ctypes.c_size_t, void_p, ctypes.c_size_t,
             void_p],
            ctypes.c_int,
        ),
        "moekit_storage_create": (
            [void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(void_p)],
            ctypes.c_int,
        ),
        "moekit_storage_modified": ([void_p], ctypes.c_int),
        "moekit_storage_release": ([void_p], None),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib


_lib = _load()


def last_error():
    message = _lib.moekit_last_error()
    return message.decode("utf-8", "replace") if message else "unknown error (moekit_last_error is empty)"


def check(status):
    """Raises moekit.Error with the library's message when a call returned non-zero."""
    if status != 0:
        raise Error(last_error())


def _encode(text):
    return text.encode("utf-8") if isinstance(text, str) else text


# The structures' bytes, packed with the struct module in native layout: one pack per tensor costs a
# fraction of building the ctypes structure, and a weight's view, packed once, is reused as it is.
# _TENSOR_LAYOUTS[ndim] packs (data, ndim, device_type, device_index, reserved, dtype, shape..., strides...,
# storage) with the unused dimensions zero.
_TENSOR_LAYOUTS = [
    struct.Struct(f"@P4iP{n}q{(MAX_DIMS - n) * 8}x{n}q{(MAX_DIMS - n) * 8}xP") for n in range(MAX_DIMS + 1)
]
TENSOR_BYTES = ctypes.sizeof(Tensor)
ABSENT = bytes(TENSOR_BYTES)  # data NULL: an absent tensor
# The fields of moekit_experts_problem after its nine tensors: activation .. block_size.
_CONFIG_LAYOUT = struct.Struct("@P5iffiPPq")
if any(l.size != TENSOR_BYTES for l in _TENSOR_LAYOUTS) or (
    9 * TENSOR_BYTES + _CONFIG_LAYOUT.size != ctypes.sizeof(ExpertsProblem)
    or 6 * TENSOR_BYTES != ctypes.sizeof(ExpertsGradients)
):
    raise ImportError("moekit's packed C structures do not match their ctypes declarations on this platform")

# C strings that outlive every call (dtype, activation and format names): the addresses of their buffers go
# into the packed structures, and the buffers are kept here.
_string_addresses = {}
_string_buffers = []


def c_string(text) -> int:
    """The address of a NUL-terminated copy of text that lives as long as the process."""
    address = _string_addresses.get(text)
    if address is None:
        buffer = ctypes.create_string_buffer(text.encode("utf-8") if isinstance(text, str) else text)
        _string_buffers.append(buffer)
        _string_addresses[text] = address = ctypes.addressof(buffer)
    return address


def tensor(data, shape, strides, dtype, device_type, device_index, storage=None) -> bytes:
    """A moekit_tensor view, as its bytes. dtype is a C dtype string ("f32", "bf16", "i64", "f8_e4m3", ...);
    strides are in elements; storage is a handle from storage_create (or None)."""
    ndim = len(shape)
    if ndim > MAX_DIMS or len(strides) != ndim:
        raise Error(
            f"a moekit tensor has at most {MAX_DIMS} dimensions and one stride per dimension, got shape "
            f"{tuple(shape)} and strides {tuple(strides)}"
        )
    return _TENSOR_LAYOUTS[ndim].pack(data, ndim, device_type, device_index, 0, c_string(dtype), *shape, *strides,
                                      storage or 0)


def config(activation, has_gate, has_bias, is_transposed, is_concatenated, swiglu_limit, swiglu_alpha,
           weight_format, activation_scheme="dynamic", block_size=0) -> bytes:
    """The configuration fields of moekit_experts_problem (activation .. block_size), as their bytes;
    swiglu_limit None is the unclamped activation."""
    return _CONFIG_LAYOUT.pack(c_string(activation), int(has_gate), int(has_bias), int(is_transposed),
                               int(is_concatenated), int(swiglu_limit is not None),
                               swiglu_limit if swiglu_limit is not None else 0.0, swiglu_alpha, 0,
                               c_string(weight_format), c_string(activation_scheme), block_size)


def problem(views, config_bytes) -> bytes:
    """moekit_experts_problem from its nine tensor views (hidden_states .. down_proj_scale_inv) and its
    configuration, all as bytes."""
    return b"".join(views) + config_bytes


def gradients(views) -> bytes:
    """moekit_experts_gradients from its six views (hidden_states .. down_proj_bias)."""
    return b"".join(views)


def backend_names():
    needed = ctypes.c_size_t(0)
    check(_lib.moekit_backend_names(None, 0, ctypes.byref(needed)))
    buffer = ctypes.create_string_buffer(needed.value)
    check(_lib.moekit_backend_names(buffer, needed.value, ctypes.byref(needed)))
    return [name for name in buffer.value.decode("utf-8").split("\n") if name]


def backend_supports_device(backend, device_type, device_index):
    """(ok, reason): whether the backend runs on this device in this build and on this machine."""
    ok = ctypes.c_int32(0)
    reason = ctypes.create_string_buffer(_REASON_CAPACITY)
    check(
        _lib.moekit_backend_supports_device(
            _encode(backend), device_type, device_index, ctypes.byref(ok), reason, _REASON_CAPACITY
        )
    )
    return bool(ok.value), reason.value.decode("utf-8", "replace")


def experts_supports(problem, backend, backward):
    """(ok, reason) for running the problem forward or backward; raises if the problem breaks the contract."""
    ok = ctypes.c_int32(0)
    reason = ctypes.create_string_buffer(_REASON_CAPACITY)
    check(
        _lib.moekit_experts_supports(
            problem, _encode(backend), int(backward), ctypes.byref(ok), reason, _REASON_CAPACITY
        )
    )
    return bool(ok.value), reason.value.decode("utf-8", "replace")


def experts_workspace_bytes(problem, backend, backward):
    size = ctypes.c_size_t(0)
    check(_lib.moekit_experts_workspace_bytes(problem, _encode(backend), int(backward), ctypes.byref(size)))
    return size.value


def experts_forward(problem, backend, out, workspace, workspace_bytes, stream):
    """Writes out ([T, H], contiguous). workspace and stream are addresses (0 for none / the default stream)."""
    check(
        _lib.moekit_experts_forward(
            problem, _encode(backend), out, workspace or None, workspace_bytes, stream or None
        )
    )


def experts_backward(problem, backend, grad_out, grads, workspace, workspace_bytes, stream):
    check(
        _lib.moekit_experts_backward(
            problem,
            _encode(backend),
            grad_out,
            grads,
            workspace or None,
            workspace_bytes,
            stream or None,
        )
    )


def experts_saved_bytes(problem, backend):
    """(saved, forward workspace, backward workspace) bytes of a training step that keeps activations: what
    the forward keeps for the backward (0 where the backend recomputes), the workspace of the forward that
    keeps them and of the backward that reads them. Raises, with the reason, where the backend has no
    backward for the problem."""
    saved, forward_ws, backward_ws = ctypes.c_size_t(0), ctypes.c_size_t(0), ctypes.c_size_t(0)
    check(_lib.moekit_experts_saved_bytes(problem, _encode(backend), ctypes.byref(saved), ctypes.byref(forward_ws),
                                          ctypes.byref(backward_ws)))
    return saved.value, forward_ws.value, backward_ws.value


def experts_forward_saving(problem, backend, out, saved, saved_bytes, workspace, workspace_bytes, stream):
    """experts_forward that also writes saved_bytes bytes at address saved for experts_backward_saved."""
    check(
        _lib.moekit_experts_forward_saving(
            problem, _encode(backend), out, saved or None, saved_bytes, workspace or None, workspace_bytes,
            stream or None
        )
    )


def experts_backward_saved(problem, backend, grad_out, grads, saved, saved_bytes, workspace, workspace_bytes, stream):
    """experts_backward reading what experts_forward_saving kept for the same problem and inputs."""
    check(
        _lib.moekit_experts_backward_saved(
            problem, _encode(backend), grad_out, grads, saved or None, saved_bytes, workspace or None,
            workspace_bytes, stream or None
        )
    )


def storage_create(data, nbytes, device_type, device_index):
    """A handle registering [data, data + nbytes) so that derived data (packed weights) outlives a call."""
    handle = ctypes.c_void_p()
    check(_lib.moekit_storage_create(data, nbytes, device_type, device_index, ctypes.byref(handle)))
    return handle.value


def storage_modified(handle):
    check(_lib.moekit_storage_modified(handle))


def storage_release(handle):
    _lib.moekit_storage_release(handle)

"""ggml's ABI, in one place: its libraries, the signatures of the functions called, the
struct layouts and protocol constants mirrored from its headers, and their self-checks.

llama.h does not give out everything the package needs from ggml (a context's CPU backend,
its RPC backend, graphs of our own), so :mod:`.graph`, :mod:`.cpu_attention` and :mod:`.rpc`
call ggml directly, through :data:`lib`. Upgrading llama-cpp-python means checking this
module (and ``native/``): :func:`check_layouts` says which mirrored layout moved.

The libraries are those llama-cpp-python ships (or the folder ``LLAMA_CPP_LIB_PATH`` names,
as llama_cpp itself reads it), by the names libllama links: on Linux the sonames
(``libggml-base.so.0``), since the wheel's unversioned names are copies, which would load a
second ggml with a registry and an abort callback of its own. Whatever cannot be loaded or
found is :class:`Unavailable`, in one line; its callers fall back (the engine turns flash
attention off; a worker warns) or refuse in words.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import sys
from pathlib import Path

_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_sz, _cp, _bool = ctypes.c_size_t, ctypes.c_char_p, ctypes.c_bool


class Unavailable(RuntimeError):
    """A ggml library, function or layout that is not as this module expects (one line)."""


class InitParams(ctypes.Structure):  # struct ggml_init_params, passed by value
    _fields_ = [("mem_size", _sz), ("mem_buffer", _p), ("no_alloc", _bool)]


# ---- constants mirrored from ggml's headers ----

TYPE_F32, TYPE_I32 = 0, 26                  # enum ggml_type
SORT_ORDER_ASC = 0                          # enum ggml_sort_order
DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 3  # enum ggml_backend_dev_type
# struct ggml_backend_device_i (ggml-backend-impl.h), in pointers from the start of a
# device (its first member): checked by _check_device.
DEVICE_GET_NAME, DEVICE_GET_TYPE, DEVICE_INIT_BACKEND = 0, 3, 5
# struct ggml_backend: a guid pointer, then struct ggml_backend_i (get_name first,
# graph_compute 13th), then the device; in pointers: checked by _check_backend.
BACKEND_GET_NAME, BACKEND_GRAPH_COMPUTE, BACKEND_DEVICE = 1, 13, 17
# struct ggml_tensor (ggml.h): type (padded to 8 bytes), buffer, ne[4], nb[4], op; in
# bytes: checked by _check_tensor.
TENSOR_NE, TENSOR_OP = 16, 80
# The RPC protocol (ggml-rpc.h, ggml-rpc.cpp) of this llama.cpp: checked against a worker
# by rpc.probe, which refuses one that answers otherwise.
RPC_PROTOCOL = (7, 0)      # RPC_PROTO_MAJOR_VERSION, RPC_PROTO_MINOR_VERSION
RPC_MAX_SERVERS = 16       # GGML_RPC_MAX_SERVERS
RPC_CMD_HELLO = 14         # RPC_CMD_HELLO (fixed across versions)
RPC_CMD_DEVICE_COUNT = 15  # RPC_CMD_DEVICE_COUNT
RPC_CONN_CAPS = 24         # RPC_CONN_CAPS_SIZE: the HELLO request's size

INIT_BACKEND = ctypes.CFUNCTYPE(_p, _p, _cp)     # a device's init_backend(dev, params)
GET_NAME = ctypes.CFUNCTYPE(_cp, _p)             # a device's or a backend's get_name
GET_TYPE = ctypes.CFUNCTYPE(_i, _p)              # a device's get_type
GRAPH_COMPUTE = ctypes.CFUNCTYPE(_i, _p, _p)     # a backend's graph_compute(backend, graph)
RPC_ADD_SERVER = ctypes.CFUNCTYPE(_p, _cp)       # ggml_backend_rpc_add_server(endpoint)
RPC_START_SERVER = ctypes.CFUNCTYPE(None, _cp, _cp, _sz, _sz, ctypes.POINTER(_p))

# Every function called: name -> (library, result type, argument types). Graph operations
# take the ggml_context first.
SIGNATURES = {
    # the backend registry and devices (libggml and libggml-base)
    "ggml_backend_reg_by_name": ("ggml", _p, [_cp]),
    "ggml_backend_register": ("ggml", None, [_p]),
    "ggml_backend_dev_count": ("ggml", _sz, []),
    "ggml_backend_dev_get": ("ggml", _p, [_sz]),
    "ggml_backend_dev_by_name": ("ggml", _p, [_cp]),
    "ggml_backend_dev_by_type": ("ggml", _p, [_i]),
    "ggml_backend_reg_get_proc_address": ("ggml-base", _p, [_p, _cp]),
    "ggml_backend_reg_dev_count": ("ggml-base", _sz, [_p]),
    "ggml_backend_reg_dev_get": ("ggml-base", _p, [_p, _sz]),
    "ggml_backend_reg_name": ("ggml-base", _cp, [_p]),
    "ggml_backend_dev_name": ("ggml-base", _cp, [_p]),
    "ggml_backend_dev_description": ("ggml-base", _cp, [_p]),
    "ggml_backend_dev_type": ("ggml-base", _i, [_p]),
    "ggml_backend_dev_backend_reg": ("ggml-base", _p, [_p]),
    "ggml_backend_dev_memory": ("ggml-base", None, [_p, ctypes.POINTER(_sz),
                                                    ctypes.POINTER(_sz)]),
    "ggml_backend_dev_supports_op": ("ggml-base", _bool, [_p, _p]),
    "ggml_backend_buft_get_device": ("ggml-base", _p, [_p]),
    "ggml_backend_name": ("ggml-base", _cp, [_p]),
    "ggml_backend_free": ("ggml-base", None, [_p]),
    "ggml_backend_graph_compute": ("ggml-base", _i, [_p, _p]),
    "ggml_set_abort_callback": ("ggml-base", _p, [_p]),
    # the CPU backend
    "ggml_backend_cpu_set_use_ref": ("ggml-cpu", None, [_p, _bool]),
    "ggml_graph_compute_with_ctx": ("ggml-cpu", _i, [_p, _p, _i]),
    # contexts, tensors and graphs of our own
    "ggml_init": ("ggml-base", _p, [InitParams]),
    "ggml_free": ("ggml-base", None, [_p]),
    "ggml_tensor_overhead": ("ggml-base", _sz, []),
    "ggml_graph_overhead_custom": ("ggml-base", _sz, [_sz, _bool]),
    "ggml_new_graph": ("ggml-base", _p, [_p]),
    "ggml_new_graph_custom": ("ggml-base", _p, [_p, _sz, _bool]),
    "ggml_new_tensor_1d": ("ggml-base", _p, [_p, _i, _i64]),
    "ggml_new_tensor_4d": ("ggml-base", _p, [_p, _i, _i64, _i64, _i64, _i64]),
    "ggml_build_forward_expand": ("ggml-base", None, [_p, _p]),
    "ggml_graph_n_nodes": ("ggml-base", _i, [_p]),
    "ggml_graph_node": ("ggml-base", _p, [_p, _i]),
    "ggml_get_data": ("ggml-base", _p, [_p]),
    "ggml_nelements": ("ggml-base", _i64, [_p]),
    "ggml_op_desc": ("ggml-base", _cp, [_p]),
    "ggml_op_name": ("ggml-base", _cp, [_i]),
    "ggml_set_name": ("ggml-base", _p, [_p, _cp]),
    "ggml_set_output": ("ggml-base", None, [_p]),
    "ggml_backend_alloc_ctx_tensors_from_buft": ("ggml-base", _p, [_p, _p]),
    "ggml_backend_buffer_free": ("ggml-base", None, [_p]),
    "ggml_backend_tensor_set": ("ggml-base", None, [_p, _p, _sz, _sz]),
    "ggml_backend_tensor_get": ("ggml-base", None, [_p, _p, _sz, _sz]),
    # operations (graph.py's sampler, cpu_attention's probe graph)
    "ggml_reshape_1d": ("ggml-base", _p, [_p, _p, _i64]),
    "ggml_reshape_2d": ("ggml-base", _p, [_p, _p, _i64, _i64]),
    "ggml_view_1d": ("ggml-base", _p, [_p, _p, _i64, _sz]),
    "ggml_soft_max_ext": ("ggml-base", _p, [_p, _p, _p, _f, _f]),
    "ggml_top_k": ("ggml-base", _p, [_p, _p, _i]),
    "ggml_argsort": ("ggml-base", _p, [_p, _p, _i]),
    "ggml_get_rows": ("ggml-base", _p, [_p, _p, _p]),
    "ggml_set_rows": ("ggml-base", _p, [_p, _p, _p, _p]),
    "ggml_cumsum": ("ggml-base", _p, [_p, _p]),
    "ggml_sum": ("ggml-base", _p, [_p, _p]),
    "ggml_pad_ext": ("ggml-base", _p, [_p, _p] + [_i] * 8),
    "ggml_scale_bias": ("ggml-base", _p, [_p, _p, _f, _f]),
    "ggml_clamp": ("ggml-base", _p, [_p, _p, _f, _f]),
    "ggml_add": ("ggml-base", _p, [_p, _p, _p]),
    "ggml_mul": ("ggml-base", _p, [_p, _p, _p]),
    "ggml_div": ("ggml-base", _p, [_p, _p, _p]),
    "ggml_log": ("ggml-base", _p, [_p, _p]),
    "ggml_step": ("ggml-base", _p, [_p, _p]),
    "ggml_flash_attn_ext": ("ggml-base", _p, [_p, _p, _p, _p, _p, _f, _f, _f]),
}


# ---- the libraries ----

def library_folder() -> Path:
    """Where llama.cpp's libraries are: ``LLAMA_CPP_LIB_PATH`` (as llama_cpp reads it),
    else llama_cpp's own ``lib`` folder (found without importing llama_cpp)."""
    folder = os.environ.get("LLAMA_CPP_LIB_PATH")
    if folder:
        return Path(folder)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("llama-cpp-python is not installed")
    return Path(spec.submodule_search_locations[0]) / "lib"


def file_names(stem: str, platform: str = sys.platform) -> list[str]:
    """The names a library ``stem`` (``ggml-base``) may have, the one libllama links first."""
    if platform == "darwin":
        return [f"lib{stem}.0.dylib", f"lib{stem}.dylib"]
    if platform.startswith("win"):
        return [f"{stem}.dll", f"lib{stem}.dll"]
    return [f"lib{stem}.so.0", f"lib{stem}.so"]


@functools.cache
def library(stem: str) -> ctypes.CDLL:
    """The loaded library ``stem``; Unavailable in one line if it is missing or does not
    load."""
    folder = library_folder()
    for name in file_names(stem):
        if (folder / name).exists():
            try:
                return ctypes.CDLL(str(folder / name))
            except OSError as exc:
                raise Unavailable(f"llama.cpp's {name} in {folder} does not load "
                                  f"({exc})") from None
    raise Unavailable(f"llama.cpp's lib{stem} is not in {folder} (looked for "
                      f"{', '.join(file_names(stem))})")


class _Functions:
    """ggml's functions by name without the ``ggml_`` prefix (``lib.backend_dev_name``),
    each looked up and typed on first use from :data:`SIGNATURES`."""

    def __getattr__(self, name: str):
        symbol = f"ggml_{name}"
        if symbol not in SIGNATURES:
            raise AttributeError(f"{symbol} is not in ggml.SIGNATURES")
        stem, restype, argtypes = SIGNATURES[symbol]
        try:
            function = getattr(library(stem), symbol)
        except AttributeError:
            raise Unavailable(f"this llama.cpp's lib{stem} has no {symbol}") from None
        function.restype, function.argtypes = restype, argtypes
        setattr(self, name, function)
        return function


lib = _Functions()


def rpc_proc(name: str, signature):
    """A function of ggml's RPC registry, reached as llama.cpp's own ``--rpc`` reaches it;
    Unavailable where llama.cpp has no RPC backend or the registry lacks it."""
    registry = lib.backend_reg_by_name(b"RPC")
    address = registry and lib.backend_reg_get_proc_address(registry, name.encode())
    if not address:
        raise Unavailable(f"this llama.cpp has no {name}")
    return signature(address)


# ---- the layouts, checked ----

def cpu_device() -> int:
    device = lib.backend_dev_by_type(DEVICE_CPU)
    if not device:
        raise Unavailable("llama.cpp has no CPU device")
    return device


def device_table(device: int) -> ctypes.Array:
    return (_p * (DEVICE_INIT_BACKEND + 1)).from_address(device)


def backend_table(backend: int) -> ctypes.Array:
    return (_p * (BACKEND_DEVICE + 1)).from_address(backend)


@functools.cache
def check_layouts() -> None:
    """Unavailable, naming every mirrored layout that is not where this module expects it
    (the device's and the backend's interface tables, a tensor's fields); run once, before
    anything is written through them."""
    moved = []
    for check in (_check_device, _check_backend, _check_tensor):
        try:
            check()
        except Unavailable as exc:
            moved.append(str(exc))
    if moved:
        raise Unavailable("; ".join(moved))


def _check_device() -> None:
    device = cpu_device()
    table = device_table(device)
    if not all(table[i] for i in (DEVICE_GET_NAME, DEVICE_GET_TYPE, DEVICE_INIT_BACKEND)):
        raise Unavailable("the CPU device's interface table has empty entries")
    if (GET_NAME(table[DEVICE_GET_NAME])(device) != lib.backend_dev_name(device)
            or GET_TYPE(table[DEVICE_GET_TYPE])(device) != lib.backend_dev_type(device)):
        raise Unavailable("the CPU device's get_name and get_type entries moved")
    with _cpu_backend(device) as backend:
        if lib.backend_name(backend) != b"CPU":
            raise Unavailable("the CPU device's init_backend entry makes no CPU backend")


def _check_backend() -> None:
    """The backend's table: its device and its name answer as ggml says, and ggml's own
    ``ggml_backend_graph_compute`` calls the entry taken for graph_compute (a spy put there
    for one sum, then the original back), which computes the sum."""
    device = cpu_device()
    with _cpu_backend(device) as backend:
        table = backend_table(backend)
        if (table[BACKEND_DEVICE] != device
                or GET_NAME(table[BACKEND_GET_NAME])(backend) != lib.backend_name(backend)):
            raise Unavailable("the CPU backend's get_name and device entries moved")
        original, called = table[BACKEND_GRAPH_COMPUTE], []

        def spy(backend, graph):
            called.append(graph)
            return GRAPH_COMPUTE(original)(backend, graph)

        spy_entry = GRAPH_COMPUTE(spy)
        with _graph(alloc=True) as (ctx, graph):
            a, b = (lib.new_tensor_1d(ctx, TYPE_F32, 4) for _ in range(2))
            for tensor, values in ((a, (1, 2, 3, 4)), (b, (10, 20, 30, 40))):
                ctypes.memmove(lib.get_data(tensor), (_f * 4)(*values), 16)
            total = lib.add(ctx, a, b)
            lib.build_forward_expand(graph, total)
            table[BACKEND_GRAPH_COMPUTE] = ctypes.cast(spy_entry, _p).value
            try:
                status = lib.backend_graph_compute(backend, graph)
            finally:
                table[BACKEND_GRAPH_COMPUTE] = original
            result = list((_f * 4).from_address(lib.get_data(total)))
        if called != [graph] or status != 0 or result != [11, 22, 33, 44]:
            raise Unavailable("the CPU backend's graph_compute entry moved")


def _check_tensor() -> None:
    """A tensor's ne and op, read at their offsets, against what ggml says of them."""
    with _graph(alloc=False) as (ctx, graph):
        a = lib.new_tensor_4d(ctx, TYPE_F32, 3, 5, 7, 2)
        total = lib.add(ctx, a, a)
        ne = list((_i64 * 4).from_address(total + TENSOR_NE))
        op = _i.from_address(total + TENSOR_OP).value
        if ne != [3, 5, 7, 2] or ne[0] * ne[1] * ne[2] * ne[3] != lib.nelements(total):
            raise Unavailable("ggml's tensors hold their sizes (ne) elsewhere")
        # ggml_op_name indexes a table by op: only a value in range is asked about
        if not 0 <= op < 256 or lib.op_name(op) != b"ADD" or lib.op_desc(total) != b"ADD":
            raise Unavailable("ggml's tensors hold their operation (op) elsewhere")


@contextlib.contextmanager
def _cpu_backend(device: int):
    """A CPU backend made through the device's own init_backend entry, freed after."""
    backend = INIT_BACKEND(device_table(device)[DEVICE_INIT_BACKEND])(device, None)
    if not backend:
        raise Unavailable("the CPU device's init_backend entry makes no backend")
    try:
        yield backend
    finally:
        lib.backend_free(backend)


@contextlib.contextmanager
def _graph(alloc: bool):
    """A small context of our own and a graph in it; ``alloc``: tensors with data."""
    ctx = lib.init(InitParams(16 * 2**20, None, not alloc))
    if not ctx:
        raise Unavailable("ggml_init made no context")
    try:
        yield ctx, lib.new_graph(ctx)
    finally:
        lib.free(ctx)

"""Flash attention on the CPU that computes every row the same way, whatever the batch.

ggml's CPU flash attention (ggml-cpu/ops.cpp) has three paths: a query row that meets 512 or
more cached keys alone is split over the threads (chunks of ``keys / threads``, then a
reduction: the result depends on the thread count); batches of 64 rows or more go through a
tiled kernel (another rounding); everything else takes the one-row reference path. So with
flash attention on, a token's logits depended on how its batch was formed and on the
threads, and the engine used to turn flash attention off.

The backend's ``use_ref`` flag sends every row through the reference path: a row's result
then depends on neither the batch nor the threads, and a token decoded alone or verified
in a batch of drafted tokens gets the same logits bit for bit (tests/test_speculative.py).
It is set per CPU backend (``ggml_backend_cpu_set_use_ref``), and llama.h does not give out
the backend of a context. A context makes its CPU backend through the CPU device's
``init_backend`` entry (``ggml_backend_init_by_type`` -> ``ggml_backend_dev_init`` ->
``dev->iface.init_backend``), and that device is a static struct holding a copy of its
interface table. So, while :func:`reference_attention` is active (under a lock, around the
creation of one context), that entry is a wrapper that sets ``use_ref`` on the backends it
makes, and then the original comes back. The table's layout (``struct
ggml_backend_device_i`` in ggml-backend-impl.h) is checked before anything is written: its
``get_name`` and ``get_type`` entries have to answer as the exported
``ggml_backend_dev_name`` and ``ggml_backend_dev_type`` do, and its ``init_backend`` entry
has to make a backend named "CPU". Where any of that fails, :func:`reference_attention`
raises :class:`Unavailable` and nothing is written.

A :class:`Switch` turns the flag off and on again between decodes: the tiled kernel is faster
for a prompt's whole chunks, which the engine always evaluates alone and the same way, so
they need no more than that.

An RPC worker (``adaptive-llama rpc-worker``) computes the layers it holds with CPU backends
of its own, which the host cannot switch. :func:`worker_attention` gives them the same rule
from what each graph holds: the backends it makes (for the worker's whole life) run every
graph through the reference kernel, except a graph whose flash attention has ``CHUNK`` rows
or more, which runs as llama.cpp would (the tiled kernel). The host keeps every other batch
under ``CHUNK`` rows, so that only its whole prompt chunks are that large, and worker and
host compute every row alike. The rows are read from the graph's first flash attention node
(``ggml_graph_node``, and the node's ``op`` and ``ne`` from ``struct ggml_tensor`` in ggml.h,
checked against ``ggml_op_desc`` and ``ggml_nelements``); the backend's ``graph_compute``
entry (``struct ggml_backend_i``) is checked like the device's entries.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from pathlib import Path

import llama_cpp

_vp = ctypes.c_void_p
_INIT_BACKEND = ctypes.CFUNCTYPE(_vp, _vp, ctypes.c_char_p)
_GET_NAME = ctypes.CFUNCTYPE(ctypes.c_char_p, _vp)
_GET_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, _vp)
_GRAPH_COMPUTE = ctypes.CFUNCTYPE(ctypes.c_int, _vp, _vp)
# Entries of struct ggml_backend_device_i, in pointers from the start of the device struct
# (its first member).
GET_NAME, GET_TYPE, INIT_BACKEND = 0, 3, 5
_DEVICE_CPU = 0  # enum ggml_backend_dev_type
# struct ggml_backend: a guid pointer, then struct ggml_backend_i (get_name first,
# graph_compute 13th), then the device; in pointers from the start.
BACKEND_GET_NAME, BACKEND_GRAPH_COMPUTE, BACKEND_DEVICE = 1, 13, 17
# struct ggml_tensor: type (padded to 8 bytes), buffer, ne[4], nb[4], op; in bytes.
TENSOR_NE, TENSOR_OP = 16, 80
# A worker's graph runs the tiled kernel from this many flash attention rows: the engine's
# prompt chunk (runtime.batching.CHUNK, which test_speculative checks against it).
TILED_ROWS = 64


class Unavailable(RuntimeError):
    """llama.cpp's CPU device is not laid out as this module expects."""


class _CpuDevice:
    """The CPU device's interface table, checked, and the functions around it."""

    def __init__(self):
        # By the sonames llama.cpp links: the wheel's unversioned names are copies, which
        # would be a second ggml with a CPU device of its own.
        folder = Path(llama_cpp.__file__).parent / "lib"
        ggml = ctypes.CDLL(str(folder / "libggml.so.0"))
        base = ctypes.CDLL(str(folder / "libggml-base.so.0"))
        cpu = ctypes.CDLL(str(folder / "libggml-cpu.so.0"))
        for lib, name, args, res in (
                (ggml, "ggml_backend_dev_by_type", [ctypes.c_int], _vp),
                (base, "ggml_backend_dev_name", [_vp], ctypes.c_char_p),
                (base, "ggml_backend_dev_type", [_vp], ctypes.c_int),
                (base, "ggml_backend_name", [_vp], ctypes.c_char_p),
                (base, "ggml_backend_free", [_vp], None),
                (base, "ggml_graph_n_nodes", [_vp], ctypes.c_int),
                (base, "ggml_graph_node", [_vp, ctypes.c_int], _vp),
                (base, "ggml_op_desc", [_vp], ctypes.c_char_p),
                (base, "ggml_nelements", [_vp], ctypes.c_int64),
                (cpu, "ggml_backend_cpu_set_use_ref", [_vp, ctypes.c_bool], None)):
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise Unavailable(f"this llama.cpp has no {name}") from None
            fn.argtypes, fn.restype = args, res
            setattr(self, name.removeprefix("ggml_"), fn)
        self.device = self.backend_dev_by_type(_DEVICE_CPU)
        if not self.device:
            raise Unavailable("llama.cpp has no CPU device")
        self.table = (_vp * (INIT_BACKEND + 1)).from_address(self.device)
        self.original = self.table[INIT_BACKEND]
        self._check_layout()
        self.wrapper = _INIT_BACKEND(self._init_backend)
        self.made: list[int] = []  # the backends the wrapper set use_ref on
        self.on_backend = None  # a worker's hook for each backend made (worker_attention)
        self._flash_op: int | None = None  # ggml_op's FLASH_ATTN_EXT, once a node showed it

    def _check_layout(self) -> None:
        dev = self.device
        if not all(self.table[i] for i in (GET_NAME, GET_TYPE, INIT_BACKEND)):
            raise Unavailable("the CPU device's interface table has empty entries")
        if (_GET_NAME(self.table[GET_NAME])(dev) != self.backend_dev_name(dev)
                or _GET_TYPE(self.table[GET_TYPE])(dev) != self.backend_dev_type(dev)):
            raise Unavailable("the CPU device's interface table is laid out otherwise")
        backend = _INIT_BACKEND(self.original)(dev, None)
        try:
            if not backend or self.backend_name(backend) != b"CPU":
                raise Unavailable("the CPU device's init_backend entry makes no CPU backend")
        finally:
            if backend:
                self.backend_free(backend)

    def attention_rows(self, graph) -> int:
        """The rows (tokens) of the graph's first flash attention node; 0 without one."""
        for i in range(self.graph_n_nodes(graph)):
            node = self.graph_node(graph, i)
            if ctypes.c_int.from_address(node + TENSOR_OP).value == self._flash_attention_op(node):
                return ctypes.c_int64.from_address(node + TENSOR_NE + 2 * 8).value
        return 0

    def _flash_attention_op(self, node) -> int:
        """ggml_op's number of FLASH_ATTN_EXT, learnt from the first node that is one, with
        the node's layout checked (-1 until then)."""
        if self._flash_op is None and self.op_desc(node) == b"FLASH_ATTN_EXT":
            ne = (ctypes.c_int64 * 4).from_address(node + TENSOR_NE)
            if ne[0] * ne[1] * ne[2] * ne[3] != self.nelements(node):
                raise Unavailable("ggml's tensors are laid out otherwise")
            self._flash_op = ctypes.c_int.from_address(node + TENSOR_OP).value
        return -1 if self._flash_op is None else self._flash_op

    def _init_backend(self, dev, params):
        backend = _INIT_BACKEND(self.original)(dev, params)
        if backend:
            self.backend_cpu_set_use_ref(backend, True)
            self.made.append(backend)
            if self.on_backend is not None:
                self.on_backend(backend)
        return backend


class _RowRule:
    """A worker's CPU backend: before each graph, the reference kernel for fewer than
    TILED_ROWS flash attention rows, llama.cpp's own choice from that many (see the module
    docstring)."""

    def __init__(self, device: _CpuDevice, backend: int):
        self.device = device
        self.table = (_vp * (BACKEND_DEVICE + 1)).from_address(backend)
        if (self.table[BACKEND_DEVICE] != device.device
                or _GET_NAME(self.table[BACKEND_GET_NAME])(backend)
                != device.backend_name(backend)):
            raise Unavailable("the CPU backend's interface table is laid out otherwise")
        self.original = _GRAPH_COMPUTE(self.table[BACKEND_GRAPH_COMPUTE])
        self.wrapper = _GRAPH_COMPUTE(self._graph_compute)
        self.use_ref = True
        self.table[BACKEND_GRAPH_COMPUTE] = ctypes.cast(self.wrapper, _vp).value

    def use_ref_for(self, graph) -> bool:
        return self.device.attention_rows(graph) < TILED_ROWS

    def _graph_compute(self, backend, graph):
        use_ref = self.use_ref_for(graph)
        if use_ref != self.use_ref:
            self.device.backend_cpu_set_use_ref(backend, use_ref)
            self.use_ref = use_ref
        return self.original(backend, graph)


class Switch:
    """The reference kernel of one context's CPU backends, on or off between decodes."""

    def __init__(self, backends: list[int]):
        self._backends = list(backends)
        self._set = _cpu_device().backend_cpu_set_use_ref
        self.on = True  # as reference_attention made them

    def set(self, on: bool) -> None:
        if on != self.on:
            for backend in self._backends:
                self._set(backend, on)
            self.on = on


_lock = threading.Lock()


@functools.cache
def _cpu_device() -> _CpuDevice:
    return _CpuDevice()


class _GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _vp), ("no_alloc", ctypes.c_bool)]


@functools.cache
def _ggml_base():
    """libggml-base, with the functions that build a graph."""
    base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so.0"))
    base.ggml_init.argtypes, base.ggml_init.restype = [_GgmlInitParams], _vp
    base.ggml_free.argtypes = [_vp]
    base.ggml_new_tensor_4d.argtypes = [_vp, ctypes.c_int] + [ctypes.c_int64] * 4
    base.ggml_new_tensor_4d.restype = _vp
    base.ggml_flash_attn_ext.argtypes = [_vp] * 5 + [ctypes.c_float] * 3
    base.ggml_flash_attn_ext.restype = _vp
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [_vp], _vp
    base.ggml_build_forward_expand.argtypes = [_vp, _vp]
    return base


@contextlib.contextmanager
def attention_graph(rows: int):
    """A graph (no data) whose one node is flash attention over ``rows`` query rows of a
    32-cell cache: what a worker reads the rows of."""
    base = _ggml_base()
    ctx = base.ggml_init(_GgmlInitParams(16 * 2**20, None, True))
    try:
        f32 = 0  # GGML_TYPE_F32
        q = base.ggml_new_tensor_4d(ctx, f32, 64, rows, 2, 1)  # head size, rows, heads
        k, v = (base.ggml_new_tensor_4d(ctx, f32, 64, 32, 2, 1) for _ in range(2))
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(
            graph, base.ggml_flash_attn_ext(ctx, q, k, v, None, 0.125, 0.0, 0.0))
        yield graph
    finally:
        base.ggml_free(ctx)


def _check_graph_reading(device: _CpuDevice) -> None:
    """Unavailable where a graph's flash attention rows do not read back as built."""
    with attention_graph(5) as graph:
        rows = device.attention_rows(graph)
    if rows != 5:
        raise Unavailable(f"a graph's flash attention rows read as {rows}, not 5")


def worker_attention() -> list[_RowRule]:
    """For the rest of this process (an RPC worker): the CPU backends llama.cpp makes follow
    the engine's rule by the rows of each graph (see the module docstring). Returns the list
    that fills with them as they are made. :class:`Unavailable` where llama.cpp is not laid
    out as expected (nothing changed)."""
    device = _cpu_device()
    _check_graph_reading(device)
    probe = _INIT_BACKEND(device.original)(device.device, None)
    try:
        _RowRule(device, probe)  # checks the backend's table (then freed with it)
    finally:
        device.backend_free(probe)
    rules: list[_RowRule] = []
    _lock.acquire()  # held for good: no engine in this process makes a context
    device.on_backend = lambda backend: rules.append(_RowRule(device, backend))
    device.table[INIT_BACKEND] = ctypes.cast(device.wrapper, _vp).value
    return rules


@contextlib.contextmanager
def reference_attention():
    """Inside: the CPU backends llama.cpp makes use ggml's reference kernels (see the module
    docstring); yields the list of the backends made, for a :class:`Switch`. Raises
    :class:`Unavailable` (nothing changed) where llama.cpp is not laid out as expected."""
    device = _cpu_device()
    with _lock:
        device.made = []
        device.table[INIT_BACKEND] = ctypes.cast(device.wrapper, _vp).value
        try:
            yield device.made
        finally:
            device.table[INIT_BACKEND] = device.original

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
makes, and then the original comes back. The tables' layouts (``struct
ggml_backend_device_i`` and ``struct ggml_backend_i`` in ggml-backend-impl.h, ``struct
ggml_tensor`` in ggml.h) are checked before anything is written (:func:`.ggml.check_layouts`:
each entry used has to answer as ggml's exported functions do, ``graph_compute`` has to
compute a sum). Where any of that fails, :func:`reference_attention` raises
:class:`Unavailable` and nothing is written.

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
(``ggml_graph_node``, and the node's ``op`` and ``ne`` from ``struct ggml_tensor``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

from . import ggml
from .ggml import (
    BACKEND_GRAPH_COMPUTE,
    DEVICE_INIT_BACKEND,
    GRAPH_COMPUTE,
    INIT_BACKEND,
    TENSOR_NE,
    TENSOR_OP,
    Unavailable,
)

# A worker's graph runs the tiled kernel from this many flash attention rows: the engine's
# prompt chunk (runtime.batching.CHUNK, which test_speculative checks against it).
TILED_ROWS = 64


class _CpuDevice:
    """The CPU device's interface table, its layout checked (ggml.check_layouts), and the
    wrapper of its init_backend entry."""

    def __init__(self):
        ggml.check_layouts()
        lib = ggml.lib
        self.set_use_ref = lib.backend_cpu_set_use_ref  # Unavailable here if it has none
        self.device = ggml.cpu_device()
        self.table = ggml.device_table(self.device)
        self.original = self.table[DEVICE_INIT_BACKEND]
        self.wrapper = INIT_BACKEND(self._init_backend)
        self.made: list[int] = []  # the backends the wrapper set use_ref on
        self.on_backend = None  # a worker's hook for each backend made (worker_attention)
        self._flash_op: int | None = None  # ggml_op's FLASH_ATTN_EXT, once a node showed it

    def attention_rows(self, graph) -> int:
        """The rows (tokens) of the graph's first flash attention node; 0 without one."""
        lib = ggml.lib
        for i in range(lib.graph_n_nodes(graph)):
            node = lib.graph_node(graph, i)
            if ctypes.c_int.from_address(node + TENSOR_OP).value == self._flash_attention_op(node):
                return ctypes.c_int64.from_address(node + TENSOR_NE + 2 * 8).value
        return 0

    def _flash_attention_op(self, node) -> int:
        """ggml_op's number of FLASH_ATTN_EXT, learnt from the first node that is one (-1
        until then)."""
        if self._flash_op is None and ggml.lib.op_desc(node) == b"FLASH_ATTN_EXT":
            self._flash_op = ctypes.c_int.from_address(node + TENSOR_OP).value
        return -1 if self._flash_op is None else self._flash_op

    def _init_backend(self, dev, params):
        backend = INIT_BACKEND(self.original)(dev, params)
        if backend:
            self.set_use_ref(backend, True)
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
        self.table = ggml.backend_table(backend)
        self.original = GRAPH_COMPUTE(self.table[BACKEND_GRAPH_COMPUTE])
        self.wrapper = GRAPH_COMPUTE(self._graph_compute)
        self.use_ref = True
        self.table[BACKEND_GRAPH_COMPUTE] = ctypes.cast(self.wrapper, ctypes.c_void_p).value

    def use_ref_for(self, graph) -> bool:
        return self.device.attention_rows(graph) < TILED_ROWS

    def _graph_compute(self, backend, graph):
        use_ref = self.use_ref_for(graph)
        if use_ref != self.use_ref:
            self.device.set_use_ref(backend, use_ref)
            self.use_ref = use_ref
        return self.original(backend, graph)


class Switch:
    """The reference kernel of one context's CPU backends, on or off between decodes."""

    def __init__(self, backends: list[int]):
        self._backends = list(backends)
        self._set = _cpu_device().set_use_ref
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


@contextlib.contextmanager
def attention_graph(rows: int):
    """A graph (no data) whose one node is flash attention over ``rows`` query rows of a
    32-cell cache: what a worker reads the rows of."""
    lib = ggml.lib
    ctx = lib.init(ggml.InitParams(16 * 2**20, None, True))
    try:
        q = lib.new_tensor_4d(ctx, ggml.TYPE_F32, 64, rows, 2, 1)  # head size, rows, heads
        k, v = (lib.new_tensor_4d(ctx, ggml.TYPE_F32, 64, 32, 2, 1) for _ in range(2))
        graph = lib.new_graph(ctx)
        lib.build_forward_expand(graph, lib.flash_attn_ext(ctx, q, k, v, None, 0.125, 0.0,
                                                           0.0))
        yield graph
    finally:
        lib.free(ctx)


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
    rules: list[_RowRule] = []
    _lock.acquire()  # held for good: no engine in this process makes a context
    device.on_backend = lambda backend: rules.append(_RowRule(device, backend))
    device.table[DEVICE_INIT_BACKEND] = ctypes.cast(device.wrapper, ctypes.c_void_p).value
    return rules


@contextlib.contextmanager
def reference_attention():
    """Inside: the CPU backends llama.cpp makes use ggml's reference kernels (see the module
    docstring); yields the list of the backends made, for a :class:`Switch`. Raises
    :class:`Unavailable` (nothing changed) where llama.cpp is not laid out as expected."""
    device = _cpu_device()
    with _lock:
        device.made = []
        device.table[DEVICE_INIT_BACKEND] = ctypes.cast(device.wrapper, ctypes.c_void_p).value
        try:
            yield device.made
        finally:
            device.table[DEVICE_INIT_BACKEND] = device.original

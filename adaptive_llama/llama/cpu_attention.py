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
# Entries of struct ggml_backend_device_i, in pointers from the start of the device struct
# (its first member).
GET_NAME, GET_TYPE, INIT_BACKEND = 0, 3, 5
_DEVICE_CPU = 0  # enum ggml_backend_dev_type


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

    def _init_backend(self, dev, params):
        backend = _INIT_BACKEND(self.original)(dev, params)
        if backend:
            self.backend_cpu_set_use_ref(backend, True)
            self.made.append(backend)
        return backend


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

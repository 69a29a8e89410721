"""ctypes bindings of the C library built from ``native/adaptive.c`` when the package installs.

:func:`load` returns the library, or ``None`` with the reason when it was not built (no C
compiler at install time) or does not load; callers decide what falls back and say so.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
import weakref
from pathlib import Path

import numpy as np

LIBRARY_STEM = "_adaptive_native"
INVALID_LOGITS = -2  # al_adaptive_*: NaN, +inf, or every logit -inf


class InvalidLogits(ValueError):
    """The C kernel found logits it cannot use (the caller says which and where)."""


class Stats(ctypes.Structure):
    """Mirror of ``al_stats``: the figures of one decision."""

    _fields_ = [
        ("k", ctypes.c_int32),
        ("token", ctypes.c_int32),
        ("kept_mass", ctypes.c_double),
        ("entropy", ctypes.c_double),
        ("conf", ctypes.c_double),
        ("p_chosen", ctypes.c_double),
        ("n_tokens", ctypes.c_int64),
        ("n_fallbacks", ctypes.c_int64),
    ]


def _library_path() -> Path | None:
    # A build of our own (`make asan`: AddressSanitizer) can stand in for the installed one.
    override = os.environ.get("ADAPTIVE_LLAMA_NATIVE_LIB")
    if override:
        return Path(override)
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{LIBRARY_STEM}{suffix}"
        if candidate.exists():
            return candidate
    return None


def _declare(lib: ctypes.CDLL) -> None:
    vp, sz, dbl, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_double, ctypes.c_int32
    stats_p = ctypes.POINTER(Stats)
    lib.al_workspace_new.restype = vp
    lib.al_workspace_new.argtypes = []
    lib.al_workspace_free.restype = None
    lib.al_workspace_free.argtypes = [vp]
    for name in ("al_adaptive_f32", "al_adaptive_f64"):
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [vp, sz, dbl, vp, stats_p]
    lib.al_set_sampler_init.restype = None
    lib.al_set_sampler_init.argtypes = [vp]
    lib.al_adaptive_sampler_new.restype = vp
    lib.al_adaptive_sampler_new.argtypes = [dbl, ctypes.c_int, ctypes.c_uint64, ctypes.c_int]
    lib.al_adaptive_sampler_stats.restype = stats_p
    lib.al_adaptive_sampler_stats.argtypes = [vp]
    lib.al_test_fail_allocations.restype = None
    lib.al_test_fail_allocations.argtypes = [ctypes.c_int]
    lib.al_eta_sampler_new.restype = vp
    lib.al_eta_sampler_new.argtypes = [dbl]
    for name in ("al_sizeof_token_data", "al_sizeof_token_data_array",
                 "al_sizeof_sampler_iface", "al_sizeof_stats"):
        getattr(lib, name).restype = sz
        getattr(lib, name).argtypes = []


_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str] | None = None


def load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why it is unavailable). Loaded once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            path = _library_path()
            if path is None:
                _loaded = (None, "the C library was not built when the package was installed")
            else:
                try:
                    lib = ctypes.CDLL(str(path))
                    _declare(lib)
                    if lib.al_sizeof_stats() != ctypes.sizeof(Stats):
                        raise OSError("its al_stats layout differs from the Python mirror")
                    _loaded = (lib, "")
                except (OSError, AttributeError) as exc:
                    _loaded = (None, f"the C library {path.name} does not load: {exc}")
        return _loaded


class _Buffers:
    """A C workspace (reused buffers), freed when this object is collected."""

    def __init__(self, lib: ctypes.CDLL):
        self.pointer = lib.al_workspace_new()
        if not self.pointer:
            raise MemoryError("could not allocate the adaptive kernel's workspace")
        weakref.finalize(self, lib.al_workspace_free, self.pointer)


class _Workspace(threading.local):
    """One workspace per thread, collected with the thread's local storage."""

    def __init__(self, lib: ctypes.CDLL):
        self.buffers = _Buffers(lib)


_workspaces: dict[int, _Workspace] = {}


def adaptive_native(lib: ctypes.CDLL, x: np.ndarray, eps: float, want_stats: bool):
    """(k*, kept mass, entropy) from the C kernel; x is a contiguous float32/float64 array."""
    local = _workspaces.get(id(lib))
    if local is None:
        local = _workspaces.setdefault(id(lib), _Workspace(lib))
    fn = lib.al_adaptive_f32 if x.dtype == np.float32 else lib.al_adaptive_f64
    stats = Stats() if want_stats else None
    k = fn(x.ctypes.data, x.shape[0], eps, local.buffers.pointer, ctypes.byref(stats) if stats else None)
    if k == INVALID_LOGITS:
        raise InvalidLogits
    if k < 1:
        raise MemoryError("the adaptive kernel could not allocate its buffers")
    if stats is None:
        return k, float("nan"), float("nan")
    return k, stats.kept_mass, stats.entropy

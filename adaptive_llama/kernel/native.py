"""The C library built from ``native/`` when the package installs.

Two faces of one file: the llama.cpp samplers through ctypes (:func:`load`), and the array
API as a CPython function (``native/module.c``; :func:`adaptive_native`), because a ctypes
call would cost more than a tenth of the kernel at V 32k. :func:`load` returns the library,
or ``None`` with the reason when it was not built (no C compiler at install time) or does not
load; callers decide what falls back and say so.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import threading
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
    vp, sz, dbl = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_double
    stats_p = ctypes.POINTER(Stats)
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
    lib.al_pless_sampler_new.restype = vp
    lib.al_pless_sampler_new.argtypes = []
    lib.al_toph_sampler_new.restype = vp
    lib.al_toph_sampler_new.argtypes = [dbl, ctypes.c_size_t]
    lib.al_adaptive_sample_row.restype = ctypes.c_int32
    lib.al_adaptive_sample_row.argtypes = [vp, vp, sz, ctypes.c_float]
    lib.al_set_threads.restype = ctypes.c_int
    lib.al_set_threads.argtypes = [ctypes.c_int]
    lib.al_greedy_row.restype = ctypes.c_int32
    lib.al_greedy_row.argtypes = [vp, sz]
    for name in ("al_sizeof_token_data", "al_sizeof_token_data_array",
                 "al_sizeof_sampler_iface", "al_sizeof_stats"):
        getattr(lib, name).restype = sz
        getattr(lib, name).argtypes = []


def _import_module(path: Path):
    """The same file as a CPython extension module (its PyInit__adaptive_native)."""
    loader = importlib.machinery.ExtensionFileLoader(f"{__package__}.{LIBRARY_STEM}", str(path))
    spec = importlib.util.spec_from_file_location(loader.name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str] | None = None
_adaptive = None  # the module's adaptive(x, eps, want_stats), once load() succeeded


def load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why it is unavailable). Loaded once per process."""
    global _loaded, _adaptive
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
                    _adaptive = _import_module(path).adaptive
                    _loaded = (lib, "")
                except (OSError, AttributeError, ImportError) as exc:
                    _loaded = (None, f"the C library {path.name} does not load: {exc}")
        return _loaded


def adaptive_native(x: np.ndarray, eps: float, want_stats: bool):
    """(k*, kept mass, entropy) from the C kernel, once :func:`load` succeeded; x is a
    non-empty contiguous 1-D float32/float64 array. Kept mass and entropy are NaN unless
    want_stats."""
    k, kept, entropy = _adaptive(x, eps, want_stats)
    if k == INVALID_LOGITS:
        raise InvalidLogits
    if k < 1:
        raise MemoryError("the adaptive kernel could not allocate its buffers")
    return k, kept, entropy


def set_pass_threads(threads: int) -> int:
    """How many threads the C kernel's passes over every token may use (the max, the
    temperature, the weights; at most one per 16,384 tokens), in the whole process. The
    decoder of a model whose layers are on a GPU or workers sets it to llama.cpp's thread
    count, whose threads wait while the host samples; the results are the same on any
    number. Returns the number set: 1 without the C library
    or where it was built without OpenMP."""
    lib, _ = load()
    return lib.al_set_threads(threads) if lib is not None else 1


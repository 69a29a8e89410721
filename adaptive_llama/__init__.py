"""adaptive-llama: adaptive decoding (Zhu et al., ICML 2024) for GGUF models on llama.cpp.

The kernel (:func:`adaptive_k`, :func:`adaptive_stats`) needs numpy and numba only; it and
the parts that run llama.cpp (:class:`Engine`, :class:`Chat`, :class:`SamplerChain`,
:func:`use_sampler`) load on first use, and check the installed llama-cpp-python's version
then.
"""

import ctypes
import importlib.util
import os
from pathlib import Path


def _preload_llama_cpp() -> None:
    """Load llama.cpp's libraries now, before anything imports numpy.

    A CUDA build of llama.cpp crashed while loading a model (a segmentation fault) in
    processes that had imported numpy before llama_cpp (seen on an H100 machine; llama-cpp-
    python issue #1581 describes the same order dependence); importing llama_cpp first
    avoided it. So the package loads libllama, and with it what it links (OpenMP's runtime,
    CUDA's libraries), from the file llama_cpp itself loads (the same handle then), without
    importing llama_cpp or numpy: every entry point (the command line, the server, a program
    that imports adaptive_llama first) starts in the order that works. A library that is
    missing or does not load is left to ``import llama_cpp`` to report in its own words."""
    folder = os.environ.get("LLAMA_CPP_LIB_PATH")  # read by llama_cpp the same way
    if not folder:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            return
        folder = Path(spec.submodule_search_locations[0]) / "lib"
    try:
        ctypes.CDLL(str(Path(folder) / "libllama.so"))
    except OSError:
        pass


_preload_llama_cpp()

from .runtime.models import ModelError, resolve_model  # noqa: E402
from .samplers import SAMPLERS, SamplerSpec, SpecError, parse_spec  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "IMPL", "BACKEND", "AdaptiveStats", "adaptive_k", "adaptive_stats",
    "SAMPLERS", "SamplerSpec", "SpecError", "parse_spec", "ModelError", "resolve_model",
    "Engine", "GenerationResult", "Stream", "ContextOverflow", "Chat", "SamplerChain",
    "use_sampler", "LLAMA_CPP_VERSION", "Request", "InvalidArgument", "json_grammar",
    "UnsupportedSchema",
]

_LAZY = {"BACKEND": "kernel", "IMPL": "kernel", "AdaptiveStats": "kernel",
         "adaptive_k": "kernel", "adaptive_stats": "kernel", "Engine": "runtime.engine",
         "GenerationResult": "runtime.engine", "Stream": "runtime.engine",
         "ContextOverflow": "runtime.engine", "Chat": "chat.conversation",
         "SamplerChain": "llama.chain", "use_sampler": "llama.chain",
         "LLAMA_CPP_VERSION": "llama.chain", "Request": "runtime.engine",
         "InvalidArgument": "runtime.engine", "json_grammar": "llama.grammar",
         "UnsupportedSchema": "llama.grammar"}


def __getattr__(name):
    """The kernel (numba) and the llama.cpp-backed parts load on first use, so that the
    specs and the command line import fast (and a bad ADAPTIVE_LLAMA_IMPL is reported by
    whoever uses the kernel)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""adaptive-llama: adaptive decoding (Zhu et al., ICML 2024) for GGUF models on llama.cpp.

The kernel (:func:`adaptive_k`, :func:`adaptive_stats`) needs only numpy; the engine, the
samplers and the CLI run on llama-cpp-python, whose version is checked here at import.
"""

from .compat import check_llama_cpp_version

LLAMA_CPP_VERSION = check_llama_cpp_version()

from .kernel import BACKEND, AdaptiveStats, adaptive_k, adaptive_stats  # noqa: E402
from .specs import SamplerSpec, SpecError, parse_spec  # noqa: E402
from .models import ModelError  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "BACKEND", "AdaptiveStats", "adaptive_k", "adaptive_stats", "LLAMA_CPP_VERSION",
    "SamplerSpec", "SpecError", "parse_spec", "ModelError",
    "Engine", "Chat", "GenerationResult", "SamplerChain", "use_sampler",
]

_LAZY = {"Engine": "engine", "Chat": "engine", "GenerationResult": "engine",
         "ContextOverflow": "engine", "SamplerChain": "sampler", "use_sampler": "sampler"}


def __getattr__(name):
    """The llama.cpp-backed parts load on first use, so the kernel imports fast."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

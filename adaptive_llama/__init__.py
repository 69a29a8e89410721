"""adaptive-llama: adaptive decoding (Zhu et al., ICML 2024) for GGUF models on llama.cpp.

The kernel (:func:`adaptive_k`, :func:`adaptive_stats`) needs numpy and numba only; it and
the parts that run llama.cpp (:class:`Engine`, :class:`Chat`, :class:`SamplerChain`,
:func:`use_sampler`) load on first use, and check the installed llama-cpp-python's version
then.
"""

from .runtime.models import ModelError, resolve_model
from .samplers import SAMPLERS, SamplerSpec, SpecError, parse_spec

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

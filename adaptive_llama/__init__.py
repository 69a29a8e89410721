"""adaptive-llama: adaptive decoding (Zhu et al., ICML 2024) for GGUF models on llama.cpp.

The kernel (:func:`adaptive_k`, :func:`adaptive_stats`) needs only numpy; the engine, the
samplers and the CLI run on llama-cpp-python, whose version is checked here at import.
"""

from .compat import check_llama_cpp_version

LLAMA_CPP_VERSION = check_llama_cpp_version()

from .kernel import BACKEND, AdaptiveStats, adaptive_k, adaptive_stats  # noqa: E402

__version__ = "0.1.0"
__all__ = ["BACKEND", "AdaptiveStats", "adaptive_k", "adaptive_stats", "LLAMA_CPP_VERSION"]

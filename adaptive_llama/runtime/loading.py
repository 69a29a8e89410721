"""Loading a GGUF file into llama.cpp, the same way for the engine and an embedding model."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
from llama_cpp import _internals

from .models import ModelError


def load_model(path: Path, n_gpu_layers: int = 0, verbose: bool = False):
    """The ``llama_cpp._internals.LlamaModel`` of ``path`` (``n_gpu_layers`` -1: all on the
    GPU), or ModelError in one line for a file llama.cpp cannot load."""
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers
    # No repacked weight layouts (AVX2/AVX-512 repack, AMX): they compute a row with
    # other kernels depending on its place in the batch (groups of four rows against
    # single rows), so a reply would depend on what else was decoded with it; and the
    # AMX path crashed (SIGSEGV in ggml_backend_amx_mul_mat) on the AMX CPUs of our CI.
    params.use_extra_bufts = False
    try:
        return _internals.LlamaModel(path_model=str(path), params=params, verbose=verbose)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelError(f"{path}: llama.cpp could not load it; the file is truncated or "
                         f"corrupt, or not a model llama.cpp supports ({exc})") from None

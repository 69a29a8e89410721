"""The parts of llama.h this package mirrors, and the llama-cpp-python releases they are
checked against (at import).

``native/adaptive.c`` mirrors llama.cpp's ``llama_sampler_i`` (12 function pointers in
0.3.36), ``llama_token_data`` and ``llama_token_data_array`` in C; on the Python side
:class:`SamplerIface` is the one copy of ``llama_sampler_i``, used by the numba samplers and
the graph hooks. These changed between releases, so another version could crash instead of
failing: :func:`check_llama_cpp_version` refuses an untested one, and the chain compares the
sizes with llama-cpp-python's own before it runs. Keep in step with pyproject.toml.
"""

from __future__ import annotations

import ctypes
from importlib import metadata

TESTED_LLAMA_CPP = ((0, 3, 36), (0, 3, 37))  # [low, high)


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_llama_cpp_version() -> str:
    """The installed llama-cpp-python version, or ImportError saying what to install."""
    low, high = TESTED_LLAMA_CPP
    wanted = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    try:
        installed = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"adaptive-llama needs llama-cpp-python{wanted}, which is not installed: "
            f"pip install 'llama-cpp-python{wanted}'"
        ) from None
    if not (low <= _parse(installed) < high):
        raise ImportError(
            f"adaptive-llama is tested with llama-cpp-python{wanted}, but {installed} is "
            f"installed; its sampler interface may differ. Install a tested version: "
            f"pip install 'llama-cpp-python{wanted}'"
        )
    return installed


class SamplerIface(ctypes.Structure):
    """llama.h's ``llama_sampler_i`` with plain addresses: six hooks every sampler may have,
    then six for backend sampling (inside llama.cpp's graph)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "name", "accept", "apply", "reset", "clone", "free", "backend_init", "backend_accept",
        "backend_apply", "backend_set_input", "backend_reset", "copy_state")]

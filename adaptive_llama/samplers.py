"""Every sampler in one table, and sampler specs: one syntax for the API, the CLI, the REPL
and the server, parsed and validated once, at the edge.

A spec is ``NAME`` or ``NAME:key=value,key=value``; every sampler but greedy also takes
``temp=`` (applied first). Modifiers join a sampler with ``+``:
``adaptive:eps=0.001+penalties:repeat=1.1+dry``. Modifiers alone sample the whole
distribution after them (``dist``), with ``temp=`` in any of them: ``top-n-sigma:n=1,temp=1.5``
is top-n-sigma as a method of its own. Whatever order they are written in, a chain
runs them in one order, llama.cpp's (``--samplers``)::

    [grammar] -> penalties -> dry -> top-n-sigma -> [temp] -> SAMPLER -> xtc -> [dist]

penalties and DRY change the logits of tokens seen in the prompt and the reply, top-n-sigma
masks tokens far below the top logit, the sampler truncates (and may choose), XTC removes
the most likely tokens of what is left, and ``dist`` (seeded) chooses unless the sampler
chose itself. After adaptive, XTC sees adaptive's kept set with its renormalised
probabilities, and ``dist`` draws from what XTC leaves. :data:`SAMPLERS` holds, per
sampler and modifier, its parameters (name, type, default, valid range, help), how it joins a
llama.cpp chain, and whether it picks the token itself (otherwise a ``dist`` sampler follows
it). The error messages, ``adaptive-llama
samplers``, the REPL's ``/help`` and :class:`adaptive_llama.llama.chain.SamplerChain` all read
it: adding a sampler that llama.cpp has is adding an entry (a new kind also needs its
``apply`` in ``native/adaptive.c`` and :mod:`adaptive_llama.llama.numba_samplers`). Run
``adaptive-llama samplers`` for the table.

This module imports neither llama_cpp nor numpy: a chain builder is handed to each entry's
``add`` (see :class:`ChainBuilder`).
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

INT32_MAX = 2**31 - 1  # llama.cpp takes k and m as int32


class SpecError(ValueError):
    """A sampler spec that cannot be used; the message says what is valid. ``param``: the
    option it is about, when a client's option (not spec text) was wrong."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
        """``value`` converted to the parameter's type, or SpecError naming ``name`` (an
        option's name, carried as the error's ``param``) or the parameter."""
        try:
            return self._validated(value, name or self.name)
        except SpecError as exc:
            exc.param = name
            raise

    def _validated(self, value: Any, name: str) -> Any:
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
    def p_less(self) -> None: ...
    def top_h(self, alpha: float, top_n: int) -> None: ...
    def adaptive(self, epsilon: float, uniform: bool) -> None: ...
    def adaptive_p(self, target: float, decay: float) -> None: ...
    def penalties(self, last_n: int, repeat: float, freq: float, present: float) -> None: ...
    def dry(self, multiplier: float, base: float, allowed_length: int,
            last_n: int) -> None: ...
    def top_n_sigma(self, n: float) -> None: ...
    def xtc(self, probability: float, threshold: float) -> None: ...


@dataclass(frozen=True)
class Sampler:
    """One table entry: what a spec name means and how it joins a chain.

    ``add(builder, params)`` appends the sampler's llama.cpp samplers; when
    ``chooses_token`` is False a ``dist`` sampler (seeded) follows them. ``in_graph``: it can
    run inside llama.cpp's graph (backend sampling, :mod:`adaptive_llama.llama.graph`).
    ``stage``: where it runs in a chain: ``"sampler"`` for the one sampler of a spec,
    ``"before"`` / ``"after"`` it for a modifier (joined with ``+``; modifiers of one stage
    run in table order).
    """

    name: str
    summary: str
    params: tuple[Param, ...]
    add: Callable[[ChainBuilder, dict], None]
    chooses_token: bool = False
    takes_temp: bool = True
    in_graph: bool = False
    stage: str = "sampler"

    @property
    def is_modifier(self) -> bool:
        return self.stage != "sampler"

    def all_params(self) -> tuple[Param, ...]:
        return self.params + ((TEMP,) if self.takes_temp else ())


# The threshold of adaptive decoding and of eta-sampling: the kernel validates its
# `epsilon` argument with this same parameter. Below about 1 / V every token with p > 0 is
# kept (dConf_k <= p_k); the open interval (0, 1) is what the formula allows. The default is
# what this project's evaluation supports on the models people run locally, not the paper's
# 0.0005 (tuned on 7B models): 0.005 was the dev sweeps' pick in 6 of 12 settings, level
# with tuned min-p at T = 1, and the one value that held in every setting run hot, where
# smaller ones fell behind min-p or collapsed (docs/evaluation.md; models.md says why).
EPSILON = Param("eps", float, 0.005, "threshold epsilon", low=0.0, high=1.0,
                low_open=True, high_open=True)
# Below this epsilon, adaptive decoding run above temperature 1 fell behind min-p or collapsed
# in the evaluation: the REPL says so when a user sets such a pair.
HOT_EPSILON = 0.005
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
# The tokens penalties and DRY look back on: the prompt's last ones, then the reply's. llama.cpp
# allocates this many entries per sampler; 2**20 is beyond any context window.
MAX_LOOKBACK = 2**20
_PENALTY = dict(low=-2.0, high=2.0)  # OpenAI's range for presence and frequency penalties
# llama.cpp's default DRY sequence breakers: a repeat across one of these is not penalised.
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")


def _modifier(name: str, summary: str, params: tuple[Param, ...], add, stage: str) -> Sampler:
    return Sampler(name, summary, params, add, takes_temp=False, stage=stage)

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
    Sampler("p-less", "keep p >= sum of p^2, the chance two draws agree; no parameter "
            "(Tan et al., ICLR 2026)", (), lambda b, p: b.p_less()),
    Sampler("top-h", "of the top_n likeliest, the longest prefix whose entropy sum is at most "
            "alpha times theirs (Potraghloo et al., 2025)",
            (Param("alpha", float, 0.4, "share of the top_n's entropy the kept tokens may "
                   "hold", low=0.0, high=1.0, low_open=True),
             Param("top_n", int, 100, "likeliest tokens considered", low=1, high=INT32_MAX)),
            lambda b, p: b.top_h(p["alpha"], p["top_n"])),
    Sampler("adaptive", "adaptive decoding (Zhu et al., 2024); mode=uniform samples "
            "uniformly in the kept set",
            (EPSILON, Param("mode", str, "multinomial", "sampling inside the kept set",
                            choices=("multinomial", "uniform"))),
            lambda b, p: b.adaptive(p["eps"], p["mode"] == "uniform"), chooses_token=True,
            in_graph=True),
    # llama.cpp's own (PR 17927), not adaptive decoding: it reshapes the distribution
    # towards tokens near a target probability and chooses. llama.cpp's default target (-1)
    # leaves it off; a sampler of its own needs one, and 0.5 is the middle of its range.
    Sampler("adaptive-p", "llama.cpp's adaptive-p (PR 17927, not adaptive decoding): "
            "favours tokens near a target probability, steered by a moving average",
            (Param("target", float, 0.5, "probability the chosen tokens average", low=0.0,
                   high=1.0),
             Param("decay", float, 0.9, "moving average's decay; history ~ 1/(1-decay) "
                   "tokens", low=0.0, high=0.99)),
            lambda b, p: b.adaptive_p(p["target"], p["decay"]), chooses_token=True),
    Sampler("dist", "the whole distribution, no truncation", (), lambda b, p: None,
            in_graph=True),
    _modifier("penalties", "repetition (divides), frequency and presence (subtract) "
              "penalties on tokens among the last last_n",
              (Param("repeat", float, 1.1, "repetition penalty (1: none)", low=0.0,
                     low_open=True, high=10.0),
               Param("freq", float, 0.0, "frequency penalty, per occurrence (0: none)",
                     **_PENALTY),
               Param("present", float, 0.0, "presence penalty (0: none)", **_PENALTY),
               Param("last_n", int, 64, "tokens looked back on", low=1,
                     high=MAX_LOOKBACK)),
              lambda b, p: b.penalties(p["last_n"], p["repeat"], p["freq"], p["present"]),
              "before"),
    _modifier("dry", "DRY: penalise tokens that would extend a repeated sequence "
              "(multiplier * base^(length - allowed_length))",
              (Param("multiplier", float, 0.8, "strength (0: none)", low=0.0, high=100.0),
               Param("base", float, 1.75, "growth per repeated token", low=1.0, high=100.0),
               Param("allowed_length", int, 2, "repeats this long go unpenalised", low=1,
                     high=INT32_MAX),
               Param("last_n", int, 1024, "tokens looked back on", low=1,
                     high=MAX_LOOKBACK)),
              lambda b, p: b.dry(p["multiplier"], p["base"], p["allowed_length"],
                                 p["last_n"]),
              "before"),
    _modifier("top-n-sigma", "keep logits >= max - n * sigma (Tang et al., 2024)",
              (Param("n", float, 1.0, "standard deviations below the top logit", low=0.0,
                     low_open=True, high=1e6),),
              lambda b, p: b.top_n_sigma(p["n"]), "before"),
    _modifier("xtc", "exclude top choices: with probability `probability`, drop every "
              "token with p >= threshold but the least likely of them",
              (Param("probability", float, 0.5, "chance per token", low=0.0, high=1.0,
                     low_open=True),
               Param("threshold", float, 0.1, "p that makes a top choice", low=0.0,
                     high=0.5, low_open=True)),
              lambda b, p: b.xtc(p["probability"], p["threshold"]), "after"),
)}


def in_graph_names() -> str:
    """The samplers that can run inside llama.cpp's graph, for error messages."""
    return ", ".join(s.name for s in SAMPLERS.values() if s.in_graph)


def _with_defaults(s: Sampler) -> str:
    args = ",".join(f"{p.name}={p.default:g}" if isinstance(p.default, float)
                    else f"{p.name}={p.default}" for p in s.params)
    return f"{s.name}:{args}" if args else s.name


def valid_specs() -> str:
    """Every sampler and modifier with its defaults, on one line (for error messages and
    --help)."""
    samplers = [_with_defaults(s) for s in SAMPLERS.values() if not s.is_modifier]
    modifiers = [_with_defaults(s) for s in SAMPLERS.values() if s.is_modifier]
    return (", ".join(samplers) + f" (all but greedy also take temp={TEMP.default:g}); "
            f"modifiers, joined with +: {', '.join(modifiers)}")


def table() -> str:
    """The samplers and modifiers, their parameters with defaults and ranges."""
    lines = []
    for title, modifiers in (("Samplers (one per spec; truncations may join each other, "
                              "as in top-k:k=40+top-p:p=0.95+min-p, the last in the order "
                              f"{', '.join(CUTS)} sampling and the others cutting before it):",
                              False),
                             ("Modifiers (joined with +, e.g. adaptive+penalties:repeat=1.1; "
                              "order: penalties, dry, top-n-sigma, temp, the sampler, xtc; "
                              "alone, they are followed by dist and take temp=, as in "
                              "top-n-sigma:n=1,temp=1.5):", True)):
        lines.append(title)
        for s in SAMPLERS.values():
            if s.is_modifier != modifiers:
                continue
            lines.append(f"  {s.name:<12} {s.summary}")
            for p in s.all_params():
                default = f"{p.name}={p.default}"
                lines.append(f"{'':<16}{default:<22} {p.range_text()}: {p.help}")
    return "\n".join(lines)


@dataclass(frozen=True)
class SamplerSpec:
    """A parsed, validated spec: its sampler's name, parameters and temperature, and the
    modifiers joined to it (each a SamplerSpec of a modifier entry), in chain order."""

    name: str
    params: dict = field(default_factory=dict)
    temp: float = 1.0
    modifiers: tuple[SamplerSpec, ...] = ()

    @property
    def sampler(self) -> Sampler:
        return SAMPLERS[self.name]

    def stage(self, stage: str) -> tuple[SamplerSpec, ...]:
        """The modifiers that run ``"before"`` or ``"after"`` the sampler, or the truncations
        that cut before it (``"cut"``), in order."""
        return tuple(m for m in self.modifiers if _stage_of(m) == stage)

    @property
    def in_graph(self) -> bool:
        """Whether every entry can run inside llama.cpp's graph (backend sampling)."""
        return all(s.sampler.in_graph for s in (self, *self.modifiers))

    def __str__(self) -> str:
        items = dict(self.params)
        if self.sampler.takes_temp and self.temp != 1.0:
            items["temp"] = self.temp
        args = ",".join(f"{k}={_number_text(v)}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in items.items())
        own = f"{self.name}:{args}" if args else self.name
        return "+".join([own, *map(str, self.modifiers)])

    def with_param(self, key: str, value, option: str | None = None) -> SamplerSpec:
        """A copy with one parameter of the sampler (``temp`` included) changed and
        validated; the modifiers stay. ``option``: the client's option that gave the value,
        named by the SpecError of a bad one."""
        by_name = {p.name: p for p in self.sampler.all_params()}
        if key not in by_name:
            raise SpecError(f"{self.name} has no `{key}`; it takes "
                            f"{', '.join(f'{k}=' for k in by_name) or 'no parameters'}")
        value = by_name[key].validate(value, option)
        if key == "temp":
            return replace(self, temp=value)
        return replace(self, params={**self.params, key: value})

    def with_modifier(self, modifier: SamplerSpec) -> SamplerSpec:
        """A copy with ``modifier`` joined, in place of one of the same name."""
        kept = [m for m in self.modifiers if m.name != modifier.name]
        return _joined(replace(self, modifiers=()), [*kept, modifier])


# Truncations that may cut before another, in llama.cpp's chain order (top_k, typ_p, top_p,
# min_p): a spec of several runs all but the last as cuts before it, as llama-server runs
# a request's top_k, typical_p, top_p and min_p together.
CUTS = ("top-k", "typical", "top-p", "min-p")


def _stage_of(entry: SamplerSpec) -> str:
    """Where a joined entry runs: a modifier's stage, or ``"cut"`` for a truncation."""
    return entry.sampler.stage if entry.sampler.is_modifier else "cut"


def _joined(sampler: SamplerSpec, modifiers: list[SamplerSpec]) -> SamplerSpec:
    """``sampler`` with ``modifiers`` (and cuts) in chain order, or SpecError for a pair
    that cannot run together."""
    order = [*CUTS, *SAMPLERS]
    modifiers = sorted(modifiers, key=lambda m: order.index(m.name))
    if any(m.sampler.stage == "after" for m in modifiers):
        _check_chosen_later(sampler)
    return replace(sampler, modifiers=tuple(modifiers))


def _check_chosen_later(sampler: SamplerSpec) -> None:
    """SpecError unless ``dist`` may choose after the sampler (as it does after xtc)."""
    if sampler.name == "adaptive" and sampler.params["mode"] == "uniform":
        raise SpecError("xtc cannot follow adaptive:mode=uniform: the choice after xtc "
                        "draws by probability, not uniformly; use mode=multinomial")
    if sampler.sampler.chooses_token and sampler.name != "adaptive":
        raise SpecError(f"xtc cannot follow {sampler.name}, which chooses the token itself; "
                        "use it with adaptive, dist or a truncation sampler")


def _number_text(value: float) -> str:
    """The shortest text that parses back to the same float (5.0 reads as 5)."""
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


# `+` joins entries; the one in a number such as 1e+3 is followed by a digit.
_JOIN = re.compile(r"\+(?=\s*[A-Za-z])")


def parse_spec(text: str) -> SamplerSpec:
    """Parse and validate ``NAME[:key=value,...][+MODIFIER[:key=value,...]]...``; SpecError
    says what is wrong and valid.

    Call it where text comes in (CLI option, REPL command, HTTP body); pass the
    :class:`SamplerSpec` on from there.
    """
    if not isinstance(text, str):
        raise SpecError(f"a sampler spec has to be text such as 'adaptive:eps=0.0005', "
                        f"but is {text!r}")
    parts = _JOIN.split(text)
    if not any(_entry_name(part) in SAMPLERS and not SAMPLERS[_entry_name(part)].is_modifier
               for part in parts):
        return _modifiers_then_dist(text, parts)
    entries = [_parse_entry(part) for part in parts]
    samplers = [e for e in entries if not e.sampler.is_modifier]
    modifiers = [e for e in entries if e.sampler.is_modifier]
    _check_once([e.name for e in entries], text)
    if len(samplers) > 1 and all(e.name in CUTS for e in samplers):
        return _cut(samplers, modifiers, text)
    if len(samplers) != 1:
        names = " and ".join(e.name for e in samplers) or "none"
        raise SpecError(f"a spec has one sampler, but {text.strip()!r} has {names}; "
                        "modifiers join it with +, as in adaptive+penalties:repeat=1.1 "
                        f"(truncations may join each other: {', '.join(CUTS)})")
    return _joined(samplers[0], modifiers)


def _cut(truncations: list[SamplerSpec], modifiers: list[SamplerSpec],
         text: str) -> SamplerSpec:
    """Several truncations: the last in llama.cpp's order samples, the others cut before
    it (before the temperature, as in llama.cpp), so that they take no ``temp=``."""
    ordered = sorted(truncations, key=lambda e: CUTS.index(e.name))
    *cuts, last = ordered
    warm = next((e for e in cuts if e.temp != 1.0), None)
    if warm is not None:
        raise SpecError(f"in {text.strip()!r}, {warm.name} cuts before {last.name}, which "
                        f"takes the temperature: write temp= on {last.name}")
    return _joined(last, [*cuts, *modifiers])


def _check_once(names: list[str], text: str) -> None:
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:
        raise SpecError(f"`{twice}` is given twice in {text.strip()!r}")


def _entry_name(text: str) -> str:
    return text.strip().partition(":")[0].strip().lower()


def _modifiers_then_dist(text: str, parts: list[str]) -> SamplerSpec:
    """A spec of modifiers alone, such as ``top-n-sigma:n=1,temp=1.5`` (top-n-sigma as a
    method, Tang et al., 2024): the modifiers, then the temperature (given in any of them)
    and ``dist`` over what they leave."""
    entries = [_parse_entry(part, with_temp=True) for part in parts]
    _check_once([e.name for e in entries], text)
    temps = [e.temp for e in entries if e.temp is not None]
    if len(temps) > 1:
        raise SpecError(f"`temp` is given twice in {text.strip()!r}")
    dist = SamplerSpec(name="dist", temp=temps[0] if temps else TEMP.default)
    return _joined(dist, [replace(e, temp=TEMP.default) for e in entries])


def _parse_entry(text: str, with_temp: bool = False) -> SamplerSpec:
    """One ``NAME[:key=value,...]`` of a spec, its values validated. ``with_temp``: a
    modifier may take ``temp=`` too (for the dist after modifiers alone); its temp is then
    None unless given."""
    name = _entry_name(text)
    rest = text.strip().partition(":")[2]
    if name not in SAMPLERS:
        raise SpecError(f"unknown sampler {name!r}; valid: {valid_specs()}")
    sampler = SAMPLERS[name]
    params = sampler.all_params()
    if with_temp and not sampler.takes_temp:
        params += (replace(TEMP, default=None),)
    by_name = {p.name: p for p in params}
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


# The protocols' options for modifiers (llama-server's and Ollama's names) -> (modifier,
# parameter). Unset parameters start where nothing happens (OpenAI's penalties default to
# none, llama-server's DRY and XTC to off), so that only the options given act.
MODIFIER_OPTIONS = {
    "repeat_penalty": ("penalties", "repeat"),
    "frequency_penalty": ("penalties", "freq"),
    "presence_penalty": ("penalties", "present"),
    "repeat_last_n": ("penalties", "last_n"),
    "dry_multiplier": ("dry", "multiplier"),
    "dry_base": ("dry", "base"),
    "dry_allowed_length": ("dry", "allowed_length"),
    "dry_penalty_last_n": ("dry", "last_n"),
    "top_n_sigma": ("top-n-sigma", "n"),
    "xtc_probability": ("xtc", "probability"),
    "xtc_threshold": ("xtc", "threshold"),
}
_OPTIONS_START = {"penalties": {"repeat": 1.0}, "dry": {"multiplier": 0.0},
                  "xtc": {"probability": 0.0}}
# Values that turn a modifier off, as in llama-server and Ollama (last_n 0: look back on
# nothing; -1, the whole context, is taken as MAX_LOOKBACK).
_OFF = {
    "penalties": lambda p: p["last_n"] == 0 or (p["repeat"] == 1 and p["freq"] == 0
                                                 and p["present"] == 0),
    "dry": lambda p: p["multiplier"] == 0 or p["last_n"] == 0,
    "top-n-sigma": lambda p: p["n"] <= 0,
    "xtc": lambda p: p["probability"] <= 0,
}
_MIROSTAT = {1: "mirostat1", 2: "mirostat"}


def spec_from_options(default: SamplerSpec, *, sampler: str | None = None,
                      temperature: float | None = None, top_p: float | None = None,
                      top_k: int | None = None, min_p: float | None = None,
                      typical_p: float | None = None,
                      epsilon: float | None = None, mirostat: int | None = None,
                      mirostat_tau: float | None = None, mirostat_eta: float | None = None,
                      adaptive_target: float | None = None,
                      adaptive_decay: float | None = None,
                      **modifier_options) -> SamplerSpec:
    """The spec a client's options ask for (the OpenAI and Ollama routes, the llm plugin):
    ``sampler`` text (parsed once), else ``mirostat`` 1 or 2 (with ``mirostat_tau`` and
    ``mirostat_eta``), else llama-server's ``adaptive_target`` (0 to 1; negative: off) with
    ``adaptive_decay`` for adaptive-p, which runs alone here (a truncation option that would
    cut before it is refused), else every truncation option that truncates (``top_k`` above
    0, ``typical_p`` and ``top_p`` below 1, ``min_p`` above 0), in llama.cpp's order, the
    last sampling at the default spec's temperature and the others cutting before it, else
    ``default``; then ``epsilon`` on top (a spec without one:
    SpecError), the modifiers' options (:data:`MODIFIER_OPTIONS`, over a modifier the spec
    already has) and ``temperature`` (0: greedy, with the modifiers before it; a sampler
    that takes none, such as greedy, ignores it, as clients send one with every request)."""
    unknown = set(modifier_options) - set(MODIFIER_OPTIONS)
    if unknown:
        raise TypeError(f"spec_from_options() got unknown options {sorted(unknown)}")
    spec = parse_spec(sampler) if sampler is not None else default
    chosen = None
    if sampler is None:
        chosen = (_mirostat(mirostat, mirostat_tau, mirostat_eta)
                  or _adaptive_p(adaptive_target, adaptive_decay, top_p, top_k, min_p,
                                 typical_p)
                  or _truncation(top_p, top_k, min_p, typical_p))
    if chosen is not None:
        chosen = chosen.with_param("temp", default.temp) if default.sampler.takes_temp \
            else chosen
        spec = _rejoined(chosen, default.modifiers)
    if epsilon is not None:
        if "eps" not in spec.params:
            raise SpecError(f"`epsilon` applies to adaptive and eta, not to {spec}", "epsilon")
        spec = spec.with_param("eps", epsilon, "epsilon")
    spec = _with_option_modifiers(spec, modifier_options)
    if temperature == 0:
        return _rejoined(parse_spec("greedy"), spec.modifiers)
    if temperature is not None and spec.sampler.takes_temp:
        spec = spec.with_param("temp", temperature, "temperature")
    return spec


def _rejoined(sampler: SamplerSpec, modifiers: tuple[SamplerSpec, ...]) -> SamplerSpec:
    """``sampler`` (with its own cuts) in place of another, with the other's modifiers it
    can take: a client's temperature 0 or mirostat on a server whose default spec has xtc
    drops xtc, which cannot follow a sampler that chooses the token itself. The other's
    cuts were its own: they go with it."""
    modifiers = tuple(m for m in modifiers if m.sampler.is_modifier)
    try:
        _check_chosen_later(sampler)
    except SpecError:
        modifiers = tuple(m for m in modifiers if m.sampler.stage != "after")
    return _joined(sampler, [*sampler.stage("cut"), *modifiers])


def _with_option_modifiers(spec: SamplerSpec, options: dict) -> SamplerSpec:
    """``spec`` with each modifier that ``options`` set joined, replaced or (set off)
    taken out; SpecError naming the option for a bad value."""
    for name in _OFF:
        given = {param: (option, value) for option, (modifier, param)
                 in MODIFIER_OPTIONS.items()
                 if modifier == name and (value := options.get(option)) is not None}
        if not given:
            continue
        current = next((m for m in spec.modifiers if m.name == name), None)
        by_name = {p.name: p for p in SAMPLERS[name].params}
        values = dict(current.params) if current else {
            p.name: p.default for p in by_name.values()} | _OPTIONS_START.get(name, {})
        for param, (option, value) in given.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"`{option}` has to be a number, but is {value!r}", option)
            values[param] = MAX_LOOKBACK if param == "last_n" and value == -1 else value
        kept = [m for m in spec.modifiers if m.name != name]
        if not _OFF[name](values):
            for param, (option, _) in given.items():
                values[param] = by_name[param].validate(values[param], option)
            kept.append(SamplerSpec(name, values))
        spec = _joined(replace(spec, modifiers=()), kept)
    return spec


def _mirostat(mode: int | None, tau: float | None, eta: float | None) -> SamplerSpec | None:
    """Ollama's and llama-server's ``mirostat``: 0 off, 1 mirostat v1, 2 mirostat v2."""
    if mode is None or mode == 0:
        return None
    if mode not in _MIROSTAT or isinstance(mode, bool):
        raise SpecError(f"`mirostat` has to be 0, 1 or 2, but is {mode}", "mirostat")
    spec = parse_spec(_MIROSTAT[mode])
    for key, value, option in (("tau", tau, "mirostat_tau"), ("eta", eta, "mirostat_eta")):
        if value is not None:
            spec = spec.with_param(key, value, option)
    return spec


def _adaptive_p(target: float | None, decay: float | None, top_p, top_k, min_p,
                typical_p) -> SamplerSpec | None:
    """llama-server's ``adaptive_target`` (negative or absent: off) and ``adaptive_decay``."""
    if target is None or (isinstance(target, (int, float)) and target < 0):
        return None
    if _truncation(top_p, top_k, min_p, typical_p) is not None:
        raise SpecError("`adaptive_target`: adaptive-p runs alone here; leave out min_p, "
                        "typical_p and top_p below 1 and top_k above 0", "adaptive_target")
    spec = parse_spec("adaptive-p").with_param("target", target, "adaptive_target")
    return spec if decay is None else spec.with_param("decay", decay, "adaptive_decay")


def _truncation(top_p: float | None, top_k: int | None, min_p: float | None,
                typical_p: float | None = None) -> SamplerSpec | None:
    """The options that truncate (``top_k`` above 0, ``typical_p`` and ``top_p`` below 1,
    ``min_p`` above 0), all of them, in llama.cpp's order; None if none does."""
    given = [(name, param, value, option) for name, param, value, option, truncates in (
        ("top-k", "k", top_k, "top_k", bool(top_k)),
        ("typical", "p", typical_p, "typical_p", typical_p is not None and typical_p < 1),
        ("top-p", "p", top_p, "top_p", top_p is not None and top_p < 1),
        ("min-p", "p", min_p, "min_p", bool(min_p))) if truncates]
    if not given:
        return None
    entries = [parse_spec(name).with_param(param, value, option)
               for name, param, value, option in given]
    return _joined(entries[-1], entries[:-1])


def hot_epsilon_note(spec: SamplerSpec) -> str | None:
    """One line for adaptive decoding run above temperature 1 with an epsilon below
    :data:`HOT_EPSILON`, which the evaluation saw fall behind min-p or collapse; else None."""
    if spec.name != "adaptive" or spec.temp <= 1 or spec.params["eps"] >= HOT_EPSILON:
        return None
    return (f"note: above temperature 1, adaptive with eps {spec.params['eps']:g} fell behind "
            f"min-p or collapsed in our evaluation, where eps {HOT_EPSILON:g} held "
            f"(/set eps {HOT_EPSILON:g}; docs/evaluation.md)")

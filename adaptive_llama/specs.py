"""Sampler specs: one syntax for the Python API and the CLI, validated once, here.

``NAME`` or ``NAME:key=value,key=value``. Every sampler takes ``temp=`` (default 1.0), and
its other parameters default to the values below:

=============  ================================  =============================================
spec           parameters                        what runs
=============  ================================  =============================================
greedy         (none)                            argmax
top-k          k=40                              the k most likely tokens
top-p          p=0.95                            nucleus sampling (Holtzman et al., 2020)
typical        p=0.95                            locally typical sampling (Meister et al., 2023)
min-p          p=0.05                            p >= p_min * p_max
mirostat       tau=5, eta=0.1                    mirostat v2 (Basu et al., 2021)
mirostat1      tau=5, eta=0.1, m=100             mirostat v1
eta            eps=0.0009                        p > min(eps, sqrt(eps) exp(-H)) (Hewitt et al., 2022)
adaptive       eps=0.0005, mode=multinomial      adaptive decoding (Zhu et al., 2024);
                                                 mode=uniform samples uniformly in the kept set
=============  ================================  =============================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class SpecError(ValueError):
    """A sampler spec that cannot be used; the message lists what is valid."""


def _unit_open(name, lo_closed=False, hi_closed=True):
    def check(value):
        lo_ok = value >= 0 if lo_closed else value > 0
        hi_ok = value <= 1 if hi_closed else value < 1
        if not (lo_ok and hi_ok):
            lo = "[0" if lo_closed else "(0"
            hi = "1]" if hi_closed else "1)"
            raise SpecError(f"`{name}` has to be in {lo}, {hi}, but is {value:g}")
    return check


def _positive(name):
    def check(value):
        if not value > 0:
            raise SpecError(f"`{name}` has to be > 0, but is {value:g}")
    return check


def _at_least_one(name):
    def check(value):
        if value < 1:
            raise SpecError(f"`{name}` has to be an integer >= 1, but is {value}")
    return check


def _mode(value):
    if value not in ("multinomial", "uniform"):
        raise SpecError(f"`mode` has to be multinomial or uniform, but is {value}")


# name -> {parameter: (type, default, check)}
SAMPLERS: dict[str, dict[str, tuple]] = {
    "greedy": {},
    "top-k": {"k": (int, 40, _at_least_one("k"))},
    "top-p": {"p": (float, 0.95, _unit_open("p"))},
    "typical": {"p": (float, 0.95, _unit_open("p"))},
    "min-p": {"p": (float, 0.05, _unit_open("p", lo_closed=True))},
    "mirostat": {"tau": (float, 5.0, _positive("tau")), "eta": (float, 0.1, _positive("eta"))},
    "mirostat1": {"tau": (float, 5.0, _positive("tau")), "eta": (float, 0.1, _positive("eta")),
                  "m": (int, 100, _at_least_one("m"))},
    "eta": {"eps": (float, 0.0009, _unit_open("eps", hi_closed=False))},
    "adaptive": {"eps": (float, 0.0005, _unit_open("eps", hi_closed=False)),
                 "mode": (str, "multinomial", _mode)},
}
COMMON = {"temp": (float, 1.0, None)}


def valid_specs() -> str:
    """One line per sampler with its parameters and defaults (for error messages and help)."""
    lines = []
    for name, params in SAMPLERS.items():
        items = {**params, **COMMON} if name != "greedy" else {}
        args = ",".join(f"{k}={d}" for k, (_, d, _) in items.items())
        lines.append(f"{name}:{args}" if args else name)
    return ", ".join(lines)


def _check_temp(value):
    if not (math.isfinite(value) and value > 0):
        raise SpecError(f"`temp` has to be a finite number > 0, but is {value:g}")


@dataclass(frozen=True)
class SamplerSpec:
    """A parsed, validated sampler: ``name``, its parameters and the temperature."""

    name: str
    params: dict = field(default_factory=dict)
    temp: float = 1.0

    def __str__(self) -> str:
        items = dict(self.params)
        if self.name != "greedy" and self.temp != 1.0:
            items["temp"] = self.temp
        args = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in items.items())
        return f"{self.name}:{args}" if args else self.name

    def with_param(self, key: str, value) -> "SamplerSpec":
        """A copy with one parameter changed (``temp`` included), validated again."""
        items = {**self.params, "temp": self.temp, key: value}
        return parse_spec(self.name + ":" + ",".join(f"{k}={v}" for k, v in items.items()))


def _convert(name, key, kind, raw):
    try:
        if kind is int:
            value = float(raw)
            if value != int(value):
                raise ValueError
            return int(value)
        if kind is float:
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
            return value
        return raw.strip()
    except ValueError:
        kind_name = {int: "an integer", float: "a finite number"}.get(kind, "text")
        raise SpecError(f"`{key}` of {name} has to be {kind_name}, but is {raw!r}") from None


def parse_spec(text: str | SamplerSpec) -> SamplerSpec:
    """Parse and validate ``NAME[:key=value,...]``; SpecError says what is wrong and what is valid."""
    if isinstance(text, SamplerSpec):
        return text
    raw = (text or "").strip()
    name, _, rest = raw.partition(":")
    name = name.strip().lower()
    if name not in SAMPLERS:
        raise SpecError(f"unknown sampler {name!r}; valid: {valid_specs()}")
    allowed = {**SAMPLERS[name], **COMMON}
    values = {key: default for key, (_, default, _) in allowed.items()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in allowed:
            raise SpecError(
                f"{name} takes {', '.join(f'{k}=' for k in allowed)}, not {item!r}"
            )
        values[key] = _convert(name, key, allowed[key][0], value)
    for key, (_, _, check) in allowed.items():
        if check:
            check(values[key])
    _check_temp(values["temp"])
    temp = values.pop("temp")
    return SamplerSpec(name=name, params=values, temp=temp)

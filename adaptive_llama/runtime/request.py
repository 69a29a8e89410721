"""One generation request, validated once: everything a reply is a function of.

:meth:`adaptive_llama.runtime.engine.Engine.request` builds it from what a caller (the API,
the REPL, the server's routes, the llm plugin) asked for, applying every rule once: the
sampler spec parsed and checked against where sampling runs, ``logprobs`` in range and
possible, ``max_tokens`` within the room the prompt leaves in the context window, and the
seed rule (a seed given is used; none: the engine's, else a fresh random one, reported in
the result). What carries a request never checks it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..samplers import SamplerSpec
from .reasoning import ThinkingFormat


class InvalidArgument(ValueError):
    """An argument out of range; ``param`` names it (the server's error says which field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ContextOverflow(InvalidArgument):
    """The prompt does not fit in the context window."""

    def __init__(self, message: str):
        super().__init__(message, "prompt")


@dataclass(frozen=True)
class Request:
    """A checked request (build it with ``Engine.request``).

    ``max_tokens`` is at most the room the prompt leaves; ``seed`` is the one the reply uses;
    ``stop`` holds no empty string; ``logprobs``: None, or how many alternatives to record
    with each token's log-probability; ``grammar``: a ``llama_cpp.LlamaGrammar`` or None;
    ``logit_bias``: (token, bias) pairs added to the logits;
    ``thinking``: how a reasoning model's thinking is told apart from its answer
    (:mod:`adaptive_llama.runtime.reasoning`), None to keep the reply as one text; then
    ``thinking_spec`` is the thinking's own sampler (None: ``spec``), ``thinking_budget``
    the tokens it may take (None: no bound), and ``closing_tokens`` what closes it when
    the budget is spent.
    """

    prompt_tokens: tuple[int, ...]
    spec: SamplerSpec
    max_tokens: int
    seed: int
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    grammar: Any = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    record_stats: bool = True
    thinking: ThinkingFormat | None = None
    thinking_spec: SamplerSpec | None = None
    thinking_budget: int | None = None
    closing_tokens: tuple[int, ...] = ()


def check_logit_bias(value, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """``value`` ({token id: bias} or [(token id, bias)]) as (token, bias) pairs if every id
    is a token of the vocabulary and every bias a number in [-100, 100] (OpenAI's range:
    -100 bans the token in effect), else InvalidArgument."""
    pairs = list(value.items() if isinstance(value, dict) else value)
    checked = {}
    for token, bias in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n_vocab:
            raise InvalidArgument(f"`logit_bias`: {token!r} is not a token id of this model "
                                  f"(0 to {n_vocab - 1})", "logit_bias")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                or not -100 <= bias <= 100):
            raise InvalidArgument(f"`logit_bias`: the bias of token {token} has to be a "
                                  f"number in [-100, 100], but is {bias!r}", "logit_bias")
        checked[token] = float(bias)
    return tuple(checked.items())


def check_shares(name: str, value, most: int) -> list[float]:
    """``value`` as floats if it is a list of up to ``most`` non-negative finite numbers (not
    bools) with a positive sum (``tensor_split``), else InvalidArgument."""
    ok = isinstance(value, (list, tuple)) and 0 < len(value) <= most and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf
        for x in value) and sum(value) > 0
    if not ok:
        raise InvalidArgument(f"`{name}` has to be a list of up to {most} shares like [3, 2] "
                              f"(non-negative numbers, not all 0), but is {value!r}", name)
    return [float(x) for x in value]


def check_budget(name: str, value) -> int | None:
    """A reasoning model's thinking budget as given (-1: no bound) as the engine keeps it
    (None: no bound), or InvalidArgument naming ``name``."""
    return None if check_int(name, value, low=-1) == -1 else value


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) in [low, high], else InvalidArgument."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value > high)):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgument(f"`{name}` has to be an integer {span}, but is {value!r}", name)
    return value

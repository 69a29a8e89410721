"""How long one sampler call takes on real logits, for the evaluation and the benchmarks."""

from __future__ import annotations

import statistics
import time

import llama_cpp

from ..runtime.engine import Engine

PROMPT = "The history of the printing press begins in"


def sampler_latency_us(engine: Engine, sampler, rounds: int = 200, prompt: str = PROMPT) -> float:
    """Median microseconds of one ``llama_sampler_sample`` call, no decode.

    ``sampler`` is a ``llama_sampler *``: a :class:`~adaptive_llama.llama.chain.SamplerChain`'s
    ``pointer`` or llama-cpp-python's own ``LlamaSampler().sampler``. The same logits are
    sampled ``rounds`` times (llama.cpp builds the candidate array anew each call).
    """
    engine.prefill(engine.tokenize(prompt))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        llama_cpp.llama_sampler_sample(sampler, engine.ctx, -1)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)

"""The in-chain samplers under both backends (C and numba), on the bundled models, one run.

For each installed bundled model: (1) the sampler-only cost of one token (llama.cpp builds the
candidate array and runs the chain on the same real logits; no decode), greedy and each spec
under each backend; (2) decode tokens/s of greedy and adaptive under each backend, rounds
interleaved, medians, ratios to greedy of the same round set. Progress on stderr; one JSON
object on stdout.

    python benchmarks/bench_backends.py [--rounds 5] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

from adaptive_llama import Engine, kernel
from adaptive_llama.eval.timing import PROMPT, sampler_latency_us
from adaptive_llama.llama import chain
from adaptive_llama.llama.chain import SamplerChain
from adaptive_llama.runtime.models import BUNDLED

SPECS = ["adaptive:eps=0.0005", "eta:eps=0.0009"]
BACKENDS = ("c", "numba")


def use_backend(name: str) -> None:
    """Let the next chains hold this backend's samplers (as ADAPTIVE_LLAMA_IMPL would)."""
    kernel.BACKEND = name
    chain.in_chain_samplers.cache_clear()


def sampler_costs(engine: Engine) -> dict:
    out = {}
    with SamplerChain("greedy", 0, engine.n_vocab) as greedy:
        out["greedy"] = round(sampler_latency_us(engine, greedy.pointer), 1)
    for spec in SPECS:
        for backend in BACKENDS:
            use_backend(backend)
            with SamplerChain(spec, 0, engine.n_vocab) as c:
                out[f"{spec} [{backend}]"] = round(sampler_latency_us(engine, c.pointer), 1)
    return out


def decode_speeds(engine: Engine, rounds: int, tokens: int) -> dict:
    runs = [("greedy", "c"), ("adaptive:eps=0.0005", "c"), ("adaptive:eps=0.0005", "numba")]
    speeds = {f"{spec} [{backend}]": [] for spec, backend in runs}
    for r in range(rounds):
        for spec, backend in runs:
            use_backend(backend)
            result = engine.generate(PROMPT, sampler=spec, max_tokens=tokens, seed=r + 1)
            speeds[f"{spec} [{backend}]"].append(result.decode_tokens_per_s)
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    greedy = medians["greedy [c]"]
    return {"median_tokens_per_s": {k: round(v, 1) for k, v in medians.items()},
            "ratio_to_greedy": {k: round(v / greedy, 3) for k, v in medians.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    results = {}
    for name in ("smollm2", "gemma3-270m"):
        if not BUNDLED[name].installed():
            continue
        print(f"{name}: sampler costs, then decode speeds", file=sys.stderr, flush=True)
        engine = Engine(name, n_ctx=512)
        try:
            results[name] = {"vocab": engine.n_vocab,
                             "sampler_us_per_token": sampler_costs(engine),
                             **decode_speeds(engine, args.rounds, args.tokens)}
        finally:
            engine.close()
    print(json.dumps({"benchmark": "backends", "rounds": args.rounds, "tokens": args.tokens,
                      "machine": platform.processor() or platform.machine(),
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""Host time of choosing one token: llama.cpp's chain against the row samplers, one run.

Every token, ``llama_sampler_sample`` fills a vocabulary-sized ``llama_token_data`` array
from the logits row before any sampler runs; greedy pays it too. A chain that is only
temperature -> adaptive, or greedy, chooses straight from the row instead
(:meth:`adaptive_llama.llama.chain.SamplerChain.sample`), the same token from the same
random stream. For each installed bundled model (V 49,152, 151,936 and 262,144), on the
real logits of one prompt (no decode in the timing), this times one choice each way:

- greedy through llama.cpp's chain (``llama_sampler_sample``): the yardstick;
- greedy and adaptive (eps 0.0005) from the row, and adaptive through the chain, under
  each backend (C, numba), with and without the per-token statistics (entropy, Conf),
  at temperature 1 and 0.7;
- the C kernel from the row with its passes over every token split among the engine's
  threads (``--threads``, default the engine's: llama.cpp's threads wait while the host
  samples), labelled "N threads".

Rounds interleave the ways; each round takes the median of ``--calls`` calls, and the
figures are the medians over rounds, with ratios to greedy through the chain. Run it on a
quiet machine. Progress on stderr; one JSON object on stdout.

    python benchmarks/bench_row.py [--rounds 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import llama_cpp
from bench_backends import BACKENDS, use_backend  # this folder: the script's own

from adaptive_llama import Engine
from adaptive_llama.eval.timing import PROMPT
from adaptive_llama.kernel.native import set_pass_threads
from adaptive_llama.llama.chain import SamplerChain
from adaptive_llama.runtime.models import BUNDLED

MODELS = ("smollm2", "qwen2.5-coder-1.5b", "gemma3-270m")


def ways(n_vocab: int, threads: int) -> dict:
    """name -> (chain, how one token is chosen with it, the kernel's pass threads)."""
    out = {}

    def add(name, spec, backend, through_chain, record=True, passes=1):
        use_backend(backend)
        c = SamplerChain(spec, 1, n_vocab, record_stats=record)
        if through_chain:
            out[name] = (c, lambda ctx: llama_cpp.llama_sampler_sample(c.pointer, ctx, -1),
                         passes)
        else:
            out[name] = (c, lambda ctx: c.sample(ctx, -1), passes)

    add("greedy, chain", "greedy", "c", True)
    add("greedy, row [c]", "greedy", "c", False)
    for backend in BACKENDS:
        for temp in ("", ",temp=0.7"):
            for record in (False, True):
                label = f"{'' if record else ', no stats'}{' T 0.7' if temp else ''} [{backend}]"
                spec = f"adaptive:eps=0.0005{temp}"
                add(f"adaptive, chain{label}", spec, backend, True, record)
                add(f"adaptive, row{label}", spec, backend, False, record)
    if threads > 1:
        for temp in ("", ",temp=0.7"):
            add(f"adaptive, row, no stats{' T 0.7' if temp else ''} [c, {threads} threads]",
                f"adaptive:eps=0.0005{temp}", "c", False, False, threads)
    return out


def time_round(choose, ctx, calls: int) -> float:
    """Median microseconds of one choice over ``calls`` calls."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        choose(ctx)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def measure(engine: Engine, rounds: int, calls: int, threads: int) -> dict:
    engine.prefill(engine.tokenize(PROMPT))
    chosen = ways(engine.n_vocab, threads)
    samples = {name: [] for name in chosen}
    try:
        for _ in range(rounds):
            for name, (_, choose, passes) in chosen.items():
                set_pass_threads(passes)
                samples[name].append(time_round(choose, engine.ctx, calls))
    finally:
        set_pass_threads(1)
        for c, _, _ in chosen.values():
            c.close()
    medians = {name: statistics.median(v) for name, v in samples.items()}
    yardstick = medians["greedy, chain"]
    return {"us_per_token": {k: round(v, 1) for k, v in medians.items()},
            "ratio_to_greedy_chain": {k: round(v / yardstick, 3) for k, v in medians.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--model", action="append", default=None,
                        help="a GGUF file to time instead of the bundled models (repeatable)")
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for the C kernel's passes (default: the engine's)")
    args = parser.parse_args()
    results = {}
    for name in args.model or MODELS:
        if args.model is None and not BUNDLED[name].installed():
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        print(f"{name}: timing", file=sys.stderr, flush=True)
        engine = Engine(name, n_ctx=256, n_gpu_layers=args.n_gpu_layers)
        try:
            threads = args.threads or engine.threads
            results[name] = {"vocab": engine.n_vocab, "threads": threads,
                             **measure(engine, args.rounds, args.calls, threads)}
        finally:
            engine.close()
    print(json.dumps({"benchmark": "row", "rounds": args.rounds, "calls": args.calls,
                      "machine": platform.processor() or platform.machine(),
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()

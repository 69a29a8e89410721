"""Decode speed with the chain on the CPU against the chain inside llama.cpp's graph.

For each installed bundled model (or --model PATH): decode tokens/s of greedy and adaptive,
each with the sampler chain on the CPU (llama.cpp copies all V logits to the host every token)
and inside the graph (backend sampling: only the kept candidates and the token come back).
Rounds interleave the four, medians; ratios to greedy on the CPU chain of the same run. With
--parallel N, also the aggregate tokens/s of N sequences decoded together (what
``serve --parallel N`` does per step). Progress on stderr, one JSON object on stdout.

    python benchmarks/bench_graph.py [--n-gpu-layers -1] [--rounds 5] [--tokens 128]
                                     [--parallel 8] [--model PATH] [--spec NAME=SPEC ...]

On a CPU-only machine the graph runs on ggml's CPU backend: this measures what backend
sampling costs there, not what it saves on a GPU (the GPU kit, benchmarks/gpu/, runs it on one).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from adaptive_llama import Engine
from adaptive_llama.eval.timing import PROMPT
from adaptive_llama.runtime.models import BUNDLED

SPECS = {"greedy": "greedy", "adaptive": "adaptive:eps=0.0005"}


def engines(path, args) -> dict[str, Engine]:
    common = dict(n_ctx=1024, n_gpu_layers=args.n_gpu_layers, parallel=args.parallel)
    if args.threads:
        common["n_threads"] = args.threads
    return {"cpu_chain": Engine(path, **common),
            "in_graph": Engine(path, backend_sampling=True, **common)}


QUEUE = 4  # prompts per slot in a batch round: slots refill when a reply ends early


def one_round(engine: Engine, spec: str, tokens: int, parallel: int) -> float:
    """Tokens per second: one sequence, or ``parallel`` together (aggregate). A sampled reply
    can end long before ``tokens`` (greedy's never do here): with only ``parallel`` prompts
    the batch would then run emptier than greedy's, so QUEUE times as many wait their turn
    (continuous batching, as a busy server runs) and the slots stay full but for the tail."""
    if parallel == 1:
        result = engine.generate(PROMPT, sampler=spec, max_tokens=tokens, stop=[])
        return result.completion_tokens / result.decode_s
    n = parallel * QUEUE
    start = time.perf_counter()
    results = engine.generate_batch([PROMPT] * n, sampler=spec, max_tokens=tokens,
                                    seed=list(range(n)))
    return sum(r.completion_tokens for r in results) / (time.perf_counter() - start)


def measure(path, args) -> dict:
    pair = engines(str(path), args)
    specs = dict(s.split("=", 1) for s in args.spec) if args.spec else SPECS
    out = {"n_vocab": pair["cpu_chain"].n_vocab, "specs": specs,
           "in_graph_available": pair["in_graph"].backend_sampling}
    for parallel in sorted({1, args.parallel}):
        speeds = {f"{name}/{where}": [] for where in pair for name in specs}
        for r in range(args.rounds):
            for key in speeds if r % 2 == 0 else reversed(list(speeds)):
                name, where = key.split("/")
                speeds[key].append(one_round(pair[where], specs[name], args.tokens, parallel))
                print(f"  {Path(path).name} x{parallel} round {r + 1} {key}: "
                      f"{speeds[key][-1]:.1f} tok/s", file=sys.stderr)
        medians = {key: round(statistics.median(v), 1) for key, v in speeds.items()}
        base = medians["greedy/cpu_chain"]
        out[f"parallel_{parallel}"] = {
            "tokens_per_s": medians,
            "ratio_to_greedy_cpu_chain": {k: round(v / base, 3) for k, v in medians.items()},
            **{f"{name}_over_greedy": {where: round(medians[f"{name}/{where}"]
                                                    / medians[f"greedy/{where}"], 3)
                                       for where in pair}
               for name in specs if name != "greedy"}}
    for engine in pair.values():
        engine.close()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--model", default=None,
                        help="a GGUF path or bundled name (default: smollm2 and gemma3-270m)")
    parser.add_argument("--threads", type=int, default=None,
                        help="llama.cpp's threads (default: the engine's)")
    parser.add_argument("--spec", action="append", metavar="NAME=SPEC",
                        help="the samplers to time, one per option; greedy must be among "
                             "them (default: greedy and adaptive:eps=0.0005)")
    args = parser.parse_args()
    paths = ([args.model] if args.model else
             [m.path() for m in BUNDLED.values() if m.installed()
              and m.name in ("smollm2", "gemma3-270m")])
    results = {}
    for path in paths:
        results[Path(path).name] = measure(path, args)
    print(json.dumps({"benchmark": "graph", "machine": platform.machine(), "threads": args.threads,
                      "n_gpu_layers": args.n_gpu_layers, "rounds": args.rounds,
                      "tokens": args.tokens, "results": results}, indent=2))


if __name__ == "__main__":
    main()

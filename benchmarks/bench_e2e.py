"""End-to-end decode speed: adaptive against greedy and the usual samplers, same model, one run.

For each model: every sampler generates the same prompt, rounds interleaved (greedy, adaptive,
..., greedy, adaptive, ...) so that machine load hits them alike; medians of decode tokens/s
(prompt evaluation excluded) and the ratio to greedy. Also the sampler-only cost per token
(the chain applied to real logits, no decode), and RSS before and after a long generation.
Prints one JSON object.

    python benchmarks/bench_e2e.py [--models smollm2 gemma3-270m] [--rounds 5] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import llama_cpp

from adaptive_llama import Engine
from adaptive_llama.sampler import SamplerChain

SAMPLERS = ["greedy", "adaptive:eps=0.0005", "min-p:p=0.05", "top-p:p=0.95", "eta:eps=0.0009"]
PROMPT = "The history of the printing press begins in"


def llama_cpp_python_default_chain(engine):
    """llama-cpp-python's own default chain (top_k 40, top_p .95, min_p .05, temp .8, dist)."""
    return engine.llama._init_sampler()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def decode_speed(engine, spec, tokens):
    result = engine.generate(PROMPT, sampler=spec, max_tokens=tokens, seed=1)
    # A sampler that hits end-of-text early is measured on what it produced.
    return result.decode_tokens_per_s, result.completion_tokens, result.mean_k


def sampler_cost_us(engine, make_chain, rounds=200):
    """Median microseconds of one llama_sampler_sample on the current logits (no decode)."""
    engine._prefill(engine.tokenize(PROMPT))
    ctx = engine.llama._ctx.ctx
    chain = make_chain()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        chain.sample(ctx, -1) if isinstance(chain, SamplerChain) else chain.sample(
            engine.llama._ctx, -1)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    chain.close()
    return statistics.median(times)


def bench_model(name, rounds, tokens, soak_tokens):
    engine = Engine(name, seed=1, n_ctx=1024)
    out = {"model": name, "n_vocab": engine.n_vocab, "tokens_per_run": tokens}
    samples = {s: [] for s in SAMPLERS}
    mean_k = []
    decode_speed(engine, "greedy", 8)  # warm up
    for _ in range(rounds):
        for spec in SAMPLERS:
            speed, n, k = decode_speed(engine, spec, tokens)
            samples[spec].append(speed)
            if k is not None:
                mean_k.append(k)
    med = {s: statistics.median(v) for s, v in samples.items()}
    out["decode_tokens_per_s_median"] = {s: round(v, 2) for s, v in med.items()}
    out["ratio_to_greedy"] = {s: round(v / med["greedy"], 3) for s, v in med.items()}
    out["adaptive_mean_k"] = round(statistics.fmean(mean_k), 2) if mean_k else None
    out["adaptive_target_met_0.97x_greedy"] = out["ratio_to_greedy"]["adaptive:eps=0.0005"] >= 0.97
    out["sampler_us_per_token_median"] = {
        "adaptive:eps=0.0005": round(sampler_cost_us(
            engine, lambda: SamplerChain("adaptive:eps=0.0005", 1, engine.n_vocab)), 1),
        "greedy": round(sampler_cost_us(
            engine, lambda: SamplerChain("greedy", 1, engine.n_vocab)), 1),
        "llama_cpp_python_default_chain": round(sampler_cost_us(
            engine, lambda: llama_cpp_python_default_chain(engine)), 1),
    }
    if soak_tokens:
        before = rss_mb()
        done = 0
        while done < soak_tokens:
            r = engine.generate(PROMPT, sampler="adaptive:eps=0.0005", max_tokens=500,
                                seed=done)
            done += r.completion_tokens
        out["soak"] = {"tokens": done, "rss_mb_before": round(before, 1),
                       "rss_mb_after": round(rss_mb(), 1)}
    engine.close()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--soak-tokens", type=int, default=10_000)
    args = parser.parse_args()
    results = [bench_model(m, args.rounds, args.tokens, args.soak_tokens) for m in args.models]
    print(json.dumps({"benchmark": "e2e", "llama_cpp_python": llama_cpp.__version__,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()

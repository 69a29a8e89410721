"""End-to-end decode speed: adaptive against greedy and the usual samplers, same model, one run.

For each model: every sampler generates the same prompt, rounds interleaved (greedy, adaptive,
..., greedy, adaptive, ...) so that machine load hits them alike; medians of decode tokens/s
(prompt evaluation excluded) and the ratio to greedy. Two families, each with its own greedy:

- ``engine``: our Engine, every spec a native llama.cpp chain (what adaptive-llama runs);
- ``llama_cpp_python``: plain ``Llama.create_completion(stream=True)``: its default chain
  (top_k 40, top_p .95, min_p .05, temp .8), top-p 0.95 with top_k 0, and the paper's
  algorithm ported naively (float64 numpy, full sort) as a Python ``logits_processor``.
  Tokens/s there is (chunks - 1) / (last chunk - first chunk), so prompt evaluation is out.

And ``bare_llama_decode_loop_argmax``: the runtime's limit (llama-cpp-python's low-level API,
one llama_decode per token, numpy argmax, same context size and threads), with each engine
spec's ratio to it (``ratio_to_bare_loop``). Also the sampler-only cost per token (the chain applied to real logits, no decode), and RSS
before and after a long generation. Progress goes to stderr; prints one JSON object.

    python benchmarks/bench_e2e.py [--models smollm2 gemma3-270m] [--rounds 5] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import _internals

from adaptive_llama import Engine
from adaptive_llama.eval.timing import PROMPT, sampler_latency_us
from adaptive_llama.kernel import adaptive_k_reference
from adaptive_llama.llama.chain import SamplerChain
from adaptive_llama.runtime.threads import default_threads

SAMPLERS = ["greedy", "adaptive:eps=0.0005", "min-p:p=0.05", "top-p:p=0.95", "eta:eps=0.0009",
            "p-less", "top-h:alpha=0.4", "adaptive-p:target=0.5", "top-n-sigma:n=1"]
NAIVE = "naive_python_adaptive:eps=0.0005"
BARE = "bare_llama_decode_loop_argmax"
# create_completion keyword arguments for each llama-cpp-python configuration.
LLAMA_CPP_PYTHON = {
    "greedy": dict(temperature=0.0),
    "default_chain": dict(),  # top_k 40, top_p 0.95, min_p 0.05, temperature 0.8
    "top-p:p=0.95,top_k=0": dict(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0),
    NAIVE: dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
}


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def naive_adaptive_processor(epsilon: float):
    """The paper's algorithm as people first port it: float64 numpy, full sort, per token."""
    def process(input_ids, scores):
        k = adaptive_k_reference(scores, epsilon)
        order = np.argsort(scores)[::-1]
        scores = scores.copy()
        scores[order[k:]] = -np.inf
        return scores
    return process


def llama_cpp_python_speed(llama, name, tokens, seed):
    kwargs = dict(LLAMA_CPP_PYTHON[name])
    if name == NAIVE:
        kwargs["logits_processor"] = llama_cpp.LogitsProcessorList(
            [naive_adaptive_processor(0.0005)])
    llama.reset()  # no prefix reuse across configurations
    stamps = [time.perf_counter() for _ in llama.create_completion(
        PROMPT, max_tokens=tokens, seed=seed, stream=True, **kwargs)]
    if len(stamps) < 2:
        return 0.0
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def decode_speed(engine, spec, tokens):
    result = engine.generate(PROMPT, sampler=spec, max_tokens=tokens, seed=1)
    # A sampler that hits end-of-text early is measured on what it produced.
    return result.decode_tokens_per_s, result.completion_tokens, result.mean_k


def medians_and_ratios(samples: dict) -> dict:
    med = {s: statistics.median(v) for s, v in samples.items()}
    return {"decode_tokens_per_s_median": {s: round(v, 2) for s, v in med.items()},
            "ratio_to_greedy": {s: round(v / med["greedy"], 3) for s, v in med.items()}}


def bare_loop_speed(engine, tokens: int) -> float:
    """The runtime's limit: llama-cpp-python's low-level API, one llama_decode per token,
    numpy argmax; same model, context size and threads as the engine."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = engine.n_ctx, 512, 512
    params.n_threads = params.n_threads_batch = default_threads()
    ctx = _internals.LlamaContext(model=engine._model, params=params, verbose=False)
    batch = _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
    prompt = engine.tokenize(PROMPT)
    batch.set_batch(prompt, 0, False)
    ctx.decode(batch)
    pos, n_vocab = len(prompt), engine.n_vocab
    started = time.perf_counter()
    for _ in range(tokens):
        logits = llama_cpp.llama_get_logits_ith(ctx.ctx, -1)
        token = int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())
        batch.set_batch([token], pos, False)
        ctx.decode(batch)
        pos += 1
    speed = tokens / (time.perf_counter() - started)
    batch.close()
    ctx.close()
    return speed


def has_amx() -> bool:
    """Whether this CPU has AMX, where plain llama-cpp-python's decode crashes (its AMX
    weight layout; docs/gpu.md): the engine loads without it, a plain ``Llama`` cannot."""
    try:
        return "amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def sampler_times(engine, llama) -> dict:
    """Median microseconds of one sampler call: each of ours (the rivals beside min-p, whose
    cost is their bound), and llama-cpp-python's default chain (top_k 40, top_p .95,
    min_p .05, temp .8, dist)."""
    out = {}
    for spec in SAMPLERS:
        with SamplerChain(spec, 1, engine.n_vocab) as chain:
            out[spec] = round(sampler_latency_us(engine, chain.pointer), 1)
    if llama is None:
        return out
    default_chain = llama._init_sampler()
    out["llama_cpp_python_default_chain"] = round(
        sampler_latency_us(engine, default_chain.sampler), 1)
    default_chain.close()
    return out


def bench_model(name, rounds, tokens, soak_tokens, baselines=True):
    engine = Engine(name, seed=1, n_ctx=1024)
    llama = llama_cpp.Llama(model_path=str(engine.path), n_ctx=1024, verbose=False,
                            n_threads=default_threads(), n_threads_batch=default_threads()) \
        if baselines else None
    out = {"model": name, "n_vocab": engine.n_vocab, "tokens_per_run": tokens,
           "threads": default_threads()}
    samples = {s: [] for s in SAMPLERS + [BARE]}
    baseline_samples = {s: [] for s in LLAMA_CPP_PYTHON}
    mean_k = []
    decode_speed(engine, "greedy", 8)  # warm up
    for r in range(rounds):
        progress(f"{name}: round {r + 1}/{rounds}")
        for spec in SAMPLERS:
            speed, n, k = decode_speed(engine, spec, tokens)
            samples[spec].append(speed)
            if k is not None:
                mean_k.append(k)
        samples[BARE].append(bare_loop_speed(engine, tokens))
        for config in LLAMA_CPP_PYTHON if llama is not None else ():
            baseline_samples[config].append(llama_cpp_python_speed(llama, config, tokens, r))
    out["engine"] = medians_and_ratios(samples)
    bare = statistics.median(samples[BARE])
    out["engine"]["ratio_to_bare_loop"] = {
        s: round(statistics.median(samples[s]) / bare, 3) for s in SAMPLERS}
    out["llama_cpp_python"] = medians_and_ratios(baseline_samples) if llama is not None \
        else "not run: this CPU has AMX, where plain llama-cpp-python's decode crashes"
    out["adaptive_mean_k"] = round(statistics.fmean(mean_k), 2) if mean_k else None
    ratio = out["engine"]["ratio_to_greedy"]["adaptive:eps=0.0005"]
    out["adaptive_target_met_0.97x_greedy"] = ratio >= 0.97
    out["sampler_us_per_token_median"] = sampler_times(engine, llama)
    if soak_tokens:
        progress(f"{name}: soak, {soak_tokens} tokens")
        before = rss_mb()
        done = runs = 0
        while done < soak_tokens:
            runs += 1  # a new seed every run, even one that ends at once
            r = engine.generate(PROMPT, sampler="adaptive:eps=0.0005", max_tokens=500,
                                seed=runs)
            done += r.completion_tokens
        out["soak"] = {"tokens": done, "rss_mb_before": round(before, 1),
                       "rss_mb_after": round(rss_mb(), 1)}
    engine.close()
    if llama is not None:
        llama.close()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--soak-tokens", type=int, default=10_000)
    args = parser.parse_args()
    baselines = not has_amx()
    if not baselines:
        progress("this CPU has AMX: plain llama-cpp-python's decode crashes there, so its "
                 "family is left out")
    results = [bench_model(m, args.rounds, args.tokens, args.soak_tokens, baselines)
               for m in args.models]
    print(json.dumps({"benchmark": "e2e", "llama_cpp_python": llama_cpp.__version__,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()

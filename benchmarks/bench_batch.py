"""Many sequences at once: the batched engine, `serve --parallel`, and the runtime's limit.

Prints one JSON object (progress on stderr). Medians of interleaved rounds; every ratio is
taken inside this run. Measured:

- ``batched``: aggregate tokens/s of ``Engine.generate_batch`` (B prompts, B slots) against a
  bare batched llama_decode loop (llama-cpp-python's low-level API, one llama_batch holding a
  token of every sequence, numpy argmax per row) at B = 1, 2, 4, 8, 16, same threads;
- ``serve``: aggregate tokens/s of ``adaptive-llama serve --parallel P`` answering C
  concurrent clients (P = 1, 4 and C), each asking for the same number of tokens, and a bare
  batched loop making the same number of tokens per request;
- ``soak``: RSS before and after 10,000 tokens with sequences joining and leaving;
- ``sampling``: aggregate tokens/s of ``generate_batch`` (8 sequences) per sampler, at
  SmolLM2's vocabulary (49,152) and Gemma-3's (262,144, when installed), with a step's
  chains run one after another in one thread (``one_thread``), always side by side in one
  group per decoding thread (``threads``), and as the decoder chooses (``default``: threads
  for chains that take at least ``PARALLEL_FROM_S``); the decode is the same in all three;
- ``sharing``: the GSM8K evaluation's shape (each chat question under its 10 samplers, asked
  for one after another, B slots): texts and tokens per second with prompts sharing a
  prefix copied between slots (``SHARE_FROM``) and with every prompt evaluated in full;
  and what one copy costs against evaluating one prompt token.

Run on a quiet machine: llama.cpp's threads spin, so anything else running skews it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import llama_cpp
import numpy as np
from llama_cpp import _internals

from adaptive_llama import Engine
from adaptive_llama.eval.tasks import GSM8K_PROMPT, gsm8k_specs
from adaptive_llama.runtime.batching import PARALLEL_FROM_S, SHARE_FROM
from adaptive_llama.runtime.models import BUNDLED
from adaptive_llama.runtime.threads import default_threads

PROMPTS = ["The history of the printing press begins in", "Once upon a time a small dog",
           "Rivers of Europe include the", "In 1905 the physicist published",
           "The recipe needs three eggs and", "A good night's sleep is", "The old lighthouse",
           "Photosynthesis is the process by which"]
SPEC = "adaptive:eps=0.0005"


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + f" ({i})" * (i >= len(PROMPTS)) for i in range(n)]


def engine_rate(engine: Engine, b: int, tokens: int, seed: int) -> tuple[float, list[int]]:
    """(generated tokens per second of wall time, prompts included; tokens per sequence)."""
    engine.clear_cache()
    t0 = time.perf_counter()
    results = engine.generate_batch(prompts(b), sampler=SPEC, seed=list(range(seed, seed + b)),
                                    max_tokens=tokens)
    counts = [r.completion_tokens for r in results]
    return sum(counts) / (time.perf_counter() - t0), counts


def bare_rate(model, ctx, batch, counts: list[int]) -> float:
    """The runtime's limit: the sequences in one llama_batch per step, argmax per row, each
    retired after as many tokens as the run it is compared with made for it (sequences that
    end early leave smaller batches behind, in both)."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx.ctx), True)
    t0 = time.perf_counter()
    seqs = [model.tokenize(p.encode(), True, False) for p in prompts(len(counts))]
    batch.reset()
    for s, toks in enumerate(seqs):
        batch.add_sequence(toks, s, False)
    ctx.decode(batch)
    rows = dict(enumerate(np.cumsum([len(t) for t in seqs]) - 1))  # sequence -> logits row
    pos = [len(t) for t in seqs]
    n_vocab, made, step = model.n_vocab(), 0, 0
    while rows:
        nxt = {s: int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, int(i)),
                                            shape=(n_vocab,)).argmax()) for s, i in rows.items()}
        made += len(nxt)
        step += 1
        live = [s for s in nxt if counts[s] > step]
        raw = batch.batch
        raw.n_tokens = len(live)
        for i, s in enumerate(live):
            raw.token[i], raw.pos[i], raw.n_seq_id[i], raw.logits[i] = nxt[s], pos[s], 1, True
            raw.seq_id[i][0] = s
            pos[s] += 1
        if live:
            ctx.decode(batch)
        rows = {s: i for i, s in enumerate(live)}
    return made / (time.perf_counter() - t0)


def bare_context(model, b: int, n_ctx: int, threads: int):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx * b, b, False
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = threads
    return (_internals.LlamaContext(model=model, params=params, verbose=False),
            _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False))


def bench_batched(model_name: str, sizes: list[int], rounds: int, tokens: int) -> dict:
    threads = default_threads()
    out = {}
    for b in sizes:
        engine = Engine(model_name, n_ctx=256, parallel=b, n_threads=threads, seed=1)
        ctx, batch = bare_context(engine._model, b, 256, threads)
        ours, bare = [], []
        for r in range(rounds):
            progress(f"batched: B={b} round {r + 1}/{rounds}")
            rate, counts = engine_rate(engine, b, tokens, r * 100)
            ours.append(rate)
            bare.append(bare_rate(engine._model, ctx, batch, counts))
        batch.close()
        ctx.close()
        engine.close()
        med, med_bare = statistics.median(ours), statistics.median(bare)
        out[b] = {"engine_tokens_per_s": round(med, 1), "bare_loop_tokens_per_s": round(med_bare, 1),
                  "engine_vs_bare": round(med / med_bare, 3)}
    first = out[sizes[0]]["engine_tokens_per_s"]
    for b in sizes:
        out[b]["vs_one_sequence"] = round(out[b]["engine_tokens_per_s"] / first, 3)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_rate(model_path: str, parallel: int, clients: int, tokens: int, rounds: int):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "adaptive_llama.cli", "serve", model_path,
                             "--port", str(port), "--parallel", str(parallel), "--ctx", "256",
                             "--max-queue", str(clients)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/health")
                break
            except OSError:
                time.sleep(0.2)
        rates, counts = [], []
        for r in range(rounds):
            made = [0] * clients

            def ask(i):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                conn.request("POST", "/v1/completions", json.dumps({
                    "prompt": prompts(clients)[i], "max_tokens": tokens, "seed": r * 100 + i,
                    "sampler": SPEC}))
                made[i] = json.loads(conn.getresponse().read())["usage"]["completion_tokens"]

            workers = [threading.Thread(target=ask, args=(i,)) for i in range(clients)]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            rates.append(sum(made) / (time.perf_counter() - t0))
            counts.append(made)
        return rates, counts
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bench_serve(model_name: str, clients: int, rounds: int, tokens: int) -> dict:
    path = str(BUNDLED[model_name].path()) if model_name in BUNDLED else model_name
    levels = sorted({1, 4, clients})  # 4: the default of --parallel
    samples = {**{p: [] for p in levels}, "bare": []}
    model = _internals.LlamaModel(path_model=path, params=llama_cpp.llama_model_default_params(),
                                  verbose=False)
    ctx, batch = bare_context(model, clients, 256, default_threads())
    for r in range(rounds):  # interleaved: one round of each, again and again
        for parallel in levels:
            progress(f"serve: --parallel {parallel}, {clients} clients, round {r + 1}/{rounds}")
            rates, counts = serve_rate(path, parallel, clients, tokens, 1)
            samples[parallel] += rates
        # The same requests' token counts through a bare batched loop in this process.
        samples["bare"].append(bare_rate(model, ctx, batch, counts[0]))
    batch.close()
    ctx.close()
    model.close()
    med = {p: statistics.median(v) for p, v in samples.items()}
    return {"clients": clients, "tokens_per_request": tokens,
            "tokens_per_s": {f"parallel_{p}" if p != "bare" else "bare_batched_loop": round(v, 1)
                             for p, v in med.items()},
            f"parallel_{clients}_vs_parallel_1": round(med[clients] / med[1], 3),
            f"parallel_{clients}_vs_bare_batched_loop": round(med[clients] / med["bare"], 3)}


def rss_mb() -> float:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def soak(model_name: str, total: int) -> dict:
    engine = Engine(model_name, n_ctx=256, parallel=4, seed=1)
    engine.generate_batch(prompts(4), sampler=SPEC, max_tokens=16)  # warm up
    before, made, round_ = rss_mb(), 0, 0
    while made < total:
        round_ += 1
        n = 1 + round_ % 6  # 1..6 prompts: sequences join and leave the 4 slots
        results = engine.generate_batch(prompts(n), sampler=SPEC, max_tokens=48,
                                        seed=[round_ * 10 + i for i in range(n)])
        made += sum(r.completion_tokens for r in results)
    engine.close()
    return {"tokens": made, "rss_mb_before": round(before, 1), "rss_mb_after": round(rss_mb(), 1)}


SAMPLING_SPECS = ["adaptive:eps=0.0005", "top-p:p=0.95", "typical:p=0.95", "min-p:p=0.05",
                  "mirostat:tau=5,eta=0.1"]


def bench_sampling(models: list[str], b: int, rounds: int, tokens: int) -> dict:
    out = {}
    for name in models:
        if name in BUNDLED and not BUNDLED[name].installed():
            continue
        engine = Engine(name, n_ctx=256, parallel=b, n_threads=default_threads(), seed=1)
        decoder = engine.decoder  # tuner.threads: its groups; llama.cpp's threads stay as set
        modes = {"one_thread": (1, PARALLEL_FROM_S),
                 "threads": (decoder.tuner.max_threads, 0.0),
                 "default": (decoder.tuner.max_threads, PARALLEL_FROM_S)}
        out[name] = {"n_vocab": engine.n_vocab}
        for spec in SAMPLING_SPECS:
            rates = {mode: [] for mode in modes}
            for r in range(rounds):  # interleaved
                for mode, (groups, parallel_from_s) in modes.items():
                    progress(f"sampling: {name} {spec} {mode} round {r + 1}/{rounds}")
                    decoder.tuner.threads, decoder.parallel_from_s = groups, parallel_from_s
                    engine.clear_cache()
                    t0 = time.perf_counter()
                    made = engine.generate_batch(prompts(b), sampler=spec, max_tokens=tokens,
                                                 seed=list(range(r * 100, r * 100 + b)))
                    rates[mode].append(sum(x.completion_tokens for x in made)
                                       / (time.perf_counter() - t0))
            med = {mode: statistics.median(v) for mode, v in rates.items()}
            out[name][spec] = {
                **{f"{mode}_tokens_per_s": round(v, 1) for mode, v in med.items()},
                **{f"{mode}_vs_one_thread": round(med[mode] / med["one_thread"], 3)
                   for mode in ("threads", "default")}}
        engine.close()
    return out


# Word problems of GSM8K's length (its test set is an optional install).
QUESTIONS = [
    "A bakery sells muffins for $3 each and cookies for $1.50 each. On Saturday it sold 48 "
    "muffins and twice as many cookies. It spent $65 on ingredients that day. How much "
    "profit did the bakery make on Saturday?",
    "Maya reads 12 pages of her book every weekday and 20 pages on each day of the weekend. "
    "Her book has 368 pages. How many full weeks does she need to finish it?",
    "A farmer has 15 rows of apple trees with 24 trees in each row. Each tree gives 35 kg of "
    "apples, and he sells the apples in crates of 20 kg. How many crates does he fill?",
    "A train leaves at 9:15 and travels 210 km at 84 km per hour, then stops for 20 minutes "
    "and travels another 96 km at 64 km per hour. At what time does it arrive?",
]


def bench_sharing(model_name: str, b: int, rounds: int, tokens: int) -> dict:
    engine = Engine(model_name, n_ctx=1024, parallel=b, n_threads=default_threads(), seed=1)
    decoder, specs = engine.decoder, gsm8k_specs()
    texts = [GSM8K_PROMPT.format(question=q) for q in QUESTIONS for _ in specs]
    samplers = specs * len(QUESTIONS)
    modes = {"shared": SHARE_FROM, "separate": 10**9}
    rates = {mode: ([], []) for mode in modes}
    for r in range(rounds):  # interleaved
        for mode, share_from in modes.items():
            progress(f"sharing: {mode} round {r + 1}/{rounds}")
            decoder.share_from = share_from
            engine.clear_cache()
            t0 = time.perf_counter()
            made = engine.generate_batch(texts, chat=True, sampler=samplers, max_tokens=tokens,
                                         seed=list(range(r * 1000, r * 1000 + len(texts))))
            wall = time.perf_counter() - t0
            rates[mode][0].append(len(made) / wall)
            rates[mode][1].append(sum(x.completion_tokens for x in made) / wall)
    out = {"slots": b, "texts": len(texts), "max_tokens": tokens,
           "prompt_tokens": statistics.mean(x.prompt_tokens for x in made)}
    for mode, (texts_per_s, tokens_per_s) in rates.items():
        out[f"{mode}_texts_per_s"] = round(statistics.median(texts_per_s), 3)
        out[f"{mode}_tokens_per_s"] = round(statistics.median(tokens_per_s), 1)
    out["shared_vs_separate"] = round(out["shared_texts_per_s"] / out["separate_texts_per_s"], 3)
    out.update(copy_cost(engine, rounds * 5))
    engine.close()
    return out


def copy_cost(engine: Engine, repeats: int) -> dict:
    """Seconds of a one-token decode in slot 1 right after copying slot 0's cache into it,
    less those of the same decode without, against one token's share of a 64-token prompt."""
    memory, decoder = llama_cpp.llama_get_memory(engine.ctx), engine.decoder
    engine.clear_cache()
    prompt = engine.tokenize(" ".join(QUESTIONS))[:64]

    def timed(decode) -> float:
        t0 = time.perf_counter()
        decode()
        return time.perf_counter() - t0

    def one_token(copy: bool) -> float:
        llama_cpp.llama_memory_seq_rm(memory, 1, 0, -1)
        if copy:
            llama_cpp.llama_memory_seq_cp(memory, 0, 1, -1, -1)
            llama_cpp.llama_memory_seq_rm(memory, 1, 0, -1)  # the data moves all the same
        decoder._put(0, prompt[0], decoder.slots[1], 0, True)
        decoder._batch.n_tokens = 1
        return timed(decoder._decode)

    def whole_prompt() -> float:
        decoder.forget()
        return timed(lambda: decoder.evaluate(prompt))

    prompt_s = statistics.median(whole_prompt() for _ in range(3))
    with_copy, without = [], []
    for _ in range(repeats):
        with_copy.append(one_token(True))
        without.append(one_token(False))
    copy_s = max(statistics.median(with_copy) - statistics.median(without), 0.0)
    engine.clear_cache()
    return {"copy_ms": round(copy_s * 1e3, 3),
            "prompt_token_ms": round(prompt_s / len(prompt) * 1e3, 3),
            "copy_in_prompt_tokens": round(copy_s / (prompt_s / len(prompt)), 2)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--soak-tokens", type=int, default=10_000)
    parser.add_argument("--sampling-models", default="smollm2,gemma3-270m")
    parser.add_argument("--sharing-tokens", type=int, default=256,
                        help="the sharing section's tokens per text (GSM8K's answers run "
                             "about 200)")
    parser.add_argument("--sections", default="batched,serve,soak,sampling,sharing",
                        help="which parts to run, comma-separated")
    args = parser.parse_args()
    sections = args.sections.split(",")
    out = {"benchmark": "batch", "model": args.model, "threads": default_threads(),
           "sampler": SPEC}
    if "batched" in sections:
        out["batched"] = bench_batched(args.model, args.sizes, args.rounds, args.tokens)
    if "serve" in sections:
        out["serve"] = bench_serve(args.model, args.clients, args.rounds, args.tokens)
    if "soak" in sections and args.soak_tokens:
        progress(f"soak: {args.soak_tokens} tokens")
        out["soak"] = soak(args.model, args.soak_tokens)
    if "sampling" in sections:
        out["sampling"] = bench_sampling(args.sampling_models.split(","), 8, args.rounds,
                                         args.tokens)
    if "sharing" in sections:
        out["sharing"] = bench_sharing(args.model, max(args.sizes), args.rounds,
                                       args.sharing_tokens)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""What reproducible replies cost: prompt evaluation and decoding, canonical against the
ways llama.cpp would otherwise run.

Same seed, same reply (README, "Reproducibility") needs two things of the engine: prompts
evaluated in chunks aligned to 64 positions, each decoded alone (adaptive_llama.runtime.batching),
and, on the CPU, no flash attention. Three engines on the same model, rounds interleaved:

- canonical: the engine as it ships (64-token chunks, no flash attention);
- one batch: prompts in batches of up to 512 tokens, no flash attention (chunking's cost);
- flash attention: 512-token batches with llama.cpp's CPU flash attention (its default).

Each round evaluates a prompt of each length from an empty cache, and decodes 64 tokens
after the longest (greedy). One JSON object on stdout: medians of prompt tokens/s and decode
tokens/s, and the ratios to "flash attention". Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from adaptive_llama import Engine
from adaptive_llama.eval.timing import PROMPT
from adaptive_llama.runtime import batching as decoder


class FlashAttentionEngine(Engine):
    """The engine with llama.cpp's default attention (flash attention on the CPU)."""

    def _new_context(self, *args):
        self.batch_invariant = False
        return super()._new_context(*args)


def prompt_rate(engine, tokens, chunk) -> float:
    decoder.CHUNK = chunk
    engine.clear_cache()
    started = time.perf_counter()
    engine.prefill(tokens)
    return len(tokens) / (time.perf_counter() - started)


def decode_rate(engine, tokens, chunk, n) -> float:
    decoder.CHUNK = chunk
    engine.clear_cache()
    result = engine.stream(tokens, sampler="greedy", max_tokens=n)
    result.text()
    return result.result.decode_tokens_per_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", default="100,500,1500")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    canonical_chunk = decoder.CHUNK
    options = dict(n_ctx=2048, n_threads=args.threads)
    engines = {"canonical": (Engine(args.model, **options), canonical_chunk),
               "one batch": (Engine(args.model, **options), 512),
               "flash attention": (FlashAttentionEngine(args.model, **options), 512)}
    base = engines["canonical"][0].tokenize(PROMPT * 200)
    prompt = {n: base[:n] for n in lengths}
    rates = {name: {**{n: [] for n in lengths}, "decode": []} for name in engines}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name, (engine, chunk) in engines.items():
            for n in lengths:
                rates[name][n].append(prompt_rate(engine, prompt[n], chunk))
            rates[name]["decode"].append(decode_rate(engine, prompt[max(lengths)], chunk, 64))
    decoder.CHUNK = canonical_chunk
    medians = {name: {str(k): round(statistics.median(v), 1) for k, v in r.items()}
               for name, r in rates.items()}
    ratios = {name: {k: round(v / medians["flash attention"][k], 3) for k, v in m.items()}
              for name, m in medians.items()}
    print(json.dumps({"benchmark": "determinism", "model": args.model,
                      "threads": engines["canonical"][0].threads, "rounds": args.rounds,
                      "prompt_tokens_per_s_and_decode": medians,
                      "ratio_to_flash_attention": ratios}))


if __name__ == "__main__":
    main()

"""What each way of computing attention on the CPU costs, against llama.cpp's own default.

Same seed, same reply (README, "Reproducibility") and speculation that never changes the text
(docs/performance.md) both need a token's logits to be the same whatever batch it was
computed in. llama.cpp's CPU flash attention is not (adaptive_llama.llama.cpu_attention),
so the options are:

- flash: llama.cpp's default, flash attention with its tiled and split kernels;
- off: no flash attention (what the engine ran before);
- reference: flash attention through ggml's one-row reference kernel throughout;
- engine: the engine's own prefill and generate with reference attention (as with a
  draft): prompts in 64-token chunks through llama.cpp's tiled kernel (each chunk is always
  evaluated alone, the same way), every other row (a reply's tokens, drafts) through the
  reference kernel, and the sampler chain.

The first three are a bare loop of llama_decode calls: the prompt in batches of 512 tokens,
then greedy tokens one at a time (arg-max of the logits). Each round evaluates a prompt of
each length from an empty cache and decodes ``--decode`` tokens after it; rounds are
interleaved. One JSON object on stdout: medians of prompt and decode tokens/s, and their
ratios to "flash". Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import _internals

from adaptive_llama import Engine
from adaptive_llama.eval.timing import PROMPT
from adaptive_llama.llama import cpu_attention
from adaptive_llama.runtime.limits import N_BATCH

MODES = ("flash", "off", "reference")


class BareLoop:
    """One llama.cpp context of the engine's model, with the given attention."""

    def __init__(self, engine: Engine, mode: str, n_ctx: int, threads: int):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED if mode == "off"
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED)
        with (cpu_attention.reference_attention() if mode == "reference"
              else contextlib.nullcontext()):
            self.context = _internals.LlamaContext(model=engine._model, params=params,
                                                   verbose=False)
        self.ctx = self.context.ctx
        self.n_vocab = engine.n_vocab
        self.batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)

    def _decode(self, tokens: list[int], first: int) -> None:
        for j, token in enumerate(tokens):
            self.batch.token[j], self.batch.pos[j] = token, first + j
            self.batch.n_seq_id[j], self.batch.seq_id[j][0] = 1, 0
            self.batch.logits[j] = j == len(tokens) - 1
        self.batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")

    def rates(self, prompt: list[int], n_decode: int) -> tuple[float, float]:
        """(prompt tokens/s, decode tokens/s) from an empty cache."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        started = time.perf_counter()
        for first in range(0, len(prompt), N_BATCH):
            self._decode(prompt[first:first + N_BATCH], first)
        prompt_s = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(n_decode):
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1),
                                        shape=(self.n_vocab,))
            self._decode([int(row.argmax())], len(prompt) + i)
        return len(prompt) / prompt_s, n_decode / (time.perf_counter() - started)


def engine_rates(engine: Engine, prompt: list[int], n_decode: int) -> tuple[float, float]:
    engine.clear_cache()
    started = time.perf_counter()
    engine.prefill(prompt)
    prompt_rate = len(prompt) / (time.perf_counter() - started)
    engine.clear_cache()
    stream = engine.stream(prompt, sampler="greedy", max_tokens=n_decode)
    stream.text()
    return prompt_rate, stream.result.decode_tokens_per_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", default="100,1000,4000")
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded per length")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    n_ctx = max(lengths) + args.decode + 256
    engine = Engine(args.model, n_ctx=n_ctx, n_threads=args.threads, reference_attention=True)
    threads = engine.threads
    loops = {mode: BareLoop(engine, mode, n_ctx, threads) for mode in MODES}
    base = engine.tokenize(PROMPT * 400)
    prompts = {n: base[:n] for n in lengths}
    names = (*MODES, "engine")
    rates = {name: {f"{what}@{n}": [] for n in lengths for what in ("prompt", "decode")}
             for name in names}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name in names:
            for n in lengths:
                prompt_rate, decode_rate = (
                    engine_rates(engine, prompts[n], args.decode) if name == "engine"
                    else loops[name].rates(prompts[n], args.decode))
                rates[name][f"prompt@{n}"].append(prompt_rate)
                rates[name][f"decode@{n}"].append(decode_rate)
    medians = {name: {k: round(statistics.median(v), 1) for k, v in r.items()}
               for name, r in rates.items()}
    ratios = {name: {k: round(v / medians["flash"][k], 3) for k, v in m.items()}
              for name, m in medians.items()}
    print(json.dumps({"benchmark": "attention", "model": args.model, "threads": threads,
                      "rounds": args.rounds, "decode_tokens": args.decode,
                      "engine_attention": engine.attention,
                      "tokens_per_s": medians, "ratio_to_flash": ratios}))


if __name__ == "__main__":
    main()

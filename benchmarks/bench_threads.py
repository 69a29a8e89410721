"""Decode and prompt-evaluation speed by thread count, quiet and beside one busy process.

Three thread settings on the same model: 1 thread, every physical core (fixed), and the
default (every physical core, adapted by the ThreadTuner). Each answers the same chat
message, rounds interleaved, in three conditions: the machine quiet; one other process
spinning on a core all along; and that, with a fresh engine for every answer (what
`adaptive-llama generate` does: its first decode is the prompt). Warm engines are left alone
for a pause before each answer (a user typing, an idle server), which is where the thread
count for the prompt is chosen; their prompt cache is cleared so that every prompt is
evaluated in full. Medians of decode tokens/s and of prompt-evaluation seconds (from the
request to its first token); one JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from adaptive_llama import Engine
from adaptive_llama.runtime.threads import STALE_S, default_threads

FRESH = "one busy process, a fresh engine per answer"
CONDITIONS = ("quiet", "one busy process", FRESH)

MESSAGE = ("Summarise in two sentences why the printing press changed how knowledge spread "
           "in Europe, and name one city where early presses worked.")


def spin() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--pause", type=float, default=STALE_S + 0.5,
                        help="seconds of quiet before each answer")
    args = parser.parse_args()
    cores = default_threads()
    settings = {"1 thread": 1, f"{cores} threads (fixed)": cores, "default (adaptive)": None}
    warm = {name: Engine(args.model, n_ctx=1024, n_threads=n) for name, n in settings.items()}
    messages = [{"role": "user", "content": MESSAGE}]
    out = {"benchmark": "threads", "model": args.model, "physical_cores": cores,
           "tokens_per_run": args.tokens, "pause_s": args.pause,
           "prompt_tokens": len(warm["1 thread"].chat_prompt_tokens(messages))}
    for condition in CONDITIONS:
        hog = spin() if condition != "quiet" else None
        decode = {name: [] for name in settings}
        prompt = {name: [] for name in settings}
        ends_at = []
        try:
            for r in range(args.rounds):
                print(f"{condition}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                for name, n_threads in settings.items():
                    if condition == FRESH:
                        engine = Engine(args.model, n_ctx=1024, n_threads=n_threads)
                    else:
                        engine = warm[name]
                        engine.clear_cache()
                        time.sleep(args.pause)
                    result = engine.generate(MESSAGE, chat=True, sampler="greedy",
                                             max_tokens=args.tokens)
                    decode[name].append(result.decode_tokens_per_s)
                    prompt[name].append(result.prompt_eval_s)
                    if n_threads is None:
                        ends_at.append(engine.threads)
                    if condition == FRESH:
                        engine.close()
        finally:
            if hog:
                hog.kill()
        out[condition] = {
            "decode_tokens_per_s": {n: round(statistics.median(v), 1) for n, v in decode.items()},
            "prompt_eval_s": {n: round(statistics.median(v), 3) for n, v in prompt.items()},
            "default_ends_at_threads": ends_at}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

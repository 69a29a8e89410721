"""Decode speed by thread count, on a quiet machine and beside one busy process.

Three engines on the same model: 1 thread, every physical core (fixed), and the default
(every physical core, adapted by the ThreadTuner). Each generates the same prompt, rounds
interleaved, first with the machine quiet, then with one other process spinning on a core.
Medians of decode tokens/s; one JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from adaptive_llama import Engine
from adaptive_llama.eval.timing import PROMPT
from adaptive_llama.runtime.threads import default_threads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    cores = default_threads()
    engines = {"1 thread": Engine(args.model, n_ctx=1024, n_threads=1),
               f"{cores} threads (fixed)": Engine(args.model, n_ctx=1024, n_threads=cores),
               "default (adaptive)": Engine(args.model, n_ctx=1024)}
    out = {"benchmark": "threads", "model": args.model, "physical_cores": cores,
           "tokens_per_run": args.tokens}
    for condition in ("quiet", "one busy process"):
        hog = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
               if condition != "quiet" else None)
        speeds = {name: [] for name in engines}
        try:
            for r in range(args.rounds):
                print(f"{condition}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                for name, engine in engines.items():
                    result = engine.generate(PROMPT, sampler="greedy", max_tokens=args.tokens)
                    speeds[name].append(result.decode_tokens_per_s)
        finally:
            if hog:
                hog.kill()
        out[condition] = {name: round(statistics.median(v), 1) for name, v in speeds.items()}
        out[condition]["default_ends_at_threads"] = engines["default (adaptive)"].threads
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

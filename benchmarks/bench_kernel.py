"""Kernel speed: adaptive_k (C and numba) against one numpy softmax of the same logits.

Prints one JSON object: per vocabulary size the median microseconds per call of each method,
the ratios to the softmax measured in the same run, and whether the targets hold
(C <= 0.5x softmax, numba <= 1.0x). Methods are interleaved round by round so that load on
this shared machine hits them alike.

    python benchmarks/bench_kernel.py [--rounds 200] [--eps 0.0005]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from adaptive_llama import kernel, native
from adaptive_llama.kernel_numba import adaptive_numba

VOCAB_SIZES = (32_000, 49_152, 151_936, 262_144)
TARGETS = {"c": 0.5, "numba": 1.0}


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def naive_port(x, eps):
    """The paper's algorithm as first ported: float64 numpy, full sort, dConf for every k."""
    return int(np.flatnonzero(kernel.dconf_reference(x) > eps)[-1:].sum() + 1)


def realistic_logits(rng, V):
    """LM-like logits: a heavy head over a Gaussian bulk (p_max about 0.2 to 0.6)."""
    x = rng.normal(0.0, 2.0, V).astype(np.float32)
    head = rng.choice(V, 64, replace=False)
    x[head] += rng.uniform(6.0, 14.0, 64).astype(np.float32)
    return x


def time_once(fn, x):
    t0 = time.perf_counter_ns()
    fn(x)
    return (time.perf_counter_ns() - t0) / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--naive-rounds", type=int, default=10)
    parser.add_argument("--eps", type=float, default=5e-4)
    args = parser.parse_args()
    lib, why = native.load()
    if lib is None:
        raise SystemExit(f"the C library is not available ({why}); rebuild with a C compiler")
    eps = args.eps
    rng = np.random.default_rng(0)
    methods = {
        "softmax": softmax,
        "c": lambda x: native.adaptive_native(lib, x, eps, False),
        "numba": lambda x: adaptive_numba(x, eps, False),
        "np_sort": np.sort,
    }
    results = {}
    for V in VOCAB_SIZES:
        rows = [realistic_logits(rng, V) for _ in range(8)]
        for fn in methods.values():  # warm up: JIT, caches, workspaces
            fn(rows[0])
        samples = {name: [] for name in methods}
        for r in range(args.rounds):
            x = rows[r % len(rows)]
            for name, fn in methods.items():
                samples[name].append(time_once(fn, x))
        naive = [time_once(lambda x: naive_port(x, eps), rows[r % len(rows)])
                 for r in range(args.naive_rounds)]
        med = {name: statistics.median(v) for name, v in samples.items()}
        med["naive_full_sort_port"] = statistics.median(naive)
        ratios = {name: med[name] / med["softmax"] for name in med if name != "softmax"}
        results[str(V)] = {
            "median_us": {k: round(v, 1) for k, v in med.items()},
            "ratio_to_softmax": {k: round(v, 3) for k, v in ratios.items()},
            "targets_met": {k: ratios[k] <= t for k, t in TARGETS.items()},
            "mean_k": float(np.mean([kernel.adaptive_k(x, eps) for x in rows])),
        }
    print(json.dumps({
        "benchmark": "kernel",
        "eps": eps,
        "rounds": args.rounds,
        "machine": platform.processor() or platform.machine(),
        "results": results,
        "all_targets_met": all(all(r["targets_met"].values()) for r in results.values()),
    }, indent=2))


if __name__ == "__main__":
    main()

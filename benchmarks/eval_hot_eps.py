"""Adaptive decoding run hot at epsilons the dev sweep did not pick.

`adaptive-llama eval` picks epsilon by MAUVE on dev texts at T = 1 and runs that value in the
temperature study. Whether another epsilon holds better when run hot is a separate question:
this script takes a finished evaluation folder (its ``results.json`` names the tuned specs;
its cache holds their texts), makes adaptive's test texts at each given epsilon and
temperature (temperature before truncation, as the study does), and compares each, prefix by
prefix, with every temperature method at its tuned value and the same temperature, with
the evaluation's own paired statistics (Holm across everything this run compares, metric
by metric). New texts go into the folder's cache, so a second run only scores.

    python benchmarks/eval_hot_eps.py benchmarks/results/eval-gemma3-256 \\
        --eps 0.001,0.005 --temperatures 1.5,2.0

Writes ``hot_eps.json`` to the folder (one row per task, epsilon and temperature: diversity,
coherence, MAUVE, k, and every paired difference) and prints a summary of it as JSON.
"""

import argparse
import json
import sys
from pathlib import Path

from adaptive_llama.eval import tasks
from adaptive_llama.eval.config import EvalConfig
from adaptive_llama.eval.run import Evaluator, one_thread_scoring
from adaptive_llama.samplers import parse_spec


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def variant(eps: float) -> str:
    """How an adaptive epsilon is named among the tuned methods' texts."""
    return f"adaptive eps={eps:g}"


def tuned_specs(report: dict, task: str) -> dict[str, str]:
    """The spec each temperature method was tuned to in the evaluation."""
    methods = report["open_ended"][task]["methods"]
    return {m: methods[m]["spec"] for m in tasks.TEMPERATURE_METHODS if m in methods}


def hot_rows(ev: Evaluator, task: str, tuned: dict[str, str], eps_values: list[float],
             temperatures: list[float]) -> tuple[list, dict]:
    """The test prompts, and the texts keyed (temperature, name): each tuned method, each
    adaptive epsilon (named ``adaptive eps=<value>``), all made side by side per prefix."""
    _, test = tasks.dev_and_test(ev, task)
    tuned_adaptive = parse_spec(tuned["adaptive"])
    rows = {}
    for temp in temperatures:
        specs = {m: tasks.temperature_specs(spec, [temp])[temp] for m, spec in tuned.items()}
        for eps in eps_values:
            spec_at = tuned_adaptive.with_param("eps", eps).with_param("temp", temp)
            specs[variant(eps)] = str(spec_at)
        made = ev.generate_specs(task, "test", list(specs.values()), test, 1)
        rows.update({(temp, name): made[spec] for name, spec in specs.items()})
    return test, rows


def compare_hot(ev: Evaluator, test, rows: dict, eps_values, temperatures) -> list[dict]:
    """Each adaptive epsilon against every tuned temperature method at its temperature."""
    variants = {variant(eps) for eps in eps_values}
    names = sorted({name for _, name in rows if name not in variants})
    pairs = {(temp, variant(eps), other): (rows[temp, variant(eps)], rows[temp, other])
             for temp in temperatures for eps in eps_values for other in names}
    table = tasks.compare(ev, pairs, test)
    out = []
    for temp in temperatures:
        for eps in eps_values:
            name = variant(eps)
            scored = ev.score(rows[temp, name], test)
            out.append({"temperature": temp, "eps": eps, "spec": rows[temp, name][0]["spec"],
                        **{k: scored[k] for k in ("diversity", "coherence", "mauve", "k")},
                        "against": {other: {"spec": rows[temp, other][0]["spec"],
                                            **table[temp, name, other]} for other in names}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a finished `adaptive-llama eval` folder")
    parser.add_argument("--eps", type=floats, default=[0.001, 0.005])
    parser.add_argument("--temperatures", type=floats, default=[1.5, 2.0])
    parser.add_argument("--tasks", default="wiki,stories")
    args = parser.parse_args()
    report = json.loads((args.folder / "results.json").read_text())
    settings = dict(report["config"], out=str(args.folder), command=" ".join(sys.argv))
    for listed in ("tasks", "methods", "temperatures", "gsm8k_samplers"):
        settings[listed] = tuple(settings[listed])
    ev = Evaluator(EvalConfig(**settings))
    try:
        with one_thread_scoring():
            result = {"folder": str(args.folder), "model": report["model"],
                      "max_tokens": settings["max_tokens"], "tasks": {}}
            for task in args.tasks.split(","):
                test, rows = hot_rows(ev, task, tuned_specs(report, task), args.eps,
                                      args.temperatures)
                result["tasks"][task] = compare_hot(ev, test, rows, args.eps,
                                                    args.temperatures)
    finally:
        ev.close()
    (args.folder / "hot_eps.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary(result), indent=1))


def summary(result: dict) -> dict:
    """Per task, epsilon and temperature: MAUVE, coherence, and each paired MAUVE and
    coherence difference with its verdict (the whole table is in hot_eps.json)."""
    def cell(c):
        return f"{c['diff']:+.3f} p={c['p_holm']:.3f} {c['verdict']}"
    return {task: [{"T": r["temperature"], "eps": r["eps"], "mauve": r["mauve"][0],
                    "coherence": r["coherence"][0],
                    "against": {m: {"mauve": cell(c["mauve"]), "coherence": cell(c["coherence"])}
                                for m, c in r["against"].items()}}
                   for r in rows] for task, rows in result["tasks"].items()}


if __name__ == "__main__":
    main()

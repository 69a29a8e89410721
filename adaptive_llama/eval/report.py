"""Writes an evaluation's results: results.json, results.md and two PNG plots."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from ..samplers import parse_spec


def open_ended_settings(report: dict) -> str:
    """How the open-ended texts were made and scored; empty when a run has none (GSM8K only)."""
    if "open_ended" not in report:
        return ""
    c = report["config"]
    return (f"Embedder for coherence and MAUVE features: {report['embedder']}. "
            f"Continuations of {c['max_tokens']} tokens after {c['prefix_tokens']}-token "
            f"prefixes; {c['samples']} sample{'s' if c['samples'] != 1 else ''} per prefix. "
            "Every ± is a 95% t-interval over texts, except MAUVE: its mean and (sd) over "
            f"{c['mauve_seeds']} k-means seeds, num_buckets = texts / 10. ")


def generation_speed(report: dict) -> str:
    """How many texts this run made and how fast; a rerun over a full cache made none."""
    if not report.get("generated_texts"):
        return (f"every text came from {report.get('cache', 'generations.jsonl')}, made by "
                "earlier runs of the command.")
    return (f"{report['generated_texts']} texts generated at {report['texts_per_s']:.2f} "
            f"texts/s, {report['config']['batch']} at a time (cached texts of earlier runs "
            "not counted).")


def _pm(value, digits: int = 2, scale: float = 1.0) -> str:
    """A (mean, half-width) pair as text, "mean ± half-width"; "-" when there is none."""
    if value is None or math.isnan(value[0]):
        return "-"
    mean, half = value[0] * scale, value[1] * scale
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def _sd(value, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value[0]) else \
        f"{value[0]:.{digits}f} (sd {value[1]:.{digits}f})"


def markdown(report: dict) -> str:
    lines = [f"# Evaluation: {report['model']} (V {report['n_vocab']:,})", "",
             f"Command: `{report['command']}`", "",
             open_ended_settings(report) +
             f"Took {report['elapsed_s']:.0f} s; " + generation_speed(report), ""]
    if report.get("pending"):
        lines += [f"**Interim report**: {', '.join(report['pending'])} still to run; the "
                  "command above resumes from the texts made so far.", ""]
    for task, result in report.get("open_ended", {}).items():
        lines += open_ended_section(task, result)
    for key, section in (("ablation", ablation_section), ("penalties", penalties_section),
                         ("latency_us", latency_section), ("gsm8k", gsm8k_section)):
        if key in report:
            lines += section(report[key])
    return "\n".join(lines)


def open_ended_section(task: str, result: dict) -> list[str]:
    lines = [f"## Open-ended generation: {task}", "", f"{result['stand_in']}. "
             f"Hyperparameters picked by MAUVE on {result['n_dev']} dev prefixes "
             f"(1 sample each); figures from {result['n_test']} disjoint test prefixes.",
             "", "| method | spec | rep-2 | rep-3 | rep-4 | diversity | MAUVE | "
             "coherence | k |", "|---|---|---|---|---|---|---|---|---|"]
    for method, m in result["methods"].items():
        lines.append(
            f"| {method} | `{m['spec']}` | {_pm(m['rep2'])} | {_pm(m['rep3'])} | "
            f"{_pm(m['rep4'])} | {_pm(m['diversity'], 3)} | {_sd(m['mauve'], 3)} | "
            f"{_pm(m['coherence'], 3)} | {_sd(m['k'], 1)} |")
    if result["dev_mauve"]:
        lines += [""] + dev_sweep_table(result)
    if "paired" in result:
        lines += [""] + paired_section(result["paired"])
    if "temperatures" in result:
        lines += [""] + temperature_section(result["temperatures"])
    if "temperature_paired" in result:
        lines += [""] + temperature_paired_section(result["temperature_paired"])
    return lines + [""]


def ablation_section(rows: list[dict]) -> list[str]:
    lines = ["## Threshold ablation (adaptive)", "",
             "| epsilon | sampling in the kept set | k | kept mass | Conf | diversity | "
             "coherence |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['epsilon']} | {row['mode']} | {_sd(row['k'], 1)} | "
                     f"{_sd(row['kept_mass'], 3)} | {_sd(row['conf'], 3)} | "
                     f"{_pm(row['diversity'], 3)} | {_pm(row['coherence'], 3)} |")
    return lines + [""]


def penalties_section(rows: list[dict]) -> list[str]:
    lines = ["## Penalties with adaptive decoding", "",
             "Each sampler bare and with a penalty, on the same test prefixes (95 % "
             "intervals over texts; MAUVE over k-means seeds).", "",
             "| spec | rep-2 | rep-3 | rep-4 | diversity | coherence | MAUVE |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row['spec']}` | {_pm(row['rep2'])} | {_pm(row['rep3'])} | "
                     f"{_pm(row['rep4'])} | {_pm(row['diversity'], 3)} | "
                     f"{_pm(row['coherence'], 3)} | {_sd(row['mauve'], 3)} |")
    return lines + [""]


def latency_section(latency: dict) -> list[str]:
    table = {k: v for k, v in latency.items() if k != "note"}
    specs = list(next(iter(table.values())))
    lines = ["## Sampler time per token (median µs, one llama_sampler_sample call, "
             "no decode)", "", "| model | " + " | ".join(f"`{s}`" for s in specs) + " |",
             "|---" * (len(specs) + 1) + "|"]
    for model, row in table.items():
        lines.append(f"| {model} | " + " | ".join(f"{row[s]:.0f}" for s in specs) + " |")
    if "note" in latency:
        lines.append(f"\n{latency['note']}.")
    return lines + [""]


def gsm8k_section(g: dict) -> list[str]:
    lines = [f"## GSM8K ({g['n']} test problems, up to {g['max_tokens']} tokens)", "",
             "Prompt (chat template, user turn): `" + g["prompt"].replace("\n", " ")
             + "`. A zero-shot chain-of-thought prompt: the paper's appendix C text was "
             "not available offline.", ""] + gsm8k_table(g) + [""]
    if g.get("paired"):
        lines += gsm8k_paired_section(g["paired"]) + [""]
    return lines


def dev_sweep_table(result: dict) -> list[str]:
    """Every swept grid value's dev MAUVE (which picks) and dev rep-2 (what the pick costs
    in repetition), the picked value in bold."""
    lines = [f"Dev sweep: every grid value on the {result['n_dev']} dev prefixes (the same "
             "for every method); the value with the highest MAUVE is picked (**bold**).", "",
             "| method | spec | dev MAUVE | dev rep-2 |", "|---|---|---|---|"]
    for method, grid in result["dev_mauve"].items():
        picked, rep2 = result["methods"][method]["spec"], result["dev_rep2"][method]
        for spec, mauve in grid.items():
            name = f"**`{spec}`**" if spec == picked else f"`{spec}`"
            lines.append(f"| {method} | {name} | {mauve:.3f} | {rep2[spec]:.1f} |")
    return lines


def gsm8k_table(g: dict) -> list[str]:
    """Accuracy (95% Wilson interval) and the share of answers cut off by the token limit per
    method, one column per temperature ("-" where a method does not run: greedy does not
    depend on the temperature)."""
    cells = {}
    for spec, v in g.items():
        if isinstance(v, dict) and spec != "paired":
            parsed = parse_spec(spec)
            method = str(replace(parsed, temp=1.0))
            cells.setdefault(method, {})[v.get("temperature", 1.0)] = (
                _pm(v["accuracy"], 1, 100) + f" % ({100 * v['cut_off']:.0f} % cut off)")
    temps = sorted({t for row in cells.values() for t in row})
    lines = ["| sampler | " + " | ".join(f"T = {t:g}" for t in temps) + " |",
             "|---" * (len(temps) + 1) + "|"]
    for method, row in cells.items():
        lines.append(f"| `{method}` | " + " | ".join(
            row.get(t, "-") for t in temps) + " |")
    return lines


GSM8K_VERDICTS = {"better": "scores higher than", "worse": "scores lower than",
                  "not distinguishable": "cannot be told apart from"}


def gsm8k_paired_section(paired: dict) -> list[str]:
    """Each adaptive sampler against each sampler at its temperature: a table of paired
    accuracy differences, then one sentence per adaptive sampler."""
    lines = ["### Adaptive against each sampler, problem by problem", "",
             "Adaptive minus the sampler at the same temperature (greedy at every one): the "
             "difference in accuracy in points, its 95% bootstrap interval over problems, the "
             "p-value Holm-adjusted across the samplers that adaptive sampler is compared "
             "with.", "",
             "| T | adaptive | against | adaptive minus it (points) | verdict |",
             "|---|---|---|---|---|"]
    for adaptive, row in paired.items():
        for spec, cell in row["against"].items():
            low, high = (100 * x for x in cell["ci"])
            lines.append(f"| {row['temperature']:g} | `{adaptive}` | `{spec}` | "
                         f"{100 * cell['diff']:+.1f} [{low:+.1f}, {high:+.1f}] "
                         f"p={cell['p_holm']:.3f} | {cell['verdict']} |")
    lines.append("")
    for adaptive, row in paired.items():
        by = {}
        for spec, cell in row["against"].items():
            by.setdefault(cell["verdict"], []).append(f"`{spec}`")
        parts = [f"{GSM8K_VERDICTS[verdict]} {', '.join(specs)}"
                 for verdict, specs in by.items()]
        lines.append(f"At T = {row['temperature']:g}, adaptive (`{adaptive}`) "
                     + "; ".join(parts) + ".")
    return lines


METRIC_NAMES = {"rep2": "rep-2", "rep3": "rep-3", "rep4": "rep-4", "diversity": "diversity",
                "coherence": "coherence", "mauve": "MAUVE"}


def _diff(cell: dict) -> str:
    low, high = cell["ci"]
    return (f"{cell['diff']:+.3f} [{low:+.3f}, {high:+.3f}] p={cell['p_holm']:.3f} "
            f"**{cell['verdict']}**" if cell["verdict"] != "not distinguishable" else
            f"{cell['diff']:+.3f} [{low:+.3f}, {high:+.3f}] p={cell['p_holm']:.3f}")


def sentence(method: str, row: dict) -> str:
    """One plain sentence: is adaptive better, worse or not distinguishable from method?"""
    by = {}
    for metric, name in METRIC_NAMES.items():
        if metric in row:
            by.setdefault(row[metric]["verdict"], []).append(name)
    parts = [f"{verdict} on {', '.join(names)}" for verdict, names in by.items()
             if verdict != "not distinguishable"]
    same = by.get("not distinguishable")
    if not parts:
        return (f"Against {method} (`{row['spec']}`), adaptive is not distinguishable on any "
                "metric.")
    tail = f", and not distinguishable on {', '.join(same)}" if same else ""
    return f"Against {method} (`{row['spec']}`), adaptive is {'; '.join(parts)}{tail}."


def _statistics(paired: dict, family: str) -> str:
    return ("Adaptive minus the method: mean difference, 95% bootstrap interval over prefixes "
            "(MAUVE: a paired permutation test, sequential: permutations drawn until "
            f"{paired['mauve_stop_after']} are as extreme as the observed difference, at most "
            f"{paired['mauve_permutations']}; and a half-sampling interval, "
            f"{paired['mauve_bootstrap']} halves), "
            "p-value "
            f"Holm-adjusted across {family}. Lower rep-n is better; higher diversity, "
            "coherence and MAUVE are better, while the text stays text: where a method's "
            "MAUVE has collapsed, its low rep-n and diversity near 1 come from near-random "
            "tokens, which never repeat.")


def _metrics_in(rows) -> list[str]:
    rows = list(rows)  # read once per metric
    return [m for m in METRIC_NAMES if any(m in r for r in rows)]


def paired_section(paired: dict) -> list[str]:
    metrics = _metrics_in(paired["against"].values())
    lines = [f"### Adaptive against each method, prefix by prefix ({paired['n_prefixes']} "
             "prefixes)", "", _statistics(paired, "the methods"), "",
             "| against | " + " | ".join(METRIC_NAMES[m] for m in metrics) + " |",
             "|---" * (len(metrics) + 1) + "|"]
    for method, row in paired["against"].items():
        lines.append(f"| {method} | " + " | ".join(_diff(row[m]) if m in row else "-"
                                                   for m in metrics) + " |")
    lines.append("")
    lines += [sentence(method, row) for method, row in paired["against"].items()]
    return lines


def temperature_paired_section(paired: dict) -> list[str]:
    """Adaptive against each temperature method at each temperature: a table, then one
    paragraph of plain sentences per temperature."""
    by_temp = paired["by_temperature"]
    metrics = _metrics_in(row for t in by_temp.values() for row in t["against"].values())
    lines = [f"### Adaptive against each method at each temperature, prefix by prefix "
             f"({paired['n_prefixes']} prefixes)", "",
             _statistics(paired, "every method and temperature, metric by metric"), "",
             "| T | against | " + " | ".join(METRIC_NAMES[m] for m in metrics) + " |",
             "|---|---" + "|---" * len(metrics) + "|"]
    for temp, at in by_temp.items():
        for method, row in at["against"].items():
            lines.append(f"| {temp} | {method} | " + " | ".join(
                _diff(row[m]) if m in row else "-" for m in metrics) + " |")
    lines.append("")
    for temp, at in by_temp.items():
        lines += [f"At T = {temp} (adaptive: `{at['adaptive']}`): " + " ".join(
            sentence(method, row) for method, row in at["against"].items()), ""]
    return lines[:-1]


def temperature_section(study: dict) -> list[str]:
    temps = list(next(iter(study.values())))
    lines = ["### Temperature (applied before truncation, each method at its tuned value)",
             "", "| method | metric | " + " | ".join(f"T={t}" for t in temps) + " |",
             "|---|---" + "|---" * len(temps) + "|"]
    for method, by_temp in study.items():
        for metric, fmt in (("diversity", lambda v: _pm(v, 3)),
                            ("coherence", lambda v: _pm(v, 3)), ("mauve", lambda v: _sd(v, 3))):
            lines.append(f"| {method} | {METRIC_NAMES[metric]} | " + " | ".join(
                fmt(by_temp[t][metric]) for t in temps) + " |")
    return lines


def plots(report: dict, out: Path) -> list[Path]:
    """diversity_coherence.png and mauve.png, one panel per open-ended task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = report.get("open_ended", {})
    if not tasks:
        return []
    written = []
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for ax, (task, result) in zip(axes[0], tasks.items()):
        for method, m in result["methods"].items():
            ax.errorbar(m["diversity"][0], m["coherence"][0], xerr=m["diversity"][1],
                        yerr=m["coherence"][1], fmt="o", capsize=3, label=method)
        ax.set(title=task, xlabel="diversity", ylabel="coherence")
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "diversity_coherence.png")
    fig.savefig(written[-1], dpi=110)
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, (task, result) in zip(axes[0], tasks.items()):
        names = [m for m, v in result["methods"].items() if v["mauve"]]
        values = [result["methods"][m]["mauve"] for m in names]
        ax.bar(names, [v[0] for v in values],
               yerr=[0 if math.isnan(v[1]) else v[1] for v in values], capsize=3)
        ax.set(title=f"{task}: MAUVE (sd over k-means seeds)", ylim=(0, 1))
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    written.append(out / "mauve.png")
    fig.savefig(written[-1], dpi=110)
    studies = {task: r["temperatures"] for task, r in tasks.items() if "temperatures" in r}
    for task, study in studies.items():
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, metric in zip(axes, ("diversity", "coherence", "mauve")):
            for method, by_temp in study.items():
                temps = [float(t) for t in by_temp]
                values = [by_temp[t][metric] for t in by_temp]
                ax.errorbar(temps, [v[0] for v in values],
                            yerr=[0 if math.isnan(v[1]) else v[1] for v in values],
                            marker="o", capsize=3, label=method)
            ax.set(title=f"{task}: {METRIC_NAMES[metric]}", xlabel="temperature")
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / f"temperature_{task}.png")
        fig.savefig(written[-1], dpi=110)
    plt.close("all")
    return written


def write_reports(report: dict, out: Path) -> list[Path]:
    """results.json, results.md and the plots the report has data for; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(markdown(report) + "\n", encoding="utf-8")
    return [out / "results.json", out / "results.md", *plots(report, out)]

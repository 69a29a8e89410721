"""benchmarks/eval_workers.py: the eval's open-ended texts made by parallel worker processes,
then found by `adaptive-llama eval` with the same sizes (end to end on the bundled model)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_llama.eval.cache import JsonLinesCache

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "eval_workers.py"
SIZES = ["--tasks", "wiki", "--methods", "greedy,top-p,adaptive", "--n-dev", "2",
         "--n-test", "3", "--max-tokens", "8", "--temperatures", "0.7,1.0"]


@pytest.mark.slow
def test_workers_make_every_text_that_the_eval_then_reads(tmp_path, smollm2_path):
    out = tmp_path / "run"
    made = subprocess.run([sys.executable, str(SCRIPT), str(smollm2_path), "--out", str(out),
                           "--workers", "2", "--n-gpu-layers", "0", "--batch", "4", *SIZES],
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout + made.stderr
    picked = json.loads(made.stdout.splitlines()[0])["picked"]["wiki"]
    assert json.loads((out / "picks.json").read_text())["wiki"] == picked
    assert not (out / "workers").exists()  # each worker's texts went into the cache
    # dev: 4 grid values each of top-p and adaptive x 2 prefixes; test: the 3 picks, and
    # top-p and adaptive at T 0.7, x 3 prefixes
    cache = JsonLinesCache(out / "generations.jsonl")
    assert len(cache.rows) == 8 * 2 + 5 * 3
    cache.close()

    evaluated = subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "eval",
                                str(smollm2_path), "--out", str(out), *SIZES],
                               capture_output=True, text=True, timeout=900)
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads((out / "results.json").read_text())
    assert report["generated_texts"] == 0  # every text under the eval's own key
    chosen = {m: row["spec"] for m, row in report["open_ended"]["wiki"]["methods"].items()}
    assert chosen == picked  # the same picks by dev MAUVE
    assert "every text came from generations.jsonl" in (out / "results.md").read_text()


@pytest.mark.slow
def test_given_picks_skip_the_dev_sweep(tmp_path, smollm2_path):
    out, picks = tmp_path / "run", tmp_path / "picks.json"
    chosen = {"greedy": "greedy", "top-p": "top-p:p=0.8", "adaptive": "adaptive:eps=0.001"}
    picks.write_text(json.dumps({"wiki": chosen}))
    made = subprocess.run([sys.executable, str(SCRIPT), str(smollm2_path), "--out", str(out),
                           "--workers", "2", "--n-gpu-layers", "0", "--batch", "4",
                           "--picks", str(picks), *SIZES],
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout + made.stderr
    cache = JsonLinesCache(out / "generations.jsonl")
    specs = {row["spec"] for row in cache.rows.values()}
    cache.close()
    assert {key.split("|")[1] for key in cache.rows} == {"test"}  # no dev sweep
    assert specs == {"greedy", "top-p:p=0.8", "adaptive:eps=0.001", "top-p:p=0.8,temp=0.7",
                     "adaptive:eps=0.001,mode=multinomial,temp=0.7"}
    assert len(cache.rows) == 5 * 3

"""The evaluation harness: data stand-ins, the prompts file, the resume cache, GSM8K answers,
and a small end-to-end run of `adaptive-llama eval` on the bundled model."""

import ast
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from adaptive_llama.eval import data, metrics, report, run, tasks
from adaptive_llama.eval.cache import JsonLinesCache, ScoreCache
from adaptive_llama.eval.data import DataError
from adaptive_llama.samplers import parse_spec


def test_wikipedia_and_tinystories_stand_ins_load():
    articles, stories = data.wiki_articles(), data.tiny_stories()
    assert len(articles) > 2000 and len(stories) > 300
    assert not articles[0].startswith("<doc") and "</doc>" not in articles[0]
    assert all("<|endoftext|>" not in s for s in stories)


def test_prefixes_are_32_tokens_and_references_follow_them(engine):
    detok = engine.detokenize
    tokenize = lambda t: engine.tokenize(t, add_bos=False)  # noqa: E731
    prompts = data.prefixes(data.wiki_articles()[:20], "wiki", tokenize, detok, 32, 40)
    assert len(prompts) > 10
    for p in prompts[:5]:
        assert 28 <= len(tokenize(p.prefix)) <= 36
        assert p.reference and len(tokenize(p.reference)) >= 30
    dev, test = data.dev_test_split(prompts, 3, 5)
    assert not {p.id for p in dev} & {p.id for p in test}
    assert data.dev_test_split(prompts, 3, 5) == (dev, test)  # same draw every run


def test_a_story_that_ends_sooner_keeps_its_rest_as_the_reference(engine):
    # TinyStories are short: at 256 tokens 3 of 316 stories hold prefix + reference, too few
    # for 64 dev + 200 test prompts; their rest (at least 64 tokens) stands in instead
    detok = engine.detokenize
    tokenize = lambda t: engine.tokenize(t, add_bos=False)  # noqa: E731
    stories = data.tiny_stories()
    strict = data.prefixes(stories, "stories", tokenize, detok, 32, 256)
    at_256 = data.prefixes(stories, "stories", tokenize, detok, 32, 256,
                           data.SHORTEST_STORY_REFERENCE)
    at_64 = data.prefixes(stories, "stories", tokenize, detok, 32, 64,
                          data.SHORTEST_STORY_REFERENCE)
    assert len(strict) < 64 + 200 <= len(at_256)
    # at the default length the rule changes nothing: the same prompts, ids and references
    assert at_64 == data.prefixes(stories, "stories", tokenize, detok, 32, 64)
    assert [p.id for p in at_256] == [p.id for p in at_64]
    by_id = {p.id: p for p in at_64}
    lengths = []
    for p in at_256:
        story = stories[int(p.id.rsplit("-", 1)[1])]
        assert p.prefix == by_id[p.id].prefix and p.reference.startswith(by_id[p.id].reference)
        n = len(tokenize(p.reference))
        lengths.append(n)
        if n < 250:  # a reference short of 256 tokens is the story's whole rest
            assert (p.prefix + p.reference).strip()[-20:] == story.strip()[-20:]
    assert min(lengths) >= 60 and max(lengths) > 200


def test_at_256_tokens_stories_keep_their_rest_and_wikipedia_its_full_length(engine):
    from types import SimpleNamespace

    ev = SimpleNamespace(engine=engine, config=run.EvalConfig(max_tokens=256))
    stories = tasks.open_ended_prompts(ev, "stories")
    assert len(stories) >= 64 + 200  # enough for the default dev and test splits
    wiki = tasks.open_ended_prompts(ev, "wiki")
    assert len(wiki) >= 64 + 200
    tokens = [len(engine.tokenize(p.reference, add_bos=False)) for p in wiki[:20]]
    assert min(tokens) >= 250  # every Wikipedia reference is a whole 256 tokens


@pytest.mark.parametrize("content, fragment", [
    ('{"prefix": "ok"}\n{"prefix": "x", oops}\n', "line 2: not valid JSON"),
    ('{"prefix": "ok"}\n\n{"reference": "no prefix"}\n', 'line 3: needs {"prefix"'),
    ('{"prefix": "ok", "reference": 7}\n', "line 1: `reference` has to be text"),
    ('["prefix"]\n', "line 1: needs"),
    ("\n\n", "has no prompts"),
])
def test_prompts_file_errors_name_the_line(tmp_path, content, fragment):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as info:
        data.load_prompts_file(path)
    assert fragment in str(info.value)


def test_generation_cache_survives_a_line_cut_short(tmp_path):
    path = tmp_path / "generations.jsonl"
    cache = JsonLinesCache(path)
    for i in range(3):
        cache.add({"key": f"k{i}", "text": f"t{i}"})
    cache.close()
    path.write_text(path.read_text()[:-10])  # the interruption: half a line
    cache = JsonLinesCache(path)
    assert set(cache.rows) == {"k0", "k1"}
    cache.add({"key": "k2", "text": "again"})
    cache.close()
    assert JsonLinesCache(path).get("k2")["text"] == "again"


def test_damaged_lines_are_skipped_and_counted_and_the_file_only_cut_back(tmp_path):
    path = tmp_path / "generations.jsonl"
    good = [json.dumps({"key": f"k{i}", "text": "ü" * 3}).encode() + b"\n" for i in range(3)]
    damaged = [b"{}\n", b"[1, 2]\n", b'{"key": 5}\n', b"not json\n",
               '{"key": "k9", "text": "\u00fc"}\n'.encode()[:-4] + b"\xc3\n"]  # bad UTF-8
    cut = json.dumps({"key": "k3", "text": "€"}).encode()[:-3]  # cut inside the "€"
    path.write_bytes(good[0] + b"".join(damaged) + good[1] + good[2] + cut)
    before = path.read_bytes()
    cache = JsonLinesCache(path)
    assert set(cache.rows) == {"k0", "k1", "k2"} and cache.skipped == len(damaged)
    assert path.read_bytes() == before[:len(before) - len(cut)]  # cut back, nothing rewritten
    cache.close()


def test_an_interrupted_repair_never_empties_the_cache(tmp_path):
    # The repair of a cut last line is killed the moment the file first shrinks: what is
    # left has to be the file without that line (it once rewrote the file in place, and an
    # interruption then left 0 bytes).
    path = tmp_path / "generations.jsonl"
    whole = ((json.dumps({"key": "k", "text": "x" * 1000}) + "\n") * 20_000).encode()
    path.write_bytes(whole + b'{"key": "cut')
    code = ("import sys; from pathlib import Path; "
            "from adaptive_llama.eval.cache import JsonLinesCache; "
            "JsonLinesCache(Path(sys.argv[1]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)])
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if path.stat().st_size < len(whole) + 12:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert path.read_bytes() == whole


def _rows(n, start=0):
    return [{"key": f"k{i}", "text": f"text {i} " + "ü" * (i % 7)} for i in range(start, n)]


def test_a_large_cache_is_compressed_on_open_and_read_and_appended_as_before(tmp_path):
    path = tmp_path / "generations.jsonl"
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in _rows(50)]
    path.write_text("".join(lines), encoding="utf-8")
    small = JsonLinesCache(path, compress_above=path.stat().st_size)  # not past the limit
    assert small.path == path and len(small.rows) == 50
    small.close()
    with path.open("a") as cut_short:
        cut_short.write('{"key": "cut')
    cache = JsonLinesCache(path, compress_above=100)
    packed = tmp_path / "generations.jsonl.gz"
    assert cache.path == packed and not path.exists()
    assert len(cache.rows) == 50 and cache.skipped == 0  # the cut line was not carried over
    for row in _rows(53, start=50):
        cache.add(row)
    cache.close()
    # an ordinary gzip file: every whole line, the cut one left out, the added ones after
    assert gzip.decompress(packed.read_bytes()).decode() == "".join(
        json.dumps(r, ensure_ascii=False) + "\n" for r in _rows(53))
    again = JsonLinesCache(path)
    assert again.path == packed and again.get("k52")["text"] == "text 52 üüü"
    assert len(again.rows) == 53 and again.skipped == 0
    again.close()
    assert not path.exists()  # reading made no plain file beside it


def test_a_killed_run_leaves_a_compressed_cache_readable_to_its_last_whole_row(tmp_path):
    packed = tmp_path / "generations.jsonl.gz"
    (tmp_path / "generations.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _rows(5)))
    JsonLinesCache(tmp_path / "generations.jsonl", compress_above=0).close()
    finished = packed.read_bytes()  # one finished member
    cache = JsonLinesCache(tmp_path / "generations.jsonl")
    for row in _rows(9, start=5):
        cache.add(row)
    flushed = packed.read_bytes()  # a second member, flushed row by row, never finished
    cache.add(_rows(10, start=9)[0])
    cut = packed.read_bytes()[:len(flushed) + 3]  # killed while writing k9
    cache.close()
    for damaged, kept in ((cut, 9), (finished + b"\0garbage", 5), (finished[:-4], 5)):
        packed.write_bytes(damaged)
        cache = JsonLinesCache(tmp_path / "generations.jsonl")
        assert set(cache.rows) == {f"k{i}" for i in range(kept)}
        cache.add({"key": "new", "text": "after the repair"})
        cache.close()
        text = gzip.decompress(packed.read_bytes()).decode()  # finished members only
        assert text.splitlines()[-1] == '{"key": "new", "text": "after the repair"}'
        assert len(text.splitlines()) == kept + 1


def test_a_compressed_cache_survives_sigkill_while_rows_are_added(tmp_path):
    path = tmp_path / "generations.jsonl"
    code = ("import sys, itertools; from pathlib import Path; "
            "from adaptive_llama.eval.cache import JsonLinesCache; "
            "c = JsonLinesCache(Path(sys.argv[1]), compress_above=0); "
            "[c.add({'key': f'k{i}', 'text': 'x' * (i % 500)}) for i in itertools.count()]")
    path.write_text('{"key": "first", "text": "made before"}\n')
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)])
    packed = tmp_path / "generations.jsonl.gz"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (packed.exists() and
                                               packed.stat().st_size > 200_000):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    cache = JsonLinesCache(path)
    n = len(cache.rows) - 1
    assert n > 1000 and cache.get("first")["text"] == "made before" and cache.skipped == 0
    assert all(cache.get(f"k{i}")["text"] == "x" * (i % 500) for i in range(n))
    cache.close()
    assert len(JsonLinesCache(path).rows) == n + 1  # the repair is kept


def test_gzip_members_decode_across_reads_of_any_size():
    from adaptive_llama.eval.cache import _unpack

    members = [gzip.compress(f"member {i}\n".encode() * (i + 1), mtime=0) for i in range(3)]
    data = b"".join(members)
    for chunk in (1, 7, 1 << 16):
        assert _unpack(data, chunk) == (b"member 0\n" + b"member 1\n" * 2 + b"member 2\n" * 3,
                                        len(data), b"")
    # a damaged third member: the first two whole, the cut where the third starts
    assert _unpack(data[:-30] + b"\xff" * 30, 5)[:2] == (b"member 0\n" + b"member 1\n" * 2,
                                                        len(members[0]) + len(members[1]))


def test_cache_files_go_in_folders_made_for_them(tmp_path):
    cache = JsonLinesCache(tmp_path / "new" / "deeper" / "generations.jsonl")
    cache.add({"key": "k", "text": "t"})
    cache.close()
    assert JsonLinesCache(tmp_path / "new" / "deeper" / "generations.jsonl").get("k")


def test_cache_keys_stay_those_of_the_committed_caches(tmp_path):
    # The reports under benchmarks/results are re-rendered from committed caches: a change
    # in how keys are written would silently make every text and score anew.
    assert JsonLinesCache.key("wiki", "test", "greedy", 64, "wiki-7", 0) == \
        "wiki|test|greedy|64|wiki-7|0"
    cache = ScoreCache(tmp_path / "scores.jsonl", "mauve-text==0.4.0")
    cache.get_or_compute("mauve", [["ü text"], 5], lambda: 1)
    cache.close()
    key, = ScoreCache(tmp_path / "scores.jsonl", "").rows
    # what was scored, then the SHA-256 of [versions, inputs] as JSON, non-ASCII kept, UTF-8
    written = '["mauve-text==0.4.0", [["ü text"], 5]]'.encode("utf-8")
    assert key == "mauve|" + hashlib.sha256(written).hexdigest()


def test_score_cache_computes_once_per_inputs_and_package_versions(tmp_path):
    path, calls = tmp_path / "scores.jsonl", []

    def compute(value):
        calls.append(value)
        return {"diff": value}

    cache = ScoreCache(path, "mauve-text==0.4")
    assert cache.get_or_compute("mauve", [["a text"], 5], lambda: compute(1)) == {"diff": 1}
    assert cache.get_or_compute("mauve", [["a text"], 5], lambda: compute(2)) == {"diff": 1}
    cache.get_or_compute("mauve", [["a text"], 5], lambda: compute(3))["p_holm"] = 0.5
    assert cache.get_or_compute("mauve", [["a text"], 5], lambda: compute(4)) == {"diff": 1}
    assert cache.get_or_compute("mauve", [["other"], 5], lambda: compute(5)) == {"diff": 5}
    cache.close()
    again = ScoreCache(path, "mauve-text==0.4")  # a resumed run reads them back
    assert again.get_or_compute("mauve", [["other"], 5], lambda: compute(6)) == {"diff": 5}
    again.close()
    upgraded = ScoreCache(path, "mauve-text==0.5")  # another MAUVE: scored anew
    assert upgraded.get_or_compute("mauve", [["other"], 5], lambda: compute(7)) == {"diff": 7}
    upgraded.close()
    assert calls == [1, 5, 7]
    other = ScoreCache(path, "mauve-text==0.5")  # another score of the same inputs
    assert other.get_or_compute("paired", [["other"], 5], lambda: compute(8)) == {"diff": 8}
    nested = other.get_or_compute("nested", [1], lambda: {"ci": [0.1, 0.2]})
    nested["ci"].append(0.3)  # the caller's copy, not the cache's
    assert other.get_or_compute("nested", [1], lambda: None) == {"ci": [0.1, 0.2]}
    other.close()


def test_coherence_is_scored_once_so_a_rerun_embeds_no_text_twice(tmp_path):
    from adaptive_llama.eval.config import EvalConfig

    prompts = [data.Prompt(id="wiki-1", prefix="The Danube flows through ten countries"),
               data.Prompt(id="wiki-2", prefix="A small cat sat on the warm windowsill")]
    rows = [{"prompt_id": "wiki-1", "text": " and past Vienna to the Black Sea."},
            {"prompt_id": "wiki-2", "text": " watching the birds in the garden."}]
    config = EvalConfig(out=str(tmp_path))

    first = run.Evaluator(config, engine=object())  # no model: only scoring here
    values = first.text_metrics(rows, prompts)["coherence"]
    expected = metrics.coherence(first.embed([p.prefix for p in prompts]),
                                 first.embed([r["text"] for r in rows]))
    assert values == list(expected) and all(type(v) is float for v in values)
    first.close()

    class NoEmbedding(run.Evaluator):
        def embed(self, texts):
            raise AssertionError(f"embedded again: {texts}")

    again = NoEmbedding(config, engine=object())  # a resumed run
    assert again.text_metrics(rows, prompts)["coherence"] == values  # bit for bit
    changed = [rows[0], {**rows[1], "text": " chasing a red ball."}]
    with pytest.raises(AssertionError, match="embedded again"):
        again.text_metrics(changed, prompts)  # another text is embedded
    again.close()


def test_cache_key_holds_max_tokens_so_a_longer_run_generates_anew(tmp_path, engine):
    from adaptive_llama.eval.data import Prompt

    ev = run.Evaluator(run.EvalConfig(out=str(tmp_path)), engine=engine)
    prompt = [Prompt(id="wiki-0", prefix="The history of the river")]
    try:
        short = ev.generate("wiki", "test", "greedy", prompt, 1, max_tokens=3)
        long = ev.generate("wiki", "test", "greedy", prompt, 1, max_tokens=9)
        again = ev.generate("wiki", "test", "greedy", prompt, 1, max_tokens=3)
    finally:
        ev.close()
    assert short[0]["completion_tokens"] == 3 and long[0]["completion_tokens"] == 9
    assert again == short  # from the cache
    assert len((tmp_path / "generations.jsonl").read_text().splitlines()) == 2


def test_texts_are_cached_as_they_finish_and_come_back_in_prompt_order(tmp_path, engine):
    from adaptive_llama.eval.data import Prompt

    prompts = [Prompt(id=f"wiki-{i}", prefix=p) for i, p in enumerate(
        ["The history of the river", "A small dog", "In the year 1905", "The recipe"])]
    specs = ["greedy", "adaptive:eps=0.01"]
    ev = run.Evaluator(run.EvalConfig(out=str(tmp_path)), engine=engine)
    cached, kept = ev.cache.add, []

    def add_then_interrupt(row):
        cached(row)
        kept.append(row["key"])
        if len(kept) == 3:
            raise KeyboardInterrupt  # Ctrl-C while the other texts are being made

    ev.cache.add = add_then_interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            ev.generate_specs("wiki", "test", specs, prompts, 1, max_tokens=6)
        assert not engine.decoder.live  # the unfinished ones were cancelled
        lines = (tmp_path / "generations.jsonl").read_text().splitlines()
        assert [json.loads(line)["key"] for line in lines] == kept  # each kept at once
        ev.cache.add = cached
        rows = ev.generate_specs("wiki", "test", specs, prompts, 1, max_tokens=6)
    finally:
        ev.close()
    assert len((tmp_path / "generations.jsonl").read_text().splitlines()) == 8  # 5 more
    for spec in specs:  # cached or new, in the order of the prompts
        assert [(r["spec"], r["prompt_id"]) for r in rows[spec]] == [
            (spec, p.id) for p in prompts]
    assert [r["text"] for r in rows["greedy"]] == [
        engine.generate(p.prefix, sampler="greedy", max_tokens=6).text for p in prompts]


def test_each_finished_task_is_reported_before_the_next_one_runs(tmp_path, engine,
                                                                  monkeypatch):
    config = run.EvalConfig(tasks=("ablation", "gsm8k"), n_dev=2, max_tokens=4,
                            out=str(tmp_path))
    ev = run.Evaluator(config, engine=engine)

    def interrupted(_ev):
        raise KeyboardInterrupt  # Ctrl-C hours into GSM8K

    monkeypatch.setattr(run.tasks, "gsm8k", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            ev.run()
    finally:
        ev.close()
    report = json.loads((tmp_path / "results.json").read_text())
    assert len(report["ablation"]) == 8 and report["pending"] == ["gsm8k"]
    markdown = (tmp_path / "results.md").read_text()
    assert "## Threshold ablation" in markdown
    assert "**Interim report**: gsm8k still to run" in markdown


def test_the_penalty_study_runs_each_sampler_bare_and_with_each_penalty(tmp_path, engine):
    config = run.EvalConfig(tasks=("penalties",), n_dev=2, n_test=4, max_tokens=16,
                            out=str(tmp_path))
    ev = run.Evaluator(config, engine=engine)
    try:
        report = ev.run()
    finally:
        ev.close()
    rows = report["penalties"]
    assert [r["spec"] for r in rows] == [base + m for base in tasks.PENALTY_BASES
                                         for m in tasks.PENALTY_MODIFIERS]
    for row in rows:
        # rep2 is a percentage (metrics.rep_n), diversity a product of shares.
        assert 0 <= row["rep2"][0] <= 100 and 0 <= row["diversity"][0] <= 1
    cache = [json.loads(line) for line in (tmp_path / "generations.jsonl").open()]
    text = {(r["spec"], r["prompt_id"]): r["text"] for r in cache}
    bare, strong = tasks.PENALTY_BASES[0], tasks.PENALTY_BASES[0] + "+penalties:repeat=1.3"
    assert any(text[(bare, pid)] != text[(strong, pid)] for s, pid in text if s == bare)
    markdown = (tmp_path / "results.md").read_text()
    assert "## Penalties with adaptive decoding" in markdown
    assert "`adaptive:eps=0.0005+dry` |" in markdown


@pytest.mark.parametrize("text, answer", [
    ("3 + 4 = 7. Then 7 * 2 = 14. The answer is 14.", "14"),
    ("The answer is $1,250.", "1250"),
    ("She pays 12.5 dollars, then 3", "3"),
    ("I do not know.", None),
    # Qwen2.5-Coder's endings: LaTeX after "answer is", a boxed result before other numbers,
    # a boxed result on its own lines, a trailing ".00"
    ("So, the answer is \\(\\boxed{30}\\).", "30"),
    ("Ray takes \\(\\boxed{18}\\) minutes longer to swim 3 miles.", "18"),
    ("3. **The answer is N:**\n   \\[\n   \\boxed{152}\n   \\]", "152"),
    ("The answer is N = $1,037.50 a day.", "1037.5"),
    ("The difference is 30.00 - 8.00 = 22.00 dollars.", "22"),
    ("It is \\(\\boxed{-14}\\) pieces.", "-14"),
])
def test_gsm8k_answer_extraction(text, answer):
    assert tasks.extract_answer(text) == answer


def test_gsm8k_loads_numeric_answers():
    problems = data.gsm8k(5)
    assert len(problems) == 5 and all(p.answer.lstrip("-").replace(".", "").isdigit()
                                      for p in problems)


def test_gsm8k_runs_greedy_once_and_each_sampling_method_at_each_temperature():
    specs = tasks.gsm8k_specs()
    sampling = len(tasks.GSM8K_SPECS) - 1
    assert specs.count("greedy") == 1
    assert len(specs) == 1 + sampling * len(tasks.GSM8K_TEMPERATURES)
    assert "min-p:p=0.1,temp=1.5" in specs and "top-p:p=0.95,temp=0.7" in specs
    # The report: one row per method, one column per temperature, greedy only at T = 1.
    results = {"prompt": "", "n": 4, "max_tokens": 8}
    for i, spec in enumerate(specs):
        results[spec] = {"accuracy": (i / 100, 0.01), "cut_off": i / 10,
                         "temperature": parse_spec(spec).temp}
    table = report.gsm8k_table(results)
    assert table[0] == "| sampler | T = 0.7 | T = 1 | T = 1.5 |"
    assert len(table) == 2 + len(tasks.GSM8K_SPECS)
    assert table[3] == ("| `top-p:p=0.95` | 1.0 ± 1.0 % (10 % cut off) | 2.0 ± 1.0 % "
                        "(20 % cut off) | 3.0 ± 1.0 % (30 % cut off) |")


def test_gsm8k_pairs_adaptive_with_each_sampler_at_its_temperature_problem_by_problem():
    n = 40
    correct_of = {
        "greedy": [True] * 39 + [False],            # adaptive@0.7 - greedy: 1/40 = +0.025
        "top-p:p=0.95,temp=0.7": [True, False] * 20,  # 20 of 40: adaptive +0.5 on 20 problems
        "min-p:p=0.1,temp=0.7": [True] * n,          # the same answers: every difference 0
        "adaptive:eps=0.0005,temp=0.7": [True] * n,
        "top-p:p=0.95": [False] * n,
        "adaptive:eps=0.0005": [True] * 10 + [False] * 30,
    }
    paired = tasks.gsm8k_paired(correct_of, seed=0)
    assert set(paired) == {"adaptive:eps=0.0005,temp=0.7", "adaptive:eps=0.0005"}
    assert paired["adaptive:eps=0.0005,temp=0.7"]["temperature"] == 0.7
    hot = paired["adaptive:eps=0.0005,temp=0.7"]["against"]
    # compared only with greedy and the samplers at its own temperature
    assert set(hot) == {"greedy", "top-p:p=0.95,temp=0.7", "min-p:p=0.1,temp=0.7"}
    assert hot["top-p:p=0.95,temp=0.7"]["diff"] == pytest.approx(0.5)
    assert hot["top-p:p=0.95,temp=0.7"]["verdict"] == "better"
    assert hot["min-p:p=0.1,temp=0.7"]["ci"] == [0.0, 0.0]
    assert hot["min-p:p=0.1,temp=0.7"]["verdict"] == "not distinguishable"
    # one problem in 40 is no evidence, and Holm multiplies the smallest p by 3
    assert hot["greedy"]["diff"] == pytest.approx(0.025)
    assert hot["greedy"]["verdict"] == "not distinguishable"
    at_one = paired["adaptive:eps=0.0005"]["against"]
    assert set(at_one) == {"greedy", "top-p:p=0.95"}
    assert at_one["greedy"]["diff"] == pytest.approx(10 / 40 - 39 / 40)
    assert at_one["greedy"]["verdict"] == "worse" and at_one["top-p:p=0.95"]["verdict"] == "better"
    lines = report.gsm8k_paired_section(paired)
    assert ("| 0.7 | `adaptive:eps=0.0005,temp=0.7` | `top-p:p=0.95,temp=0.7` | +50.0 ["
            in "\n".join(lines))
    assert ("At T = 1, adaptive (`adaptive:eps=0.0005`) scores lower than `greedy`; scores "
            "higher than `top-p:p=0.95`.") in lines
    # the accuracy table leaves the paired section out
    results = {"prompt": "", "n": n, "max_tokens": 8, "paired": paired,
               "greedy": {"accuracy": (0.975, 0.05), "cut_off": 0.0, "temperature": 1.0}}
    assert len(report.gsm8k_table(results)) == 3


class _ScoredRows:
    """A Runner's scoring for the paired statistics: every text metric of a row is its
    "v", and paired MAUVE is a fixed cell (its calls recorded)."""

    def __init__(self, mauve_p):
        self.config = run.EvalConfig(seed=0)
        self.mauve_p, self.mauve_calls = mauve_p, []

    def text_metrics(self, rows, prompts):
        return {m: [r["v"] for r in rows] for m in ("rep2", "rep3", "rep4", "diversity",
                                                    "coherence")}

    def paired_mauve(self, a_texts, b_texts, references, comparisons):
        assert comparisons == 4  # the whole family: 2 temperatures x 2 methods
        self.mauve_calls.append((a_texts, b_texts))
        return {"diff": 0.1, "ci": [0.0, 0.2], "p": self.mauve_p}


class _DevSweep:
    """A Runner's dev sweep: each spec's texts are given, and its MAUVE is looked up."""

    def __init__(self, texts, mauve):
        self.config = run.EvalConfig(methods=("greedy", "adaptive"), seed=0)
        self.texts, self.mauve_of = texts, mauve

    def generate_specs(self, task, split, specs, prompts, samples):
        assert split == "dev" and samples == 1
        return {s: [{"spec": s, "text": t} for t in self.texts[s]] for s in specs}

    def mauve(self, rows, by_id):
        return self.mauve_of[rows[0]["spec"]], 0.0


def test_the_dev_sweep_picks_by_mauve_and_reports_each_values_rep2():
    from adaptive_llama.eval.data import Prompt

    dev = [Prompt(id=f"d{i}", prefix="x", reference="y") for i in range(2)]
    grid = tasks.GRIDS["adaptive"]
    # rep-2 of "a b a b": bigrams (a b) (b a) (a b), 2 unique of 3: 100 * (1 - 2/3) = 33.3;
    # of "a b c": none repeated, 0. Mean over the two dev texts: 16.7.
    texts = {s: ["a b a b", "a b c"] if s == grid[1] else ["a b c", "d e f"] for s in grid}
    # grid[1] and grid[2] tie on MAUVE: the first listed of them is picked
    mauve = {s: 0.5 for s in grid} | {grid[1]: 0.9, grid[2]: 0.9}
    chosen, sweep, rep2 = tasks.pick_by_dev_mauve(_DevSweep(texts, mauve), "wiki", dev)
    assert chosen == {"greedy": "greedy", "adaptive": grid[1]}
    assert sweep == {"adaptive": mauve} and list(rep2) == ["adaptive"]  # greedy: no grid
    assert rep2["adaptive"][grid[1]] == pytest.approx(50 / 3)
    assert all(rep2["adaptive"][s] == 0.0 for s in grid if s != grid[1])
    lines = report.dev_sweep_table({"n_dev": 2, "dev_mauve": sweep, "dev_rep2": rep2,
                                    "methods": {"adaptive": {"spec": chosen["adaptive"]}}})
    assert f"| adaptive | **`{grid[1]}`** | 0.900 | 16.7 |" in lines
    assert f"| adaptive | `{grid[2]}` | 0.900 | 0.0 |" in lines
    assert len(lines) == 4 + len(grid)


def test_temperature_comparisons_are_paired_per_prefix_with_holm_over_every_temperature():
    from adaptive_llama.eval.data import Prompt

    test = [Prompt(id=f"p{i}", prefix="x", reference="y") for i in range(30)]

    def rows(spec, v):
        return [{"prompt_id": p.id, "sample": 0, "spec": spec, "text": f"{spec} {p.id}",
                 "v": v} for p in test]

    # At T 0.7 top-p's texts score 1 on every metric and adaptive's 0: a difference of -1
    # on every prefix, p = 1/2001 (the bootstrap's floor). Every other pair differs by 0,
    # p = 1. One family per metric over 2 temperatures x 2 methods: Holm multiplies the
    # smallest p by 4, not by the 2 comparisons at its temperature.
    rows_at = {0.7: {"top-p": rows("top-p:p=0.95,temp=0.7", 1.0),
                     "min-p": rows("min-p:p=0.1,temp=0.7", 0.0),
                     "adaptive": rows("adaptive:eps=0.0005,temp=0.7", 0.0)},
               1.5: {"top-p": rows("top-p:p=0.95,temp=1.5", 0.5),
                     "min-p": rows("min-p:p=0.1,temp=1.5", 0.5),
                     "adaptive": rows("adaptive:eps=0.0005,temp=1.5", 0.5)}}
    ev = _ScoredRows(mauve_p=0.011)
    paired = tasks.temperature_paired(ev, rows_at, test)
    by_temp = paired["by_temperature"]
    assert list(by_temp) == ["0.7", "1.5"] and paired["n_prefixes"] == 30
    assert paired["mauve_permutations"] == 200  # 50 for each of the 4 comparisons
    assert paired["mauve_stop_after"] == metrics.STOP_AFTER
    assert by_temp["1.5"]["adaptive"] == "adaptive:eps=0.0005,temp=1.5"
    hot = by_temp["0.7"]["against"]
    assert list(hot) == ["top-p", "min-p"] and hot["top-p"]["spec"] == "top-p:p=0.95,temp=0.7"
    cell = hot["top-p"]["rep2"]
    assert cell["diff"] == pytest.approx(-1.0) and cell["p"] == pytest.approx(1 / 2001)
    assert cell["p_holm"] == pytest.approx(4 / 2001)
    assert cell["verdict"] == "better"  # lower rep-2 is better
    assert hot["top-p"]["diversity"]["verdict"] == "worse"  # higher diversity is better
    assert by_temp["1.5"]["against"]["min-p"]["rep2"]["verdict"] == "not distinguishable"
    # MAUVE: four cells at p 0.011, Holm gives 0.044 to each (better at 0.05); per
    # temperature it would have been 0.022, so this also fails if the family is smaller
    assert all(at["against"][m]["mauve"]["p_holm"] == pytest.approx(0.044)
               for at in by_temp.values() for m in ("top-p", "min-p"))
    # each pair's first samples, adaptive's first, in the order of the test prefixes
    assert ev.mauve_calls[0] == ([f"adaptive:eps=0.0005,temp=0.7 {p.id}" for p in test],
                                 [f"top-p:p=0.95,temp=0.7 {p.id}" for p in test])
    assert len(ev.mauve_calls) == 4
    lines = report.temperature_paired_section(paired)
    text = "\n".join(lines)
    assert "| 0.7 | top-p | -1.000 [-1.000, -1.000] p=0.002 **better** |" in text
    assert ("At T = 0.7 (adaptive: `adaptive:eps=0.0005,temp=0.7`): Against top-p "
            "(`top-p:p=0.95,temp=0.7`), adaptive is better on rep-2, rep-3, rep-4, MAUVE; "
            "worse on diversity, coherence.") in text
    assert "Holm-adjusted across every method and temperature" in text
    # without human continuations there is no MAUVE column, and every other one stays
    no_mauve = {**paired, "by_temperature": {t: {**at, "against": {
        m: {k: v for k, v in row.items() if k != "mauve"} for m, row in at["against"].items()}}
        for t, at in by_temp.items()}}
    header = report.temperature_paired_section(no_mauve)[4]
    assert header == "| T | against | rep-2 | rep-3 | rep-4 | diversity | coherence |"
    ev.mauve_p = 0.02  # 4 x 0.02 = 0.08: no longer better
    again = tasks.temperature_paired(ev, rows_at, test)["by_temperature"]
    assert again["0.7"]["against"]["min-p"]["mauve"]["verdict"] == "not distinguishable"


def test_gsm8k_runs_extra_samplers_and_pairs_them_with_the_usual_adaptive():
    extra = ("adaptive:eps=0.005,temp=1.5", "adaptive:temp=1.5,eps=0.001",
             "min-p:p=0.1,temp=1.5")  # the last is one of GSM8K's own: not run twice
    specs = tasks.gsm8k_specs(extra)
    usual = len(tasks.gsm8k_specs())
    assert specs[:usual] == tasks.gsm8k_specs()
    assert specs[usual:] == ["adaptive:eps=0.005,mode=multinomial,temp=1.5",
                          "adaptive:eps=0.001,mode=multinomial,temp=1.5"]
    n = 40
    correct_of = {
        "greedy": [True] * n,
        "top-p:p=0.95,temp=1.5": [False] * n,
        "adaptive:eps=0.0005,temp=1.5": [True] * 20 + [False] * 20,
        "adaptive:eps=0.005,temp=1.5": [True] * 30 + [False] * 10,  # +10 of 40 over usual
        "adaptive:eps=0.001,temp=1.5": [True] * 20 + [False] * 20,
        "top-p:p=0.95": [True] * n,
    }
    paired = tasks.gsm8k_paired(correct_of, seed=0)
    # the usual adaptive is compared with greedy and the others at T 1.5, not with the
    # extra adaptive samplers; each extra one with those and with the usual one
    assert set(paired["adaptive:eps=0.0005,temp=1.5"]["against"]) == {
        "greedy", "top-p:p=0.95,temp=1.5"}
    larger = paired["adaptive:eps=0.005,temp=1.5"]["against"]
    assert set(larger) == {"greedy", "top-p:p=0.95,temp=1.5", "adaptive:eps=0.0005,temp=1.5"}
    assert larger["adaptive:eps=0.0005,temp=1.5"]["diff"] == pytest.approx(0.25)
    assert larger["adaptive:eps=0.0005,temp=1.5"]["verdict"] == "better"
    lines = report.gsm8k_paired_section(paired)
    assert ("At T = 1.5, adaptive (`adaptive:eps=0.005,temp=1.5`) scores lower than `greedy`; "
            "scores higher than `top-p:p=0.95,temp=1.5`, `adaptive:eps=0.0005,temp=1.5`."
            ) in lines
    with pytest.raises(ValueError, match="--gsm8k-sampler 'adaptive:eps=2': "):
        run.EvalConfig(gsm8k_samplers=("adaptive:eps=2",))


def test_scoring_holds_every_thread_pool_to_one_even_those_loaded_by_mauve():
    # A fresh interpreter, so that nothing imported MAUVE's stack before the block starts (as
    # in `adaptive-llama eval`), and pools that would start with 4 threads on any machine: a
    # pool left out of the limit (SciPy's OpenBLAS, which scikit-learn loads when MAUVE is
    # first imported) reports 4 after one MAUVE call.
    script = """
import numpy as np
from threadpoolctl import threadpool_info
from adaptive_llama.eval import metrics, run
rng = np.random.default_rng(0)
with run.one_thread_scoring():
    metrics.mauve_score(rng.normal(size=(40, 8)), rng.normal(size=(40, 8)))
    print(sorted({(pool["internal_api"], pool["num_threads"]) for pool in threadpool_info()}))
"""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "4", "OMP_NUM_THREADS": "4"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    pools = ast.literal_eval(out)
    assert {api for api, _ in pools} >= {"openblas", "openmp"}
    assert {threads for _, threads in pools} == {1}


def test_missing_optional_dependency_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mauve" else real(name, *a))
    with pytest.raises(DataError, match=r"mauve-text: pip install 'adaptive-llama\[eval\]'"):
        run.require_extras()


def eval_cli(*args):
    return subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "eval", *args],
                          capture_output=True, text=True, timeout=900)


PROMPTS = [
    {"prefix": "The river flows through the old town, past the", "reference":
     " market square and under three stone bridges before it reaches the sea."},
    {"prefix": "In 1905 the physicist published four papers that", "reference":
     " changed how people thought about light, time, and the size of atoms."},
    {"prefix": "Once upon a time a small dog lived in a", "reference":
     " red house at the end of a long road, and every day he waited for the mail."},
]


def test_eval_end_to_end_on_the_bundled_model_and_resume(tmp_path, smollm2_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "results"
    args = [str(smollm2_path), "--prompts", str(prompts), "--tasks", "ablation",
            "--samples", "2", "--max-tokens", "8", "--out", str(out),
            "--temperatures", "0.7,1,1.5", "--batch", "4"]
    first = eval_cli(*args)
    assert first.returncode == 0, first.stderr
    report = json.loads((out / "results.json").read_text())
    methods = report["open_ended"]["file"]["methods"]
    assert set(methods) == set(tasks.GRIDS)
    for m in methods.values():
        assert 0 <= m["diversity"][0] <= 1 and -1 <= m["coherence"][0] <= 1
        assert 0 < m["mauve"][0] <= 1 + 1e-9
    assert methods["adaptive"]["k"][0] >= 1 and methods["greedy"]["k"] is None
    assert [row["epsilon"] for row in report["ablation"]] == [0.001, 0.005, 0.01, 0.02] * 2
    ks = [row["k"][0] for row in report["ablation"][:4]]
    assert ks == sorted(ks, reverse=True)  # a larger epsilon keeps fewer tokens
    assert "adaptive-llama eval" in report["command"]
    for name in ("results.md", "diversity_coherence.png", "mauve.png", "temperature_file.png"):
        assert (out / name).stat().st_size > 0
    assert report["texts_per_s"] > 0 and report["generated_texts"] > 0
    assert report["pending"] == [] and "Interim report" not in (out / "results.md").read_text()
    # Adaptive against every other method, every metric, Holm across them, a verdict each.
    paired = report["open_ended"]["file"]["paired"]
    assert set(paired["against"]) == set(tasks.GRIDS) - {"adaptive"}
    for row in paired["against"].values():
        for metric in ("rep2", "rep3", "rep4", "diversity", "coherence", "mauve"):
            cell = row[metric]
            assert cell["ci"][0] <= cell["diff"] <= cell["ci"][1] and cell["p"] <= cell["p_holm"]
            assert cell["verdict"] in ("better", "worse", "not distinguishable")
    markdown = (out / "results.md").read_text()
    # a sentence for each other method at T = 1, one for each other temperature method at
    # each of the 3 temperatures
    others = len(tasks.GRIDS) - 1
    hot = len(tasks.TEMPERATURE_METHODS) - 1
    assert markdown.count("Against ") == others + hot * 3 and "adaptive is" in markdown
    study = report["open_ended"]["file"]["temperatures"]
    assert set(study) == set(tasks.TEMPERATURE_METHODS)
    assert set(study["adaptive"]) == {"0.7", "1.0", "1.5"}
    assert "temp=1.5" in study["adaptive"]["1.5"]["spec"]
    assert study["adaptive"]["1.0"]["spec"] == methods["adaptive"]["spec"]
    # and adaptive against each of them at each temperature, on the same prefixes
    by_temp = report["open_ended"]["file"]["temperature_paired"]["by_temperature"]
    assert list(by_temp) == ["0.7", "1.0", "1.5"]
    for temp, at in by_temp.items():
        assert at["adaptive"] == study["adaptive"][temp]["spec"]
        assert {m: row["spec"] for m, row in at["against"].items()} == {
            m: study[m][temp]["spec"] for m in tasks.TEMPERATURE_METHODS if m != "adaptive"}
        for row in at["against"].values():
            assert set(row) - {"spec"} == set(tasks.PAIRED_METRICS)
    assert markdown.count("At T = ") == 3
    # the sampling methods x 3 prompts x 2 samples + greedy x 3 + ablation 8 x 3 + the
    # temperature methods x 2 temperatures x 3 prompts (T = 1 is the tuned texts: none made)
    cache = out / "generations.jsonl"
    lines = cache.read_text().splitlines()
    sampling = len(tasks.GRIDS) - 1
    assert len(lines) == sampling * 3 * 2 + 3 + 8 * 3 + len(tasks.TEMPERATURE_METHODS) * 2 * 3

    scores = (out / "scores.jsonl").read_text()
    assert '"key": "mauve|' in scores and '"key": "paired_mauve_permutation|' in scores

    # An interrupted run: half the generations gone, the last line cut short. The rerun
    # makes only what is missing, and (seeded) makes it exactly as before.
    cache.write_text("\n".join(lines[: len(lines) // 2]) + "\n" + lines[-1][:20])
    assert eval_cli(*args).returncode == 0
    kept = len(lines) // 2  # the cut line is dropped, the rerun appends after the kept ones
    redone = {json.loads(line)["key"]: json.loads(line)["text"]
              for line in cache.read_text().splitlines()[kept:]}
    original = {json.loads(line)["key"]: json.loads(line)["text"] for line in lines}
    assert len(redone) == len(lines) - kept
    assert all(original[key] == text for key, text in redone.items())
    # The same texts: every MAUVE figure comes back from scores.jsonl, none is added.
    assert json.loads((out / "results.json").read_text())["open_ended"] == report["open_ended"]
    assert (out / "scores.jsonl").read_text() == scores
    # A third run finds every text cached: the report says so instead of "0 texts/s".
    assert eval_cli(*args).returncode == 0
    assert "every text came from generations.jsonl" in (out / "results.md").read_text()


def test_eval_with_a_malformed_prompts_file_loses_nothing(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prefix": "fine"}\n{"prefix": 3}\n')
    out = tmp_path / "results"
    out.mkdir()
    (out / "generations.jsonl").write_text('{"key": "kept", "text": "earlier work"}\n')
    result = eval_cli("--prompts", str(prompts), "--out", str(out))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f'Error: {prompts}, line 2: needs {{"prefix": "non-empty text"}}']
    assert (out / "generations.jsonl").read_text() == '{"key": "kept", "text": "earlier work"}\n'


@pytest.mark.parametrize("args,needle", [
    (["--methods", "top-p,nucleus"], "unknown method 'nucleus'"),
    (["--methods", ","], "--methods: give at least one"),
    (["--temperatures", "0.7,hot"], "--temperatures: '0.7,hot' is not a list of numbers"),
    (["--temperatures", "-1"], "`temperature` has to be in"),
    (["--gsm8k-sampler", "adaptive:eps=2"], "--gsm8k-sampler 'adaptive:eps=2': "),
    (["--gsm8k-sampler", "nucleus"], "--gsm8k-sampler 'nucleus': "),
])
def test_bad_eval_options_are_one_line_errors(tmp_path, args, needle):
    result = eval_cli(*args, "--out", str(tmp_path))
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert needle in line and not (tmp_path / "generations.jsonl").exists()


def test_an_out_folder_that_cannot_hold_files_is_one_line(tmp_path):
    a_file = tmp_path / "hostname"
    a_file.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    cases = [(a_file, "is a file"), (a_file / "below", "cannot be created")]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((locked, "is not writable"))
    for out, needle in cases:
        result = eval_cli("--out", str(out))
        assert result.returncode == 2, result.stderr
        line, = result.stderr.strip().splitlines()
        assert line.startswith(f"Error: --out: {out}") and needle in line


def test_context_holds_the_longest_continuation_and_gsm8k_answer():
    assert run.EvalConfig().n_ctx == 512  # 160-token answers: 256 + 160 -> 512
    assert run.EvalConfig(gsm8k_max_tokens=512).n_ctx == 768
    assert run.EvalConfig(max_tokens=1000).n_ctx == 1280  # 32 + 1000 + 64 -> 5 x 256
    with pytest.raises(ValueError, match="`gsm8k_max_tokens` has to be >= 1, but is 0"):
        run.EvalConfig(gsm8k_max_tokens=0)


def test_gpu_layers_reach_the_evaluation_engine(tmp_path, smollm2_path):
    with pytest.raises(ValueError, match="`n_gpu_layers` has to be -1 .all. or more, but is -2"):
        run.EvalConfig(n_gpu_layers=-2)
    evaluator = run.Evaluator(run.EvalConfig(model=str(smollm2_path), n_gpu_layers=-1,
                                             out=str(tmp_path)))
    try:  # a CPU build offloads nothing, but the engine was asked to
        assert evaluator.engine.n_gpu_layers == -1
    finally:
        evaluator.close()
    result = eval_cli("--n-gpu-layers", "-2", "--out", str(tmp_path))
    assert result.returncode == 2 and "--n-gpu-layers" in result.stderr


def test_gsm8k_sizes_come_from_the_command_line(tmp_path, smollm2_path):
    out = tmp_path / "r"
    result = eval_cli(str(smollm2_path), "--tasks", "gsm8k", "--gsm8k-n", "2",
                      "--gsm8k-max-tokens", "6", "--out", str(out))
    assert result.returncode == 0, result.stderr
    gsm = json.loads((out / "results.json").read_text())["gsm8k"]
    assert gsm["n"] == 2 and gsm["max_tokens"] == 6
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(tasks.gsm8k_specs())
    assert all(0 < r["completion_tokens"] <= 6 for r in rows)
    # 6 tokens do not finish a worked answer: the report says the limit cut them off
    assert gsm["greedy"]["cut_off"] == 1.0
    # adaptive against the others, problem by problem, at each temperature
    assert [row["temperature"] for row in gsm["paired"].values()] == list(
        tasks.GSM8K_TEMPERATURES)
    markdown = (out / "results.md").read_text()
    assert "problem by problem" in markdown
    # no open-ended task ran: neither its settings in the report nor plots, and the log says
    # only what was written
    assert "Embedder" not in markdown and not list(out.glob("*.png"))
    assert "mauve.png" not in result.stderr and str(out / "results.md") in result.stderr


def test_methods_picks_a_subset_with_equal_grids(tmp_path, smollm2_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    result = eval_cli(str(smollm2_path), "--prompts", str(prompts), "--tasks", "latency",
                      "--methods", "min-p,adaptive", "--max-tokens", "4", "--out",
                      str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r" / "results.json").read_text())
    assert set(report["open_ended"]["file"]["methods"]) == {"min-p", "adaptive"}
    assert set(report["open_ended"]["file"]["paired"]["against"]) == {"min-p"}
    # the same tuning budget for every method with something to tune
    assert all(len(grid) == 4 for name, grid in tasks.GRIDS.items()
               if name not in ("greedy", "p-less"))
    assert tasks.GRIDS["greedy"] == ["greedy"] and tasks.GRIDS["p-less"] == ["p-less"]


def test_the_report_says_in_one_sentence_which_way_each_comparison_went():
    from adaptive_llama.eval.report import sentence

    def cell(diff, p_holm, verdict):
        return {"diff": diff, "ci": [diff - 0.1, diff + 0.1], "p": p_holm, "p_holm": p_holm,
                "verdict": verdict}

    row = {"spec": "top-p:p=0.9", "mauve": cell(0.05, 0.01, "better"),
           "rep2": cell(1.0, 0.02, "worse"), "diversity": cell(0.0, 0.9, "not distinguishable")}
    assert sentence("top-p", row) == (
        "Against top-p (`top-p:p=0.9`), adaptive is worse on rep-2; better on MAUVE, and not "
        "distinguishable on diversity.")
    quiet = {"spec": "greedy", "mauve": cell(0.0, 1.0, "not distinguishable")}
    assert sentence("greedy", quiet) == ("Against greedy (`greedy`), adaptive is not "
                                         "distinguishable on any metric.")


def test_a_missing_model_is_one_line_and_loses_nothing(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "generations.jsonl").write_text('{"key": "kept", "text": "earlier work"}\n')
    result = eval_cli(str(tmp_path / "qwen-missing.gguf"), "--out", str(out))
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert "qwen-missing.gguf: no such file" in line
    assert (out / "generations.jsonl").read_text() == '{"key": "kept", "text": "earlier work"}\n'


def test_a_prompts_texts_under_every_spec_are_asked_for_together(tmp_path, engine,
                                                                  monkeypatch):
    # so that they run side by side and the engine evaluates the prompt once (the decoder's
    # sharing is tested in test_engine.py)
    from adaptive_llama.eval.data import Prompt

    prompts = [Prompt(id=f"wiki-{i}", prefix=p) for i, p in enumerate(
        ["The history of the river", "A small dog", "In the year 1905"])]
    specs = ["greedy", "adaptive:eps=0.01", "min-p"]
    asked = []
    generate_each = engine.generate_each

    def recorded(texts, **kwargs):
        asked.extend(zip(texts, kwargs["sampler"]))
        return generate_each(texts, **kwargs)

    monkeypatch.setattr(engine, "generate_each", recorded)
    ev = run.Evaluator(run.EvalConfig(out=str(tmp_path)), engine=engine)
    try:
        ev.generate("wiki", "test", "min-p", prompts[1:2], 1, max_tokens=2)  # one cached
        asked.clear()
        ev.generate_specs("wiki", "test", specs, prompts, 1, max_tokens=2)
    finally:
        ev.close()
    assert asked == [(p.prefix, spec) for p in prompts for spec in specs
                     if (p.id, spec) != ("wiki-1", "min-p")]

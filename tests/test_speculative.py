"""Speculative decoding: drafts change the speed, never the text.

The decoder verifies a sequence's drafted tokens in one batch and samples the chain at each
position in turn (adaptive_llama.runtime.speculation). On the CPU the engine computes a row the
same way whatever the batch (reference flash attention: adaptive_llama.llama.cpu_attention),
so a reply with speculation is the reply without it, token for token, for every sampler.
"""

import logging
from types import SimpleNamespace

import llama_cpp
import numpy as np
import pytest
from conftest import GPU_LAYERS, generating_batch_rows

from adaptive_llama import Engine
from adaptive_llama.llama import cpu_attention, ggml
from adaptive_llama.runtime import drafting, speculation
from adaptive_llama.runtime.batching import CHUNK
from adaptive_llama.runtime.drafting import PromptLookup
from adaptive_llama.runtime.speculation import DraftLength, RowCost, Speculation
from adaptive_llama.runtime.models import ModelError
from adaptive_llama.runtime.request import InvalidArgument

# The numba pass of `make test` runs again the tests whose outcome depends on the sampler's
# implementation (marked `backend`, tests/test_marks.py): every sampler a backend runs,
# through the chain with drafts, the chain's own choices and a grammar. The rest (attention,
# logits, the draft rule, the drafters, the refusals, llama.cpp's samplers) are the same
# code under either backend.

LONG = ("The history of the river Danube is long and full of events. " * 20
        + "Tell me about the sea:")  # 266 tokens
QUOTE = ("Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, "
         "limes, melons, peaches, oranges.")
SAMPLERS = ["greedy", "top-k:k=20,temp=0.8", "top-p:p=0.9", "typical:p=0.9",
            "min-p:p=0.05,temp=1.3", "mirostat", "mirostat1", "eta", "dist", "adaptive",
            "adaptive:temp=0.7", "adaptive:mode=uniform", "adaptive+penalties:repeat=1.3",
            "adaptive+dry:multiplier=1.5", "adaptive+xtc:probability=0.9",
            "dist+top-n-sigma:n=1.5"]
# The ones a backend (C or numba) runs: the kernel's samplers, and greedy alone, which
# chooses from the row; llama.cpp's own samplers are the same in either pass.
ON_THE_BACKEND = {"greedy", "eta", "adaptive", "adaptive:temp=0.7", "adaptive:mode=uniform",
                  "adaptive+penalties:repeat=1.3", "adaptive+dry:multiplier=1.5",
                  "adaptive+xtc:probability=0.9"}


@pytest.fixture
def always_draft(monkeypatch):
    """Every round drafts as much as it may (the length rule would often draft nothing for
    a model this small, whose rows cost almost a decode each): what is tested here is that
    whatever is drafted leaves the reply as it was."""
    monkeypatch.setattr(DraftLength, "next_length", lambda self, costs: self.n_max)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """This module's engine without drafts, as an engine is by default."""
    engine = Engine(smollm2_path, seed=1, n_ctx=1024, n_gpu_layers=GPU_LAYERS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ngram_engine(smollm2_path):
    engine = Engine(smollm2_path, seed=1, n_ctx=1024, n_gpu_layers=GPU_LAYERS, draft="ngram",
                    draft_max=6)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def model_engine(smollm2_path):
    """SmolLM2 drafting for itself: at greedy every draft is kept."""
    engine = Engine(smollm2_path, seed=1, n_ctx=1024, n_gpu_layers=GPU_LAYERS,
                    draft=smollm2_path, draft_max=5)
    # draft whatever the draft model's confidence
    engine.decoder.speculation.drafter.p_min = 0.0
    yield engine
    engine.close()


def reply(engine, text, sampler, seed=5, max_tokens=48, **kwargs):
    return engine.generate(text, chat=True, sampler=sampler, seed=seed,
                           max_tokens=max_tokens, **kwargs)


# ---- the ground it stands on: a row's logits do not depend on its batch ----

def logits(engine, index):
    row = llama_cpp.llama_get_logits_ith(engine.ctx, index)
    return np.ctypeslib.as_array(row, shape=(engine.n_vocab,)).copy()


@pytest.mark.parametrize("repeat", [1, 14])  # 12 and 842 cached cells: both sides of 512
def test_a_drafted_row_gets_the_logits_of_the_same_token_decoded_alone(engine, repeat):
    assert engine.attention == "reference"
    prompt = engine.tokenize(LONG[:60] * repeat)
    made = [284, 1784, 30, 657, 314, 4484, 288, 457]
    # the logits after each token decoded alone: replay yields before each, and decodes the
    # last one too when it ends
    alone = [logits(engine, -1) for _ in engine.replay(prompt, made)][1:]
    alone.append(logits(engine, -1))
    engine.clear_cache()
    engine.prefill(prompt)
    decoder, slot = engine.decoder, engine.decoder.slots[0]
    for j, token in enumerate(made):
        decoder._put(j, token, slot, j, True)
    decoder._batch.n_tokens = len(made)
    decoder._decode()
    slot.tokens += made
    for j in range(len(made)):
        assert np.array_equal(logits(engine, j), alone[j]), j
    engine.clear_cache()


def test_without_the_reference_kernel_the_engine_warns_and_turns_flash_attention_off(
        smollm2_path, monkeypatch, caplog):
    def unavailable():
        raise cpu_attention.Unavailable("the CPU device's interface table is laid out "
                                        "otherwise")

    monkeypatch.setattr(cpu_attention, "reference_attention", unavailable)
    with caplog.at_level(logging.WARNING):
        engine = Engine(smollm2_path, n_ctx=512, draft="ngram")
    try:
        assert engine.attention == "off"
        assert "laid out otherwise" in caplog.text and "flash attention is off" in caplog.text
        assert engine.generate("Once", sampler="greedy", max_tokens=4).completion_tokens
    finally:
        engine.close()


def test_reference_attention_is_the_default_and_false_turns_flash_attention_off(smollm2_path):
    engines = [Engine(smollm2_path, n_ctx=256, n_gpu_layers=GPU_LAYERS, reference_attention=r)
               for r in (None, False)]
    try:
        assert [e.attention for e in engines] == (
            ["reference", "off"] if not GPU_LAYERS else ["flash", "flash"])
        assert engines[0].decoder.attention_switch is not None
        assert engines[1].decoder.attention_switch is None
    finally:
        for e in engines:
            e.close()


def test_the_cpu_device_table_is_checked_before_it_is_written(monkeypatch):
    device = cpu_attention._cpu_device()
    before = device.table[ggml.DEVICE_INIT_BACKEND]
    with cpu_attention.reference_attention() as made:
        assert device.table[ggml.DEVICE_INIT_BACKEND] != before
        assert made == []
    assert device.table[ggml.DEVICE_INIT_BACKEND] == before  # the original is back
    monkeypatch.setattr(ggml, "DEVICE_GET_TYPE", ggml.DEVICE_GET_NAME)  # a moved entry
    ggml.check_layouts.cache_clear()
    try:
        with pytest.raises(ggml.Unavailable, match="get_name and get_type entries moved"):
            cpu_attention._CpuDevice()
    finally:
        ggml.check_layouts.cache_clear()


def test_whole_prompt_chunks_take_the_tiled_kernel_and_every_other_row_the_reference(
        engine, monkeypatch):
    switch = engine.decoder.attention_switch
    calls = []
    monkeypatch.setattr(switch, "set", lambda on: calls.append(on))
    engine.clear_cache()
    engine.prefill(engine.tokenize(LONG)[:140], generated=3)  # chunks 64, 64, 9; 3 rows
    assert calls == [False, False, True, True, True, True]
    engine.clear_cache()


def test_the_switch_sets_the_flag_only_when_it_changes(monkeypatch):
    flags = []
    device = cpu_attention._cpu_device()
    monkeypatch.setattr(device, "set_use_ref", lambda backend, on: flags.append((backend, on)))
    switch = cpu_attention.Switch([11, 12])
    switch.set(True)
    assert flags == []  # made with the reference kernel on
    switch.set(False)
    switch.set(False)
    switch.set(True)
    assert flags == [(11, False), (12, False), (11, True), (12, True)]


def test_a_workers_backend_takes_the_tiled_kernel_from_a_whole_chunks_rows(monkeypatch):
    """An RPC worker cannot be switched by the host: its backends decide by the rows of the
    graph, which only a whole prompt chunk has CHUNK of (the host keeps other batches under)."""
    assert cpu_attention.TILED_ROWS == CHUNK
    device = cpu_attention._cpu_device()
    backend = ggml.INIT_BACKEND(device.original)(device.device, None)
    try:
        rule = cpu_attention._RowRule(device, backend)
        for rows, reference in ((1, True), (16, True), (CHUNK - 1, True), (CHUNK, False),
                                (4 * CHUNK, False)):
            with cpu_attention.attention_graph(rows) as graph:
                assert device.attention_rows(graph) == rows
                assert rule.use_ref_for(graph) is reference, rows
        flags = []
        monkeypatch.setattr(device, "set_use_ref", lambda b, on: flags.append(on))
        monkeypatch.setattr(rule, "original", lambda b, graph: 0)
        for rows in (CHUNK, CHUNK, 1, 5, CHUNK):
            with cpu_attention.attention_graph(rows) as graph:
                assert rule._graph_compute(backend, graph) == 0
        assert flags == [False, True, False]  # set only when it changes
    finally:
        ggml.lib.backend_free(backend)


# ---- same text ----

@pytest.mark.backend
def test_the_samplers_on_the_backend_are_those_whose_chain_asks_it(engine, monkeypatch):
    """ON_THE_BACKEND, which the numba pass runs again, holds each spec whose chain takes a
    sampler from the backend: the rest run there as they did in the first pass."""
    from adaptive_llama.llama import chain

    asked = []

    class Recording:
        def __getattr__(self, name):
            asked.append(name)
            return getattr(chain._CSamplers(), name)

    monkeypatch.setattr(chain, "in_chain_samplers", Recording)
    for spec in SAMPLERS:
        asked.clear()
        with chain.SamplerChain(spec, seed=1, n_vocab=engine.n_vocab,
                                vocab_model=engine._model):
            assert bool(asked) == (spec in ON_THE_BACKEND), (spec, asked)


@pytest.mark.parametrize("sampler", [
    pytest.param(s, marks=pytest.mark.backend) if s in ON_THE_BACKEND else s for s in SAMPLERS])
def test_every_sampler_gives_the_same_reply_with_drafts(engine, ngram_engine, model_engine,
                                                        always_draft, sampler):
    plain = reply(engine, QUOTE, sampler)
    for drafted in (ngram_engine, model_engine):
        result = reply(drafted, QUOTE, sampler)
        assert result.tokens == plain.tokens, (sampler, drafted.draft, result.text, plain.text)
        assert result.text == plain.text
    assert result.draft_tokens > 0  # the draft model drafts at every step (ngram: on a match)
    assert plain.tokens


def test_a_draft_model_on_itself_at_greedy_has_every_draft_kept(model_engine, always_draft):
    result = reply(model_engine, QUOTE, "greedy", max_tokens=60)
    # 5 drafted, all kept, and the chain's own token: 6 tokens a step
    assert result.draft_tokens >= result.completion_tokens * 2 // 3 > 10
    assert result.draft_accepted == result.draft_tokens
    assert result.summary()["draft_acceptance"] == 1.0


def test_prompt_lookup_keeps_drafts_where_the_reply_copies_its_prompt(ngram_engine,
                                                                      always_draft):
    result = reply(ngram_engine, QUOTE, "greedy", max_tokens=60)
    assert result.draft_accepted >= 10
    summary = result.summary()
    assert summary["drafter"] == "ngram"
    assert summary["draft_acceptance"] == round(result.draft_accepted / result.draft_tokens, 3)


def test_past_512_cached_cells_the_reply_is_the_same(engine, ngram_engine, always_draft):
    text = LONG * 2 + " " + QUOTE  # about 560 tokens
    for sampler in ("adaptive", "greedy"):
        assert reply(ngram_engine, text, sampler).tokens == reply(engine, text, sampler).tokens


@pytest.mark.backend
def test_stop_strings_logprobs_and_a_grammar_give_the_same_result(engine, ngram_engine,
                                                                  always_draft):
    from adaptive_llama.llama.grammar import json_grammar

    for kwargs in ({"stop": ["cherries"]}, {"logprobs": 3}, {"grammar": json_grammar()}):
        plain = reply(engine, QUOTE, "adaptive", max_tokens=60, **kwargs)
        drafted = reply(ngram_engine, QUOTE, "adaptive", max_tokens=60, **kwargs)
        assert (drafted.text, drafted.finish_reason) == (plain.text, plain.finish_reason)
        assert drafted.logprobs == plain.logprobs
    assert plain.text.startswith("{")


def test_max_tokens_and_the_context_window_end_the_reply_at_the_same_token(
        smollm2_path, engine, ngram_engine, always_draft):
    for n in (1, 2, 7):
        assert reply(ngram_engine, QUOTE, "greedy", max_tokens=n).tokens == \
            reply(engine, QUOTE, "greedy", max_tokens=n).tokens
    small = {d: Engine(smollm2_path, n_ctx=256, draft=d, draft_max=8) for d in (None, "ngram")}
    try:
        text = "The history of the river Danube is long and full of events. " * 17
        results = [e.generate(text, sampler="greedy", max_tokens=None) for e in small.values()]
        assert results[0].finish_reason == results[1].finish_reason == "length"
        assert results[0].tokens == results[1].tokens
        assert results[1].draft_accepted > 0
    finally:
        for e in small.values():
            e.close()


def test_several_sequences_drafting_together_give_each_its_own_reply(smollm2_path, engine,
                                                                    always_draft):
    prompts = [QUOTE, "Count from one to twenty in words.", LONG]
    batch = Engine(smollm2_path, n_ctx=1024, parallel=3, draft="ngram", draft_max=4)
    try:
        results = batch.generate_batch(prompts, chat=True, sampler="adaptive:temp=0.8",
                                       seed=[1, 2, 3], max_tokens=40)
    finally:
        batch.close()
    for prompt, seed, result in zip(prompts, [1, 2, 3], results):
        assert result.tokens == reply(engine, prompt, "adaptive:temp=0.8", seed=seed,
                                      max_tokens=40).tokens
    assert sum(r.draft_tokens for r in results) > 0


def test_the_cache_holds_only_the_kept_tokens_after_a_reply(ngram_engine, always_draft):
    reply(ngram_engine, QUOTE, "adaptive", max_tokens=40)
    slot = ngram_engine.decoder.slots[0]
    memory = llama_cpp.llama_get_memory(ngram_engine.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(memory, slot.index) == len(slot.tokens) - 1


@pytest.mark.backend
def test_the_next_turn_after_a_drafted_reply_is_the_same_too(engine, ngram_engine,
                                                             always_draft):
    from adaptive_llama import Chat

    texts = []
    for e in (engine, ngram_engine):
        chat = Chat(e, sampler="adaptive", seed=4, max_tokens=30)
        texts.append([chat.send(QUOTE).text(), chat.send("Once more, please.").text()])
    assert texts[0] == texts[1]


# ---- refusals ----

@pytest.fixture(scope="module")
def foreign_vocabulary(smollm2_path, tmp_path_factory):
    """SmolLM2 with the text of token 1000 changed in its GGUF (same length, so the file
    stays valid): a model whose tokenizer is not the bundled one's."""
    import struct

    engine = Engine(smollm2_path, n_ctx=256)
    try:
        text = llama_cpp.llama_vocab_get_text(engine._model.vocab, 1000)
        texts = {llama_cpp.llama_vocab_get_text(engine._model.vocab, t)
                 for t in range(engine.n_vocab)}
    finally:
        engine.close()
    other = next(t for t in (text[:-1] + bytes([c]) for c in b"qxzjkv") if t not in texts)
    data = smollm2_path.read_bytes()
    field = struct.pack("<Q", len(text)) + text
    assert data.count(field) == 1
    path = tmp_path_factory.mktemp("foreign") / "foreign.gguf"
    path.write_bytes(data.replace(field, struct.pack("<Q", len(other)) + other))
    return path, text, other


def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(smollm2_path,
                                                                      foreign_vocabulary):
    path, text, other = foreign_vocabulary
    with pytest.raises(ModelError) as refused:
        Engine(smollm2_path, n_ctx=512, draft=path)
    assert str(refused.value) == (
        f"the draft model foreign.gguf cannot draft for this model: token 1000 is "
        f"{other.decode()!r} there and {text.decode()!r} in the model; use a smaller model "
        "of the same family (the same tokenizer)")
    with pytest.raises(ModelError, match="^the draft model: .*missing.gguf: no such file"):
        Engine(smollm2_path, n_ctx=512, draft="/nowhere/missing.gguf")


@pytest.mark.parametrize("kwargs, message", [
    ({"draft": "ngram", "backend_sampling": True}, "drop one of the two"),
    ({"draft": ""}, "`draft` has to be"),
    ({"draft": 3}, "`draft` has to be"),
    ({"draft": "ngram", "draft_max": 0}, "`draft_max` has to be"),
])
def test_bad_draft_arguments_are_refused_before_anything_loads(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        Engine("/nowhere/model.gguf", **kwargs)


def test_the_cli_reports_acceptance_and_refuses_a_bad_draft_model(foreign_vocabulary):
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "adaptive_llama.cli", "generate", "--prompt", QUOTE,
               "--chat", "--seed", "2", "-n", "24", "--json", "--ctx", "512"]
    out = subprocess.run([*command, "--draft", "ngram"], capture_output=True, text=True,
                         timeout=120)
    figures = json.loads(out.stdout)
    assert figures["drafter"] == "ngram" and "draft_acceptance" in figures
    one = json.loads(subprocess.run([*command, "--draft", "ngram", "--draft-max", "1"],
                                    capture_output=True, text=True, timeout=120).stdout)
    assert one["text"] == figures["text"]
    plain = json.loads(subprocess.run(command, capture_output=True, text=True,
                                      timeout=120).stdout)
    assert "drafter" not in plain
    bad = subprocess.run([*command, "--draft", str(foreign_vocabulary[0])],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("Error: the draft model")


# ---- the parts, by hand ----

def test_prompt_lookup_drafts_what_followed_the_longest_suffix_seen_before():
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 3, 4, 6, 2, 3, 4])
    # suffix 2,3,4 occurred at the start (followed by 5); 3,4 alone later (followed by 6)
    assert lookup.draft(3) == [5, 9, 3]
    lookup.extend([7])  # 3,4,7 and 4,7 are new; nothing to copy
    assert lookup.draft(3) == []
    lookup.extend([1, 2])  # 1,2 was followed by 3
    assert lookup.draft(2) == [3, 4]
    assert lookup.draft(0) == []
    assert PromptLookup([5]).draft(4) == []


def test_a_longer_match_wins_over_a_later_shorter_one():
    lookup = PromptLookup([1, 2, 3, 4, 10, 8, 2, 3, 4, 11, 1, 2, 3, 4])
    assert lookup.draft(1) == [10]  # 1,2,3,4 before 10; 2,3,4 last before 11


def test_the_latest_occurrence_wins_and_drafts_may_run_into_the_suffix():
    lookup = PromptLookup([8, 8, 8, 8])
    assert lookup.draft(5) == [8]  # 8,8,8 last followed at position 3 by the final 8
    lookup = PromptLookup([1, 2, 5, 1, 2, 6, 1, 2])
    assert lookup.draft(1) == [6]


def linear(c, n_max=16):
    """Row costs of c decodes for each drafted row."""
    return c * np.arange(1, n_max + 1)


@pytest.mark.parametrize("c", [0.2, 0.5, 0.8])
def test_one_token_drafts_are_made_exactly_when_they_promise_the_minimum_gain(c):
    # one drafted token yields 1 + a tokens for 1 + c decodes: made when
    # (1 + a) / (1 + c) > MIN_GAIN, that is a > MIN_GAIN * (1 + c) - 1
    threshold = speculation.MIN_GAIN * (1 + c) - 1
    above, below = DraftLength(n_max=1), DraftLength(n_max=1)
    above.accepted, above.drafted = threshold + 0.01, 1.0
    below.accepted, below.drafted = threshold - 0.01, 1.0
    assert above.next_length(linear(c)) == 1
    assert below.next_length(linear(c)) == 0


def test_a_draft_that_pays_less_than_the_minimum_gain_is_not_made():
    even = DraftLength(n_max=1)
    even.accepted, even.drafted = 0.5, 1.0  # 1.5 tokens for 1.5 decodes
    assert even.next_length(linear(0.5)) == 0
    slim = DraftLength(n_max=1)  # 1.6 tokens for 1.5 decodes: 7% more, within the noise
    slim.accepted, slim.drafted = 0.6, 1.0
    assert slim.next_length(linear(0.5)) == 0


def test_probes_come_often_again_once_drafts_pay():
    length = DraftLength(n_max=4)
    length.accepted, length.drafted = 0.0, 10.0
    for _ in range(8 + 16 + 32):  # three probes: the gap has grown to 64
        length.next_length(linear(0.5))
    assert length.probe_every == 64
    length.accepted = 10.0
    assert length.next_length(linear(0.5)) > 0  # paying again
    length.accepted = 0.0
    assert [length.next_length(linear(0.5)) for _ in range(8)] == [0] * 7 + [1]


def test_a_free_drafter_never_probes():
    length = DraftLength(n_max=4, probes=False)
    length.accepted, length.drafted = 0.0, 10.0
    assert not any(length.next_length(linear(0.5)) for _ in range(200))


def test_each_positions_rate_is_its_counts_with_two_rounds_at_the_overall_rate():
    length = DraftLength(n_max=3)
    length.record(3, 3)
    length.forget(4)  # the counts decay by 0.95 a token made: that draft made 4
    length.record(2, 1)
    decay = 0.95 ** 4  # drafted 2 -> 5 -> 5d + 2, accepted 1 -> 4 -> 4d + 1
    rate = (4 * decay + 1) / (5 * decay + 2)
    assert length.rate == pytest.approx(rate)
    reached, kept = [decay + 1, decay + 1, decay], [decay + 1, decay, decay]
    rates = [(k + 2 * rate) / (r + 2) for r, k in zip(reached, kept)]
    assert length.survival() == pytest.approx(np.cumprod(rates))


def test_drafts_kept_whole_or_not_at_all_are_judged_by_their_first_token():
    copies = DraftLength(n_max=16)
    for _ in range(10):  # every other draft copies 16 tokens, the others miss at once
        copies.record(1, 0)
        copies.record(16, 16)
    pooled = DraftLength(n_max=16)
    pooled.accepted, pooled.drafted = copies.accepted, copies.drafted
    # One rate for every position (0.94) would draft 3 at 0.6 decodes a row: 1.32 tokens
    # per cost; what these drafts yield is about 1 + 0.5 n, which no length pays for.
    assert pooled.next_length(linear(0.6)) == 3
    assert copies.next_length(linear(0.6)) <= 1
    # cheaper rows: copies pay at length, longer than one rate for every position would say
    assert copies.next_length(linear(0.3)) >= 12 > pooled.next_length(linear(0.3))


def test_drafts_grow_with_acceptance_and_stop_when_they_do_not_pay():
    length = DraftLength(n_max=16)
    for _ in range(20):
        length.record(8, 8)
    assert length.next_length(linear(0.05)) == 16
    length = DraftLength(n_max=16)
    length.accepted, length.drafted = 0.8, 1.0
    # tokens per cost (1 - 0.8^(n+1)) / 0.2 / (1 + 0.3 n): 1.38, 1.53, 1.55, 1.53 for n 1-4
    assert length.next_length(linear(0.3)) == 3
    # rows that cost less the more there are, as on a CPU: short drafts do not pay, 16 do
    length.accepted, length.drafted = 0.99, 1.0
    cpu = np.array([0.95 * n if n < 8 else 5 + 0.2 * (n - 8) for n in range(1, 17)])
    assert length.next_length(cpu) == 16
    for _ in range(40):
        length.record(4, 0)
    lengths = [length.next_length(linear(0.5)) for _ in range(200)]
    probes = [i for i, n in enumerate(lengths) if n]
    assert set(lengths) == {0, 1}
    gaps = np.diff([-1] + probes)
    assert list(gaps[:4]) == [8, 16, 32, 64] and set(gaps[4:]) == {64}


def test_a_free_drafter_counts_every_steps_draft_against_the_tokens_made_after_it():
    speculation = Speculation(drafting.NgramDrafter(), draft_max=4)
    speculation.start(0, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3])  # 1, 2, 3 came before 4, 5, 6, 7
    made = []
    generation = SimpleNamespace(slot=SimpleNamespace(index=0),
                                 result=SimpleNamespace(tokens=made))
    record = speculation._sequences[0]
    length = record.length

    def step():
        assert not speculation.plan([generation], room=8, left=[100]).drafted
    step()  # no plain step measured yet: nothing is drafted, but 4, 5, 6, 7 is pending
    step()  # nothing made since: nothing counted, no second draft from the same place
    assert length.drafted == 2.0 and not any(length.reached)
    assert [pending.draft for pending in record.pending] == [[4, 5, 6, 7]]
    made.append(4)  # a token made: the counts decay by 0.95, then the first draft's first
    step()          # token counts as kept
    assert length.reached == [1, 0, 0, 0] and length.kept == [1, 0, 0, 0]
    assert length.drafted == pytest.approx(2 * 0.95 + 1)
    assert [pending.draft for pending in record.pending] == [[4, 5, 6, 7], [5, 6, 7, 1]]
    made.append(5)  # the first draft's second token, the second draft's first
    step()
    assert length.reached == pytest.approx([1.95, 1, 0, 0])
    assert length.kept == pytest.approx([1.95, 1, 0, 0])
    made.append(9)  # settles all three: the first at its third token, the second at its
    step()          # second, the third (6, 7, 1, 2) at its first
    assert record.pending == []  # and nothing followed a 9 before: nothing more pending
    assert length.reached == pytest.approx([1.95 * 0.95 + 1, 0.95 + 1, 1, 0])
    assert length.kept == pytest.approx([1.95 * 0.95, 0.95, 0, 0])
    assert length.drafted == pytest.approx(((2 * 0.95 + 1) * 0.95 + 2) * 0.95 + 3)
    assert length.accepted == pytest.approx(((1 * 0.95 + 1) * 0.95 + 2) * 0.95)


def test_a_round_recorded_in_parts_counts_as_recorded_at_once():
    whole, parts = DraftLength(n_max=4), DraftLength(n_max=4)
    for length in (whole, parts):
        length.record(1, 0)  # an earlier draft
    whole.record(3, 2)
    parts.record(2, 2)
    parts.record(2, 2, known=2)  # nothing new: no change
    parts.record(3, 2, known=2)
    for counts in ("drafted", "accepted", "reached", "kept"):
        assert getattr(parts, counts) == pytest.approx(getattr(whole, counts))
    assert parts.reached == pytest.approx([2, 1, 1, 0])
    assert parts.kept == pytest.approx([1, 1, 0, 0])


def test_a_free_drafter_learns_the_positions_past_what_the_batch_verifies():
    """Verification checks two drafted tokens; the drafter's other two are compared with the
    tokens made after them, and the draft is counted as one round."""
    speculation = Speculation(drafting.NgramDrafter(), draft_max=4)
    speculation.fixed = 2
    speculation.start(0, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    made = []
    generation = SimpleNamespace(slot=SimpleNamespace(index=0),
                                 result=SimpleNamespace(tokens=made,
                                                        draft_tokens=0, draft_accepted=0))
    length = speculation._sequences[0].length
    round_ = speculation.plan([generation], room=8, left=[100])
    assert round_.sequences[0].draft == [4, 5]
    for token in (4, 5):
        assert round_.sequences[0].accepts(token)
    made += [4, 5, 6]  # both kept, then the chain's own token
    speculation.finish(round_)
    assert (generation.result.draft_tokens, generation.result.draft_accepted) == (2, 2)
    round_ = speculation.plan([generation], room=8, left=[100])
    assert length.reached == [1, 1, 1, 0] and length.kept == [1, 1, 1, 0]
    assert length.drafted == pytest.approx(2 * 0.95 ** 3 + 3)  # three tokens made
    assert round_.sequences[0].draft == [7, 1]  # from 7, 1, 2, 3, pending too
    made += [7, 1, 2]  # the first draft kept whole, then the second's first three tokens
    speculation.plan([generation], room=8, left=[100])
    # the first is settled and gone; the second waits for its last token, beside this step's
    assert [pending.start for pending in speculation._sequences[0].pending] == [3, 6]
    decay = 0.95 ** 3
    assert length.reached == pytest.approx([decay + 1, decay + 1, decay + 1, 1])
    assert length.kept == pytest.approx([decay + 1, decay + 1, decay + 1, 1])
    assert length.drafted == pytest.approx((2 * decay + 3) * decay + 1 + 3)
    made.append(3)  # the second draft's last token: it too was kept whole
    speculation.plan([generation], room=8, left=[100])
    assert [pending.start for pending in speculation._sequences[0].pending] == [6, 7]
    assert length.kept[3] == pytest.approx(length.reached[3])


def test_each_sequence_settles_its_own_draft_in_the_same_step():
    speculation = Speculation(drafting.NgramDrafter(), draft_max=4)
    generations = []
    for slot in range(2):
        speculation.start(slot, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
        generations.append(SimpleNamespace(slot=SimpleNamespace(index=slot),
                                           result=SimpleNamespace(tokens=[])))
    speculation.plan(generations, room=8, left=[100, 100])  # both drafted 4, 5, 6, 7
    generations[0].result.tokens += [4]  # agrees so far
    generations[1].result.tokens += [8]  # differs at once: settled
    speculation.plan(generations, room=8, left=[100, 100])
    first, second = (speculation._sequences[slot].length for slot in range(2))
    assert list(first.reached) == [1, 0, 0, 0] and list(first.kept) == [1, 0, 0, 0]
    assert list(second.reached) == [1, 0, 0, 0] and list(second.kept) == [0, 0, 0, 0]


def test_where_rows_are_cheap_the_rule_drafts_what_the_shadow_found(
        smollm2_path, engine, monkeypatch):
    """Rows that cost almost nothing, as on a GPU (the CPU here is made to look like one):
    drafts that the shadow saw kept start at once, and the reply stays the same."""
    monkeypatch.setattr(RowCost, "observe", lambda self, seconds, rows, plain_rows: None)
    drafted = Engine(smollm2_path, seed=1, n_ctx=1024, draft="ngram", draft_max=6)
    drafted.decoder.speculation.row_cost.step_s.update({1: 0.01, 7: 0.0105})
    try:
        result = reply(drafted, QUOTE, "greedy", max_tokens=60)
    finally:
        drafted.close()
    assert result.draft_tokens > 0 and result.draft_accepted > 0
    assert result.tokens == reply(engine, QUOTE, "greedy", max_tokens=60).tokens


def test_the_row_cost_is_what_drafted_rows_add_to_a_step():
    cost = RowCost(prior=0.1)
    # nothing measured for the plain rows: no draft pays until a plain step is measured
    assert np.isinf(cost.extra(2, 4)).all()
    cost.observe(0.010, rows=2)  # 5 ms a sequence
    # past what was measured: the prior per row, 0.1 of a share, and one row to try first
    assert cost.extra(2, 4) == pytest.approx([0.1, np.inf, np.inf, np.inf])
    cost.observe(0.010 + 0.0001, rows=3)
    # 1 drafted row measured: up to 3 may be tried, the rows past it at the prior
    assert cost.extra(2, 4) == pytest.approx([0.02, 0.12, 0.22, np.inf])
    cost.observe(0.010 + 4 * 0.002, rows=6)
    # 4 drafted rows: 8 ms more, in 5 ms shares, up to 9 may be tried; rows interpolated
    # between 3 and 6 rows; past 6 at the prior, 0.5 ms a row
    assert cost.extra(2, 10)[:4] == pytest.approx([0.02, 0.547, 1.073, 1.6], abs=1e-3)
    assert cost.extra(2, 10)[4:] == pytest.approx([1.7, 1.8, 1.9, 2.0, 2.1, np.inf])
    assert cost.extra(2, 4, draft_s=0.001)[3] == pytest.approx(2.4)
    cost.observe(0.020, rows=6)  # a running average: 18 ms + 0.2 * 2 ms
    assert cost.step_s[6] == pytest.approx(0.0184)


def test_past_the_rows_measured_a_row_costs_the_least_it_may_so_that_it_is_tried():
    """The first drafted row can cost the most (Qwen2.5-Coder-1.5B on 2 cores: 40, 86 and
    124 ms for 1, 2 and 4 rows): a line through 1 and 2 rows would never let drafts that
    are kept grow past one token."""
    cost = RowCost(prior=0.1)
    for rows, ms in [(1, 40), (2, 86)]:
        cost.observe(ms / 1000, rows)
    assert cost.extra(1, 4) == pytest.approx([1.15, 1.25, 1.35, np.inf])
    kept = DraftLength(n_max=4)
    kept.accepted, kept.drafted = 0.99, 1.0
    assert kept.next_length(cost.extra(1, 4)) == 3  # measured next, then interpolated
    cost.observe(0.124, rows=4)
    # 3 rows interpolated at 105 ms
    assert cost.extra(1, 3) == pytest.approx([1.15, (105 - 40) / 40, (124 - 40) / 40])


def test_the_step_back_to_fewer_rows_counts_to_the_drafts_cost():
    cost = RowCost(prior=0.1)
    cost.observe(0.010, rows=1)
    cost.observe(0.016, rows=2)
    assert cost.extra(1, 1) == pytest.approx([0.6])
    cost.observe(0.0115, rows=1)  # llama.cpp builds the one-row graph again: 1.5 ms more
    assert cost.return_s == pytest.approx(0.0015)
    assert cost.step_s[1] == pytest.approx(0.010)  # kept out of the plain step's time
    assert cost.extra(1, 1) == pytest.approx([0.75])  # and added to the draft's cost
    cost.observe(0.013, rows=1)  # one row after one row: the plain step's running average
    assert cost.step_s[1] == pytest.approx(0.0106) and cost.return_s == pytest.approx(0.0015)
    noisy = RowCost(prior=0.1)
    for seconds, rows in [(0.010, 1), (0.016, 2), (0.009, 1)]:
        noisy.observe(seconds, rows)
    assert noisy.return_s == pytest.approx(-0.001)
    assert noisy.extra(1, 1) == pytest.approx([0.6])  # never a discount on drafts
    fresh = RowCost(prior=0.1)
    fresh.observe(0.020, rows=4)
    fresh.observe(0.010, rows=2)  # fewer rows, but their first step: measured as it is
    assert fresh.return_s is None and fresh.step_s[2] == 0.010
    fresh.reshaped()  # a prompt chunk: the next step builds its graph again, not counted
    fresh.observe(0.030, rows=2)
    assert fresh.step_s[2] == 0.010 and fresh.return_s is None
    fresh.observe(0.015, rows=2)
    assert fresh.step_s[2] == pytest.approx(0.011)


def test_only_a_return_to_the_plain_rows_measures_what_the_step_back_costs():
    """A drafted row count is measured seldom: a step's excess over its noisy average is not
    what building the graph again costs."""
    cost = RowCost(prior=0.1)
    for seconds, rows in [(0.010, 1), (0.030, 5), (0.050, 9)]:
        cost.observe(seconds, rows, plain_rows=1)
    cost.observe(0.040, rows=5, plain_rows=1)  # back from 9 rows to 5, 10 ms over 5's average
    assert cost.return_s is None and cost.step_s[5] == pytest.approx(0.032)
    cost.observe(0.0115, rows=1, plain_rows=1)
    assert cost.return_s == pytest.approx(0.0015) and cost.step_s[1] == pytest.approx(0.010)
    pair = RowCost(prior=0.1)  # two sequences: their plain step is two rows
    for seconds, rows in [(0.020, 2), (0.030, 4), (0.022, 2)]:
        pair.observe(seconds, rows, plain_rows=2)
    assert pair.return_s == pytest.approx(0.002)


def test_the_vocabulary_check_names_the_first_token_that_differs(smollm2_path,
                                                                 monkeypatch):
    engine = Engine(smollm2_path, n_ctx=512)
    try:
        real = llama_cpp.llama_vocab_get_text
        target_vocab = engine._model.vocab

        def text(vocab, token):
            if token == 77 and vocab == target_vocab:
                return b"changed"
            return real(vocab, token)

        monkeypatch.setattr(llama_cpp, "llama_vocab_get_text", text)
        drafting.check_vocabularies(engine._model, engine._model, "x.gguf")  # one model
        with pytest.raises(ModelError, match="token 77 is .* there and 'changed'"):
            from adaptive_llama.llama import rpc
            from adaptive_llama.runtime.loading import load_model

            # this machine's devices only: not workers an earlier test registered
            other, _ = load_model(smollm2_path, devices=rpc.model_devices([]))
            try:
                drafting.check_vocabularies(other, engine._model, "x.gguf")
            finally:
                other.close()
    finally:
        engine.close()


# ---- through the server, with a real client ----

def test_a_drafting_server_answers_concurrent_clients_as_each_alone(smollm2_path, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from test_server import API_KEY, serving

    log = tmp_path / "server.log"
    server = serving(smollm2_path, log, "--parallel", "3", "--draft", "ngram",
                     "--draft-max", "6")
    port = next(server)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY,
                               max_retries=0)

        def ask(seed):
            r = client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": QUOTE}], max_tokens=32,
                seed=seed, temperature=0.8)
            return r.choices[0].message.content, r.model_extra["sampler_stats"]

        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(ask, [1, 2, 3]))
        alone = [ask(seed) for seed in (1, 2, 3)]
    finally:
        next(server, None)
    assert [text for text, _ in together] == [text for text, _ in alone]
    assert all(stats["drafter"] == "ngram" for _, stats in together)
    assert "drafts kept" in log.read_text()


def test_the_figures_say_how_many_drafts_were_kept():
    from adaptive_llama.chat.repl import format_stats
    from adaptive_llama.runtime.batching import GenerationResult

    result = GenerationResult(text="x", finish_reason="stop", prompt_tokens=3,
                              completion_tokens=9, sampler="greedy", seed=1)
    assert result.drafts_kept is None and "draft" not in format_stats(result.summary())
    result.drafter, result.draft_tokens, result.draft_accepted = "ngram", 8, 6
    assert result.drafts_kept == "drafts kept 6/8 (75%)"
    assert result.summary()["draft_acceptance"] == 0.75
    assert format_stats(result.summary()).endswith("drafts (ngram): 6 of 8 kept")
    result.draft_tokens = result.draft_accepted = 0
    assert result.drafts_kept == "drafts kept 0/0"
    assert result.summary()["draft_acceptance"] is None


def test_the_repl_shows_the_drafter_and_the_drafts_kept():
    from test_repl import chat

    out = chat("/set verbose on", QUOTE, "/stats", "/show",
               args=("--draft", "ngram", "--seed", "1", "--ctx", "512"))
    assert "drafts kept " in out  # the footer
    assert "drafts (ngram): " in out  # /stats
    assert "drafts      ngram" in out  # /show


def test_config_toml_turns_drafting_on_and_a_bad_value_is_one_line(tmp_path, monkeypatch):
    import json
    import os
    from pathlib import Path

    from click.testing import CliRunner

    from adaptive_llama.cli import main

    config = Path(os.environ["XDG_CONFIG_HOME"]) / "adaptive-llama" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[defaults]\ndraft = "ngram"\ndraft_max = 4\n')
    args = ["generate", "--prompt", QUOTE, "--chat", "-n", "8", "--json", "--ctx", "512"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.splitlines()[-1])["drafter"] == "ngram"
    config.write_text('[defaults]\ndraft_max = 0\n')
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "draft_max" in result.output
    assert "Traceback" not in result.output


def test_a_draft_model_stays_on_this_machine_after_another_models_workers(smollm2_path):
    """A process that used RPC workers for one model, now stopped, loads a draft model for
    another: the draft model is not given the workers (llama.cpp's default device list
    would, and ggml would abort the process on the dead connection)."""
    import subprocess
    import sys

    from test_rpc import start_worker, stop
    from test_server import free_port

    port = free_port()
    worker = start_worker(port)
    model = str(smollm2_path)
    code = (f"from adaptive_llama import Engine\n"
            f"Engine({model!r}, n_ctx=256, rpc='127.0.0.1:{port}').close()\n"
            f"print('ready', flush=True)\n"
            f"input()\n"
            f"e = Engine({model!r}, n_ctx=256, draft={model!r})\n"
            f"print(e.generate('Hi', sampler='greedy', max_tokens=4).completion_tokens)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
    finally:
        stop(worker)
    out, err = child.communicate("\n", timeout=120)
    assert child.returncode == 0, err
    assert int(out.strip()) > 0


# ---- what each part of the rule must do (cases a mutation audit found unpinned) ----

def test_a_draft_token_outside_the_targets_vocabulary_is_not_drafted(model_engine,
                                                                      monkeypatch):
    drafter = model_engine.decoder.speculation.drafter
    state = drafter.start(0, model_engine.prompt_tokens(QUOTE, chat=True))
    assert drafter.draft([(0, state, 4)])[0]  # the same model: tokens it knows
    monkeypatch.setattr(drafter, "target_vocab", 0)  # every id past the target's
    assert drafter.draft([(0, state, 4)]) == [[]]


class _Sized:
    """A model as check_vocabularies sees it, with another vocabulary size."""

    def __init__(self, model, n_vocab: int):
        self.vocab, self._n_vocab = model.vocab, n_vocab

    def n_vocab(self) -> int:
        return self._n_vocab


def test_vocabulary_sizes_may_differ_by_128_either_way_and_no_more(engine):
    model, n = engine._model, engine._model.n_vocab()
    for diff in (-128, 128):
        drafting.check_vocabularies(_Sized(model, n + diff), model, "d.gguf")
    for diff in (-129, 129):
        with pytest.raises(ModelError, match=f"it has {n + diff:,} tokens, the model {n:,}"):
            drafting.check_vocabularies(_Sized(model, n + diff), model, "d.gguf")


@pytest.mark.backend
def test_acceptance_counts_only_the_drafts_the_chain_chose(engine, ngram_engine,
                                                           monkeypatch, always_draft):
    class Wrong(drafting.NgramDrafter):
        """Drafts the vocabulary's last token, which the chain never chooses here."""

        def draft(self, wants):
            return [[engine.n_vocab - 1] * n for _, _, n in wants]

    monkeypatch.setattr(ngram_engine.decoder.speculation, "drafter", Wrong())
    result = reply(ngram_engine, QUOTE, "adaptive", max_tokens=24)
    assert result.draft_tokens > 0 and result.draft_accepted == 0
    assert result.tokens == reply(engine, QUOTE, "adaptive", max_tokens=24).tokens


def test_several_sequences_drafting_never_pass_the_steps_rows(smollm2_path, monkeypatch,
                                                             always_draft):
    batch = Engine(smollm2_path, n_ctx=1024, parallel=3, draft="ngram", draft_max=8)
    batch.decoder.step_rows = 7
    rows = generating_batch_rows(monkeypatch)
    try:
        results = batch.generate_batch([QUOTE, QUOTE, QUOTE], chat=True, sampler="greedy",
                                       max_tokens=30)
    finally:
        batch.close()
    assert sum(r.draft_tokens for r in results) > 0
    assert max(rows) == 7  # drafts fill the step, and never pass it


def test_a_row_count_not_measured_again_is_forgotten_and_tried_anew():
    cost = RowCost(prior=0.1)
    cost.observe(0.050, rows=2)  # measured once at a long context, or in a burst of noise
    for _ in range(speculation.MAX_AGE):
        cost.observe(0.010, rows=1)
    assert 2 in cost.step_s
    cost.observe(0.010, rows=1)
    assert 2 not in cost.step_s  # 65 steps without it: guessed at the prior again
    assert cost.extra(1, 2) == pytest.approx([0.1, np.inf])


def test_a_round_shares_its_room_and_each_sequence_keeps_to_what_it_has_left():
    """Fixed-length drafts of 4 for three sequences: each gets at most what it has left and
    what the step's room still holds, in turn. Prompt lookup costs nothing: it is asked for
    its longest draft every time, and what the batch does not verify is compared later."""
    speculation = Speculation(drafting.NgramDrafter(), draft_max=4)
    speculation.fixed = 4
    generations = []
    for slot in range(3):
        speculation.start(slot, [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2])
        generations.append(SimpleNamespace(slot=SimpleNamespace(index=slot),
                                           result=SimpleNamespace(tokens=[])))
    asked = []
    draft = speculation.drafter.draft
    speculation.drafter.draft = lambda wants: asked.append([n for _, _, n in wants]) or \
        draft(wants)

    def lengths(round_):
        return [len(sequence.draft) for sequence in round_.sequences]
    # 4 of the room's 6, 1 left to the second, the last 1
    assert lengths(speculation.plan(generations, room=6, left=[100, 1, 100])) == [4, 1, 1]
    assert lengths(speculation.plan(generations, room=100, left=[2, 100, 0])) == [2, 4, 0]
    assert asked == [[4, 4, 4]] * 2
    speculation.drafter = SimpleNamespace(  # as a draft model: each token costs
        free=False, draft_s=0.0,
        draft=lambda wants: asked.append([n for _, _, n in wants]) or [[7] * n for *_, n in wants])
    asked.clear()
    speculation.plan(generations, room=6, left=[100, 1, 100])
    assert asked == [[4, 1, 1]]  # a draft model drafts only what the batch verifies


def test_a_sequence_the_lookup_has_nothing_for_leaves_the_room_to_the_others(monkeypatch):
    """Prompt lookup drafts first: the rule is asked only for a sequence that has a draft
    (most steps of a chat have none), and one without a draft takes none of the step's
    room."""
    speculation = Speculation(drafting.NgramDrafter(), draft_max=4)
    speculation.fixed = 4
    generations = []
    for slot, prompt in enumerate([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 1, 2]]):
        speculation.start(slot, prompt)  # the first has no suffix seen before, the second has
        generations.append(SimpleNamespace(slot=SimpleNamespace(index=slot),
                                           result=SimpleNamespace(tokens=[])))
    round_ = speculation.plan(generations, room=4, left=[100, 100])
    assert [s.draft for s in round_.sequences] == [[], [3, 4, 5, 6]]
    asked = []
    monkeypatch.setattr(DraftLength, "next_length",
                        lambda self, costs: asked.append(self) or self.n_max)
    speculation.fixed = None
    speculation.plan(generations, room=4, left=[100, 100])
    assert asked == [speculation._sequences[1].length]


def test_the_step_after_a_prompt_chunk_is_not_counted_in_what_rows_cost(ngram_engine,
                                                                        monkeypatch):
    """Each prompt chunk tells the row costs that the next step builds its graph again: the
    rule does not count that step, so a long prompt never makes drafts look dearer."""
    chunks, steps = [], []
    row_cost = ngram_engine.decoder.speculation.row_cost
    monkeypatch.setattr(row_cost, "reshaped", lambda: chunks.append(len(steps)))
    monkeypatch.setattr(row_cost, "observe", lambda seconds, rows, plain_rows: steps.append(rows))
    ngram_engine.clear_cache()
    reply(ngram_engine, LONG, "greedy", max_tokens=4)
    assert len(chunks) >= 2 and chunks == [0] * len(chunks)  # 266 tokens: several chunks
    assert steps  # and the steps after them were observed

"""Same seed, same reply, whatever the cache holds: a reply is a function of the model, the
conversation's tokens, the sampler spec and the seed (docs/performance.md, "Reproducibility").

On the CPU the engine evaluates batch-invariantly (flash attention through its tiled kernel
for whole prompt chunks and its one-row reference kernel for every other row, no repacked
weights), so a token's logits do not depend on how its prompt was split into batches, on
what the cache held, on the thread count or on the other sequences. Prompts here are long
(266 to 530 tokens): llama.cpp's own CPU flash attention changes kernels at 64 rows and
splits a row's attention over the threads at 512 cached cells, which short prompts never
reach.
"""

import re

import llama_cpp
import numpy as np
import pytest
from conftest import GPU_LAYERS
from test_repl import chat as repl_chat

from adaptive_llama import Chat, Engine

# The numba pass of `make test` runs again the tests marked `backend` (tests/test_marks.py):
# those whose replies a sampler chooses. A logits test is the same under either backend.

LONG = ("The history of the river Danube is long and full of events. " * 20
        + "Tell me about the sea:")  # 266 tokens


def logits_after(engine, tokens):
    engine.prefill(tokens)
    row = llama_cpp.llama_get_logits_ith(engine.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(engine.n_vocab,)).copy()


def test_a_tokens_logits_do_not_depend_on_how_its_prompt_was_batched(engine):
    tokens = engine.tokenize(LONG * 2)  # 531 tokens: a 512-token batch and the rest
    engine.clear_cache()
    whole = logits_after(engine, tokens)
    engine.clear_cache()
    engine.prefill(tokens[:37])
    engine.prefill(tokens[:300])  # 263 more from a cache of 37
    in_pieces = logits_after(engine, tokens)
    from_cache = logits_after(engine, tokens)  # all cached: the last token alone again
    assert np.array_equal(whole, in_pieces)
    assert np.array_equal(whole, from_cache)
    engine.clear_cache()


@pytest.mark.backend
def test_same_seed_same_reply_whatever_the_cache_holds(engine):
    def reply():
        return engine.generate(LONG, sampler="adaptive:eps=0.0005", seed=42,
                               max_tokens=40).text

    texts = [reply() for _ in range(3)]
    engine.clear_cache()
    texts.append(reply())
    assert texts[0] and texts == [texts[0]] * 4


@pytest.mark.backend
@pytest.mark.all_cores
def test_the_thread_count_changes_no_reply(smollm2_path):
    prompt = LONG * 2  # past 512 cached cells, where flash attention split by threads
    texts = []
    for threads in (1, 2):
        engine = Engine(smollm2_path, n_ctx=1024, n_threads=threads, n_gpu_layers=GPU_LAYERS)
        try:
            texts.append(engine.generate(prompt, sampler="adaptive", seed=3,
                                         max_tokens=24).text)
        finally:
            engine.close()
    assert texts[0] and texts[0] == texts[1]


@pytest.mark.all_cores
def test_the_thread_count_changes_no_logits_of_whole_chunks_or_single_rows(smollm2_path):
    # Whole 64-token prompt chunks go through flash attention's tiled kernel, every other
    # row through its reference kernel (adaptive_llama.llama.cpu_attention): neither may
    # depend on the threads, past 512 cells in view either.
    rows = []
    for threads in (1, 2):
        engine = Engine(smollm2_path, n_ctx=1024, n_threads=threads, n_gpu_layers=GPU_LAYERS)
        try:
            tokens = engine.tokenize(LONG * 2)[:576]  # 9 whole chunks, then 4 rows alone
            assert engine.attention == ("reference" if not GPU_LAYERS else "flash")
            rows.append([logits_after(engine, tokens[:512]),
                         logits_after(engine, tokens + [28, 29, 30, 31])])
            engine.prefill(tokens + [28, 29, 30, 31], generated=4)
            rows[-1].append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(
                engine.ctx, -1), shape=(engine.n_vocab,)).copy())
        finally:
            engine.close()
    for one, two in zip(*rows):
        assert np.array_equal(one, two)


@pytest.mark.backend
def test_regenerating_a_later_turn_repeats_it_even_from_an_empty_cache(engine):
    chat = Chat(engine, system=LONG, sampler="adaptive", seed=7, max_tokens=24)
    chat.send("Hello! Which rivers do you know?").text()
    second = chat.send("And which seas?").text()
    assert chat.regenerate().text() == second  # the cache holds the whole conversation
    engine.clear_cache()  # as a new process would start: every turn evaluated anew
    assert chat.regenerate().text() == second
    assert second


@pytest.mark.backend
def test_compare_with_the_same_sampler_repeats_the_reply_after_a_long_conversation():
    out = repl_chat(f"/set system {LONG}", "Hello! Which rivers do you know?",
                    "And which seas?", "/compare adaptive", args=("--seed", "5"))
    shown = re.findall(r"--- adaptive:[^\n]* ---\n(.*?)\n[^\n]*tokens/s", out, re.S)
    assert len(shown) == 2 and shown[0].strip()
    assert shown[0].strip() == shown[1].strip()


@pytest.mark.backend
def test_seed_zero_is_a_seed_not_a_missing_one(engine, monkeypatch):
    # 0 is falsy: a rule written `seed or fresh()` would draw a random seed for it.
    first, second = (engine.generate("Once upon a time", sampler="top-p:p=0.99,temp=1.5",
                                     seed=0, max_tokens=16) for _ in range(2))
    assert first.seed == second.seed == 0 and first.text == second.text
    monkeypatch.setattr(engine, "seed", 0)  # as Engine(seed=0) sets it
    assert engine.generate("Once upon a time", sampler="top-p:p=0.99,temp=1.5",
                           max_tokens=16).text == first.text

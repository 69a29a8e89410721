"""The samplers inside llama.cpp's chain, with the bundled model (end to end)."""

import ctypes

import llama_cpp
import numpy as np
import pytest

from adaptive_llama import adaptive_k, kernel
from adaptive_llama.kernel import adaptive_k_reference, native
from adaptive_llama.llama import chain as chain_module
from adaptive_llama.llama.chain import SamplerChain, use_sampler

# The numba pass of `make test` runs these again (tests/test_marks.py).
pytestmark = pytest.mark.backend


@pytest.fixture(autouse=True)
def backend_chosen_again_after_each_test():
    """Tests that switch kernel.BACKEND leave the chain's choice as it was."""
    yield
    chain_module.in_chain_samplers.cache_clear()


@pytest.fixture(params=["c", "numba"])
def backend(request, monkeypatch):
    """Run the test with the adaptive and eta samplers of one backend in the chain."""
    monkeypatch.setattr(kernel, "BACKEND", request.param)
    chain_module.in_chain_samplers.cache_clear()
    return request.param


def current_logits(engine):
    ptr = llama_cpp.llama_get_logits_ith(engine.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(engine.n_vocab,)).copy()


def apply_to(chain, logits):
    """Run a chain over a hand-made distribution; returns (kept ids in order, selected id)."""
    n = logits.shape[0]
    data = (llama_cpp.llama_token_data * n)()
    for i, x in enumerate(logits):
        data[i].id, data[i].logit, data[i].p = i, float(x), 0.0
    arr = llama_cpp.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(chain.pointer, ctypes.byref(arr))
    kept = [data[i].id for i in range(arr.size)]
    return kept, data[arr.selected].id if arr.selected >= 0 else None


@pytest.mark.parametrize("spec,names", [
    ("greedy", ["greedy"]),
    ("top-k:k=40", ["top-k", "dist"]),
    ("top-p:p=0.95,temp=0.7", ["temp", "top-p", "dist"]),
    ("typical:p=0.95", ["typical", "dist"]),
    ("min-p:p=0.05", ["min-p", "dist"]),
    ("mirostat:tau=5,eta=0.1", ["mirostat-v2"]),
    ("mirostat1", ["mirostat"]),
    ("adaptive-p:target=0.3,temp=0.8", ["temp", "adaptive-p"]),
    ("top-n-sigma:n=1,temp=1.5", ["top-n-sigma", "temp", "dist"]),
    ("eta:eps=0.0009", ["eta", "dist"]),
    ("adaptive:eps=0.0005", ["adaptive"]),
    ("adaptive:eps=0.0005,temp=0.8", ["temp", "adaptive"]),
    ("dist", ["dist"]),
    ("xtc+adaptive:temp=0.8+top-n-sigma+dry+penalties",
     ["penalties", "dry", "top-n-sigma", "temp", "adaptive", "xtc", "dist"]),
    ("min-p+penalties:repeat=1,freq=0.1", ["penalties", "min-p", "dist"]),
])
def test_chain_holds_what_the_spec_names_and_nothing_more(engine, spec, names):
    with SamplerChain(spec, seed=1, n_vocab=engine.n_vocab,
                      vocab_model=engine._model) as chain:
        assert chain.names() == names


def test_adaptive_keeps_exactly_the_kernels_k_on_real_logits(engine, backend):
    eps = 5e-4
    tokens = engine.tokenize("Rivers of Europe include the")
    with SamplerChain(f"adaptive:eps={eps}", seed=3, n_vocab=engine.n_vocab,
                      record_stats=True) as chain:
        for _ in range(20):
            engine.prefill(tokens)
            x = current_logits(engine)
            token = chain.sample(engine.ctx)
            stats = chain.last_stats()
            assert stats.k == adaptive_k(x, eps) == adaptive_k_reference(x, eps)
            assert stats.token == token
            # the chosen token is one of the k* most likely
            assert x[token] >= np.sort(x)[::-1][stats.k - 1]
            p = np.exp(x.astype(float) - x.max())
            p /= p.sum()
            assert stats.p_chosen == pytest.approx(p[token], rel=1e-5)
            assert stats.kept_mass == pytest.approx(np.sort(p)[::-1][:stats.k].sum(), rel=1e-6)
            entropy = -(p[p > 0] * np.log(p[p > 0])).sum()
            assert stats.entropy == pytest.approx(entropy, rel=1e-4)
            tokens.append(token)


def test_adaptive_on_a_hand_made_distribution(backend):
    # p = (0.4, 0.3, 0.2, 0.1): dConf = 0.039, 0.0255, 0.0123, 0 (see test_kernel).
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    with SamplerChain("adaptive:eps=0.02", seed=1, n_vocab=4) as chain:
        kept, chosen = apply_to(chain, logits)
    assert kept == [1, 3] and chosen in kept
    with SamplerChain("adaptive:eps=0.01,mode=uniform", seed=1, n_vocab=4) as chain:
        kept, chosen = apply_to(chain, logits)
    assert kept == [1, 3, 2] and chosen in kept


def chi_square_p(counts, probabilities) -> float:
    """p-value of Pearson's chi-square test of counts against the expected probabilities."""
    from scipy.stats import chisquare

    counts = np.asarray(counts, dtype=float)
    return chisquare(counts, counts.sum() * np.asarray(probabilities)).pvalue


def draw(spec, logits, n, seed=7):
    ids = {}
    with SamplerChain(spec, seed=seed, n_vocab=logits.shape[0]) as chain:
        for _ in range(n):
            _, chosen = apply_to(chain, logits)
            ids[chosen] = ids.get(chosen, 0) + 1
    return ids


def test_uniform_mode_samples_uniformly_in_the_kept_set(backend):
    # p = (0.4, 0.3, 0.2, 0.1) shuffled; eps 0.02 keeps ids 1 and 3 (0.4 and 0.3).
    counts = draw("adaptive:eps=0.02,mode=uniform", np.log([0.1, 0.4, 0.2, 0.3]), 4000)
    assert set(counts) == {1, 3}
    assert chi_square_p([counts[1], counts[3]], [0.5, 0.5]) > 0.001
    assert chi_square_p([counts[1], counts[3]], [4 / 7, 3 / 7]) < 0.001  # not proportional


def test_multinomial_mode_samples_in_proportion_to_p(backend):
    # eps 0.01 keeps 0.4, 0.3, 0.2 (k* = 3): draws follow p renormalised over the kept set.
    counts = draw("adaptive:eps=0.01", np.log([0.1, 0.4, 0.2, 0.3]), 6000)
    assert set(counts) == {1, 3, 2}
    observed = [counts[1], counts[3], counts[2]]
    assert chi_square_p(observed, [4 / 9, 3 / 9, 2 / 9]) > 0.001
    assert chi_square_p(observed, [1 / 3, 1 / 3, 1 / 3]) < 0.001


def test_reset_restores_the_seeded_sequence(backend):
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    with SamplerChain("adaptive:eps=0.01", seed=3, n_vocab=4) as chain:
        first = [apply_to(chain, logits)[1] for _ in range(30)]
        chain.reset()
        again = [apply_to(chain, logits)[1] for _ in range(30)]
    assert first == again and len(set(first)) > 1


@pytest.mark.parametrize("scale,branch", [(6.0, "eps"), (1.0, "entropy")])
def test_eta_keeps_exactly_what_its_formula_says(scale, branch, backend):
    # The cut is min(eps, sqrt(eps) exp(-H)): a peaked distribution (low H) cuts at eps, a
    # broad one (H > ln(1/eps) / 2 = 3.5 nats here) at the entropy term: test both.
    rng = np.random.default_rng(11)
    logits = rng.normal(0, scale, 2000)
    eps = 0.0009
    p = np.exp(logits - logits.max())
    p /= p.sum()
    entropy = -(p * np.log(p)).sum()
    entropy_term = np.sqrt(eps) * np.exp(-entropy)
    assert (entropy_term < eps) == (branch == "entropy")
    expected = set(np.flatnonzero(p > min(eps, entropy_term)).tolist())
    assert 1 < len(expected) < 2000
    # The other branch's cut would keep a different set: the test can tell them apart.
    assert expected != set(np.flatnonzero(p > max(eps, entropy_term)).tolist())
    with SamplerChain(f"eta:eps={eps}", seed=1, n_vocab=2000) as chain:
        kept, chosen = apply_to(chain, logits)
    assert set(kept) == expected and chosen in expected


@pytest.mark.parametrize("eps", [1e-20, 1e-300, 5e-324])
def test_a_tiny_epsilon_keeps_every_possible_token(eps, backend):
    # Below about 1/V every token with p > 0 adds confidence; the C kernel once overflowed
    # its candidate buffer here (exit 139).
    logits = np.random.default_rng(5).normal(0, 3, 50_000)
    logits[:100] = -np.inf
    with SamplerChain(f"adaptive:eps={eps!r}", seed=1, n_vocab=50_000) as chain:
        kept, chosen = apply_to(chain, logits)
    assert len(kept) == adaptive_k_reference(logits, eps) and chosen in kept
    assert len(kept) > 49_000


def test_nan_logits_do_not_crash_the_sampler(backend):
    logits = np.full(1000, np.nan)
    with SamplerChain("adaptive:eps=0.001", seed=1, n_vocab=1000) as chain:
        kept, chosen = apply_to(chain, logits)
    assert 1 <= len(kept) <= 1000 and chosen in range(1000)
    row = logits.astype(np.float32)
    for spec in ("adaptive:eps=0.001", "adaptive:eps=0.001,temp=0.7"):  # from the row
        with SamplerChain(spec, seed=1, n_vocab=1000) as chain:
            assert chain.from_row and chain.sample_from(row.ctypes.data) in range(1000)


def assert_same_record(mine, theirs, backend):
    """Two adaptive records of one choice: equal, bit for bit. numba's entropy is a fastmath
    sum whose order each compiled caller may choose: to the last digits there."""
    assert (mine.k, mine.token, mine.kept_mass, mine.p_chosen) == (
        theirs.k, theirs.token, theirs.kept_mass, theirs.p_chosen)
    if backend == "c":
        assert (mine.entropy, mine.conf) == (theirs.entropy, theirs.conf)
    else:
        assert mine.entropy == pytest.approx(theirs.entropy, rel=1e-6)


@pytest.mark.parametrize("spec", [
    "greedy", "top-k:k=40", "top-p:p=0.95,temp=1.5", "typical:p=0.5", "min-p:p=0.05",
    "mirostat:tau=3,eta=0.1", "mirostat1:tau=5,eta=0.1", "eta:eps=0.0009,temp=0.7",
    "adaptive-p:target=0.2,decay=0.5", "top-n-sigma:n=1.5,temp=1.3",
    "adaptive:eps=0.0005", "adaptive:eps=0.001,mode=uniform,temp=2",
    "adaptive:eps=0.0005,temp=0.7", "adaptive:eps=0.005,temp=0.37",
    "top-k:k=40+penalties:repeat=1.3+xtc:probability=0.5,threshold=0.05",
    "adaptive:eps=0.001+top-n-sigma:n=1.5+xtc:probability=0.5,threshold=0.05"])
def test_every_way_of_sampling_chooses_as_llama_sampler_sample(engine, backend, spec):
    """Three chains with one seed, over rows of real logits: llama.cpp's own
    llama_sampler_sample, SamplerChain.sample (from the context) and sample_from (a fetched
    row, as the decoder's threads run it). They choose the same tokens, their states (random
    numbers, mirostat's mu) move the same way. For temperature -> adaptive and greedy both of
    ours choose straight from the row, and the adaptive record is llama.cpp's chain's too."""
    chains = [SamplerChain(spec, seed=5, n_vocab=engine.n_vocab, record_stats=True)
              for _ in range(3)]
    llama, by_context, by_rows = chains
    assert by_context.from_row == (spec.split(":")[0] in ("greedy", "adaptive")
                                   and "+" not in spec)
    tokens = engine.tokenize("The old lighthouse keeper climbed the stairs and")
    chosen = []
    try:
        for step in range(12):
            engine.decoder.evaluate(tokens)
            address = ctypes.addressof(llama_cpp.llama_get_logits_ith(engine.ctx, -1).contents)
            for _ in range(3):  # the same row again: only the chains' states differ
                token = llama_cpp.llama_sampler_sample(llama.pointer, engine.ctx, -1)
                assert by_context.sample(engine.ctx, -1) == token
                assert by_rows.sample_from(address) == token
                if by_context.from_row and spec != "greedy":
                    assert_same_record(by_context.last_stats(), llama.last_stats(), backend)
                    assert_same_record(by_rows.last_stats(), llama.last_stats(), backend)
                chosen.append(token)
            tokens = tokens + [token]
    finally:
        for chain in chains:
            chain.close()
    if spec != "greedy":
        assert len(set(chosen)) > 1  # the comparison saw more than one choice


@pytest.mark.parametrize("spec,from_row", [
    ("adaptive", True), ("adaptive:eps=0.001,mode=uniform,temp=1.7", True), ("greedy", True),
    ("adaptive+penalties", False), ("penalties+greedy", False), ("adaptive+xtc", False),
    ("top-k", False), ("min-p", False), ("eta", False), ("dist", False),
    ("adaptive-p", False), ("top-n-sigma", False)])
def test_only_chains_that_need_no_candidate_array_choose_from_the_row(spec, from_row):
    with SamplerChain(spec, seed=1, n_vocab=100) as chain:
        assert chain.from_row == from_row


def test_a_grammar_keeps_the_chain(engine):
    grammar = llama_cpp.LlamaGrammar.from_string('root ::= "yes" | "no"', verbose=False)
    with SamplerChain("adaptive", seed=1, n_vocab=engine.n_vocab, grammar=grammar,
                      vocab_model=engine._model) as chain:
        assert not chain.from_row


def through_the_chain(chain, logits):
    """llama_sampler_sample's steps on a numpy row: every token a candidate, the chain
    applied, its choice accepted. The yardstick of the row samplers."""
    chosen = apply_to(chain, logits)[1]
    llama_cpp.llama_sampler_accept(chain.pointer, chosen)
    return chosen


def hard_rows():
    """Rows where a shortcut would show: masked tokens, a tie at the top, logits one ulp
    apart that a temperature rounds to one quotient, a vocabulary of Gemma-3's size."""
    rng = np.random.default_rng(3)
    masked = rng.normal(0, 2, 5000).astype(np.float32)
    masked[rng.choice(5000, 4000, replace=False)] = -np.inf
    tied = rng.normal(0, 1, 3000).astype(np.float32)
    tied[[17, 900, 2999]] = tied.max() + 2
    close = rng.normal(0, 0.3, 3000).astype(np.float32)
    close[5] = np.float32(1.45)
    close[6] = np.nextafter(np.float32(1.45), np.float32(2))  # / 0.7: the same quotient
    large = rng.normal(0, 3, 262_144).astype(np.float32)
    return {"masked": masked, "tied": tied, "close": close, "large": large}


@pytest.mark.parametrize("temp", [1.0, 0.7, 3.0, 0.37])
@pytest.mark.parametrize("row", ["masked", "tied", "close", "large"])
def test_row_samplers_choose_as_the_chain_on_hard_rows(backend, row, temp):
    logits = hard_rows()[row]
    n = logits.shape[0]
    for spec in (f"adaptive:eps=0.0005,temp={temp}", f"adaptive:eps=0.05,temp={temp}",
                 f"adaptive:eps=0.001,mode=uniform,temp={temp}", "greedy"):
        with (SamplerChain(spec, seed=9, n_vocab=n, record_stats=True) as mine,
              SamplerChain(spec, seed=9, n_vocab=n, record_stats=True) as theirs):
            assert mine.from_row
            for _ in range(4):
                assert mine.sample_from(logits.ctypes.data) == through_the_chain(theirs, logits)
                if spec != "greedy":
                    assert_same_record(mine.last_stats(), theirs.last_stats(), backend)
    if row == "close" and temp == 0.7:  # a case the row sampler's true division is for
        assert logits[5] < logits[6] and logits[5] / np.float32(0.7) == logits[6] / np.float32(
            0.7) == logits.max() / np.float32(0.7)


@pytest.mark.parametrize("nan_at", [0, 1, 500, 999])
def test_greedy_from_the_row_follows_llama_cpp_on_nan(backend, nan_at):
    """llama.cpp's greedy loop on a row with NaN answers by where the NaN is; so does the
    row's (a vectorised max would not)."""
    logits = np.random.default_rng(nan_at).normal(0, 1, 1000).astype(np.float32)
    logits[nan_at] = np.nan
    with (SamplerChain("greedy", seed=1, n_vocab=1000) as mine,
          SamplerChain("greedy", seed=1, n_vocab=1000) as theirs):
        assert mine.sample_from(logits.ctypes.data) == through_the_chain(theirs, logits)


def test_engine_replies_are_llama_sampler_samples_choices(engine, backend):
    """A reply from the engine (its chains choosing from the row) token by token against
    llama.cpp's llama_sampler_sample on the same logits with a chain of the same seed."""
    spec = "adaptive:eps=0.0005,temp=1.3"
    prompt = engine.tokenize("The old lighthouse keeper climbed the stairs and")
    reply = engine.generate("The old lighthouse keeper climbed the stairs and", sampler=spec,
                            seed=21, max_tokens=16).tokens
    assert len(reply) >= 8  # a reply of several tokens (this one may end before 16)
    with SamplerChain(spec, seed=21, n_vocab=engine.n_vocab) as theirs:
        for token in engine.replay(prompt, reply):
            assert llama_cpp.llama_sampler_sample(theirs.pointer, engine.ctx, -1) == token


def test_token_data_rows_have_llama_cpps_layout():
    assert chain_module.TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)
    for name in ("id", "logit", "p"):
        assert chain_module.TOKEN_DATA.fields[name][1] == getattr(
            llama_cpp.llama_token_data, name).offset


def test_seeded_runs_repeat_whatever_the_kv_cache_holds(engine):
    # The cache may hold nothing, this very prompt, or another prompt sharing the chat
    # template's head; the reply to a seed must not depend on which. (Re-evaluating only
    # the last prompt token once broke this: llama.cpp's one-token batch gives other logits.)
    prompt = engine.chat_prompt_tokens([{"role": "user", "content": "Tell me a story."}])
    other = engine.chat_prompt_tokens([{"role": "user", "content": "Name one colour."}])

    def reply(seed):
        return engine.stream(prompt, sampler="adaptive", max_tokens=24, seed=seed).text()

    replies = []
    for seed in (5, 6, 7):
        engine.clear_cache()
        fresh = reply(seed)
        again = reply(seed)
        engine.stream(other, sampler="greedy", max_tokens=4).text()
        assert fresh == again == reply(seed)
        replies.append(fresh)
    assert len(set(replies)) > 1


def test_grammar_constrained_run_with_adaptive(engine):
    grammar = llama_cpp.LlamaGrammar.from_string('root ::= ("yes" | "no") "."', verbose=False)
    for seed in range(3):
        stream = engine.stream(engine.tokenize("Is water wet? Answer:"), sampler="adaptive",
                               max_tokens=8, seed=seed, grammar=grammar)
        assert stream.text() in ("yes.", "no.")


def test_interrupted_generation_leaves_the_engine_usable(engine):
    prompt = "The three laws of thermodynamics are"
    before = engine.generate(prompt, sampler="greedy", max_tokens=16).text
    stream = engine.stream(engine.tokenize("Write a long story about a dragon."),
                           sampler="adaptive", max_tokens=200)
    for i, _ in enumerate(stream):
        if i == 5:
            stream.cancel()
            break
    assert stream.result.finish_reason == "interrupted"
    assert 0 < stream.result.completion_tokens <= 7
    assert engine.generate(prompt, sampler="greedy", max_tokens=16).text == before


def without_extra_buffer_types(monkeypatch):
    """Make llama_cpp.Llama load models without repacked/AMX weights, as the Engine does:
    llama-cpp-python 0.3.36's AMX kernel crashes on the AMX CPUs of our CI (docs/gpu.md)."""
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", params)


def test_use_sampler_with_a_users_own_llama(smollm2_path, monkeypatch):
    from adaptive_llama.runtime.engine import set_llama_log
    from adaptive_llama.runtime.threads import default_threads

    set_llama_log(False)
    without_extra_buffer_types(monkeypatch)
    # Llama reads prompts on every core of the machine unless told: under make test's
    # workers, each on a core of its own, those threads would spin against each other
    threads = default_threads()
    llm = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=256, verbose=False, seed=1,
                          n_threads=threads, n_threads_batch=threads)
    try:
        texts = []
        for _ in range(2):
            with use_sampler(llm, "adaptive:eps=0.0005", seed=9) as chains:
                out = llm.create_completion("The moon is", max_tokens=12)
                texts.append(out["choices"][0]["text"])
                assert chains and chains[0].names() == ["adaptive"]
                assert chains[0].last_stats().k >= 1
            assert chains[0].last_stats().k >= 1  # still readable once the block has ended
        assert texts[0] == texts[1] and texts[0]
        with use_sampler(llm, "greedy") as chains:
            chat = llm.create_chat_completion(
                messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
            assert chat["choices"][0]["message"]["content"]
            assert chains[0].names() == ["greedy"]
        assert "_init_sampler" not in vars(llm)  # restored afterwards
    finally:
        llm.close()


def test_out_of_memory_keeps_the_arg_max_and_counts_it(monkeypatch):
    from adaptive_llama.llama.chain import native_samplers

    monkeypatch.setattr(kernel, "BACKEND", "c")
    chain_module.in_chain_samplers.cache_clear()

    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    with SamplerChain("adaptive:eps=0.01", seed=1, n_vocab=4, record_stats=True) as chain:
        native_samplers().al_test_fail_allocations(1)  # the next buffer cannot grow
        kept, chosen = apply_to(chain, logits)
        assert kept == [1] and chosen == 1 and chain.fallbacks == 1
        assert chain.last_stats().k == 1 and chain.last_stats().token == 1
        kept, chosen = apply_to(chain, logits)  # memory is back: the real kept set
        assert kept == [1, 3, 2] and chain.fallbacks == 1


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_out_of_memory_on_the_row_keeps_the_first_arg_max_of_the_quotients(monkeypatch, temp):
    from adaptive_llama.llama.chain import native_samplers

    monkeypatch.setattr(kernel, "BACKEND", "c")
    chain_module.in_chain_samplers.cache_clear()
    # Token 1 is one ulp below token 3; divided by 0.7 the two are equal.
    logits = np.array([0.2, 1.45, 0.9, np.nextafter(np.float32(1.45), np.float32(2))],
                      dtype=np.float32)
    expected = 3 if temp == 1.0 else 1
    spec = f"adaptive:eps=0.01,temp={temp}"
    with (SamplerChain(spec, seed=1, n_vocab=4, record_stats=True) as mine,
          SamplerChain(spec, seed=1, n_vocab=4, record_stats=True) as theirs):
        native_samplers().al_test_fail_allocations(1)  # the next buffer cannot grow
        assert mine.sample_from(logits.ctypes.data) == expected and mine.fallbacks == 1
        assert mine.last_stats().k == 1 and mine.last_stats().token == expected
        native_samplers().al_test_fail_allocations(1)
        assert through_the_chain(theirs, logits) == expected and theirs.fallbacks == 1
        for _ in range(3):  # memory is back: both choose in the real kept set, alike
            assert mine.sample_from(logits.ctypes.data) == through_the_chain(theirs, logits)
            assert_same_record(mine.last_stats(), theirs.last_stats(), "c")
        assert mine.last_stats().k > 1 and mine.fallbacks == 1


def test_one_candidate_records_its_own_stats(backend):
    with SamplerChain("adaptive:eps=0.01", seed=1, n_vocab=4, record_stats=True) as chain:
        apply_to(chain, np.log(np.array([0.1, 0.4, 0.2, 0.3])))
        assert chain.last_stats().k == 3
        data = (llama_cpp.llama_token_data * 1)()
        data[0].id, data[0].logit = 7, 0.5
        arr = llama_cpp.llama_token_data_array(data=data, size=1, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(chain.pointer, ctypes.byref(arr))
        stats = chain.last_stats()
        assert arr.selected == 0 and (stats.k, stats.token, stats.p_chosen) == (1, 7, 1.0)


def test_a_cloned_chain_continues_the_same_sequence(backend):
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    with SamplerChain("adaptive:eps=0.01", seed=5, n_vocab=4) as chain:
        for _ in range(5):
            apply_to(chain, logits)
        clone = llama_cpp.llama_sampler_clone(chain.pointer)
        try:
            mine = [apply_to(chain, logits)[1] for _ in range(20)]

            class Clone:
                pointer = clone
            theirs = [apply_to(Clone, logits)[1] for _ in range(20)]
        finally:
            llama_cpp.llama_sampler_free(clone)
    assert mine == theirs and len(set(mine)) > 1


def test_numba_sampler_without_room_keeps_the_arg_max_and_counts_it(monkeypatch):
    """The numba sampler's buffers hold n_vocab tokens; a larger array is its out of memory
    (the C sampler grows its buffers: its out-of-memory test is above)."""
    monkeypatch.setattr(kernel, "BACKEND", "numba")
    chain_module.in_chain_samplers.cache_clear()
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    with SamplerChain("adaptive:eps=0.01", seed=1, n_vocab=3, record_stats=True) as chain:
        kept, chosen = apply_to(chain, logits)
        assert kept == [1] and chosen == 1 and chain.fallbacks == 1
        assert chain.last_stats().k == 1 and chain.last_stats().token == 1
    with SamplerChain("eta:eps=0.1", seed=1, n_vocab=3) as chain:
        assert apply_to(chain, logits)[1] in range(4)  # no truncation, dist samples
    from adaptive_llama.llama import numba_samplers

    row = logits.astype(np.float32)
    with SamplerChain("adaptive:eps=0.01", seed=1, n_vocab=3, record_stats=True) as chain:
        # the row sampler, on a row longer than its buffers
        assert numba_samplers.adaptive_sample_row(chain._adaptive, row.ctypes.data, 4, 1) == 1
        assert chain.fallbacks == 1 and chain.last_stats().k == 1


@pytest.mark.parametrize("spec", ["adaptive:eps=0.0005", "adaptive:eps=0.001,mode=uniform",
                                  "adaptive:eps=0.0003,temp=1.5", "eta:eps=0.0009",
                                  "p-less", "p-less:temp=1.5", "top-h",
                                  "top-h:alpha=0.6,top_n=300,temp=1.4"])
def test_same_seed_same_text_under_both_backends(engine, monkeypatch, spec):
    texts = {}
    for name in ("c", "numba"):
        monkeypatch.setattr(kernel, "BACKEND", name)
        chain_module.in_chain_samplers.cache_clear()
        result = engine.generate("The old lighthouse keeper", sampler=spec, max_tokens=48,
                                 seed=11)
        assert result.backend == name and result.summary()["backend"] == name
        texts[name] = (result.tokens, [s.k for s in result.token_stats])
    assert texts["c"] == texts["numba"] and len(texts["c"][0]) == 48


def test_truncations_cut_before_the_last_one(engine):
    """top-k:k=1 cutting before top-p leaves one token: greedy's reply at any temperature
    and seed, where top-p alone wanders."""
    prompt = "The old lighthouse keeper climbed the stairs and"
    greedy = engine.generate(prompt, sampler="greedy", max_tokens=16).text
    for seed in (1, 2, 3):
        assert engine.generate(prompt, sampler="top-k:k=1+top-p:p=0.99,temp=3", seed=seed,
                               max_tokens=16).text == greedy
    hot = [engine.generate(prompt, sampler="top-p:p=0.99,temp=3", seed=seed,
                           max_tokens=16).text for seed in (1, 2, 3)]
    assert any(text != greedy for text in hot)


@pytest.mark.parametrize("spec", ["adaptive:temp=0.7", "adaptive:eps=0.0005",
                                  "adaptive:eps=0.001,mode=uniform", "eta", "p-less",
                                  "top-h"])
def test_the_kernels_passes_choose_the_same_on_any_number_of_threads(spec):
    """The C kernel splits its passes over every token among threads in whole groups and adds
    the sums in group order: the same tokens and records, to the bit, on 1, 2 or 5 threads,
    for a row of Gemma-3's size with masked tokens and one whose size is no group multiple."""
    rng = np.random.default_rng(11)
    big = rng.normal(0, 3, 262_144).astype(np.float32)
    big[rng.choice(262_144, 30_000, replace=False)] = -np.inf
    odd = rng.normal(0, 2, 100_003).astype(np.float32)
    try:
        for row in (big, odd):
            runs = []
            for threads in (1, 2, 5):
                assert native.set_pass_threads(threads) == threads  # built with OpenMP
                with SamplerChain(spec, seed=4, n_vocab=row.shape[0], record_stats=True) as c:
                    tokens = [c.sample_from(row.ctypes.data) if c.from_row
                              else through_the_chain(c, row) for _ in range(5)]
                    runs.append((tokens, repr(c.last_stats())))
            assert runs[0] == runs[1] == runs[2]
    finally:
        native.set_pass_threads(1)

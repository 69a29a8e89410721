"""The rivals of adaptive decoding beside it: p-less and top-H (our kernels, against the
float64 formulas), llama.cpp's adaptive-p and top-n-sigma as a method of its own."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from adaptive_llama import kernel
from adaptive_llama.kernel.reference import p_less_reference, top_h_reference
from adaptive_llama.llama import chain as chain_module
from adaptive_llama.llama.chain import SamplerChain
from adaptive_llama.samplers import SpecError, parse_spec

pytestmark = pytest.mark.backend


@pytest.fixture(params=["c", "numba"])
def backend(request, monkeypatch):
    monkeypatch.setattr(kernel, "BACKEND", request.param)
    chain_module.in_chain_samplers.cache_clear()
    yield request.param
    chain_module.in_chain_samplers.cache_clear()


def kept_by(spec: str, logits, seed: int = 1) -> tuple[list[int], int]:
    """The ids a chain keeps of a hand-made row (in the array and not masked to -inf, as
    llama.cpp's top-n-sigma masks), sorted, and the one it chose."""
    logits = np.asarray(logits, dtype=np.float64)
    n = logits.shape[0]
    data = (llama_cpp.llama_token_data * n)()
    for i, x in enumerate(logits):
        data[i].id, data[i].logit, data[i].p = i, float(x), 0.0
    rows = llama_cpp.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    with SamplerChain(spec, seed=seed, n_vocab=n) as chain:
        llama_cpp.llama_sampler_apply(chain.pointer, ctypes.byref(rows))
    return (sorted(data[i].id for i in range(rows.size) if data[i].logit > -np.inf),
            data[rows.selected].id)


# ---- p-less: p_v >= L = sum p^2 ----

@pytest.mark.parametrize("p,kept", [
    ([0.4, 0.35, 0.25], [0, 1]),      # L = 0.345: 0.35 passes by 1.4%
    ([0.4, 0.34, 0.26], [0]),         # L = 0.3432: 0.34 misses by 0.9%
    ([0.5, 0.3, 0.2], [0]),           # L = 0.38
    ([0.25] * 4, [0, 1, 2, 3]),       # uniform: every p equals L, and p >= L keeps them all
    ([0.9] + [0.1 / 99] * 99, [0]),   # L = 0.81...: one token
])
def test_p_less_keeps_the_tokens_at_or_above_the_collision_probability(p, kept, backend):
    assert list(p_less_reference(np.log(p))) == kept
    ids, chosen = kept_by("p-less", np.log(p))
    assert ids == kept and chosen in kept


@pytest.mark.parametrize("scale,n", [(0.5, 3000), (2.0, 3000), (6.0, 49152), (1.0, 262144)])
def test_p_less_matches_the_float64_formula_on_random_rows(scale, n, backend):
    rng = np.random.default_rng(int(scale * 10) + n)
    for _ in range(3):
        logits = rng.normal(0, scale, n)
        expected = p_less_reference(logits).tolist()
        assert 1 <= len(expected) < n
        ids, chosen = kept_by("p-less", logits)
        assert ids == expected and chosen in expected


def kept_sizes_on_real_rows(engine, prompt: str, spec: str, reference) -> set[int]:
    """Six rows of real logits, each after the chain's own choice: the kept set equals the
    float64 reference's on each. Returns the sizes of the kept sets seen."""
    tokens = engine.tokenize(prompt)
    sizes = set()
    for _ in range(6):
        engine.prefill(tokens)
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(engine.ctx, -1),
                                    shape=(engine.n_vocab,)).copy()
        ids, chosen = kept_by(spec, row)
        assert ids == reference(row).tolist()
        sizes.add(len(ids))
        tokens = tokens + [chosen]
    return sizes


def test_p_less_matches_the_float64_formula_on_real_logits(engine, backend):
    sizes = kept_sizes_on_real_rows(engine, "The history of the river Thames begins",
                                    "p-less", p_less_reference)
    assert max(sizes) > 1


def test_p_less_follows_the_temperature(backend):
    # Hotter rows are flatter, so L falls and more tokens pass.
    logits = np.random.default_rng(3).normal(0, 3.0, 5000)
    cold = kept_by("p-less:temp=0.5", logits)[0]
    hot = kept_by("p-less:temp=2", logits)[0]
    assert cold == p_less_reference(logits / 0.5).tolist()
    assert hot == p_less_reference(logits / 2).tolist()
    assert len(cold) < len(hot)


def test_p_less_takes_no_parameter_but_temp():
    assert str(parse_spec("p-less:temp=0.8")) == "p-less:temp=0.8"
    with pytest.raises(SpecError, match="p-less takes temp="):
        parse_spec("p-less:eps=0.1")


# ---- top-H: the longest prefix of the top_n with E_k <= alpha E_N ----

# p = [0.5, 0.3, 0.2]: -p ln p = 0.3466, 0.3612, 0.3219; E = 0.3466, 0.7078, 1.0297
@pytest.mark.parametrize("spec,kept", [
    ("top-h:alpha=0.4", [0]),               # bound 0.412: E_2 is above
    ("top-h:alpha=0.68", [0]),              # bound 0.7002 < E_2 = 0.7078
    ("top-h:alpha=0.69", [0, 1]),           # bound 0.7105 >= E_2
    ("top-h:alpha=1", [0, 1, 2]),           # E_N <= E_N: the whole top_n
    ("top-h:alpha=1,top_n=2", [0, 1]),      # only the top_n are considered
    ("top-h:alpha=0.5,top_n=2", [0]),       # E_N = E_2: bound 0.3539 >= E_1 only
])
def test_top_h_keeps_the_prefix_whose_entropy_sum_stays_under_the_bound(spec, kept, backend):
    logits = np.log([0.2, 0.5, 0.3])[[1, 2, 0]]  # built in order: token 0 is the likeliest
    alpha = parse_spec(spec).params["alpha"]
    top_n = parse_spec(spec).params["top_n"]
    assert top_h_reference(logits, alpha, top_n).tolist() == kept
    ids, chosen = kept_by(spec, logits)
    assert ids == kept and chosen in kept


@pytest.mark.parametrize("scale,n,alpha,top_n", [
    (0.5, 3000, 0.4, 100), (2.0, 3000, 0.4, 100), (3.0, 49152, 0.6, 100),
    (1.0, 262144, 0.4, 100), (2.0, 5000, 0.3, 2000), (4.0, 50, 0.9, 100)])
def test_top_h_matches_the_float64_formula_on_random_rows(scale, n, alpha, top_n, backend):
    rng = np.random.default_rng(n + top_n)
    sizes = set()
    for _ in range(3):
        logits = rng.normal(0, scale, n)
        expected = top_h_reference(logits, alpha, top_n).tolist()
        ids, chosen = kept_by(f"top-h:alpha={alpha},top_n={top_n}", logits)
        assert ids == expected and chosen in expected
        sizes.add(len(ids))
    assert max(sizes) > 1


def test_top_h_matches_the_float64_formula_on_real_logits(engine, backend):
    sizes = kept_sizes_on_real_rows(engine, "The three laws of thermodynamics say that",
                                    "top-h", lambda row: top_h_reference(row, 0.4, 100))
    assert max(sizes) > 1


def test_top_h_checks_its_range():
    with pytest.raises(SpecError, match=r"`alpha` has to be in \(0, 1\], but is 0"):
        parse_spec("top-h:alpha=0")
    with pytest.raises(SpecError, match=r"`top_n` has to be an integer in \[1, "):
        parse_spec("top-h:top_n=0")


# ---- adaptive-p: llama.cpp's own ----

def chosen_probabilities(spec: str, p, draws: int) -> list[float]:
    """The probability of each token the chain chooses on the same row, draw after draw,
    each choice accepted as llama_sampler_sample does (adaptive-p's moving average)."""
    logits = np.log(np.asarray(p))
    out = []
    with SamplerChain(spec, seed=7, n_vocab=len(p)) as chain:
        for _ in range(draws):
            n = len(p)
            data = (llama_cpp.llama_token_data * n)()
            for i, x in enumerate(logits):
                data[i].id, data[i].logit, data[i].p = i, float(x), 0.0
            rows = llama_cpp.llama_token_data_array(data=data, size=n, selected=-1,
                                                    sorted=False)
            llama_cpp.llama_sampler_apply(chain.pointer, ctypes.byref(rows))
            token = data[rows.selected].id
            llama_cpp.llama_sampler_accept(chain.pointer, token)
            out.append(p[token])
    return out


def test_adaptive_p_steers_the_chosen_probabilities_towards_its_target():
    p = [0.6, 0.25, 0.1, 0.05]
    low = np.mean(chosen_probabilities("adaptive-p:target=0.1,decay=0.9", p, 400))
    high = np.mean(chosen_probabilities("adaptive-p:target=0.9,decay=0.9", p, 400))
    plain = np.dot(p, p)  # dist alone: the mean chosen probability is sum p^2 = 0.43
    assert low < plain - 0.1 and high > plain + 0.1


def test_adaptive_p_checks_its_range_and_refuses_what_cannot_follow_it():
    with pytest.raises(SpecError, match=r"`target` has to be in \[0, 1\], but is 1.5"):
        parse_spec("adaptive-p:target=1.5")
    with pytest.raises(SpecError, match=r"`decay` has to be in \[0, 0.99\], but is 1"):
        parse_spec("adaptive-p:decay=1")
    with pytest.raises(SpecError, match="xtc cannot follow adaptive-p"):
        parse_spec("adaptive-p+xtc")


# ---- top-n-sigma alone: the method ----

def test_top_n_sigma_alone_is_the_method_then_temperature_and_dist():
    spec = parse_spec("top-n-sigma:n=1.5,temp=1.3")
    assert spec.name == "dist" and spec.temp == 1.3
    assert [m.name for m in spec.modifiers] == ["top-n-sigma"]
    assert str(spec) == "dist:temp=1.3+top-n-sigma:n=1.5"
    assert parse_spec(str(spec)) == spec
    with pytest.raises(SpecError, match="`temp` is given twice"):
        parse_spec("top-n-sigma:temp=1+penalties:temp=2")


def test_top_n_sigma_keeps_the_logits_within_n_deviations_of_the_top():
    logits = np.random.default_rng(5).normal(0, 2.0, 4000)
    n = 1.5
    expected = np.flatnonzero(logits >= logits.max() - n * logits.std()).tolist()
    assert 1 < len(expected) < 200
    ids, chosen = kept_by(f"top-n-sigma:n={n}", logits)
    assert ids == expected and chosen in expected


# ---- end to end ----

@pytest.mark.parametrize("spec", ["p-less:temp=1.2", "top-h:alpha=0.5,temp=1.3",
                                  "adaptive-p:target=0.3", "top-n-sigma:n=1,temp=1.5"])
def test_each_rival_generates_and_repeats_its_text_for_a_seed(engine, spec):
    first = engine.generate("Once upon a time", sampler=spec, max_tokens=24, seed=4)
    again = engine.generate("Once upon a time", sampler=spec, max_tokens=24, seed=4)
    other = engine.generate("Once upon a time", sampler=spec, max_tokens=24, seed=5)
    assert first.tokens == again.tokens and first.completion_tokens > 0
    assert first.sampler == str(parse_spec(spec))
    assert other.tokens != first.tokens or spec.startswith("p-less")

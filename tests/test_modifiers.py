"""Modifiers joined to a sampler with ``+`` (penalties, DRY, top-n-sigma, XTC): the spec
syntax, hand-worked distributions through real llama.cpp chains, and the bundled model."""

import math

import numpy as np
import pytest

from adaptive_llama.kernel import adaptive_k_reference
from adaptive_llama.llama.chain import SamplerChain
from adaptive_llama.samplers import SpecError, parse_spec, spec_from_options

# The numba pass of `make test` runs these again (tests/test_marks.py).
pytestmark = pytest.mark.backend

# ---- the spec syntax (pure Python) ----


def test_modifiers_run_in_chain_order_whatever_order_they_are_written_in():
    spec = parse_spec("xtc:threshold=0.2 + adaptive:eps=0.001,temp=0.7+dry+penalties:repeat=1.2")
    assert spec.name == "adaptive" and spec.temp == 0.7
    assert [m.name for m in spec.modifiers] == ["penalties", "dry", "xtc"]
    assert [m.name for m in spec.stage("before")] == ["penalties", "dry"]
    assert [m.name for m in spec.stage("after")] == ["xtc"]
    assert spec.modifiers[0].params["repeat"] == 1.2
    assert str(spec).startswith("adaptive:eps=0.001,mode=multinomial,temp=0.7+penalties:")
    assert parse_spec(str(spec)) == spec  # the text reads back
    assert not spec.in_graph and parse_spec("top-k").in_graph


def test_modifiers_alone_are_followed_by_dist_at_the_temperature_one_of_them_gives():
    spec = parse_spec("penalties:repeat=1.2+top-n-sigma:n=2,temp=0.9")
    assert spec.name == "dist" and spec.temp == 0.9
    assert [m.name for m in spec.modifiers] == ["penalties", "top-n-sigma"]
    assert parse_spec("xtc").name == "dist" and parse_spec("xtc").temp == 1.0


def test_a_plus_inside_a_number_does_not_join():
    assert parse_spec("dist:temp=1e+0").temp == 1.0


@pytest.mark.parametrize("text,message", [
    ("penalties+dry+penalties", "`penalties` is given twice"),
    ("top-n-sigma+nucleus", "unknown sampler 'nucleus'"),
    ("adaptive+top-k", "has adaptive and top-k; modifiers join it with +"),
    ("adaptive+dry+dry", "`dry` is given twice"),
    ("adaptive+penalties:temp=0.5", "penalties takes repeat=, freq=, present=, last_n="),
    ("adaptive+penalties:last_n=0", "`last_n` has to be an integer in [1, 1048576]"),
    ("adaptive+penalties:present=3", "`present` has to be in [-2, 2], but is 3"),
    ("adaptive+xtc:threshold=0.6", "`threshold` has to be in (0, 0.5], but is 0.6"),
    ("greedy+xtc", "xtc cannot follow greedy, which chooses the token itself"),
    ("mirostat+xtc", "xtc cannot follow mirostat"),
    ("adaptive:mode=uniform+xtc", "xtc cannot follow adaptive:mode=uniform"),
    ("adaptive+nucleus", "unknown sampler 'nucleus'"),
])
def test_bad_joins_say_what_is_wrong(text, message):
    with pytest.raises(SpecError, match=None) as info:
        parse_spec(text)
    assert message in str(info.value)


def test_with_modifier_replaces_one_of_the_same_name():
    spec = parse_spec("adaptive+penalties:repeat=1.3+xtc")
    again = spec.with_modifier(parse_spec("dist+penalties:repeat=1.05").modifiers[0])
    assert [m.name for m in again.modifiers] == ["penalties", "xtc"]
    assert again.modifiers[0].params["repeat"] == 1.05
    assert spec.with_param("eps", 0.002).modifiers == spec.modifiers  # the sampler's own


@pytest.mark.parametrize("options,expected", [
    ({"repeat_penalty": 1.2}, "adaptive+penalties:repeat=1.2,freq=0,present=0,last_n=64"),
    ({"repeat_penalty": 1.2, "repeat_last_n": -1}, "adaptive+penalties:repeat=1.2,last_n=1048576"),
    ({"repeat_penalty": 1.2, "repeat_last_n": 0}, "adaptive"),  # Ollama's "off"
    ({"presence_penalty": 0.5, "frequency_penalty": -0.5, "repeat_last_n": 16},
     "adaptive+penalties:repeat=1,freq=-0.5,present=0.5,last_n=16"),
    ({"repeat_penalty": 1.0, "presence_penalty": 0.0}, "adaptive"),  # neutral: no entry
    ({"dry_multiplier": 0.5}, "adaptive+dry:multiplier=0.5,base=1.75,allowed_length=2"),
    ({"dry_base": 2.0}, "adaptive"),  # llama-server's DRY is off until a multiplier
    ({"xtc_probability": 0.3, "xtc_threshold": 0.2},
     "adaptive+xtc:probability=0.3,threshold=0.2"),
    ({"xtc_probability": 0.0}, "adaptive"),
    ({"top_n_sigma": 1.5}, "adaptive+top-n-sigma:n=1.5"),
    ({"top_n_sigma": -1.0}, "adaptive"),
    ({"temperature": 0, "repeat_penalty": 1.3}, "greedy+penalties:repeat=1.3"),
    ({"sampler": "top-k:k=5+penalties:repeat=1.5", "repeat_penalty": 1.1},
     "top-k:k=5+penalties:repeat=1.1"),  # the field overrides the spec's value
    ({"mirostat": 2, "mirostat_tau": 4.0}, "mirostat:tau=4,eta=0.1"),
    ({"mirostat": 1, "mirostat_eta": 0.2}, "mirostat1:tau=5,eta=0.2,m=100"),
])
def test_protocol_options_join_their_modifiers(options, expected):
    assert spec_from_options(parse_spec("adaptive"), **options) == parse_spec(expected)


def test_option_errors_name_the_field():
    with pytest.raises(SpecError, match="`repeat_penalty` has to be in"):
        spec_from_options(parse_spec("adaptive"), repeat_penalty=0)
    with pytest.raises(SpecError, match="`mirostat` has to be 0, 1 or 2"):
        spec_from_options(parse_spec("adaptive"), mirostat=3)
    # A client's xtc option after an explicit greedy spec is an error ...
    with pytest.raises(SpecError, match="xtc cannot follow greedy"):
        spec_from_options(parse_spec("adaptive"), sampler="greedy", xtc_probability=0.5)


def test_temperature_zero_or_mirostat_drop_a_default_xtc_they_cannot_take():
    # ... but a server default with xtc still answers temperature 0 and mirostat requests.
    default = parse_spec("adaptive+penalties:repeat=1.2+xtc")
    assert spec_from_options(default, temperature=0) == parse_spec(
        "greedy+penalties:repeat=1.2")
    assert spec_from_options(default, mirostat=2) == parse_spec("mirostat+penalties:repeat=1.2")
    assert spec_from_options(default, top_k=5) == parse_spec("top-k:k=5+penalties:repeat=1.2+xtc")


# ---- hand-worked distributions through llama.cpp's own chain ----


def choose(spec: str, logits, seed: int = 1, seen=(), n: int = 1) -> list[int]:
    """The tokens a fresh chain for ``spec`` picks from the same row ``n`` times, having
    remembered ``seen`` as the prompt."""
    row = np.ascontiguousarray(logits, dtype=np.float32)
    with SamplerChain(spec, seed, n_vocab=row.size) as chain:
        chain.remember(list(seen))
        return [chain.sample_from(row.ctypes.data) for _ in range(n)]


# Token 0 leads token 1 by a little: 2.0 against 1.9.
NEAR_TIE = [2.0, 1.9, 0.0, -1.0, -2.0, -3.0]


def test_repetition_penalty_divides_a_seen_tokens_positive_logit():
    assert choose("greedy", NEAR_TIE, seen=[0]) == [0]  # no penalty: 2.0 > 1.9
    # 2.0 / 1.1 = 1.818 < 1.9: token 1 wins.
    assert choose("greedy+penalties:repeat=1.1", NEAR_TIE, seen=[0]) == [1]
    # 2.0 / 1.04 = 1.923 > 1.9: a smaller penalty leaves token 0 ahead.
    assert choose("greedy+penalties:repeat=1.04", NEAR_TIE, seen=[0]) == [0]
    # last_n=1 looks back on the last token only, 4, so token 0 goes unpenalised.
    assert choose("greedy+penalties:repeat=1.1,last_n=1", NEAR_TIE, seen=[0, 4]) == [0]


def test_presence_and_frequency_penalties_subtract():
    # presence: 2.0 - 0.15 = 1.85 < 1.9, however often token 0 was seen.
    assert choose("greedy+penalties:repeat=1,present=0.15", NEAR_TIE, seen=[0]) == [1]
    # frequency: once, 2.0 - 0.06 = 1.94 > 1.9; twice, 2.0 - 0.12 = 1.88 < 1.9.
    assert choose("greedy+penalties:repeat=1,freq=0.06", NEAR_TIE, seen=[0]) == [0]
    assert choose("greedy+penalties:repeat=1,freq=0.06", NEAR_TIE, seen=[0, 0]) == [1]


def test_penalties_see_the_reply_as_it_grows():
    # The same row five times: each choice is penalised for the next step (presence 0.5,
    # so a chosen token drops below the ones not chosen yet: 2.0 -> 1.5 < 1.9 -> 1.4 ...).
    assert choose("greedy+penalties:repeat=1,present=0.5", NEAR_TIE, n=3) == [0, 1, 0]


def test_top_n_sigma_keeps_logits_near_the_top():
    # NEAR_TIE: mean -2.1 / 6 = -0.35; squared deviations 5.5225 + 5.0625 + 0.1225 +
    # 0.4225 + 2.7225 + 7.0225 = 20.875, sigma = sqrt(20.875 / 6) = 1.865.
    # n = 0.05 keeps logits >= 2.0 - 0.093 = 1.907: token 0 alone.
    assert set(choose("dist+top-n-sigma:n=0.05", NEAR_TIE, n=200)) == {0}
    # n = 0.1 keeps >= 2.0 - 0.187 = 1.813; n = 1 keeps >= 0.135: tokens 0 and 1 either way.
    assert set(choose("dist+top-n-sigma:n=0.1", NEAR_TIE, n=200)) == {0, 1}
    assert set(choose("dist+top-n-sigma:n=1", NEAR_TIE, n=200)) == {0, 1}


# Probabilities about 0.48, 0.29, 0.18, 0.04, 0.006, 0.0009.
STEEP = np.log([0.48, 0.29, 0.18, 0.04, 0.006, 0.0009])


def test_xtc_drops_every_top_choice_but_the_least_likely():
    # threshold 0.1: tokens 0, 1, 2 are top choices; xtc keeps the last of them (2) and
    # what follows it (3, 4, 5), so token 0 and 1 are never drawn.
    picks = choose("dist+xtc:probability=1,threshold=0.1", STEEP, n=300)
    assert set(picks) <= {2, 3, 4, 5} and {2, 3} <= set(picks)
    # probability 0.5: about half the draws keep the whole distribution.
    half = choose("dist+xtc:probability=0.5,threshold=0.1", STEEP, n=400)
    share = sum(t in (0, 1) for t in half) / len(half)
    assert 0.25 < share < 0.55  # 0.5 * (0.48 + 0.29) = 0.385 expected


def test_xtc_after_adaptive_sees_its_kept_set():
    rng = np.random.default_rng(3)
    logits = np.concatenate([[6.0, 5.6, 5.2, 3.0], rng.normal(-4, 1, 2000)]).astype(np.float32)
    eps = 0.005
    k = adaptive_k_reference(logits.astype(np.float64), eps)
    kept = set(np.argsort(-logits, kind="stable")[:k].tolist())
    # Inside the kept set the top three renormalised probabilities exceed 0.2.
    assert 4 <= k < 100, k
    row = np.ascontiguousarray(logits)
    with SamplerChain(f"adaptive:eps={eps}+xtc:probability=1,threshold=0.2", 7,
                      n_vocab=row.size, record_stats=True) as chain:
        picks = []
        for _ in range(200):
            token = chain.sample_from(row.ctypes.data)
            stats = chain.last_stats()
            assert stats.token == token and stats.k == k and math.isnan(stats.p_chosen)
            picks.append(token)
    assert set(picks) <= kept - {0, 1}  # inside adaptive's set, without the two top ones
    assert 2 in picks


def test_the_same_seed_gives_the_same_draws_with_xtc():
    spec = "top-k:k=6+xtc:probability=0.5,threshold=0.1"
    assert choose(spec, STEEP, seed=4, n=50) == choose(spec, STEEP, seed=4, n=50)
    assert choose(spec, STEEP, seed=4, n=50) != choose(spec, STEEP, seed=5, n=50)


# ---- the bundled model, end to end ----

ECHO = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"


def first_tokens(engine, spec: str, n: int = 6, seed: int = 1) -> list[int]:
    request = engine.request(engine.tokenize(ECHO, True, False), sampler=spec, max_tokens=n,
                             seed=seed)
    stream = engine.run(request)
    stream.text()
    return stream.result.tokens


def test_penalties_and_dry_see_the_prompt(engine):
    greedy = first_tokens(engine, "greedy")
    assert engine.detokenize(greedy[:1]).strip() == "sat"  # the prompt's loop goes on
    # " sat" is in the prompt: the penalty pushes it below another word.
    assert first_tokens(engine, "greedy+penalties:repeat=1.5")[0] != greedy[0]
    # Looking back on the last token (" cat") only, " sat" goes unpenalised.
    assert first_tokens(engine, "greedy+penalties:repeat=1.5,last_n=1")[0] == greedy[0]
    # " sat" would extend "The cat" (2 tokens), repeated from the prompt.
    assert first_tokens(engine, "greedy+dry:multiplier=5")[0] != greedy[0]


def test_modifiers_reproduce_with_a_seed(engine):
    spec = "adaptive:eps=0.001+penalties:repeat=1.2+dry+top-n-sigma:n=2+xtc:probability=0.5"
    one = first_tokens(engine, spec, n=16, seed=9)
    assert one == first_tokens(engine, spec, n=16, seed=9)
    assert one != first_tokens(engine, spec, n=16, seed=10)

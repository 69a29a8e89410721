"""The kernel: hand-worked cases, validation, both backends against the float64 reference."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from adaptive_llama import kernel
from adaptive_llama.kernel import (
    adaptive_k,
    adaptive_k_reference,
    adaptive_stats,
    dconf_reference,
    native,
)
from adaptive_llama.kernel.numba_impl import adaptive_numba

# The numba pass of `make test` runs these again (tests/test_marks.py).
pytestmark = pytest.mark.backend

LIB, WHY = native.load()


def backends():
    """Every backend of this build; the C one must exist in a normal install."""
    assert LIB is not None, f"the C kernel is missing: {WHY}"
    return {
        "c": lambda x, eps: native.adaptive_native(x, eps, True),
        "numba": lambda x, eps: adaptive_numba(x, x.max(), eps, True),
    }


def logits_of(p):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(p, dtype=np.float64))


# ---- layer 1: small hand-worked distributions that bracket each threshold ----

# p = (0.4, 0.3, 0.2, 0.1), V = 4, ln 4 = 1.386294:
#  k=1: R_1=0.6: 0.4 ln(0.4*3/0.6) + 1.0 ln((0.6/3)/(1/4)) = 0.277259 - 0.223144 = 0.054115 -> 0.039036
#  k=2: R_2=0.3: 0.3 ln(0.3*2/0.3) + 0.6 ln((0.3/2)/(0.6/3)) = 0.207944 - 0.172609 = 0.035335 -> 0.025489
#  k=3: R_3=0.1: 0.2 ln(0.2*1/0.1) + 0.3 ln((0.1/1)/(0.3/2)) = 0.138629 - 0.121640 = 0.016990 -> 0.012256
#  k=4: k = V, limit 0.1 ln(1) / ln 4 = 0
FOUR = (0.4, 0.3, 0.2, 0.1)
FOUR_CASES = [(0.0391, 1), (0.0390, 1), (0.0255, 1), (0.0254, 2), (0.0123, 2), (0.0122, 3),
              (1e-9, 3)]

# p = (0.5, 0.5, 0, 0), V = 4 (two masked tokens):
#  k=1: R_1=0.5: 0.5 ln(0.5*3/0.5) + 1.0 ln((0.5/3)/(1/4)) = 0.549306 - 0.405465 = 0.143841 -> 0.103759
#  k=2: R_2 = 0 exactly (the rest is masked): limit 0.5 ln(4-2+1) / ln 4 = 0.549306 / 1.386294 = 0.396241
#  k=3,4: p = 0, never counted.
# At eps = 0.2, dConf_1 < eps < dConf_2: Algorithm 1 keeps the prefix up to k = 2 (a mask would
# drop token 1).
MASKED = (0.5, 0.5, 0.0, 0.0)
MASKED_CASES = [(0.3963, 1), (0.3962, 2), (0.2, 2), (0.1037, 2), (1e-6, 2)]

# p = (0.9, 0.1), V = 2: k=1: 0.9 ln(0.9*1/0.1) + ln((0.1/1)/(1/2)) = 1.977502 - 1.609438 = 0.368064
#  -> / ln 2 = 0.531004; k=2: limit 0.
TWO = (0.9, 0.1)
TWO_CASES = [(0.531, 1), (0.5311, 1), (0.001, 1)]


@pytest.mark.parametrize("p,cases", [(FOUR, FOUR_CASES), (MASKED, MASKED_CASES), (TWO, TWO_CASES)])
def test_hand_worked_thresholds(p, cases):
    x = logits_of(p)
    for eps, expected in cases:
        assert adaptive_k_reference(x, eps) == expected, eps
        assert adaptive_k(x, eps) == expected, eps
        assert adaptive_k(x.astype(np.float32), eps) == expected, eps
        for name, run in backends().items():
            assert run(x, eps)[0] == expected, (name, eps)


def test_hand_worked_dconf_values():
    np.testing.assert_allclose(dconf_reference(logits_of(FOUR)),
                               [0.039036, 0.025489, 0.012256, 0.0], atol=1e-6)
    d = dconf_reference(logits_of(MASKED))
    np.testing.assert_allclose(d[:2], [0.103759, 0.396241], atol=1e-6)
    assert np.all(np.isneginf(d[2:]))


def test_vocabulary_of_one():
    assert adaptive_k(np.array([3.0]), 0.5) == 1
    assert adaptive_stats(np.array([3.0], dtype=np.float32), 0.5).k == 1


def test_flat_distribution_keeps_one_token():
    # Uniform over V: every dConf_k is 0 (the estimate is already right), so k* = max(1, none).
    assert adaptive_k(np.zeros(1000, dtype=np.float32), 1e-4) == 1


def test_stats_match_definitions():
    x = logits_of(FOUR)
    s = adaptive_stats(x, 0.0254)
    p = np.array(FOUR)
    entropy = -(p * np.log(p)).sum()
    assert s.k == 2
    assert s.kept_mass == pytest.approx(0.7, abs=1e-12)
    assert s.entropy == pytest.approx(entropy, abs=1e-7)
    assert s.conf == pytest.approx(1 - entropy / math.log(4), abs=1e-7)


def test_input_is_not_modified():
    x = np.random.default_rng(3).normal(size=5000).astype(np.float32)
    x[::7] = -np.inf
    before = x.copy()
    adaptive_k(x, 5e-4)
    adaptive_stats(x, 5e-4)
    np.testing.assert_array_equal(x, before)


# ---- validation ----

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", [0, 4_999, 9_999])
@pytest.mark.parametrize("bad,message", [(np.nan, "NaN at index"), (np.inf, r"\+inf at index")])
def test_bad_values_anywhere_in_a_large_row_are_found(dtype, where, bad, message):
    # The C kernel finds them in its max pass (a vectorised max can step over a NaN, so it
    # also sums the row); the message names the first one.
    x = np.random.default_rng(where).normal(0, 3, 10_000).astype(dtype)
    x[:50] = -np.inf  # masked tokens are fine
    x[where] = bad
    for fn in (adaptive_k, adaptive_stats):
        with pytest.raises(ValueError, match=f"{message} {where}"):
            fn(x, 5e-4)


@pytest.mark.parametrize("logits,message", [
    (np.array([1.0, np.nan]), "NaN at index 1"),
    (np.array([1.0, np.inf]), r"\+inf at index 1"),
    (np.array([]), "empty"),
    (np.zeros((2, 3)), "1-D"),
    (np.array([-np.inf, -np.inf]), "every logit is -inf"),
    (np.array([np.nan], dtype=np.float32), "NaN at index 0"),  # V = 1 is checked too
    (np.array([np.inf]), r"\+inf at index 0"),
    (np.array([-np.inf]), "every logit is -inf"),
    ([0.5, float("nan")], "NaN at index 1"),  # a list is converted first
    (np.array(["a", "b"]), "float32 or float64"),
])
def test_bad_logits(logits, message):
    for fn in (adaptive_k, adaptive_stats):
        with pytest.raises(ValueError, match=message):
            fn(logits, 5e-4)


@pytest.mark.parametrize("dtype", ["<f4", "=f4", ">f4", "<f8", ">f8", "f2", "i8"])
def test_every_byte_order_and_number_type_gives_the_same_k(dtype):
    # The C entry reads float32/float64 in the machine's byte order through the buffer
    # protocol (arrays over ctypes memory say "<f", numpy's own "f"); kernel.py converts
    # anything else, so every spelling of these (integer, so exactly representable) logits
    # gives the float64 answer: dConf_1..4 = 0.340, 0.119, 0.060, 0.0025, so k* = 3 at 0.01.
    logits = np.array([3.0, 2.0, 1.0, -2.0, -6.0, -9.0])
    assert adaptive_k_reference(logits, 0.01) == 3
    assert adaptive_k(logits.astype(dtype), 0.01) == 3
    assert adaptive_stats(logits.astype(dtype), 0.01).k == 3


@pytest.mark.parametrize("bad", [
    np.zeros(4, dtype=">f4"), np.zeros(4, dtype=np.float16), np.zeros((2, 2), np.float32),
    np.zeros(8, np.float32)[::2], np.zeros(0, np.float32), b"abcd",
])
def test_c_entry_refuses_buffers_it_cannot_read(bad):
    # What kernel.py never passes (it converts first) still gets a TypeError, not a crash.
    assert LIB is not None, WHY
    with pytest.raises(TypeError, match="1-D contiguous float32 or float64"):
        native.adaptive_native(bad, 5e-4, False)


@pytest.mark.parametrize("eps", [0, 1, 2, -0.1, float("nan"), float("inf"), "x", None])
def test_bad_epsilon(eps):
    with pytest.raises(ValueError, match="`epsilon` has to be"):
        adaptive_k(np.zeros(3), eps)


# ---- layer 2: fast kernels against the float64 reference ----

def near_boundary(x, eps, rel=1e-6):
    """Whether some dConf_k lies within rel of eps (then either answer is right)."""
    d = dconf_reference(x)
    return bool(np.any(np.abs(d[np.isfinite(d)] - eps) <= rel * eps))


def random_rows(n_rows=1100, seed=20240607):
    """Seeded rows of many shapes, V from 2 to 262,144 (log-uniform, both ends included)."""
    rng = np.random.default_rng(seed)
    sizes = [2, 3, 262_144, 262_144] + list(
        np.exp(rng.uniform(np.log(2), np.log(262_144), n_rows - 4)).astype(int))
    kinds = ["gaussian", "masked", "tied", "flat", "near_one_hot", "offset", "heavy_head"]
    for i, V in enumerate(sizes):
        V = max(int(V), 2)
        kind = kinds[i % len(kinds)]
        scale = rng.uniform(0.5, 6.0)
        x = rng.normal(0, scale, V)
        if kind == "masked":
            x[rng.random(V) < rng.uniform(0.1, 0.99)] = -np.inf
            x[rng.integers(V)] = rng.normal()
        elif kind == "tied":
            x = np.round(x)
        elif kind == "flat":
            x = rng.normal(0, 0.01, V)
        elif kind == "near_one_hot":
            x[rng.integers(V)] += rng.uniform(15, 40)
        elif kind == "offset":
            x += rng.uniform(-3e3, 3e3)
        elif kind == "heavy_head":
            head = rng.choice(V, min(V, 50), replace=False)
            x[head] += rng.uniform(5, 14, head.size)
        dtype = np.float32 if i % 3 else np.float64
        eps = float(np.exp(rng.uniform(np.log(1e-4), np.log(2e-2))))
        yield kind, x.astype(dtype), eps


ROWS = list(random_rows())


def test_backends_match_reference_on_random_rows():
    assert len(ROWS) >= 1000
    runs = backends()
    mismatches, skipped = [], 0
    for i, (kind, x, eps) in enumerate(ROWS):
        expected = adaptive_k_reference(x, eps)
        got = {name: run(x, eps)[0] for name, run in runs.items()}
        if any(k != expected for k in got.values()):
            if near_boundary(x.astype(np.float64), eps):
                skipped += 1
                continue
            mismatches.append((i, kind, x.shape[0], eps, expected, got))
    assert not mismatches, mismatches[:5]
    assert skipped <= 5


def test_backends_match_reference_statistics():
    runs = backends()
    for kind, x, eps in ROWS[:300]:
        k = adaptive_k_reference(x, eps)
        x64 = np.sort(x.astype(np.float64))[::-1]
        p = np.exp(x64 - x64[0])
        p /= p.sum()
        nz = p[p > 0]
        entropy = -(nz * np.log(nz)).sum()
        for name, run in runs.items():
            got_k, kept, ent = run(x, eps)
            if got_k != k:
                continue  # a boundary case, counted in the test above
            assert kept == pytest.approx(p[:k].sum(), rel=1e-6, abs=1e-9), (name, kind)
            assert ent == pytest.approx(entropy, rel=1e-4, abs=1e-5), (name, kind)


def test_backends_match_reference_on_real_logits(engine):
    """Logits of the bundled model along a real continuation."""
    import llama_cpp

    tokens = engine.tokenize("The history of the river Thames begins")
    runs = backends()
    for step in range(12):
        engine.prefill(tokens)
        ptr = llama_cpp.llama_get_logits_ith(engine.ctx, -1)
        x = np.ctypeslib.as_array(ptr, shape=(engine.n_vocab,)).copy()
        for eps in (1e-4, 5e-4, 2e-3, 1e-2):
            expected = adaptive_k_reference(x, eps)
            for name, run in runs.items():
                assert run(x, eps)[0] == expected or near_boundary(x.astype(float), eps), (
                    name, step, eps)
        tokens.append(int(np.argmax(x)))


def test_docstring_formula_is_the_reference():
    """The formula in kernel's docstring is the one dconf_reference evaluates, and a literal
    per-k loop of it (R_k = 1 - c_k, small V where that is exact enough) agrees."""
    assert ("dConf_k = [ p_k ln(p_k (V-k) / R_k)  +  R_{k-1} ln( (R_k/(V-k)) / "
            "(R_{k-1}/(V-k+1)) ) ] / ln V") in kernel.__doc__
    rng = np.random.default_rng(5)
    for _ in range(50):
        V = int(rng.integers(3, 40))
        p = np.sort(rng.dirichlet(np.ones(V) * rng.uniform(0.2, 3)))[::-1]
        literal, c = [], 0.0
        for k in range(1, V + 1):
            pk = p[k - 1]
            R_prev, c = 1.0 - c, c + pk
            R = 1.0 - c
            if k == V or R <= 1e-12:
                literal.append(pk * math.log(V - k + 1) / math.log(V))
            else:
                literal.append((pk * math.log(pk * (V - k) / R)
                                + R_prev * math.log((R / (V - k)) / (R_prev / (V - k + 1))))
                               / math.log(V))
        np.testing.assert_allclose(dconf_reference(np.log(p)), literal, atol=1e-9)


def test_bound_dconf_at_most_p():
    """The bound that makes the kernels O(V): dConf_k <= p_k."""
    for kind, x, eps in ROWS[:200]:
        x64 = np.sort(x.astype(np.float64))[::-1]
        p = np.exp(x64 - x64[0])
        p /= p.sum()
        d = dconf_reference(x64)
        assert np.all(d[p > 0] <= p[p > 0] + 1e-12), kind


def test_sharper_bound_that_lets_the_c_kernel_pass_over_blocks():
    """dConf_k ln V <= p_k ln(p_k (V-k+1) / R_{k-1}) (kernel docstring), on every shape, and
    it is much tighter than p_k ln V where it matters: for tokens with p just above eps."""
    tighter = 0
    for kind, x, eps in ROWS[:300]:
        x64 = np.sort(x.astype(np.float64))[::-1]
        V = x64.shape[0]
        p = np.exp(x64 - x64[0])
        p /= p.sum()
        R_prev = np.concatenate(([1.0], np.cumsum(p[::-1])[::-1][1:]))  # R_{k-1}, summed directly
        k = np.arange(1, V + 1)
        live = (p > 0) & (R_prev > 0)
        gain = dconf_reference(x64)[live] * np.log(V)
        bound = p[live] * np.log(p[live] * (V - k[live] + 1) / R_prev[live])
        assert np.all(gain <= bound + 1e-12 * np.maximum(1.0, np.abs(bound))), kind
        tighter += int(np.sum(bound[p[live] > eps] < 0.9 * p[live][p[live] > eps] * np.log(V)))
    assert tighter > 100


LOG_BACKEND = """
import logging, sys
import numpy as np
handler = logging.StreamHandler(sys.stdout)
logging.getLogger("adaptive_llama").addHandler(handler)
logging.getLogger("adaptive_llama").setLevel(logging.DEBUG)
import adaptive_llama
for _ in range(3):
    adaptive_llama.adaptive_k(np.zeros(10), 0.1)
print("BACKEND", adaptive_llama.BACKEND)
"""


@pytest.mark.parametrize("variable,forced,impl,says", [
    ("ADAPTIVE_LLAMA_IMPL", "", "c", "kernel implementation: c (native/adaptive.c)"),
    ("ADAPTIVE_LLAMA_IMPL", "numba", "numba",
     "kernel implementation: numba (forced by ADAPTIVE_LLAMA_IMPL)"),
    ("ADAPTIVE_LLAMA_BACKEND", "numba", "numba",  # the old name still works, with a warning
     "kernel implementation: numba (forced by ADAPTIVE_LLAMA_BACKEND)"),
])
def test_the_implementation_is_chosen_and_logged_once(variable, forced, impl, says):
    env = {k: v for k, v in os.environ.items() if k != "ADAPTIVE_LLAMA_IMPL"}
    done = subprocess.run([sys.executable, "-c", LOG_BACKEND], env={**env, variable: forced},
                          capture_output=True, text=True, timeout=300, check=True)
    out = done.stdout.splitlines()
    assert [line for line in out if "implementation" in line or "BACKEND" in line] == [
        says, f"BACKEND {impl}"]
    renamed = "ADAPTIVE_LLAMA_BACKEND is now called ADAPTIVE_LLAMA_IMPL" in done.stderr
    assert renamed == (variable == "ADAPTIVE_LLAMA_BACKEND")


# ---- hypothesis properties ----

finite_rows = arrays(np.float64, st.integers(2, 400),
                     elements=st.floats(-30, 30, allow_nan=False, allow_infinity=False))
epsilons = st.floats(1e-5, 0.5, exclude_min=True)


@settings(max_examples=150, deadline=None)
@given(x=finite_rows, eps=epsilons, masked=st.integers(0, 10**6))
def test_k_within_finite_logits(x, eps, masked):
    x = x.copy()
    x[np.random.default_rng(masked).random(x.shape[0]) < 0.3] = -np.inf
    assume(np.isfinite(x).any())
    k = adaptive_k(x, eps)
    assert 1 <= k <= int(np.isfinite(x).sum())


@settings(max_examples=150, deadline=None)
@given(x=finite_rows, e1=epsilons, e2=epsilons)
def test_k_never_increases_with_epsilon(x, e1, e2):
    lo, hi = sorted((e1, e2))
    assert adaptive_k(x, hi) <= adaptive_k(x, lo)


@settings(max_examples=150, deadline=None)
@given(x=finite_rows, eps=epsilons, seed=st.integers(0, 2**32 - 1))
def test_permutation_leaves_k_unchanged(x, eps, seed):
    assume(not near_boundary(x, eps, rel=1e-6))
    perm = np.random.default_rng(seed).permutation(x.shape[0])
    assert adaptive_k(x[perm], eps) == adaptive_k(x, eps)


def test_k_from_dconf_counts_only_values_strictly_above_epsilon():
    from adaptive_llama.kernel import k_from_dconf

    assert k_from_dconf([0.5, 0.1, 0.1], 0.1) == 1  # equal to epsilon is not above it
    assert k_from_dconf([0.5, 0.1, 0.1000001], 0.1) == 3
    assert k_from_dconf([0.05, 0.5, 0.01], 0.1) == 2  # the last above, not the first
    assert k_from_dconf([0.01, 0.02], 0.1) == 1  # none above: the most likely token


def test_dconf_of_head_with_the_tail_is_the_full_formula():
    from adaptive_llama.kernel import dconf_of_head

    rng = np.random.default_rng(9)
    x = rng.normal(0, 2, 3000)
    p = np.sort(np.exp(x - x.max()) / np.exp(x - x.max()).sum())[::-1]
    full = dconf_reference(x)
    for K in (1, 10, 400, 3000):
        np.testing.assert_allclose(dconf_of_head(p[:K], p[K:][::-1].sum(), 3000), full[:K],
                                   rtol=1e-9, atol=1e-15)


def test_the_array_api_gives_the_same_bits_on_any_number_of_threads():
    """k*, the kept mass and the entropy of rows from 16,384 to 262,144 tokens (one thread
    per 16,384 tokens at most), float32 and float64, on 1, 3 and 8 threads."""
    rng = np.random.default_rng(5)
    rows = [rng.normal(0, s, n) for n, s in ((16_384, 1.0), (50_000, 4.0), (262_144, 3.0))]
    rows.append(np.where(rng.random(200_001) < 0.3, -np.inf, rng.normal(0, 2, 200_001)))
    try:
        for x in rows:
            for dtype in (np.float32, np.float64):
                for eps in (5e-4, 5e-3):
                    got = []
                    for threads in (1, 3, 8):
                        assert native.set_pass_threads(threads) == threads
                        got.append(native.adaptive_native(x.astype(dtype), eps, True))
                    assert got[0] == got[1] == got[2], (x.shape, dtype, eps)
    finally:
        native.set_pass_threads(1)


def test_without_the_c_library_the_passes_have_one_thread(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: (None, "the C library was not built"))
    assert native.set_pass_threads(4) == 1

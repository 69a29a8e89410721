"""The evaluation's metrics against values worked by hand on tiny inputs."""

import math
import os

import numpy as np
import pytest

from adaptive_llama.eval import metrics


def test_rep_n_and_diversity_on_a_repeating_text():
    text = "a b a b a b"
    # 2-grams: ab ba ab ba ab -> 5, 2 unique -> 100 * (1 - 2/5) = 60
    assert metrics.rep_n(text, 2) == pytest.approx(60.0)
    # 3-grams: aba bab aba bab -> 4, 2 unique -> 50
    assert metrics.rep_n(text, 3) == pytest.approx(50.0)
    # 4-grams: abab baba abab -> 3, 2 unique -> 33.33
    assert metrics.rep_n(text, 4) == pytest.approx(100 / 3)
    # diversity = (1 - .6) (1 - .5) (1 - 1/3) = 0.4 * 0.5 * 0.6667 = 0.1333
    assert metrics.diversity(text) == pytest.approx(0.4 * 0.5 * (2 / 3))


def test_rep_n_of_text_without_repeats_or_too_short():
    assert metrics.rep_n("the cat sat on the mat", 2) == 0.0  # "the cat" != "the mat"
    assert metrics.rep_n("the the", 2) == 0.0                  # one 2-gram: nothing repeats
    assert metrics.rep_n("one", 3) == 0.0                      # no 3-gram at all
    assert metrics.diversity("the cat sat on the mat") == 1.0


def test_coherence_is_the_rowwise_cosine():
    prefixes = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    continuations = np.array([[5.0, 0.0], [1.0, 1.0], [-3.0, -4.0]])
    # cos = 1; 2/(2*sqrt 2) = 1/sqrt 2; -25/25 = -1
    np.testing.assert_allclose(metrics.coherence(prefixes, continuations),
                               [1.0, 1 / math.sqrt(2), -1.0])


def test_mauve_of_identical_versus_disjoint_feature_sets():
    rng = np.random.default_rng(0)
    p = rng.normal(size=(80, 16))
    assert metrics.mauve_score(p, p) > 0.99
    assert metrics.mauve_score(p, p + 10.0) < 0.1


@pytest.mark.parametrize("n,d,shift,seed", [(6, 8, 0.0, 0), (40, 8, 0.3, 1), (80, 16, 0.0, 2),
                                             (120, 32, 1.0, 3), (200, 24, 10.0, 4)])
def test_mauve_is_the_float_mauve_texts_compute_mauve_gives(n, d, shift, seed):
    """The divergence curve and its areas, written with numpy, against the package's own
    function: from a few texts (2 clusters) to sets far apart (disjoint histograms)."""
    import mauve

    rng = np.random.default_rng(seed)
    p, q = rng.normal(size=(n, d)) + shift, rng.normal(size=(n, d))
    for k_seed in (25, 26):
        theirs = mauve.compute_mauve(p_features=p.astype(np.float32), q_features=q.astype(
            np.float32), num_buckets=max(2, n // 10), seed=k_seed, verbose=False).mauve
        assert metrics.mauve_score(p, q, seed=k_seed) == theirs
    assert metrics.mauve_score(p, p) == mauve.compute_mauve(
        p_features=p.astype(np.float32), q_features=p.astype(np.float32),
        num_buckets=max(2, n // 10), verbose=False).mauve


def test_mauve_keeps_faiss_warnings_out_of_stderr_and_restores_it(capfd):
    # 80 points in 8 centroids: fewer than faiss's 39 per centroid, so it would warn
    rng = np.random.default_rng(1)
    metrics.mauve_score(rng.normal(size=(80, 16)), rng.normal(size=(80, 16)))
    os.write(2, b"still open\n")
    err = capfd.readouterr().err
    assert "WARNING clustering" not in err and "still open" in err


def test_mean_ci_uses_student_t():
    mean, half = metrics.mean_ci([1.0, 2.0, 3.0])
    # sd 1, df 2: t = 4.303, half = 4.303 / sqrt 3 = 2.484
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(metrics.mean_ci([5.0])[1])


def test_proportion_ci_has_width_at_zero_successes():
    p, half = metrics.proportion_ci(0, 10)
    # Wilson upper bound at 0/10: z^2 / (n + z^2) = 3.8416 / 13.8416 = 0.2775
    assert p == 0.0 and half == pytest.approx(3.8416 / 13.8416, rel=1e-4)
    p, half = metrics.proportion_ci(5, 10)
    assert p == 0.5 and 0.25 < half < 0.35


def test_mean_sd_is_the_population_spread_without_nans():
    # values 2, 4, 6 (NaN dropped): mean 4, population sd sqrt((4 + 0 + 4) / 3) = 1.633
    mean, sd = metrics.mean_sd([2.0, float("nan"), 4.0, 6.0])
    assert mean == 4.0 and sd == pytest.approx(math.sqrt(8 / 3))
    assert all(math.isnan(v) for v in metrics.mean_sd([float("nan")]))


def test_holm_adjusts_in_step_down_order():
    # sorted: a 0.01 x 3 = 0.03; c 0.03 x 2 = 0.06; b 0.04 x 1 = 0.04 -> kept monotone: 0.06
    adjusted = metrics.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adjusted == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert metrics.holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}


def test_paired_bootstrap_finds_a_clear_difference_and_not_a_null_one():
    clear = metrics.paired_bootstrap([1.0] * 50, n_boot=500)
    assert clear["diff"] == 1.0 and clear["ci"] == [1.0, 1.0]
    assert clear["p"] == pytest.approx(1 / 501)  # no replicate at or below 0
    rng = np.random.default_rng(3)
    null = metrics.paired_bootstrap(rng.normal(0, 1, 200), n_boot=2000)
    assert null["ci"][0] < 0 < null["ci"][1] and null["p"] > 0.05
    shifted = metrics.paired_bootstrap(rng.normal(0.5, 1, 200), n_boot=2000)
    assert shifted["ci"][0] > 0 and shifted["p"] < 0.01


def test_paired_mauve_of_a_method_with_itself_is_zero():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(60, 16)).astype(np.float32)
    q = rng.normal(0.3, 1, size=(60, 16)).astype(np.float32)
    same = metrics.paired_mauve(a, a, q, resamples=5)
    assert same["diff"] == 0 and same["ci"] == [0.0, 0.0] and same["p"] == 1.0
    far = rng.normal(4, 1, size=(60, 16)).astype(np.float32)
    apart = metrics.paired_mauve(a, far, q, resamples=19)
    # every permutation mixes the far texts into both sides: none is as extreme (p = 1/20)
    assert apart["diff"] > 0.3 and apart["ci"][0] > 0 and apart["p"] == pytest.approx(1 / 20)
    more = metrics.paired_mauve(a, far, q, resamples=5, permutations=59)
    assert more["p"] == pytest.approx(1 / 60) and more["diff"] == apart["diff"]
    assert more["drawn"] == 59  # none as extreme: the sequential test draws them all
    assert apart["ci"][0] < apart["diff"] < apart["ci"][1]  # centred on its estimate


@pytest.mark.parametrize("comparisons", [1, 2, 7, 12, 30])
def test_a_family_of_paired_mauve_tests_can_reach_significance_after_holm(comparisons):
    # the permutation p-value's floor, 1 / (permutations + 1), for every comparison: Holm
    # must still leave each below 0.05 (40 permutations in all left 7 x 1/41 = 0.17)
    n = metrics.permutations(40, comparisons)
    assert n >= 40
    floor = {i: 1 / (n + 1) for i in range(comparisons)}
    assert max(metrics.holm(floor).values()) < 0.05


def test_the_sequential_permutation_test_stops_once_enough_draws_are_as_extreme():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 8)).astype(np.float32)
    q = rng.normal(0.3, 1, size=(40, 8)).astype(np.float32)
    # a against itself: every permuted difference is 0, as extreme as the observed 0, so
    # it stops at the 3rd draw of 100 with p = h / l = 3 / 3
    same = metrics.paired_mauve(a, a, q, resamples=4, permutations=100, stop_after=3)
    assert same["drawn"] == 3 and same["p"] == 1.0
    # not stopped (5 draws, all as extreme, fewer than h = 20): p = (1 + 5) / (5 + 1)
    short = metrics.paired_mauve(a, a, q, resamples=4, permutations=5)
    assert short["drawn"] == 5 and short["p"] == 1.0
    b = rng.normal(size=(40, 8)).astype(np.float32)
    alike = metrics.paired_mauve(a, b, q, resamples=4, permutations=400, stop_after=4)
    assert 4 <= alike["drawn"] < 400 and alike["p"] == pytest.approx(4 / alike["drawn"])


def test_paired_mauve_of_two_alike_methods_is_not_distinguishable():
    rng = np.random.default_rng(5)
    q = rng.normal(0.3, 1, size=(80, 8)).astype(np.float32)
    a, b = (rng.normal(size=(80, 8)).astype(np.float32) for _ in range(2))
    alike = metrics.paired_mauve(a, b, q, resamples=19)
    assert alike["ci"][0] < alike["diff"] < alike["ci"][1]
    assert alike["ci"][0] < 0 < alike["ci"][1] and alike["p"] > 0.05


def test_mauve_over_seeds_reports_mean_and_spread():
    rng = np.random.default_rng(1)
    p = rng.normal(size=(80, 8)).astype(np.float32)
    q = rng.normal(0.5, 1, size=(80, 8)).astype(np.float32)
    mean, sd = metrics.mauve_seeds(p, q, seeds=3)
    singles = [metrics.mauve_score(p, q, seed=25 + i) for i in range(3)]
    assert mean == pytest.approx(np.mean(singles)) and sd == pytest.approx(np.std(singles))


def test_coherence_of_short_and_zero_vectors():
    # Norms below 1 still divide (cos 1 and -1); a zero vector has no direction: 0, not nan.
    np.testing.assert_allclose(
        metrics.coherence([[0.1, 0.0], [0.0, 0.3], [0.0, 0.0]],
                          [[0.2, 0.0], [0.0, -0.1], [1.0, 1.0]]),
        [1.0, -1.0, 0.0])


def test_mean_ci_takes_t_from_the_table_up_to_30_degrees_of_freedom_then_1_96():
    # Two values 1, 3: sd sqrt 2, df 1, t 12.706: half = 12.706 * sqrt 2 / sqrt 2.
    assert metrics.mean_ci([1.0, 3.0]) == (2.0, pytest.approx(12.706))
    for n, t in ((31, 2.042), (32, 1.96)):
        values = [float(v) for v in range(n)]
        sd = float(np.std(values, ddof=1))
        assert metrics.mean_ci(values)[1] == pytest.approx(t * sd / math.sqrt(n))


def test_proportion_ci_is_the_wilson_interval():
    # 5 of 10: the Wilson centre is 0.5 itself; half = z sqrt(p q / n + z^2 / 4n^2) / (1 + z^2/n)
    z = 1.96
    p, half = metrics.proportion_ci(5, 10)
    assert p == 0.5
    assert half == pytest.approx(z * math.sqrt(0.025 + z * z / 400) / (1 + z * z / 10))
    assert all(math.isnan(v) for v in metrics.proportion_ci(0, 0))


def test_paired_bootstrap_p_value_is_two_sided_with_ties_counted_against_the_claim():
    # All differences 0: every replicate is 0, both tails hold all of them: p = 1.
    assert metrics.paired_bootstrap([0.0] * 20, n_boot=100)["p"] == 1.0
    # Differences 3 and -1: a replicate mean is 3 (1/4), 1 (1/2) or -1 (1/4), so the lower
    # tail holds 1/4 and p = 2 * 1/4 (+ 1/20001); the interval runs from -1 to 3.
    result = metrics.paired_bootstrap([3.0, -1.0], n_boot=20000)
    assert result["diff"] == 1.0 and result["ci"] == [-1.0, 3.0]
    assert result["p"] == pytest.approx(0.5, abs=0.02)
    flipped = metrics.paired_bootstrap([-3.0, 1.0], n_boot=20000)
    assert flipped["p"] == pytest.approx(0.5, abs=0.02)


def test_paired_bootstrap_interval_is_the_2_5_and_97_5_percentiles():
    # For many prefixes the bootstrap mean is close to normal: the percentile interval is
    # mean +- 1.96 sd / sqrt(n) (population sd, as the bootstrap resamples the sample itself).
    d = np.random.default_rng(7).normal(0.2, 1.0, 400)
    result = metrics.paired_bootstrap(d, n_boot=40000)
    se = float(np.std(d)) / math.sqrt(len(d))
    assert result["ci"][0] == pytest.approx(d.mean() - 1.96 * se, abs=0.05 * se)
    assert result["ci"][1] == pytest.approx(d.mean() + 1.96 * se, abs=0.05 * se)


def test_paired_bootstrap_resamples_every_prefix():
    # One prefix carries the whole difference: replicates without it are 0, with it 1 or more.
    result = metrics.paired_bootstrap([50.0] + [0.0] * 49, n_boot=4000)
    assert result["diff"] == 1.0 and result["ci"][0] == 0.0 and result["ci"][1] >= 3.0

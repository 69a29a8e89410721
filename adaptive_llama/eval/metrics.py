"""Text metrics of the paper's open-ended generation evaluation (Zhu et al., ICML 2024, 5.1).

Pure functions over strings and arrays (the embedder and the model live elsewhere):

- ``rep_n(text, n) = 100 * (1 - |unique n-grams| / |n-grams|)`` over whitespace tokens;
- ``diversity(text) = prod_{n=2..4} (1 - rep_n / 100)``;
- ``coherence(prefix_vectors, continuation_vectors)`` = cosine similarity, row by row, of
  sentence embeddings of prefix and continuation (the paper uses SimCSE; the caller says
  which embedder stood in);
- ``mauve_score(p, q)``: MAUVE (Pillutla et al., 2021) between two feature sets computed by
  the caller, quantised by the ``mauve-text`` package;
- ``mean_sd(values)``: mean and standard deviation (the spread of k, kept mass, Conf);
- ``mean_ci(values)``: mean and the half-width of its 95% t-interval; ``proportion_ci``
  the same for a proportion (Wilson);
- ``mauve_seeds``: MAUVE's mean and sd over k-means seeds;
- ``paired_bootstrap`` (per-prefix differences): a difference, its 95% interval and p-value;
- ``paired_mauve`` (MAUVE of two methods on the same prefixes): the difference, a
  sequential permutation p-value and a half-sampling interval (see there why not the
  bootstrap);
- ``holm`` adjusts a family of p-values.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys

import numpy as np

# Two-sided 95% Student-t quantiles for small samples (df 1..30); beyond, the normal's 1.96.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def rep_n(text: str, n: int) -> float:
    """Percentage of repeated n-grams: 100 * (1 - unique / total); 0 when there are none."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 100.0 * (1.0 - len(set(grams)) / len(grams))


def diversity(text: str) -> float:
    """prod over n = 2, 3, 4 of (1 - rep_n / 100): 1 for text that never repeats itself."""
    return math.prod(1.0 - rep_n(text, n) / 100.0 for n in (2, 3, 4))


def coherence(prefix_vectors, continuation_vectors) -> np.ndarray:
    """Cosine similarity of each prefix embedding with its continuation's."""
    a = np.asarray(prefix_vectors, dtype=np.float64)
    b = np.asarray(continuation_vectors, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.einsum("ij,ij->i", a, b) / np.where(norms > 0, norms, 1.0)


# mauve-text's defaults: the mixture weights of the divergence curve and its scaling c
MIXTURE_WEIGHTS = np.linspace(1e-6, 1 - 1e-6, 25)
MAUVE_SCALING = 5


def mauve_score(p_features, q_features, seed: int = 25) -> float:
    """MAUVE between generated (p) and human (q) features, as ``mauve-text`` computes it.

    The number of clusters follows mauve-text's default (n / 10), at least 2, so that the
    small default runs still quantise. The features are quantised by mauve-text's own
    ``cluster_feats`` (PCA to 90% of the variance, then k-means) into histograms P and Q;
    then, with R_w = w P + (1 - w) Q for each mixture weight w, the divergence curve
    (exp(-c KL(Q || R_w)), exp(-c KL(P || R_w))) between (1, 0) and (0, 1), and

        MAUVE = (area under y(x) + area under x(y)) / 2.

    That part is written here as mauve-text writes it, with the same float operations, so
    the score is the same float (tests/test_metrics.py holds it to ``compute_mauve``). Its
    ``compute_mauve`` also computes MAUVE* and two frontier integrals that nothing here
    reads and checks each area's input through scikit-learn: more than half its time on
    an evaluation's paired tests, which compute MAUVE thousands of times.
    """
    from mauve.compute_mauve import cluster_feats

    p = np.asarray(p_features, dtype=np.float32)
    q = np.asarray(q_features, dtype=np.float32)
    clusters = max(2, min(len(p), len(q)) // 10)
    with _c_stderr_silenced():
        p_hist, q_hist, _, _ = cluster_feats(p, q, num_clusters=clusters, norm="l2",
                                             whiten=False, seed=seed)
    curve = [[0, np.inf]]
    for w in MIXTURE_WEIGHTS:
        mixture = w * p_hist + (1 - w) * q_hist
        curve.append([_kl(q_hist, mixture), _kl(p_hist, mixture)])
    curve.append([np.inf, 0])
    x, y = np.exp(-MAUVE_SCALING * np.asarray(curve)).T
    by_x, by_y = np.argsort(x), np.argsort(y)
    return float(0.5 * (float(np.trapezoid(y[by_x], x[by_x]))
                        + float(np.trapezoid(x[by_y], y[by_y]))))


def _kl(p, q) -> float:
    """KL(p || q) of two histograms, infinite where q misses mass of p (mauve-text's)."""
    if np.logical_and(p != 0, q == 0).any():
        return np.inf
    both = np.logical_and(p != 0, q != 0)
    return np.sum(p[both] * np.log(p[both] / q[both]))


@contextlib.contextmanager
def _c_stderr_silenced():
    """Send file descriptor 2 to /dev/null for the block.

    faiss writes "WARNING clustering N points to K centroids" from C++ for every k-means with
    fewer than 39 points per centroid, which MAUVE's n/10 buckets always are (10 per
    centroid): thousands of identical lines in an evaluation's log that hide its progress,
    and mauve-text gives no way to pass faiss's ``min_points_per_centroid``.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# Besag and Clifford suggest stopping a sequential permutation test after 10 to 20 draws as
# extreme as the observed one; at 20 a stopped p's standard error is about a fifth of it
# (1 / sqrt(20)).
STOP_AFTER = 20


def mauve_seeds(p_features, q_features, seeds: int = 5) -> tuple[float, float]:
    """(mean, standard deviation) of MAUVE over ``seeds`` k-means seeds (the quantisation is
    the noisy part of MAUVE with a few hundred texts)."""
    values = [mauve_score(p_features, q_features, seed=25 + i) for i in range(seeds)]
    return statistics.fmean(values), statistics.pstdev(values)


def paired_bootstrap(diffs, n_boot: int = 2000, seed: int = 0) -> dict:
    """Mean of paired differences (one per prefix), its 95% percentile-bootstrap interval
    over prefixes, and the two-sided bootstrap p-value of "the mean is 0"."""
    d = np.asarray(diffs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(n_boot, len(d)))].mean(axis=1)
    # Two-sided: twice the smaller tail, each tail counting replicates at 0 (ties go against
    # the claim), plus one replicate's weight so that p is never 0.
    below, above = (means <= 0).mean(), (means >= 0).mean()
    p = min(1.0, 2 * min(below, above) + 1 / (n_boot + 1))
    low, high = np.percentile(means, [2.5, 97.5])
    return {"diff": float(d.mean()), "ci": [float(low), float(high)], "p": float(p)}


def paired_mauve(a_features, b_features, q_features, resamples: int = 40,
                 seed: int = 0, permutations: int | None = None,
                 stop_after: int = STOP_AFTER) -> dict:
    """MAUVE(a) - MAUVE(b) against the same human texts (row i of a, b and q belong to
    prefix i), with a p-value and a 95% interval.

    - p-value: a paired permutation test, sequential (Besag and Clifford, "Sequential Monte
      Carlo p-values", Biometrika 1991). Under "the two methods' texts are exchangeable",
      swapping a_i and b_i for a random half of the prefixes gives a difference as likely
      as the one observed. Permutations are drawn until ``stop_after`` of them are at least
      as extreme as the observed difference, or until ``permutations`` (default
      ``resamples``) are drawn:

          stopped after l draws with h = stop_after as extreme:   p = h / l
          all n drawn, g of them as extreme:                      p = (1 + g) / (n + 1)

      Both are valid p-values (P(p <= alpha) <= alpha). A clear difference still draws all
      n, so the floor 1 / (n + 1) and what Holm can reach are those of the full test; a
      difference well inside the permutation distribution stops after about h / p draws
      instead of n (each draw is two MAUVE computations). The floor means a family of m
      comparisons adjusted by Holm needs more than m / 0.05 permutations before any of them
      can be significant. ``drawn`` in the result says how many were drawn.
    - interval: half-sampling. MAUVE quantises the features by k-means, so a bootstrap
      sample's duplicated texts make tight clusters that shift the score: a percentile
      bootstrap need not even contain its own estimate (seen: +0.139 outside
      [-0.879, +0.004]). A random half of the prefixes, drawn without replacement, has
      no duplicates, and its difference varies about as much as the full estimate does
      (variance s^2 (1/m - 1/n) = s^2 / n at m = n/2), so the interval is the estimate plus
      or minus 1.96 times the sd of those differences. Simulated (benchmarks/
      mauve_coverage.py, 50 runs of 200 prefixes), it covered the true difference in 88%
      and 92% of runs: about a 90% interval.
    """
    a, b, q = (np.asarray(x, dtype=np.float32) for x in (a_features, b_features, q_features))
    rng = np.random.default_rng(seed)
    n = len(a)

    def difference(x, y, rows=slice(None)):
        return mauve_score(x[rows], q[rows]) - mauve_score(y[rows], q[rows])

    estimate = difference(a, b)
    permutations = resamples if permutations is None else permutations
    extreme = drawn = 0
    while drawn < permutations and extreme < stop_after:
        swap = rng.random(n) < 0.5
        permuted = difference(np.where(swap[:, None], b, a), np.where(swap[:, None], a, b))
        extreme += abs(permuted) >= abs(estimate) - 1e-12
        drawn += 1
    p = extreme / drawn if extreme == stop_after else (1 + extreme) / (permutations + 1)
    halves = [difference(a, b, np.sort(rng.choice(n, n // 2, replace=False)))
              for _ in range(resamples)]
    half_width = 1.96 * float(np.std(halves, ddof=1))
    return {"diff": estimate, "ci": [estimate - half_width, estimate + half_width],
            "p": float(p), "drawn": drawn}


# A permutation p-value is at least 1 / (permutations + 1), and Holm multiplies the smallest
# of m by m: 50 per comparison puts that floor at m / (50 m + 1) < 0.02, so a difference no
# permutation reaches is significant in any family (with 40 in all, none of 7 ever was).
PERMUTATIONS_PER_COMPARISON = 50


def permutations(resamples: int, comparisons: int) -> int:
    """Permutations of a paired MAUVE test in a family of ``comparisons``."""
    return max(resamples, PERMUTATIONS_PER_COMPARISON * comparisons)


def holm(p_values: dict) -> dict:
    """Holm's step-down adjustment of a family of p-values (keyed by comparison)."""
    order = sorted(p_values, key=p_values.get)
    adjusted, running = {}, 0.0
    for rank, key in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p_values[key]))
        adjusted[key] = running
    return adjusted


def mean_sd(values) -> tuple[float, float]:
    """(mean, population standard deviation), NaNs left out; both NaN for no values."""
    values = [float(v) for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.pstdev(values)


def mean_ci(values) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval); the half-width is nan for one value."""
    values = [float(v) for v in values]
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    df = len(values) - 1
    t = _T95[df - 1] if df <= len(_T95) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def proportion_ci(successes: int, n: int) -> tuple[float, float]:
    """(proportion, a half-width around it that covers the 95% Wilson interval).

    Wilson rather than the t-interval, which collapses to zero width at 0 of 10 correct.
    """
    if n == 0:
        return math.nan, math.nan
    z = 1.96
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, half + abs(centre - p)

"""The float64 reference: the formula of the package docstring (:mod:`adaptive_llama.kernel`),
term by term, over the fully sorted vocabulary. Slow and exact; the fast kernels (C, numba,
the graph) are tested against it."""

from __future__ import annotations

import numpy as np

from .checks import validate_epsilon, validated_logits


def dconf_reference(logits) -> np.ndarray:
    """dConf_1..dConf_V in float64, straight from the package docstring's formula.

    Slow (full sort) and exact; the fast kernels are tested against it.
    """
    x = np.sort(np.asarray(logits, dtype=np.float64))[::-1]
    e = np.exp(x - x[0])
    return dconf_of_head(e / e.sum(), 0.0, x.shape[0])


def dconf_of_head(p, tail: float, V: int) -> np.ndarray:
    """dConf_1..dConf_K in float64 from the K largest probabilities ``p`` (descending) and
    ``tail``, the mass of the V - K tokens after them: the formula needs nothing else, since
    R_k = tail + p_{k+1} + ... + p_K. With K = V and tail 0 it is :func:`dconf_reference`;
    the graph's self-check gives it the probabilities and tail mass the graph used."""
    p = np.asarray(p, dtype=np.float64)
    K = p.shape[0]
    # R_k = sum_{j>k} p_j, summed directly (small values first), never 1 - c_k
    R = tail + np.append(np.cumsum(p[::-1])[::-1][1:], 0.0)
    R_prev = np.concatenate(([tail + p.sum()], R[:-1]))
    k = np.arange(1, K + 1, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        formula = (
            p * np.log(p * (V - k) / R)
            + R_prev * np.log((R / (V - k)) / (R_prev / (V - k + 1)))
        ) / np.log(V)
        limit = p * np.log(V - k + 1) / np.log(V)  # R_k = 0: every later token masked, or k = V
    dconf = np.where(R > 0, formula, limit)
    return np.where(p > 0, dconf, -np.inf)  # a token with p = 0 never counts


def k_from_dconf(dconf, epsilon: float) -> int:
    """k* = max(1, last k with dConf_k > epsilon)."""
    above = np.flatnonzero(np.asarray(dconf) > epsilon)
    return int(above[-1]) + 1 if above.size else 1


def adaptive_k_reference(logits, epsilon: float) -> int:
    """k* = max(1, last k with dConf_k > epsilon), from :func:`dconf_reference`."""
    epsilon = validate_epsilon(epsilon)
    x = validated_logits(logits)
    if x.shape[0] == 1:
        return 1
    return k_from_dconf(dconf_reference(x), epsilon)


def p_less_reference(logits) -> np.ndarray:
    """The tokens p-less sampling keeps (Tan, Wu and Howard, ICLR 2026; native/adaptive.c
    says more), in float64: p_v >= L = sum_u p_u^2, the probability that two draws agree."""
    x = np.asarray(logits, dtype=np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    return np.flatnonzero(p >= np.sum(p * p))


def top_h_reference(logits, alpha: float, top_n: int) -> np.ndarray:
    """The tokens top-H keeps (Potraghloo et al., 2025; native/adaptive.c says more), in
    float64: of the N = min(top_n, V) likeliest (ties: the earlier token first), the longest
    prefix, at least one token, with E_k = -sum_{i<=k} p_i ln p_i <= alpha E_N."""
    x = np.asarray(logits, dtype=np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")[:min(top_n, p.shape[0])]
    head = p[order]
    with np.errstate(divide="ignore", invalid="ignore"):
        E = np.cumsum(np.where(head > 0, -head * np.log(head), 0.0))
    k = max(1, int(np.count_nonzero(E <= alpha * E[-1])))
    return np.sort(order[:k])

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
    V = x.shape[0]
    e = np.exp(x - x[0])
    p = e / e.sum()
    R = np.append(np.cumsum(p[::-1])[::-1][1:], 0.0)  # R_k = sum_{j>k} p_j, summed directly
    R_prev = np.concatenate(([1.0], R[:-1]))
    k = np.arange(1, V + 1, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        formula = (
            p * np.log(p * (V - k) / R)
            + R_prev * np.log((R / (V - k)) / (R_prev / (V - k + 1)))
        ) / np.log(V)
        limit = p * np.log(V - k + 1) / np.log(V)  # R_k = 0: every later token masked, or k = V
    dconf = np.where(R > 0, formula, limit)
    return np.where(p > 0, dconf, -np.inf)  # a token with p = 0 never counts


def adaptive_k_reference(logits, epsilon: float) -> int:
    """k* = max(1, last k with dConf_k > epsilon), from :func:`dconf_reference`."""
    epsilon = validate_epsilon(epsilon)
    x = validated_logits(logits)
    if x.shape[0] == 1:
        return 1
    above = np.flatnonzero(dconf_reference(x) > epsilon)
    return int(above[-1]) + 1 if above.size else 1

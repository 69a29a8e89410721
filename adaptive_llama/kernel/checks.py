"""Checks of the kernel's inputs, shared by the reference and the fast implementations."""

from __future__ import annotations

import numpy as np

from ..samplers import EPSILON


def validate_epsilon(epsilon: float) -> float:
    """epsilon as a float, or ValueError (SpecError): a finite number in (0, 1).

    The same check as a spec's ``eps=`` (:data:`adaptive_llama.samplers.EPSILON`).
    """
    return EPSILON.validate(epsilon, name="epsilon")


def as_logits(logits) -> np.ndarray:
    """A contiguous 1-D float32/float64 array, or ValueError; the values are not read."""
    x = np.asarray(logits)
    if x.ndim != 1:
        raise ValueError(f"`logits` has to be a 1-D array, but has shape {x.shape}")
    if x.shape[0] == 0:
        raise ValueError("`logits` is empty: it needs one entry per vocabulary token")
    if x.dtype not in (np.float32, np.float64):
        if not np.issubdtype(x.dtype, np.number):
            raise ValueError(f"`logits` has to be float32 or float64, but is {x.dtype}")
        x = x.astype(np.float64)
    return np.ascontiguousarray(x)


def check_values(x: np.ndarray):
    """The max of x, or ValueError naming the first NaN or +inf, or an all -inf row (one pass
    when fine)."""
    top = x.max()  # NaN propagates; +inf and an all -inf row show here too
    if np.isnan(top):
        raise ValueError(f"`logits` contains NaN at index {int(np.flatnonzero(np.isnan(x))[0])}")
    if top == np.inf:
        raise ValueError(f"`logits` contains +inf at index {int(np.flatnonzero(np.isposinf(x))[0])}")
    if top == -np.inf:
        raise ValueError("every logit is -inf: at least one token has to be possible")
    return top


def validated_logits(logits) -> np.ndarray:
    x = as_logits(logits)
    check_values(x)
    return x

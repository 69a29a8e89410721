r"""The adaptive-decoding kernel: how many candidates to keep at one step.

Adaptive decoding (Zhu et al., "Improving Open-Ended Text Generation via Adaptive Decoding",
ICML 2024, https://arxiv.org/abs/2402.18223, section 4 and Algorithm 1). Sort the next-token
probabilities :math:`p_1 \ge p_2 \ge \dots \ge p_V`, let :math:`c_k = p_1 + \dots + p_k` and
:math:`R_k = 1 - c_k` (the mass not yet placed). With natural logarithms::

    dConf_k = [ p_k ln(p_k (V-k) / R_k)  +  R_{k-1} ln( (R_k/(V-k)) / (R_{k-1}/(V-k+1)) ) ] / ln V

    k* = max(1, the last k with dConf_k > epsilon)

dConf_k is the rise in confidence, Conf = 1 - H / ln V, of the estimated distribution that
knows p_1..p_k and spreads R_k uniformly over the other V - k tokens, when token k becomes
known. The kept set is the prefix p_1..p_{k*}, as in Algorithm 1, even when some dConf before
k* dips below epsilon (the authors' scripts use a mask instead).

Edge semantics:

- V is the length of the logits, masked (``-inf``) tokens included.
- A token with p = 0 never counts (its dConf is not above epsilon).
- Where the tail mass R_k is exactly 0 (every later token masked, and at k = V), dConf_k takes
  its continuous limit ``p_k ln(V-k+1) / ln V``.
- V = 1 gives k* = 1. At a tie on the boundary any prefix of the sorted order is fine: tied
  tokens have equal p, so every order gives the same dConf sequence.

Normalisation: the paper's Conf is base-free (entropy over log V with one base), so natural
logarithms throughout. The authors' first script, ``adaptive.py``, divides natural-log terms
by log2 V: its dConf is the paper's times ln 2, so its epsilon 0.001 is the paper's (and
this module's) 0.00144. Their later transformers warper uses ln V, as here.

Why the fast kernels are O(V) and exact: dConf_k ln V is the drop in estimated entropy when
token k becomes known, R_{k-1} KL(q || uniform over V-k+1 tokens) with q = (p_k/R_{k-1}, rest
uniform). Since p_k is at least the mean of the remaining tokens this is at most
p_k ln(p_k/u) with u = R_{k-1}/(V-k+1) >= p_k/(V-k+1), hence::

    dConf_k <= p_k ln(V-k+1) / ln V <= p_k

so no token with p <= epsilon can be the last index above epsilon. The part of the KL sum
over the V-k other tokens is not positive (q gives each of them at most 1/(V-k+1), because
p_k >= u), which gives the
sharper bound dConf_k ln V <= p_k ln(p_k (V-k+1) / R_{k-1}); the C kernel evaluates it once
for a block of candidates (largest p, smallest R in the block) and passes over blocks that it
keeps below epsilon ln V without computing their dConf. The kernels compute the
max logit, the softmax normaliser, collect the fewer than 1/epsilon tokens with p > epsilon,
sort only those and scan them; the tail masses R_k are float64 sums of the tail itself, never
``1 - c_k`` (which cancels catastrophically once c_k is near 1).

Backends: the C library built from ``native/adaptive.c`` when it is present, else a numba JIT
kernel; chosen once at import, logged at debug level, and a missing C library is reported once
as a warning. ``ADAPTIVE_LLAMA_BACKEND=numba`` (or ``c``) forces one.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import numpy as np

from . import native
from .samplers import EPSILON

log = logging.getLogger(__name__)

__all__ = [
    "AdaptiveStats",
    "BACKEND",
    "adaptive_k",
    "adaptive_k_reference",
    "adaptive_stats",
    "dconf_reference",
    "validate_epsilon",
]


@dataclass(frozen=True)
class AdaptiveStats:
    """The per-step figures of the paper's ablation (section 6, threshold study).

    ``k``: candidate-set size k*; ``kept_mass``: c_{k*}, the probability of the kept set;
    ``conf``: 1 - H / ln V of the whole distribution (NaN for V = 1); ``entropy``: H in nats.
    """

    k: int
    kept_mass: float
    conf: float
    entropy: float


def validate_epsilon(epsilon: float) -> float:
    """epsilon as a float, or ValueError (SpecError): a finite number in (0, 1).

    The same check as a spec's ``eps=`` (:data:`adaptive_llama.samplers.EPSILON`).
    """
    return EPSILON.validate(epsilon, name="epsilon")


def _as_logits(logits) -> np.ndarray:
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


def _check_values(x: np.ndarray):
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


def _validated_logits(logits) -> np.ndarray:
    x = _as_logits(logits)
    _check_values(x)
    return x


def _run_kernel(logits, epsilon: float, want_stats: bool, backend: str | None):
    """(k*, kept mass, entropy) from the backend; each backend converts what it cannot read
    as it is. The C kernel checks the values itself (it notices bad logits in its normaliser),
    so only a failure costs the extra pass that names the problem."""
    run = _kernel if backend is None else _kernel_for(backend)
    try:
        return run(logits, epsilon, want_stats)
    except native.InvalidLogits:
        _check_values(_as_logits(logits))
        raise


def _valid_epsilon(epsilon) -> float:
    # The usual call passes a float inside (0, 1): one test instead of a call (NaN fails it).
    return epsilon if type(epsilon) is float and 0.0 < epsilon < 1.0 else validate_epsilon(epsilon)


# ---- float64 reference: the documented formula over the fully sorted vocabulary ----


def dconf_reference(logits) -> np.ndarray:
    """dConf_1..dConf_V in float64, straight from the module docstring's formula.

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
    x = _validated_logits(logits)
    if x.shape[0] == 1:
        return 1
    above = np.flatnonzero(dconf_reference(x) > epsilon)
    return int(above[-1]) + 1 if above.size else 1


# ---- backend selection: once, at import ----


def _make_c_kernel():
    lib, why = native.load()
    if lib is None:
        raise ValueError(f"the C backend is not available: {why}")

    def c_kernel(logits, eps, want_stats):
        try:  # reads a 1-D contiguous float32/float64 array where it lies, without a copy
            return native.adaptive_native(logits, eps, want_stats)
        except TypeError:  # anything else is converted (or refused with its reason) first
            return native.adaptive_native(_as_logits(logits), eps, want_stats)

    return c_kernel


def _make_numba_kernel():
    from .kernel_numba import adaptive_numba  # numba's import costs a second: only when used

    def numba_kernel(logits, eps, want_stats):
        x = _as_logits(logits)
        # its fast-math loops cannot be trusted to notice NaN or inf; the check finds the max
        top = _check_values(x)
        if x.shape[0] == 1:
            return 1, 1.0, 0.0
        return adaptive_numba(x, top, eps, want_stats)

    return numba_kernel


_KERNEL_FACTORIES = {"c": _make_c_kernel, "numba": _make_numba_kernel}


@functools.cache
def _kernel_for(backend: str):
    """The kernel of one backend (built once), or ValueError naming what is wrong."""
    try:
        make = _KERNEL_FACTORIES[backend]
    except KeyError:
        raise ValueError(f"`backend` has to be 'c' or 'numba', but is {backend!r}") from None
    return make()


def _choose_backend() -> str:
    """The backend that runs: C when its library loads, else numba; logged once (a missing C
    library is a warning: numba is slower), and ADAPTIVE_LLAMA_BACKEND=c|numba forces one."""
    forced = os.environ.get("ADAPTIVE_LLAMA_BACKEND", "").strip().lower()
    if forced not in ("", "c", "numba"):
        raise ImportError(
            f"ADAPTIVE_LLAMA_BACKEND has to be 'c' or 'numba', but is {forced!r}"
        )
    lib, why = native.load()
    if forced == "c" and lib is None:
        raise ImportError(f"ADAPTIVE_LLAMA_BACKEND=c, but {why}")
    if forced:
        log.info("adaptive backend: %s (forced by ADAPTIVE_LLAMA_BACKEND)", forced)
        return forced
    if lib is not None:
        log.info("adaptive backend: c (native/adaptive.c)")
        return "c"
    log.warning("adaptive backend: numba, because %s; reinstall with a C compiler "
                "for the faster C kernel", why)
    return "numba"


BACKEND = _choose_backend()
_kernel = _kernel_for(BACKEND)


def adaptive_k(logits, epsilon: float, backend: str | None = None) -> int:
    """The candidate-set size k* of adaptive decoding (formula in the module docstring).

    Args:
        logits: 1-D float32 or float64 array over the whole vocabulary; ``-inf`` marks a
            masked token. Not modified.
        epsilon: the threshold on the confidence gain, in (0, 1). The paper recommends
            0.0005 for open-ended text (about 1e-4 to 1e-3); larger keeps fewer tokens.
        backend: ``"c"`` or ``"numba"`` to run that kernel; None (default) runs
            :data:`BACKEND`.

    Returns:
        k* in [1, number of finite logits].

    Raises:
        ValueError: NaN or +inf in ``logits``, an empty or non-1-D array, every logit
            ``-inf``, ``epsilon`` not a finite number in (0, 1), or an unknown or
            unavailable ``backend``.

    Cost: O(V) (three passes over the logits) plus a sort of the < 1/epsilon tokens with
    p > epsilon; runs on :data:`BACKEND`.
    """
    return int(_run_kernel(logits, _valid_epsilon(epsilon), False, backend)[0])


def adaptive_stats(logits, epsilon: float, backend: str | None = None) -> AdaptiveStats:
    """k*, kept probability mass, Conf and entropy of one step (see :class:`AdaptiveStats`).

    Same arguments, validation and cost as :func:`adaptive_k`, plus one multiply-add per token
    for the entropy.
    """
    k, kept, entropy = _run_kernel(logits, _valid_epsilon(epsilon), True, backend)
    V = len(logits)  # the kernel ran, so logits is one row of V numbers
    return AdaptiveStats(
        k=int(k), kept_mass=float(kept), entropy=float(entropy),
        conf=math.nan if V == 1 else 1.0 - entropy / math.log(V),
    )

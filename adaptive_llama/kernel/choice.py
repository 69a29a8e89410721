"""Which implementation of the kernel runs, chosen once, and the array API.

Two implementations compute the same k*: the C library built from ``native/adaptive.c`` when
it is present, else a numba JIT kernel. One is chosen at import and logged (a missing C
library is a warning: numba is slower); ``ADAPTIVE_LLAMA_IMPL=c`` or ``numba`` forces one.
The same choice runs the adaptive and eta samplers in llama.cpp's chain
(:mod:`adaptive_llama.llama.chain`). Where sampling runs, the CPU chain or llama.cpp's graph,
is a separate setting (``backend_sampling``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import warnings
from dataclasses import dataclass

from . import native
from .checks import as_logits, check_values, validate_epsilon

log = logging.getLogger(__name__)

IMPL_VARIABLE = "ADAPTIVE_LLAMA_IMPL"
OLD_IMPL_VARIABLE = "ADAPTIVE_LLAMA_BACKEND"  # the old name, still read


@dataclass(frozen=True)
class AdaptiveStats:
    """The figures of one adaptive decision (the paper's ablation, section 6), the one type
    for them wherever they come from: :func:`adaptive_stats`, and the C, numba and graph
    samplers of a chain (``SamplerChain.last_stats``).

    ``k``: candidate-set size k*; ``kept_mass``: c_{k*}, the probability of the kept set;
    ``conf``: 1 - H / ln V of the whole distribution (NaN for V = 1, and where a chain did
    not compute it); ``entropy``: H in nats (likewise); ``token`` and ``p_chosen``: the
    token a chain's sampler chose and its probability in the kept set (-1 and NaN from
    :func:`adaptive_stats`, which chooses none).
    """

    k: int
    kept_mass: float
    conf: float
    entropy: float
    token: int = -1
    p_chosen: float = math.nan


def _run_kernel(logits, epsilon: float, want_stats: bool, impl: str | None):
    """(k*, kept mass, entropy) from the implementation; each converts what it cannot read
    as it is. The C kernel checks the values itself (it notices bad logits in its normaliser),
    so only a failure costs the extra pass that names the problem."""
    run = _kernel if impl is None else _kernel_for(impl)
    try:
        return run(logits, epsilon, want_stats)
    except native.InvalidLogits:
        check_values(as_logits(logits))
        raise


def _valid_epsilon(epsilon) -> float:
    # The usual call passes a float inside (0, 1): one test instead of a call (NaN fails it).
    return epsilon if type(epsilon) is float and 0.0 < epsilon < 1.0 else validate_epsilon(epsilon)


# ---- the implementations, and the choice: once, at import ----


def _make_c_kernel():
    lib, why = native.load()
    if lib is None:
        raise ValueError(f"the C implementation is not available: {why}")

    def c_kernel(logits, eps, want_stats):
        try:  # reads a 1-D contiguous float32/float64 array where it lies, without a copy
            return native.adaptive_native(logits, eps, want_stats)
        except TypeError:  # anything else is converted (or refused with its reason) first
            return native.adaptive_native(as_logits(logits), eps, want_stats)

    return c_kernel


def _make_numba_kernel():
    from .numba_impl import (
        adaptive_numba,  # numba's import costs a second: only when used
    )

    def numba_kernel(logits, eps, want_stats):
        x = as_logits(logits)
        # its fast-math loops cannot be trusted to notice NaN or inf; the check finds the max
        top = check_values(x)
        if x.shape[0] == 1:
            return 1, 1.0, 0.0
        return adaptive_numba(x, top, eps, want_stats)

    return numba_kernel


_KERNEL_FACTORIES = {"c": _make_c_kernel, "numba": _make_numba_kernel}


@functools.cache
def _kernel_for(impl: str):
    """The kernel of one implementation (built once), or ValueError naming what is wrong."""
    try:
        make = _KERNEL_FACTORIES[impl]
    except KeyError:
        raise ValueError(f"`impl` has to be 'c' or 'numba', but is {impl!r}") from None
    return make()


def _forced_impl() -> tuple[str, str]:
    """(the implementation the environment asks for: "c", "numba" or "" for none, the
    variable that asked); ImportError for another value. The old variable still works, with
    a deprecation warning."""
    variable = IMPL_VARIABLE
    if IMPL_VARIABLE not in os.environ and OLD_IMPL_VARIABLE in os.environ:
        variable = OLD_IMPL_VARIABLE
        warnings.warn(f"{OLD_IMPL_VARIABLE} is now called {IMPL_VARIABLE}; the old name "
                      "will stop working in a later release", FutureWarning, stacklevel=2)
    forced = os.environ.get(variable, "").strip().lower()
    if forced not in ("", "c", "numba"):
        raise ImportError(f"{variable} has to be 'c' or 'numba', but is {forced!r}")
    return forced, variable


def _choose_impl() -> str:
    """C when its library loads, else numba (a warning); the environment can force one."""
    forced, variable = _forced_impl()
    lib, why = native.load()
    if forced == "c" and lib is None:
        raise ImportError(f"{variable}=c, but {why}")
    if forced:
        log.info("kernel implementation: %s (forced by %s)", forced, variable)
        return forced
    if lib is not None:
        log.info("kernel implementation: c (native/adaptive.c)")
        return "c"
    log.warning("kernel implementation: numba, because %s; reinstall with a C compiler "
                "for the faster C kernel", why)
    return "numba"


IMPL = _choose_impl()
BACKEND = IMPL  # the old name, kept for code that reads it
_kernel = _kernel_for(IMPL)


def adaptive_k(logits, epsilon: float, impl: str | None = None) -> int:
    """The candidate-set size k* of adaptive decoding (formula in :mod:`adaptive_llama.kernel`).

    Args:
        logits: 1-D float32 or float64 array over the whole vocabulary; ``-inf`` marks a
            masked token. Not modified.
        epsilon: the threshold on the confidence gain, in (0, 1). The paper recommends
            0.0005 for open-ended text (about 1e-4 to 1e-3); larger keeps fewer tokens.
        impl: ``"c"`` or ``"numba"`` to run that implementation; None (default) runs
            :data:`IMPL`.

    Returns:
        k* in [1, number of finite logits].

    Raises:
        ValueError: NaN or +inf in ``logits``, an empty or non-1-D array, every logit
            ``-inf``, ``epsilon`` not a finite number in (0, 1), or an unknown or
            unavailable ``impl``.

    Cost: O(V) (three passes over the logits) plus a sort of the < 1/epsilon tokens with
    p > epsilon; runs on :data:`IMPL`.
    """
    return int(_run_kernel(logits, _valid_epsilon(epsilon), False, impl)[0])


def adaptive_stats(logits, epsilon: float, impl: str | None = None) -> AdaptiveStats:
    """k*, kept probability mass, Conf and entropy of one step (see :class:`AdaptiveStats`).

    Same arguments, validation and cost as :func:`adaptive_k`, plus one multiply-add per token
    for the entropy.
    """
    k, kept, entropy = _run_kernel(logits, _valid_epsilon(epsilon), True, impl)
    V = len(logits)  # the kernel ran, so logits is one row of V numbers
    return AdaptiveStats(
        k=int(k), kept_mass=float(kept), entropy=float(entropy),
        conf=math.nan if V == 1 else 1.0 - entropy / math.log(V),
    )

"""The numba backend of the adaptive-decoding kernel: the same passes as ``native/adaptive.c``.

The formula and its edge cases are documented in :mod:`adaptive_llama.kernel`. numba's LLVM
has no vector math library here (llvmlite ships without SVML), so ``math.exp`` over float32
would run one scalar call per token; :func:`_exp_weight` is the C kernel's branch-free
Cody-Waite/Cephes ``expf`` (within 1 ulp, exactly 0 below -87.3), which LLVM vectorises. The
tokens that decide k* get exact float64 weights anyway, so its error only reaches the sum of
the tail, where it is harmless.

:func:`decide` is shared by the array API (:func:`adaptive_numba`) and the in-chain sampler
(:mod:`adaptive_llama.llama.numba_samplers`); it works in buffers the caller owns, so a token costs no
allocation of vocabulary size.
"""

from __future__ import annotations

import math
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
# Below exp(-87.3) float32 turns subnormal and the 2^n trick fails: such a weight is 0,
# as for a masked (-inf) token.
_EXP_ARG_MIN = np.float32(-87.3)
_CANDIDATE_SLACK = 0.99  # collect p > 0.99 eps: the float32 weights only estimate S


@intrinsic
def _float_from_bits(typingctx, bits):
    """Reinterpret an int32 as float32 (a bitcast LLVM can vectorise)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always", fastmath=True, error_model="numpy")
def _exp_weight(d):
    """exp(d) for float32 d <= 0: d = n ln2 + r, exp(r) by a degree-7 polynomial; 0 below
    -87.3 (see native/adaptive.c exp_weight)."""
    c = d if d > _EXP_ARG_MIN else _EXP_ARG_MIN
    n = np.floor(c * _LOG2E + np.float32(0.5))
    r = c - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    v = p * _float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    return v if d >= _EXP_ARG_MIN else np.float32(0.0)


@njit(cache=True, fastmath=True, error_model="numpy")
def weights(x, m, w, want_entropy):
    """w_i = exp(x_i - m) in float32 (x float32 or float64); returns (S, sum w_i (x_i - m)).

    Without the entropy S is a float32 sum, as in the C kernel: it only places the candidate
    threshold, which has slack, and the tail is summed again in float64."""
    if want_entropy:
        return _weights_entropy(x, m, w)
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        v = _exp_weight(np.float32(x[i] - m))
        w[i] = v
        s += v
    return np.float64(s), 0.0


@njit(cache=True, fastmath=True, error_model="numpy")
def _weights_entropy(x, m, w):
    s = 0.0
    sd = 0.0
    for i in range(x.shape[0]):
        d = np.float32(x[i] - m)
        v = _exp_weight(d)
        w[i] = v
        s += np.float64(v)
        d = d if d > _EXP_ARG_MIN else _EXP_ARG_MIN  # 0 * -inf would be NaN
        sd += np.float64(v) * np.float64(d)
    return s, sd


@njit(cache=True, fastmath=True, error_model="numpy")
def _collect(w, threshold, cand, flags):
    """Indices with w > threshold into cand, in order; returns (count, sum of the others).

    Two loops LLVM vectorises (flag every token, sum the unflagged ones in float64), then
    the flags read 8 at a time as one word, which is 0 nearly everywhere."""
    n = w.shape[0]
    tail = 0.0
    for i in range(n):
        v = w[i]
        hot = v > threshold
        flags[i] = hot
        tail += 0.0 if hot else np.float64(v)
    nc = 0
    whole = n // 8 * 8
    words = flags[:whole].view(np.uint64)
    for k in range(words.shape[0]):
        if words[k] != 0:
            for j in range(8 * k, 8 * k + 8):
                if flags[j]:
                    cand[nc] = j
                    nc += 1
    for j in range(whole, n):
        if flags[j]:
            cand[nc] = j
            nc += 1
    return nc, tail


@njit(cache=True, error_model="numpy")
def _gain(p, r, r_prev, n_after):
    """dConf_k ln V from p_k, R_k, R_{k-1} and V - k (see native/adaptive.c gains)."""
    if n_after <= 0 or r <= 0.0:
        return p * math.log(n_after + 1.0)  # the limit R_k -> 0
    # p_k ln(p_k (V-k)/R_k) + R_{k-1} ln((R_k/(V-k)) / (R_{k-1}/(V-k+1))), the second log
    # split in two, each ratio by log1p when it is near 1.
    if r < 0.5 * r_prev:
        tail_ratio_log = math.log(r / r_prev)
    else:
        tail_ratio_log = math.log1p(-p / r_prev)
    return p * math.log(p * n_after / r) + r_prev * (tail_ratio_log + math.log1p(1.0 / n_after))


@njit(cache=True, error_model="numpy")
def _scan(exact, tail, nc, V, eps):
    """Algorithm 1 over sorted candidate weights; tail[j] = S R_j. Returns k* (0 if none).

    From the back: the first k found above epsilon is the last one."""
    S = tail[0]
    bar = eps * math.log(V)
    for k in range(nc, 0, -1):
        if _gain(exact[k - 1] / S, tail[k] / S, tail[k - 1] / S, V - k) > bar:
            return k
    return 0


@njit(cache=True, error_model="numpy")
def decide(x, w, m, S, eps, cand, exact, tail, flags):
    """k* and the kept mass from the weights of pass 2, as native/adaptive.c select_*.

    Leaves the candidates' indices in cand[:nc] and their exact float64 weights in exact[:nc],
    sorted by weight (descending, ties in index order); returns (k*, kept mass, nc). With no
    token above epsilon: the arg-max alone, nc = 1. Buffers: cand, exact and flags (uint8)
    hold n entries, tail n + 1.
    """
    n = x.shape[0]
    nc, rest = _collect(w[:n], np.float32(eps * _CANDIDATE_SLACK * S), cand, flags)
    if nc == 0:  # p_max <= eps: k* = 1, the arg-max, whose weight is exp(0) = 1
        best = 0
        for i in range(n):
            if x[i] == m:
                best = i
                break
        cand[0] = best
        exact[0] = 1.0
        return 1, 1.0 / S, 1
    for j in range(nc):
        exact[j] = math.exp(np.float64(x[cand[j]]) - np.float64(m))
    order = np.argsort(-exact[:nc], kind="mergesort")  # stable: ties keep index order
    cand[:nc] = cand[:nc][order]
    exact[:nc] = exact[:nc][order]
    tail[nc] = rest
    for j in range(nc, 0, -1):
        tail[j - 1] = tail[j] + exact[j - 1]
    k = max(_scan(exact, tail, nc, n, eps), 1)
    return k, exact[:k].sum() / tail[0], nc


class _Workspace(threading.local):
    """Per-thread buffers of the array API, grown to the largest vocabulary seen."""

    def __init__(self):
        self.size = -1

    def buffers(self, n: int):
        if n > self.size:
            self.w = np.empty(n, dtype=np.float32)
            self.cand = np.empty(n, dtype=np.int64)
            self.exact = np.empty(n)
            self.tail = np.empty(n + 1)
            self.flags = np.empty(n, dtype=np.uint8)
            self.size = n
        return self.w, self.cand, self.exact, self.tail, self.flags


_workspace = _Workspace()


def adaptive_numba(x: np.ndarray, m: float, eps: float, want_stats: bool):
    """Returns (k*, kept mass, entropy); entropy is NaN unless want_stats. x: 1-D, n >= 2,
    m its max (numpy's max is vectorised, numba's is not)."""
    w, cand, exact, tail, flags = _workspace.buffers(x.shape[0])
    S, wd = weights(x, m, w, want_stats)
    k, kept, _ = decide(x, w, m, S, eps, cand, exact, tail, flags)
    entropy = math.log(S) - wd / S if want_stats else math.nan
    return k, kept, entropy

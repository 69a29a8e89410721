"""The numba backend of the adaptive-decoding kernel: the same passes as ``native/adaptive.c``.

The formula and its edge cases are documented in :mod:`adaptive_llama.kernel`. numba's LLVM
has no vector math library here (llvmlite ships without SVML), so ``math.exp`` over float32
would run one scalar call per token; :func:`_exp_f32` is a branch-free Cody-Waite/Cephes
``expf`` that LLVM vectorises instead (about 1 ulp, like glibc's vector ``expf``). The
tokens that decide k* get exact float64 weights anyway, so its error only reaches the sum
of the tail, where it is harmless.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
# exp(-87.3) is the smallest normal float32; below it the 2^n trick needs subnormals.
# A masked token then weighs 1e-38 instead of 0, which no sum or threshold can notice.
_EXP_ARG_MIN_F32 = np.float32(-87.3)
_EXP_ARG_MIN_F64 = -745.0
_CHUNK = 64
_CANDIDATE_SLACK = 0.99  # collect p > 0.99 eps: the float32 weights only estimate S


@intrinsic
def _float_from_bits(typingctx, bits):
    """Reinterpret an int32 as float32 (a bitcast LLVM can vectorise)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always", fastmath=True)
def _exp_f32(d):
    """exp(d) for float32 d in [-87.3, 0]: d = n ln2 + r, exp(r) by a degree-7 polynomial."""
    n = np.floor(d * _LOG2E + np.float32(0.5))
    r = d - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(cache=True, fastmath=True)
def _weights_f32(x, m, w, want_entropy):
    s = 0.0
    sd = 0.0
    for i in range(x.shape[0]):
        d = max(x[i] - m, _EXP_ARG_MIN_F32)
        v = _exp_f32(d)
        w[i] = v
        s += np.float64(v)
        if want_entropy:
            sd += np.float64(v) * np.float64(d)
    return s, sd


@njit(cache=True, fastmath=True)
def _weights_f64(x, m, w, want_entropy):
    s = 0.0
    sd = 0.0
    for i in range(x.shape[0]):
        d = max(x[i] - m, _EXP_ARG_MIN_F64)
        v = np.float32(math.exp(d))
        w[i] = v
        s += np.float64(v)
        if want_entropy:
            sd += np.float64(v) * d
    return s, sd


@njit(cache=True, fastmath=True)
def _max(x):
    m = x[0]
    for i in range(1, x.shape[0]):
        m = max(m, x[i])
    return m


@njit(cache=True, fastmath=True)
def _collect(w, threshold, cand):
    """Indices with w > threshold into cand; returns (count, sum of the other weights)."""
    n = w.shape[0]
    nc = 0
    tail = 0.0
    for i0 in range(0, n, _CHUNK):
        end = min(i0 + _CHUNK, n)
        cmax = np.float32(0.0)
        csum = 0.0
        for j in range(i0, end):
            cmax = max(cmax, w[j])
            csum += np.float64(w[j])
        if cmax <= threshold:
            tail += csum
            continue
        for j in range(i0, end):
            if w[j] > threshold:
                cand[nc] = j
                nc += 1
            else:
                tail += np.float64(w[j])
    return nc, tail


@njit(cache=True)
def _scan(weights, tail, V, eps):
    """Algorithm 1 over sorted candidate weights; tail[j] = S R_j. Returns k* (0 if none)."""
    S = tail[0]
    ln_v = math.log(V)
    kstar = 0
    for k in range(1, weights.shape[0] + 1):
        p = weights[k - 1] / S
        r = tail[k] / S
        r_prev = tail[k - 1] / S
        n_after = V - k
        if k == V or r <= 0.0:
            gain = p * math.log(n_after + 1.0)  # the limit R_k -> 0
        else:
            # p_k ln(p_k (V-k)/R_k) + R_{k-1} ln((R_k/(V-k)) / (R_{k-1}/(V-k+1))), the second
            # log split in two, each ratio by log1p when it is near 1 (see native/adaptive.c).
            if r < 0.5 * r_prev:
                tail_ratio_log = math.log(r / r_prev)
            else:
                tail_ratio_log = math.log1p(-p / r_prev)
            gain = p * math.log(p * n_after / r) + r_prev * (
                tail_ratio_log + math.log1p(1.0 / n_after))
        if gain > eps * ln_v:
            kstar = k
    return kstar


@njit(cache=True)
def _select(x, w, m, S, eps):
    """(k*, kept mass) from the weights of pass 2; see native/adaptive.c select_*."""
    n = x.shape[0]
    cap = min(int(1.0 / (eps * _CANDIDATE_SLACK)) + 2, n)
    cand = np.empty(cap, dtype=np.int64)
    nc, rest = _collect(w, np.float32(eps * _CANDIDATE_SLACK * S), cand)
    if nc == 0:  # p_max <= eps: k* = 1
        return 1, 1.0 / S
    exact = np.empty(nc)
    for j in range(nc):
        exact[j] = math.exp(np.float64(x[cand[j]]) - np.float64(m))
    exact = -np.sort(-exact)
    tail = np.empty(nc + 1)
    tail[nc] = rest
    for j in range(nc, 0, -1):
        tail[j - 1] = tail[j] + exact[j - 1]
    k = max(_scan(exact, tail, n, eps), 1)
    return k, exact[:k].sum() / tail[0]


def adaptive_numba(x: np.ndarray, eps: float, want_stats: bool):
    """Returns (k*, kept mass, entropy); entropy is NaN unless want_stats. x: 1-D, n >= 2."""
    w = np.empty(x.shape[0], dtype=np.float32)
    m = _max(x)
    weights = _weights_f32 if x.dtype == np.float32 else _weights_f64
    S, wd = weights(x, m, w, want_stats)
    k, kept = _select(x, w, m, S, eps)
    entropy = math.log(S) - wd / S if want_stats else math.nan
    return k, kept, entropy

r"""Adaptive decoding as ggml operations inside llama.cpp's graph (backend sampling).

With backend sampling llama.cpp runs the head of a sampler chain as part of the model's own
graph, on the device that holds the output layer, and copies back only what the chain leaves:
here a few thousand candidates and the chosen token instead of all V logits. This module
builds the adaptive sampler's part of that graph; temperature before it and ``dist`` after it
are llama.cpp's own backend samplers.

The maths is :mod:`adaptive_llama.kernel`'s (Zhu et al., ICML 2024, Algorithm 1), evaluated
in float32 over the K = min(V, floor(1/epsilon) + 1) most likely tokens only: dConf_k <= p_k
(the kernel module's docstring shows why), fewer than 1/epsilon tokens have p > epsilon, so
k* < K. The K tokens are put in *ascending* order of p, position j holding rank k = K - j::

    p_j     = softmax(x)[ids_j]                      (softmax over all V logits)
    T       = sum of p over the V - K tokens left out (read directly, never 1 - sum)
    R_{k-1} = T + (p_0 + ... + p_j)                  (cumsum, small values first)
    R_k     = T + (p_0 + ... + p_{j-1})              (the same cumsum shifted by one)
    n       = V - k = V - K + j
    dConf_k ln V = p_j ln(p_j n / R_k) + R_{k-1} [ ln(R_k / R_{k-1}) + ln((n+1) / n) ]
    keep j  <=>  some i <= j has dConf > epsilon, or j = K - 1   (k* = max(1, last k above))

which is the kernel's formula with the two logarithms of the second term split so that no
argument leaves float32's range. Where R_k = 0 (every later token has p = 0) R_k and n are
clamped to FLT_MIN and 1: the two terms then cancel to the continuous limit p ln(V-k+1) that
the kernel uses; a token with p = 0 has R_{k-1} = 0 and dConf = 0. Float32 logarithms put
each dConf within about 1e-7 of its float64 value, so k* is the float64 reference's unless
some dConf lies within about 1e-4 (relative) of epsilon.

The kept set leaves the graph as the K log-probabilities (-inf for the tokens cut off) and
their token ids, in that ascending order: llama.cpp's ``dist`` then samples from it. Ascending
order matters there: ``dist`` picks the first position whose cumulative probability exceeds a
uniform draw and falls back to the last position when rounding leaves the total below the
draw, so the last position must be a kept token (the most likely one), never a cut one.
Mode ``uniform`` leaves 0 for every kept token instead of its log-probability. The host reads
k (the finite entries), the kept mass and the chosen token's probability back from these K
values (:func:`read_back`); entropy and Conf are not computed in the graph.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from pathlib import Path

import numpy as np

from .abi import SamplerIface

log = logging.getLogger(__name__)

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
GGML_SORT_ORDER_ASC = 0
FLT_MIN = float(np.finfo(np.float32).tiny)
PROBE_VOCAB = 128 * 1024  # the vocabulary size llama.cpp's own support probes use

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_f = ctypes.c_float
_i = ctypes.c_int

# name: (result type, argument types); every op takes the ggml_context first.
_SIGNATURES = {
    "ggml_nelements": (_i64, [_p]),
    "ggml_reshape_1d": (_p, [_p, _p, _i64]),
    "ggml_reshape_2d": (_p, [_p, _p, _i64, _i64]),
    "ggml_view_1d": (_p, [_p, _p, _i64, ctypes.c_size_t]),
    "ggml_soft_max": (_p, [_p, _p]),
    "ggml_top_k": (_p, [_p, _p, _i]),
    "ggml_argsort": (_p, [_p, _p, _i]),
    "ggml_get_rows": (_p, [_p, _p, _p]),
    "ggml_set_rows": (_p, [_p, _p, _p, _p]),
    "ggml_cumsum": (_p, [_p, _p]),
    "ggml_sum": (_p, [_p, _p]),
    "ggml_pad_ext": (_p, [_p, _p] + [_i] * 8),
    "ggml_arange": (_p, [_p, _f, _f, _f]),
    "ggml_scale_bias": (_p, [_p, _p, _f, _f]),
    "ggml_clamp": (_p, [_p, _p, _f, _f]),
    "ggml_add": (_p, [_p, _p, _p]),
    "ggml_mul": (_p, [_p, _p, _p]),
    "ggml_div": (_p, [_p, _p, _p]),
    "ggml_log": (_p, [_p, _p]),
    "ggml_step": (_p, [_p, _p]),
    "ggml_cont": (_p, [_p, _p]),
    "ggml_set_name": (_p, [_p, ctypes.c_char_p]),
    # graphs of our own: the support probe and the standalone evaluation
    "ggml_init": (_p, [ctypes.c_size_t, _p, ctypes.c_bool]),
    "ggml_free": (None, [_p]),
    "ggml_tensor_overhead": (ctypes.c_size_t, []),
    "ggml_graph_overhead_custom": (ctypes.c_size_t, [ctypes.c_size_t, ctypes.c_bool]),
    "ggml_new_graph_custom": (_p, [_p, ctypes.c_size_t, ctypes.c_bool]),
    "ggml_new_tensor_1d": (_p, [_p, _i, _i64]),
    "ggml_build_forward_expand": (None, [_p, _p]),
    "ggml_graph_n_nodes": (_i, [_p]),
    "ggml_graph_node": (_p, [_p, _i]),
    "ggml_get_data": (_p, [_p]),
    "ggml_op_desc": (ctypes.c_char_p, [_p]),
    "ggml_backend_buft_get_device": (_p, [_p]),
    "ggml_backend_dev_supports_op": (ctypes.c_bool, [_p, _p]),
    "ggml_backend_dev_name": (ctypes.c_char_p, [_p]),
}


class _InitParams(ctypes.Structure):  # struct ggml_init_params, passed by value
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _p), ("no_alloc", ctypes.c_bool)]


@functools.cache
def ggml():
    """ggml's functions from the libraries llama-cpp-python ships (the ones llama.cpp uses)."""
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    api = type("GGML", (), {})()
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(base, name)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(api, name.removeprefix("ggml_"), fn)
    api.init.argtypes = [_InitParams]
    api.init_params = _InitParams
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
    api.graph_compute_with_ctx = cpu.ggml_graph_compute_with_ctx
    api.graph_compute_with_ctx.restype = _i
    api.graph_compute_with_ctx.argtypes = [_p, _p, _i]
    return api


def n_candidates(n_vocab: int, epsilon: float) -> int:
    """K: how many of the most likely tokens can hold k* (fewer than 1/epsilon have p > eps)."""
    return min(n_vocab, math.floor(1.0 / epsilon) + 1)


def build(ctx, logits, candidates, epsilon: float, uniform: bool):
    """Add the adaptive sampler to a graph: (kept logits, their token ids), ascending order.

    ``logits``: the F32 row the chain has so far (V entries); ``candidates``: the I32 token ids
    of those entries, or None when they are the whole vocabulary in order. Returns K entries:
    log p (0 in ``uniform`` mode) for the kept tokens, -inf for the others, and their ids.
    """
    g = ggml()
    V = g.nelements(logits)
    K = n_candidates(V, epsilon)
    x = g.reshape_1d(ctx, logits, V)
    probs = g.soft_max(ctx, x)

    def rows(table, idx, n):  # table[idx] for a 1-D table (ggml gathers rows)
        return g.reshape_1d(ctx, g.get_rows(ctx, g.reshape_2d(ctx, table, 1, n), idx), K)

    top = g.top_k(ctx, x, K)                                     # any order
    ids = rows(top, g.argsort(ctx, rows(x, top, V), GGML_SORT_ORDER_ASC), K)
    p = rows(probs, ids, V)
    out_ids = ids if candidates is None else rows(candidates, ids, V)
    if K == 1:  # V = 1: the one token is k* = 1
        return g.log(ctx, g.scale_bias(ctx, p, 0.0, 1.0) if uniform else p), out_ids

    # T: the probabilities of the tokens outside the K, summed directly (top K zeroed).
    zeros = g.reshape_2d(ctx, g.scale_bias(ctx, p, 0.0, 0.0), 1, K)
    rest = g.set_rows(ctx, g.reshape_2d(ctx, g.cont(ctx, probs), 1, V), zeros, ids)
    T = g.sum(ctx, rest)
    cum = g.cumsum(ctx, p)                                       # p_0 + ... + p_j
    R_prev = g.add(ctx, cum, T)                                  # R_{k-1}
    cum_before = g.pad_ext(ctx, g.view_1d(ctx, cum, K - 1, 0), 1, 0, 0, 0, 0, 0, 0, 0)
    R_k = g.add(ctx, cum_before, T)
    n = g.arange(ctx, float(V - K), float(V), 1.0)               # V - k
    n_safe = g.clamp(ctx, n, 1.0, math.inf)
    R_k_safe = g.clamp(ctx, R_k, FLT_MIN, math.inf)
    head = g.log(ctx, g.div(ctx, g.clamp(ctx, p, FLT_MIN, 1.0), R_k_safe))
    head = g.mul(ctx, p, g.add(ctx, head, g.log(ctx, n_safe)))
    drop = g.log(ctx, g.div(ctx, R_k_safe, g.clamp(ctx, R_prev, FLT_MIN, math.inf)))
    spread = g.log(ctx, g.div(ctx, g.scale_bias(ctx, n, 1.0, 1.0), n_safe))
    dconf = g.add(ctx, head, g.mul(ctx, R_prev, g.add(ctx, drop, spread)))  # dConf_k ln V
    g.set_name(dconf, b"adaptive_dconf_lnV")
    above = g.step(ctx, g.scale_bias(ctx, dconf, 1.0, -epsilon * math.log(V)))
    last = g.step(ctx, g.arange(ctx, 1.5 - K, 1.5, 1.0))         # 1 at j = K - 1 (rank 1)
    keep = g.step(ctx, g.add(ctx, g.cumsum(ctx, above), last))
    bias = g.log(ctx, keep)                                      # 0 kept, -inf cut
    out = bias if uniform else g.add(ctx, g.log(ctx, p), bias)
    g.set_name(out, b"adaptive_logits")
    return out, out_ids


# ---- graphs of our own: the standalone evaluation and the device support probe ----


class _Graph:
    """A ggml context and graph of our own (freed on exit); ``alloc``: tensors get memory."""

    def __init__(self, mem_size: int, alloc: bool, max_nodes: int = 2048):
        g = ggml()
        size = mem_size + max_nodes * g.tensor_overhead() + g.graph_overhead_custom(
            max_nodes, False)
        self.ctx = g.init(g.init_params(size, None, not alloc))
        if not self.ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for a graph")
        self.gf = g.new_graph_custom(self.ctx, max_nodes, False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        ggml().free(self.ctx)


def evaluate(logits, epsilon: float, uniform: bool = False, threads: int = 1):
    """Run :func:`build` on ggml's CPU backend, outside llama.cpp: (out logits, token ids).

    For tests and measurements: the same operations llama.cpp puts in its graph, on a row
    given here. Returns float32 and int32 arrays of K entries, ascending order.
    """
    g = ggml()
    x = np.ascontiguousarray(logits, dtype=np.float32)
    with _Graph(64 * 4 * x.size + (1 << 20), alloc=True) as graph:
        row = g.new_tensor_1d(graph.ctx, GGML_TYPE_F32, x.size)
        ctypes.memmove(g.get_data(row), x.ctypes.data, x.nbytes)
        out, ids = build(graph.ctx, row, None, epsilon, uniform)
        for tensor in (out, ids):
            g.build_forward_expand(graph.gf, tensor)
        if g.graph_compute_with_ctx(graph.ctx, graph.gf, threads) != 0:
            raise RuntimeError("ggml could not compute the adaptive sampler's graph")
        K = g.nelements(out)
        return (np.ctypeslib.as_array(ctypes.cast(g.get_data(out), ctypes.POINTER(ctypes.c_float)),
                                      (K,)).copy(),
                np.ctypeslib.as_array(ctypes.cast(g.get_data(ids), ctypes.POINTER(ctypes.c_int32)),
                                      (K,)).copy())


def unsupported_op(device, epsilon: float, uniform: bool) -> str | None:
    """The first operation of the sampler's graph that ``device`` cannot run, or None."""
    g = ggml()
    with _Graph(0, alloc=False) as graph:
        logits = g.new_tensor_1d(graph.ctx, GGML_TYPE_F32, PROBE_VOCAB)
        candidates = g.new_tensor_1d(graph.ctx, GGML_TYPE_I32, PROBE_VOCAB)
        for tensor in build(graph.ctx, logits, candidates, epsilon, uniform):
            g.build_forward_expand(graph.gf, tensor)
        for i in range(g.graph_n_nodes(graph.gf)):
            node = g.graph_node(graph.gf, i)
            if not g.backend_dev_supports_op(device, node):
                return g.op_desc(node).decode()
    return None


# ---- the adaptive sampler's backend hooks ----
#
# The adaptive sampler (C or numba) gets a copy of its llama_sampler_i with backend_init and
# backend_apply filled in; both run once per graph llama.cpp builds, not per token.

_graph_samplers: dict[int, tuple[float, bool, SamplerIface]] = {}  # sampler address -> config
refusals: list[str] = []  # why a device could not take the sampler (newest last)


def _address(smpl) -> int:
    return ctypes.cast(smpl, ctypes.c_void_p).value


def _backend_init(smpl, buft, n_outputs_max_per_seq):
    """True when the device that holds the model's output can run every operation."""
    try:
        epsilon, uniform, _ = _graph_samplers[_address(smpl)]
        device = ggml().backend_buft_get_device(buft)
        if not device:  # llama.cpp: no device means the CPU, which runs every operation
            return True
        missing = unsupported_op(device, epsilon, uniform)
        if missing is not None:  # the engine reports it, once
            refusals.append(f"{ggml().backend_dev_name(device).decode()} cannot run the "
                            f"{missing} operation that the adaptive sampler needs")
        return missing is None
    except Exception:  # an exception must not cross into llama.cpp
        log.exception("backend sampling: the adaptive sampler's support check failed")
        # Refused without a reason in `refusals`, llama.cpp would still run the chain.
        refusals.append("the adaptive sampler's support check failed (the error is logged)")
        return False


def _backend_apply(smpl, ctx, gf, data):
    try:
        epsilon, uniform, _ = _graph_samplers[_address(smpl)]
        d = data.contents
        d.logits, d.candidates = build(ctx, d.logits, d.candidates, epsilon, uniform)
    except Exception:
        # llama.cpp would sample from the chain without the adaptive step: say so loudly.
        log.exception("backend sampling: building the adaptive sampler's graph failed")


@functools.cache
def _hooks():
    import llama_cpp

    return (llama_cpp.llama_sampler_i_backend_init(_backend_init),
            llama_cpp.llama_sampler_i_backend_apply(_backend_apply))


def enable(sampler: int, epsilon: float, uniform: bool) -> None:
    """Give the adaptive sampler at address ``sampler`` its backend-sampling hooks."""
    import llama_cpp

    smpl = llama_cpp.llama_sampler.from_address(sampler)
    iface = SamplerIface.from_buffer_copy(
        ctypes.string_at(_address(smpl.iface), ctypes.sizeof(SamplerIface)))
    init, apply = _hooks()
    iface.backend_init = _address(init)
    iface.backend_apply = _address(apply)
    _graph_samplers[sampler] = (epsilon, uniform, iface)  # keeps the copy alive
    smpl.iface = ctypes.cast(ctypes.pointer(iface), ctypes.POINTER(llama_cpp.llama_sampler_i))


def forget(sampler: int) -> None:
    """After the sampler is freed: drop its hooks' configuration."""
    _graph_samplers.pop(sampler, None)


def read_back(ctx, idx: int, token: int, uniform: bool) -> tuple[int, float, float]:
    """(k, kept mass, the chosen token's probability) from what the graph left for output
    ``idx``: the K log-probabilities (-inf where cut) and their ids. NaN masses in uniform
    mode, whose kept entries hold 0 instead of log p."""
    import llama_cpp

    n = llama_cpp.llama_get_sampled_logits_count_ith(ctx, idx)
    x = np.ctypeslib.as_array(llama_cpp.llama_get_sampled_logits_ith(ctx, idx), (n,))
    kept = np.isfinite(x)
    if uniform:
        return int(kept.sum()), math.nan, math.nan
    ids = np.ctypeslib.as_array(llama_cpp.llama_get_sampled_candidates_ith(ctx, idx), (n,))
    chosen = x[ids == token]
    return (int(kept.sum()), float(np.exp(x[kept].astype(np.float64)).sum()),
            float(np.exp(np.float64(chosen[0]))) if chosen.size else 0.0)

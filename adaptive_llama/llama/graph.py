r"""Adaptive decoding as ggml operations inside llama.cpp's graph (backend sampling).

With backend sampling llama.cpp runs the head of a sampler chain as part of the model's own
graph, on the device that holds the output layer, and copies back only what the chain leaves:
here a few hundred candidates and the chosen token instead of all V logits. This module
builds the adaptive sampler's part of that graph, temperature included (the softmax's scale);
``dist`` after it is llama.cpp's own backend sampler.

The maths is :mod:`adaptive_llama.kernel`'s (Zhu et al., ICML 2024, Algorithm 1), evaluated
in float32 over the K = min(V, floor(1/epsilon) + 1) most likely tokens only: dConf_k <= p_k
(the kernel module's docstring shows why), fewer than 1/epsilon tokens have p > epsilon, so
k* < K. The K tokens are put in *ascending* order of p, position j holding rank k = K - j::

    p_j     = softmax(x / temp)[ids_j]               (softmax over all V logits)
    T       = sum of p over the V - K tokens left out (read directly, never 1 - sum)
    R_{k-1} = T + (p_0 + ... + p_j)                  (cumsum, small values first)
    R_k     = T + (p_0 + ... + p_{j-1})              (the same cumsum shifted by one)
    n       = V - k = V - K + j
    dConf_k ln V = p_j [ln(p_j / R_k) + ln n] + R_{k-1} [ ln(R_k / R_{k-1}) + ln((n+1) / n) ]
    keep j  <=>  some i <= j has dConf > epsilon, or j = K - 1   (k* = max(1, last k above))

which is the kernel's formula with the two logarithms of the second term split so that no
argument leaves float32's range. What depends only on V, K and epsilon is computed once in
float64 and kept on the device with the sampler (:func:`constants`): ln n, ln((n+1)/n) (a
ratio within 4e-6 of 1 at V 262,144, which float32 could not hold) and the threshold
-epsilon ln V, with +1e30 at j = K - 1 so that the most likely token is always above it.
Where R_k = 0 (every later token has p = 0) R_k and n are clamped to FLT_MIN and 1: the two
terms then cancel to the continuous limit p ln(V-k+1) that the kernel uses; a token with
p = 0 has R_{k-1} = 0 and dConf = 0. Float32 logarithms put each dConf within about 1e-7 of
its float64 value, so k* is the float64 reference's unless some dConf lies within about 1e-4
(relative, :data:`TOLERANCE`) of epsilon.

The kept set leaves the graph as the K log-probabilities (-inf for the tokens cut off) and
their token ids, in that ascending order: llama.cpp's ``dist`` then samples from it. Ascending
order matters there: ``dist`` picks the first position whose cumulative probability exceeds a
uniform draw and falls back to the last position when rounding leaves the total below the
draw, so the last position must be a kept token (the most likely one), never a cut one.
Mode ``uniform`` leaves 0 for every kept token instead of its log-probability. The host reads
k (the finite entries), the kept mass and the chosen token's probability back from these K
values (:func:`read_back`); entropy and Conf are not computed in the graph.

Self-check (:func:`self_check`): the graph also keeps the K probabilities and the tail mass T
it used, and the host recomputes k* from exactly those in float64
(:func:`adaptive_llama.kernel.dconf_of_head`). A mismatch is then the graph's own arithmetic,
never a difference in the logits, which is what tells on a GPU whether the graph is exact.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math

import numpy as np

from ..kernel import dconf_of_head, k_from_dconf
from . import ggml
from .abi import SamplerIface

log = logging.getLogger(__name__)

FLT_MIN = float(np.finfo(np.float32).tiny)
PROBE_VOCAB = 128 * 1024  # the vocabulary size llama.cpp's own support probes use
# float32 logarithms put dConf within ~1e-7 (absolute, times ln V) of its float64 value: the
# graph's k* may differ from the float64 reference only where some dConf lies this close
# (relative) to epsilon.
TOLERANCE = 1e-4
ALWAYS = 1e30  # the threshold's entry for the most likely token: above it whatever its dConf

def n_candidates(n_vocab: int, epsilon: float) -> int:
    """K: how many of the most likely tokens can hold k* (fewer than 1/epsilon have p > eps)."""
    return min(n_vocab, math.floor(1.0 / epsilon) + 1)


def constants(V: int, K: int, epsilon: float) -> np.ndarray:
    """What the graph needs that depends only on V, K and epsilon, in float64 then float32,
    position j = K - k: rows ln n, ln((n+1)/n) with n = V - k clamped to 1 (the formula's
    last logarithm; log1p keeps it exact where the ratio is within float32's step of 1),
    and the threshold -epsilon ln V (ALWAYS at j = K - 1, the most likely token)."""
    n = np.arange(V - K, V, dtype=np.float64)
    n_safe = np.maximum(n, 1.0)
    threshold = np.full(K, -epsilon * math.log(V))
    threshold[-1] = ALWAYS
    spread = np.log1p((n + 1.0 - n_safe) / n_safe)  # ln((n+1)/n); 0 where n = 0 (k = V)
    return np.concatenate([np.log(n_safe), spread, threshold]).astype(np.float32)


def build(ctx, logits, candidates, epsilon: float, uniform: bool, consts, temp: float = 1.0):
    """Add the adaptive sampler to a graph: (kept logits, their token ids, (p, T)).

    ``logits``: the F32 row the chain has so far (V entries); ``candidates``: the I32 token ids
    of those entries, or None when they are the whole vocabulary in order; ``consts``: an F32
    tensor of 3K entries holding :func:`constants` (K from :func:`n_candidates`); ``temp``:
    the temperature, the softmax's scale 1/temp (the order of the logits does not change).
    Returns K entries: log p (0 in ``uniform`` mode) for the kept tokens, -inf for the
    others, their ids, and the K probabilities and tail mass T that decided (for the
    self-check).
    """
    g = ggml.lib
    V = g.nelements(logits)
    K = n_candidates(V, epsilon)
    x = g.reshape_1d(ctx, logits, V)
    probs = g.soft_max_ext(ctx, x, None, 1.0 / temp, 0.0)

    def rows(table, idx, n):  # table[idx] for a 1-D table (ggml gathers rows)
        return g.reshape_1d(ctx, g.get_rows(ctx, g.reshape_2d(ctx, table, 1, n), idx), K)

    top = g.top_k(ctx, x, K)                                     # any order
    p_top = rows(probs, top, V)
    order = g.argsort(ctx, p_top, ggml.SORT_ORDER_ASC)           # a sort of K, not of V
    ids, p = rows(top, order, K), rows(p_top, order, K)
    out_ids = ids if candidates is None else rows(candidates, ids, V)
    if K == 1:  # V = 1: the one token is k* = 1
        return (g.log(ctx, g.scale_bias(ctx, p, 0.0, 1.0) if uniform else p), out_ids,
                (p, g.scale_bias(ctx, g.sum(ctx, p), 0.0, 0.0)))

    def const(row):
        return g.view_1d(ctx, consts, K, row * K * 4)

    # T: the probabilities of the tokens outside the K, summed directly. The top K are
    # zeroed in place: every read of probs (p_top) comes before, since the zeros are made
    # from p.
    zeros = g.reshape_2d(ctx, g.scale_bias(ctx, p, 0.0, 0.0), 1, K)
    T = g.sum(ctx, g.set_rows(ctx, g.reshape_2d(ctx, probs, 1, V), zeros, ids))
    cum = g.cumsum(ctx, p)                                       # p_0 + ... + p_j
    R_prev = g.add(ctx, cum, T)                                  # R_{k-1}
    cum_before = g.pad_ext(ctx, g.view_1d(ctx, cum, K - 1, 0), 1, 0, 0, 0, 0, 0, 0, 0)
    R_k = g.clamp(ctx, g.add(ctx, cum_before, T), FLT_MIN, math.inf)
    head = g.log(ctx, g.div(ctx, g.clamp(ctx, p, FLT_MIN, 1.0), R_k))
    head = g.mul(ctx, p, g.add(ctx, head, const(0)))             # + ln n
    drop = g.log(ctx, g.div(ctx, R_k, g.clamp(ctx, R_prev, FLT_MIN, math.inf)))
    dconf = g.add(ctx, head, g.mul(ctx, R_prev, g.add(ctx, drop, const(1))))  # dConf_k ln V
    above = g.step(ctx, g.add(ctx, dconf, const(2)))             # dConf > eps, or rank 1
    keep = g.step(ctx, g.cumsum(ctx, above))                     # 1 from the first above on
    out = g.log(ctx, keep if uniform else g.mul(ctx, p, keep))   # log p kept, -inf cut
    g.set_name(out, b"adaptive_logits")
    return out, out_ids, (p, T)


# ---- graphs of our own: the standalone evaluation and the device support probe ----


class _Graph:
    """A ggml context and graph of our own (freed on exit); ``alloc``: tensors get memory."""

    def __init__(self, mem_size: int, alloc: bool, max_nodes: int = 2048):
        g = ggml.lib
        size = mem_size + max_nodes * g.tensor_overhead() + g.graph_overhead_custom(
            max_nodes, False)
        self.ctx = g.init(ggml.InitParams(size, None, not alloc))
        if not self.ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for a graph")
        self.gf = g.new_graph_custom(self.ctx, max_nodes, False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        ggml.lib.free(self.ctx)


def _const_tensor(g, ctx, V: int, epsilon: float):
    """A tensor of ``ctx`` for the :func:`constants` of a row of V, and those values."""
    values = constants(V, n_candidates(V, epsilon), epsilon)
    return g.new_tensor_1d(ctx, ggml.TYPE_F32, values.size), values


def _array(g, tensor, ctype, n):
    return np.ctypeslib.as_array(ctypes.cast(g.get_data(tensor), ctypes.POINTER(ctype)),
                                 (n,)).copy()


def evaluate(logits, epsilon: float, uniform: bool = False, threads: int = 1,
             temp: float = 1.0):
    """Run :func:`build` on ggml's CPU backend, outside llama.cpp: (out logits, token ids).

    For tests and measurements: the same operations llama.cpp puts in its graph, on a row
    given here. Returns float32 and int32 arrays of K entries, ascending order.
    """
    g = ggml.lib
    x = np.ascontiguousarray(logits, dtype=np.float32)
    with _Graph(64 * 4 * x.size + (1 << 20), alloc=True) as graph:
        row = g.new_tensor_1d(graph.ctx, ggml.TYPE_F32, x.size)
        ctypes.memmove(g.get_data(row), x.ctypes.data, x.nbytes)
        consts, values = _const_tensor(g, graph.ctx, x.size, epsilon)
        ctypes.memmove(g.get_data(consts), values.ctypes.data, values.nbytes)
        out, ids, _ = build(graph.ctx, row, None, epsilon, uniform, consts, temp)
        for tensor in (out, ids):
            g.build_forward_expand(graph.gf, tensor)
        if g.graph_compute_with_ctx(graph.ctx, graph.gf, threads) != 0:
            raise RuntimeError("ggml could not compute the adaptive sampler's graph")
        K = g.nelements(out)
        return _array(g, out, ctypes.c_float, K), _array(g, ids, ctypes.c_int32, K)


def graph_ops(epsilon: float, uniform: bool, n_vocab: int = PROBE_VOCAB) -> list[str]:
    """The compute operations the sampler adds to llama.cpp's graph for one sequence, in
    order (views and reshapes, which move no data, left out)."""
    g = ggml.lib
    with _Graph(0, alloc=False) as graph:
        logits = g.new_tensor_1d(graph.ctx, ggml.TYPE_F32, n_vocab)
        consts = _const_tensor(g, graph.ctx, n_vocab, epsilon)[0]
        for tensor in build(graph.ctx, logits, None, epsilon, uniform, consts)[:2]:
            g.build_forward_expand(graph.gf, tensor)
        names = [g.op_desc(g.graph_node(graph.gf, i)).decode()
                 for i in range(g.graph_n_nodes(graph.gf))]
    return [n for n in names if n not in ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE")]


def unsupported_op(device, epsilon: float, uniform: bool) -> str | None:
    """The first operation of the sampler's graph that ``device`` cannot run, or None."""
    g = ggml.lib
    with _Graph(0, alloc=False) as graph:
        logits = g.new_tensor_1d(graph.ctx, ggml.TYPE_F32, PROBE_VOCAB)
        candidates = g.new_tensor_1d(graph.ctx, ggml.TYPE_I32, PROBE_VOCAB)
        consts = _const_tensor(g, graph.ctx, PROBE_VOCAB, epsilon)[0]
        for tensor in build(graph.ctx, logits, candidates, epsilon, uniform, consts)[:2]:
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


class _InGraph:
    """One adaptive sampler's part in llama.cpp's graph: its configuration, the interface
    copy that holds the hooks, its constants in a buffer of the output device (made once
    per row length), and in self-check mode the last (p, T) tensors of its graph."""

    def __init__(self, epsilon: float, uniform: bool, temp: float, iface, check: bool):
        self.epsilon, self.uniform, self.temp = epsilon, uniform, temp
        self.iface, self.check = iface, check
        self.buft = None
        self.consts: dict[int, tuple] = {}  # row length -> (ggml context, buffer, tensor)
        self.decided = None

    def constants_on_device(self, V: int):
        if V not in self.consts:
            g = ggml.lib
            ctx = g.init(ggml.InitParams(4 * g.tensor_overhead(), None, True))
            tensor, values = _const_tensor(g, ctx, V, self.epsilon)
            buffer = g.backend_alloc_ctx_tensors_from_buft(ctx, self.buft)
            if not buffer:
                g.free(ctx)
                raise MemoryError("the device has no memory for the adaptive sampler's "
                                  "constants")
            g.backend_tensor_set(tensor, values.ctypes.data, 0, values.nbytes)
            self.consts[V] = (ctx, buffer, tensor)
        return self.consts[V][2]

    def free(self):
        g = ggml.lib
        for ctx, buffer, _ in self.consts.values():
            g.backend_buffer_free(buffer)
            g.free(ctx)
        self.consts.clear()


_graph_samplers: dict[int, _InGraph] = {}  # sampler address -> its part in the graph
refusals: list[str] = []  # why a device could not take the sampler (newest last)
_checks: list | None = None  # the records of :func:`self_check` while one is open


def _address(smpl) -> int:
    return ctypes.cast(smpl, ctypes.c_void_p).value


def _backend_init(smpl, buft, n_outputs_max_per_seq):
    """True when the device that holds the model's output can run every operation."""
    try:
        sampler = _graph_samplers[_address(smpl)]
        sampler.buft = buft
        device = ggml.lib.backend_buft_get_device(buft)
        if not device:  # llama.cpp: no device means the CPU, which runs every operation
            return True
        missing = unsupported_op(device, sampler.epsilon, sampler.uniform)
        if missing is not None:  # the engine reports it, once
            refusals.append(f"{ggml.lib.backend_dev_name(device).decode()} cannot run the "
                            f"{missing} operation that the adaptive sampler needs")
        return missing is None
    except Exception:  # an exception must not cross into llama.cpp
        log.exception("backend sampling: the adaptive sampler's support check failed")
        # Refused without a reason in `refusals`, llama.cpp would still run the chain.
        refusals.append("the adaptive sampler's support check failed (the error is logged)")
        return False


def _backend_apply(smpl, ctx, gf, data):
    try:
        sampler = _graph_samplers[_address(smpl)]
        d = data.contents
        g = ggml.lib
        V = g.nelements(d.logits)
        d.logits, d.candidates, decided = build(ctx, d.logits, d.candidates, sampler.epsilon,
                                                sampler.uniform, sampler.constants_on_device(V),
                                                sampler.temp)
        if sampler.check:  # kept in memory after the graph runs, for checked()
            for tensor in decided:
                g.set_output(tensor)
            sampler.decided = (*decided, V)
    except Exception:
        # llama.cpp would sample from the chain without the adaptive step: say so loudly.
        log.exception("backend sampling: building the adaptive sampler's graph failed")


@functools.cache
def _hooks():
    import llama_cpp

    return (llama_cpp.llama_sampler_i_backend_init(_backend_init),
            llama_cpp.llama_sampler_i_backend_apply(_backend_apply))


def enable(sampler: int, epsilon: float, uniform: bool, temp: float = 1.0) -> None:
    """Give the adaptive sampler at address ``sampler`` its backend-sampling hooks, with the
    temperature folded into its softmax (in self-check mode while a :func:`self_check` is
    open)."""
    import llama_cpp

    smpl = llama_cpp.llama_sampler.from_address(sampler)
    iface = SamplerIface.from_buffer_copy(
        ctypes.string_at(_address(smpl.iface), ctypes.sizeof(SamplerIface)))
    init, apply = _hooks()
    iface.backend_init = _address(init)
    iface.backend_apply = _address(apply)
    # keeps the copy alive
    _graph_samplers[sampler] = _InGraph(epsilon, uniform, temp, iface,
                                        check=_checks is not None)
    smpl.iface = ctypes.cast(ctypes.pointer(iface), ctypes.POINTER(llama_cpp.llama_sampler_i))


def forget(sampler: int) -> None:
    """After the sampler is freed: drop its hooks' configuration and constants."""
    part = _graph_samplers.pop(sampler, None)
    if part is not None:
        part.free()


@contextlib.contextmanager
def self_check():
    """Self-check mode for the adaptive samplers put in a graph inside the block: each token
    the graph samples adds a record to the list this yields: the graph's k, the float64
    reference's k from the same K probabilities and tail mass, whether they are equal,
    whether a difference is within :data:`TOLERANCE` (some dConf that close to epsilon), and
    how far the K probabilities and the tail sum from 1."""
    global _checks
    records, outer = [], _checks
    _checks = records
    try:
        yield records
    finally:
        _checks = outer


def checked(sampler: int, k: int) -> None:
    """Record the self-check of the token just sampled by ``sampler``, whose graph kept k."""
    part = _graph_samplers.get(sampler)
    if _checks is None or part is None or part.decided is None:
        return
    g = ggml.lib
    p_t, T_t, V = part.decided
    p = np.empty(g.nelements(p_t), np.float32)
    T = np.empty(1, np.float32)
    g.backend_tensor_get(p_t, p.ctypes.data, 0, p.nbytes)
    g.backend_tensor_get(T_t, T.ctypes.data, 0, T.nbytes)
    _checks.append(verdict(p[::-1], float(T[0]), V, part.epsilon, k))


def verdict(p_desc, tail: float, V: int, epsilon: float, k: int) -> dict:
    """How the graph's k compares with the float64 reference's from the same K probabilities
    (descending) and tail mass: equal, or different only where dConf is within TOLERANCE of
    epsilon. A larger k says dConf_k > epsilon; a smaller one says that no later dConf is
    (those the reference has above must be that close)."""
    dconf = dconf_of_head(np.asarray(p_desc, np.float64), tail, V)
    k_ref = k_from_dconf(dconf, epsilon)
    if k > k_ref:
        disputed = dconf[k - 1:k]
    else:
        disputed = dconf[k:k_ref][dconf[k:k_ref] > epsilon]  # dConf_{k+1} .. dConf_{k_ref}
    near = bool(np.all(np.abs(disputed - epsilon) <= TOLERANCE * epsilon))
    return {"k": k, "k_ref": k_ref, "equal": k == k_ref,
            "within_tolerance": k == k_ref or near,
            "mass_error": abs(float(np.sum(p_desc, dtype=np.float64)) + tail - 1.0)}


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

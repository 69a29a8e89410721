"""The adaptive, eta, p-less and top-H samplers for llama.cpp's chain, in numba: the fallback
of the C ones.

When the C library is missing (a prebuilt llama-cpp-python wheel on a machine without a C
compiler) or ``ADAPTIVE_LLAMA_IMPL=numba`` asks for it, these are the samplers
:class:`adaptive_llama.llama.chain.SamplerChain` adds. They keep the C samplers' contract
(``native/adaptive.c``): the same kept set in the same order, the same splitmix64 random
stream, the same statistics record (``al_stats``, read through :class:`native.Stats`), the
same out-of-memory rule (a vocabulary larger than the buffers: the arg-max, counted in
``n_fallbacks``). So a seed gives the same text under both backends.

``apply`` and ``reset`` are ``numba.cfunc`` functions: llama.cpp calls machine code, no Python
runs per token. ``name``, ``clone`` and ``free`` run rarely and are ctypes callbacks. Each
sampler's state and buffers are one numpy record and arrays, kept alive in a registry until
llama.cpp frees the sampler.
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from ..kernel import native
from ..kernel.numba_impl import decide, weights
from .abi import SamplerIface

# al_stats first, at the offsets native.Stats gives, then the sampler's own fields.
STATE = np.dtype([
    ("k", np.int32), ("token", np.int32), ("kept_mass", np.float64), ("entropy", np.float64),
    ("conf", np.float64), ("p_chosen", np.float64), ("n_tokens", np.int64),
    ("n_fallbacks", np.int64),
    ("eps", np.float64), ("uniform", np.int64), ("seed", np.uint64), ("rng", np.uint64),
    ("record", np.int64), ("cap", np.int64), ("top_n", np.int64),
    # buffer addresses (numpy arrays this module keeps alive)
    ("x", np.int64), ("w", np.int64), ("cand", np.int64), ("exact", np.int64),
    ("tail", np.int64), ("flags", np.int64), ("kept", np.int64),
], align=True)
_SORTED_OFFSET = 24  # llama_token_data_array.sorted (bool) after data, size, selected


@intrinsic
def _pointer(typingctx, address):
    """An int64 address as a void pointer, for numba.carray."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return sig, codegen


@njit(inline="always", error_model="numpy")
def _next_uniform(state):
    """splitmix64, as native/adaptive.c next_uniform: (uniform in [0, 1), next state)."""
    state = state + np.uint64(0x9E3779B97F4A7C15)
    z = state
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.float64(z >> np.uint64(11)) * (1.0 / 9007199254740992.0), state


@njit(inline="always", error_model="numpy")
def _state_of(smpl):
    """The sampler's state record: llama_sampler is {iface, ctx}."""
    return carray(_pointer(carray(smpl, 2, np.int64)[1]), 1, STATE)


@njit(cache=True, error_model="numpy")
def _gather(logits, x):
    """The logits into a contiguous buffer (the passes vectorise over it), and their max."""
    m = logits[0, 1]
    for i in range(x.shape[0]):
        v = logits[i, 1]
        x[i] = v
        m = v if v > m else m
    return m


@njit(cache=True, error_model="numpy")
def _move_to_front(rows, pos, k, kept, mark):
    """Rows pos[0..k) to the front, in that order, every other row kept somewhere (a
    permutation, as native/adaptive.c move_to_front); rows are (id, logit, p) as int32."""
    for j in range(k):
        kept[j] = rows[pos[j]]
        mark[j] = 0
    for j in range(k):
        if pos[j] < k:
            mark[pos[j]] = 1
    front = 0
    for j in range(k):
        if pos[j] < k:
            continue
        while mark[front]:
            front += 1
        rows[pos[j]] = rows[front]
        front += 1
    rows[:k] = kept[:k]


@njit(inline="always", error_model="numpy")
def _record_fallback(s, token):
    """The record of a token chosen by arg-max because the buffers were too small."""
    s.k = 1
    s.token = token
    s.kept_mass = s.p_chosen = s.entropy = s.conf = math.nan
    s.n_tokens += 1
    s.n_fallbacks += 1


@njit(cache=True, error_model="numpy")
def _choose_argmax(s, rows, logits, cur):
    """Out of room: the most likely token alone (llama.cpp aborts on no selection)."""
    n = rows.shape[0]
    best = 0
    for i in range(1, n):
        if logits[i, 1] > logits[best, 1]:
            best = i
    for f in range(3):
        rows[best, f], rows[0, f] = rows[0, f], rows[best, f]
    logits[0, 2] = 1.0
    cur[1] = 1
    cur[2] = 0
    _record_fallback(s, rows[0, 0])


@njit(inline="always", error_model="numpy")
def _record_certain(s, token):
    """A choice with nothing left to decide: k = 1, all the mass on ``token``."""
    s.k = 1
    s.token = token
    s.kept_mass = s.p_chosen = 1.0
    s.entropy = 0.0 if s.record else math.nan
    s.conf = math.nan  # 1 - H / ln V is undefined for V = 1
    s.n_tokens += 1


@njit(cache=True, error_model="numpy")
def _decide(s, x, m):
    """The sampler's decision on the contiguous row x (n >= 2 tokens, max m), as
    native/adaptive.c decide: k*, the draw inside the kept set, and the record but for the
    token and the count. Returns (the choice's position among the sorted candidates, whose
    ``cand`` entry is its position in x; the kept weight)."""
    n = x.shape[0]
    w = carray(_pointer(s.w), n, np.float32)
    cand = carray(_pointer(s.cand), n, np.int64)
    exact = carray(_pointer(s.exact), n, np.float64)
    tail = carray(_pointer(s.tail), n + 1, np.float64)
    flags = carray(_pointer(s.flags), n, np.uint8)
    S, wd = weights(x, m, w, s.record != 0)
    k, kept_mass, nc = decide(x, w, m, S, s.eps, cand, exact, tail, flags)
    kept_w = 0.0
    for j in range(k):
        kept_w += exact[j]
    u, rng = _next_uniform(s.rng)
    s.rng = rng
    if s.uniform:
        chosen = min(int(u * k), k - 1)
    else:
        target = u * kept_w
        acc = 0.0
        chosen = 0
        while chosen < k - 1:
            acc += exact[chosen]
            if acc > target:
                break
            chosen += 1
    s.k = k
    s.kept_mass = kept_mass
    s.p_chosen = exact[chosen] * kept_mass / kept_w
    if s.record:
        s.entropy = math.log(S) - wd / S
        s.conf = 1.0 - s.entropy / math.log(n)
    return chosen, kept_w


@cfunc(types.void(types.voidptr, types.voidptr), cache=True, error_model="numpy")
def _adaptive_apply(smpl, cur_p):
    s = _state_of(smpl)[0]
    cur = carray(cur_p, 3, np.int64)  # data, size, selected
    n = cur[1]
    if n == 0:
        return
    rows = carray(_pointer(cur[0]), (n, 3), np.int32)
    logits = carray(_pointer(cur[0]), (n, 3), np.float32)
    if n == 1:  # one candidate: it is the choice
        cur[2] = 0
        _record_certain(s, rows[0, 0])
        return
    if n > s.cap:
        _choose_argmax(s, rows, logits, cur)
        return
    x = carray(_pointer(s.x), n, np.float32)
    chosen, kept_w = _decide(s, x, _gather(logits, x))
    k = s.k
    exact = carray(_pointer(s.exact), n, np.float64)
    _move_to_front(rows, carray(_pointer(s.cand), n, np.int64), k,
                   carray(_pointer(s.kept), (n, 3), np.int32),
                   carray(_pointer(s.flags), n, np.uint8))
    for j in range(k):
        logits[j, 2] = np.float32(1.0 / k) if s.uniform else np.float32(exact[j] / kept_w)
    cur[1] = k
    carray(cur_p, 32, np.uint8)[_SORTED_OFFSET] = 1
    cur[2] = chosen
    s.token = rows[chosen, 0]
    s.n_tokens += 1


@njit(cache=True, error_model="numpy")
def _scale_row(row, temp, x):
    """x_i = row_i / temp: llama.cpp's temperature sampler, bit for bit (true divisions:
    no fastmath, which would multiply by 1 / temp)."""
    for i in range(row.shape[0]):
        x[i] = row[i] / temp


@njit(cache=True, fastmath=True, error_model="numpy")
def _max_of(x):
    m = x[0]
    for i in range(x.shape[0]):
        m = x[i] if x[i] > m else m
    return m


@njit(cache=True, error_model="numpy")
def _argmax_of_quotients(row, temp):
    """The first token with the highest row_i / temp (two logits can round to one)."""
    best = 0
    for i in range(1, row.shape[0]):
        if row[i] / temp > row[best] / temp:
            best = i
    return best


@cfunc(types.int32(types.voidptr, types.int64, types.int64, types.float32), cache=True,
       error_model="numpy")
def _adaptive_sample_row(smpl, logits, n, temp):
    """The chain temp(temp) -> adaptive on a row of logits, as native/adaptive.c
    al_adaptive_sample_row: the chain's token and record, without its candidate array."""
    s = _state_of(smpl)[0]
    if n == 1:
        _record_certain(s, 0)
        return 0
    # Typed as the sampler's own buffers are, so that _decide runs the same machine code
    # on it: fastmath lets each compilation sum in its own order.
    row = carray(_pointer(logits), n, np.float32)
    if n > s.cap:
        token = _argmax_of_quotients(row, temp)
        _record_fallback(s, token)
        return token
    x = row
    if temp != 1.0:
        x = carray(_pointer(s.x), n, np.float32)
        _scale_row(row, temp, x)
    chosen, _ = _decide(s, x, _max_of(x))
    s.token = carray(_pointer(s.cand), n, np.int64)[chosen]
    s.n_tokens += 1
    return s.token


@cfunc(types.int32(types.voidptr, types.int64), cache=True, error_model="numpy")
def _greedy_row(logits_p, n):
    """llama.cpp's greedy sampler on a row of logits: the first token with the highest."""
    row = carray(logits_p, n, np.float32)
    best = 0
    for i in range(1, n):
        if row[i] > row[best]:
            best = i
    return best


@cfunc(types.void(types.voidptr), cache=True, error_model="numpy")
def _adaptive_reset(smpl):
    s = _state_of(smpl)[0]
    s.rng = s.seed
    s.n_tokens = 0
    s.n_fallbacks = 0


@njit(cache=True, error_model="numpy")
def _keep_passing(cur_p, rows, x, m, w, threshold, inclusive):
    """Keep the tokens with w > threshold (>= when inclusive) at the front, a permutation;
    the most likely token alone where rounding let none pass (native/adaptive.c
    keep_passing)."""
    cur = carray(cur_p, 3, np.int64)
    n = cur[1]
    kept = 0
    for i in range(n):
        if w[i] > threshold or (inclusive and w[i] == threshold):
            for f in range(3):
                rows[i, f], rows[kept, f] = rows[kept, f], rows[i, f]
            kept += 1
    if kept == 0:  # the most likely token, as transformers does
        best = 0
        for i in range(n):
            if x[i] == m:
                best = i
                break
        for f in range(3):
            rows[best, f], rows[0, f] = rows[0, f], rows[best, f]
        kept = 1
    cur[1] = kept
    carray(cur_p, 32, np.uint8)[_SORTED_OFFSET] = 0


@njit(inline="always", error_model="numpy")
def _row_weights(smpl, cur_p, want_entropy):
    """The row's token rows, logits x, max m, weights w, S and sum w (x - m); n = 0 when
    there is nothing to cut (fewer than 2 tokens, or more than the buffers hold: the chain
    then samples from every token)."""
    s = _state_of(smpl)[0]
    n = carray(cur_p, 3, np.int64)[1]
    if n < 2 or n > s.cap:
        n = 0
    rows = carray(_pointer(carray(cur_p, 3, np.int64)[0]), (n, 3), np.int32)
    logits = carray(_pointer(carray(cur_p, 3, np.int64)[0]), (n, 3), np.float32)
    x = carray(_pointer(s.x), n, np.float32)
    w = carray(_pointer(s.w), n, np.float32)
    if n == 0:
        return rows, x, np.float32(0.0), w, 1.0, 0.0
    m = _gather(logits, x)
    S, wd = weights(x, m, w, want_entropy)
    return rows, x, m, w, S, wd


@cfunc(types.void(types.voidptr, types.voidptr), cache=True, error_model="numpy")
def _eta_apply(smpl, cur_p):
    """Keep p > min(eps, sqrt(eps) e^-H), as native/adaptive.c eta_apply."""
    rows, x, m, w, S, wd = _row_weights(smpl, cur_p, True)
    if x.shape[0] == 0:
        return
    eps = _state_of(smpl)[0].eps
    H = math.log(S) - wd / S
    cut = min(eps, math.sqrt(eps) * math.exp(-H))
    _keep_passing(cur_p, rows, x, m, w, np.float32(cut * S), False)


@njit(cache=True, fastmath=True, error_model="numpy")
def _sum_squares(w):
    q = 0.0
    for i in range(w.shape[0]):
        q += np.float64(w[i] * w[i])
    return q


@cfunc(types.void(types.voidptr, types.voidptr), cache=True, error_model="numpy")
def _pless_apply(smpl, cur_p):
    """Keep p_v >= sum_u p_u^2 (p-less, Tan et al., ICLR 2026), as native/adaptive.c
    pless_apply: w_v >= sum_u w_u^2 / S."""
    rows, x, m, w, S, _ = _row_weights(smpl, cur_p, True)  # S in float64, as C's is nearly
    if x.shape[0] == 0:
        return
    _keep_passing(cur_p, rows, x, m, w, np.float32(_sum_squares(w) / S), True)


@njit(inline="always", error_model="numpy")
def _before(wa, ia, wb, ib):
    """a before b: the larger weight, of equal weights the smaller position."""
    return wa > wb or (wa == wb and ia < ib)


@njit(cache=True, error_model="numpy")
def _sift_down(hw, hi, n, i):
    while True:
        left, right, last = 2 * i + 1, 2 * i + 2, i
        if left < n and _before(hw[last], hi[last], hw[left], hi[left]):
            last = left
        if right < n and _before(hw[last], hi[last], hw[right], hi[right]):
            last = right
        if last == i:
            return
        hw[i], hw[last] = hw[last], hw[i]
        hi[i], hi[last] = hi[last], hi[i]
        i = last


@njit(cache=True, error_model="numpy")
def _likeliest(w, want, hw, hi):
    """The ``want`` likeliest positions of w, in order, into hi (their weights in hw): a
    heap of the best so far (native/adaptive.c likeliest). Returns how many."""
    size = 0
    for i in range(w.shape[0]):
        v = np.float64(w[i])
        if size < want:
            hw[size], hi[size] = v, i
            size += 1
            if size == want:
                for j in range(want // 2 - 1, -1, -1):
                    _sift_down(hw, hi, want, j)
        elif _before(v, i, hw[0], hi[0]):
            hw[0], hi[0] = v, i
            _sift_down(hw, hi, want, 0)
    if size < want:
        for j in range(size // 2 - 1, -1, -1):
            _sift_down(hw, hi, size, j)
    for end in range(size, 1, -1):
        hw[0], hw[end - 1] = hw[end - 1], hw[0]
        hi[0], hi[end - 1] = hi[end - 1], hi[0]
        _sift_down(hw, hi, end - 1, 0)
    return size


@cfunc(types.void(types.voidptr, types.voidptr), cache=True, error_model="numpy")
def _toph_apply(smpl, cur_p):
    """Top-H (Potraghloo et al., 2025), as native/adaptive.c toph_apply: of the top_n
    likeliest, keep the longest prefix with E_k <= alpha E_N, E_k = -sum_{i<=k} p_i ln p_i."""
    rows, x, m, w, S, _ = _row_weights(smpl, cur_p, True)
    if x.shape[0] == 0:
        return
    s = _state_of(smpl)[0]
    n = x.shape[0]
    hw = carray(_pointer(s.exact), n, np.float64)
    hi = carray(_pointer(s.cand), n, np.int64)
    N = _likeliest(w, min(s.top_n, n), hw, hi)
    E = carray(_pointer(s.tail), n + 1, np.float64)
    e = 0.0
    for i in range(N):
        p = math.exp(np.float64(x[hi[i]]) - np.float64(m)) / S
        e += -p * math.log(p) if p > 0.0 else 0.0
        E[i] = e
    bound = s.eps * E[N - 1]
    k = 1
    while k < N and E[k] <= bound:
        k += 1
    _move_to_front(rows, hi, k, carray(_pointer(s.kept), (n, 3), np.int32),
                   carray(_pointer(s.flags), n, np.uint8))
    carray(cur_p, 3, np.int64)[1] = k
    carray(cur_p, 32, np.uint8)[_SORTED_OFFSET] = 0


# ---- creation, clone, free: rare, in Python ----

_NAME_HOOK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_CLONE_HOOK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_FREE_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_lock = threading.Lock()
_live: dict[int, tuple] = {}  # state address -> (state, buffers): alive until llama.cpp frees


def _ctx_of(smpl: int) -> int:
    return ctypes.c_void_p.from_address(smpl + ctypes.sizeof(ctypes.c_void_p)).value


def _page_aligned(shape, dtype) -> np.ndarray:
    """An empty array starting on a 4 KiB boundary. numpy's own placement put the weights
    16 bytes past the logits copy modulo 4 KiB: the pass with the statistics then made each
    load wait on a recent store to the same low address bits (4K aliasing), and a token at
    V 262,144 took 1.24 ms instead of 0.70."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(size + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + size].view(dtype).reshape(shape)


def _new_state(n_vocab: int, **fields) -> np.ndarray:
    state = np.zeros(1, STATE)
    buffers = {
        "x": _page_aligned(n_vocab, np.float32), "w": _page_aligned(n_vocab, np.float32),
        "cand": np.empty(n_vocab, np.int64), "exact": np.empty(n_vocab),
        "tail": np.empty(n_vocab + 1), "flags": np.empty(n_vocab, np.uint8),
        "kept": np.empty((n_vocab, 3), np.int32),
    }
    for name, array in buffers.items():
        state[0][name] = array.ctypes.data
    state[0]["cap"] = n_vocab
    state[0]["entropy"] = state[0]["conf"] = math.nan
    for name, value in fields.items():
        state[0][name] = value
    with _lock:
        _live[state.ctypes.data] = (state, buffers)
    return state


class _Kind:
    """One sampler kind: its interface table and hooks, alive as long as the module."""

    def __init__(self, name: bytes, apply, reset=None):
        self.label = ctypes.create_string_buffer(name)
        self.hooks = (_NAME_HOOK(lambda smpl: ctypes.addressof(self.label)),
                      _CLONE_HOOK(self._clone), _FREE_HOOK(_free))
        self.iface = SamplerIface(
            name=ctypes.cast(self.hooks[0], ctypes.c_void_p).value, apply=apply.address,
            reset=reset.address if reset else None,
            clone=ctypes.cast(self.hooks[1], ctypes.c_void_p).value,
            free=ctypes.cast(self.hooks[2], ctypes.c_void_p).value)

    def create(self, state: np.ndarray) -> int:
        import llama_cpp

        iface = ctypes.cast(ctypes.pointer(self.iface), ctypes.POINTER(llama_cpp.llama_sampler_i))
        sampler = llama_cpp.llama_sampler_init(iface, ctypes.c_void_p(state.ctypes.data))
        address = ctypes.cast(sampler, ctypes.c_void_p).value
        if not address:
            _forget(state.ctypes.data)
        return address or 0

    def _clone(self, smpl) -> int:
        with _lock:
            original = _live[_ctx_of(smpl)][0][0]
        fields = {name: original[name] for name in STATE.names
                  if name not in ("x", "w", "cand", "exact", "tail", "flags", "kept", "cap")}
        return self.create(_new_state(int(original["cap"]), **fields))


def _forget(address: int) -> None:
    with _lock:
        _live.pop(address, None)


def _free(smpl) -> None:
    _forget(_ctx_of(smpl))


_init_lock = threading.Lock()
_kinds: dict[str, _Kind] = {}


def _kind(name: str) -> _Kind:
    with _init_lock:
        if not _kinds:
            import llama_cpp

            if ctypes.sizeof(SamplerIface) != ctypes.sizeof(llama_cpp.llama_sampler_i):
                raise RuntimeError("llama_sampler_i's layout differs from the numba samplers'")
            _kinds["adaptive"] = _Kind(b"adaptive", _adaptive_apply, _adaptive_reset)
            _kinds["eta"] = _Kind(b"eta", _eta_apply)
            _kinds["p-less"] = _Kind(b"p-less", _pless_apply)
            _kinds["top-h"] = _Kind(b"top-h", _toph_apply)
        return _kinds[name]


def adaptive_sampler_new(eps: float, uniform: bool, seed: int, record: bool,
                         n_vocab: int) -> int:
    """A new adaptive sampler (address of its llama_sampler), 0 if llama.cpp refused."""
    state = _new_state(n_vocab, eps=eps, uniform=int(uniform), seed=seed, rng=seed,
                       record=int(record))
    return _kind("adaptive").create(state)


def adaptive_sampler_stats(smpl: int) -> native.Stats:
    """The record of the sampler's last token (a view that stays current)."""
    return native.Stats.from_address(_ctx_of(smpl))


def eta_sampler_new(eps: float, n_vocab: int) -> int:
    return _kind("eta").create(_new_state(n_vocab, eps=eps))


def pless_sampler_new(n_vocab: int) -> int:
    return _kind("p-less").create(_new_state(n_vocab))


def toph_sampler_new(alpha: float, top_n: int, n_vocab: int) -> int:
    """Top-H: its alpha is kept where the others keep epsilon."""
    return _kind("top-h").create(_new_state(n_vocab, eps=alpha, top_n=top_n))


# The row samplers as ctypes calls, which let go of the GIL as the C library's do.
adaptive_sample_row = ctypes.CFUNCTYPE(
    ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_float)(
    _adaptive_sample_row.address)
greedy_row = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t)(
    _greedy_row.address)

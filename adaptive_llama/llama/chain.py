"""The llama.cpp binding: sampler chains built from specs, with native adaptive and eta samplers.

The adaptive and eta samplers are real ``llama_sampler`` objects whose ``apply`` is machine
code: the C code in ``native/adaptive.c``, or, where that library is missing or
``ADAPTIVE_LLAMA_IMPL=numba`` asks, the numba cfuncs of :mod:`adaptive_llama.llama.numba_samplers`
(the implementation :data:`adaptive_llama.kernel.IMPL` names, chosen once). No Python runs per
token. A chain is ``[grammar] -> [penalties, dry, top-n-sigma] -> [temp] ->
truncation -> [xtc] -> final choice``, built from the spec's entries in the sampler table
(:mod:`adaptive_llama.samplers`); it holds exactly the samplers its spec names (llama-cpp-python's
default top_k 40 / top_p 0.95 / min_p 0.05 never run behind a spec that did not ask for them).
Temperature comes first for every sampler, as in the paper's (transformers) setting, so that
adaptive decoding sees the distribution it will sample from.

Two ways in:

- :class:`SamplerChain` for code that drives llama.cpp itself (the engine does);
- :func:`use_sampler` for a ``llama_cpp.Llama`` you already hold: its ``create_completion``,
  ``create_chat_completion`` and ``generate`` then sample with the spec.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math

from .abi import check_llama_cpp_version

LLAMA_CPP_VERSION = check_llama_cpp_version()  # before anything touches llama.cpp's structs

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402
from llama_cpp import _internals  # noqa: E402

from .. import kernel  # noqa: E402
from ..kernel import AdaptiveStats, native  # noqa: E402
from ..samplers import (  # noqa: E402
    DRY_SEQUENCE_BREAKERS,
    SEED,
    SamplerSpec,
    SpecError,
    in_graph_names,
    spec_of,
)
from . import graph  # noqa: E402

# llama.cpp's llama_token_data, one candidate token of a chain
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_FLOAT_P = ctypes.POINTER(ctypes.c_float)
# llama_get_logits_ith returning the row's address as an int (NULL: None), without the
# float pointer object llama-cpp-python's declaration builds on every call.
_logits_ith = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
    ctypes.cast(llama_cpp.llama_cpp._lib.llama_get_logits_ith, ctypes.c_void_p).value)
XTC_SEED_OFFSET = 0x9E3779B9


@functools.lru_cache(maxsize=4)
def _fresh_rows(n_vocab: int) -> np.ndarray:
    """Every token a candidate, its logit still to fill in: copied whole into a chain's rows."""
    rows = np.zeros(n_vocab, dtype=TOKEN_DATA)
    rows["id"] = np.arange(n_vocab, dtype=np.int32)
    rows.flags.writeable = False
    return rows


class NativeSamplersUnavailable(RuntimeError):
    """The C library with the adaptive and eta samplers is missing or does not fit."""


def native_samplers() -> ctypes.CDLL:
    """The C library, checked against this llama-cpp-python once; or NativeSamplersUnavailable."""
    lib, why = native.load()
    if lib is None:
        raise NativeSamplersUnavailable(
            f"the adaptive and eta samplers need the C library, but {why}; reinstall "
            "adaptive-llama on a machine with a C compiler (gcc or clang)"
        )
    if not getattr(native_samplers, "checked", False):
        _check_layouts(lib)
        init = ctypes.cast(llama_cpp.llama_cpp._lib.llama_sampler_init, ctypes.c_void_p).value
        lib.al_set_sampler_init(init)
        native_samplers.checked = True
    return lib


def _check_layouts(lib: ctypes.CDLL) -> None:
    """native/adaptive.c mirrors llama.h structs: refuse to run if llama-cpp-python's differ."""
    pairs = {
        "llama_token_data": (lib.al_sizeof_token_data(), ctypes.sizeof(llama_cpp.llama_token_data)),
        "llama_token_data_array": (lib.al_sizeof_token_data_array(),
                                   ctypes.sizeof(llama_cpp.llama_token_data_array)),
        "llama_sampler_i": (lib.al_sizeof_sampler_iface(), ctypes.sizeof(llama_cpp.llama_sampler_i)),
    }
    wrong = [f"{name} ({ours} vs {theirs} bytes)" for name, (ours, theirs) in pairs.items()
             if ours != theirs]
    if wrong:
        raise NativeSamplersUnavailable(
            "this llama-cpp-python's structs differ from the ones native/adaptive.c was "
            f"written for: {', '.join(wrong)}"
        )


class _CSamplers:
    """The samplers of native/adaptive.c."""

    name = "c"

    def __init__(self):
        self.lib = native_samplers()

    def adaptive(self, eps, uniform, seed, record, n_vocab) -> int:
        return self.lib.al_adaptive_sampler_new(eps, int(uniform), seed, int(record))

    def stats(self, address) -> native.Stats:
        return self.lib.al_adaptive_sampler_stats(address).contents

    def eta(self, eps, n_vocab) -> int:
        return self.lib.al_eta_sampler_new(eps)

    def p_less(self, n_vocab) -> int:
        return self.lib.al_pless_sampler_new()

    def top_h(self, alpha, top_n, n_vocab) -> int:
        return self.lib.al_toph_sampler_new(alpha, top_n)

    @property
    def adaptive_row(self):
        return self.lib.al_adaptive_sample_row

    @property
    def greedy_row(self):
        return self.lib.al_greedy_row


class _NumbaSamplers:
    """The samplers of numba_samplers (compiled, or read from numba's cache, on first use)."""

    name = "numba"

    def __init__(self):
        from . import numba_samplers

        self.adaptive = numba_samplers.adaptive_sampler_new
        self.stats = numba_samplers.adaptive_sampler_stats
        self.eta = numba_samplers.eta_sampler_new
        self.p_less = numba_samplers.pless_sampler_new
        self.top_h = numba_samplers.toph_sampler_new
        self.adaptive_row = numba_samplers.adaptive_sample_row
        self.greedy_row = numba_samplers.greedy_row


@functools.cache
def in_chain_samplers():
    """The adaptive, eta, p-less and top-H sampler makers of :data:`kernel.BACKEND`."""
    return _CSamplers() if kernel.BACKEND == "c" else _NumbaSamplers()


class SamplerChain:
    """A llama.cpp sampler chain for one spec and seed; owns its samplers.

    The chain is ``[grammar] -> [logit bias] -> [modifiers before] -> [temp] -> the spec's
    sampler -> [modifiers after] -> [dist]``, built from the spec's entries in
    :data:`adaptive_llama.samplers.SAMPLERS`; ``dist`` (seeded) follows unless the sampler
    chooses the token itself and nothing comes after it. Penalties and DRY see the tokens
    of the reply (and, through :meth:`remember`, of the prompt).

    Args:
        spec: a :class:`SamplerSpec` (or spec text, parsed here once).
        seed: the random seed, 0 to 2**32 - 1; the same seed and prompt give the same tokens.
        n_vocab: the model's vocabulary size (mirostat v1 needs it).
        grammar: an optional ``llama_cpp.LlamaGrammar`` applied before everything else.
        logit_bias: (token, bias) pairs added to the logits before the samplers (OpenAI's
            ``logit_bias``).
        vocab_model: the model the grammar or DRY tokenizes for (a
            ``llama_cpp._internals.LlamaModel``: ``Llama._model``, or the engine's), needed
            with a grammar or DRY.
        record_stats: let the adaptive sampler compute entropy and Conf for every token
            (one extra multiply-add per vocabulary entry); k, kept mass and the chosen
            token's probability are always recorded.
        in_graph: build the chain for llama.cpp's backend sampling (attach it to a sequence
            with ``llama_set_sampler``): the adaptive sampler then runs as ggml operations
            (:mod:`adaptive_llama.llama.graph`) with llama.cpp's ``dist`` after it. Only samplers
            with a graph path (``in_graph`` in the table) and no grammar are allowed.
    """

    def __init__(self, spec: SamplerSpec | str, seed: int, n_vocab: int, grammar=None,
                 vocab_model=None, record_stats: bool = False, in_graph: bool = False,
                 logit_bias: tuple[tuple[int, float], ...] = ()):
        self.spec = spec_of(spec)
        self.seed = SEED.validate(seed)
        if in_graph:
            check_in_graph(self.spec, grammar, logit_bias)
        self.in_graph = in_graph
        self._n_vocab = n_vocab
        self._record_stats = record_stats
        self._chain = _internals.LlamaSampler()
        self._adaptive = None
        self._closed_stats: AdaptiveStats | None = None  # last_stats once the chain is freed
        self._graph_stats: AdaptiveStats | None = None
        self._candidates: np.ndarray | None = None  # sample_from's llama_token_data rows
        self._vocab_model = vocab_model
        self._lookback: list[tuple[int, int]] = []  # (sampler, tokens): penalties, DRY
        self._last_token = -1
        if grammar is not None:
            self._add_grammar(vocab_model, grammar)
        if logit_bias:
            self._add_logit_bias(logit_bias)
        for modifier in (*self.spec.stage("before"), *self.spec.stage("cut")):
            modifier.sampler.add(self, modifier.params)
        sampler = self.spec.sampler
        # In the graph the adaptive sampler's softmax takes the temperature as its scale:
        # one operation per sequence fewer than llama.cpp's temp before it.
        folded = in_graph and sampler.name == "adaptive"
        if sampler.takes_temp and self.spec.temp != 1.0 and not folded:
            self._chain.add_temp(self.spec.temp)
        sampler.add(self, self.spec.params)
        after = self.spec.stage("after")
        for modifier in after:
            modifier.sampler.add(self, modifier.params)
        # After xtc, dist chooses among what xtc left, even behind a sampler that chose.
        self._chosen_later = bool(after) and sampler.chooses_token
        if not sampler.chooses_token or after:
            self._chain.add_dist(self.seed)
        self._on_row = None if logit_bias else self._row_sampler(grammar)

    def _row_sampler(self, grammar):
        """The chain's choice straight from a row of logits (its address), or None.

        A chain that is only temperature -> adaptive (the default) or greedy needs none of
        the vocabulary-sized candidate array that ``llama_sampler_sample`` fills before any
        sampler runs: the backend's row sampler chooses the token the chain would, from the
        same random stream and with the same record, in fewer passes over the row. Any
        other sampler, a modifier or a grammar: the chain itself."""
        if self.in_graph or grammar is not None or self.spec.modifiers:
            return None
        n, name = self._n_vocab, self.spec.sampler.name
        if name == "adaptive":
            row, adaptive = in_chain_samplers().adaptive_row, self._adaptive
            temp = ctypes.c_float(self.spec.temp)
            return lambda logits: row(adaptive, logits, n, temp)
        if name == "greedy":
            row = in_chain_samplers().greedy_row
            return lambda logits: row(logits, n)
        return None

    def _add_logit_bias(self, biases: tuple[tuple[int, float], ...]) -> None:
        """llama.cpp's logit-bias sampler: ``bias`` added to each token's logit, before
        every other sampler but the grammar."""
        self._chain.add_logit_bias(self._n_vocab, dict(biases))  # llama.cpp copies them

    def _add_grammar(self, vocab_model, grammar) -> None:
        # llama-cpp-python's add_grammar would put a NULL sampler in the chain for a grammar
        # that llama.cpp cannot parse (a crash at the first token).
        sampler = llama_cpp.llama_sampler_init_grammar(
            vocab_model.vocab, grammar._grammar.encode("utf-8"), grammar._root.encode("utf-8"))
        if not sampler:
            self._chain.close()
            raise SpecError("llama.cpp cannot parse the grammar (its log, with --verbose, "
                            "says where)")
        llama_cpp.llama_sampler_chain_add(self._chain.sampler, sampler)

    # ---- ChainBuilder: what the sampler table's entries add ----

    def greedy(self) -> None:
        self._chain.add_greedy()

    def top_k(self, k: int) -> None:
        self._chain.add_top_k(k)

    def top_p(self, p: float) -> None:
        self._chain.add_top_p(p, 1)

    def typical(self, p: float) -> None:
        self._chain.add_typical(p, 1)

    def min_p(self, p: float) -> None:
        self._chain.add_min_p(p, 1)

    def mirostat_v1(self, tau: float, eta: float, m: int) -> None:
        self._chain.add_mirostat(self._n_vocab, self.seed, tau, eta, m)

    def mirostat_v2(self, tau: float, eta: float) -> None:
        self._chain.add_mirostat_v2(self.seed, tau, eta)

    def eta(self, epsilon: float) -> None:
        self._add_native(in_chain_samplers().eta(epsilon, self._n_vocab))

    def p_less(self) -> None:
        self._add_native(in_chain_samplers().p_less(self._n_vocab))

    def top_h(self, alpha: float, top_n: int) -> None:
        self._add_native(in_chain_samplers().top_h(alpha, top_n, self._n_vocab))

    def adaptive(self, epsilon: float, uniform: bool) -> None:
        samplers = in_chain_samplers()
        self._adaptive = self._add_native(samplers.adaptive(
            epsilon, uniform, self.seed, self._record_stats, self._n_vocab))
        self._stats = samplers.stats(self._adaptive)
        self._uniform = uniform
        if self.in_graph:  # in the graph it only cuts: llama.cpp's dist chooses
            graph.enable(self._adaptive, epsilon, uniform, self.spec.temp)
            self._chain.add_dist(self.seed)

    def adaptive_p(self, target: float, decay: float) -> None:
        sampler = llama_cpp.llama_sampler_init_adaptive_p(target, decay, self.seed)
        llama_cpp.llama_sampler_chain_add(self._chain.sampler, sampler)

    def penalties(self, last_n: int, repeat: float, freq: float, present: float) -> None:
        self._add_looking_back(llama_cpp.llama_sampler_init_penalties(
            self._n_vocab, last_n, repeat, freq, present), last_n)

    def dry(self, multiplier: float, base: float, allowed_length: int, last_n: int) -> None:
        if self._vocab_model is None:
            raise SpecError("dry needs the model's vocabulary: pass vocab_model")
        breakers = (ctypes.c_char_p * len(DRY_SEQUENCE_BREAKERS))(
            *(b.encode() for b in DRY_SEQUENCE_BREAKERS))
        self._add_looking_back(llama_cpp.llama_sampler_init_dry(
            self._vocab_model.vocab, multiplier, base, allowed_length, last_n, breakers,
            len(DRY_SEQUENCE_BREAKERS)), last_n)

    def top_n_sigma(self, n: float) -> None:
        self._chain.add_top_n_sigma(n)

    def xtc(self, probability: float, threshold: float) -> None:
        # Its own stream: with dist's seed it would draw dist's numbers, and a low draw that
        # lets xtc act would then also pick the top of what is left.
        self._chain.add_xtc(probability, threshold, 1, (self.seed + XTC_SEED_OFFSET) % 2**32)

    def _add_looking_back(self, sampler, last_n: int) -> None:
        llama_cpp.llama_sampler_chain_add(self._chain.sampler, sampler)
        self._lookback.append((sampler, last_n))

    def remember(self, tokens) -> None:
        """Let the samplers that look back on past tokens (penalties, DRY) see ``tokens``,
        the prompt's, as llama-server does: a reply is penalised for repeating its prompt
        too. The grammar and the other samplers do not see them."""
        for sampler, last_n in self._lookback:
            for token in tokens[-last_n:]:
                llama_cpp.llama_sampler_accept(sampler, token)

    @property
    def from_row(self) -> bool:
        """Whether the chain chooses straight from the logits row (temperature -> adaptive,
        or greedy), without llama.cpp's candidate array: the same tokens either way."""
        return self._on_row is not None

    @property
    def backend(self) -> str:
        """Which implementation runs the adaptive and eta samplers: "c" or "numba" on the
        CPU, "graph" inside llama.cpp's graph."""
        return "graph" if self.in_graph else in_chain_samplers().name

    def _add_native(self, address: int | None) -> int:
        """Hand a sampler made by a backend to the chain, which frees it with itself."""
        if not address:
            raise MemoryError("llama.cpp could not create the sampler")
        pointer = ctypes.cast(address, llama_cpp.llama_sampler_p_ctypes)
        llama_cpp.llama_sampler_chain_add(self._chain.sampler, pointer)
        return address

    def attach(self, ctx, seq_id: int) -> None:
        """Put this chain (built ``in_graph``) in the graph of ``ctx`` for one sequence, or
        SpecError when the device cannot run all of it there. llama.cpp would quietly run a
        refused sampler and everything after it on the CPU (and accepts the chain anyway),
        which would change what this chain means: ``dist`` after a CPU adaptive sampler."""
        graph.refusals.clear()
        llama_cpp.llama_set_sampler(ctx, seq_id, self.pointer)
        # llama.cpp names its samplers that the device cannot run "-name" once attached.
        refused = graph.refusals + [f"the device cannot run llama.cpp's {n[1:]} sampler"
                                    for n in self.names() if n.startswith("-")]
        if refused:
            llama_cpp.llama_set_sampler(ctx, seq_id, None)
            raise SpecError(f"backend sampling: {'; '.join(refused)}")

    @staticmethod
    def detach(ctx, seq_id: int) -> None:
        """Take whatever chain a sequence has out of the graph (before that chain is freed)."""
        llama_cpp.llama_set_sampler(ctx, seq_id, None)

    @property
    def pointer(self):
        """The ``llama_sampler *`` of the chain, for llama.cpp calls."""
        return self._chain.sampler

    def names(self) -> list[str]:
        """The samplers in the chain, in order, as llama.cpp names them."""
        n = llama_cpp.llama_sampler_chain_n(self.pointer)
        return [llama_cpp.llama_sampler_name(llama_cpp.llama_sampler_chain_get(self.pointer, i))
                .decode() for i in range(n)]

    def sample(self, ctx, idx: int = -1) -> int:
        """Sample the next token from the logits of ``ctx`` (a ``llama_context *``); in the
        graph: take the token the graph chose, and read the adaptive sampler's figures."""
        if self._on_row is not None:
            logits = _logits_ith(ctx, idx)
            if not logits:
                raise RuntimeError(f"llama.cpp has no logits at batch index {idx}")
            return self._accept(self._on_row(logits))
        token = self._last_token = llama_cpp.llama_sampler_sample(self.pointer, ctx, idx)
        if self.in_graph and self._adaptive is not None:
            k, kept_mass, p_chosen = graph.read_back(ctx, idx, token, self._uniform)
            graph.checked(self._adaptive, k)
            self._graph_stats = AdaptiveStats(k=k, token=token, kept_mass=kept_mass,
                                           entropy=math.nan, conf=math.nan, p_chosen=p_chosen)
        return token

    def sample_from(self, logits: int) -> int:
        """:meth:`sample` from a row of logits the caller fetched from the context (its
        address), by llama_sampler_sample's own steps: every token a candidate, the chain
        applied, its choice accepted. Nothing here calls into the context, so the chains of
        several sequences can run at once in threads: ctypes lets go of the GIL around each
        llama.cpp call, and every sampler in a chain is machine code. Not for chains in the
        graph, which read what the graph chose from the context."""
        if self._on_row is not None:
            return self._accept(self._on_row(logits))
        n = self._n_vocab
        if self._candidates is None:
            self._candidates = np.empty(n, dtype=TOKEN_DATA)
        cur = self._candidates
        cur[:] = _fresh_rows(n)  # the chain reorders and cuts the rows: refill each time
        cur["logit"] = np.ctypeslib.as_array(ctypes.cast(logits, _FLOAT_P), shape=(n,))
        rows = llama_cpp.llama_token_data_array(
            data=cur.ctypes.data_as(llama_cpp.llama_token_data_p), size=n, selected=-1,
            sorted=False)
        llama_cpp.llama_sampler_apply(self.pointer, ctypes.byref(rows))
        if not 0 <= rows.selected < rows.size:
            raise RuntimeError(f"the sampler chain {self.names()} chose no token")
        # xtc drops the top rows by moving the array's start: selected counts from there.
        first = (ctypes.addressof(rows.data.contents) - cur.ctypes.data) // TOKEN_DATA.itemsize
        return self._accept(int(cur["id"][first + rows.selected]))

    def _accept(self, token: int) -> int:
        """The chosen token into the chain's state, as llama_sampler_sample ends."""
        self._last_token = token
        llama_cpp.llama_sampler_accept(self.pointer, token)
        return token

    def last_stats(self) -> AdaptiveStats | None:
        """The adaptive sampler's record of its last token (None for other samplers); in the
        graph entropy and Conf are NaN, and so are the masses in uniform mode. Still readable
        after :meth:`close`."""
        if self._adaptive is None:
            return self._closed_stats
        if self.in_graph:
            return self._graph_stats
        s = self._stats
        if self._chosen_later:  # the chain's dist chose after xtc, not the adaptive sampler
            return AdaptiveStats(k=s.k, token=self._last_token, kept_mass=s.kept_mass,
                                 entropy=s.entropy, conf=s.conf, p_chosen=math.nan)
        return AdaptiveStats(k=s.k, token=s.token, kept_mass=s.kept_mass, entropy=s.entropy,
                          conf=s.conf, p_chosen=s.p_chosen)

    @property
    def records_stats(self) -> bool:
        """Whether the chain's adaptive sampler records each token (:meth:`last_stats`)."""
        return self._adaptive is not None

    @property
    def fallbacks(self) -> int:
        """Tokens the adaptive sampler chose by arg-max because memory ran out (0 normally)."""
        return 0 if self._adaptive is None else self._stats.n_fallbacks

    def reset(self) -> None:
        llama_cpp.llama_sampler_reset(self.pointer)

    def close(self) -> None:
        self._closed_stats = self.last_stats()  # its record is freed with the sampler
        self._chain.close()
        if self.in_graph and self._adaptive is not None:
            graph.forget(self._adaptive)
        self._adaptive = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_in_graph(spec: SamplerSpec, grammar, logit_bias=()) -> None:
    """SpecError unless the spec (with its grammar and logit bias) can run inside
    llama.cpp's graph."""
    refused = [s.name for s in (spec, *spec.modifiers) if not s.sampler.in_graph]
    if refused:
        raise SpecError(f"`{'`, `'.join(refused)}` cannot run inside llama.cpp's graph "
                        f"(backend sampling): use {in_graph_names()}, or turn backend "
                        "sampling off")
    if grammar is not None:
        raise SpecError("a grammar cannot run inside llama.cpp's graph (backend sampling): "
                        "turn backend sampling off to use one")
    if logit_bias:
        raise SpecError("a logit bias cannot run inside llama.cpp's graph (backend "
                        "sampling): turn backend sampling off to use one")


class _LlamaSamplerShim:
    """What ``llama_cpp.Llama.generate`` expects of ``self._sampler``, over a SamplerChain."""

    def __init__(self, chain: SamplerChain):
        self.chain = chain

    def sample(self, ctx, idx: int = -1) -> int:
        return self.chain.sample(ctx.ctx, idx)

    def reset(self) -> None:
        self.chain.reset()

    def close(self) -> None:
        self.chain.close()


@contextlib.contextmanager
def use_sampler(llama: "llama_cpp.Llama", spec: SamplerSpec | str, seed: int | None = None,
                record_stats: bool = False):
    """Make a ``llama_cpp.Llama`` you hold sample with ``spec`` inside the ``with`` block.

    ``create_completion``, ``create_chat_completion`` and ``generate`` then build their chain
    from the spec (plus the call's ``grammar``, if any), ignoring the call's top_k / top_p /
    min_p / temperature / mirostat arguments. Yields a list that receives each generation's
    :class:`SamplerChain`, so the adaptive sampler's :meth:`SamplerChain.last_stats` can be read.

    >>> with use_sampler(llm, "adaptive:eps=0.0005", seed=1) as chains:
    ...     out = llm.create_completion("Once upon a time", max_tokens=32)
    """
    parsed = spec_of(spec)
    chains: list[SamplerChain] = []
    base_seed = llama._seed if seed is None else seed

    def init_sampler(*, grammar=None, logits_processor=None, **_ignored):
        if logits_processor is not None:
            raise ValueError("use_sampler does not run logits_processor callbacks")
        chain = SamplerChain(parsed, base_seed, llama.n_vocab(), grammar=grammar,
                             vocab_model=llama._model, record_stats=record_stats)
        chains.append(chain)
        return _LlamaSamplerShim(chain)

    llama._init_sampler = init_sampler  # instance attribute shadows Llama._init_sampler
    try:
        yield chains
    finally:
        del llama._init_sampler
        llama._sampler = None
        for chain in chains:
            chain.close()

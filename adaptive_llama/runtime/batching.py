"""Batched decoding: many sequences in one llama.cpp context, continuous batching.

The context has ``n_slots`` sequences (llama.cpp's ``n_seq_max``, each with its own
``n_ctx_seq`` KV cells). A :class:`Generation` takes a free slot; every :meth:`Decoder.step`
evaluates prompt chunks of newly joined sequences, then decodes one token of every
generating sequence in one batch, and samples each sequence that got logits with its own
chain (costly chains side by side, in threads). Sequences join and finish independently; a
finished one leaves its KV cells in its slot, so the next prompt that shares a prefix with
them re-evaluates only the rest (from its last whole chunk). A prompt that shares a longer
prefix with another slot (a sibling sample of the same prompt, a common system prompt)
copies that slot's cache instead of evaluating the prefix again; a prompt whose shared
prefix a sibling is still evaluating waits for it.

**Same tokens, same logits.** llama.cpp computes a row with other kernels depending on its
batch (one row or many; on the CPU its flash attention also by batch size and thread count),
and the rounding differs. So that a reply is a function of the
conversation's tokens, the sampler and the seed alone, whatever the cache holds, every
prompt is evaluated the one canonical way: in chunks aligned to multiples of ``CHUNK``
positions, each chunk decoded alone, and the logits of its last token sampled. A cache is
reused only for whole chunks evaluated that way (``Slot.canonical``), never for the tokens a
reply generated one at a time: the next turn evaluates them again as prompt. On the CPU every
row that is not part of a whole chunk goes through flash attention's reference kernel
(``attention_switch``; the engine's default), which computes it the same way in any batch, so
that a sequence's drafted tokens are verified in one batch without changing a row
(:mod:`adaptive_llama.runtime.speculation`); with ``reference_attention=False`` flash attention
is off. The generating rows of several sequences share a batch; on the CPU that changes no
row either way (tests).
"""

from __future__ import annotations

import bisect
import codecs
import contextlib
import ctypes
import math
import statistics
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Iterator

import llama_cpp
import numpy as np

from ..kernel.native import set_pass_threads
from ..llama.chain import SamplerChain
from .prefix import shared_prefix
from .reasoning import ANSWER, THINKING, ThinkingSplitter, Thought
from .request import Request
from .speculation import DraftRound, Speculation
from .threads import ThreadTuner
from .vocab import Vocab

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
# A step's chains run in threads once one chain takes this long: below it, handing them to
# threads and the cores' contention with llama.cpp's spinning workers cost more than they
# save. benchmarks/bench_batch.py (sampling, 8 sequences, 2 cores, Gemma-3's 262,144 tokens):
# always in threads, adaptive and min-p (about 1 ms a chain) ran 0.83x and 0.78x as fast,
# typical and mirostat (about 30 ms) 1.25x and 1.32x; with this threshold 0.96x, 0.94x (the
# same code as one thread: noise), 1.31x and 1.33x, top-p 1.09x.
PARALLEL_FROM_S = 0.005
MEASURE_EVERY = 16  # every 16th step of threaded chains runs them one after another
# A prompt copies another slot's cache when that saves evaluating at least this many tokens.
# The copy moves the whole slot (llama.cpp copies a sequence's cache between slots only in
# full), which costs about as much as evaluating one or two tokens: benchmarks/bench_batch.py
# --sections sharing measures both.
SHARE_FROM = 16
# Prompts are evaluated in chunks aligned to multiples of this many positions (see the module
# docstring). Smaller chunks would let a chat turn keep more of its cache; each chunk is a
# llama_decode of its own (benchmarks/bench_determinism.py measures the cost).
CHUNK = 64


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability in the distribution the model gave (before
    temperature and truncation), and the most likely tokens there: (id, bytes, logprob)."""

    token: int
    text: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()
    phase: str | None = None  # a reasoning reply's: "thinking" or "answer"; else None


@dataclass
class GenerationResult:
    """What one generation produced and what it cost."""

    text: str
    finish_reason: str            # "stop" (end of turn), "length", "stop_string", "interrupted"
    prompt_tokens: int
    completion_tokens: int
    sampler: str
    seed: int
    backend: str = ""             # what runs the adaptive and eta samplers: "c" or "numba"
    tokens: list[int] = field(default_factory=list)
    # AdaptiveStats per token when an adaptive chain chose any (None for a token it did not
    # choose: another phase's sampler, a budget's forced token), else empty
    token_stats: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)      # TokenLogprob, when asked for
    prompt_eval_s: float = 0.0
    prompt_evaluated: int = 0     # of the prompt's tokens, those not taken from a cache
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0
    thinks: bool = False          # a reasoning model's reply, its thinking split off:
    reasoning: str = ""           # the thinking, apart from ``text``
    reasoning_sampler: str = ""   # the thinking's own sampler, if it has one
    reasoning_tokens: int = 0     # the tokens of the thinking (its tags included)
    stop_string: str = ""         # the stop string that ended it ("stop_string")
    drafter: str = ""             # speculation: "ngram" or the draft model's file, else ""
    draft_tokens: int = 0         # drafted tokens the sampler checked (not those after the end)
    draft_accepted: int = 0       # of them, those it chose too

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (prompt evaluation excluded)."""
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def drafts_kept(self) -> str | None:
        """Speculation's figure for a footer or a log line, as ``drafts kept 23/25 (92%)``;
        None without a drafter."""
        if not self.drafter:
            return None
        share = f" ({self.draft_accepted / self.draft_tokens:.0%})" if self.draft_tokens else ""
        return f"drafts kept {self.draft_accepted}/{self.draft_tokens}{share}"

    @property
    def adaptive_stats(self) -> list:
        """The AdaptiveStats of the tokens the adaptive sampler chose."""
        return [s for s in self.token_stats if s is not None]

    @property
    def mean_k(self) -> float | None:
        stats = self.adaptive_stats
        return statistics.fmean(s.k for s in stats) if stats else None

    def summary(self) -> dict:
        """The figures of the reply, for the REPL's /stats, the server's ``sampler_stats``
        and ``generate --json``: the prompt (its tokens, those not taken from a cache, the
        seconds until its evaluation ended), speed, finish, and for adaptive the spread of k
        and Conf."""
        out = {"sampler": self.sampler, "seed": self.seed, "backend": self.backend,
               "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
               "prompt_evaluated": self.prompt_evaluated,
               "prompt_eval_s": round(self.prompt_eval_s, 4),
               "completion_tokens": self.completion_tokens,
               "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
               "time_to_first_token_s": round(self.time_to_first_token_s, 4)}
        if stats := self.adaptive_stats:
            ks = sorted(s.k for s in stats)
            confs = [s.conf for s in stats if not math.isnan(s.conf)]
            out.update(mean_k=round(statistics.fmean(ks), 3),
                       stdev_k=round(statistics.pstdev(ks), 3),
                       median_k=statistics.median_low(ks), max_k=ks[-1],
                       mean_conf=round(statistics.fmean(confs), 4) if confs else None)
        if self.reasoning_sampler:
            out["reasoning_sampler"] = self.reasoning_sampler
        if self.thinks:
            out["reasoning_tokens"] = self.reasoning_tokens
        if self.drafter:
            out.update(drafter=self.drafter, draft_tokens=self.draft_tokens,
                       draft_accepted=self.draft_accepted,
                       draft_acceptance=round(self.draft_accepted / self.draft_tokens, 3)
                       if self.draft_tokens else None)
        return out

    def as_dict(self) -> dict:
        thinking = ({"reasoning": self.reasoning, "reasoning_tokens": self.reasoning_tokens}
                    if self.thinks else {})
        return {"text": self.text, **thinking, **self.summary()}


def _mark_phases(logprobs: list[TokenLogprob], thinking: int) -> None:
    """Say the phase of the token just taken: the last ``thinking`` tokens were the
    thinking's (more than one when a mark of several tokens opened it), else the answer's."""
    if not thinking:
        logprobs[-1] = replace(logprobs[-1], phase="answer")
    for i in range(len(logprobs) - thinking, len(logprobs)):
        logprobs[i] = replace(logprobs[i], phase="thinking")


class Generation:
    """One sequence being generated: its request, its chain, and the result it fills.

    Text appears in ``pieces`` as it is made (take it with :meth:`take`), a reasoning model's
    thinking as :class:`~.reasoning.Thought` pieces when the request splits it off;
    ``done`` once it has finished, whatever the reason. The generation owns its chains and
    closes them.

    A reasoning model's reply has two chains: ``thinking_chain`` chooses the tokens of the
    thinking (the request's reasoning sampler, without its grammar) and ``answer_chain``
    the rest; :attr:`chain` is the one choosing now, switched at the token that closes the
    thinking. Each chain sees every token of the reply (penalties and DRY look back on the
    whole of it), the grammar only the answer's. ``forced`` tokens are taken in place of
    the next choices: a spent thinking budget closes the thinking this way.
    """

    def __init__(self, request: Request, chain: SamplerChain,
                 thinking_chain: SamplerChain | None = None):
        self.request = request
        self.prompt_tokens = list(request.prompt_tokens)
        self.answer_chain = chain
        self.thinking_chain = thinking_chain
        self.forced: list[int] = []
        self.forced_now = False  # whether the token being taken was forced
        self.thought_tokens = 0  # tokens inside the thinking, its tags not counted
        self.undecided_tokens = 0  # tokens before the reply showed whether it thinks
        self.result = GenerationResult(
            text="", finish_reason="interrupted", prompt_tokens=len(self.prompt_tokens),
            completion_tokens=0, sampler=str(chain.spec), seed=chain.seed, backend=chain.backend,
            reasoning_sampler=str(request.thinking_spec or ""))
        self.pieces: list[str] = []
        self.done = False
        self.slot: Slot | None = None
        self.todo: list[int] = []          # prompt tokens not evaluated yet
        self.next_token: int | None = None  # sampled, to be decoded in the next step
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""                     # text that could still begin a stop string
        # whether each token gets a place in token_stats (an adaptive chain chooses some)
        self.records_stats = any(chain.records_stats for chain in self.chains)
        self.splitter = ThinkingSplitter(request.thinking) if request.thinking else None
        self.result.thinks = self.splitter is not None
        if self.splitter is not None and self.splitter.thinking:
            self._check_budget()  # a budget of 0 closes a thinking the prompt opened
        self._submitted = time.perf_counter()
        self._decode_start: float | None = None

    @property
    def chain(self) -> SamplerChain:
        """The chain that chooses the next token."""
        if self.thinking_chain is not None and self.splitter.phase != ANSWER:
            return self.thinking_chain
        return self.answer_chain

    @property
    def chains(self) -> list[SamplerChain]:
        return [c for c in (self.thinking_chain, self.answer_chain) if c is not None]

    def seen(self, token: int, chosen_by: SamplerChain | None) -> None:
        """Let the chains that did not choose ``token`` look back on it too."""
        for chain in self.chains:
            if chain is not chosen_by:
                chain.remember((token,))

    def _check_budget(self) -> None:
        """Close the thinking once its budget is spent, between whole characters."""
        budget = self.request.thinking_budget
        if (budget is not None and not self.forced and self.splitter.thinking
                and self.thought_tokens >= budget and not self._utf8.getstate()[0]):
            self.forced = list(self.request.closing_tokens)

    def take(self) -> list[str]:
        """The text pieces made since the last call."""
        pieces, self.pieces = self.pieces, []
        return pieces


@dataclass
class Slot:
    """One sequence of the context: what its KV cells hold, and who uses it."""

    index: int
    tokens: list[int] = field(default_factory=list)
    generation: Generation | None = None
    # The first `canonical` tokens' cells were evaluated as whole aligned chunks (a multiple
    # of CHUNK): only they may be reused by another prompt.
    canonical: int = 0
    # When a generation last joined (Decoder.add's count): among slots that keep as much of a
    # prompt, the least recently used is overwritten, so that a cache that may be asked for
    # again (the chat being read, the next request with a system prompt) lasts longest.
    joined: int = 0

    def reusable(self, prompt: list[int]) -> int:
        """How many of ``prompt``'s first tokens this slot's cache can keep."""
        return _keepable(min(shared_prefix(self.tokens, prompt), self.canonical), prompt)


class Decoder:
    """Runs generations in the slots of one llama.cpp context ``ctx`` (a ``llama_context
    *``; see the module docstring); ``vocab`` turns their tokens into text. Not thread-safe:
    one thread adds, steps and cancels.

    ``speculation`` drafts tokens for the generating sequences (None: no drafts);
    ``attention_switch`` is the reference flash attention of the context's CPU backends (a
    cpu_attention.Switch; None without it): on for every row a reply's tokens depend on,
    whose logits must be the same alone or in a batch of drafts; off for whole prompt
    chunks, which are always evaluated alone and the same way, where the tiled kernel is
    faster. ``watchdog`` is entered around each step (RPC workers: a Watchdog).
    ``step_rows`` bounds a step's batch, drafts included (more sequences: several batches);
    with RPC workers, fewer than CHUNK: a worker tells a whole prompt chunk by its rows
    (cpu_attention.worker_attention), so no other batch may have as many.
    """

    def __init__(self, ctx, vocab: Vocab, n_slots: int, n_ctx_seq: int, n_batch: int,
                 tuner: ThreadTuner, *, speculation: Speculation | None = None,
                 attention_switch=None, watchdog=None, step_rows: int | None = None,
                 passes_on_threads: bool = False):
        self._vocab = vocab
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.n_ctx_seq = n_ctx_seq
        self.n_batch = n_batch
        self.slots = [Slot(i) for i in range(n_slots)]
        self.live: list[Generation] = []
        self.tuner = tuner
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        # A step's chains side by side on the cores that decode (idle while the chains run),
        # when one chain takes long enough to pay for it (see _choose).
        self._samplers = ThreadPoolExecutor(max_workers=tuner.max_threads,
                                            thread_name_prefix="adaptive-llama-sample")
        self.parallel_from_s = PARALLEL_FROM_S
        self.share_from = SHARE_FROM
        self._chain_s = 0.0  # one chain's CPU time to choose a token, at the last measure
        # The C kernel's passes over every token on llama.cpp's threads while chains run one
        # after another: for a model whose layers are elsewhere (a GPU, workers), where the
        # host's time is a large share of a token. On a CPU it would save under 1% of a
        # decode, and on a loaded machine a pool thread without a core stalls the pass.
        self.passes_on_threads = passes_on_threads
        self._steps = 0
        self._joins = 0
        self.speculation = speculation
        self.attention_switch = attention_switch
        self.watchdog = watchdog or contextlib.nullcontext()
        self.step_rows = step_rows or n_batch

    def close(self) -> None:
        for generation in list(self.live):
            self.cancel(generation)
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self._samplers.shutdown()

    @property
    def free_slots(self) -> int:
        return sum(slot.generation is None for slot in self.slots)

    # ---- joining ----

    def add(self, generation: Generation) -> None:
        """Give the generation the free slot whose cache shares most with its prompt (the
        least recently used among equals)."""
        prompt = generation.prompt_tokens
        free = [slot for slot in self.slots if slot.generation is None]
        if not free:
            raise RuntimeError("every slot is busy")
        slot = max(free, key=lambda s: (s.reusable(prompt), -s.joined, -s.index))
        self._joins += 1
        slot.joined = self._joins
        if generation.chain.in_graph:  # one chain: no reasoning sampler in the graph
            generation.chain.attach(self._ctx, slot.index)
        generation.todo = self._reuse(slot, prompt)
        generation.result.prompt_evaluated = len(generation.todo)
        generation.slot, slot.generation = slot, generation
        if self.speculation is not None:
            self.speculation.start(slot.index, prompt)
            generation.result.drafter = self.speculation.name
        # live stays in slot order: step() lists the batch in this order
        bisect.insort(self.live, generation, key=lambda g: g.slot.index)

    def evaluate(self, tokens: list[int], generated: int = 0) -> None:
        """Evaluate tokens in the first slot, outside any generation (its cache is reused for
        a shared prefix); the logits of the last one stay in the context. The last
        ``generated`` tokens are decoded one at a time, as a generation decodes the tokens it
        made, so that the logits are those that generation saw."""
        split = len(tokens) - generated
        for _ in self.replay(tokens[:split], tokens[split:]):
            pass

    def replay(self, prompt: list[int], made: list[int]) -> Iterator[int]:
        """Evaluate ``prompt`` in the first slot as :meth:`evaluate` does, then decode
        ``made`` a token at a time; each token of ``made`` is yielded while the context holds
        the logits it follows, the row a generation sampled it from."""
        slot = self.slots[0]
        rest = self._reuse(slot, prompt)
        try:
            while rest:
                chunk = rest[:self._chunk_length(slot, len(rest))]
                self._evaluate_chunk(slot, chunk, last=len(chunk) == len(rest))
                del rest[:len(chunk)]
            for token in made:  # one row each, never canonical
                yield token
                self._evaluate_chunk(slot, [token], last=True)
        except GeneratorExit:
            raise  # left between two tokens: the slot holds what was decoded
        except BaseException:
            self._forget(slot)
            raise

    def _reuse(self, slot: Slot, tokens: list[int]) -> list[int]:
        """Keep the slot's cache for the prefix it shares with ``tokens``; the rest, to
        evaluate (at least the last token, whose logits the first sample needs)."""
        keep = slot.reusable(tokens)
        llama_cpp.llama_memory_seq_rm(self._memory, slot.index, keep, -1)
        del slot.tokens[keep:]
        slot.canonical = keep
        return tokens[keep:]

    def _share_prompts(self) -> list[Generation]:
        """Give each prompt still to evaluate the longest prefix cached in any other slot,
        when that saves at least ``share_from`` tokens. The prompts that must wait, because a
        sibling ahead of them is still evaluating the prefix they share, are returned."""
        pending = [g for g in self.live if g.todo]
        for generation in pending:
            slot, prompt = generation.slot, generation.prompt_tokens
            keep, _, source = max(((s.reusable(prompt), -s.index, s)
                                   for s in self.slots if s is not slot), default=(0, 0, None))
            if keep - len(slot.tokens) >= self.share_from:
                self._copy_prefix(source, slot, keep)
                generation.todo = prompt[keep:]
                generation.result.prompt_evaluated = len(generation.todo)
        return [g for g in pending if any(self._waits_for(g, h) for h in pending if h is not g)]

    def _waits_for(self, generation: Generation, sibling: Generation) -> bool:
        """Whether ``generation`` is to wait for ``sibling`` to evaluate their shared prefix:
        it would save ``share_from`` tokens, and the sibling is further along it (or as far,
        in a lower slot: a strict order, so someone always goes)."""
        prompt = generation.prompt_tokens
        shared = _keepable(shared_prefix(sibling.prompt_tokens, prompt), prompt)
        mine, theirs = len(generation.slot.tokens), len(sibling.slot.tokens)
        if shared - mine < self.share_from:
            return False
        return (min(theirs, shared), -sibling.slot.index) > (mine, -generation.slot.index)

    def _copy_prefix(self, source: Slot, slot: Slot, n: int) -> None:
        """Make ``slot`` hold the first ``n`` tokens of ``source``'s cache. (llama.cpp copies
        the whole buffer at the next decode, before that decode's tokens go in; the context
        keeps a full-size cache for sliding-window layers, so the prefix is all there.)"""
        llama_cpp.llama_memory_seq_cp(self._memory, source.index, slot.index, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, slot.index, n, -1)
        slot.tokens = source.tokens[:n]
        slot.canonical = n

    def _forget(self, slot: Slot) -> None:
        """Empty one slot's cache (after a failure, what it holds is no longer known)."""
        slot.tokens.clear()
        slot.canonical = 0
        llama_cpp.llama_memory_seq_rm(self._memory, slot.index, 0, -1)

    def _attention_for(self, whole_chunk: bool) -> None:
        """Before a decode: a whole CHUNK-row prompt chunk goes through llama.cpp's tiled
        flash attention (faster), every other batch through its reference kernel (see
        ``attention_switch``)."""
        if self.attention_switch is not None:
            self.attention_switch.set(not whole_chunk)

    def _decode(self) -> None:
        code = llama_cpp.llama_decode(self._ctx, self._batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}: the context is full or the "
                               "batch is malformed")

    def forget(self) -> None:
        """Empty every slot's cache."""
        for slot in self.slots:
            slot.tokens.clear()
            slot.canonical = 0
            slot.joined = 0
        llama_cpp.llama_memory_clear(self._memory, True)

    def cancel(self, generation: Generation) -> None:
        """Stop a generation between steps; its partial text is its result."""
        if not generation.done:
            self._finish(generation, "interrupted")

    # ---- one step ----

    def step(self) -> None:
        """Evaluate prompt chunks, then decode one token of every generating sequence.

        Each prompt chunk is a decode of its own (see the module docstring); a prompt whose
        last chunk is in samples its first token at once. The generating sequences' tokens
        then go in one batch, in the order of their ids (slots): with a cache of its own for
        each sequence, llama.cpp splits a batch into micro-batches of consecutive sequence
        ids, so in the order sequences happened to join it would split into many small ones,
        each a matrix-vector product (measured: 23.0 instead of 40.0 tok/s for 32 sequences of
        Qwen2.5-1.5B on 2 cores).
        """
        if not self.live:
            return
        with self.watchdog:
            self._step()

    def _step(self) -> None:
        generating = [g for g in self.live if g.next_token is not None]  # in slot order
        try:
            self._evaluate_prompts(max(CHUNK, self.n_batch - len(generating)))
            for start in range(0, len(generating), self.step_rows):
                self._decode_tokens(generating[start:start + self.step_rows])
        except BaseException:
            # A Ctrl-C or an error mid-step: what the KV cells hold is no longer known.
            for generation in list(self.live):
                self._forget(generation.slot)
                self._finish(generation, "interrupted")
            raise

    def _decode_tokens(self, generating: list[Generation]) -> None:
        """Decode the next token of these sequences (and their drafts) in one batch, then
        choose their next tokens."""
        round_ = self._round(generating)
        for sequence in round_.sequences:
            generation = sequence.generation
            for j, token in enumerate([generation.next_token, *sequence.draft]):
                self._put(sequence.first_row + j, token, generation.slot, j, True)
        self._batch.n_tokens = round_.rows
        self._attention_for(whole_chunk=False)
        started = time.perf_counter()
        self._decode()
        if self.speculation is not None:
            # The step's whole cost: with layers on a GPU llama_decode can return before the
            # step is computed (sampling waits for it), and the launches alone would make
            # every drafted row look as dear as a token.
            llama_cpp.llama_synchronize(self._ctx)
            self.speculation.observe(time.perf_counter() - started, round_.rows)
        for generation in generating:  # the token it fed is in its cache now
            generation.slot.tokens.append(generation.next_token)
            generation.next_token = None
        self._verify(round_)

    def _round(self, generating: list[Generation]) -> DraftRound:
        """This step's drafts (none without speculation), within the batch, the context
        window and the tokens each request may still make."""
        if self.speculation is None:
            return DraftRound.of(generating, [[] for _ in generating])
        left = [min(g.request.max_tokens - g.result.completion_tokens,
                    self.n_ctx_seq - len(g.slot.tokens)) - 2 if not g.forced else 0
                for g in generating]
        return self.speculation.plan(generating, self.step_rows - len(generating), left)

    def _verify(self, round_: DraftRound) -> None:
        """Sample each sequence's chain at its rows in turn: a drafted token is kept while it
        equals the chain's choice, and the first choice that differs ends its round (it is
        fed in the next step). The cells of the drafts not kept leave the cache."""
        self.tuner.observe()
        decoded = time.perf_counter()
        pending = round_.sequences
        while pending:
            wants = [(s.generation, s.next_row) for s in pending]
            still = []
            for sequence, (generation, row), token in zip(pending, wants, self._choose(wants)):
                self._take(generation, row, token, decoded)
                if sequence.accepts(token) and not generation.done:
                    generation.slot.tokens.append(token)  # its cells hold it already
                    generation.next_token = None
                    still.append(sequence)
            pending = still
        if round_.drafted:
            self.speculation.finish(round_)
            for sequence in round_.sequences:
                slot = sequence.generation.slot
                llama_cpp.llama_memory_seq_rm(self._memory, slot.index, len(slot.tokens), -1)

    def _evaluate_prompts(self, room: int) -> None:
        """Evaluate whole chunks of the prompts still to evaluate, lower slots first, up to
        ``room`` tokens; a prompt whose last chunk is in samples its first token."""
        waiting = self._share_prompts()
        for generation in list(self.live):
            if not generation.todo or generation in waiting:
                continue
            slot = generation.slot
            while generation.todo:
                n = self._chunk_length(slot, len(generation.todo))
                if n > room:
                    return
                chunk, last = generation.todo[:n], n == len(generation.todo)
                self.tuner.observe()  # a prompt is where a thread too many costs most
                self._evaluate_chunk(slot, chunk, last)
                del generation.todo[:n]
                room -= n
                if last:
                    self._sample([(generation, n - 1)])

    def _chunk_length(self, slot: Slot, left: int) -> int:
        """The next chunk of a prompt: up to the next multiple of CHUNK, or its end."""
        return min(CHUNK - len(slot.tokens) % CHUNK, left)

    def _evaluate_chunk(self, slot: Slot, chunk: list[int], last: bool) -> None:
        """Decode one aligned chunk alone (logits for its last token when ``last``)."""
        for j, token in enumerate(chunk):
            self._put(j, token, slot, j, last and j == len(chunk) - 1)
        self._batch.n_tokens = len(chunk)
        self._attention_for(whole_chunk=len(chunk) == CHUNK)
        self._decode()
        if self.speculation is not None:
            self.speculation.prompt_evaluated()
        if len(chunk) == CHUNK and slot.canonical == len(slot.tokens):
            slot.canonical += CHUNK
        slot.tokens += chunk

    def _sample(self, wants: list[tuple[Generation, int]]) -> None:
        """Choose and record the next token of each (generation, batch index of its logits)
        of the last decode."""
        self.tuner.observe()
        decoded = time.perf_counter()
        for (generation, index), token in zip(wants, self._choose(wants)):
            self._take(generation, index, token, decoded)

    def _put(self, i: int, token: int, slot: Slot, offset: int, logits: bool) -> None:
        batch = self._batch
        batch.token[i] = token
        batch.pos[i] = len(slot.tokens) + offset
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = slot.index
        batch.logits[i] = logits

    def _choose(self, wants: list[tuple[Generation, int]]) -> list[int]:
        """The next token of each (generation, batch index).

        Chains run one after another in this thread, unless they are costly (one chain's CPU
        time, when last measured, at least ``parallel_from_s``): then in as many groups as
        llama.cpp has threads now, each on a logits row fetched here first (the first fetch
        finishes the decode), so the threads only read memory and run their chains. Chains in
        the graph read what the graph chose, here.
        """
        ctx = self._ctx
        tokens = []
        for generation, index in wants:  # forced tokens, and what the graph chose
            generation.forced_now = bool(generation.forced)
            tokens.append(generation.forced.pop(0) if generation.forced_now
                          else generation.chain.sample(ctx, index)
                          if generation.chain.in_graph else None)
        cpu = [(i, g.chain, index) for i, (g, index) in enumerate(wants) if tokens[i] is None]
        groups = min(len(cpu), self.tuner.threads)
        self._steps += 1
        if (groups > 1 and self._chain_s >= self.parallel_from_s
                and self._steps % MEASURE_EVERY != 0):
            rows = [(i, chain, ctypes.addressof(llama_cpp.llama_get_logits_ith(ctx, index)
                                                .contents)) for i, chain, index in cpu]
            set_pass_threads(1)  # the chains themselves are spread over the cores
            running = [self._samplers.submit(_run_chains, rows[g::groups])
                       for g in range(groups)]
            try:
                for future in running:
                    for i, token in future.result():
                        tokens[i] = token
            finally:
                # A Ctrl-C here ends the generations and frees their chains: not while a
                # thread still runs one.
                futures.wait(running)
        elif cpu:
            # The chains' cost is measured here only, one after another: in threads they
            # share the cores with llama.cpp's spinning workers and take several times the
            # CPU time (about 5 ms a chain instead of 1 for adaptive at 262,144 tokens),
            # which would keep cheap chains in threads once they got there.
            # every step: another engine in this process may have set it since
            set_pass_threads(self.tuner.threads if self.passes_on_threads else 1)
            started = time.thread_time()
            for i, chain, index in cpu:
                tokens[i] = chain.sample(ctx, index)
            if len(cpu) > 1:  # a step of several chains: the only kind the choice is for
                self._chain_s = (time.thread_time() - started) / len(cpu)
        return tokens

    def _take(self, generation: Generation, index: int, token: int, decoded: float) -> None:
        """Record the chosen token: timings, text, stop conditions, the next step's input."""
        result = generation.result
        if generation._decode_start is None:
            generation._decode_start = decoded
            result.prompt_eval_s = decoded - generation._submitted
        if result.completion_tokens == 0:
            result.time_to_first_token_s = time.perf_counter() - generation._submitted
        request, vocab = generation.request, self._vocab
        if vocab.is_end_of_generation(token):
            return self._finish(generation, "stop")
        result.tokens.append(token)
        result.completion_tokens += 1
        if request.logprobs is not None:
            result.logprobs.append(self._logprob(index, token, request.logprobs))
        chain = None if generation.forced_now else generation.chain  # None: forced
        if generation.records_stats:
            result.token_stats.append(chain.last_stats() if chain is not None
                                      and chain.records_stats else None)
        generation.seen(token, chain)
        text = generation._utf8.decode(vocab.piece(token))
        if generation.splitter is not None:
            thought = result.reasoning_tokens
            text = self._split_thinking(generation, text, counts=True)
            generation._check_budget()
            if request.logprobs is not None:
                _mark_phases(result.logprobs, result.reasoning_tokens - thought)
        generation._held += text
        emit, generation._held, hit = split_stop(generation._held, request.stop)
        if emit:
            result.text += emit
            generation.pieces.append(emit)
        if hit:
            result.stop_string = hit
            return self._finish(generation, "stop_string")
        if (result.completion_tokens >= request.max_tokens
                or len(generation.slot.tokens) + 1 >= self.n_ctx_seq):
            return self._finish(generation, "length")
        generation.next_token = token

    @staticmethod
    def _split_thinking(generation: Generation, text: str, counts: bool = False,
                        final: bool = False) -> str:
        """The answer's part of the text of a token (``counts``: a reasoning token when it
        was or opened the thinking) or, ``final``, of what the reply held back at its end;
        the thinking's part goes to the result and the pieces."""
        splitter, result = generation.splitter, generation.result
        was_thinking, was_undecided = splitter.thinking, splitter.undecided
        parts = splitter.feed(text) + (splitter.finish() if final else [])
        if counts and (was_thinking or splitter.thinking):
            # a mark of several tokens opened the thinking: they were all its tokens
            opening = generation.undecided_tokens if was_undecided else 0
            result.reasoning_tokens += 1 + opening
            generation.thought_tokens += was_thinking and splitter.thinking
        if counts and splitter.undecided:
            generation.undecided_tokens += 1
        answer = []
        for phase, part in parts:
            if phase == THINKING:
                result.reasoning += part
                generation.pieces.append(Thought(part))
            else:
                answer.append(part)
        return "".join(answer)

    def _logprob(self, index: int, token: int, n_top: int) -> TokenLogprob:
        """From the logits the model gave at batch ``index`` (the chain works on a copy)."""
        vocab = self._vocab
        x = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, index),
                                  shape=(vocab.n_vocab,))
        top = float(x.max())
        log_norm = top + math.log(float(np.exp((x - top).astype(np.float64)).sum()))
        best = np.argpartition(x, -n_top)[-n_top:] if n_top else np.array([], dtype=int)
        best = best[np.argsort(-x[best], kind="stable")]
        return TokenLogprob(token, vocab.piece(token), float(x[token]) - log_norm,
                            tuple((int(i), vocab.piece(int(i)), float(x[i]) - log_norm)
                                  for i in best))

    def _finish(self, generation: Generation, reason: str) -> None:
        result = generation.result
        result.finish_reason = reason
        if reason != "interrupted":
            tail = generation._utf8.decode(b"", final=True)
            if generation.splitter is not None:
                tail = self._split_thinking(generation, tail, final=True)
            tail = generation._held + tail
            if reason != "stop_string" and tail:
                result.text += tail
                generation.pieces.append(tail)
        if generation._decode_start is not None:
            result.decode_s = time.perf_counter() - generation._decode_start
        generation.done = True
        generation.next_token = None
        generation.todo = []
        if generation.slot is not None:
            generation.slot.generation = None
            if self.speculation is not None:
                self.speculation.end(generation.slot.index)
            if generation.chain.in_graph:  # before the chain is freed
                generation.chain.detach(self._ctx, generation.slot.index)
        if generation in self.live:
            self.live.remove(generation)
        for chain in generation.chains:
            chain.close()


def _run_chains(group: list[tuple[int, SamplerChain, int]]) -> list[tuple[int, int]]:
    """(position, token) for each (position, chain, logits address) of the group."""
    return [(i, chain.sample_from(logits)) for i, chain, logits in group]


def _keepable(shared: int, prompt: list[int]) -> int:
    """Of ``shared`` cached tokens at the start of ``prompt``, how many a cache may keep: whole
    chunks, and never the prompt's last token (evaluated again for its logits)."""
    return max(0, min(shared, len(prompt) - 1)) // CHUNK * CHUNK


def split_stop(text: str, stops: list[str]) -> tuple[str, str, str]:
    """(text safe to emit, text held back, the stop string found there or "": the one
    that starts first, the first listed of those that start there)."""
    if not stops:
        return text, "", ""
    found = [(i, n) for n, i in enumerate(text.find(s) for s in stops) if i >= 0]
    if found:
        cut, n = min(found)
        return text[:cut], "", stops[n]
    hold = 0  # longest suffix of text that is a proper prefix of some stop string
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold], text[len(text) - hold:], ""

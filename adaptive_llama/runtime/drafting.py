"""The drafters of speculative decoding (:mod:`adaptive_llama.runtime.speculation`).

- :class:`NgramDrafter` ("ngram", :class:`PromptLookup`): the tokens that followed the last
  earlier occurrence of the sequence's last 4, 3 or 2 tokens (the longest found), anywhere
  in its prompt or reply. No second model: it pays where a reply copies its context (code
  edits, quotes, summaries, JSON).
- :class:`ModelDrafter`: a smaller model with the same vocabulary drafts greedily, one
  sequence of its own per slot, and stops where its likeliest token falls below ``p_min``.
"""

from __future__ import annotations

import time

import llama_cpp
import numpy as np
from llama_cpp import _internals

from ..llama import rpc as ggml_rpc
from .limits import N_BATCH
from .loading import load_model
from .models import ModelError, resolve_model
from .prefix import shared_prefix
from .speculation import average

NGRAM_SIZES = (4, 3, 2)  # longest first: a longer match predicts better
P_MIN = 0.75             # a draft model stops below this probability (llama.cpp's default)
# llama.cpp's compatibility rule for a draft model (common/speculative.cpp): vocabularies of
# the same type and special tokens, sizes at most this far apart, the same text for every
# token from id 5 on.
VOCAB_SIZE_SLACK = 128
VOCAB_CHECK_FROM = 5


class PromptLookup:
    """Prompt lookup over one sequence's tokens, kept up to date as they grow: for each
    n-gram size, the position that followed the n-gram's latest occurrence."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self._after: list[dict[tuple, int]] = [{} for _ in NGRAM_SIZES]
        self.extend(tokens)

    def extend(self, tokens) -> None:
        history = self.tokens
        for token in tokens:
            end = len(history)
            for n, after in zip(NGRAM_SIZES, self._after):
                if end >= n:
                    after[tuple(history[end - n:end])] = end
            history.append(token)

    def draft(self, n_max: int) -> list[int]:
        """Up to ``n_max`` tokens that followed the longest suffix seen before."""
        history = self.tokens
        for n, after in zip(NGRAM_SIZES, self._after):
            if len(history) > n and (start := after.get(tuple(history[-n:]))) is not None:
                return history[start:start + n_max]
        return []


class NgramDrafter:
    """Prompt lookup for every sequence (nothing to load)."""

    name = "ngram"
    draft_s = 0.0  # seconds per drafted token: a dictionary lookup
    free = True    # so it drafts in the shadow of steps that do not draft too

    def start(self, slot: int, tokens: list[int]) -> PromptLookup:
        return PromptLookup(tokens)

    def draft(self, wants: list[tuple[int, PromptLookup, int]]) -> list[list[int]]:
        """Drafts for (slot, state, tokens wanted) of several sequences."""
        return [state.draft(n) for _, state, n in wants]

    def close(self) -> None:
        pass


class ModelDrafter:
    """A smaller model drafts greedily, a sequence of its own context per slot."""

    free = False  # each drafted token is a decode of the draft model

    def __init__(self, model, target, *, n_slots: int, n_ctx_seq: int, threads: int,
                 p_min: float = P_MIN):
        self.path = resolve_model(model)
        self.name = self.path.name
        # On this machine only: with no list, llama.cpp would take every GPU-type device,
        # RPC workers registered for another model in this process included.
        self._model, _ = load_model(self.path, devices=ggml_rpc.model_devices([]))
        try:
            check_vocabularies(self._model, target, self.name)
            params = llama_cpp.llama_context_default_params()
            params.n_ctx = n_ctx_seq * n_slots
            params.n_seq_max = n_slots
            params.kv_unified = False
            params.n_batch = params.n_ubatch = min(N_BATCH, params.n_ctx)
            params.n_threads = params.n_threads_batch = threads
            params.no_perf = True
            try:
                self._context = _internals.LlamaContext(model=self._model, params=params,
                                                        verbose=False)
            except (ValueError, RuntimeError) as exc:
                raise ValueError(f"the draft model {self.name}: llama.cpp could not create "
                                 f"its context ({exc})") from None
        except BaseException:
            self._model.close()
            raise
        self._ctx = self._context.ctx
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self.n_batch = params.n_batch
        self.n_vocab = self._model.n_vocab()
        self.target_vocab = target.n_vocab()
        self.p_min = p_min
        self.draft_s = 0.0  # seconds per drafted token, measured
        self._held: dict[int, list[int]] = {}  # slot -> the tokens its draft cache holds

    def start(self, slot: int, tokens: list[int]) -> "_Tokens":
        return _Tokens(tokens)

    def draft(self, wants: list[tuple[int, "_Tokens", int]]) -> list[list[int]]:
        try:
            return self._draft(wants)
        except BaseException:  # an error or a Ctrl-C: what the draft cache holds is unknown
            self._held.clear()
            llama_cpp.llama_memory_clear(self._memory, True)
            raise

    def _draft(self, wants: list[tuple[int, "_Tokens", int]]) -> list[list[int]]:
        started = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in wants]
        live = [i for i, (_, _, n) in enumerate(wants) if n > 0]
        for i in live:  # each cache up to the last token: no logits needed
            slot, state, _ = wants[i]
            self._catch_up(slot, state.tokens[:-1])
        feed = {i: wants[i][1].tokens[-1] for i in live}
        while live:
            for j, i in enumerate(live):  # one row per sequence: its logits at row j
                slot = wants[i][0]
                self._put(j, feed[i], slot, len(self._held[slot]), True)
                self._held[slot].append(feed[i])
            self._decode(len(live))
            picked = []
            for j, i in enumerate(live):
                token, p = self._top(j)
                if p < self.p_min or token >= self.target_vocab:
                    continue
                drafts[i].append(token)
                if len(drafts[i]) < wants[i][2]:
                    feed[i] = token
                    picked.append(i)
            live = picked
        made = sum(map(len, drafts))
        if made:
            self.draft_s = average(self.draft_s or None, (time.perf_counter() - started) / made)
        return drafts

    def _catch_up(self, slot: int, tokens: list[int]) -> None:
        """Make the slot's draft cache hold ``tokens``, keeping the prefix it shares."""
        held = self._held.setdefault(slot, [])
        keep = shared_prefix(held, tokens)
        llama_cpp.llama_memory_seq_rm(self._memory, slot, keep, -1)
        del held[keep:]
        for first in range(keep, len(tokens), self.n_batch):
            chunk = tokens[first:first + self.n_batch]
            for j, token in enumerate(chunk):
                self._put(j, token, slot, first + j, False)
            self._decode(len(chunk))
            held += chunk

    def _top(self, row: int) -> tuple[int, float]:
        x = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, row),
                                  shape=(self.n_vocab,))
        token = int(x.argmax())
        return token, 1.0 / float(np.exp(x - x[token]).sum())

    def _put(self, i: int, token: int, slot: int, pos: int, logits: bool) -> None:
        batch = self._batch
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = slot, logits

    def _decode(self, n: int) -> None:
        self._batch.n_tokens = n
        if llama_cpp.llama_decode(self._ctx, self._batch) != 0:
            raise RuntimeError(f"the draft model {self.name} could not decode (its context "
                               "is full?)")

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
            self._context.close()
            self._model.close()


class _Tokens:
    """A sequence's tokens, for a drafter that keeps nothing else per sequence."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)


def check_vocabularies(draft, target, name: str) -> None:
    """ModelError unless the draft model's tokens are the target's (llama.cpp's rule)."""
    dv, tv = draft.vocab, target.vocab
    problem = None
    if llama_cpp.llama_vocab_type(dv) != llama_cpp.llama_vocab_type(tv):
        problem = "its tokenizer is of another type"
    elif (llama_cpp.llama_vocab_bos(dv), llama_cpp.llama_vocab_eos(dv)) != (
            llama_cpp.llama_vocab_bos(tv), llama_cpp.llama_vocab_eos(tv)):
        problem = "its start and end tokens differ"
    elif abs(draft.n_vocab() - target.n_vocab()) > VOCAB_SIZE_SLACK:
        problem = f"it has {draft.n_vocab():,} tokens, the model {target.n_vocab():,}"
    else:
        for token in range(VOCAB_CHECK_FROM, min(draft.n_vocab(), target.n_vocab())):
            ours = llama_cpp.llama_vocab_get_text(dv, token)
            theirs = llama_cpp.llama_vocab_get_text(tv, token)
            if ours != theirs:
                problem = (f"token {token} is {ours.decode('utf-8', 'replace')!r} there and "
                           f"{theirs.decode('utf-8', 'replace')!r} in the model")
                break
    if problem:
        raise ModelError(f"the draft model {name} cannot draft for this model: {problem}; "
                         "use a smaller model of the same family (the same tokenizer)")

"""Embeddings: one vector per text, from a llama.cpp context of its own with pooling.

The context shares the weights of the model it is made for (the engine's, or an embedding
GGUF loaded on its own). Its pooling is the model's own (``<arch>.pooling_type`` in the GGUF:
an embedding model says mean, CLS or last); a model that names none, a chat model, is
mean-pooled over its tokens. Vectors come L2-normalised (length 1), as OpenAI's and Ollama's
do, so that a dot product is the cosine similarity.

Several texts decode together: as many sequences as fit in one batch of
:data:`EMBED_BATCH` tokens and :data:`MAX_SEQUENCES` sequences, each pooled on its own.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _internals

from .loading import load_model
from .request import InvalidArgument

EMBED_BATCH = 2048  # tokens decoded at once, and the longest text (non-causal models see
#                     a text whole, so it has to fit in one micro-batch)
MAX_SEQUENCES = 16  # texts decoded together


class Embedder:
    """Embeddings from ``model`` (a loaded ``llama_cpp._internals.LlamaModel``); thread-safe:
    one batch at a time.

    Args:
        model: the model; it has to outlive the embedder.
        name: how errors name it.
        threads: CPU threads for a batch.
        max_tokens: the longest text, in tokens (at most the model's training context).
    """

    @classmethod
    def open(cls, path: Path, threads: int) -> Embedder:
        """An embedder over the GGUF at ``path``, a model of its own (closed with it);
        ModelError for a file llama.cpp cannot load."""
        model, _ = load_model(path)
        try:
            embedder = cls(model, path.name, threads)
        except ValueError:
            model.close()
            raise
        embedder._owned_model = model
        return embedder

    def __init__(self, model, name: str, threads: int, max_tokens: int = EMBED_BATCH):
        self._model = model
        self._owned_model = None
        self.name = name
        self.max_tokens = min(max_tokens, model.n_ctx_train())
        self.n_embd = model.n_embd()
        self.pooling = self._pooling()
        params = llama_cpp.llama_context_default_params()
        params.embeddings = True
        params.pooling_type = self.pooling
        params.n_ctx = params.n_batch = params.n_ubatch = self.max_tokens
        params.n_seq_max = MAX_SEQUENCES
        params.kv_unified = True  # one batch's texts share the cells; cleared after it
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        try:
            self._context = _internals.LlamaContext(model=model, params=params,
                                                    verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"llama.cpp could not create an embedding context for {name} "
                             f"({exc})") from None
        self._batch = _internals.LlamaBatch(n_tokens=self.max_tokens, embd=0,
                                            n_seq_max=MAX_SEQUENCES, verbose=False)
        self._lock = threading.Lock()

    def _pooling(self) -> int:
        """The model's own pooling, or mean for a model that names none."""
        metadata = self._model.metadata()
        arch = metadata.get("general.architecture", "")
        own = metadata.get(f"{arch}.pooling_type", "")
        if own.isdigit() and int(own) not in (llama_cpp.LLAMA_POOLING_TYPE_NONE,
                                               llama_cpp.LLAMA_POOLING_TYPE_RANK):
            return int(own)
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN

    def tokenize(self, text: str) -> list[int]:
        """A text's tokens as the model embeds it (its BOS token when it takes one)."""
        return self._model.tokenize(text.encode("utf-8", "replace"), True, False)

    def check(self, inputs: list[list[int]], field: str = "input") -> None:
        """InvalidArgument naming ``field.i`` for an input that is empty, too long, or holds
        an id outside the vocabulary."""
        n_vocab = self._model.n_vocab()
        for i, tokens in enumerate(inputs):
            where = f"{field}.{i}" if len(inputs) > 1 else field
            if not tokens:
                raise InvalidArgument(f"`{where}` is empty: there is nothing to embed", where)
            if len(tokens) > self.max_tokens:
                raise InvalidArgument(
                    f"`{where}` has {len(tokens)} tokens, but {self.name} embeds at most "
                    f"{self.max_tokens} at once: split it", where)
            bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise InvalidArgument(f"`{where}`: {bad} is not a token of {self.name} "
                                      f"(0 to {n_vocab - 1})", where)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """The unit vectors of token lists checked by :meth:`check`: one row per input."""
        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        with self._lock:
            for first, last in self._batches(inputs):
                self._decode(inputs[first:last], out[first:last])
        return out

    def _batches(self, inputs: list[list[int]]):
        """(first, last) input indexes of each batch: within the token and sequence limits."""
        first, tokens = 0, 0
        for i, item in enumerate(inputs):
            if i > first and (tokens + len(item) > self.max_tokens
                              or i - first == MAX_SEQUENCES):
                yield first, i
                first, tokens = i, 0
            tokens += len(item)
        if inputs:
            yield first, len(inputs)

    def _decode(self, inputs: list[list[int]], out: np.ndarray) -> None:
        ctx = self._context
        ctx.kv_cache_clear()
        self._batch.reset()
        for seq, tokens in enumerate(inputs):
            self._batch.add_sequence(tokens, seq, True)  # pooling reads every token
        ctx.decode(self._batch)
        for seq in range(len(inputs)):
            pointer = llama_cpp.llama_get_embeddings_seq(ctx.ctx, seq)
            vector = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(
                ctypes.c_float)), shape=(self.n_embd,))
            norm = float(np.linalg.norm(vector.astype(np.float64)))
            out[seq] = vector / norm if norm > 0 else vector
        ctx.kv_cache_clear()

    def close(self) -> None:
        self._batch.close()
        self._context.close()
        if self._owned_model is not None:
            self._owned_model.close()

"""A model's tokens as text: what turns the tokens of a reply into its bytes and tells where
a reply ends (the engine tokenizes; the decoder only needs this)."""

from __future__ import annotations

import ctypes
import functools

import llama_cpp


class Vocab:
    """The vocabulary of a loaded model (``llama_cpp._internals.LlamaModel``)."""

    def __init__(self, model):
        self._vocab = model.vocab
        self.n_vocab: int = model.n_vocab()

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a token stands for (a control token's text only with ``special``)."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:  # buffer too small: -n is the size needed
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:max(n, 0)]

    def is_end_of_generation(self, token: int) -> bool:
        return llama_cpp.llama_vocab_is_eog(self._vocab, token)

    @functools.cached_property
    def end_of_generation(self) -> tuple[int, ...]:
        """Every token that ends a generation (llama-server's ``ignore_eos`` bans them)."""
        return tuple(t for t in range(self.n_vocab) if self.is_end_of_generation(t))

    def is_control(self, token: int) -> bool:
        """A control or user-defined token (the chat template's markup)."""
        wanted = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        return bool(llama_cpp.llama_vocab_get_attr(self._vocab, token) & wanted)

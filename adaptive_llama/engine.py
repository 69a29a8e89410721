"""The engine: load a GGUF, render its chat template, generate with a sampler spec.

>>> from adaptive_llama import Engine
>>> engine = Engine("smollm2", seed=1)                 # a bundled name or a .gguf path
>>> print(engine.generate("Once upon a time", sampler="adaptive:eps=0.0005").text)

What runs where: the token loop (:meth:`Engine.stream`) is Python: one ``llama_decode`` and
one ``llama_sampler_sample`` per token. Inside ``llama_sampler_sample`` llama.cpp fills the
candidate array and runs the chain (:mod:`adaptive_llama.chain`), whose adaptive and eta
samplers are C (``native/adaptive.c``). The KV cache is reused across requests for the
longest common prefix of tokens, so a chat turn only evaluates what is new. A
``KeyboardInterrupt`` (or :meth:`Stream.cancel`) stops a reply between tokens and leaves the
engine ready for the next request. Conversations live in :mod:`adaptive_llama.chat`.
"""

from __future__ import annotations

import codecs
import ctypes
import math
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from .chain import SamplerChain, TokenStats
from .models import ModelError, resolve_model
from .samplers import SEED, SamplerSpec, spec_of

import llama_cpp  # noqa: E402  (after .chain, which checks its version)
from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: E402

CTX_STEP = 256  # llama.cpp rounds a context up to a multiple of this


class ContextOverflow(ValueError):
    """The prompt does not fit in the context window."""


@llama_cpp.llama_log_callback
def _quiet_log(level, text, user_data):
    """llama.cpp's log, dropped unless the engine is verbose (then: stderr)."""
    if _quiet_log.verbose:
        print(text.decode("utf-8", "replace"), end="", flush=True, file=sys.stderr)


_quiet_log.verbose = False


def set_llama_log(verbose: bool) -> None:
    """Route llama.cpp's own log: shown with ``verbose``, otherwise silent (errors included:
    the engine reports them in one line)."""
    _quiet_log.verbose = verbose
    llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))


@dataclass
class GenerationResult:
    """What one generation produced and what it cost."""

    text: str
    finish_reason: str            # "stop" (end of turn), "length", "stop_string", "interrupted"
    prompt_tokens: int
    completion_tokens: int
    sampler: str
    seed: int
    tokens: list[int] = field(default_factory=list)
    token_stats: list[TokenStats] = field(default_factory=list)   # adaptive only
    prompt_eval_s: float = 0.0
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (prompt evaluation excluded)."""
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_k(self) -> float | None:
        return statistics.fmean(s.k for s in self.token_stats) if self.token_stats else None

    def summary(self) -> dict:
        """The figures of the reply, for the REPL's /stats, the server's ``sampler_stats``
        and ``generate --json``: speed, finish, and for adaptive the spread of k and Conf."""
        out = {"sampler": self.sampler, "seed": self.seed, "finish_reason": self.finish_reason,
               "completion_tokens": self.completion_tokens,
               "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
               "time_to_first_token_s": round(self.time_to_first_token_s, 4)}
        if self.token_stats:
            ks = sorted(s.k for s in self.token_stats)
            confs = [s.conf for s in self.token_stats if not math.isnan(s.conf)]
            out.update(mean_k=round(statistics.fmean(ks), 3),
                       stdev_k=round(statistics.pstdev(ks), 3),
                       median_k=statistics.median_low(ks), max_k=ks[-1],
                       mean_conf=round(statistics.fmean(confs), 4) if confs else None)
        return out

    def as_dict(self) -> dict:
        return {"text": self.text, "prompt_tokens": self.prompt_tokens,
                "prompt_eval_s": round(self.prompt_eval_s, 4), **self.summary()}


class Stream:
    """An iterator over the text pieces of one reply; ``result`` is set when it ends.

    Ending it early (:meth:`cancel`, or a KeyboardInterrupt while it decodes) finishes the
    generation with finish_reason "interrupted" and keeps the partial text. Callbacks given
    to :meth:`on_finish` run once, with the result, however it ends.
    """

    def __init__(self, pieces: Iterator[str], live: GenerationResult):
        self._pieces = pieces
        self._live = live
        self._callbacks: list[Callable[[GenerationResult], None]] = []
        self.result: GenerationResult | None = None

    @property
    def last_k(self) -> int | None:
        """The candidate-set size of the newest token (adaptive sampler), else None."""
        return self._live.token_stats[-1].k if self._live.token_stats else None

    def on_finish(self, callback: Callable[[GenerationResult], None]) -> None:
        self._callbacks.append(callback)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self.result is not None:
            raise StopIteration
        try:
            return next(self._pieces)
        except BaseException:  # the end, an error, or a KeyboardInterrupt mid-decode
            self._finish()
            raise

    def cancel(self) -> None:
        """Stop the generation now (between tokens); the partial reply is the result."""
        if self.result is None:
            self._pieces.close()
            self._finish()

    def _finish(self) -> None:
        self.result = self._live
        for callback in self._callbacks:
            callback(self.result)

    def text(self) -> str:
        """Consume the stream; the whole reply."""
        for _ in self:
            pass
        return self.result.text


class Engine:
    """A GGUF model on llama.cpp with adaptive decoding and the usual baselines.

    Args:
        model: a .gguf path or a bundled short name (``adaptive-llama models``); None: smollm2.
        n_gpu_layers: layers to offload to the GPU (needs a CUDA build of llama-cpp-python;
            -1 offloads all).
        n_ctx: context window in tokens, rounded up to a multiple of 256 as llama.cpp does
            (0: the model's training context).
        n_threads: CPU threads (None: llama.cpp's choice).
        seed: default seed of every generation, 0 to 2**32 - 1.
        verbose: show llama.cpp's own log.

    Raises:
        ModelError: the file is missing, not GGUF, truncated or otherwise unloadable.
        ValueError: an argument out of range, or a context too large to allocate.
    """

    def __init__(self, model=None, *, n_gpu_layers: int = 0, n_ctx: int = 2048,
                 n_threads: int | None = None, seed: int = 0, verbose: bool = False):
        _check_int("n_gpu_layers", n_gpu_layers, low=-1)
        _check_int("n_ctx", n_ctx, low=0)
        if 0 < n_ctx < CTX_STEP:
            raise ValueError(f"`n_ctx` has to be 0 (the model's own) or at least {CTX_STEP}, "
                             f"but is {n_ctx}")
        if n_threads is not None:
            _check_int("n_threads", n_threads, low=1)
        self.seed = SEED.validate(seed)
        self.path: Path = resolve_model(model)
        # llama.cpp rounds the context up; llama-cpp-python's token buffer would not.
        rounded = -(-n_ctx // CTX_STEP) * CTX_STEP
        set_llama_log(verbose)
        try:
            self.llama = llama_cpp.Llama(
                model_path=str(self.path), n_ctx=rounded, n_gpu_layers=n_gpu_layers,
                n_threads=n_threads, seed=self.seed, verbose=verbose, logits_all=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            if "context" in str(exc):
                raise ValueError(f"llama.cpp could not create a context of {n_ctx} tokens "
                                 "(not enough memory for its cache?): use a smaller n_ctx "
                                 "(--ctx), or 0 for the model's own") from None
            raise ModelError(f"{self.path}: llama.cpp could not load it; the file is "
                             f"truncated or corrupt, or not a model llama.cpp supports ({exc})"
                             ) from None
        self.n_vocab = self.llama.n_vocab()
        self.n_ctx = self.llama.n_ctx()
        self._vocab = self.llama._model.vocab
        self._formatter = self._chat_formatter()
        self._special_texts: list[tuple[str, int]] | None = None

    # ---- model facts ----

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def has_chat_template(self) -> bool:
        return self._formatter is not None

    @property
    def ctx(self):
        """The ``llama_context *`` (for llama.cpp calls such as ``llama_sampler_sample``)."""
        return self.llama._ctx.ctx

    def _chat_formatter(self) -> Jinja2ChatFormatter | None:
        template = self.llama.metadata.get("tokenizer.chat_template")
        if not template:
            return None
        piece = self._piece
        return Jinja2ChatFormatter(
            template=template,
            eos_token=piece(self.llama.token_eos(), special=True).decode("utf-8", "replace"),
            bos_token=piece(self.llama.token_bos(), special=True).decode("utf-8", "replace"),
        )

    def _piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:  # buffer too small: -n is the size needed
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:max(n, 0)]

    # ---- text to tokens ----

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        """Plain text to tokens: text that looks like a control token stays text."""
        return self.llama.tokenize(text.encode("utf-8", "replace"), add_bos=add_bos,
                                   special=False)

    def prompt_tokens(self, text: str, chat: bool = False) -> list[int]:
        """A prompt as tokens: plain continuation, or one user message in the chat template."""
        if chat:
            return self.chat_prompt_tokens([{"role": "user", "content": text}])
        return self.tokenize(text)

    def chat_prompt_tokens(self, messages: list[dict]) -> list[int]:
        """Tokens of the conversation rendered with the model's own chat template.

        Only the template's own markup becomes control tokens: the messages' text is
        tokenized as text, so a message containing ``<|im_end|>`` cannot end its turn or
        forge another role's.
        """
        if self._formatter is None:
            raise ModelError(f"{self.name} has no chat template (tokenizer.chat_template): "
                             "use plain completion (generate without --chat)")
        nonce = secrets.token_hex(4)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        rendered = self._formatter(messages=[{**m, "content": mark}
                                             for m, mark in zip(messages, marks)])
        by_mark = {mark: m["content"] for m, mark in zip(messages, marks)}
        tokens = [] if rendered.added_special else self.tokenize("", add_bos=True)
        text = ""  # plain text gathered since the last control token
        for part, is_content in _split_marks(rendered.prompt, by_mark):
            if is_content:
                text += part
                continue
            for chunk, special_id in self._split_specials(part):
                if special_id is None:
                    text += chunk
                else:
                    tokens += self.tokenize(text, add_bos=False) if text else []
                    tokens.append(special_id)
                    text = ""
        return tokens + (self.tokenize(text, add_bos=False) if text else [])

    def _split_specials(self, markup: str) -> Iterator[tuple[str, int | None]]:
        """Markup split into plain text and control tokens (longest match first)."""
        if self._special_texts is None:
            self._special_texts = self._control_tokens()
        pos = 0
        while pos < len(markup):
            hits = [(markup.find(t, pos), -len(t), t, i) for t, i in self._special_texts]
            hits = [h for h in hits if h[0] >= 0]
            if not hits:
                break
            at, _, text, token = min(hits)
            if at > pos:
                yield markup[pos:at], None
            yield text, token
            pos = at + len(text)
        if pos < len(markup):
            yield markup[pos:], None

    def _control_tokens(self) -> list[tuple[str, int]]:
        wanted = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        out = []
        for token in range(self.n_vocab):
            if llama_cpp.llama_vocab_get_attr(self._vocab, token) & wanted:
                text = self._piece(token, special=True).decode("utf-8", "replace")
                if text:
                    out.append((text, token))
        return out

    # ---- generation ----

    def prefill(self, tokens: list[int]) -> None:
        """Evaluate tokens, reusing the KV cache for the prefix shared with the last request;
        afterwards the context holds the logits that follow ``tokens``."""
        llama = self.llama
        cached = llama.input_ids[: llama.n_tokens]
        shared = 0
        for a, b in zip(cached, tokens):
            if a != b:
                break
            shared += 1
        # Re-evaluate at least two tokens. llama.cpp runs a one-token batch through other
        # kernels than a longer one, and the logits differ (by up to 0.6 on SmolLM2): with
        # one token re-evaluated, a repeated request would not repeat under the same seed.
        shared = max(0, min(shared, len(tokens) - 2))
        llama.n_tokens = shared
        llama.eval(tokens[shared:])

    def stream(self, prompt_tokens: list[int], *, sampler: SamplerSpec | str = "adaptive",
               max_tokens: int = 256, seed: int | None = None, stop: list[str] | tuple = (),
               grammar=None, record_stats: bool = True) -> Stream:
        """Generate after ``prompt_tokens``; iterate the returned :class:`Stream` for text.

        Raises ContextOverflow (at once) when the prompt leaves no room in the context window;
        generation itself stops at the window with finish_reason "length".
        """
        spec = spec_of(sampler)
        _check_int("max_tokens", max_tokens, low=1)
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if len(prompt_tokens) >= self.n_ctx:
            raise ContextOverflow(
                f"the prompt has {len(prompt_tokens)} tokens, but the context window holds "
                f"{self.n_ctx}: shorten it or raise n_ctx")
        stop = [s for s in stop if s]  # an empty stop string would end every reply at once
        seed = self.seed if seed is None else seed
        chain = SamplerChain(spec, seed, self.n_vocab, grammar=grammar, model=self.llama,
                             record_stats=record_stats)
        result = GenerationResult(text="", finish_reason="interrupted",
                                  prompt_tokens=len(prompt_tokens), completion_tokens=0,
                                  sampler=str(spec), seed=chain.seed)
        return Stream(self._decode(prompt_tokens, chain, max_tokens, stop, result), result)

    def _decode(self, prompt_tokens, chain: SamplerChain, max_tokens: int, stop: list[str],
                result: GenerationResult) -> Iterator[str]:
        """The token loop; fills ``result`` as it goes (its finally runs however it ends)."""
        llama = self.llama
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        held = ""  # text that could still be the start of a stop string
        started = time.perf_counter()
        decode_start = None
        try:
            self.prefill(prompt_tokens)
            decode_start = time.perf_counter()
            result.prompt_eval_s = decode_start - started
            for _ in range(max_tokens):
                token = chain.sample(self.ctx)
                if result.completion_tokens == 0:
                    result.time_to_first_token_s = time.perf_counter() - started
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    result.finish_reason = "stop"
                    break
                result.tokens.append(token)
                result.completion_tokens += 1
                stats = chain.last_stats()
                if stats is not None:
                    result.token_stats.append(stats)
                held += decoder.decode(self._piece(token))
                emit, held, hit = _split_stop(held, stop)
                if emit:
                    result.text += emit
                    yield emit
                if hit:
                    result.finish_reason = "stop_string"
                    break
                if llama.n_tokens + 1 >= self.n_ctx:
                    result.finish_reason = "length"
                    break
                llama.eval([token])
            else:
                result.finish_reason = "length"
            tail = held + decoder.decode(b"", final=True)
            if result.finish_reason != "stop_string" and tail:
                result.text += tail
                yield tail
        finally:
            if decode_start is not None:
                result.decode_s = time.perf_counter() - decode_start
            chain.close()

    def generate(self, prompt: str, *, chat: bool = False, **kwargs) -> GenerationResult:
        """Complete ``prompt`` (or, with ``chat``, answer it as a user message); kwargs as
        :meth:`stream`."""
        stream = self.stream(self.prompt_tokens(prompt, chat=chat), **kwargs)
        stream.text()
        return stream.result

    def chat(self, system: str | None = None, sampler: SamplerSpec | str = "adaptive",
             **defaults):
        """A conversation with this model (see :class:`adaptive_llama.chat.Chat`)."""
        from .chat import Chat

        return Chat(self, system=system, sampler=sampler, **defaults)

    def close(self) -> None:
        self.llama.close()


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` has to be an integer >= {low}, but is {value!r}")


def _split_marks(rendered: str, by_mark: dict[str, str]) -> Iterator[tuple[str, bool]]:
    """The rendered template as (markup, False) and (message text, True) parts."""
    rest = rendered
    while rest:
        found = [(rest.find(mark), mark) for mark in by_mark if mark in rest]
        if not found:
            yield rest, False
            return
        at, mark = min(found)
        if at:
            yield rest[:at], False
        yield by_mark[mark], True
        rest = rest[at + len(mark):]


def _split_stop(text: str, stops: list[str]) -> tuple[str, str, bool]:
    """(text safe to emit, text held back, whether a stop string was found)."""
    if not stops:
        return text, "", False
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], "", True
    hold = 0  # longest suffix of text that is a proper prefix of some stop string
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold], text[len(text) - hold:], False

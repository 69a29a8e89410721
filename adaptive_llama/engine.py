"""The engine: load a GGUF, render its chat template, generate with a sampler spec.

>>> from adaptive_llama import Engine
>>> engine = Engine("smollm2", seed=1)                 # a bundled name or a .gguf path
>>> chat = engine.chat(system="You are terse.", sampler="adaptive:eps=0.0005")
>>> for piece in (reply := chat.send("Name three rivers.")):
...     print(piece, end="", flush=True)
>>> reply.result.mean_k, reply.result.decode_tokens_per_s

Generation runs llama.cpp's decode and sampler chain directly (one ``llama_decode`` and one
``llama_sampler_sample`` per token; the adaptive sampler's ``apply`` is C). The KV cache is
reused across requests for the longest common prefix of tokens, so a chat turn only evaluates
what is new. A ``KeyboardInterrupt`` (or :meth:`Stream.cancel`) stops a reply between tokens and
leaves the engine ready for the next request.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from .models import ModelError, resolve_model
from .sampler import SamplerChain, TokenStats
from .specs import parse_spec

log = logging.getLogger(__name__)


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
    token_texts: list[str] = field(default_factory=list)          # the text each token added
    prompt_eval_s: float = 0.0
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (prompt evaluation excluded)."""
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def _k_values(self) -> list[int]:
        return [s.k for s in self.token_stats]

    @property
    def mean_k(self) -> float | None:
        ks = self._k_values()
        return statistics.fmean(ks) if ks else None

    @property
    def stdev_k(self) -> float | None:
        ks = self._k_values()
        return statistics.pstdev(ks) if ks else None

    @property
    def mean_conf(self) -> float | None:
        confs = [s.conf for s in self.token_stats if not math.isnan(s.conf)]
        return statistics.fmean(confs) if confs else None

    def as_dict(self) -> dict:
        out = {
            "text": self.text, "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "time_to_first_token_s": round(self.time_to_first_token_s, 4),
            "prompt_eval_s": round(self.prompt_eval_s, 4),
            "sampler": self.sampler, "seed": self.seed,
        }
        if self.token_stats:
            out.update(mean_k=self.mean_k, stdev_k=self.stdev_k, mean_conf=self.mean_conf)
        return out


class Stream:
    """An iterator over the text pieces of one reply; ``result`` is set when it ends.

    Closing it early (``cancel()``, ``close()``, or a KeyboardInterrupt inside the loop)
    ends the generation with finish_reason "interrupted" and keeps the partial text.
    """

    def __init__(self, pieces: Iterator[str], finish, live: GenerationResult):
        self._pieces = pieces
        self._finish = finish
        self._live = live
        self.result: GenerationResult | None = None

    @property
    def last_k(self) -> int | None:
        """The candidate-set size of the newest token (adaptive sampler), else None."""
        return self._live.token_stats[-1].k if self._live.token_stats else None

    def __iter__(self):
        try:
            yield from self._pieces
        finally:
            self.result = self._finish()

    def cancel(self) -> None:
        self._pieces.close()

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
        n_ctx: context window in tokens (0: the model's training context).
        n_threads: CPU threads (None: llama.cpp's choice).
        seed: default seed of every generation.
        verbose: show llama.cpp's own log.

    Raises:
        ModelError: the file is missing, not GGUF, truncated or otherwise unloadable.
    """

    def __init__(self, model=None, *, n_gpu_layers: int = 0, n_ctx: int = 2048,
                 n_threads: int | None = None, seed: int = 0, verbose: bool = False):
        for name, value, low in (("n_ctx", n_ctx, 0), ("n_gpu_layers", n_gpu_layers, -1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` has to be an integer >= {low}, but is {value!r}")
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise ValueError(f"`n_threads` has to be an integer >= 1, but is {n_threads!r}")
        self.path: Path = resolve_model(model)
        self.seed = seed
        set_llama_log(verbose)
        try:
            self.llama = llama_cpp.Llama(
                model_path=str(self.path), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers,
                n_threads=n_threads, seed=seed, verbose=verbose, logits_all=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelError(f"{self.path}: llama.cpp could not load it; the file is "
                             f"truncated or corrupt, or not a model llama.cpp supports ({exc})"
                             ) from None
        self.n_vocab = self.llama.n_vocab()
        self.n_ctx = self.llama.n_ctx()
        self._vocab = self.llama._model.vocab
        self._formatter = self._chat_formatter()

    # ---- model facts ----

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def has_chat_template(self) -> bool:
        return self._formatter is not None

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

    def tokenize(self, text: str, special: bool = False, add_bos: bool = True) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def chat_prompt_tokens(self, messages: list[dict]) -> list[int]:
        """Tokens of the conversation rendered with the model's own chat template."""
        if self._formatter is None:
            raise ModelError(f"{self.name} has no chat template (tokenizer.chat_template): "
                             "use plain completion (generate without --chat)")
        rendered = self._formatter(messages=messages)
        return self.tokenize(rendered.prompt, special=True, add_bos=not rendered.added_special)

    # ---- generation ----

    def _prefill(self, tokens: list[int]) -> None:
        """Evaluate tokens, reusing the KV cache for the prefix shared with the last request."""
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

    def stream(self, prompt_tokens: list[int], *, sampler="adaptive", max_tokens: int = 256,
               seed: int | None = None, stop: list[str] | tuple = (), grammar=None,
               record_stats: bool = True) -> Stream:
        """Generate after ``prompt_tokens``; iterate the returned :class:`Stream` for text.

        Raises ContextOverflow (at once) when the prompt leaves no room in the context window;
        generation itself stops at the window with finish_reason "length".
        """
        spec = parse_spec(sampler)
        if max_tokens < 1:
            raise ValueError(f"`max_tokens` has to be >= 1, but is {max_tokens}")
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if len(prompt_tokens) >= self.n_ctx:
            raise ContextOverflow(
                f"the prompt has {len(prompt_tokens)} tokens, but the context window holds "
                f"{self.n_ctx}: shorten it or raise n_ctx")
        seed = self.seed if seed is None else seed
        result = GenerationResult(text="", finish_reason="interrupted",
                                  prompt_tokens=len(prompt_tokens), completion_tokens=0,
                                  sampler=str(spec), seed=seed)
        state = {"started": time.perf_counter()}
        pieces = self._run(prompt_tokens, spec, max_tokens, seed, list(stop), grammar,
                           record_stats, result, state)

        def finish() -> GenerationResult:
            if "decode_start" in state:
                result.decode_s = time.perf_counter() - state["decode_start"]
            return result

        return Stream(pieces, finish, result)

    def _run(self, prompt_tokens, spec, max_tokens, seed, stop, grammar, record_stats,
             result: GenerationResult, state: dict) -> Iterator[str]:
        llama = self.llama
        chain = SamplerChain(spec, seed, self.n_vocab, grammar=grammar, model=llama,
                             record_stats=record_stats)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        held = ""  # text that could still be the start of a stop string
        try:
            self._prefill(prompt_tokens)
            state["decode_start"] = time.perf_counter()
            result.prompt_eval_s = state["decode_start"] - state["started"]
            for _ in range(max_tokens):
                token = chain.sample(llama._ctx.ctx)
                if result.completion_tokens == 0:
                    result.time_to_first_token_s = time.perf_counter() - state["started"]
                stats = chain.last_stats()
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    result.finish_reason = "stop"
                    break
                result.tokens.append(token)
                result.completion_tokens += 1
                if stats is not None:
                    result.token_stats.append(stats)
                piece = decoder.decode(self._piece(token))
                result.token_texts.append(piece)
                held += piece
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
            chain.close()

    def generate(self, prompt: str, **kwargs) -> GenerationResult:
        """Plain completion of ``prompt`` (no chat template); kwargs as :meth:`stream`."""
        stream = self.stream(self.tokenize(prompt), **kwargs)
        stream.text()
        return stream.result

    def chat(self, system: str | None = None, sampler="adaptive", **defaults) -> "Chat":
        """A conversation with this model (see :class:`Chat`)."""
        return Chat(self, system=system, sampler=sampler, **defaults)

    def close(self) -> None:
        self.llama.close()


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


class Chat:
    """A conversation: messages, settings, and replies that fit the context window.

    When the rendered conversation plus room for the reply exceeds the context window, the
    oldest exchanges are dropped (the system prompt stays); ``dropped`` counts them. A reply
    that is interrupted stays in the history with ``"interrupted": True``.
    """

    def __init__(self, engine: Engine, system: str | None = None, sampler="adaptive",
                 max_tokens: int = 256, seed: int | None = None):
        self.engine = engine
        self.system = system
        self.sampler = parse_spec(sampler)
        self.max_tokens = max_tokens
        self.seed = engine.seed if seed is None else seed
        self.messages: list[dict] = []
        self.dropped = 0

    def _conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def _fit(self) -> list[int]:
        """Prompt tokens, after dropping the oldest exchanges that do not fit."""
        room = min(self.max_tokens, self.engine.n_ctx // 4)
        while True:
            tokens = self.engine.chat_prompt_tokens(self._conversation())
            if len(tokens) + room <= self.engine.n_ctx or len(self.messages) <= 1:
                break
            drop = 2 if len(self.messages) > 2 and self.messages[1]["role"] == "assistant" else 1
            del self.messages[:drop]
            self.dropped += drop
        if len(tokens) >= self.engine.n_ctx:
            raise ContextOverflow(
                f"this message alone is {len(tokens)} tokens, more than the context window "
                f"({self.engine.n_ctx}); shorten it or raise the context size")
        return tokens

    def send(self, text: str, **overrides) -> Stream:
        """Add a user message and stream the reply; the reply joins the history as it ends."""
        self.messages.append({"role": "user", "content": text})
        try:
            tokens = self._fit()
        except ContextOverflow:
            self.messages.pop()
            raise
        return self._reply(tokens, overrides)

    def regenerate(self, **overrides) -> Stream:
        """Drop the last reply and answer the last user message again."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            raise ValueError("there is no message to answer yet")
        return self._reply(self._fit(), overrides)

    def _reply(self, tokens: list[int], overrides: dict) -> Stream:
        options = dict(sampler=self.sampler, max_tokens=self.max_tokens, seed=self.seed)
        options.update(overrides)
        stream = self.engine.stream(tokens, **options)
        inner_finish = stream._finish

        def finish():
            result = inner_finish()
            message = {"role": "assistant", "content": result.text}
            if result.finish_reason == "interrupted":
                message["interrupted"] = True
            self.messages.append(message)
            return result

        stream._finish = finish
        return stream

    def undo(self) -> bool:
        """Drop the last exchange (user message and its reply); False when there is none."""
        if not self.messages:
            return False
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        return True

    def clear(self) -> None:
        self.messages.clear()
        self.dropped = 0

    def context_used(self) -> int:
        """Tokens the conversation occupies now (0 when empty)."""
        conv = self._conversation()
        return len(self.engine.chat_prompt_tokens(conv)) if conv else 0

"""The engine: load a GGUF, render its chat template, generate with a sampler spec.

>>> from adaptive_llama import Engine
>>> engine = Engine("smollm2", seed=1)                 # a bundled name or a .gguf path
>>> print(engine.generate("Once upon a time", sampler="adaptive:eps=0.0005").text)

What runs where: the token loop (:mod:`adaptive_llama.runtime.batching`) is Python: per step one
``llama_decode`` of a batch holding a token of every running sequence, then one
``llama_sampler_sample`` per sequence. Inside it llama.cpp fills the candidate array and runs
the chain (:mod:`adaptive_llama.llama.chain`), whose adaptive and eta samplers are machine
code (``native/adaptive.c``, or their numba stand-ins); with ``backend_sampling`` the chain's
head runs inside llama.cpp's graph instead (:mod:`adaptive_llama.llama.graph`). Prompts are evaluated in aligned 64-token chunks, and a sequence's
KV cache is reused for the whole chunks its prompt shares with what it holds (never for a
reply's generated tokens), so that the same seed gives the same reply whatever the cache
held. A ``KeyboardInterrupt`` (or
:meth:`Stream.cancel`) stops a reply between tokens and leaves the engine ready for the next
request. Conversations live in :mod:`adaptive_llama.chat.conversation`; :meth:`Engine.generate_batch`
generates for many prompts at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import threading
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

import llama_cpp  # noqa: E402  (after .chain, which checks its version)
from llama_cpp import _internals  # noqa: E402

from ..endpoints import parse_endpoints
from ..kernel.native import set_pass_threads
from ..llama import cpu_attention
from ..llama import rpc as ggml_rpc
from ..llama.chain import SamplerChain, check_in_graph
from ..samplers import SEED, SamplerSpec, SpecError, seed_or_fresh, spec_of
from .batching import (  # noqa: F401
    CHUNK,
    MAX_LOGPROBS,
    Decoder,
    Generation,
    GenerationResult,
    TokenLogprob,
)
from . import template_process
from .chat_template import ChatTemplate
from .drafting import ModelDrafter, NgramDrafter
from .embeddings import Embedder
from .gguf_header import quantization_name
from .limits import MAX_CTX, MAX_THREADS, N_BATCH
from .reasoning import ThinkingFormat, ThinkingSettings, template_format
from .loading import layer_devices, load_model, set_llama_log
from .models import ModelError, resolve_model
from .request import (ContextOverflow, InvalidArgument, Request, check_budget, check_int,
                      check_logit_bias, check_shares)
from .speculation import MAX_DRAFT, Speculation
from .threads import ThreadTuner, default_threads
from .vocab import Vocab

log = logging.getLogger(__name__)

CTX_STEP = 256  # llama.cpp rounds a context up to a multiple of this
class _NoWatchdog(contextlib.nullcontext):
    """In place of :class:`~..llama.rpc.Watchdog` without workers."""

    def progress(self) -> None:
        pass


_NO_WATCHDOG = _NoWatchdog()
_GRAPH_HAS_ONE_CHAIN = ("a sampler of the thinking's own needs a second chain, and backend "
                        "sampling runs one chain in the graph: drop one of the two")

__all__ = ["ContextOverflow", "Engine", "GenerationResult", "InvalidArgument", "Request",
           "Stream", "set_llama_log"]


class Stream:
    """An iterator over the text pieces of one reply; ``result`` is set when it ends.

    Ending it early (:meth:`cancel`, or a KeyboardInterrupt while it decodes) finishes the
    generation with finish_reason "interrupted" and keeps the partial text. Callbacks given
    to :meth:`on_finish` run once, with the result, however it ends.
    """

    def __init__(self, pieces: Iterator[str], live: GenerationResult,
                 release: Callable[[], None]):
        self._pieces = pieces
        self._live = live
        self._release = release  # frees what the generation holds, if it never ran
        self._callbacks: list[Callable[[GenerationResult], None]] = []
        self.result: GenerationResult | None = None

    @property
    def last_logprob(self):
        """The newest token's :class:`TokenLogprob` (when the stream was asked for them)."""
        return self._live.logprobs[-1] if self._live.logprobs else None

    @property
    def last_k(self) -> int | None:
        """The candidate-set size of the newest token (adaptive sampler), else None."""
        stats = self._live.token_stats[-1] if self._live.token_stats else None
        return stats.k if stats is not None else None

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
        self._release()
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
        n_ctx: context window of each sequence in tokens, rounded up to a multiple of 256 as
            llama.cpp does (0: the model's training context).
        n_threads: CPU threads; None: the physical cores this process may use, fewer while
            other processes keep some of them busy (:mod:`adaptive_llama.runtime.threads`).
        parallel: sequences decoded together (slots); the KV cache holds
            ``parallel x n_ctx`` tokens.
        seed: the seed of every generation that names none, 0 to 2**32 - 1; None (the
            default): a fresh random seed for each, reported in its result.
        verbose: show llama.cpp's own log.
        backend_sampling: run the sampler chain inside llama.cpp's graph, on the device that
            holds the output layer (:mod:`adaptive_llama.llama.graph`): only the chosen token and
            the kept candidates come back, not all V logits. Samplers without a graph path
            (typical, mirostat, eta), grammars and logprobs are refused per request with a
            one-line error. Where the device cannot run an operation the chain needs, the
            engine logs one warning and samples on the CPU (``backend_sampling`` then reads
            False).
        chat_template: a Jinja chat template in place of the model's own (the source;
            :func:`adaptive_llama.runtime.chat_template.load_template` reads a built-in one,
            such as ``chatml-tools``, or a file).
        rpc: llama.cpp RPC workers (``adaptive-llama rpc-worker``) to hold layers, as
            ``"HOST:PORT,..."`` or a list of them (docs/distributed.md). Each is checked
            before the model loads. ``n_gpu_layers`` 0 then means all layers on them (the
            output layer too); ``n_gpu_layers`` N keeps the first layers here.
        tensor_split: the share of the offloaded layers each device holds, in order: the
            workers' devices, then this machine's GPUs (llama.cpp's ``--tensor-split``);
            None: in proportion to their free memory.
        rpc_timeout: seconds a decode step with workers may take before the engine gives
            them up: one line naming them, and the process exits with status 3 (llama.cpp
            itself would wait for ever on a frozen worker).
        draft: speculative decoding (:mod:`adaptive_llama.runtime.drafting`): "ngram"
            (prompt lookup), or a draft model (a .gguf path or a bundled name) with the
            model's vocabulary; None: none. Every token is still the sampler chain's own
            choice, so on the CPU a reply is the same text as without it, only faster
            where drafts are kept.
        draft_max: tokens drafted per step at most (the engine drafts fewer, or none,
            where drafts are seldom kept).
        reasoning_budget, reasoning_budget_message, reasoning_sampler: a reasoning model's
            thinking (:mod:`adaptive_llama.runtime.reasoning`): at most this many tokens of
            it (-1: no bound; 0: none), the text that closes it when the budget is spent,
            and the sampler that chooses its tokens (None: the reply's); each request may
            set its own.
        reference_attention: on the CPU (no GPU layers; RPC workers started with
            ``adaptive-llama rpc-worker`` follow it), flash attention through llama.cpp's
            tiled kernel for whole prompt chunks and its one-row reference kernel for every
            other row, which gives a row the same logits alone or among drafted tokens
            (:mod:`adaptive_llama.llama.cpu_attention`). False: flash attention off, about
            10% slower decoding. None (the default) or True: on. Replies are reproducible
            either way, but the two compute attention differently, so the same seed gives
            another reply in each.

    Raises:
        ModelError: the file is missing, not GGUF, truncated or otherwise unloadable.
        ValueError: an argument out of range, or a context too large to allocate.
    """

    def __init__(self, model=None, *, n_gpu_layers: int = 0, n_ctx: int = 2048,
                 n_threads: int | None = None, parallel: int = 1, seed: int | None = None,
                 verbose: bool = False, backend_sampling: bool = False,
                 chat_template: str | None = None, rpc: str | list[str] | None = None,
                 tensor_split: list[float] | None = None,
                 rpc_timeout: float = ggml_rpc.STEP_TIMEOUT_S, draft: str | None = None,
                 draft_max: int = MAX_DRAFT, reference_attention: bool | None = None,
                 reasoning_budget: int = -1, reasoning_budget_message: str = "",
                 reasoning_sampler: SamplerSpec | str | None = None):
        self.thinking_settings = ThinkingSettings(
            check_budget("reasoning_budget", reasoning_budget), str(reasoning_budget_message),
            None if reasoning_sampler is None else spec_of(reasoning_sampler))
        if reasoning_sampler is not None and backend_sampling:
            raise InvalidArgument(_GRAPH_HAS_ONE_CHAIN, "reasoning_sampler")
        self.rpc, tensor_split = _checked_arguments(
            n_gpu_layers=n_gpu_layers, n_ctx=n_ctx, n_threads=n_threads, parallel=parallel,
            backend_sampling=backend_sampling, rpc=rpc, rpc_timeout=rpc_timeout,
            tensor_split=tensor_split, draft=draft, draft_max=draft_max,
            reference_attention=reference_attention)
        self._wants_reference = reference_attention is not False
        self.seed = None if seed is None else SEED.validate(seed)
        self.backend_sampling = backend_sampling
        self.path: Path = resolve_model(model)
        template_process.prestart()  # its chat template's renderer starts while it loads
        if self.rpc and n_gpu_layers == 0:
            n_gpu_layers = -1  # workers given to hold nothing would be a mistake
        # Every wait on the workers is bounded: the handshake, the load (restarted by each
        # tensor sent), the context; then each decode step (the decoder's).
        watchdog = ggml_rpc.Watchdog(self.rpc, rpc_timeout) if self.rpc else _NO_WATCHDOG
        with watchdog:
            self._load(n_gpu_layers, tensor_split, verbose, watchdog)
            # llama.cpp rounds each sequence's context up to a multiple of 256.
            requested = n_ctx or min(self._model.n_ctx_train(), MAX_CTX)
            self.n_ctx = -(-requested // CTX_STEP) * CTX_STEP
            self.parallel = parallel
            threads = n_threads or default_threads()
            self._context = self._new_context(requested, threads, verbose)
            self.ctx = self._context.ctx  # the llama_context *, for llama.cpp calls
        speculation = (self._speculation(draft, draft_max, threads, watchdog)
                       if draft is not None else None)
        self.decoder = self._decoder(threads, adaptive=n_threads is None, watchdog=watchdog,
                                     speculation=speculation)
        if backend_sampling:
            self.backend_sampling = self._graph_can_sample()
        self.metadata = self._model.metadata()
        self._specials: tuple[re.Pattern | None, dict[str, int]] | None = None
        self.chat_template = self._chat_template(chat_template)
        self.thinking = self._thinking_format()

    def _load(self, n_gpu_layers: int, tensor_split: list[float] | None, verbose: bool,
              watchdog) -> None:
        """The model, on this machine or with layers on the workers (connected first)."""
        devices = ggml_rpc.connect(self.rpc) if self.rpc else []
        gpus = len(ggml_rpc.local_gpus()) if self.rpc else 0
        if self.rpc and tensor_split and len(tensor_split) > len(devices) + gpus:
            raise InvalidArgument(
                f"`tensor_split` has {len(tensor_split)} shares, but there are "
                f"{len(devices)} worker and {gpus} local GPU devices", "tensor_split")
        # Whether a token's logits are a function of the tokens before it alone (whatever
        # the batch, the cache, the threads or the other sequences): on CPUs, here or in
        # CPU workers, yes (see _new_context); with layers on a GPU, llama.cpp's kernels
        # depend on the batch (a worker's device is not known here: docs/distributed.md).
        self.batch_invariant = n_gpu_layers == 0 or (bool(self.rpc) and gpus == 0)
        # Whether this machine's CPU waits while the model's layers compute (on a GPU or on
        # the workers): its threads then take the sampler's passes too (Decoder).
        self.decodes_elsewhere = bool(self.rpc) or (
            n_gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload())
        self.n_gpu_layers = n_gpu_layers
        set_llama_log(verbose)
        self._model, layers = load_model(
            self.path, n_gpu_layers, verbose, tensor_split=tensor_split,
            devices=ggml_rpc.model_devices(devices), progress=watchdog.progress,
            device_label=ggml_rpc.device_label)
        self.layers = [dict(run, device=ggml_rpc.device_label(run["device"]))
                       for run in layer_devices(layers)]
        self._embedder: Embedder | None = None
        self._embedder_lock = threading.Lock()
        self.vocab = Vocab(self._model)
        self.n_vocab = self.vocab.n_vocab

    def _decoder(self, threads: int, adaptive: bool, watchdog,
                 speculation: Speculation | None) -> Decoder:
        n_batch = min(N_BATCH, self.n_ctx * self.parallel)
        if self.decodes_elsewhere and threads > 1 and set_pass_threads(threads) == 1:
            log.warning("the C kernel was built without OpenMP: its passes over the "
                        "vocabulary run on one thread while the layers compute elsewhere "
                        "(reinstall with a compiler that has OpenMP, such as GCC)")
        # the workers' rule (cpu_attention): no batch but a whole prompt chunk has CHUNK rows
        workers_rule = self.rpc and self.attention == "reference"
        return Decoder(self.ctx, self.vocab, self.parallel, self.n_ctx, n_batch,
                       ThreadTuner(self.ctx, threads, adaptive=adaptive),
                       speculation=speculation, attention_switch=self._attention_switch,
                       watchdog=watchdog if self.rpc else None,
                       step_rows=min(n_batch, CHUNK - 1) if workers_rule else None,
                       passes_on_threads=self.decodes_elsewhere)

    def _speculation(self, draft, draft_max: int, threads: int, watchdog) -> Speculation:
        try:
            drafter = NgramDrafter() if str(draft) == "ngram" else ModelDrafter(
                draft, self._model, n_slots=self.parallel, n_ctx_seq=self.n_ctx,
                threads=threads)
        except BaseException as exc:
            self._close_context(watchdog)  # the engine so far: no decoder yet
            if isinstance(exc, ModelError) and not str(exc).startswith("the draft model"):
                raise ModelError(f"the draft model: {exc}") from None
            raise
        if self.attention != "reference":
            log.warning("with drafts, a reply may differ from the same seed's reply "
                        "without them where two tokens nearly tie: %s computes a row "
                        "otherwise in a batch (docs/performance.md)",
                        "this GPU" if self.n_gpu_layers else "attention without llama.cpp's "
                        "reference kernel")
        return Speculation(drafter, draft_max)

    @staticmethod
    def _endpoints(value) -> list[str]:
        if value is None or value == [] or value == "":
            return []
        try:
            return parse_endpoints(value)
        except ValueError as exc:
            raise InvalidArgument(f"`rpc`: {exc}", "rpc") from None

    def _new_context(self, requested: int, threads: int, verbose: bool):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.n_ctx * self.parallel
        params.n_seq_max = self.parallel
        params.kv_unified = False  # each slot its own n_ctx cells
        # Sliding-window layers keep every position (llama.cpp's default, said here because
        # the decoder relies on it): a slot cut back to a prefix, or copied from another
        # slot, then still holds the window the next token attends to.
        params.swa_full = True
        params.n_batch = params.n_ubatch = min(N_BATCH, params.n_ctx)
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        if self.backend_sampling:
            # The sampled logits, probabilities and ids take V entries per possible output:
            # at most one output per sequence per step, not n_batch of them.
            params.n_outputs_max = self.parallel
            params.n_outputs_max_per_seq = 1
        self.attention = "flash"  # llama.cpp's own choice
        self._attention_switch = None
        if self.batch_invariant and self._wants_reference:
            context = self._reference_attention_context(params, requested, verbose)
            if context is not None:
                return context
        if self.batch_invariant:
            # Batch-invariant evaluation (see batch_invariant) without the reference kernel
            # (turned off, or not to be had): llama.cpp's other CPU flash attention kernels
            # compute a row otherwise in a batch of 64 rows or more, and split a single
            # row's attention over the threads once 512 cells are in view. Without flash
            # attention every prompt row is computed the same way, whatever the batch.
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            self.attention = "off"
        return self._create_context(params, requested, verbose)

    def _reference_attention_context(self, params, requested: int, verbose: bool):
        """The context with flash attention through ggml's reference kernel, which computes
        each row alone (:mod:`adaptive_llama.llama.cpu_attention`); None, after one warning,
        where it cannot be had."""
        try:
            with cpu_attention.reference_attention() as made:
                params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
                context = self._create_context(params, requested, verbose)
            if made:
                self.attention = "reference"
                self._attention_switch = cpu_attention.Switch(made)
                return context
            context.close()
            reason = "llama.cpp made its CPU backend some other way"
        except cpu_attention.Unavailable as exc:
            reason = str(exc)
        log.warning("flash attention is off, about 10%% slower decoding: its batch-invariant "
                    "kernel cannot be set here (%s)", reason)
        return None

    def _create_context(self, params, requested: int, verbose: bool):
        try:
            return _internals.LlamaContext(model=self._model, params=params, verbose=verbose)
        except (ValueError, RuntimeError) as exc:
            self._model.close()
            raise ValueError(
                f"llama.cpp could not create a context of {requested} tokens"
                f"{f' x {self.parallel} sequences' if self.parallel > 1 else ''} (not enough "
                "memory for its cache?): use a smaller n_ctx (--ctx), or 0 for the model's "
                f"own ({exc})") from None

    @property
    def draft(self) -> str | None:
        """What drafts for speculative decoding: "ngram", the draft model's file, or None."""
        speculation = self.decoder.speculation
        return speculation.name if speculation is not None else None

    def _graph_can_sample(self) -> bool:
        """Whether the output device runs the adaptive chain in the graph (a trial attach)."""
        with SamplerChain("adaptive:temp=0.7", 0, self.n_vocab, in_graph=True) as chain:
            try:
                chain.attach(self.ctx, 0)
            except SpecError as exc:
                log.warning("%s; sampling on the CPU instead", str(exc).replace(
                    "backend sampling:", "backend sampling is off:", 1))
                return False
            chain.detach(self.ctx, 0)
        return True

    # ---- model facts ----

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def n_params(self) -> int:
        """The model's parameter count."""
        return llama_cpp.llama_model_n_params(self._model.model)

    @property
    def quantization(self) -> str:
        """The weights' type as llama.cpp names it (``Q4_1``, ``Q4_K_M``, ``F16``), from the
        GGUF's ``general.file_type``; "unknown" when absent."""
        return quantization_name(self.metadata.get("general.file_type"))

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def placement(self) -> str:
        """Which device holds which layers, as ``CPU 0-14; RPC0 (10.0.0.2:50052) 15-29 and
        output`` (the output layer is numbered after the last repeating one)."""
        n_layer = llama_cpp.llama_model_n_layer(self._model.model)

        def span(first: int, last: int) -> str:
            output = last == n_layer
            last -= output
            text = "" if last < first else str(first) if first == last else f"{first}-{last}"
            return " and ".join(filter(None, [text, "output" if output else ""]))

        return "; ".join(f"{run['device']} {span(*run['layers'])}" for run in self.layers)

    @property
    def threads(self) -> int:
        """The threads llama.cpp decodes with now."""
        return self.decoder.tuner.threads

    @property
    def threads_adaptive(self) -> bool:
        return self.decoder.tuner.adaptive

    def _chat_template(self, source: str | None) -> ChatTemplate | None:
        """The template given, else the model's own; None if neither."""
        origin = "the chat template given" if source else \
            f"the chat template of {self.path.name} (its tokenizer.chat_template)"
        source = source or self.metadata.get("tokenizer.chat_template")
        if not source:
            return None
        return ChatTemplate(
            source,
            eos=self.piece(self._model.token_eos(), special=True).decode("utf-8", "replace"),
            bos=self.piece(self._model.token_bos(), special=True).decode("utf-8", "replace"),
            specials=lambda: self._special_tokens()[0], origin=origin)

    def _thinking_format(self) -> ThinkingFormat | None:
        """How the model marks its thinking, if it is a reasoning model: its chat template
        writes or reads the marks (or takes ``enable_thinking``), and they are tokens of the
        vocabulary; None otherwise (:mod:`adaptive_llama.runtime.reasoning`)."""
        form = template_format(self.chat_template.source) if self.chat_template else None
        if form is None or not all(self._is_one_token(mark) for mark in form.tokens):
            return None
        return form

    def can_turn_thinking_off(self) -> bool:
        """Whether a reasoning model's chat template turns its thinking off
        (``enable_thinking``)."""
        return self.chat_template is not None and self.chat_template.turns_thinking_off

    def _is_one_token(self, text: str) -> bool:
        tokens = self.tokenize(text, add_bos=False, special=True)
        return len(tokens) == 1 and self.piece(tokens[0], special=True) == text.encode()

    def _thinking_of(self, prompt_tokens: list[int]) -> ThinkingFormat | None:
        """The thinking format of a reply to this prompt: opened by the prompt when it ends
        with the opening tag (a template that starts the thinking itself)."""
        if self.thinking is None:
            return None
        tail = b"".join(self.piece(t, special=True) for t in prompt_tokens[-8:])
        opened = tail.decode("utf-8", "replace").rstrip().endswith(self.thinking.open)
        return dataclasses.replace(self.thinking, opened_by_prompt=opened)

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a token stands for (a control token's text only with ``special``)."""
        return self.vocab.piece(token, special)

    def is_end_of_generation(self, token: int) -> bool:
        return self.vocab.is_end_of_generation(token)

    # ---- text to tokens and back ----

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Text to tokens. Text that looks like a control token stays text unless
        ``special`` (a raw prompt, written with the model's own markup by its caller)."""
        return self._model.tokenize(text.encode("utf-8", "replace"), add_bos, special)

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def prompt_tokens(self, text: str, chat: bool = False) -> list[int]:
        """A prompt as tokens: plain continuation, or one user message in the chat template."""
        if chat:
            return self.chat_prompt_tokens([{"role": "user", "content": text}])
        return self.tokenize(text)

    def chat_prompt_tokens(self, messages: list[dict], tools: list[dict] | None = None,
                           cancelled: threading.Event | None = None,
                           thinking: bool | None = None) -> list[int]:
        """Tokens of the conversation rendered with the chat template (the model's own, or
        the one the engine was given), with ``tools`` (OpenAI's function definitions) for a
        template that shows them (:attr:`ChatTemplate.writes_tools`).

        Only the template's own markup becomes control tokens: the messages' text is
        tokenized as text, so a message containing ``<|im_end|>`` cannot end its turn or
        forge another role's. The render stops when ``cancelled`` is set
        (:class:`~.template_process.TemplateCancelled`). ``thinking`` False turns a
        reasoning model's thinking off where its template can (:meth:`can_turn_thinking_off`).
        """
        if self.chat_template is None:
            raise ModelError(f"{self.name} has no chat template (tokenizer.chat_template): "
                             "use plain completion (generate without --chat), or give one "
                             "(--chat-template)")
        if thinking is None and self.thinking_settings.budget == 0:
            thinking = False if self.can_turn_thinking_off() else None
        parts, added_bos = self.chat_template.render(messages, tools, cancelled, thinking)
        tokens = [] if added_bos else self.tokenize("", add_bos=True)
        text: list[str] = []  # plain text gathered since the last control token
        for part, is_content in parts:
            if is_content:
                text.append(part)
                continue
            for chunk, special_id in self._split_specials(part):
                if special_id is None:
                    text.append(chunk)
                else:
                    tokens += self.tokenize("".join(text), add_bos=False) if text else []
                    tokens.append(special_id)
                    text = []
        return tokens + (self.tokenize("".join(text), add_bos=False) if text else [])

    def _split_specials(self, markup: str) -> Iterator[tuple[str, int | None]]:
        """Markup split into plain text and control tokens (longest match first)."""
        pattern, by_text = self._special_tokens()
        pos = 0
        for match in pattern.finditer(markup) if pattern else ():
            if match.start() > pos:
                yield markup[pos:match.start()], None
            yield match.group(), by_text[match.group()]
            pos = match.end()
        if pos < len(markup):
            yield markup[pos:], None

    def _special_tokens(self) -> tuple[re.Pattern | None, dict[str, int]]:
        """The pattern of the control tokens' texts (longest first; None if there are
        none) and their ids, read once, lazily."""
        if self._specials is None:
            by_text = self._control_tokens()
            pattern = re.compile("|".join(re.escape(t) for t in sorted(
                by_text, key=len, reverse=True))) if by_text else None
            self._specials = (pattern, by_text)
        return self._specials

    def _control_tokens(self) -> dict[str, int]:
        """The text of every control or user-defined token -> its id (read once, lazily)."""
        out = {}
        for token in range(self.n_vocab):
            if self.vocab.is_control(token):
                text = self.piece(token, special=True).decode("utf-8", "replace")
                if text:
                    out.setdefault(text, token)
        return out

    # ---- generation ----

    def prefill(self, tokens: list[int], generated: int = 0) -> None:
        """Evaluate ``tokens`` in the first slot (reusing its cache for a shared prefix); the
        context then holds the logits that follow them (``llama_get_logits_ith(ctx, -1)``).
        The last ``generated`` of them are decoded one at a time, as a generation decodes
        the tokens it made: the logits are then those that generation sampled from. For
        measurements and tests; generation does this itself."""
        self._require_idle("prefill")
        self.decoder.evaluate(tokens, generated)

    def replay(self, prompt: list[int], made: list[int]) -> Iterator[int]:
        """Evaluate ``prompt`` in the first slot, then decode the reply ``made`` a token at a
        time, as the generation that made it did. Each token of ``made`` is yielded while the
        context holds the logits it was sampled from (``llama_get_logits_ith(ctx, -1)``):
        in one pass what ``prefill(prompt + made[:i], generated=i)`` holds for each i. For
        measurements and tests."""
        self._require_idle("replay")
        return self.decoder.replay(prompt, made)

    def _require_idle(self, what: str) -> None:
        if self.decoder.live:
            raise RuntimeError(f"{what} needs an idle engine: generations are running")

    def request(self, prompt_tokens: list[int], *, sampler: SamplerSpec | str = "adaptive",
                max_tokens: int | None = 256, seed: int | None = None,
                stop: list[str] | tuple = (), grammar=None, record_stats: bool = True,
                logprobs: int | None = None, thinking: bool = True,
                reasoning_sampler: SamplerSpec | str | None = None,
                reasoning_budget: int | None = None, logit_bias=()) -> Request:
        """The request, checked once (:mod:`adaptive_llama.runtime.request`); arguments as
        :meth:`stream`. ``max_tokens`` None, or beyond the room the prompt leaves in the
        context window: that room. Seed None: the engine's seed, else a fresh random one.

        Raises ContextOverflow when the prompt leaves no room; SpecError for a sampler or
        grammar that cannot run here (backend sampling runs fewer); InvalidArgument (a
        ValueError naming its ``param``) for an argument out of range.
        """
        if not prompt_tokens:
            raise InvalidArgument("the prompt is empty", "prompt")
        room = self.n_ctx - len(prompt_tokens)
        if room < 1:
            raise ContextOverflow(
                f"the prompt has {len(prompt_tokens)} tokens, but the context window holds "
                f"{self.n_ctx}: shorten it or raise n_ctx")
        biases = check_logit_bias(logit_bias, self.n_vocab)
        spec = self.check_sampler(sampler, grammar, biases)
        if max_tokens is not None:
            check_int("max_tokens", max_tokens, low=1)
        if logprobs is not None:
            check_int("logprobs", logprobs, low=0, high=MAX_LOGPROBS)
            if self.backend_sampling:
                raise InvalidArgument("`logprobs` needs the model's logits, which backend "
                                      "sampling leaves on the device: start without backend "
                                      "sampling", "logprobs")
        if seed is not None:
            SEED.validate(seed)
        # An empty stop string would end every reply at once: it is no stop string.
        return Request(prompt_tokens=tuple(prompt_tokens), spec=spec,
                       max_tokens=min(max_tokens or room, room),
                       seed=seed_or_fresh(self.seed if seed is None else seed),
                       stop=tuple(s for s in stop if s), logprobs=logprobs, grammar=grammar,
                       logit_bias=biases, record_stats=record_stats,
                       **self._thinking_request(prompt_tokens, thinking, reasoning_sampler,
                                                reasoning_budget))

    def _thinking_request(self, prompt_tokens: list[int], thinking: bool, sampler,
                          budget: int | None) -> dict:
        """A request's fields for a reasoning model's thinking (none for another model, or
        with ``thinking`` False); ``sampler`` and ``budget`` None: the engine's."""
        settings = self.thinking_settings
        spec = settings.sampler if sampler is None else spec_of(sampler)
        if spec is not None and self.backend_sampling:
            raise InvalidArgument(_GRAPH_HAS_ONE_CHAIN, "reasoning_sampler")
        budget = settings.budget if budget is None else check_budget("reasoning_budget", budget)
        form = self._thinking_of(prompt_tokens) if thinking else None
        if form is None:
            return {}
        return {"thinking": form, "thinking_spec": spec, "thinking_budget": budget,
                "closing_tokens": tuple(self._closing_tokens(settings.budget_message))
                if budget is not None else ()}

    def _closing_tokens(self, message: str) -> list[int]:
        """What closes the thinking when its budget is spent: ``message`` (on a line of its
        own), the closing mark, and what the format writes before the answer."""
        text = f"\n{message.strip()}\n" if message.strip() else "\n"
        gap = self.tokenize(self.thinking.answer_gap, add_bos=False) \
            if self.thinking.answer_gap else []
        return (self.tokenize(text, add_bos=False)
                + self.tokenize(self.thinking.close, add_bos=False, special=True) + gap)

    def check_sampler(self, sampler: SamplerSpec | str, grammar=None,
                      logit_bias=()) -> SamplerSpec:
        """The parsed spec, or the SpecError a request with it would get here: under backend
        sampling, a sampler, grammar or logit bias that cannot run inside the graph."""
        spec = spec_of(sampler)
        if self.backend_sampling:
            check_in_graph(spec, grammar, logit_bias)
        return spec

    def _generation(self, request: Request) -> Generation:
        chain = SamplerChain(request.spec, request.seed, self.n_vocab, grammar=request.grammar,
                             vocab_model=self._model, record_stats=request.record_stats,
                             in_graph=self.backend_sampling, logit_bias=request.logit_bias)
        chain.remember(request.prompt_tokens)
        if request.thinking is None or self.backend_sampling:
            return Generation(request, chain)
        # the thinking's own chain: its sampler (or the reply's), never the grammar
        try:
            thinking = SamplerChain(request.thinking_spec or request.spec, request.seed,
                                    self.n_vocab, vocab_model=self._model,
                                    record_stats=request.record_stats,
                                    logit_bias=request.logit_bias)
        except BaseException:
            chain.close()
            raise
        thinking.remember(request.prompt_tokens)
        return Generation(request, chain, thinking)

    # ---- driving the slots: for a scheduler of its own (the server's) ----

    @property
    def free_slots(self) -> int:
        """Sequences free for :meth:`begin` now."""
        return self.decoder.free_slots

    def begin(self, request: Request) -> Generation:
        """The request's generation in a free slot (RuntimeError when none is); it advances
        with each :meth:`step` (its text in ``pieces``, its ``result`` filled as it goes)
        until ``done``."""
        self._check_free_slot()
        generation = self._generation(request)
        self.decoder.add(generation)
        return generation

    def _check_free_slot(self) -> None:
        if not self.decoder.free_slots:
            raise RuntimeError(f"all {self.parallel} of the engine's sequences are busy: "
                               "finish or cancel() the other streams, or create the "
                               "Engine with a larger `parallel`")

    def step(self) -> None:
        """One decode step of every running generation (prompt chunks, or one token)."""
        self.decoder.step()

    def cancel(self, generation: Generation) -> None:
        """Stop a generation now and free its slot (nothing if it has finished)."""
        self.decoder.cancel(generation)

    # ---- generation ----

    def stream(self, prompt_tokens: list[int], *, sampler: SamplerSpec | str = "adaptive",
               max_tokens: int | None = 256, seed: int | None = None,
               stop: list[str] | tuple = (), grammar=None, record_stats: bool = True,
               logprobs: int | None = None, thinking: bool = True, logit_bias=()) -> Stream:
        """Generate after ``prompt_tokens``; iterate the returned :class:`Stream` for text.

        ``logprobs``: None, or record each token's log-probability in the model's own
        distribution (before temperature and truncation) with that many of the most likely
        alternatives (0 to 20) in ``result.logprobs``.

        ``thinking``: a reasoning model's thinking comes apart from its answer
        (:mod:`adaptive_llama.runtime.reasoning`): as :class:`~.reasoning.Thought` pieces
        and in ``result.reasoning``, while ``result.text`` is the answer; False keeps the
        reply as one text, tags and all.

        ``logit_bias``: {token id: bias} (or (token, bias) pairs), each bias in [-100, 100]
        added to the token's logit before the samplers, as OpenAI's ``logit_bias``.

        Raises at once what :meth:`request` raises; generation itself stops at the window
        with finish_reason "length". Other streams of this engine advance while this one is
        iterated (they share each decode step).
        """
        return self.run(self.request(prompt_tokens, sampler=sampler, max_tokens=max_tokens,
                                     seed=seed, stop=stop, grammar=grammar,
                                     record_stats=record_stats, logprobs=logprobs,
                                     thinking=thinking, logit_bias=logit_bias))

    def run(self, request: Request) -> Stream:
        """:meth:`stream` of a request built with :meth:`request`: it takes a slot when
        first iterated."""
        generation = self._generation(request)
        return Stream(self._drive(generation), generation.result,
                      lambda: self.decoder.cancel(generation))

    def _drive(self, generation: Generation) -> Iterator[str]:
        decoder = self.decoder
        try:
            self._check_free_slot()
            decoder.add(generation)
            while not generation.done:
                decoder.step()
                yield from generation.take()
            yield from generation.take()
        finally:
            decoder.cancel(generation)  # nothing if it finished

    def generate(self, prompt: str, *, chat: bool = False, **kwargs) -> GenerationResult:
        """Complete ``prompt`` (or, with ``chat``, answer it as a user message); kwargs as
        :meth:`stream`."""
        stream = self.stream(self.prompt_tokens(prompt, chat=chat), **kwargs)
        stream.text()
        return stream.result

    def generate_batch(self, prompts: list[str], *, chat: bool = False,
                       sampler: SamplerSpec | str | list = "adaptive",
                       seed: int | list[int] | None = None, max_tokens: int = 256,
                       stop: list[str] | tuple = (), record_stats: bool = True
                       ) -> list[GenerationResult]:
        """Generate for many prompts at once, ``parallel`` sequences per decode step.

        ``sampler`` and ``seed`` are one for all prompts or a list with one per prompt (seed
        None: the engine's). Sequences finish independently; a waiting prompt takes the first
        slot that frees (continuous batching). Results come back in the order of ``prompts``.
        """
        results: list[GenerationResult] = [None] * len(prompts)  # type: ignore[list-item]
        for index, result in self.generate_each(prompts, chat=chat, sampler=sampler,
                                                seed=seed, max_tokens=max_tokens, stop=stop,
                                                record_stats=record_stats):
            results[index] = result
        return results

    def generate_each(self, prompts: list[str], *, chat: bool = False,
                      sampler: SamplerSpec | str | list = "adaptive",
                      seed: int | list[int] | None = None, max_tokens: int = 256,
                      stop: list[str] | tuple = (), record_stats: bool = True
                      ) -> Iterator[tuple[int, GenerationResult]]:
        """:meth:`generate_batch`, yielding (index in ``prompts``, result) as each sequence
        finishes, so that a long run can keep every result at once and its slots stay full
        to the end. Every request is checked here, before anything is decoded; closing the
        iterator early cancels what is still running."""
        n = len(prompts)
        samplers = sampler if isinstance(sampler, list) else [sampler] * n
        seeds = seed if isinstance(seed, list) else [seed] * n
        if len(samplers) != n or len(seeds) != n:
            raise ValueError("`sampler` and `seed` lists need one entry per prompt")
        requests = [self.request(self.prompt_tokens(p, chat=chat), sampler=s, seed=sd,
                                 max_tokens=max_tokens, stop=stop, record_stats=record_stats)
                    for p, s, sd in zip(prompts, samplers, seeds)]
        return self._finish_each(requests)

    def _finish_each(self, requests: list[Request]) -> Iterator[tuple[int, GenerationResult]]:
        waiting = deque(enumerate(requests))
        running: dict[int, Generation] = {}
        try:
            while waiting or running:
                while waiting and self.free_slots:
                    index, request = waiting.popleft()
                    running[index] = self.begin(request)
                self.step()
                for index, generation in list(running.items()):
                    generation.take()
                    if generation.done:
                        del running[index]
                        yield index, generation.result
        finally:
            for generation in running.values():
                self.cancel(generation)

    def clear_cache(self) -> None:
        """Forget every sequence's KV cache (the next prompts are evaluated in full)."""
        if self.decoder.live:
            raise RuntimeError("clear_cache needs an idle engine: generations are running")
        self.decoder.forget()

    def embedder(self) -> Embedder:
        """Embeddings from this model (:mod:`adaptive_llama.runtime.embeddings`): a context of
        their own, made on the first call, over the same weights."""
        with self._embedder_lock:
            if self._embedder is None:
                self._embedder = Embedder(self._model, self.path.name, self.threads)
            return self._embedder

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
        if self.decoder.speculation is not None:
            self.decoder.speculation.close()
        self.decoder.close()
        self._close_context(self.decoder.watchdog)

    def _close_context(self, watchdog) -> None:
        if self.rpc:
            watchdog.stop()
        self._context.close()
        self._model.close()


def _checked_arguments(*, n_gpu_layers, n_ctx, n_threads, parallel, backend_sampling, rpc,
                       rpc_timeout, tensor_split, draft, draft_max, reference_attention
                       ) -> tuple[list[str], list[float] | None]:
    """Engine's arguments checked (InvalidArgument naming the first that is wrong): the
    workers' endpoints and the shares, as the engine takes them."""
    check_int("n_gpu_layers", n_gpu_layers, low=-1)
    check_int("n_ctx", n_ctx, low=0, high=MAX_CTX)
    if 0 < n_ctx < CTX_STEP:
        raise InvalidArgument(f"`n_ctx` has to be 0 (the model's own) or at least "
                              f"{CTX_STEP}, but is {n_ctx}", "n_ctx")
    if n_threads is not None:
        check_int("n_threads", n_threads, low=1, high=MAX_THREADS)
    check_int("parallel", parallel, low=1)
    if not isinstance(backend_sampling, bool):
        raise InvalidArgument(f"`backend_sampling` has to be True or False, but is "
                              f"{backend_sampling!r}", "backend_sampling")
    endpoints = Engine._endpoints(rpc)
    if not (isinstance(rpc_timeout, (int, float)) and not isinstance(rpc_timeout, bool)
            and 0 < rpc_timeout < math.inf):
        raise InvalidArgument(f"`rpc_timeout` has to be a number of seconds above 0, but "
                              f"is {rpc_timeout!r}", "rpc_timeout")
    if tensor_split is not None:
        tensor_split = check_shares("tensor_split", tensor_split,
                                    llama_cpp.llama_max_devices())
    check_int("draft_max", draft_max, low=1, high=N_BATCH - 1)
    if draft is not None and not (isinstance(draft, (str, Path)) and str(draft)):
        raise InvalidArgument(f"`draft` has to be \"ngram\" or a draft model, but is "
                              f"{draft!r}", "draft")
    if draft is not None and backend_sampling:
        raise InvalidArgument("speculative decoding samples at every drafted position "
                              "on the CPU, and backend sampling samples in the graph: "
                              "drop one of the two", "draft")
    if reference_attention not in (None, True, False):
        raise InvalidArgument(f"`reference_attention` has to be True, False or None, but "
                              f"is {reference_attention!r}", "reference_attention")
    if endpoints and backend_sampling:
        raise InvalidArgument("backend sampling runs in the graph of the device that "
                              "holds the output layer, which an RPC worker cannot do "
                              "here: drop one of the two", "backend_sampling")
    return endpoints, tensor_split

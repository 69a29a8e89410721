"""The models one server serves, as ollama serves them.

Each model has a friendly name (``smollm2``, or the file's stem in lower case; see
:func:`served_name`) and is loaded on its first request. At most ``max_loaded`` are loaded
at once: loading one more first unloads the least recently used model that is idle (no
request running or waiting). When every loaded model is busy, the request waits for one to
become idle, up to ``LOAD_WAIT_S``, then gets 503. A loaded model idle for its
``keep_alive`` seconds is unloaded: the last request's ``keep_alive``, else the server's
(``--keep-alive``); infinite keeps it, 0 unloads it as soon as it is idle.

A request holds its model from the moment it names it (:meth:`ModelPool.use`) until its
generation is queued; from then on the model's scheduler counts it until it ends. A model is
unloaded only when neither holds it, so no request ever sees a closed engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..llama import rpc
from ..runtime.chat_template import ChatTemplate, TemplateError
from ..runtime.engine import ContextOverflow, Engine, InvalidArgument
from ..runtime.gguf_header import GGUFHeader, read_header
from ..runtime.models import BUNDLED
from ..runtime.reasoning import template_format
from ..samplers import SamplerSpec, SpecError
from .errors import APIError
from .scheduler import Job, QueueFull, Scheduler

log = logging.getLogger("adaptive_llama.server")

FOREVER = math.inf
LOAD_WAIT_S = 120.0  # a request for an unloaded model waits this long for room
FAREWELL_S = 1.0     # for the answers to requests when the process must end
ROOM_POLL_S = 0.1
UNLOAD_POLL_S = 0.5  # how often idle models are looked at
RETRY_AFTER_S = 5
# Longer than anyone keeps a server up, and far below what a date can hold: a keep_alive
# beyond it means for ever (1e308 seconds would overflow every expiry date shown).
MAX_KEEP_ALIVE_S = 100 * 365.25 * 86400
# Go's duration syntax, as ollama's keep_alive takes it: "5m", "1h30m", "-1s", "90s".
_DURATION = re.compile(r"([+-]?)((?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_NAME = re.compile(r"[a-z0-9][a-z0-9._:-]*")


def keep_alive_s(value: float | int | str) -> float:
    """Seconds from ollama's ``keep_alive``: a number of seconds, or a duration such as
    "5m", "1h30m" or "300" (seconds); negative, or more than :data:`MAX_KEEP_ALIVE_S`,
    means for ever. ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"has to be a duration such as \"5m\" or a number of seconds, "
                         f"but is {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            if not _DURATION.fullmatch(text):
                raise ValueError(f"has to be a duration such as \"5m\", \"1h\" or \"30s\" "
                                 f"(or -1: for ever), but is {value!r}") from None
            seconds = sum(float(n) * _UNIT_S[unit] for n, unit in
                          _DURATION_PART.findall(text))
            seconds = -seconds if text.startswith("-") else seconds
    if math.isnan(seconds):
        raise ValueError("has to be a number of seconds, but is NaN")
    return FOREVER if seconds < 0 or seconds > MAX_KEEP_ALIVE_S else seconds


def served_name(model: str, path: Path) -> str:
    """The name a model is served under: ``NAME`` of a ``NAME=PATH`` argument, a bundled
    model's short name, else the file's stem in lower case
    (``Llama-3.2-1B-Instruct-Q4_K_M.gguf`` -> ``llama-3.2-1b-instruct-q4_k_m``)."""
    for bundled in BUNDLED.values():
        # planned_path: where a model shipped in parts is joined, without joining it now
        if model == bundled.name or (bundled.installed() and path == bundled.planned_path()):
            return bundled.name
    return path.stem.lower()


def split_named(argument: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> (NAME, PATH); anything else (a path, a bundled name) -> (None, it).
    ValueError for a NAME ollama's clients could not send."""
    name, sep, model = argument.partition("=")
    if not sep or Path(argument).expanduser().exists():
        return None, argument
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} cannot name a model: use lower-case letters, digits "
                         "and . _ : - (NAME=PATH)")
    return name, model


@dataclass(frozen=True, eq=False)
class ServedModel:
    """A model the server may serve: its name, its file, how to load it, its sampler, and
    the chat template it is served with in place of its own (None: its own)."""

    name: str
    path: Path
    load: Callable[[], Engine]
    sampler: SamplerSpec
    chat_template: str | None = None

    @functools.cached_property
    def header(self) -> GGUFHeader:
        """The GGUF's header (its metadata and size), read once, without loading it."""
        return read_header(self.path)

    @property
    def template_source(self) -> str:
        """The chat template it is served with ("" if none)."""
        return self.chat_template or self.header.chat_template

    @functools.cached_property
    def calls_tools(self) -> bool:
        """Whether its template shows tools and asks for calls this server reads back."""
        source = self.template_source
        try:
            return bool(source) and ChatTemplate(source, bos="", eos="",
                                                 specials=lambda: None).tool_calls_hermes
        except TemplateError:  # loading the model says what is wrong with it
            return False

    @property
    def thinks(self) -> bool:
        """Whether it is a reasoning model, as far as its header says without loading it:
        its template writes or reads the thinking (loaded, the engine also checks that the
        marks are tokens of its vocabulary)."""
        return template_format(self.template_source) is not None

    def answers_to(self, name: str) -> bool:
        """Whether a request naming ``name`` means this model: its name (with ollama's
        ``:latest`` or not), its file name or stem, in any case."""
        asked = name.strip().lower()
        return asked.removesuffix(":latest") == self.name or asked in (
            self.path.name.lower(), self.path.stem.lower())


class LoadedModel:
    """A model in memory: its engine and the scheduler running that engine's slots."""

    def __init__(self, served: ServedModel, engine: Engine, max_queue: int,
                 keep_alive: float):
        self.served = served
        self.name = served.name
        self.sampler = served.sampler
        self.engine = engine
        self.scheduler = Scheduler(engine, max_queue)
        self.keep_alive = keep_alive
        self.holders = 0  # requests that named it and have not queued their job yet
        self._released = time.monotonic()

    @property
    def busy(self) -> bool:
        return self.holders > 0 or self.scheduler.accepted > 0

    def hold(self) -> None:
        self.holders += 1

    def release(self) -> None:
        self.holders -= 1
        self._released = time.monotonic()

    def idle_since(self) -> float:
        """When its last request let go of it (monotonic clock)."""
        return max(self._released, self.scheduler.last_done)

    def expires_at(self) -> float:
        """When it will be unloaded if nothing uses it (monotonic clock; inf: never)."""
        start = time.monotonic() if self.busy else self.idle_since()
        return start + self.keep_alive

    def job(self, prompt_tokens: list[int], *, sampler: SamplerSpec, max_tokens: int | None,
            seed: int | None, stop: list[str], stream: bool, logprobs: int | None = None,
            grammar=None, format_field: str = "", prompt_field: str, route: str = "",
            thinking: bool = True, reasoning_sampler: SamplerSpec | None = None,
            reasoning_budget: int | None = None, logit_bias=()) -> Job:
        """The engine's checked request as the scheduler takes it, or the 400 that says why
        not: a prompt that leaves no room in the context window (named as
        ``prompt_field``), a sampler or a grammar (asked for by ``format_field``) the engine
        cannot run here (backend sampling runs fewer, and no grammar), logprobs it cannot
        give. ``max_tokens`` None or beyond the room: the room. ``thinking``: a reasoning
        model's thinking comes apart from its answer (False: one text), chosen by
        ``reasoning_sampler`` and bounded by ``reasoning_budget`` (None: the engine's).
        ``logit_bias``: (token id, bias) pairs added to the logits."""
        try:
            request = self.engine.request(prompt_tokens, sampler=sampler,
                                          max_tokens=max_tokens, seed=seed, stop=stop,
                                          logprobs=logprobs, grammar=grammar,
                                          thinking=thinking,
                                          reasoning_sampler=reasoning_sampler,
                                          reasoning_budget=reasoning_budget,
                                          logit_bias=logit_bias)
        except SpecError as exc:
            param = format_field if grammar is not None and sampler.in_graph \
                else "sampler"
            raise APIError(400, f"{param}: {exc}", param=param,
                           code="invalid_sampler") from None
        except ContextOverflow as exc:
            raise APIError(400, str(exc), param=prompt_field,
                           code="context_length_exceeded") from None
        except InvalidArgument as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        return Job(request=request, stream=stream, loop=asyncio.get_running_loop(),
                   label=f"{route} {self.name}")

    def submit(self, job: Job) -> None:
        """Queue the job, or 503 with Retry-After when the queue is full."""
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            raise APIError(503, f"the server is busy: {exc.waiting} requests are waiting; "
                           f"retry in {RETRY_AFTER_S} s", type="server_busy",
                           code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def close(self) -> None:
        self.scheduler.stop()
        self.engine.close()


class ModelPool:
    """The models a server may serve (the first is the default) and the ones loaded now."""

    def __init__(self, models: Sequence[ServedModel], *, max_loaded: int, keep_alive: float,
                 max_queue: int):
        if not models:
            raise ValueError("a server needs at least one model")
        names = [m.name for m in models]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two models are named {twice[0]!r}: name one with NAME=PATH")
        if not (isinstance(max_loaded, int) and max_loaded >= 1):
            raise ValueError(f"`max_loaded` has to be at least 1, but is {max_loaded!r}")
        if not keep_alive >= 0:
            raise ValueError(f"`keep_alive` has to be >= 0 seconds, but is {keep_alive!r}")
        self.models = tuple(models)
        self.max_loaded = max_loaded
        self.keep_alive = keep_alive
        self._answers_when_lost = False  # fail_all registered with llama.cpp's abort
        self.max_queue = max_queue
        self._loaded: dict[str, LoadedModel] = {}
        self._room = asyncio.Lock()  # one load (and the unloading it needs) at a time

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def loaded(self) -> list[LoadedModel]:
        return list(self._loaded.values())

    def _loaded_model(self, model: ServedModel, engine: Engine) -> LoadedModel:
        if engine.rpc and not self._answers_when_lost:
            # A worker lost ends the process: waiting clients get an error, not a reset.
            rpc.on_abort(self.fail_all)
            self._answers_when_lost = True
        return LoadedModel(model, engine, self.max_queue, self.keep_alive)

    def fail_all(self, reason: str) -> None:
        """Answer every running and waiting request with a server error saying ``reason``,
        and give the event loop a moment to send the answers: llama.cpp is about to end the
        process (an RPC worker lost)."""
        for model in self.loaded:
            model.scheduler.fail_all(RuntimeError(reason))
        time.sleep(FAREWELL_S)

    def find(self, name: str | None, *, any_name_for_one: bool = False) -> ServedModel:
        """The model a request names (None: the default); with ``any_name_for_one``, any
        name reaches a server's only model (OpenAI clients often insist on a name of their
        own). APIError 404 that lists the served names otherwise."""
        if name is None or (any_name_for_one and len(self.models) == 1):
            return self.default
        for model in self.models:
            if model.answers_to(name):
                return model
        raise APIError(404, f"model {name!r} not found; this server serves "
                       f"{', '.join(m.name for m in self.models)}", param="model",
                       code="model_not_found")

    def load_now(self, model: ServedModel) -> LoadedModel:
        """Load ``model`` before serving (the default, so that a broken file stops the
        server at its start); no room is made."""
        loaded = self._loaded_model(model, model.load())
        self._loaded[model.name] = loaded
        return loaded

    @contextlib.asynccontextmanager
    async def use(self, model: ServedModel, keep_alive: float | None = None):
        """The loaded model, held while the block runs (loaded first when it is not);
        ``keep_alive`` (seconds) replaces its idle time before unloading."""
        loaded = self._loaded.get(model.name) or await self._load(model)
        loaded.hold()  # no await since the lookup: nothing unloaded it in between
        if keep_alive is not None:
            loaded.keep_alive = keep_alive
        try:
            yield loaded
        finally:
            loaded.release()

    async def _load(self, model: ServedModel) -> LoadedModel:
        async with self._room:
            loaded = self._loaded.get(model.name)  # another request may have loaded it
            if loaded is not None:
                return loaded
            await self._make_room()
            log.info("loading %s (%s)", model.name, model.path)
            started = time.perf_counter()
            try:
                engine = await asyncio.to_thread(model.load)
            except Exception as exc:  # a damaged file, no memory: the server keeps serving
                log.warning("could not load %s: %s", model.name, exc)
                raise APIError(500, f"model {model.name!r} could not be loaded: {exc}",
                               type="server_error", param="model") from None
            loaded = self._loaded_model(model, engine)
            self._loaded[model.name] = loaded
            log.info("loaded %s in %.1f s", model.name, time.perf_counter() - started)
            return loaded

    async def _make_room(self) -> None:
        deadline = time.monotonic() + LOAD_WAIT_S
        while len(self._loaded) >= self.max_loaded:
            idle = [m for m in self._loaded.values() if not m.busy]
            if idle:
                await self._unload(min(idle, key=LoadedModel.idle_since))
                continue
            if time.monotonic() >= deadline:
                raise APIError(503, f"every loaded model is busy ({self.max_loaded} at "
                               f"most, adaptive-llama serve --max-loaded); retry in "
                               f"{RETRY_AFTER_S} s", type="server_busy", code="models_busy",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            await asyncio.sleep(ROOM_POLL_S)

    async def _unload(self, loaded: LoadedModel) -> None:
        # Out of the table first, with no await before: no request can take it after this.
        if self._loaded.get(loaded.name) is not loaded:
            return
        del self._loaded[loaded.name]
        log.info("unloading %s", loaded.name)
        await asyncio.to_thread(loaded.close)

    async def unload_expired(self) -> None:
        """Unload every model idle for its keep-alive time."""
        now = time.monotonic()
        for loaded in self.loaded:
            if not loaded.busy and now >= loaded.expires_at():
                await self._unload(loaded)

    async def keep_unloading(self) -> None:
        """Unload idle models as their keep-alive ends, until cancelled (a server task)."""
        while True:
            await asyncio.sleep(UNLOAD_POLL_S)
            await self.unload_expired()

    def close(self) -> None:
        for loaded in self._loaded.values():
            loaded.close()
        self._loaded.clear()

"""What the OpenAI and Ollama routes share, and all they share: the server's state
(:class:`Server`: the models it serves, :mod:`.pool`, whose names they import from here), the
rules of a request (its body read and checked off
the event loop, its messages, the sampler its options ask for, the room its prompt leaves),
and the bounds on what one request may hold.

Scheduling, for each loaded model: up to ``--parallel`` generations decode together on
its worker thread, one token of each per step (continuous batching: a new request joins between two steps). At
most ``max_queue`` more wait, in arrival order; one more gets 503 with ``Retry-After``. A
client that disconnects stops its generation at the next token, and its slot goes to the
next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from typing import Annotated, Callable, Literal, TypeVar

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from ..llama.grammar import UnsupportedSchema, gbnf_grammar, json_grammar
from ..runtime.embeddings import Embedder
from ..runtime.engine import Engine, GenerationResult, InvalidArgument
from ..runtime.reasoning import Thought, without_thinking
from ..runtime.tools import ToolCall, ToolCallReader, calls_grammar
from ..samplers import (DRY_SEQUENCE_BREAKERS, SamplerSpec, SpecError, parse_spec,
                        spec_from_options)
from .errors import APIError, too_large
from .pool import FOREVER, LoadedModel, ModelPool, ServedModel, keep_alive_s  # noqa: F401
from .scheduler import Job

log = logging.getLogger("adaptive_llama.server")
T = TypeVar("T")

DISCONNECT_POLL_S = 0.25
MAX_BODY = 2 * 2**20  # bytes: about 500k tokens of text, more than any context holds
# finish reasons of the engine -> OpenAI's ("interrupted" only reaches a client that left).
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length",
                  "interrupted": "stop"}

# Bounds on what one request may hold: far beyond what a context window takes, small enough
# that checking a body costs milliseconds (a 2 MiB body held 600k messages).
MAX_MESSAGES = 4096
MAX_PARTS = 256  # content parts of one message
MAX_STOPS = 16  # OpenAI allows 4
MAX_PROMPTS = 16  # a list of prompts: more than one is refused in words (one per request)
MAX_EMBED_INPUTS = 256  # texts embedded in one request (OpenAI takes 2048)
MAX_TOOLS = 128  # functions offered in one request (OpenAI's limit)
MAX_CALLS = 64  # tool calls in one assistant message

# Strict types, as OpenAI's: "5" is not a number and "yes" not a boolean. Unknown fields
# (user, ...) are ignored, as most local servers do, so that clients sending their full
# default set keep working; fields that would change the reply and that the server does not
# do are refused (a body's UNSUPPORTED: field -> the values that change nothing).
STRICT = ConfigDict(extra="ignore", strict=True)


class ContentPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


# OpenAI's rule for a function's name; it also keeps names out of the template's markup.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; None: any object
    strict: bool | None = None  # the grammar enforces the schema when a call is required


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=FUNCTION_NAME)  # a call sent back names an offered function
    arguments: str | dict = "{}"  # OpenAI's: JSON text; Ollama's: an object


class ToolCallMessage(BaseModel):
    """A call in an assistant message sent back: OpenAI's (with ``id`` and ``type``) or
    Ollama's (only ``function``)."""
    model_config = STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None
    images: list | None = None  # Ollama's
    tool_calls: Annotated[list[ToolCallMessage], Field(max_length=MAX_CALLS)] | None = None
    tool_call_id: str | None = None  # OpenAI's, in a tool's result
    name: str | None = None
    tool_name: str | None = None  # Ollama's name of the tool in its result
    # A reasoning model's thinking sent back with its answer (llama.cpp's and DeepSeek's
    # field, Ollama's): never shown to the model again, as reasoning models' templates do.
    reasoning_content: str | None = None
    thinking: str | None = None

    def as_template_message(self, index: int) -> dict:
        """The message for the chat template; 400 for a part the model cannot read."""
        where = f"messages.{index}"
        if self.images:
            raise APIError(400, f"`{where}.images`: the model has no vision support; send "
                           "text only",
                           param=f"{where}.images", code="unsupported_field")
        content = self.content or ""
        if not isinstance(content, str):
            for i, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"`{where}.content.{i}`: the model has no vision "
                                   f"or audio support; send text parts only, not "
                                   f"{part.type!r}",
                                   param=f"{where}.content", code="unsupported_field")
            content = "".join(part.text for part in content)
        # Chat templates know "system"; OpenAI's newer "developer" role means the same.
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call, f"{where}.tool_calls.{i}")
                                     for i, call in enumerate(self.tool_calls)]
        if self.role == "tool":
            message.update(tool_call_id=self.tool_call_id, name=self.name or self.tool_name)
        return message


def _template_call(call: ToolCallMessage, where: str) -> dict:
    """A call sent back, as chat templates take it: the arguments an object (Hugging Face's
    convention), not OpenAI's JSON text."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise APIError(400, f"`{where}.function.arguments` has to be a JSON object (as "
                           "text)", param=f"{where}.function.arguments")
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


async def chat_prompt(request: Request, engine: Engine, messages: list[Message],
                      tools: list[Tool] | None = None, thinking: bool | None = None,
                      field: str = "messages") -> list[int]:
    """The conversation's tokens in the model's chat template, with ``tools`` shown to the
    model (:func:`template_prompt`); earlier answers without their thinking."""
    rendered = [m.as_template_message(i) for i, m in enumerate(messages)]
    if engine.thinking is not None:
        rendered = [without_thinking(m, engine.thinking) for m in rendered]
    offered = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    return await template_prompt(request, engine, rendered, offered, thinking, field)


async def template_prompt(request: Request, engine: Engine, messages: list[dict],
                          tools: list[dict] | None = None, thinking: bool | None = None,
                          field: str = "messages") -> list[int]:
    """The tokens of ``messages`` (the chat template's dicts) in the model's chat template,
    rendered off the event loop (a long conversation must not stall other requests) and
    stopped when the client leaves; a 400 on ``field`` (where the request holds the
    messages) when the model has no template or its template rejects the roles given or
    passes its bounds. ``thinking`` False: the template's ``enable_thinking`` false."""
    def render(cancelled: threading.Event) -> list[int]:
        return engine.chat_prompt_tokens(messages, tools, cancelled, thinking)
    try:
        return await _watched(request, render)
    except APIError:
        raise
    except Exception as exc:  # the template's own error, whatever its kind
        raise APIError(400, f"{field}: {exc}", param=field) from None


async def _watched(request: Request, work: Callable[[threading.Event], T]) -> T:
    """``work(cancelled)`` off the event loop; when the client leaves, ``cancelled`` is set
    (the work stops) and the answer is a 499, which nobody reads."""
    cancelled = threading.Event()
    task = asyncio.ensure_future(asyncio.to_thread(work, cancelled))
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
                raise APIError(499, "the client disconnected")
        return task.result()
    finally:
        cancelled.set()


def check_tools(model: LoadedModel, tools: list[Tool]) -> list[str]:
    """The names of the functions offered; a 400 when the model's template cannot show
    tools or ask for calls this server reads, or when two functions share a name."""
    if not model.served.calls_tools:
        raise APIError(400, f"`tools`: the chat template of {model.name} has no tool support "
                       "(or writes calls in a format other than Hermes's <tool_call> JSON); "
                       "serve it with a template that has, e.g. --chat-template chatml-tools "
                       "for a ChatML model", param="tools", code="unsupported_field")
    names = [t.function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise APIError(400, f"`tools`: two functions are named {twice[0]!r}", param="tools")
    return names


class SamplingFields(BaseModel):
    """The sampling options both protocols take beside their own, under llama-server's and
    Ollama's names: truncation, mirostat, and the modifiers (penalties, DRY, top-n-sigma,
    XTC; see :data:`adaptive_llama.samplers.MODIFIER_OPTIONS`). Their ranges are the sampler
    table's, checked in :func:`sampler_for`."""

    model_config = STRICT

    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    typical_p: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    adaptive_target: float | None = None
    adaptive_decay: float | None = None
    repeat_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repeat_last_n: int | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None

    def sampling_options(self) -> dict:
        """These fields as :func:`adaptive_llama.samplers.spec_from_options` takes them."""
        return {name: getattr(self, name) for name in SamplingFields.model_fields}


# llama-server's request fields (tools/server/README.md) that this server does not do, with
# the values that change nothing, as its clients send them by default: any other value is
# a 400 naming the field. Its other fields are done, or change nothing here: n_keep and
# cache_prompt (the context is never shifted; prompts are always cached), id_slot. DRY runs
# with llama.cpp's sequence breakers: clients that send them (SillyTavern does) are served.
LLAMA_SERVER_UNDONE: dict[str, tuple] = {
    "dry_sequence_breakers": (None, list(DRY_SEQUENCE_BREAKERS)),
    "dynatemp_range": (None, 0, 0.0), "dynatemp_exponent": (None, 1, 1.0),
    "min_keep": (None, 0, 1), "samplers": (None,), "n_indent": (None, 0),
    "t_max_predict_ms": (None, 0), "image_data": (None, []), "multimodal_data": (None, []),
    "lora": (None, []), "post_sampling_probs": (None, False), "return_tokens": (None, False),
    "response_fields": (None, []), "timings_per_token": (None, False),
    "return_progress": (None, False), "chat_template_kwargs": (None, {}),
    "thinking_forced_open": (None, False), "n_cmpl": (None, 1)}


def reasoning_sampler(text: str | None, param: str) -> SamplerSpec | None:
    """The spec of a request's ``reasoning_sampler`` (None: the engine's), or a 400."""
    if text is None:
        return None
    try:
        return parse_spec(text)
    except SpecError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_sampler") from None


def thinking_switch(engine: Engine, budget: int | None) -> bool | None:
    """The chat template's ``enable_thinking`` for a request's thinking budget: false for
    a budget of 0 where the template can turn thinking off (elsewhere the engine closes
    the thinking as soon as it opens), else the template's default."""
    return False if budget == 0 and engine.can_turn_thinking_off() else None


def sampler_for(default: SamplerSpec, *, param: str = "sampler", prefix: str = "",
                **options) -> SamplerSpec:
    """:func:`adaptive_llama.samplers.spec_from_options`, its error a 400 naming the option
    that was wrong (``prefix`` + its name: ``options.repeat_penalty``), else ``param``."""
    try:
        return spec_from_options(default, **options)
    except SpecError as exc:
        where = prefix + exc.param if exc.param else param
        raise APIError(400, f"{where}: {exc}", param=where, code="invalid_sampler") from None


class Server:
    """The routes' shared state: the models (:class:`.pool.ModelPool`) and the embeddings'
    own model, if one was given."""

    def __init__(self, pool: ModelPool, embedder: Embedder | None = None):
        self.pool = pool
        self._embedder = embedder

    @contextlib.asynccontextmanager
    async def model(self, name: str | None, *, keep_alive: float | None = None,
                    any_name_for_one: bool = False):
        """The model a request names, loaded and held while the block runs; 404 for a name
        no model answers to (:meth:`.pool.ModelPool.find`)."""
        async with self.pool.use(self.pool.find(name, any_name_for_one=any_name_for_one),
                                 keep_alive) as model:
            yield model

    async def embed(self, name: str | None, items: list[str | list[int]], field: str, *,
                    truncate: bool = False, any_name_for_one: bool = False
                    ) -> tuple[str, np.ndarray, int]:
        """The embedding model's name, the unit vectors of texts or token lists (one row
        each) and the tokens they held, computed off the event loop by the server's
        embeddings model (``--embedding-model``, whatever the name) or else the model
        ``name``; a 400 naming ``field.i`` for an input that is empty, too long
        (``truncate``: cut to the longest the model embeds instead) or not tokens of the
        model."""
        if self._embedder is not None:
            return self._embedder.name, *await _embedded(self._embedder, items, field,
                                                         truncate)
        async with self.model(name, any_name_for_one=any_name_for_one) as model:
            embedder = await asyncio.to_thread(model.engine.embedder)
            return model.name, *await _embedded(embedder, items, field, truncate)


async def _embedded(embedder: Embedder, items: list[str | list[int]], field: str,
                    truncate: bool) -> tuple[np.ndarray, int]:
    def run():
        inputs = [embedder.tokenize(x) if isinstance(x, str) else x for x in items]
        if truncate:
            inputs = [tokens[:embedder.max_tokens] for tokens in inputs]
        embedder.check(inputs, field)
        return embedder.embed(inputs), sum(map(len, inputs))
    try:
        return await asyncio.to_thread(run)
    except InvalidArgument as exc:
        raise APIError(400, str(exc), param=exc.param) from None


async def wait(request: Request, job: Job) -> GenerationResult:
    """The job's result, for an answer in one piece; a client that leaves stops the job
    (and gets 499, which nobody reads)."""
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                what, value = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                what = value = None
            if what == "error":
                raise APIError(500, f"generation failed: {value}", type="server_error")
            if what == "done":  # the result holds the whole text; pieces are for streams
                return value
            # Pieces arrive every few ms, so look for a client that left on a clock.
            if loop.time() - checked >= DISCONNECT_POLL_S:
                checked = loop.time()
                if await request.is_disconnected():
                    raise APIError(499, "the client disconnected")  # finally: stops the job
    finally:
        job.cancelled.set()  # no-op once done; stops the generation if we were cancelled


async def reply_parts(job: Job, functions: list[str]):
    """A streamed reply as its parts come, for the routes that send thinking, text and
    calls as items or blocks of their own (Responses, Messages): ``("thinking", text)``,
    ``("text", text)``, ``("call", ToolCall)`` (with ``functions``, the calls read out of
    the text), then ``("done", result)`` or ``("error", message)``. Text of white space
    only waits for the text after it, and goes where a call or the end follows it: a
    client then gets no text block of a line break before a call. The client leaving
    stops the generation at its next token."""
    reader = ToolCallReader(functions) if functions else None
    space = ""  # white space waiting for text
    try:
        while True:
            what, value = await job.events.get()
            if what == "error":
                yield "error", value
                return
            if what == "piece" and isinstance(value[0], Thought):
                yield "thinking", str(value[0])
                continue
            parts = ([] if what == "done" else reader.feed(value[0]) if reader
                     else [value[0]])
            if what == "done" and reader:
                parts = reader.finish()
            for part in parts:
                if isinstance(part, ToolCall):
                    space = ""
                    yield "call", part
                elif (space + part).strip():
                    yield "text", space + part
                    space = ""
                else:
                    space += part
            if what == "done":
                yield "done", value
                return
    finally:
        job.cancelled.set()


async def reply_events(job: Job, functions: list[str], writer):
    """A streamed reply in an API's own events: what ``writer`` (that API's events of one
    reply) makes of its start (``start()``), of each part of :func:`reply_parts`
    (``text(kind, text)`` for thinking and text, ``call(call)``) and of its end
    (``end(result)``, or ``failed(message)``), each a list of events."""
    for event in writer.start():
        yield event
    async for kind, value in reply_parts(job, functions):
        if kind in ("thinking", "text"):
            batch = writer.text(kind, value)
        elif kind == "call":
            batch = writer.call(value)
        elif kind == "done":
            batch = writer.end(value)
        else:
            batch = writer.failed(value)
        for event in batch:
            yield event


async def grammar_for(schema: dict | str | None, field: str):
    """The grammar of JSON output that ``schema`` accepts, or of a GBNF text (None: no
    grammar), built off the event loop; a 400 naming ``field`` for a schema it cannot
    enforce or a grammar llama.cpp cannot parse."""
    if schema is None:
        return None
    if isinstance(schema, str):
        return await _grammar(gbnf_grammar, field, schema)
    return await _grammar(json_grammar, field, schema)


async def calls_grammar_for(tools: list[Tool], *, parallel: bool):
    """The grammar of a reply made of calls to ``tools`` (one, or with ``parallel`` one or
    more), built off the event loop; a 400 on ``tools`` for parameters it cannot enforce."""
    functions = [(t.function.name, t.function.parameters) for t in tools]
    return await _grammar(calls_grammar, "tools", functions, parallel=parallel)


async def _grammar(build, field: str, *args, **kwargs):
    try:
        return await asyncio.to_thread(build, *args, **kwargs)
    except UnsupportedSchema as exc:
        raise APIError(400, f"`{field}`: {exc}", param=field,
                       code="unsupported_schema") from None


def server_of(request: Request) -> Server:
    return request.app.state.server


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body, whatever the Content-Type says (curl users often send none; see
    :mod:`.guard` for the types refused).

    Read at most the app's ``max_body`` bytes (413 beyond), then decoded and validated off the event
    loop (:func:`_decode`).
    """
    max_body = request.app.state.max_body
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body:
                raise too_large(max_body)
    except ClientDisconnect:
        log.warning("%s %s: the client left while sending its body", request.method,
                    request.url.path)
        raise APIError(400, "the body ended early: the client disconnected") from None
    return await asyncio.to_thread(_decode, bytes(raw), model)


def _decode(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The body as ``model``, or the 400 that says what is wrong with it."""
    try:
        data = json.loads(raw or b"null")
        if not isinstance(data, dict):
            raise APIError(400, "the body has to be a JSON object")
        _refuse_unsupported(data, getattr(model, "UNSUPPORTED", {}))
        return model.model_validate(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None
    except ValidationError as exc:
        errors = exc.errors()
        # A field that takes a string or a list fails once per kind; the error of the kind
        # that was sent (a list too long) says more than "not a string".
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        where = ".".join(str(part) for part in first["loc"] if not _is_type_tag(part))
        given = f" (got {_short(first['input'])})" if "input" in first and where else ""
        raise APIError(400, f"`{where}`: {first['msg']}{given}", param=where) from None


def _is_type_tag(part) -> bool:
    """pydantic's name for one kind of a union (``str``, ``list[str]``, ``ContentPart``) in
    an error's location, where field names and indexes are what a client can act on."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict")
                                      or "[" in part or part[:1].isupper())


def _refuse_unsupported(data: dict, fields: dict[str, tuple]) -> None:
    """400 naming the first field that asks for something this server does not do (JSON
    mode, tools, ...): answering it with plain text would look like success."""
    for name, harmless in fields.items():
        if name in data and not any(data[name] == h and type(data[name]) is type(h)
                                    for h in harmless):
            raise APIError(400, f"`{name}` is not supported by this server; remove it "
                           f"(accepted: {' or '.join(json.dumps(h) for h in harmless)})",
                           param=name, code="unsupported_field")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

"""Ollama-compatible routes, beside the OpenAI ones, for desktop clients that speak Ollama's API.

``GET /api/version``, ``GET /api/tags``, ``POST /api/show``, ``POST /api/embed`` (and the older
``/api/embeddings``), ``POST /api/chat`` and ``POST /api/generate``: newline-delimited JSON as pieces come (the default), or one object
with ``"stream": false``. The same queue, slots, API key and limits as the OpenAI routes; errors
in Ollama's shape, ``{"error": "message"}``, with the HTTP status.

``options``: ``temperature`` (0: greedy), ``seed``, ``num_predict`` (max new tokens; -1 or
absent: until the context is full), ``stop``, ``num_ctx`` (this request's window, inside the
slot's), and the sampler: our ``sampler`` spec (``"adaptive:eps=0.001"``), or, without it,
``mirostat`` 1 or 2, or Ollama's truncation options (``top_k`` above 0, ``typical_p`` and
``top_p`` below 1, ``min_p`` above 0: all that are given cut, in that order, the last at the
default sampler's temperature); penalties (``repeat_penalty``,
``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``) and llama-server's DRY, XTC and
top-n-sigma options join their modifiers (:class:`.common.SamplingFields`). Without any of them
the server's default sampler runs (:func:`.common.sampler_for`, shared with the OpenAI routes).
Options that set up a model (``num_gpu``, ``num_thread``, ...) are accepted and ignored: the
server sets them when it starts.

``format``: ``"json"`` (any JSON object) or a JSON schema constrains the reply with a grammar
(:mod:`adaptive_llama.llama.grammar`); a schema keyword it cannot enforce is a 400 naming it.
``tools`` (chat) are shown to the model in its chat template, and the calls it writes come back
in ``message.tool_calls``, arguments as an object (:mod:`adaptive_llama.runtime.tools`).

``think`` (reasoning models, as Ollama 0.12): a reasoning model's thinking comes back in
``message.thinking`` (``thinking`` on ``/api/generate``), apart from the answer, unless
``think`` is false: then the template turns the thinking off where it can (Qwen3's
``enable_thinking``), and a model that cannot is a 400. ``think`` true on a model that does
not think is a 400, as in Ollama; its levels ("low", "medium", "high") set the thinking
budget (docs/reasoning.md), and ``options.reasoning_sampler`` the thinking's sampler.

Models (:mod:`.pool`): ``model`` names one the server serves (``/api/tags`` lists them,
``/api/ps`` the loaded ones, with when each will be unloaded); an unknown name gets 404. The
model loads on its first request; ``keep_alive`` (``"5m"``, seconds, ``-1`` for ever, ``0``
to unload once idle) sets how long it stays loaded after the request, as in Ollama; a
``/api/generate`` without a prompt (or ``/api/chat`` without messages) loads it, or with
``keep_alive`` 0 unloads it.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
import math
import time
from importlib import metadata
from typing import Annotated, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from ..llama.grammar import ANY_OBJECT
from ..runtime.engine import GenerationResult
from ..runtime.models import ModelError
from ..runtime.reasoning import EFFORT_BUDGETS, Thought
from ..runtime.tools import ToolCall, ToolCallReader, parse_reply
from ..samplers import SEED
from .common import (
    FINISH_REASONS,
    FOREVER,
    MAX_EMBED_INPUTS,
    MAX_MESSAGES,
    MAX_STOPS,
    MAX_TOOLS,
    STRICT,
    APIError,
    Job,
    LoadedModel,
    Message,
    SamplingFields,
    ServedModel,
    Server,
    Tool,
    chat_prompt,
    check_tools,
    grammar_for,
    keep_alive_s,
    parse_body,
    reasoning_sampler,
    sampler_for,
    server_of,
    template_prompt,
    wait,
)

router = APIRouter()
log = logging.getLogger("adaptive_llama.server")
NDJSON = "application/x-ndjson"
OLLAMA_API_VERSION = "0.9.0"  # /api/chat, /api/generate with format and options, as here


class Options(SamplingFields):
    model_config = STRICT

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=SEED.high)
    num_ctx: int | None = Field(None, ge=1)
    num_predict: int | None = Field(None, ge=-2)
    stop: list[str] | None = Field(None, max_length=MAX_STOPS)
    sampler: str | None = None
    reasoning_sampler: str | None = None  # a reasoning model's thinking (docs/reasoning.md)


class _Body(BaseModel):
    # As the OpenAI bodies: strict types, unknown fields ignored, fields that would change
    # the reply and are not done here refused.
    model_config = STRICT
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    model: str = Field(min_length=1)
    stream: bool = True
    options: Options = Field(default_factory=Options)
    format: Literal["", "json"] | dict | None = None
    keep_alive: int | float | str | None = None
    think: bool | Literal["low", "medium", "high"] | None = None

    def thinking_wanted(self, engine) -> tuple[bool | None, int | None]:
        """The template's ``enable_thinking`` for this request (None: the template's own
        default) and the thinking budget (None: the engine's, -1: no bound), or the 400
        that says why ``think`` cannot be done."""
        if self.think is None:
            return None, None
        name = self.model
        if engine.thinking is None:
            if self.think is False:
                return None, None
            raise APIError(400, f"`think`: {name} is not a reasoning model (it does not "
                           "think); leave `think` out", param="think")
        if self.think is False:
            if not engine.can_turn_thinking_off():
                raise APIError(400, f"`think`: {name} cannot turn its thinking off (its "
                               "chat template has no enable_thinking); leave `think` out "
                               "or send true", param="think")
            return False, None
        if isinstance(self.think, str):
            return None, EFFORT_BUDGETS[self.think]
        # think: true asks for thinking even where the server's budget is 0
        return None, -1 if engine.thinking_settings.budget == 0 else None

    def keep_alive_wanted(self) -> float | None:
        """Seconds to keep the model loaded after this request (None: as it is)."""
        if self.keep_alive is None:
            return None
        try:
            return keep_alive_s(self.keep_alive)
        except ValueError as exc:
            raise APIError(400, f"`keep_alive` {exc}", param="keep_alive") from None

    def schema_wanted(self) -> dict | None:
        """The JSON schema the reply has to follow; None: plain text."""
        if not self.format:
            return None
        return ANY_OBJECT if self.format == "json" else self.format


class ChatBody(_Body):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None


class GenerateBody(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_Body.UNSUPPORTED, "images": (None, []), "context": (None, []), "suffix": (None, ""),
        "tools": (None, [])}

    prompt: str = ""
    system: str | None = None
    raw: bool = False


class EmbedBody(BaseModel):
    model_config = STRICT
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"dimensions": (None,)}
    model: str = Field(min_length=1)
    keep_alive: int | float | str | None = None  # accepted; the server's keep-alive applies
    input: str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
    truncate: bool = True


class EmbeddingsBody(BaseModel):  # the older /api/embeddings
    model_config = STRICT
    model: str = Field(min_length=1)
    prompt: str


class ShowBody(BaseModel):
    model_config = STRICT
    model: str = Field(min_length=1)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _final_fields(result: GenerationResult) -> dict:
    """The figures Ollama puts in its last object (durations in nanoseconds)."""
    return {
        "done_reason": "length" if FINISH_REASONS[result.finish_reason] == "length" else "stop",
        "total_duration": _ns(result.prompt_eval_s + result.decode_s),
        "load_duration": 0,
        "prompt_eval_count": result.prompt_tokens,
        "prompt_eval_duration": _ns(result.prompt_eval_s),
        "eval_count": result.completion_tokens,
        "eval_duration": _ns(result.decode_s),
        "sampler_stats": result.summary(),
    }


def _line(value: dict) -> bytes:
    return (json.dumps(value, ensure_ascii=False) + "\n").encode()


def _details(model: ServedModel) -> dict:
    """Ollama's ``details``, as ollama writes them: family ``llama``, parameter_size
    ``135M``, quantization_level ``Q4_1``."""
    header = model.header
    family = header.architecture
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else None,
            "parameter_size": header.metadata.get("general.size_label")
            or _size_label(header.n_params),
            "quantization_level": header.quantization}


def _listed(model: ServedModel) -> dict:
    """A model as ``/api/tags`` and ``/api/ps`` list it."""
    header = model.header
    modified = datetime.datetime.fromtimestamp(header.modified, datetime.timezone.utc)
    digest = hashlib.sha256(f"{model.path.resolve()}:{header.size}".encode()).hexdigest()
    return {"name": model.name, "model": model.name,
            "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "size": header.size, "digest": digest, "details": _details(model)}


def _size_label(n_params: int) -> str:
    """ollama's way of writing a parameter count: 134.5M, 1.5B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n_params >= scale:
            return f"{n_params / scale:.1f}{unit}"
    return str(n_params)


def _model_info(model: ServedModel) -> dict:
    """Ollama's ``model_info``: the GGUF's own keys (``llama.context_length``, ...; the
    tokenizer's, which are large, left out), and the parameter count."""
    info = {key: _json_safe(value) for key, value in model.header.metadata.items()
            if not key.startswith("tokenizer.")}
    info["general.parameter_count"] = model.header.n_params
    return info


def _json_safe(value):
    """A GGUF value as JSON can hold it: an infinity or NaN as its name."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _wall_clock(monotonic: float) -> str:
    """A time on the monotonic clock as ollama writes times (far in the future for
    never, as ollama writes a model kept for ever)."""
    if monotonic == FOREVER:
        when = datetime.datetime(2318, 1, 1, tzinfo=datetime.timezone.utc)
    else:
        when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(
            seconds=monotonic - time.monotonic())
    return when.isoformat().replace("+00:00", "Z")


def _in_memory(model: LoadedModel) -> tuple[int, int]:
    """(bytes, bytes on the GPU) of a loaded model's weights, as ``/api/ps`` reports them:
    the file's size, the share of its layers offloaded on the GPU."""
    size = model.served.header.size
    layers = model.served.header.metadata.get(f"{model.served.header.architecture}"
                                              ".block_count") or 1
    offloaded = model.engine.n_gpu_layers
    share = 1.0 if offloaded < 0 else min(offloaded, layers) / layers
    return size, int(size * share)


async def _job(model: LoadedModel, tokens: list[int], body: _Body, prompt_field: str,
               route: str, budget: int | None = None) -> Job:
    options = body.options
    sampler = sampler_for(model.sampler, sampler=options.sampler,
                          temperature=options.temperature, top_p=options.top_p,
                          param="options.sampler", prefix="options.",
                          **options.sampling_options())
    wanted = options.num_predict if options.num_predict and options.num_predict > 0 else None
    if options.num_ctx is not None:  # a window of its own, inside the slot's
        room = options.num_ctx - len(tokens)
        if room < 1:
            raise APIError(400, f"the prompt has {len(tokens)} tokens, but `options.num_ctx` "
                           f"is {options.num_ctx}: shorten it or raise num_ctx",
                           param="options.num_ctx", code="context_length_exceeded")
        wanted = min(wanted or room, room)
    return model.job(tokens, sampler=sampler, max_tokens=wanted, seed=options.seed,
                      stop=[s for s in options.stop or [] if s], stream=body.stream,
                      grammar=await grammar_for(body.schema_wanted(), "format"),
                      format_field="format", prompt_field=prompt_field, route=route,
                      reasoning_budget=budget,
                      reasoning_sampler=reasoning_sampler(options.reasoning_sampler,
                                                          "options.reasoning_sampler"))


async def _respond(model: LoadedModel, request: Request, job: Job, body: _Body, kind: str,
                   functions: list[str] = ()):
    """Queue the job; answer with NDJSON lines or one object. ``functions``: the names of
    the tools whose calls are read out of the reply."""
    model.submit(job)
    head = {"model": body.model}

    def piece(text: str, calls: list[ToolCall] = (), thinking: str = "") -> dict:
        if kind == "chat":
            message = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [_call(call) for call in calls]
            return {**head, "created_at": _now(), "message": message, "done": False}
        return {**head, "created_at": _now(), "response": text, "done": False,
                **({"thinking": thinking} if thinking else {})}

    def last(result: GenerationResult, text: str, calls: list[ToolCall] = (),
             thinking: str = "") -> dict:
        out = piece(text, calls, thinking)
        out.update(done=True, **_final_fields(result))
        return out

    if not body.stream:
        result = await wait(request, job)
        if functions:
            return last(result, *parse_reply(result.text, functions), result.reasoning)
        return last(result, result.text, thinking=result.reasoning)

    reader = ToolCallReader(functions) if functions else None

    def lines_of(text: str) -> list[bytes]:
        if isinstance(text, Thought):
            return [_line(piece("", thinking=str(text)))]
        if reader is None:
            return [_line(piece(text))]
        return [_line(piece("", [part]) if isinstance(part, ToolCall) else piece(part))
                for part in reader.feed(text)]

    async def lines():
        try:
            while True:
                what, value = await job.events.get()
                if what == "piece":
                    for line in lines_of(value[0]):
                        yield line
                elif what == "error":
                    yield _line({"error": f"generation failed: {value}"})
                    return
                else:
                    for rest in reader.finish() if reader else ():
                        yield _line(piece(rest))
                    yield _line(last(value, ""))
                    return
        finally:
            job.cancelled.set()  # a client that left stops the generation

    return StreamingResponse(lines(), media_type=NDJSON)


def _call(call: ToolCall) -> dict:
    """A call as Ollama writes it: the arguments an object."""
    return {"function": {"name": call.name, "arguments": call.arguments}}


# ---- the routes ----

@router.get("/api/version")
async def version():
    # Clients compare "version" with the Ollama release that brought what they use (0.1.x
    # from this package would read as too old), so it names the Ollama API level this server
    # speaks; the package's own version is beside it.
    return {"version": OLLAMA_API_VERSION, "adaptive_llama": metadata.version("adaptive-llama")}


@router.get("/api/tags")
async def tags(request: Request):
    def readable(model: ServedModel) -> dict | None:
        try:
            return _listed(model)
        except ModelError as exc:  # one damaged file hides only itself
            log.warning("not listing %s: %s", model.name, exc)
            return None

    pool = server_of(request).pool
    listed = await asyncio.to_thread(lambda: [readable(m) for m in pool.models])
    return {"models": [m for m in listed if m is not None]}


@router.get("/api/ps")
async def ps(request: Request):
    def listed(model: LoadedModel) -> dict:
        size, size_vram = _in_memory(model)
        return {**_listed(model.served), "size": size, "size_vram": size_vram,
                "expires_at": _wall_clock(model.expires_at()),
                "context_length": model.engine.n_ctx}
    pool = server_of(request).pool
    return {"models": await asyncio.to_thread(lambda: [listed(m) for m in pool.loaded])}


@router.post("/api/show")
async def show(request: Request):
    server = server_of(request)
    body = await parse_body(request, ShowBody)
    model = server.pool.find(body.model)
    await asyncio.to_thread(lambda: model.calls_tools)  # reads the header once, off the loop
    template = model.template_source
    return {"modelfile": "", "parameters": f"sampler {model.sampler}", "template": template,
            "details": _details(model), "model_info": _model_info(model),
            "capabilities": ["completion", *(["tools"] if model.calls_tools else []),
                             *(["thinking"] if model.thinks else [])],
            "modified_at": _now()}


async def _load_or_unload(server: Server, body: _Body, kind: str) -> dict:
    """Ollama's answer to a request with nothing to generate: the model is loaded, or
    with ``keep_alive`` 0 unloaded."""
    keep_alive = body.keep_alive_wanted()
    unloading = keep_alive == 0
    loaded = {m.name for m in server.pool.loaded}
    if not (unloading and server.pool.find(body.model).name not in loaded):
        async with server.model(body.model, keep_alive=keep_alive):
            pass
        if unloading:
            await server.pool.unload_expired()
    out = {"model": body.model, "created_at": _now(), "done": True,
           "done_reason": "unload" if unloading else "load"}
    if kind == "chat":
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return out


@router.post("/api/chat")
async def chat(request: Request):
    server = server_of(request)
    body = await parse_body(request, ChatBody)
    if not body.messages:  # Ollama's way to load (or unload) a model
        return await _load_or_unload(server, body, "chat")
    offered = body.tools or []
    async with server.model(body.model, keep_alive=body.keep_alive_wanted()) as model:
        functions = check_tools(model, offered) if offered else []
        thinking, budget = body.thinking_wanted(model.engine)
        tokens = await chat_prompt(request, model.engine, body.messages, offered, thinking)
        job = await _job(model, tokens, body, "messages", request.url.path, budget)
        return await _respond(model, request, job, body, "chat", functions)


@router.post("/api/generate")
async def generate(request: Request):
    server = server_of(request)
    body = await parse_body(request, GenerateBody)
    if not body.prompt:  # Ollama's way to load (or unload) a model
        return await _load_or_unload(server, body, "generate")
    async with server.model(body.model, keep_alive=body.keep_alive_wanted()) as model:
        engine = model.engine
        thinking, budget = body.thinking_wanted(engine)
        if body.raw or not engine.has_chat_template:
            text = body.prompt if body.system is None else f"{body.system}\n\n{body.prompt}"
            # raw: the caller wrote the template's markup itself, on purpose
            tokens = await asyncio.to_thread(engine.tokenize, text, True, body.raw)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else [])
            messages.append({"role": "user", "content": body.prompt})
            tokens = await template_prompt(request, engine, messages, thinking=thinking)
        job = await _job(model, tokens, body, "prompt", request.url.path, budget)
        return await _respond(model, request, job, body, "generate")


@router.post("/api/embed")
async def embed(request: Request):
    server = server_of(request)
    body = await parse_body(request, EmbedBody)
    started = time.perf_counter()
    items = [body.input] if isinstance(body.input, str) else body.input
    _, vectors, tokens = await server.embed(body.model, items, "input",
                                            truncate=body.truncate)
    return {"model": body.model, "embeddings": vectors.tolist(),
            "total_duration": _ns(time.perf_counter() - started), "load_duration": 0,
            "prompt_eval_count": tokens}


@router.post("/api/embeddings")
async def embeddings(request: Request):
    server = server_of(request)
    body = await parse_body(request, EmbeddingsBody)
    if not body.prompt:  # as ollama answers it
        return {"embedding": []}
    _, vectors, _ = await server.embed(body.model, [body.prompt], "prompt", truncate=True)
    return {"embedding": vectors[0].tolist()}

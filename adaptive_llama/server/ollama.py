"""Ollama-compatible routes, beside the OpenAI ones, for desktop clients that speak Ollama's API.

``GET /api/version``, ``GET /api/tags``, ``POST /api/show``, ``POST /api/embed`` (and the older
``/api/embeddings``), ``POST /api/chat`` and ``POST /api/generate``: newline-delimited JSON as pieces come (the default), or one object
with ``"stream": false``. The same queue, slots, API key and limits as the OpenAI routes; errors
in Ollama's shape, ``{"error": "message"}``, with the HTTP status.

``options``: ``temperature`` (0: greedy), ``seed``, ``num_predict`` (max new tokens; -1 or
absent: until the context is full), ``stop``, ``num_ctx`` (this request's window, inside the
slot's), and the sampler: our ``sampler`` spec (``"adaptive:eps=0.001"``), or, without it,
``mirostat`` 1 or 2, or one of Ollama's truncation options: ``min_p`` above 0, else ``top_p``
below 1, else ``top_k`` above 0 (in that order; llama.cpp's chain here runs one truncation
sampler), at the default sampler's temperature; penalties (``repeat_penalty``,
``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``) and llama-server's DRY, XTC and
top-n-sigma options join their modifiers (:class:`.common.SamplingFields`). Without any of them
the server's default sampler runs (:func:`.common.sampler_for`, shared with the OpenAI routes).
Options that set up a model (``num_gpu``, ``num_thread``, ...) are accepted and ignored: the
server sets them when it starts.

``format``: ``"json"`` (any JSON object) or a JSON schema constrains the reply with a grammar
(:mod:`adaptive_llama.llama.grammar`); a schema keyword it cannot enforce is a 400 naming it.

The model: one model is served under every name; ``/api/tags`` lists it under the server's
model id.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import math
import time
from importlib import metadata
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from ..llama.grammar import ANY_OBJECT
from ..runtime.engine import GenerationResult
from ..samplers import SEED
from .common import (
    FINISH_REASONS,
    MAX_EMBED_INPUTS,
    MAX_MESSAGES,
    MAX_STOPS,
    STRICT,
    APIError,
    Job,
    Message,
    SamplingFields,
    Server,
    chat_prompt,
    grammar_for,
    parse_body,
    sampler_for,
    server_of,
)

router = APIRouter()
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


class _Body(BaseModel):
    # As the OpenAI bodies: strict types, unknown fields ignored, fields that would change
    # the reply and are not done here refused.
    model_config = STRICT
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"tools": (None, [])}

    model: str = Field(min_length=1)
    stream: bool = True
    options: Options = Field(default_factory=Options)
    format: Literal["", "json"] | dict | None = None

    def schema_wanted(self) -> dict | None:
        """The JSON schema the reply has to follow; None: plain text."""
        if not self.format:
            return None
        return ANY_OBJECT if self.format == "json" else self.format


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)


class GenerateBody(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_Body.UNSUPPORTED, "images": (None, []), "context": (None, []), "suffix": (None, "")}

    prompt: str = ""
    system: str | None = None
    raw: bool = False


class EmbedBody(BaseModel):
    model_config = STRICT
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"dimensions": (None,)}
    model: str = Field(min_length=1)
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


def _details(server: Server) -> dict:
    """Ollama's ``details``, as ollama writes them: family ``llama``, parameter_size
    ``135M``, quantization_level ``Q4_1``."""
    engine = server.engine
    family = engine.metadata.get("general.architecture", "")
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else None,
            "parameter_size": engine.metadata.get("general.size_label")
            or _size_label(engine.n_params),
            "quantization_level": engine.quantization}


def _size_label(n_params: int) -> str:
    """ollama's way of writing a parameter count: 134.5M, 1.5B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n_params >= scale:
            return f"{n_params / scale:.1f}{unit}"
    return str(n_params)


def _model_info(engine) -> dict:
    """Ollama's ``model_info``: the GGUF's own keys (``llama.context_length``, ...; numbers
    as numbers, the tokenizer's lists left out, as they are large), and the parameter
    count."""
    info = {key: _number_or_text(value) for key, value in engine.metadata.items()
            if not key.startswith("tokenizer.")}
    info["general.parameter_count"] = engine.n_params
    return info


def _number_or_text(value: str):
    """A GGUF value as a JSON number where it is one ("8192", "0.00001"); text otherwise,
    a name such as "Infinity" included (JSON has no infinities)."""
    for kind in (int, float):
        try:
            number = kind(value)
        except ValueError:
            continue
        if math.isfinite(number):
            return number
    return value


async def _job(server: Server, tokens: list[int], body: _Body, prompt_field: str,
               route: str) -> Job:
    options = body.options
    sampler = sampler_for(server.sampler, sampler=options.sampler,
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
    return server.job(tokens, sampler=sampler, max_tokens=wanted, seed=options.seed,
                      stop=[s for s in options.stop or [] if s], stream=body.stream,
                      grammar=await grammar_for(body.schema_wanted(), "format"),
                      format_field="format", prompt_field=prompt_field, route=route)


async def _respond(server: Server, request: Request, job: Job, body: _Body, kind: str):
    server.submit(job)
    head = {"model": body.model}

    def piece(text: str) -> dict:
        if kind == "chat":
            return {**head, "created_at": _now(),
                    "message": {"role": "assistant", "content": text}, "done": False}
        return {**head, "created_at": _now(), "response": text, "done": False}

    def last(result: GenerationResult, text: str) -> dict:
        out = piece(text)
        out.update(done=True, **_final_fields(result))
        return out

    if not body.stream:
        result = await server.wait(request, job)
        return last(result, result.text)

    async def lines():
        try:
            while True:
                what, value = await job.events.get()
                if what == "piece":
                    yield _line(piece(value[0]))
                elif what == "error":
                    yield _line({"error": f"generation failed: {value}"})
                    return
                else:
                    yield _line(last(value, ""))
                    return
        finally:
            job.cancelled.set()  # a client that left stops the generation

    return StreamingResponse(lines(), media_type=NDJSON)


# ---- the routes ----

@router.get("/api/version")
async def version():
    # Clients compare "version" with the Ollama release that brought what they use (0.1.x
    # from this package would read as too old), so it names the Ollama API level this server
    # speaks; the package's own version is beside it.
    return {"version": OLLAMA_API_VERSION, "adaptive_llama": metadata.version("adaptive-llama")}


@router.get("/api/tags")
async def tags(request: Request):
    server = server_of(request)
    path = Path(server.engine.path)
    stat = path.stat()
    modified = datetime.datetime.fromtimestamp(stat.st_mtime, datetime.timezone.utc)
    digest = hashlib.sha256(f"{path.resolve()}:{stat.st_size}".encode()).hexdigest()
    return {"models": [{
        "name": server.model_id, "model": server.model_id,
        "modified_at": modified.isoformat().replace("+00:00", "Z"),
        "size": stat.st_size, "digest": digest, "details": _details(server)}]}


@router.post("/api/show")
async def show(request: Request):
    server = server_of(request)
    engine = server.engine
    await parse_body(request, ShowBody)
    return {"modelfile": "", "parameters": f"sampler {server.sampler}",
            "template": engine.metadata.get("tokenizer.chat_template", ""),
            "details": _details(server),
            "model_info": _model_info(engine),
            "capabilities": ["completion"], "modified_at": _now()}


@router.post("/api/chat")
async def chat(request: Request):
    server = server_of(request)
    body = await parse_body(request, ChatBody)
    tokens = await chat_prompt(server.engine, body.messages)
    job = await _job(server, tokens, body, "messages", request.url.path)
    return await _respond(server, request, job, body, "chat")


@router.post("/api/generate")
async def generate(request: Request):
    server = server_of(request)
    engine = server.engine
    body = await parse_body(request, GenerateBody)
    if not body.prompt:  # Ollama's way to load a model: nothing to generate
        return {"model": body.model, "created_at": _now(), "response": "", "done": True,
                "done_reason": "load"}
    if body.raw or not engine.has_chat_template:
        text = body.prompt if body.system is None else f"{body.system}\n\n{body.prompt}"
        # raw: the caller wrote the template's markup itself, on purpose
        tokens = await asyncio.to_thread(engine.tokenize, text, True, body.raw)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else [])
        messages.append({"role": "user", "content": body.prompt})
        tokens = await asyncio.to_thread(engine.chat_prompt_tokens, messages)
    job = await _job(server, tokens, body, "prompt", request.url.path)
    return await _respond(server, request, job, body, "generate")


@router.post("/api/embed")
async def embed(request: Request):
    server = server_of(request)
    body = await parse_body(request, EmbedBody)
    started = time.perf_counter()
    items = [body.input] if isinstance(body.input, str) else body.input
    vectors, tokens = await server.embed(items, "input", truncate=body.truncate)
    return {"model": body.model, "embeddings": vectors.tolist(),
            "total_duration": _ns(time.perf_counter() - started), "load_duration": 0,
            "prompt_eval_count": tokens}


@router.post("/api/embeddings")
async def embeddings(request: Request):
    server = server_of(request)
    body = await parse_body(request, EmbeddingsBody)
    if not body.prompt:  # as ollama answers it
        return {"embedding": []}
    vectors, _ = await server.embed([body.prompt], "prompt", truncate=True)
    return {"embedding": vectors[0].tolist()}

"""An OpenAI-compatible HTTP server: adaptive decoding for any chat-completions client.

``adaptive-llama serve`` puts one model, with one llama.cpp context, behind
``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events ending with ``data: [DONE]``, or one JSON object), plus ``GET /health``,
and Ollama's routes under ``/api/`` (:mod:`adaptive_llama.server.ollama`).

Sampling: the body field ``sampler`` takes a spec (``adaptive:eps=0.001``, ``min-p:p=0.05``,
...); without it the server's default (adaptive) runs. OpenAI fields map onto the spec:
``temperature`` sets its ``temp=`` (0 means greedy), and ``top_p`` below 1 without a
``sampler`` field asks for nucleus sampling, ``top-p:p=TOP_P``. Every response carries
``sampler_stats`` (the spec, and for adaptive the mean and spread of k).

Scheduling: up to ``--parallel`` generations decode together on one worker thread, one
token of each per step (continuous batching: a new request joins between two steps). At
most ``max_queue`` more wait, in arrival order; one more gets 503 with ``Retry-After``. A
client that disconnects stops its generation at the next token, and its slot goes to the
next request.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: malformed
JSON, an unknown spec, a bad field, a prompt longer than the context are 400s, and the server
keeps serving.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import itertools
import json
import logging
import time
from typing import Annotated, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import MAX_LOGPROBS, Engine, GenerationResult, TokenLogprob
from ..samplers import SEED, SamplerSpec, SpecError, parse_spec, spec_of
from .errors import APIError, too_large
from .guard import LOOPBACK_ORIGIN, Access, Guard
from .scheduler import Job, QueueFull, Scheduler

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
DISCONNECT_POLL_S = 0.25
MAX_BODY = 2 * 2**20  # bytes: about 500k tokens of text, more than any context holds
# finish reasons of the engine -> OpenAI's ("interrupted" only reaches a client that left).
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length",
                  "interrupted": "stop"}


# ---- request bodies ----

# Bounds on what one request may hold: far beyond what a context window takes, small enough
# that checking a body costs milliseconds (a 2 MiB body held 600k messages).
MAX_MESSAGES = 4096
MAX_PARTS = 256  # content parts of one message
MAX_STOPS = 16  # OpenAI allows 4
MAX_PROMPTS = 16  # a list of prompts: more than one is refused in words (one per request)


class _Body(BaseModel):
    # Strict types, as OpenAI's: "5" is not a number and "yes" not a boolean. Unknown
    # fields (user, ...) are ignored, as most local servers do, so that clients sending
    # their full default set keep working; fields that would change the reply and that the
    # server does not do are refused (UNSUPPORTED: field -> the values that change nothing).
    model_config = ConfigDict(extra="ignore", strict=True)
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"logit_bias": (None, {})}

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(None, ge=0, le=SEED.high)
    n: int = Field(1, ge=1, le=1)  # one context, one choice
    stream: bool = False
    stream_options: dict | None = None
    sampler: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None
    images: list | None = None  # Ollama's

    def as_template_message(self, index: int) -> dict:
        """The message for the chat template; 400 for a part the model cannot read."""
        where = f"messages.{index}"
        if self.images:
            raise APIError(400, f"`{where}.images`: this server reads text only",
                           param=f"{where}.images", code="unsupported_field")
        content = self.content or ""
        if not isinstance(content, str):
            for i, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"`{where}.content.{i}`: this server reads text "
                                   f"parts only, not {part.type!r}",
                                   param=f"{where}.content", code="unsupported_field")
            content = "".join(part.text for part in content)
        # Chat templates know "system"; OpenAI's newer "developer" role means the same.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


def template_messages(messages: list[Message]) -> list[dict]:
    return [m.as_template_message(i) for i, m in enumerate(messages)]


class ChatBody(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_Body.UNSUPPORTED, "response_format": (None, {"type": "text"}),
        "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
        "function_call": (None, "none", "auto")}

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_Body.UNSUPPORTED, "echo": (None, False), "suffix": (None, ""),
        "best_of": (None, 1)}

    prompt: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


# ---- the application ----

GREEDY = parse_spec("greedy")
TOP_P = parse_spec("top-p")


def _sampler_for(default: SamplerSpec, body: _Body) -> SamplerSpec:
    """The request's sampler: its ``sampler`` text parsed (once), with OpenAI's fields on top."""
    try:
        spec = parse_spec(body.sampler) if body.sampler is not None else default
        if body.sampler is None and body.top_p is not None and body.top_p < 1:
            spec = TOP_P.with_param("p", body.top_p).with_param("temp", spec.temp)
        if body.temperature == 0:
            return GREEDY
        if body.temperature is not None and spec.sampler.takes_temp:
            spec = spec.with_param("temp", body.temperature)
        return spec
    except SpecError as exc:
        raise APIError(400, f"sampler: {exc}", param="sampler", code="invalid_sampler") from None


def _token(text: bytes, logprob: float) -> dict:
    return {"token": text.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(text)}


def _chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """OpenAI's chat ``logprobs``: per token, its log-probability and the top alternatives."""
    return {"content": [{**_token(e.text, e.logprob),
                         "top_logprobs": [_token(text, lp) for _, text, lp in e.top]}
                        for e in entries]}


class _CompletionLogprobs:
    """The completions endpoint's (legacy) ``logprobs`` of one reply, chunk by chunk.

    A token's text is the characters it completes, so that the tokens join into the reply's
    text and ``text_offset`` indexes it: a character split over tokens belongs to the token
    that ends it (the ones before it read "", as in llama-server).
    """

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._offset = 0  # characters of the reply before the next token

    def __call__(self, entries: list[TokenLogprob]) -> dict:
        tokens = [self._decoder.decode(e.text) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.decode("utf-8", "replace"): lp for _, t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}


def _usage(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


class Server:
    """The routes' shared state: the engine, its scheduler, the default sampler."""

    def __init__(self, engine: Engine, sampler: SamplerSpec, max_queue: int,
                 model_id: str | None = None):
        self.engine = engine
        self.sampler = sampler
        self.model_id = model_id or engine.name
        self.scheduler = Scheduler(engine, max_queue)
        self._ids = itertools.count(1)

    def job(self, prompt_tokens: list[int], body: _Body, max_tokens: int | None,
            prompt_field: str) -> Job:
        room = self.engine.n_ctx - len(prompt_tokens)
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt_tokens)} tokens, but the "
                           f"context window holds {self.engine.n_ctx}: shorten it",
                           param=prompt_field, code="context_length_exceeded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        sampler, logprobs = self.checked(_sampler_for(self.sampler, body),
                                         body.logprobs_wanted())
        return Job(prompt_tokens=prompt_tokens, sampler=sampler,
                   max_tokens=min(max_tokens or room, room),
                   seed=body.seed,
                   stop=stop, stream=body.stream, loop=asyncio.get_running_loop(),
                   logprobs=logprobs)

    def checked(self, sampler: SamplerSpec, logprobs: int | None):
        """(sampler, logprobs), or the 400 the engine's rules give (backend sampling)."""
        try:
            return self.engine.check_request(sampler, logprobs), logprobs
        except SpecError as exc:
            raise APIError(400, f"sampler: {exc}", param="sampler",
                           code="invalid_sampler") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="logprobs") from None

    def submit(self, job: Job) -> None:
        """Queue the job, or 503 with Retry-After when the queue is full."""
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            raise APIError(503, f"the server is busy: {exc.waiting} requests are waiting; "
                           f"retry in {RETRY_AFTER_S} s", type="server_busy",
                           code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def respond(self, request: Request, job: Job, body: _Body, kind: str):
        """Queue the job; answer with an SSE stream or one JSON object."""
        self.submit(job)
        head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{next(self._ids)}",
                "created": int(time.time()), "model": self.model_id}
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return EventSourceResponse(self._events(job, head, kind, usage),
                                       ping=15, sep="\n")
        return self._final(await self.wait(request, job), head, kind, job.logprobs is not None)

    async def wait(self, request: Request, job: Job) -> GenerationResult:
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

    @staticmethod
    def _final(result: GenerationResult, head: dict, kind: str, logprobs: bool) -> dict:
        reason = FINISH_REASONS[result.finish_reason]
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": _chat_logprobs(result.logprobs) if logprobs else None,
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": result.text,
                      "logprobs": (_CompletionLogprobs()(result.logprobs)
                                   if logprobs else None),
                      "finish_reason": reason}
            obj = "text_completion"
        return {**head, "object": obj, "choices": [choice], "usage": _usage(result),
                "sampler_stats": result.summary()}

    async def _events(self, job: Job, head: dict, kind: str, include_usage: bool):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        completion_logprobs = _CompletionLogprobs()

        def chunk(delta_text: str | None, reason: str | None = None, entries=(),
                  **extra) -> str:
            logprobs = None
            if job.logprobs is not None and delta_text is not None:
                logprobs = (_chat_logprobs(entries) if kind == "chat"
                            else completion_logprobs(entries))
            if kind == "chat":
                delta = {} if delta_text is None else {"content": delta_text}
                choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": logprobs,
                          "finish_reason": reason}
            return _json({**head, "object": obj, "choices": [choice], **extra})

        try:
            if kind == "chat":
                yield _json({**head, "object": obj, "choices": [{
                    "index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]})
            while True:
                what, value = await job.events.get()
                if what == "piece":
                    text, entries = value
                    yield chunk(text, entries=entries)
                elif what == "error":
                    yield _json({"error": {"message": f"generation failed: {value}",
                                           "type": "server_error", "param": None,
                                           "code": None}})
                    break
                else:
                    yield chunk(None, FINISH_REASONS[value.finish_reason],
                                sampler_stats=value.summary())
                    if include_usage:
                        yield _json({**head, "object": obj, "choices": [],
                                     "usage": _usage(value)})
                    break
            yield "[DONE]"
        finally:
            job.cancelled.set()  # a client that left stops the generation at the next token


async def _parse(request: Request, model: type[BaseModel], max_body: int) -> BaseModel:
    """The JSON body, whatever the Content-Type says (curl users often send none; see
    :mod:`.guard` for the types refused).

    Read at most ``max_body`` bytes (413 beyond), then decoded and validated off the event
    loop (:func:`_decode`).
    """
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


def _json(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)


def create_app(engine: Engine, sampler: SamplerSpec | str = "adaptive", *,
               api_key: str | None = None, max_queue: int = 8, model_id: str | None = None,
               max_body: int = MAX_BODY, allow_origins: tuple[str, ...] = (),
               allow_hosts: tuple[str, ...] | None = ()) -> FastAPI:
    """The ASGI application; run it with uvicorn (``adaptive-llama serve`` does).

    ``allow_origins``: web pages besides loopback ones that may call it (``"*"``: any);
    ``allow_hosts``: host names besides loopback ones it answers (None: any, for a server
    on a public address). See :mod:`.guard`. ValueError for an empty or non-ASCII key.
    """
    access = Access(api_key, allow_origins, allow_hosts)
    server = Server(engine, spec_of(sampler), max_queue, model_id)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        server.scheduler.stop()

    app = FastAPI(title="adaptive-llama", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.server = server

    app.add_middleware(Guard, access=access, max_body=max_body)
    # Outermost: answers browsers' preflight requests, for the pages Access allows only.
    app.add_middleware(CORSMiddleware, allow_origins=sorted(access.allow_origins),
                       allow_origin_regex=LOOPBACK_ORIGIN, allow_methods=["GET", "POST"],
                       allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response(request.url.path)

    @app.get("/health")
    async def health():
        s = server.scheduler
        return {"status": "ok", "model": server.model_id, "sampler": str(server.sampler),
                "slots": engine.parallel, "running": s.running,
                "free": engine.parallel - s.running, "waiting": s.waiting,
                "threads": engine.threads, **s.counts}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_id, "object": "model", "created": 0, "owned_by": "local",
            "n_ctx": engine.n_ctx, "n_vocab": engine.n_vocab}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatBody, max_body)
        messages = template_messages(body.messages)
        try:  # off the event loop: a long conversation must not stall other requests
            tokens = await asyncio.to_thread(engine.chat_prompt_tokens, messages)
        except Exception as exc:  # no template, or the template rejects the roles given
            raise APIError(400, f"messages: {exc}", param="messages") from None
        job = server.job(tokens, body, body.max_completion_tokens or body.max_tokens,
                         "messages")
        return await server.respond(request, job, body, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionBody, max_body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "`prompt`: send one prompt per request (a string)",
                               param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "`prompt`: the prompt is empty", param="prompt")
        # OpenAI's completions endpoint defaults to 16 tokens.
        # A raw prompt: its caller wrote any chat markup (<|im_start|>...) on purpose.
        tokens = await asyncio.to_thread(engine.tokenize, prompt, True, True)
        job = server.job(tokens, body, body.max_tokens or 16, "prompt")
        return await server.respond(request, job, body, "completion")

    from . import ollama  # imports this module's Server and errors

    ollama.add_routes(app, server, max_body)
    return app

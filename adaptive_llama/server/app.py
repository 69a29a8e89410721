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
import contextlib
import hmac
import itertools
import json
import logging
import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import MAX_LOGPROBS, Engine, GenerationResult, TokenLogprob
from ..samplers import SEED, SamplerSpec, SpecError, parse_spec, spec_of
from .scheduler import Job, QueueFull, Scheduler

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
DISCONNECT_POLL_S = 0.25
MAX_BODY = 2 * 2**20  # bytes: about 500k tokens of text, more than any context holds
# finish reasons of the engine -> OpenAI's ("interrupted" only reaches a client that left).
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length",
                  "interrupted": "stop"}


class APIError(Exception):
    """An error the client caused (or a busy server), answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def response(self, path: str = "") -> JSONResponse:
        """OpenAI's error shape; Ollama's, ``{"error": message}``, on its routes (/api/)."""
        if path.startswith("/api/"):
            body = {"error": self.message}
        else:
            body = {"error": {"message": self.message, "type": self.type,
                              "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# ---- request bodies ----

class _Body(BaseModel):
    # Unknown OpenAI fields (logit_bias, user, ...) are accepted and ignored, as most local
    # servers do, so that clients sending their full default set keep working.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=SEED.high)
    n: int = Field(1, ge=1, le=1)  # one context, one choice
    stream: bool = False
    stream_options: dict | None = None
    sampler: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict:
        content = self.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        # Chat templates know "system"; OpenAI's newer "developer" role means the same.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Body):
    prompt: str | list[str]
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


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    """The completions endpoint's (legacy) ``logprobs``; ``offset``: characters of text
    before these tokens."""
    tokens = [e.text.decode("utf-8", "replace") for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.decode("utf-8", "replace"): lp for _, t, lp in e.top}
                             for e in entries],
            "text_offset": offsets}


def _usage(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


class Server:
    """The routes' shared state: the engine, its scheduler, the default sampler, the key."""

    def __init__(self, engine: Engine, sampler: SamplerSpec, api_key: str | None,
                 max_queue: int, model_id: str | None = None):
        self.engine = engine
        self.sampler = sampler
        self.api_key = api_key
        self.model_id = model_id or engine.name
        self.scheduler = Scheduler(engine, max_queue)
        self._ids = itertools.count(1)

    def key_error(self, headers: Headers) -> APIError | None:
        """The 401 for a request without the right key (None when it may pass)."""
        if self.api_key is None:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              self.api_key.encode()):
            return None
        return APIError(401, "invalid or missing API key: send the header "
                        "'Authorization: Bearer KEY'", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})

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
                      "logprobs": _completion_logprobs(result.logprobs, 0) if logprobs else None,
                      "finish_reason": reason}
            obj = "text_completion"
        return {**head, "object": obj, "choices": [choice], "usage": _usage(result),
                "sampler_stats": result.summary()}

    async def _events(self, job: Job, head: dict, kind: str, include_usage: bool):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        sent = 0  # characters of text sent so far (the completions' text_offset)

        def chunk(delta_text: str | None, reason: str | None = None, entries=(),
                  **extra) -> str:
            nonlocal sent
            logprobs = None
            if job.logprobs is not None and delta_text is not None:
                logprobs = (_chat_logprobs(entries) if kind == "chat"
                            else _completion_logprobs(entries, sent))
            if kind == "chat":
                delta = {} if delta_text is None else {"content": delta_text}
                choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": logprobs,
                          "finish_reason": reason}
            sent += len(delta_text or "")
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


async def _parse(request: Request, model: type[_Body], max_body: int) -> _Body:
    """The JSON body, whatever the Content-Type says (curl users often send none).

    Read at most ``max_body`` bytes (413 beyond), and decoded off the event loop.
    """
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body:
                raise _too_large(max_body)
    except ClientDisconnect:
        log.warning("%s %s: the client left while sending its body", request.method,
                    request.url.path)
        raise APIError(400, "the body ended early: the client disconnected") from None
    try:
        data = await asyncio.to_thread(json.loads, bytes(raw) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body has to be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        given = f" (got {_short(first['input'])})" if "input" in first and where else ""
        raise APIError(400, f"`{where}`: {first['msg']}{given}", param=where) from None


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _too_large(max_body: int) -> APIError:
    return APIError(413, f"the body is larger than this server's limit of {max_body:,} "
                    "bytes (adaptive-llama serve --max-body)", code="request_too_large")


class Guard:
    """Pure ASGI middleware (which, unlike Starlette's BaseHTTPMiddleware, leaves
    disconnect detection working): the API key, and a Content-Length over the limit."""

    def __init__(self, app, server: "Server", max_body: int):
        self.app, self.server, self.max_body = app, server, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            error = self.server.key_error(headers)
            length = headers.get("content-length", "")
            if error is None and length.isdigit() and int(length) > self.max_body:
                error = _too_large(self.max_body)
            if error is not None:
                return await error.response(scope["path"])(scope, receive, send)
        return await self.app(scope, receive, send)


def _json(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)


def create_app(engine: Engine, sampler: SamplerSpec | str = "adaptive", *,
               api_key: str | None = None, max_queue: int = 8, model_id: str | None = None,
               max_body: int = MAX_BODY) -> FastAPI:
    """The ASGI application; run it with uvicorn (``adaptive-llama serve`` does)."""
    server = Server(engine, spec_of(sampler), api_key, max_queue, model_id)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        server.scheduler.stop()

    app = FastAPI(title="adaptive-llama", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.server = server

    app.add_middleware(Guard, server=server, max_body=max_body)

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
        messages = [m.as_template_message() for m in body.messages]
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
        tokens = await asyncio.to_thread(engine.tokenize, prompt)
        job = server.job(tokens, body, body.max_tokens or 16, "prompt")
        return await server.respond(request, job, body, "completion")

    from . import ollama  # imports this module's Server and errors

    ollama.add_routes(app, server, max_body)
    return app

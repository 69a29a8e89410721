"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions``, streaming as server-sent events ending with ``data: [DONE]``, or one
JSON object; ``POST /v1/embeddings`` (unit vectors, as numbers or base64 float32). Each
also answers without ``/v1``, as llama-server's do, for clients given a bare base URL.

Sampling: the body field ``sampler`` takes a spec (``adaptive:eps=0.001``, ``min-p:p=0.05``,
...); without it the server's default (adaptive) runs. OpenAI fields map onto the spec
(:func:`.common.sampler_for`): ``temperature`` sets its ``temp=`` (0 means greedy), and
``top_p`` below 1 without a ``sampler`` field asks for nucleus sampling, ``top-p:p=TOP_P``;
``frequency_penalty``, ``presence_penalty`` and llama-server's extensions (``repeat_penalty``,
``top_k``, ``min_p``, DRY, XTC, ...; :class:`.common.SamplingFields`) join their modifiers.
Every response carries ``sampler_stats`` (the spec, and for adaptive the mean and spread of k).
With ``token_details: true`` (an extension, which OpenAI clients ignore; the browser page asks
for it) each chunk also carries ``token_details``: per token its text, log-probability, the
likeliest candidates, for adaptive its k, kept mass and entropy, and for a reasoning model
the phase it was in (:class:`TokenDetails`).

Structured output: ``response_format`` ``{"type": "json_object"}`` (any JSON object) or
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` constrains the reply
with a grammar (:mod:`adaptive_llama.llama.grammar`), on both routes; the sampler chooses
among the tokens it allows. A schema keyword the grammar cannot enforce is a 400 naming it.

Reasoning models (chat): the thinking comes back apart from the answer, as llama-server and
DeepSeek send it: ``message.reasoning_content``, ``delta.reasoning_content`` while streaming,
and ``usage.completion_tokens_details.reasoning_tokens``; ``reasoning_format: "none"`` keeps
the reply as one text, tags and all. Thinking sent back in earlier turns is not shown to the
model again.

Tool calls (chat): ``tools`` are shown to the model in its chat template, and the calls it
writes (:mod:`adaptive_llama.runtime.tools`) come back as ``tool_calls``, streamed as OpenAI
streams them; ``tool_choice`` "required" or a named function constrains the reply to calls
with a grammar, "none" shows no tools. A template without tools is a 400 on ``tools``.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: malformed
JSON, an unknown spec, a bad field, a prompt longer than the context are 400s, and the server
keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import dataclasses
import itertools
import json
import math
import threading
import time
from importlib import metadata
from typing import Annotated, ClassVar, Literal

import llama_cpp
import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from ..llama.grammar import ANY_OBJECT
from ..runtime.engine import MAX_LOGPROBS, GenerationResult, TokenLogprob
from ..runtime.reasoning import EFFORT_BUDGETS, Thought
from ..runtime.tools import ToolCall, ToolCallReader, parse_reply
from ..samplers import SEED
from .common import (
    FINISH_REASONS,
    LLAMA_SERVER_UNDONE,
    MAX_EMBED_INPUTS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOPS,
    MAX_TOOLS,
    STRICT,
    APIError,
    Job,
    LoadedModel,
    Message,
    SamplingFields,
    Tool,
    calls_grammar_for,
    chat_prompt,
    check_tools,
    grammar_for,
    parse_body,
    reasoning_sampler,
    sampler_for,
    server_of,
    thinking_switch,
    wait,
)

router = APIRouter()
DETAIL_CANDIDATES = 5  # the likeliest candidates each token's token_details names
MAX_CHOICES = 16  # OpenAI's `n`: choices of one request (each a generation of its own)
MAX_BIASES = 1024  # tokens one logit_bias names (OpenAI allows 300)
_ids = itertools.count(1)  # of the responses, "chatcmpl-1", "cmpl-2", ...
# OpenAI's system_fingerprint: what made the reply besides the request and the model.
FINGERPRINT = (f"adaptive-llama-{metadata.version('adaptive-llama')}"
               f"-llama.cpp-{llama_cpp.__version__}")


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the grammar enforces the schema either way


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict | None = Field(None, alias="schema")  # llama-server's, with json_object

    def schema_wanted(self) -> dict | None:
        """The JSON schema the reply has to follow; None: plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return self.schema_ or ANY_OBJECT
        if self.json_schema is None:
            raise APIError(400, "`response_format.json_schema` is required with type "
                           "json_schema", param="response_format.json_schema")
        return self.json_schema.schema_ or ANY_OBJECT


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class _FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: _FunctionName


class _Body(SamplingFields):
    model_config = STRICT
    # llama-server's fields not done here, and its log-probabilities (here: `logprobs`).
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**LLAMA_SERVER_UNDONE, "n_probs": (None, 0)}
    # A body translated from another API's (Responses, Messages): its fields' names there,
    # for the errors that name one.
    NAMES: ClassVar[dict[str, str]] = {}

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n_predict: int | None = Field(None, ge=-1)  # llama-server's max_tokens (-1: no bound)
    ignore_eos: bool = False  # llama-server's: the end of generation is never chosen
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(None, ge=0, le=SEED.high)
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, each its own seed
    stream: bool = False
    stream_options: StreamOptions | None = None
    sampler: str | None = None
    response_format: ResponseFormat | None = None
    json_schema: dict | None = None  # llama-server's: a schema the reply follows
    grammar: str | None = None       # llama-server's: a GBNF grammar the reply follows
    # {"token id": bias} (OpenAI's) or [[token id, bias]] (llama-server's)
    logit_bias: (Annotated[dict[str, float], Field(max_length=MAX_BIASES)]
                 | Annotated[list[Annotated[list[int | float], Field(min_length=2,
                                                                   max_length=2)]],
                             Field(max_length=MAX_BIASES)]
                 | None) = None

    def max_wanted(self, asked: int | None, default: int | None = None) -> int | None:
        """The most tokens to generate: ``asked`` (OpenAI's field), else ``n_predict``
        (-1: the room the prompt leaves), else ``default``."""
        if asked is not None or self.n_predict is None:
            return asked or default
        if self.n_predict == 0:
            raise APIError(400, "`n_predict`: 0 generates nothing; send -1 (until the "
                           "context is full) or a count of tokens", param="n_predict")
        return None if self.n_predict == -1 else self.n_predict

    def biases(self) -> list[tuple[int, float]]:
        """``logit_bias`` as (token id, bias) pairs; a 400 for a key that is not an id."""
        if isinstance(self.logit_bias, dict):
            bad = [key for key in self.logit_bias if not key.isdigit()]
            if bad:
                raise APIError(400, f"`logit_bias`: {bad[0]!r} is not a token id (the keys "
                               "are token ids, as /tokenize gives them)", param="logit_bias")
            return [(int(key), bias) for key, bias in self.logit_bias.items()]
        return [tuple(pair) for pair in self.logit_bias or []]  # the engine checks the ids
    token_details: bool = False  # an extension: see the module docstring

    def constraint(self) -> tuple[str, dict | str | None]:
        """The field that constrains the reply (by its name where the request was sent)
        and its schema or GBNF; None: plain text. A 400 when two fields ask."""
        given = [(name, value) for name, value in (
            ("response_format", self.response_format and self.response_format.schema_wanted()),
            ("json_schema", self.json_schema), ("grammar", self.grammar)) if value is not None]
        if len(given) > 1:
            raise APIError(400, f"`{given[0][0]}` and `{given[1][0]}` both constrain the "
                           "reply; send one", param=given[1][0])
        name, value = given[0] if given else ("response_format", None)
        return self.NAMES.get(name, name), value


class ChatBody(_Body):
    # The legacy functions API (clients send `tools` now); audio, web search and OpenAI's
    # verbosity; llama-server's continuation of the last message, template per request and
    # raw tool calls.
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_Body.UNSUPPORTED, "functions": (None, []), "function_call": (None, "none", "auto"),
        "audio": (None,), "modalities": (None, ["text"]), "web_search_options": (None,),
        "verbosity": (None, "medium"), "add_generation_prompt": (None, True),
        "chat_template": (None, ""), "parse_tool_calls": (None, True)}

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # A reasoning model's thinking (docs/reasoning.md): llama-server's reasoning_format
    # ("none" keeps the reply as one text), OpenAI's reasoning_effort, and ours.
    reasoning_format: Literal["none", "auto", "deepseek"] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    reasoning_budget: int | None = Field(None, ge=-1)
    reasoning_sampler: str | None = None

    def thinking_apart(self) -> bool:
        return self.reasoning_format != "none"

    def budget_wanted(self) -> int | None:
        """The thinking budget asked for (-1: no bound), or None: the engine's."""
        if self.reasoning_effort is not None and self.reasoning_budget is not None:
            raise APIError(400, "`reasoning_effort` and `reasoning_budget` both set the "
                           "thinking budget; send one", param="reasoning_budget")
        if self.reasoning_effort is not None:
            return EFFORT_BUDGETS[self.reasoning_effort]
        return self.reasoning_budget

    def tools_offered(self) -> list[Tool]:
        """The tools the model may call: none without ``tools`` or with ``tool_choice``
        "none" (then they are not shown to it either)."""
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise APIError(400, "`tool_choice` needs `tools`", param="tool_choice")
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def tools_required(self, offered: list[Tool]) -> list[Tool]:
        """The tools the reply has to call one of: every one offered for ``tool_choice``
        "required", the one named, or none (the model chooses)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            named = [t for t in offered if t.function.name == choice.function.name]
            if not named:
                raise APIError(400, f"`tool_choice` names {choice.function.name!r}, which "
                               "`tools` does not offer", param="tool_choice")
            return named
        return offered if choice == "required" else []

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_Body.UNSUPPORTED, "echo": (None, False), "suffix": (None, ""),
        "best_of": (None, 1), "reasoning_format": (None, "none")}  # a raw prompt: raw text

    prompt: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def thinking_apart(self) -> bool:
        return False  # a raw prompt's reply is one text, as llama-server's

    def budget_wanted(self) -> None:
        return None


class EmbeddingBody(BaseModel):
    model_config = STRICT
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"dimensions": (None,)}

    model: str | None = None
    input: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
            | Annotated[list[int], Field(min_length=1)]
            | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_EMBED_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"

    def items(self) -> list[str | list[int]]:
        """The inputs, one per vector: a text or a list of token ids each."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """A vector as OpenAI writes it: numbers, or base64 of little-endian float32."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def _job(model: LoadedModel, tokens: list[int], body: _Body, max_tokens: int | None,
               prompt_field: str, route: str, grammar, grammar_field: str) -> Job:
    """The generation a body asks for; ``grammar_field``: the field that asked for the
    grammar (named when it cannot run here)."""
    sampler = sampler_for(model.sampler, sampler=body.sampler, temperature=body.temperature,
                          top_p=body.top_p, **body.sampling_options())
    # token_details names each token's likeliest candidates: the engine's log-probabilities.
    logprobs = body.logprobs_wanted()
    if body.token_details:
        logprobs = max(logprobs or 0, DETAIL_CANDIDATES)
    biases = body.biases()
    if body.ignore_eos:  # as llama-server: a bias no logit overcomes
        biases += [(token, -100.0) for token in model.engine.vocab.end_of_generation]
    return model.job(tokens, sampler=sampler, max_tokens=max_tokens, seed=body.seed,
                      stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                      stream=body.stream, logprobs=logprobs, grammar=grammar,
                      format_field=grammar_field, prompt_field=prompt_field,
                      route=route, thinking=body.thinking_apart(),
                      reasoning_budget=body.budget_wanted(), logit_bias=biases,
                      reasoning_sampler=reasoning_sampler(
                          getattr(body, "reasoning_sampler", None), "reasoning_sampler"))


async def chat_job(request: Request, model: LoadedModel, body: ChatBody
                   ) -> tuple[Job, list[str]]:
    """The generation a chat body asks for, whichever API's request it was (the Responses
    and Messages routes translate theirs into a ChatBody), and the names of the functions
    whose calls are read out of its reply."""
    tokens, offered, functions = await chat_tokens(request, model, body)
    job = await _job(model, tokens, body,
                     body.max_wanted(body.max_completion_tokens or body.max_tokens),
                     body.NAMES.get("messages", "messages"), request.url.path,
                     *await _chat_grammar(body, offered))
    return job, functions


async def chat_tokens(request: Request, model: LoadedModel, body: ChatBody
                      ) -> tuple[list[int], list[Tool], list[str]]:
    """A chat body's prompt in the model's template, the tools shown in it and their
    names."""
    offered = body.tools_offered()
    functions = check_tools(model, offered) if offered else []
    tokens = await chat_prompt(request, model.engine, body.messages, offered,
                               thinking_switch(model.engine, body.budget_wanted()),
                               body.NAMES.get("messages", "messages"))
    return tokens, offered, functions


async def _constraint_grammar(body: _Body) -> tuple[object, str]:
    """The grammar of the field that constrains the reply (None: none), and the field."""
    field, constraint = body.constraint()
    return await grammar_for(constraint, field), field


async def _chat_grammar(body: ChatBody, offered: list[Tool]) -> tuple[object, str]:
    """The grammar of a reply that has to call a tool, or else of ``response_format``, and
    the field that asks for it."""
    required = body.tools_required(offered)
    format_field, constraint = body.constraint()
    if not required:
        return await _constraint_grammar(body)
    if constraint is not None:
        raise APIError(400, f"`{format_field}` and a `tool_choice` that requires a call "
                       "cannot both shape the reply; drop one", param=format_field)
    parallel = body.parallel_tool_calls and not isinstance(body.tool_choice, NamedToolChoice)
    return await calls_grammar_for(required, parallel=parallel), "tool_choice"


async def _respond(model: LoadedModel, request: Request, job: Job, body: _Body, kind: str,
                   functions: list[str] = ()):
    """Queue the job (and, for ``n`` choices, its copies); answer with an SSE stream or one
    JSON object. ``functions``: the names of the tools whose calls are read out of the
    reply."""
    if body.n > 1 and body.token_details:
        raise APIError(400, "`token_details` is for one choice; send `n` 1", param="n")
    jobs = _choices(job, body.n)
    for i, each in enumerate(jobs):
        try:
            model.submit(each)
        except APIError:
            for submitted in jobs[:i]:  # all the choices or none
                submitted.cancelled.set()
            raise
    head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{next(_ids)}",
            "created": int(time.time()), "model": model.name,
            "system_fingerprint": FINGERPRINT}
    shown = _Shown(body.logprobs_wanted(), body.token_details)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_events(jobs, head, kind, usage, functions, shown),
                                   ping=15, sep="\n")
    try:
        results = await asyncio.gather(*(wait(request, each) for each in jobs))
    finally:
        for each in jobs:
            each.cancelled.set()
    return _final(results, head, kind, shown, functions)


def _choices(job: Job, n: int) -> list[Job]:
    """The job and ``n - 1`` copies, each with the seed after the one before: ``n``
    choices, each its own seed, and the same seed gives the same choices."""
    return [job, *(dataclasses.replace(
        job, request=dataclasses.replace(job.request,
                                         seed=(job.request.seed + i) % (SEED.high + 1)),
        events=asyncio.Queue(), cancelled=threading.Event(), tokens_sent=0)
        for i in range(1, n))]


class _Shown:
    """What a response shows of each token: ``top`` (None: no ``logprobs``) of its
    likeliest candidates in OpenAI's fields, and with ``details`` the ``token_details``."""

    def __init__(self, top: int | None, details: bool):
        self.top = top
        self._details = TokenDetails() if details else None

    def logprobs(self, entries: list[TokenLogprob]) -> list[TokenLogprob] | None:
        """The entries cut to the candidates asked for (the engine made more only for the
        details), or None when the response has no ``logprobs``."""
        if self.top is None:
            return None
        if self._details is None:
            return entries
        return [dataclasses.replace(e, top=e.top[:self.top]) for e in entries]

    def extra(self, entries: list[TokenLogprob], stats: list) -> dict:
        """``{"token_details": [...]}`` for these tokens, or nothing."""
        return {} if self._details is None else {"token_details": self._details(entries, stats)}


class TokenDetails:
    """The ``token_details`` of one reply, chunk by chunk: for each token ``text`` (the
    characters it completes, as the completions route's logprobs), ``logprob``, ``top`` (the
    likeliest candidates in the model's distribution, ``[{"text", "p"}]``), ``k``,
    ``mass`` (the kept set's probability) and ``entropy`` (nats) of the adaptive choice,
    null under other samplers and where a figure was not computed, and ``phase``
    ("thinking" or "answer") in a reasoning model's reply, else null."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, entries: list[TokenLogprob], stats: list) -> list[dict]:
        return [self._one(entry, stats[i] if i < len(stats) else None)
                for i, entry in enumerate(entries)]

    def _one(self, entry: TokenLogprob, stats) -> dict:
        return {"text": self._decoder.decode(entry.text), "logprob": entry.logprob,
                "top": [{"text": text.decode("utf-8", "replace"), "p": math.exp(lp)}
                        for _, text, lp in entry.top[:DETAIL_CANDIDATES]],
                "k": stats.k if stats else None,
                "mass": _number(stats.kept_mass) if stats else None,
                "entropy": _number(stats.entropy) if stats else None, "phase": entry.phase}


def _number(x: float) -> float | None:
    """JSON has no NaN: a figure not computed is null."""
    return None if math.isnan(x) else x


def _final(results: list[GenerationResult], head: dict, kind: str, shown: _Shown,
           functions: list[str]) -> dict:
    """The whole reply: a choice per result (each with its ``sampler_stats`` when there
    are several), the prompt counted once in ``usage``."""
    first = results[0]
    choices = [_choice(result, i, kind, shown, functions) for i, result in enumerate(results)]
    if len(results) > 1:
        for choice, result in zip(choices, results):
            choice["sampler_stats"] = result.summary()
    return {**head, "object": "chat.completion" if kind == "chat" else "text_completion",
            "choices": choices, "usage": _usage(results), "sampler_stats": first.summary(),
            **shown.extra(first.logprobs, first.token_stats)}


def _choice(result: GenerationResult, index: int, kind: str, shown: _Shown,
            functions: list[str]) -> dict:
    reason = FINISH_REASONS[result.finish_reason]
    logprobs = shown.logprobs(result.logprobs)
    if kind != "chat":
        return {"index": index, "text": result.text,
                "logprobs": _CompletionLogprobs()(logprobs) if logprobs is not None else None,
                "finish_reason": reason}
    content, calls = parse_reply(result.text, functions) if functions else (result.text, [])
    message = {"role": "assistant", "content": content if content or not calls else None}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if calls:
        message["tool_calls"] = [_call(call) for call in calls]
    return {"index": index, "message": message,
            "logprobs": _chat_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": _finish_reason(reason, calls)}


def _call(call: ToolCall) -> dict:
    """A call as OpenAI writes it: the arguments as JSON text."""
    return {"id": call.id, "type": "function", "function": {
        "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def _finish_reason(reason: str, calls: list) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


async def _events(jobs: list[Job], head: dict, kind: str, include_usage: bool,
                  functions: list[str], shown: _Shown):
    """The stream's events (OpenAI's chunks, then ``[DONE]``) as the jobs (one per choice)
    make their pieces."""
    streams = [_Chunks(head, kind, functions, shown, i) for i in range(len(jobs))]
    results = []
    try:
        if kind == "chat":
            for stream in streams:
                yield _json({**head, "object": stream.obj, "choices": [{
                    "index": stream.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]})
        async for index, what, value in _merged(jobs):
            if what == "piece":
                for event in streams[index].piece(*value):
                    yield event
            elif what == "error":
                yield _json({"error": {"message": f"generation failed: {value}",
                                       "type": "server_error", "param": None,
                                       "code": None}})
                break
            else:
                results.append(value)
                for event in streams[index].end(value):
                    yield event
        if include_usage and len(results) == len(jobs):
            yield _json({**head, "object": streams[0].obj, "choices": [],
                         "usage": _usage(results)})
        yield "[DONE]"
    finally:
        for job in jobs:
            job.cancelled.set()  # a client that left stops the generations at the next token


async def _merged(jobs: list[Job]):
    """(the job's index, what, value) of the jobs' events as they come, each job's in its
    order, until every job is done or one fails."""
    waiting = {asyncio.ensure_future(job.events.get()): i for i, job in enumerate(jobs)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.get):
                index = waiting.pop(task)
                what, value = task.result()
                yield index, what, value
                if what == "piece":
                    waiting[asyncio.ensure_future(jobs[index].events.get())] = index
    finally:
        for task in waiting:
            task.cancel()


class _Chunks:
    """One stream's chunks: pieces of text (or, with ``functions``, the tool calls read out
    of them), their log-probabilities and details, and the last chunk."""

    def __init__(self, head: dict, kind: str, functions: list[str], shown: _Shown,
                 index: int = 0):
        self.head, self.kind, self.shown, self.index = head, kind, shown, index
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.completion_logprobs = _CompletionLogprobs()
        self.reader = ToolCallReader(functions) if functions else None
        self.calls = 0  # tool calls streamed so far
        self.held = []  # log-probabilities of tokens whose text the reader holds back

    def chunk(self, delta_text: str | None, reason: str | None = None, entries=(),
              delta: dict | None = None, **extra) -> str:
        logprobs = None
        if self.shown.top is not None and (delta_text is not None or delta):
            entries = self.shown.logprobs(entries)
            logprobs = (_chat_logprobs(entries) if self.kind == "chat"
                        else self.completion_logprobs(entries))
        if self.kind == "chat":
            if delta is None:
                delta = {} if delta_text is None else {"content": delta_text}
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": reason}
        else:
            choice = {"index": self.index, "text": delta_text or "", "logprobs": logprobs,
                      "finish_reason": reason}
        return _json({**self.head, "object": self.obj, "choices": [choice], **extra})

    def piece(self, text: str, entries, stats) -> list[str]:
        if isinstance(text, Thought):
            return [self.chunk(None, delta={"reasoning_content": str(text)}, entries=entries,
                               **self.shown.extra(entries, stats))]
        if self.reader is None:
            return [self.chunk(text, entries=entries, **self.shown.extra(entries, stats))]
        events = []
        self.held += entries
        details = self.shown.extra(entries, stats)  # with the piece's first chunk
        for part in self.reader.feed(text):
            if isinstance(part, ToolCall):
                events += self.call_chunks(part, self.held)
            else:
                events.append(self.chunk(part, entries=self.held, **details))
                details = {}
            self.held = []
        if details:  # the reader holds the text back: the details go now
            events.append(self.chunk(None, delta={}, **details))
        return events

    def call_chunks(self, call: ToolCall, entries) -> list[str]:
        """A call as OpenAI streams one: its id and name, then its arguments."""
        whole = _call(call)
        first = {"index": self.calls, "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": ""}}
        arguments = {"index": self.calls,
                     "function": {"arguments": whole["function"]["arguments"]}}
        self.calls += 1
        return [self.chunk(None, delta={"tool_calls": [first]}, entries=entries),
                self.chunk(None, delta={"tool_calls": [arguments]})]

    def end(self, result: GenerationResult) -> list[str]:
        events = []
        for part in self.reader.finish() if self.reader else ():
            events.append(self.chunk(part, entries=self.held))
            self.held = []
        events.append(self.chunk(None, _finish_reason(FINISH_REASONS[result.finish_reason],
                                                      self.calls),
                                 sampler_stats=result.summary()))
        return events


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


def _usage(results: list[GenerationResult]) -> dict:
    """The tokens of one request's choices: their prompt once, every choice's reply."""
    prompt = results[0].prompt_tokens
    completion = sum(result.completion_tokens for result in results)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion}
    if results[0].thinks:
        usage["completion_tokens_details"] = {
            "reasoning_tokens": sum(result.reasoning_tokens for result in results)}
    return usage


def _json(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---- the routes ----

@router.get("/v1/models")
@router.get("/models")
async def models(request: Request):
    pool = server_of(request).pool
    loaded = {m.name: m.engine for m in pool.loaded}
    return {"object": "list", "data": [{
        "id": m.name, "object": "model", "created": 0, "owned_by": "local",
        "loaded": m.name in loaded,
        **({"n_ctx": loaded[m.name].n_ctx, "n_vocab": loaded[m.name].n_vocab}
           if m.name in loaded else {})} for m in pool.models]}


# A server with one model answers every name with it: OpenAI clients often insist on a name.
@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: Request):
    body = await parse_body(request, ChatBody)
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        job, functions = await chat_job(request, model, body)
        return await _respond(model, request, job, body, "chat", functions)


@router.post("/v1/completions")
@router.post("/completions")
async def completions(request: Request):
    server = server_of(request)
    body = await parse_body(request, CompletionBody)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "`prompt`: send one prompt per request (a string)",
                           param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "`prompt`: the prompt is empty", param="prompt")
    async with server.model(body.model, any_name_for_one=True) as model:
        # A raw prompt: its caller wrote any chat markup (<|im_start|>...) on purpose.
        tokens = await asyncio.to_thread(model.engine.tokenize, prompt, True, True)
        # OpenAI's completions endpoint defaults to 16 tokens.
        job = await completion_job(model, tokens, body, request.url.path, default_max=16)
        return await _respond(model, request, job, body, "completion")


async def completion_job(model: LoadedModel, tokens: list[int], body: CompletionBody,
                         route: str, default_max: int | None = None) -> Job:
    """The generation a completion body asks for (llama-server's /completion translates
    its body into one); ``default_max``: the tokens without ``max_tokens`` (None: the
    room the prompt leaves)."""
    return await _job(model, tokens, body, body.max_wanted(body.max_tokens, default_max),
                      "prompt", route,
                      *await _constraint_grammar(body))


@router.post("/v1/embeddings")
@router.post("/embeddings")
async def embeddings(request: Request):
    server = server_of(request)
    body = await parse_body(request, EmbeddingBody)
    name, vectors, tokens = await server.embed(body.model, body.items(), "input",
                                               any_name_for_one=True)
    return {"object": "list", "model": name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

"""llama-server's own routes beside the protocols, in its shapes, for the scripts and clients
written for it: ``POST /completion`` (streamed or whole), ``GET /props``, ``GET /slots``
(read-only: slots are not saved or restored here), ``POST /apply-template``, ``GET /metrics``
(Prometheus text), ``POST /tokenize`` and ``POST /detokenize``. Errors come in its shape,
``{"error": {"code", "message", "type"}}``.

``/completion`` runs the completions route's path (:mod:`.openai`): ``prompt`` (text, or
token ids), ``n_predict`` (-1: until the context is full), ``temperature``, ``top_p``,
``stop``, ``seed``, ``stream``, ``n_probs``, ``grammar``, ``json_schema``, our ``sampler``
and the modifiers (:class:`.common.SamplingFields`). The reply: ``content``,
``tokens_predicted``, ``tokens_evaluated``, ``stop_type`` (``eos``, ``limit``, ``word``),
``stopping_word`` and ``timings``; streamed, a ``data:`` line per piece with
``"stop": false``, then the whole reply's line.

``/tokenize``: ``{"content": text, "add_special": false, "parse_special": true,
"with_pieces": false}`` -> ``{"tokens": [ids]}``, or with pieces ``{"tokens": [{"id": id,
"piece": text}]}`` (a piece that is not whole UTF-8, part of a character, comes as its list of
bytes). ``add_special`` adds the model's BOS token; ``parse_special`` reads markup such as
``<|im_start|>`` as the control tokens it names.

Both take an optional ``model`` (default: the server's first model).

``/detokenize``: ``{"tokens": [ids]}`` -> ``{"content": text}``, control tokens written out
as their text; an id outside the vocabulary is a 400 that names its index.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from ..runtime.engine import GenerationResult
from ..samplers import SEED
from .common import (
    LLAMA_SERVER_UNDONE,
    MAX_MESSAGES,
    MAX_STOPS,
    STRICT,
    APIError,
    LoadedModel,
    SamplingFields,
    parse_body,
    server_of,
    template_prompt,
    wait,
)
from .openai import FINGERPRINT, CompletionBody, completion_job

router = APIRouter()


class TokenizeBody(BaseModel):
    model_config = STRICT
    model: str | None = None  # None: the server's default model
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


def _piece(text: bytes) -> str | list[int]:
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        return list(text)


@router.post("/tokenize")
async def tokenize(request: Request):
    body = await parse_body(request, TokenizeBody)
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        engine = model.engine
        tokens = await asyncio.to_thread(engine.tokenize, body.content, body.add_special,
                                         body.parse_special)
        if not body.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": _piece(engine.piece(t, special=True))}
                           for t in tokens]}


@router.post("/detokenize")
async def detokenize(request: Request):
    body = await parse_body(request, DetokenizeBody)
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        engine = model.engine
        for i, token in enumerate(body.tokens):
            if not 0 <= token < engine.n_vocab:
                raise APIError(400, f"`tokens.{i}`: {token} is not a token of this model "
                               f"(0 to {engine.n_vocab - 1})", param=f"tokens.{i}")
        text = await asyncio.to_thread(
            lambda: b"".join(engine.piece(t, special=True) for t in body.tokens))
    return {"content": text.decode("utf-8", "replace")}


# ---- /completion ----

class CompletionRequest(SamplingFields):
    """llama-server's /completion body."""
    model_config = STRICT
    UNSUPPORTED: ClassVar[dict[str, tuple]] = LLAMA_SERVER_UNDONE

    model: str | None = None
    prompt: str | Annotated[list[int], Field(min_length=1)]
    n_predict: int = Field(-1, ge=-1)  # -1: until the context is full
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(None, ge=-1, le=SEED.high)  # -1: a random one, as llama-server
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=20)
    grammar: str | None = None
    json_schema: dict | None = None
    sampler: str | None = None
    logit_bias: dict | list | None = None  # as the other routes take it
    ignore_eos: bool = False

    def completion_body(self) -> CompletionBody:
        """The same request as the completions route takes it."""
        return CompletionBody.model_validate({
            "prompt": "", "n_predict": self.n_predict,  # the completions body reads it
            "temperature": self.temperature, "top_p": self.top_p, "stop": self.stop,
            "seed": None if self.seed == -1 else self.seed, "stream": self.stream,
            "logprobs": self.n_probs or None, "grammar": self.grammar,
            "json_schema": self.json_schema, "sampler": self.sampler,
            "logit_bias": self.logit_bias, "ignore_eos": self.ignore_eos,
            **self.sampling_options()})


STOP_TYPES = {"stop": "eos", "length": "limit", "stop_string": "word", "interrupted": "none"}


def _probabilities(entries) -> dict:
    """llama-server's ``completion_probabilities`` of these tokens (with ``n_probs``)."""
    def token(token_id: int, text: bytes, logprob: float) -> dict:
        return {"id": token_id, "token": text.decode("utf-8", "replace"),
                "logprob": logprob, "bytes": list(text)}
    return {"completion_probabilities": [
        {**token(e.token, e.text, e.logprob), "top_logprobs": [token(*t) for t in e.top]}
        for e in entries]} if entries else {}


def _completion(result: GenerationResult, model: str) -> dict:
    """The last object of a /completion reply, whole or streamed."""
    prompt_ms, predicted_ms = result.prompt_eval_s * 1000, result.decode_s * 1000
    return {
        "content": result.text, "stop": True, "model": model,
        **_probabilities(result.logprobs),
        "tokens_predicted": result.completion_tokens,
        "tokens_evaluated": result.prompt_tokens, "truncated": False,
        "stop_type": STOP_TYPES[result.finish_reason], "stopping_word": result.stop_string,
        "generation_settings": {"seed": result.seed, "sampler": result.sampler},
        "system_fingerprint": FINGERPRINT, "sampler_stats": result.summary(),
        "timings": {
            "prompt_n": result.prompt_tokens, "prompt_ms": prompt_ms,
            "prompt_per_second": result.prompt_tokens / result.prompt_eval_s
            if result.prompt_eval_s else 0.0,
            "predicted_n": result.completion_tokens, "predicted_ms": predicted_ms,
            "predicted_per_second": result.decode_tokens_per_s}}


async def _pieces(job, model: str):
    try:
        while True:
            what, value = await job.events.get()
            if what == "piece":
                yield json.dumps({"content": str(value[0]), "stop": False,
                                  **_probabilities(value[1])}, ensure_ascii=False)
            elif what == "error":
                yield json.dumps({"error": {"code": 500, "type": "server_error",
                                            "message": f"generation failed: {value}"}})
                return
            else:
                yield json.dumps(_completion(value, model), ensure_ascii=False)
                return
    finally:
        job.cancelled.set()


@router.post("/completion")
async def completion(request: Request):
    body = await parse_body(request, CompletionRequest)
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        if isinstance(body.prompt, str):
            tokens = await asyncio.to_thread(model.engine.tokenize, body.prompt, True, True)
        else:
            tokens = _checked_tokens(model, body.prompt, "prompt")
        if not tokens:
            raise APIError(400, "`prompt`: the prompt is empty", param="prompt")
        job = await completion_job(model, tokens, body.completion_body(), request.url.path)
        model.submit(job)
        if body.stream:
            return EventSourceResponse(_pieces(job, model.name), ping=15, sep="\n")
        return _completion(await wait(request, job), model.name)


def _checked_tokens(model: LoadedModel, tokens: list[int], field: str) -> list[int]:
    for i, token in enumerate(tokens):
        if not 0 <= token < model.engine.n_vocab:
            raise APIError(400, f"`{field}.{i}`: {token} is not a token of this model "
                           f"(0 to {model.engine.n_vocab - 1})", param=f"{field}.{i}")
    return tokens


# ---- what the server holds ----

@router.get("/props")
async def props(request: Request, model: str | None = None):
    async with server_of(request).model(model, any_name_for_one=True) as loaded:
        engine = loaded.engine
        return {"default_generation_settings": {
                    "n_ctx": engine.n_ctx, "params": {"sampler": str(loaded.sampler),
                                                      "seed": engine.seed}},
                "total_slots": engine.parallel, "model_alias": loaded.name,
                "model_path": str(loaded.served.path),
                "chat_template": engine.chat_template.source if engine.chat_template else "",
                "modalities": {"vision": False, "audio": False},
                "build_info": FINGERPRINT}


@router.get("/slots")
async def slots(request: Request, model: str | None = None):
    async with server_of(request).model(model, any_name_for_one=True) as loaded:
        decoder = loaded.engine.decoder
        return [{"id": slot.index, "n_ctx": decoder.n_ctx_seq,
                 "is_processing": slot.generation is not None,
                 "n_cached_tokens": len(slot.tokens)} for slot in decoder.slots]


@router.post("/slots/{slot_id}")
async def slot_action(slot_id: str):
    raise APIError(400, "this server does not save, restore or erase slots (its slots' "
                   "caches are reused by prompt); GET /slots shows them",
                   code="unsupported_field")


class TemplateBody(BaseModel):
    model_config = STRICT
    model: str | None = None
    messages: Annotated[list[dict], Field(min_length=1, max_length=MAX_MESSAGES)]


@router.post("/apply-template")
async def apply_template(request: Request):
    body = await parse_body(request, TemplateBody)
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        tokens = await template_prompt(request, model.engine, body.messages)
        text = b"".join(model.engine.piece(t, special=True) for t in tokens)
        return {"prompt": text.decode("utf-8", "replace")}


# Prometheus metrics: (name, type, help, what of a loaded model)
METRICS = [
    ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens evaluated.",
     lambda m: m.scheduler.totals["prompt_tokens"]),
    ("llamacpp:prompt_seconds_total", "counter", "Seconds spent on prompts.",
     lambda m: m.scheduler.totals["prompt_s"]),
    ("llamacpp:tokens_predicted_total", "counter", "Tokens generated.",
     lambda m: m.scheduler.totals["predicted_tokens"]),
    ("llamacpp:tokens_predicted_seconds_total", "counter", "Seconds spent generating.",
     lambda m: m.scheduler.totals["predicted_s"]),
    ("llamacpp:predicted_tokens_seconds", "gauge", "Generated tokens per second so far.",
     lambda m: _rate(m.scheduler.totals["predicted_tokens"], m.scheduler.totals["predicted_s"])),
    ("llamacpp:prompt_tokens_seconds", "gauge", "Prompt tokens per second so far.",
     lambda m: _rate(m.scheduler.totals["prompt_tokens"], m.scheduler.totals["prompt_s"])),
    ("llamacpp:requests_processing", "gauge", "Requests generating now.",
     lambda m: m.scheduler.running),
    ("llamacpp:requests_deferred", "gauge", "Requests waiting for a slot.",
     lambda m: m.scheduler.waiting),
]


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds else 0.0


@router.get("/metrics")
async def metrics(request: Request):
    loaded = server_of(request).pool.loaded
    lines = []
    for name, kind, text, value in METRICS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{model="{m.name}"}} {value(m)}' for m in loaded]
    lines += ["# HELP adaptive_llama:requests_total Requests ended, by how they ended.",
              "# TYPE adaptive_llama:requests_total counter"]
    lines += [f'adaptive_llama:requests_total{{model="{m.name}",outcome="{outcome}"}} {n}'
              for m in loaded for outcome, n in m.scheduler.counts.items()]
    return PlainTextResponse("\n".join(lines) + "\n",
                             media_type="text/plain; version=0.0.4")

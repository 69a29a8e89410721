"""OpenAI's Responses API, ``POST /v1/responses``, as OpenAI's SDKs and Codex call it.

Stateless: the server keeps no responses, so every request sends the whole conversation
(``store`` is accepted and nothing is stored; ``previous_response_id`` and ``conversation``
are 400s that say so). ``input`` is a string or a list of items: messages (``input_text``
parts; ``output_text`` in the assistant's), ``function_call`` items sent back and their
``function_call_output`` (whose ``call_id`` has to name a call before it), ``reasoning``
items (read and left out, as the thinking of earlier turns is). ``instructions`` goes first
as a system message.

The request is translated into the chat route's (:func:`.openai.chat_job`: one template,
tool-call parser, grammar and scheduler for every API): ``max_output_tokens``,
``temperature``, ``top_p``, ``tools`` (function tools), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``json_object``, ``json_schema``), ``reasoning.effort``
(a thinking budget, docs/reasoning.md), and our extensions as on the chat route
(``sampler``, ``seed``, the modifiers of :class:`.common.SamplingFields`).

The reply is a ``response`` object whose ``output`` holds a ``reasoning`` item (a reasoning
model's thinking, as ``reasoning_text``), a ``message`` item of ``output_text`` and one
``function_call`` item per call; ``status`` is ``incomplete`` (``max_output_tokens``) when
the reply was cut. With ``stream`` the same comes as OpenAI's events: ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, its deltas
(``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``) and ``.done`` events, then
``response.completed`` (or ``response.incomplete``, ``response.failed``).
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from typing import Annotated, ClassVar, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, ValidationError
from sse_starlette.sse import EventSourceResponse

from ..runtime.engine import GenerationResult
from ..runtime.tools import ToolCall, parse_reply
from ..samplers import SEED
from .common import (
    FUNCTION_NAME,
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TOOLS,
    STRICT,
    APIError,
    ContentPart,
    SamplingFields,
    parse_body,
    reply_events,
    server_of,
    wait,
)
from .openai import ChatBody, chat_job

router = APIRouter()
MAX_ID = 256  # characters of a call's id
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
FORMAT_FIELDS = {"messages": "input", "response_format": "text.format"}


class InputItem(BaseModel):
    """One item of ``input``: a message, a function call sent back or its output, or a
    reasoning item (its fields, by ``type``)."""
    model_config = STRICT
    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None
    call_id: str | None = Field(None, max_length=MAX_ID)
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    arguments: str | None = None
    output: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None


class FunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the others would change the reply


class Reasoning(BaseModel):
    model_config = STRICT
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the thinking comes whole


class ResponsesBody(SamplingFields):
    model_config = STRICT
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "background": (None, False), "prompt": (None,), "max_tool_calls": (None,),
        "top_logprobs": (None, 0)}

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    metadata: dict | None = None
    include: Annotated[list[str], Field(max_length=64)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    seed: int | None = Field(None, ge=0, le=SEED.high)
    sampler: str | None = None

    def chat_body(self) -> ChatBody:
        """The same request as the chat route takes it; a 400 naming the item that does
        not fit."""
        if "message.output_text.logprobs" in (self.include or []):
            raise APIError(400, "`include`: this server gives no log-probabilities on this "
                           "route; use /v1/chat/completions with `logprobs`",
                           param="include", code="unsupported_field")
        for field in ("previous_response_id", "conversation"):
            if getattr(self, field) is not None:
                raise APIError(400, f"`{field}`: this server keeps no responses or "
                               "conversations; send the whole conversation in `input`",
                               param=field, code="unsupported_field")
        fields = {"messages": self.messages(), "model": self.model,
                  "max_completion_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p,
                  "tools": [{"type": "function", "function": t.model_dump(
                      exclude={"type"}, exclude_none=True)} for t in self.tools or []] or None,
                  "tool_choice": self.chat_tool_choice(),
                  "parallel_tool_calls": self.parallel_tool_calls,
                  "response_format": self.response_format(),
                  "reasoning_budget": 0 if self.effort() == "none" else None,
                  "reasoning_effort": None if self.effort() == "none" else self.effort(),
                  "seed": self.seed, "sampler": self.sampler, "stream": self.stream,
                  **self.sampling_options()}
        try:
            return ResponsesChat.model_validate(fields)
        except ValidationError as exc:  # what only the translation's bounds catch
            raise APIError(400, f"`input`: {exc.errors()[0]['msg']}", param="input") from None

    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning else None

    def chat_tool_choice(self):
        if isinstance(self.tool_choice, NamedFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def response_format(self) -> dict | None:
        form = self.text.format if self.text else None
        if form is None or form.type != "json_schema":
            return None if form is None else {"type": form.type}
        return {"type": "json_schema", "json_schema": {
            "name": form.name, "schema": form.schema_, "strict": form.strict}}

    def messages(self) -> list[dict]:
        """``instructions`` and ``input`` as the chat route's messages."""
        messages = [{"role": "system", "content": self.instructions}] \
            if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        calls: dict[str, str] = {}  # call_id -> the function's name, of the calls so far
        for i, item in enumerate(self.input):
            _add_item(messages, item, f"input.{i}", calls)
        if not messages:
            raise APIError(400, "`input`: the conversation is empty", param="input")
        return messages


class ResponsesChat(ChatBody):
    NAMES: ClassVar[dict[str, str]] = FORMAT_FIELDS


def _add_item(messages: list[dict], item: InputItem, where: str,
              calls: dict[str, str]) -> None:
    """Append ``item`` to the chat messages: a function call joins the assistant message
    before it (or opens one), so that parallel calls stay one turn."""
    if item.type == "message":
        if item.role is None or item.content is None:
            raise APIError(400, f"`{where}`: a message needs `role` and `content`",
                           param=where)
        messages.append({"role": item.role, "content": _text(item.content,
                                                             f"{where}.content")})
    elif item.type == "function_call":
        _need(item, ("call_id", "name", "arguments"), where)
        if item.call_id in calls:
            raise APIError(400, f"`{where}.call_id`: two function calls have the id "
                           f"{item.call_id!r}", param=f"{where}.call_id")
        calls[item.call_id] = item.name
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            messages.append(last)
        last.setdefault("tool_calls", []).append(call)
    elif item.type == "function_call_output":
        _need(item, ("call_id", "output"), where)
        if item.call_id not in calls:
            raise APIError(400, f"`{where}.call_id`: no function_call before it has the "
                           f"call_id {item.call_id!r}", param=f"{where}.call_id")
        messages.append({"role": "tool", "tool_call_id": item.call_id,
                         "name": calls[item.call_id],
                         "content": _text(item.output, f"{where}.output")})
    elif item.type != "reasoning":  # earlier thinking is not shown to the model again
        raise APIError(400, f"`{where}.type`: this server takes message, function_call, "
                       f"function_call_output and reasoning items, not {item.type!r}",
                       param=f"{where}.type")


def _need(item: InputItem, fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if getattr(item, f) is None]
    if missing:
        raise APIError(400, f"`{where}.{missing[0]}` is required in a {item.type} item",
                       param=f"{where}.{missing[0]}")


def _text(content: str | list[ContentPart], where: str) -> str:
    """A message's text; a 400 for a part that is not text (this model reads text only)."""
    if isinstance(content, str):
        return content
    for i, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise APIError(400, f"`{where}.{i}`: this model takes text only; send "
                           f"input_text parts, not {part.type!r}", param=f"{where}.{i}",
                           code="unsupported_field")
    return "".join(part.text for part in content)


# ---- the reply ----

def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _message(text: str, item_id: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_output_text(text)] if status == "completed" else []}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning(text: str, item_id: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _function_call(call: ToolCall, item_id: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False)
            if status == "completed" else "", "status": status}


class _Head:
    """What every ``response`` object of one request says besides its output."""

    def __init__(self, body: ResponsesBody, model: str):
        self.fields = {
            "id": _item_id("resp"), "object": "response", "created_at": int(time.time()),
            "model": model, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": body.effort(), "summary": None}, "store": False,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text and body.text.format else {"type": "text"})},
            "tool_choice": body.tool_choice.model_dump()
            if isinstance(body.tool_choice, NamedFunction) else body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "truncation": body.truncation or "disabled", "metadata": body.metadata or {}}

    def response(self, output: list[dict], result: GenerationResult | None = None,
                 status: str | None = None, error: str | None = None) -> dict:
        """The response object: in progress without ``result``, else completed or, cut
        by the token limit, incomplete."""
        cut = result is not None and result.finish_reason == "length"
        status = status or ("in_progress" if result is None
                            else "incomplete" if cut else "completed")
        return {**self.fields, "status": status, "output": output,
                "output_text": "".join(part["text"] for item in output
                                       if item["type"] == "message"
                                       for part in item["content"]),
                "error": {"code": "server_error", "message": error} if error else None,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "usage": _usage(result) if result is not None else None,
                **({"sampler_stats": result.summary()} if result is not None else {})}


def _usage(result: GenerationResult) -> dict:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _final_output(result: GenerationResult, functions: list[str]) -> list[dict]:
    """The output items of a whole reply: its thinking, its text, its calls."""
    text, calls = parse_reply(result.text, functions) if functions else (result.text, [])
    output = [_reasoning(result.reasoning, _item_id("rs"))] if result.reasoning else []
    if text.strip() or not calls:
        output.append(_message(text, _item_id("msg")))
    return output + [_function_call(call, _item_id("fc")) for call in calls]


class _Events:
    """One stream's events: the items of the reply opened, filled and closed as its parts
    come (:func:`.common.reply_parts`), each event numbered."""

    def __init__(self, head: _Head):
        self.head = head
        self.numbers = itertools.count()
        self.output: list[dict] = []   # the items closed so far
        self.open: dict | None = None  # the item text is going into, with its text so far

    def event(self, kind: str, **fields) -> dict:
        return {"event": kind, "data": json.dumps(
            {"type": kind, "sequence_number": next(self.numbers), **fields},
            ensure_ascii=False)}

    def start(self) -> list[dict]:
        response = self.head.response([])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def text(self, kind: str, text: str) -> list[dict]:
        """``kind`` "thinking" or "text": a delta of the open item of that kind, opened
        (and the one before closed) first where needed."""
        events = []
        wanted = "reasoning" if kind == "thinking" else "message"
        if self.open is None or self.open["item"]["type"] != wanted:
            events += self.close() + self._open(wanted)
        self.open["text"] += text
        delta = "response.reasoning_text.delta" if kind == "thinking" \
            else "response.output_text.delta"
        extra = {} if kind == "thinking" else {"logprobs": []}
        return events + [self.event(delta, item_id=self.open["item"]["id"],
                                    output_index=len(self.output), content_index=0,
                                    delta=text, **extra)]

    def _open(self, kind: str) -> list[dict]:
        item = (_reasoning("", _item_id("rs")) if kind == "reasoning"
                else _message("", _item_id("msg"), "in_progress"))
        self.open = {"item": item, "text": ""}
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" \
            else _output_text("")
        where = {"item_id": item["id"], "output_index": len(self.output)}
        return [self.event("response.output_item.added", output_index=len(self.output),
                           item=item),
                self.event("response.content_part.added", **where, content_index=0,
                           part=part)]

    def close(self) -> list[dict]:
        """Close the open item: its text's ``.done`` events and the item whole."""
        if self.open is None:
            return []
        item, text = self.open["item"], self.open["text"]
        reasoning = item["type"] == "reasoning"
        done = _reasoning(text, item["id"]) if reasoning else _message(text, item["id"])
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        events = [self.event("response.reasoning_text.done" if reasoning
                             else "response.output_text.done", **where, text=text,
                             **({} if reasoning else {"logprobs": []})),
                  self.event("response.content_part.done", **where,
                             part=done["content"][0]),
                  self.event("response.output_item.done", output_index=len(self.output),
                             item=done)]
        self.output.append(done)
        self.open = None
        return events

    def call(self, call: ToolCall) -> list[dict]:
        events = self.close()
        item_id, index = _item_id("fc"), len(self.output)
        done = _function_call(call, item_id)
        events += [self.event("response.output_item.added", output_index=index,
                              item=_function_call(call, item_id, "in_progress")),
                   self.event("response.function_call_arguments.delta", item_id=item_id,
                              output_index=index, delta=done["arguments"]),
                   self.event("response.function_call_arguments.done", item_id=item_id,
                              output_index=index, name=call.name,
                              arguments=done["arguments"]),
                   self.event("response.output_item.done", output_index=index, item=done)]
        self.output.append(done)
        return events

    def end(self, result: GenerationResult) -> list[dict]:
        kind = "response.incomplete" if result.finish_reason == "length" \
            else "response.completed"
        events = self.close()  # before the response, which lists the item it closes
        return events + [self.event(kind, response=self.head.response(self.output, result))]

    def failed(self, message: str) -> list[dict]:
        return self.close() + [self.event("response.failed", response=self.head.response(
            self.output, status="failed", error=f"generation failed: {message}"))]


@router.post("/v1/responses")
async def responses(request: Request):
    body = await parse_body(request, ResponsesBody)
    chat = body.chat_body()
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        job, functions = await chat_job(request, model, chat)
        model.submit(job)
        head = _Head(body, model.name)
        if body.stream:
            return EventSourceResponse(reply_events(job, functions, _Events(head)), ping=15,
                                       sep="\n")
        result = await wait(request, job)
        return head.response(_final_output(result, functions), result)

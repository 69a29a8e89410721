"""Anthropic's Messages API, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``,
as Anthropic's SDKs and Claude Code call it.

``system`` (a string or text blocks), ``messages`` of text, ``tool_use`` and
``tool_result`` blocks (a result's ``tool_use_id`` has to name a ``tool_use`` before it),
``max_tokens`` (required, as Anthropic requires it), ``temperature``, ``top_p``,
``top_k``, ``stop_sequences``, ``tools`` (``input_schema``), ``tool_choice`` (``auto``,
``any``, ``tool``, ``none``; ``disable_parallel_tool_use``) and ``thinking``: a reasoning
model thinks only when the request enables it (``{"type": "enabled", "budget_tokens":
N}``: N is its thinking budget, docs/reasoning.md), and its thinking then comes back as a
``thinking`` block; without it, the thinking is turned off. Our extensions as on the other
routes (``sampler``, ``seed``, the modifiers of :class:`.common.SamplingFields`). Image and
document blocks are a 400: the models served here read text. A last message of the
assistant's (a prefill to continue) is a 400 too.

The request is translated into the chat route's (:func:`.openai.chat_job`): one template,
tool-call parser, grammar and scheduler for every API. The reply is a ``message`` whose
``content`` holds its blocks; ``stop_reason`` is ``end_turn``, ``max_tokens``,
``stop_sequence`` (with ``stop_sequence``) or ``tool_use``. With ``stream``, Anthropic's
events: ``message_start``, per block ``content_block_start``, ``content_block_delta``
(``text_delta``, ``thinking_delta``, ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (the stop reason and usage) and ``message_stop``.

Errors come in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
(:mod:`.errors`); the API key also comes as ``x-api-key`` (:mod:`.guard`).
"""

from __future__ import annotations

import json
import secrets
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
    MAX_STOPS,
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
from .openai import ChatBody, chat_job, chat_tokens

router = APIRouter()
MAX_ID = 256  # characters of a tool_use's id
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
# The engine's finish reasons -> Anthropic's stop reasons (a reply with calls: tool_use).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_string": "stop_sequence",
                "interrupted": "end_turn"}


class Block(BaseModel):
    """One content block of a message (its fields, by ``type``)."""
    model_config = STRICT
    type: str
    text: str | None = None
    id: str | None = Field(None, max_length=MAX_ID)        # tool_use
    name: str | None = Field(None, pattern=FUNCTION_NAME)  # tool_use
    input: dict | None = None                              # tool_use
    tool_use_id: str | None = Field(None, max_length=MAX_ID)  # tool_result
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None
    is_error: bool | None = None                           # tool_result
    thinking: str | None = None                            # thinking sent back


class AnthropicMessage(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_PARTS)]


class SystemBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class AnthropicTool(BaseModel):
    model_config = STRICT
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are not run here
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)


class CountBody(SamplingFields):
    """What a prompt is made of (``count_tokens`` takes only this)."""
    model_config = STRICT
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"mcp_servers": (None, []),
                                               "container": (None,),
                                               "context_management": (None,)}

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | Annotated[list[SystemBlock], Field(max_length=MAX_PARTS)] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def budget(self) -> int:
        """The thinking budget: the one asked for, else 0 (no thinking, as Anthropic's
        default)."""
        if self.thinking is None or self.thinking.type == "disabled":
            return 0
        if self.thinking.budget_tokens is None:
            raise APIError(400, "`thinking.budget_tokens` is required with type enabled",
                           param="thinking.budget_tokens")
        return self.thinking.budget_tokens

    def chat_fields(self) -> dict:
        return {"messages": self.chat_messages(), "model": self.model,
                "tools": [{"type": "function", "function": {
                    "name": t.name, "description": t.description,
                    "parameters": t.input_schema}} for t in self.tools or []] or None,
                **self.chat_tool_choice(), "reasoning_budget": self.budget()}

    def chat_tool_choice(self) -> dict:
        choice = self.tool_choice
        if choice is None:
            return {}
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, "`tool_choice.name` is required with type tool",
                           param="tool_choice.name")
        chat = ({"type": "function", "function": {"name": choice.name}}
                if choice.type == "tool" else
                {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        return {"tool_choice": chat,
                "parallel_tool_calls": not choice.disable_parallel_tool_use}

    def chat_messages(self) -> list[dict]:
        """``system`` and ``messages`` as the chat route's messages."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) \
                else "\n\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        calls: dict[str, str] = {}  # tool_use id -> the tool's name, of the calls so far
        for i, message in enumerate(self.messages):
            messages += _chat_turn(message, f"messages.{i}", calls)
        if self.messages[-1].role == "assistant":
            raise APIError(400, f"`messages.{len(self.messages) - 1}`: this server does not "
                           "continue an assistant's message; end with a user message",
                           param=f"messages.{len(self.messages) - 1}")
        return messages


class MessagesBody(CountBody):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    metadata: dict | None = None
    seed: int | None = Field(None, ge=0, le=SEED.high)
    sampler: str | None = None

    def chat_body(self) -> ChatBody:
        fields = {**self.chat_fields(), "max_tokens": self.max_tokens,
                  "temperature": self.temperature, "top_p": self.top_p,
                  "stop": self.stop_sequences, "stream": self.stream, "seed": self.seed,
                  "sampler": self.sampler, **self.sampling_options()}
        return _validated(fields)


def _validated(fields: dict) -> ChatBody:
    try:
        return ChatBody.model_validate(fields)
    except ValidationError as exc:  # what only the translation's bounds catch
        raise APIError(400, f"`messages`: {exc.errors()[0]['msg']}",
                       param="messages") from None


def _chat_turn(message: AnthropicMessage, where: str, calls: dict[str, str]) -> list[dict]:
    """One message as the chat route's: an assistant's text, thinking and calls in one
    message; a user's tool results each a tool message, before its text."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text, results, made = [], [], []
    for j, block in enumerate(message.content):
        at = f"{where}.content.{j}"
        if block.type == "text" and block.text is not None:
            text.append(block.text)
        elif block.type == "tool_use" and message.role == "assistant":
            made.append(_call(block, at, calls))
        elif block.type == "tool_result" and message.role == "user":
            results.append(_result(block, at, calls))
        elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier thinking is not shown to the model again
        elif block.type in MEDIA_BLOCKS:
            raise APIError(400, f"`{at}`: this model takes text only, not {block.type!r} "
                           "blocks", param=at)
        else:
            raise APIError(400, f"`{at}.type`: a {message.role} message takes "
                           f"{'text and tool_use' if message.role == 'assistant' else 'text and tool_result'}"
                           f" blocks, not {block.type!r}", param=f"{at}.type")
    if message.role == "assistant":
        turn = {"role": "assistant", "content": "".join(text) or None}
        return [{**turn, "tool_calls": made} if made else turn]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results
                      else [])


def _call(block: Block, where: str, calls: dict[str, str]) -> dict:
    if block.id is None or block.name is None or block.input is None:
        raise APIError(400, f"`{where}`: a tool_use block needs `id`, `name` and `input`",
                       param=where)
    if block.id in calls:
        raise APIError(400, f"`{where}.id`: two tool_use blocks have the id {block.id!r}",
                       param=f"{where}.id")
    calls[block.id] = block.name
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input)}}


def _result(block: Block, where: str, calls: dict[str, str]) -> dict:
    if block.tool_use_id not in calls:
        raise APIError(400, f"`{where}.tool_use_id`: no tool_use before it has the id "
                       f"{block.tool_use_id!r}", param=f"{where}.tool_use_id")
    content = block.content or ""
    if not isinstance(content, str):
        for k, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise APIError(400, f"`{where}.content.{k}`: this model takes text only, "
                               f"not {part.type!r} blocks", param=f"{where}.content.{k}")
        content = "".join(part.text for part in content)
    if block.is_error:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block.tool_use_id,
            "name": calls[block.tool_use_id], "content": content}


# ---- the reply ----

def _stop_reason(result: GenerationResult, calls: bool) -> str:
    reason = STOP_REASONS[result.finish_reason]
    return "tool_use" if calls and reason == "end_turn" else reason


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


def _usage(result: GenerationResult) -> dict:
    return {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens}


def _message(model: str, content: list[dict], result: GenerationResult | None,
             calls: bool = False) -> dict:
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
            "model": model, "content": content,
            "stop_reason": _stop_reason(result, calls) if result else None,
            "stop_sequence": (result.stop_string or None) if result else None,
            "usage": _usage(result) if result else {"input_tokens": 0, "output_tokens": 0}}


def _final_content(result: GenerationResult, functions: list[str], thinking: bool
                   ) -> tuple[list[dict], bool]:
    text, calls = parse_reply(result.text, functions) if functions else (result.text, [])
    content = [{"type": "thinking", "thinking": result.reasoning, "signature": ""}] \
        if thinking and result.reasoning else []
    if text.strip() or not calls:
        content.append({"type": "text", "text": text})
    return content + [_tool_use(call) for call in calls], bool(calls)


class _Blocks:
    """One stream's events: each block started, filled and stopped as the reply's parts
    come (:func:`.common.reply_parts`)."""

    def __init__(self, model: str, prompt_tokens: int, thinking: bool):
        self.model, self.prompt_tokens = model, prompt_tokens
        self.thinking = thinking  # whether the request enabled thinking (shown then)
        self.index = -1          # of the block open or last stopped
        self.open: str | None = None  # the kind of the open block: "text", "thinking"
        self.calls = 0

    @staticmethod
    def event(kind: str, **fields) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **fields},
                                                  ensure_ascii=False)}

    def start(self) -> list[dict]:
        message = _message(self.model, [], None)
        message["usage"]["input_tokens"] = self.prompt_tokens
        return [self.event("message_start", message=message)]

    def _start_block(self, block: dict) -> dict:
        self.index += 1
        return self.event("content_block_start", index=self.index, content_block=block)

    def stop(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.index)]

    def text(self, kind: str, text: str) -> list[dict]:
        if kind == "thinking" and not self.thinking:
            return []
        events = []
        if self.open != kind:
            events += self.stop()
            block = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            events.append(self._start_block(block))
            self.open = kind
        delta = {"type": "text_delta", "text": text} if kind == "text" else \
            {"type": "thinking_delta", "thinking": text}
        return events + [self.event("content_block_delta", index=self.index, delta=delta)]

    def call(self, call: ToolCall) -> list[dict]:
        events = self.stop() + [self._start_block({**_tool_use(call), "input": {}})]
        self.calls += 1
        return events + [
            self.event("content_block_delta", index=self.index, delta={
                "type": "input_json_delta",
                "partial_json": json.dumps(call.arguments, ensure_ascii=False)}),
            self.event("content_block_stop", index=self.index)]

    def end(self, result: GenerationResult) -> list[dict]:
        events = self.stop()
        if self.index < 0:  # an empty reply is one empty text block, as Anthropic's
            events += [self._start_block({"type": "text", "text": ""}),
                       self.event("content_block_stop", index=self.index)]
        return events + [
            self.event("message_delta", delta={
                "stop_reason": _stop_reason(result, self.calls > 0),
                "stop_sequence": result.stop_string or None}, usage=_usage(result)),
            self.event("message_stop")]

    def failed(self, message: str) -> list[dict]:
        return self.stop() + [self.event("error", error={
            "type": "api_error", "message": f"generation failed: {message}"})]


@router.post("/v1/messages")
async def messages(request: Request):
    body = await parse_body(request, MessagesBody)
    chat = body.chat_body()
    thinking = body.budget() != 0
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        job, functions = await chat_job(request, model, chat)
        model.submit(job)
        if body.stream:
            blocks = _Blocks(model.name, len(job.request.prompt_tokens), thinking)
            return EventSourceResponse(reply_events(job, functions, blocks), ping=15,
                                       sep="\n")
        result = await wait(request, job)
        content, calls = _final_content(result, functions, thinking)
        return _message(model.name, content, result, calls)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    body = await parse_body(request, CountBody)
    chat = _validated(body.chat_fields())
    async with server_of(request).model(body.model, any_name_for_one=True) as model:
        tokens, _, _ = await chat_tokens(request, model, chat)
        return {"input_tokens": len(tokens)}

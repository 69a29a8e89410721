"""Chat templates: the model's own (the GGUF's ``tokenizer.chat_template``) or one given in
its place, rendered with Jinja as Hugging Face renders them, and what a template does with
tools.

A template is rendered with a mark in place of every text a client gives (a message's
content, a tool call's id, name and arguments, a tool result's id and name, a tool's
description and the names and texts of its parameters), so that the caller can tokenize the
template's markup (whose ``<|im_start|>`` are control tokens) apart from those texts (where
they stay text): no field can end a turn or forge another role's. Roles and ``type`` fields
are checked values, left as they are. Values a template writes as JSON (``tools | tojson``, a
call's arguments) are written from the texts themselves, and cannot hold a control token
either: its first character is written as a JSON escape (``\\u003c|im_end|>``), which parses
to the same string.

Rendering is bounded (:mod:`.template_sandbox`): a template, the model's own included, is
untrusted input. One that cannot be parsed, or that passes the bounds on a short
conversation, is refused when it is loaded, in one line naming it.

Built in, by name, for models whose own template has no tools: ``chatml-tools``, ChatML
(``<|im_start|>role ... <|im_end|>``, the markup of SmolLM2 and Qwen) with tools in Hermes's
format, as Qwen2.5 writes them: the tools' signatures in the system turn, each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and the tools' results as a user
turn of ``<tool_response>`` blocks.

Also by name: every template llama.cpp has built in (``llama3``, ``chatml``, ``gemma``,
``command-r``, ...; :func:`llama_cpp_names`), rendered by llama.cpp's own
``llama_chat_apply_template`` as llama-server's ``--chat-template NAME`` renders it, with the
same marks around the client's texts. Those write no tools and no BOS (the engine adds the
model's), and keep a client's text as sent where llama.cpp would trim it.
"""

from __future__ import annotations

import ctypes
import functools
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from .template_process import TemplateCrashed, TemplateSyntax, render
from .template_sandbox import TemplateBudgetError

CHATML_TOOLS = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": '
    + (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

BUILTIN = {"chatml-tools": CHATML_TOOLS}
HERMES_CALL = "<tool_call>"  # what a template that writes Hermes's tool calls contains
# The source standing for one of llama.cpp's built-in templates (a Jinja comment, so that
# whatever reads a source as Jinja finds nothing in it).
_LLAMA_CPP_SOURCE = re.compile(r"\{#- llama\.cpp's built-in chat template ([\w.-]+) -#\}")


@functools.cache
def llama_cpp_names() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat templates (llama_chat_builtin_templates)."""
    import llama_cpp

    count = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * count)()
    llama_cpp.llama_chat_builtin_templates(names, count)
    return tuple(name.decode() for name in names)


def load_template(value: str) -> str:
    """A template's source from a built-in name (``chatml-tools``, or one of llama.cpp's) or
    a Jinja file's path, checked (:func:`check_template`); ValueError saying what was
    wrong."""
    if value in BUILTIN:
        return BUILTIN[value]
    if value in llama_cpp_names():
        return f"{{#- llama.cpp's built-in chat template {value} -#}}"
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"has to be a built-in template ({', '.join(BUILTIN)}, or one of "
                         f"llama.cpp's: {', '.join(llama_cpp_names())}) or a Jinja file, "
                         f"but {value!r} is neither")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{value} cannot be read as a UTF-8 Jinja file ({exc})") from None
    check_template(source, origin=value)
    return source


class TemplateError(ValueError):
    """A chat template that cannot be used; one line naming it, what is wrong and where."""


def check_template(source: str, origin: str) -> None:
    """TemplateError when ``source`` is no Jinja or passes the render bounds on a short
    conversation (``origin`` names it in the message)."""
    ChatTemplate(source, bos="", eos="", specials=lambda: None, origin=origin)


_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
# Keys whose values a template compares with literals ("user", "function", "string"): kept.
_CHECKED_KEYS = frozenset({"role", "type", "format", "$ref"})


class ChatTemplate:
    """One model's chat template, rendered in a renderer process (:mod:`.template_process`).

    Args:
        source: the Jinja template.
        bos, eos: the texts of the model's BOS and EOS tokens (templates write them).
        specials: the regular expression of the model's control tokens' texts, made on
            first use (its vocabulary is scanned only when a template writes JSON).
        origin: what the template is, for messages ("the chat template of model.gguf").

    Raises:
        TemplateError: a syntax error, or a template that passes the render bounds (or
            stops its renderer) on a short conversation.
    """

    def __init__(self, source: str, *, bos: str, eos: str,
                 specials: Callable[[], re.Pattern | None], origin: str = "the chat template"):
        self.source = source
        self.origin = origin
        named = _LLAMA_CPP_SOURCE.fullmatch(source.strip())
        self._llama_cpp_name = named.group(1) if named else None
        self._specials = specials
        self._bos, self._eos = bos, eos
        try:
            self._render(_PROBE, None)
        except TemplateSyntax as exc:
            where = f"line {exc.line}: " if exc.line else ""
            raise TemplateError(f"{origin} is not valid Jinja: {where}{exc}") from None
        except (TemplateBudgetError, TemplateCrashed) as exc:
            raise TemplateError(f"{origin} cannot be used: rendering a four-message "
                                f"conversation, {exc}") from None
        except ValueError:  # the template's own refusal of the probe's roles
            pass

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               cancelled: threading.Event | None = None, thinking: bool | None = None
               ) -> tuple[list[tuple[str, bool]], bool]:
        """The conversation as (markup, False) and (client text, True) parts, and whether
        the template wrote the BOS itself (always: templates write ``bos_token``). A
        message's ``content`` is text, a tool call's ``arguments`` an object. ``thinking``
        (not None) is the template's ``enable_thinking`` (Qwen3's switch).

        Raises what :func:`.template_process.render` raises: TemplateBudgetError past the
        bounds, TemplateCancelled once ``cancelled`` is set (the renderer is stopped)."""
        nonce = str(secrets.randbelow(10**8))  # digits: upper() or lower() keep the mark
        texts: list[str] = []
        marker = _Marker(nonce, texts)
        marked = [marker.message(m) for m in messages]
        offered = [marker.tool(t) for t in tools] if tools else None
        rendered = self._render(marked, offered, texts, cancelled, thinking)
        return list(_split_marks(rendered, texts, nonce)), self._llama_cpp_name is None

    def _render(self, messages: list[dict], tools: list[dict] | None,
                texts: list[str] | None = None, cancelled: threading.Event | None = None,
                thinking: bool | None = None) -> str:
        if self._llama_cpp_name is not None:
            return _llama_cpp_render(self._llama_cpp_name, messages)
        pattern = self._specials() if "tojson" in self.source else None
        switch = {} if thinking is None else {"enable_thinking": thinking}
        return render(self.source, texts=texts, cancelled=cancelled,
                      specials=pattern.pattern if pattern else None,
                      context={"messages": messages, "tools": tools or None,
                               "bos_token": self._bos, "eos_token": self._eos,
                               "add_generation_prompt": True, "functions": None,
                               "function_call": None, "tool_choice": None, **switch})

    @functools.cached_property
    def turns_thinking_off(self) -> bool:
        """Whether ``enable_thinking`` false changes the prompt (Qwen3's templates write an
        empty thinking into it)."""
        if "enable_thinking" not in self.source:
            return False
        probe = [{"role": "user", "content": "hi"}]
        try:
            return self._render(probe, None, thinking=False) != self._render(probe, None)
        except ValueError:  # the template's own error, or a bound
            return False

    @functools.cached_property
    def writes_tools(self) -> bool:
        """Whether the template shows the model the tools it is given (renders them)."""
        probe = f"probe_{secrets.token_hex(4)}"
        tool = {"type": "function", "function": {
            "name": probe, "description": "", "parameters": {"type": "object"}}}
        try:
            rendered = self._render([{"role": "user", "content": "hi"}], [tool])
        except ValueError:  # the template's own error, or a bound
            return False
        return probe in rendered

    @property
    def tool_calls_hermes(self) -> bool:
        """Whether the template asks for Hermes's tool calls (``<tool_call>`` JSON), the
        one format whose calls are read back from a reply (:mod:`.tools`)."""
        return self.writes_tools and HERMES_CALL in self.source


class _Marker:
    """Client texts replaced by marks ``\\ue000NONCE:i\\ue001`` (the same text, the same
    mark: a template's ``name in required`` still holds), each text kept in ``texts``."""

    def __init__(self, nonce: str, texts: list[str]):
        self._nonce, self._texts, self._index = nonce, texts, {}

    def text(self, value):
        if not isinstance(value, str) or not value:  # a template tests empty text
            return value
        if value not in self._index:
            self._index[value] = len(self._texts)
            self._texts.append(value)
        return f"\ue000{self._nonce}:{self._index[value]}\ue001"

    def free(self, value):
        """Free-form data (a call's arguments): every key and text marked."""
        if isinstance(value, dict):
            return {self.text(k): self.free(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.free(v) for v in value]
        return self.text(value)

    def message(self, message: dict) -> dict:
        out = {k: (v if k in _CHECKED_KEYS else self.text(v)) for k, v in message.items()}
        if message.get("tool_calls"):
            out["tool_calls"] = [self._call(c) for c in message["tool_calls"]]
        return out

    def _call(self, call: dict) -> dict:
        out = {k: (v if k in _CHECKED_KEYS else self.text(v)) for k, v in call.items()}
        if isinstance(call.get("function"), dict):
            function = call["function"]
            out["function"] = {"name": self.text(function.get("name")),
                               "arguments": self.free(function.get("arguments"))}
        return out

    def tool(self, tool: dict) -> dict:
        out = dict(tool)
        if isinstance(tool.get("function"), dict):
            out["function"] = self.schema(tool["function"])
        return out

    def schema(self, value):
        """A function or a JSON schema: property names, descriptions and values marked;
        keywords and checked values (``type``) kept."""
        if isinstance(value, list):
            return [self.schema(v) for v in value]
        if not isinstance(value, dict):
            return self.text(value)
        out = {}
        for key, item in value.items():
            if key in _CHECKED_KEYS:
                out[key] = item
            elif key == "properties" and isinstance(item, dict):
                out[key] = {self.text(name): self.schema(sub) for name, sub in item.items()}
            elif key in ("enum", "const", "default", "examples"):
                out[key] = self.free(item)
            else:
                out[key] = self.schema(item)
        return out


def _llama_cpp_render(name: str, messages: list[dict]) -> str:
    """The conversation in llama.cpp's built-in template ``name``, ending with the
    assistant's turn opened (its roles and contents only: these templates write no tools)."""
    import llama_cpp

    texts = [(str(m.get("role", "")).encode(), (m.get("content") or "").encode())
             for m in messages]
    chat = (llama_cpp.llama_chat_message * len(texts))()
    for row, (role, content) in zip(chat, texts):
        row.role, row.content = role, content
    size = 2 * sum(len(r) + len(c) for r, c in texts) + 256
    for _ in range(2):  # llama.cpp says how much it needs when the buffer is short
        buffer = ctypes.create_string_buffer(size)
        needed = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(texts), True,
                                                     buffer, size)
        if needed < 0:
            raise ValueError(f"llama.cpp's chat template {name} cannot render this "
                             "conversation")
        if needed <= size:
            return buffer.raw[:needed].decode("utf-8", "replace")
        size = needed
    raise ValueError(f"llama.cpp's chat template {name} did not say its length")


def _split_marks(rendered: str, texts: list[str], nonce: str) -> Iterator[tuple[str, bool]]:
    """The rendered template as (markup, False) and (client text, True) parts: each mark
    ``\\ue000NONCE:i\\ue001`` stands for ``texts[i]``. One pass over the text."""
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
    for i, part in enumerate(parts):
        if i % 2:
            yield texts[int(part)], True
        elif part:
            yield part, False

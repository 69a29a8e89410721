"""Chat templates: the model's own (the GGUF's ``tokenizer.chat_template``) or one given in
its place, rendered with Jinja as Hugging Face renders them, and what a template does with
tools.

A template is rendered with a mark in place of each message's text, so that the caller can
tokenize the template's markup (whose ``<|im_start|>`` are control tokens) apart from the
messages' text (where they stay text): a message cannot end its turn or forge another role's.
Values a template writes as JSON (``tools | tojson``, a tool call's arguments) cannot hold a
control token either: its first character is written as a JSON escape (``\\u003c|im_end|>``),
which parses to the same string.

Built in, by name, for models whose own template has no tools: ``chatml-tools``, ChatML
(``<|im_start|>role ... <|im_end|>``, the markup of SmolLM2 and Qwen) with tools in Hermes's
format, as Qwen2.5 writes them: the tools' signatures in the system turn, each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and the tools' results as a user
turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

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


def load_template(value: str) -> str:
    """A template's source from a built-in name (``chatml-tools``) or a Jinja file's path;
    ValueError saying what was wrong."""
    if value in BUILTIN:
        return BUILTIN[value]
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"has to be a built-in template ({', '.join(BUILTIN)}) or a Jinja "
                         f"file, but {value!r} is neither")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{value} cannot be read as a UTF-8 Jinja file ({exc})") from None


class _Formatter(Jinja2ChatFormatter):
    """llama-cpp-python's formatter, with a ``tojson`` that cannot write a control token."""

    def __init__(self, source: str, *, bos: str, eos: str, escape: Callable[[str], str]):
        self._escape = escape
        super().__init__(template=source, eos_token=eos, bos_token=bos)

    def tojson(self, x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return self._escape(Jinja2ChatFormatter.tojson(x, ensure_ascii, indent, separators,
                                                       sort_keys))


class ChatTemplate:
    """One model's chat template.

    Args:
        source: the Jinja template.
        bos, eos: the texts of the model's BOS and EOS tokens (templates write them).
        specials: the regular expression of the model's control tokens' texts, made on
            first use (its vocabulary is scanned only when a template writes JSON).
    """

    def __init__(self, source: str, *, bos: str, eos: str,
                 specials: Callable[[], re.Pattern | None]):
        self.source = source
        self._specials = specials
        self._formatter = _Formatter(source, bos=bos, eos=eos, escape=self._escape_specials)

    def render(self, messages: list[dict], tools: list[dict] | None = None
               ) -> tuple[list[tuple[str, bool]], bool]:
        """The conversation as (markup, False) and (message text, True) parts, and whether
        the template wrote the BOS itself. A message's ``content`` is text, a tool call's
        ``arguments`` an object."""
        nonce = secrets.token_hex(4)
        # Only text stands behind a mark: a template tests empty content ("if content").
        marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if m.get("content") else m
                  for i, m in enumerate(messages)]
        rendered = self._formatter(messages=marked, tools=tools or None)
        return list(_split_marks(rendered.prompt, messages, nonce)), rendered.added_special

    @functools.cached_property
    def writes_tools(self) -> bool:
        """Whether the template shows the model the tools it is given (renders them)."""
        probe = f"probe_{secrets.token_hex(4)}"
        tool = {"type": "function", "function": {
            "name": probe, "description": "", "parameters": {"type": "object"}}}
        try:
            rendered = self._formatter(messages=[{"role": "user", "content": "hi"}],
                                       tools=[tool])
        except Exception:  # the template's own error, whatever its kind
            return False
        return probe in rendered.prompt

    @property
    def tool_calls_hermes(self) -> bool:
        """Whether the template asks for Hermes's tool calls (``<tool_call>`` JSON), the
        one format whose calls are read back from a reply (:mod:`.tools`)."""
        return self.writes_tools and HERMES_CALL in self.source

    def _escape_specials(self, text: str) -> str:
        pattern = self._specials()
        if pattern is None:
            return text
        # Inside JSON a control token's text can only stand in a string, where an escape
        # of its first character reads the same.
        return pattern.sub(lambda m: _json_escape(m.group()[0]) + m.group()[1:], text)


def _json_escape(char: str) -> str:
    """``char`` as JSON's ``\\uXXXX`` escape (two, a surrogate pair, beyond the BMP)."""
    units = char.encode("utf-16-be")
    return "".join(f"\\u{int.from_bytes(units[i:i + 2], 'big'):04x}"
                   for i in range(0, len(units), 2))


def _split_marks(rendered: str, messages: list[dict],
                 nonce: str) -> Iterator[tuple[str, bool]]:
    """The rendered template as (markup, False) and (message text, True) parts: each mark
    ``\ue000NONCE:i\ue001`` stands for message i's content. One pass over the text."""
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
    for i, part in enumerate(parts):
        if i % 2:
            yield messages[int(part)]["content"], True
        elif part:
            yield part, False

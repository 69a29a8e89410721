"""Tool calls in Hermes's format, as Qwen2.5 and the built-in ``chatml-tools`` template ask
for them: after any text, one block per call,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallReader` reads the calls out of a reply as it streams: text passes through at
once, except what may be the start of a call (and the white space before it); a call comes
out whole once its block closes. :func:`parse_reply` reads a whole reply the same way.
:func:`calls_grammar` constrains a reply to one or more calls (``tool_choice`` "required",
or one function named).

A block that is not a JSON object with the ``name`` of a function the request offered and
an object of ``arguments`` is not a call: it stays in the text as the model wrote it, as
does a block the reply left open. Only a call's block, and the white space before it, leave
the text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from ..llama.grammar import UnsupportedSchema, check_schema, framed_json_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_ARGUMENTS = {"type": "object"}


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name, its arguments, an id for the
    result's ``tool_call_id``."""

    name: str
    arguments: dict
    id: str = field(default_factory=_call_id)


def read_call(block: str, names: Collection[str]) -> ToolCall | None:
    """The call a block's text holds, or None if it holds none of the functions ``names``."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)
            and value["name"] in names):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


class ToolCallReader:
    """A reply's text and calls, as it streams: :meth:`feed` each piece, then
    :meth:`finish`; each returns the text (str) and calls (:class:`ToolCall`) now known,
    in order."""

    def __init__(self, names: Iterable[str]):
        self._names = frozenset(names)
        self._pending = ""  # text not passed on yet
        self._in_call = False  # whether _pending is inside an open block
        self._gap = ""  # the white space before the open block (text if it is no call)

    def feed(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return out
                block, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                call = read_call(block, self._names)
                out.append(call if call is not None else self._gap + OPEN + block + CLOSE)
                self._in_call = False
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                before = self._pending[:start]
                _append_text(out, before.rstrip())
                self._gap = before[len(before.rstrip()):]
                self._pending = self._pending[start + len(OPEN):]
                self._in_call = True
                continue
            keep = _held_back(self._pending)
            _append_text(out, self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return out

    def finish(self) -> list[str | ToolCall]:
        """What is left once the reply ended: text, including a block left open."""
        rest = (self._gap + OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return [rest] if rest else []


def _append_text(out: list, text: str) -> None:
    if text:
        out.append(text)


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may belong to a call not yet begun: the
    longest end that starts ``<tool_call>``, and the white space before it."""
    partial = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1)
                    if OPEN.startswith(text[-n:])), 0)
    before = text[:len(text) - partial]
    return partial + len(before) - len(before.rstrip())


def parse_reply(text: str, names: Iterable[str]) -> tuple[str, list[ToolCall]]:
    """A whole reply's text (the calls' blocks, and the white space before each, taken out)
    and its calls."""
    reader = ToolCallReader(names)
    parts = reader.feed(text) + reader.finish()
    return ("".join(p for p in parts if isinstance(p, str)),
            [p for p in parts if isinstance(p, ToolCall)])


def calls_grammar(functions: list[tuple[str, dict | None]], *, parallel: bool = True):
    """The grammar of a reply made of calls to these functions ((name, JSON schema of the
    arguments; None: any object) each): one call, or with ``parallel`` one or more.
    UnsupportedSchema names the function whose schema the grammar cannot enforce."""
    alternatives, definitions = [], {}
    for i, (name, parameters) in enumerate(functions):
        parameters = ANY_ARGUMENTS if parameters is None else parameters
        try:
            check_schema(parameters)
        except UnsupportedSchema as exc:
            raise UnsupportedSchema(f"the parameters of {name!r}: {exc}") from None
        alternatives.append({"type": "object", "properties": {
            "name": {"const": name}, "arguments": _hoisted(parameters, f"f{i}-", definitions)},
            "required": ["name", "arguments"]})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    if definitions:
        schema = {**schema, "$defs": definitions}
    return framed_json_grammar(schema, f"{OPEN}\n", f"\n{CLOSE}",
                               separator="\n" if parallel else None)


_DEFINITIONS = ("$defs", "definitions")


def _hoisted(parameters: dict, prefix: str, definitions: dict) -> dict:
    """``parameters`` with its definitions moved into ``definitions`` (the whole schema's,
    names given ``prefix``) and its ``$ref``s pointed there: inside the schema of the calls,
    a function's parameters are no longer the root that ``#/$defs/...`` means."""
    def moved(node):
        if isinstance(node, list):
            return [moved(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                for keyword in _DEFINITIONS:
                    if value.startswith(f"#/{keyword}/"):
                        value = f"#/$defs/{prefix}{value[len(keyword) + 3:]}"
                out[key] = value
            elif not (node is parameters and key in _DEFINITIONS):
                out[key] = moved(value)
        return out

    for keyword in _DEFINITIONS:
        for name, sub in parameters.get(keyword, {}).items():
            definitions[prefix + name] = moved(sub)
    return moved(parameters)

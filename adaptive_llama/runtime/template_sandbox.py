"""Jinja with bounds, for chat templates, which are untrusted input: a GGUF's
``tokenizer.chat_template`` comes with a downloaded model.

This module is the renderer's side: it runs in a process of its own
(:mod:`.template_process`), which is stopped at the render's deadline and cannot take more
than :data:`MAX_MEMORY`, so that no single call (a ``sort`` of 16 million items, a
``format`` of many wide fields) can outlast the deadline or take the server's memory.
Inside it, Jinja's immutable sandbox stops attribute escapes (``__class__``,
``__globals__``), and these bounds make a hostile template fail early and plainly, with
:class:`TemplateBudgetError`:

- a step budget (:data:`MAX_STEPS`: calls, attribute and item lookups, operators, loop
  turns over ``range``, output pieces, and one step for every 64 characters or items a
  filter or method is given);
- a size bound (:data:`MAX_CHARS`): every filter, method and operator whose result can be
  larger than what it is given (widths, counts, repetitions, joins, formats, indents,
  wraps, escapes, ``lipsum``) has the size of its result bounded before it runs, every
  other one's result is measured when it returns, and the output too;
- integers of at most :data:`MAX_INT_BITS` bits from ``*`` and ``**``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_S = 2.0  # seconds of one render
MAX_STEPS = 2_000_000  # steps of one render (about 1 s of plain Python here)
MAX_CHARS = 16 * 2**20  # characters (or items) of a value a template builds, and of its output
MAX_RANGE = 100_000  # items of one range(), as Jinja's own sandbox allows
MAX_INT_BITS = 65_536  # bits of an integer a template computes (about 20,000 digits)
MAX_MEMORY = 2**30  # bytes of address space of the renderer's process (where it can be set)
CHARS_A_STEP = 64  # characters or items a filter or method is given, counted as one step
_NUMBER = re.compile(r"\d+")
_FIELD = re.compile(r"[{%]")


class TemplateBudgetError(ValueError):
    """A render that would pass one of the bounds (the message says which)."""


@dataclass
class Limits:
    """The bounds of one render (the parent's, read when it asks: tests lower them)."""

    max_s: float = MAX_RENDER_S
    max_steps: int = MAX_STEPS
    max_chars: int = MAX_CHARS


@dataclass
class _Budget:
    limits: Limits
    deadline: float
    steps: int = 0


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("_budget",
                                                                        default=None)


def step(count: int = 1) -> None:
    """Count work against the render's budget; TemplateBudgetError once it is spent."""
    budget = _budget.get()
    if budget is None:
        return
    budget.steps += count
    if budget.steps > budget.limits.max_steps:
        raise TemplateBudgetError(f"the template takes more than {budget.limits.max_steps:,} "
                                  "steps")
    if budget.steps % 1024 < count and time.monotonic() > budget.deadline:
        raise TemplateBudgetError(f"the template takes more than {budget.limits.max_s:g} s")


def _max_chars() -> int:
    budget = _budget.get()
    return budget.limits.max_chars if budget else MAX_CHARS


def check_size(size: int, what: str) -> None:
    limit = _max_chars()
    if size > limit:
        raise TemplateBudgetError(f"the template builds {what} of {size:,} characters or "
                                  f"items, more than the {limit:,} allowed")


def _size(value) -> int:
    """Characters or items of a value (0 for a number or None)."""
    return len(value) if isinstance(value, (str, list, tuple, dict, range)) else 0


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``a ~ b`` joined by :meth:`BoundedEnvironment.join`."""

    def visit_Concat(self, node, frame) -> None:  # noqa: N802 (Jinja's name)
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class GenerationTags(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's mark of the assistant's
    part, for training) renders its body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Hugging Face's chat-template environment (trim_blocks, lstrip_blocks, loop controls,
    ``{% generation %}`` passed over), within the bounds."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**", "%", "//"})

    def __init__(self):
        super().__init__(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                         extensions=[GenerationTags, jinja2.ext.loopcontrols])
        self.globals["range"] = _bounded_range
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}

    def render(self, template: jinja2.Template, limits: Limits | None = None,
               **context) -> str:
        """``template`` rendered within the bounds (TemplateBudgetError past them)."""
        limits = limits or Limits()
        token = _budget.set(_Budget(limits, time.monotonic() + limits.max_s))
        try:
            pieces, size = [], 0
            for piece in template.generate(**context):
                step()
                size += len(piece)
                check_size(size, "an output")
                pieces.append(piece)
            return "".join(pieces)
        finally:
            _budget.reset(token)

    # ---- the sandbox's hooks, each a step and a size check before the work ----

    def bounded_join(self, parts: Iterable) -> str:
        texts = [str(p) for p in parts]
        step()
        check_size(sum(map(len, texts)), "a string")
        return "".join(texts)

    def call_binop(self, context, operator: str, left, right):
        step()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    check_size(len(seq) * max(times, 0), "a repeated value")
            if _is_int(left) and _is_int(right):
                _check_bits(left.bit_length() + right.bit_length())
        elif operator == "+" and all(isinstance(x, (str, list, tuple)) for x in (left, right)):
            check_size(len(left) + len(right), "a joined value")
        elif operator == "**" and isinstance(right, (int, float)):
            if abs(right) > 4096:
                raise TemplateBudgetError(f"the template raises a number to the power {right}")
            if _is_int(left) and right > 0:
                _check_bits(left.bit_length() * int(right))
        elif operator == "%" and isinstance(left, str):
            values = right if isinstance(right, tuple) else (right,)
            check_size(_format_size(left, values), "a formatted string")
        return _measured(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        step(1 + _given(__obj, args, kwargs))
        _check_arguments(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        size = _method_size(owner, name, args, kwargs)
        if size is not None:
            check_size(size, "a value")
        return _measured(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        # The sandbox hands a template its own wrapper of str.format (no __self__ left for
        # call() to look at): the format string's size is bounded, with the values given,
        # when the wrapper is called.
        owner = getattr(value, "__self__", None)
        wrapped = super().wrap_str_format(value)
        if wrapped is None or not isinstance(owner, str):
            return wrapped

        def bounded(*args, **kwargs):
            values = (*args, *kwargs.values(), *(args[0].values() if args and
                                                 isinstance(args[0], dict) else ()))
            check_size(_format_size(owner, values), "a formatted string")
            return wrapped(*args, **kwargs)

        return bounded

    def getattr(self, obj, attribute):
        step()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        step()
        return super().getitem(obj, argument)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateBudgetError(f"the template computes an integer of about {bits:,} bits, "
                                  f"more than the {MAX_INT_BITS:,} allowed")


def _measured(result):
    """A result that a call has built: no longer than the bound."""
    if isinstance(result, (str, list, tuple, dict)):
        check_size(len(result), "a value")
    return result


def _given(obj, args: tuple, kwargs: dict) -> int:
    """Steps for the characters or items a call is given (its object's included)."""
    given = _size(getattr(obj, "__self__", None))
    given += sum(_size(v) for v in (*args, *kwargs.values()))
    return given // CHARS_A_STEP


def _bounded_range(*args) -> _CountedRange:
    numbers = range(*args)
    if len(numbers) > MAX_RANGE:
        raise TemplateBudgetError(f"range() of {len(numbers):,} items, more than the "
                                  f"{MAX_RANGE:,} allowed")
    return _CountedRange(numbers)


class _CountedRange:
    """A range whose every turn of a loop is a step (``loop.length``, ``|length`` and
    indexing work as on a range)."""

    def __init__(self, numbers: range):
        self._numbers = numbers

    def __iter__(self) -> Iterator[int]:
        for number in self._numbers:
            step()
            yield number

    def __len__(self) -> int:
        return len(self._numbers)

    def __getitem__(self, index):
        item = self._numbers[index]
        return _CountedRange(item) if isinstance(item, range) else item

    def __contains__(self, value) -> bool:
        return value in self._numbers


def _bounded_filter(f):
    """A filter that counts as steps (one, and one per 64 characters or items given), whose
    result's size is bounded before it runs (where it can be larger than its input) and
    measured after."""
    name = f.__name__.removeprefix("sync_").removeprefix("do_")
    estimate = _FILTER_SIZES.get(name)
    signature = inspect.signature(f) if estimate else None

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        step(1 + _given(f, args, kwargs))
        _check_arguments(args, kwargs)
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return f(*args, **kwargs)  # the filter's own error, in its words
            bound.apply_defaults()
            check_size(estimate(bound.arguments), "a value")
        return _measured(f(*args, **kwargs))

    return bounded


def _text_size(value) -> int:
    """An upper bound of ``str(value)``'s length for the texts filters take (other values
    are measured when the filter returns)."""
    return len(value) if isinstance(value, str) else 0


def _format_size(form: str, values: Iterable) -> int:
    """An upper bound of a ``%`` or ``str.format`` result's size: the format string, every
    number in it taken as a width, and each field as long as the longest value given. A
    single width past the bound is named (``'%0999999999d'``)."""
    numbers = _NUMBER.findall(form)
    for number in numbers:
        if len(number) > 8 and int(number) > _max_chars():
            raise TemplateBudgetError(f"the template formats with a width of {number}, more "
                                      f"than the {_max_chars():,} characters allowed")
    widths = sum(int(n) for n in numbers)
    longest = max((_text_size(v) for v in values), default=0)
    return len(form) + widths + len(_FIELD.findall(form)) * (longest + 32)


def _lines(text) -> int:
    return text.count("\n") + 1 if isinstance(text, str) else 1


def _width(value) -> int:
    return len(value) if isinstance(value, str) else value if _is_int(value) else 0


def _replace_size(text: str, old, new, count=None) -> int:
    times = len(text) + 1 if count is None or count < 0 else count
    return len(text) + min(times, len(text) + 1) * _text_size(new) if isinstance(
        text, str) else 0


# What each filter can build, from its arguments by name, where it can be larger than
# what it is given (the others are measured when they return).
_FILTER_SIZES = {
    "center": lambda a: max(_text_size(a["value"]), _width(a["width"])),
    "indent": lambda a: _text_size(a["s"]) + _width(a["width"]) * _lines(a["s"]),
    "wordwrap": lambda a: _text_size(a["s"]) * (1 + len(a["wrapstring"] or "\n")),
    "format": lambda a: _format_size(str(a["value"]), (*a["args"], *a["kwargs"].values())),
    "replace": lambda a: _replace_size(a["s"], a["old"], a["new"], a["count"]),
    "join": lambda a: _join_size(a["d"], a["value"]),
    "batch": lambda a: _size(a["value"]) + _width(a["linecount"]),
    "slice": lambda a: _size(a["value"]) + _width(a["slices"]),
    "urlize": lambda a: _text_size(a["value"]) * (
        24 + _text_size(a["target"]) + _text_size(a["rel"])),
    "escape": lambda a: 6 * _text_size(a["s"]),
    "forceescape": lambda a: 6 * _text_size(a["value"]),
    "urlencode": lambda a: 12 * _text_size(a["value"]),
    "upper": lambda a: 3 * _text_size(a["s"]),
    "lower": lambda a: 3 * _text_size(a["s"]),
    "title": lambda a: 3 * _text_size(a["s"]),
    "capitalize": lambda a: 3 * _text_size(a["s"]),
    "truncate": lambda a: _text_size(a["s"]) + _text_size(a["end"]),
    # A container's text: at least a character and a separator for each item.
    "soft_str": lambda a: _text_size(a["s"]) or 3 * _size(a["s"]),
    "pprint": lambda a: _text_size(a["value"]) or 3 * _size(a["value"]),
    "sum": lambda a: sum(_size(x) for x in a["iterable"]) if isinstance(
        a["iterable"], (list, tuple)) else 0,
}
# What each str method can build, from its object and arguments.
_STR_SIZES = {
    "center": lambda s, a, k: max(len(s), _width(a[0] if a else 0)),
    "ljust": lambda s, a, k: max(len(s), _width(a[0] if a else 0)),
    "rjust": lambda s, a, k: max(len(s), _width(a[0] if a else 0)),
    "zfill": lambda s, a, k: max(len(s), _width(a[0] if a else 0)),
    "expandtabs": lambda s, a, k: len(s) * max(1, _width(a[0] if a else k.get("tabsize", 8))),
    "replace": lambda s, a, k: _replace_size(s, *a[:3]) if len(a) >= 2 else len(s),
    "join": lambda s, a, k: _join_size(s, a[0]) if a else 0,
    "upper": lambda s, a, k: 3 * len(s),
    "lower": lambda s, a, k: 3 * len(s),
    "title": lambda s, a, k: 3 * len(s),
    "capitalize": lambda s, a, k: 3 * len(s),
    "swapcase": lambda s, a, k: 3 * len(s),
    "casefold": lambda s, a, k: 3 * len(s),
}
_GLOBAL_SIZES = {  # lipsum(n, html, min, max): n paragraphs of up to max words
    "generate_lorem_ipsum": lambda a, k: 16 * _width(a[0] if a else k.get("n", 5)) * max(
        _width(a[3] if len(a) > 3 else k.get("max", 100)), 1),
}


def _method_size(owner, name: str, args: tuple, kwargs: dict) -> int | None:
    """What a method or global call can build, where that can be larger than its input."""
    if isinstance(owner, str) and name in _STR_SIZES:
        return _STR_SIZES[name](owner, args, kwargs)
    if owner is None and name in _GLOBAL_SIZES:
        return _GLOBAL_SIZES[name](args, kwargs)
    return None


def _check_arguments(args: tuple, kwargs: dict) -> None:
    """No integer argument past the size bound (widths, counts: ``'x'.center(10**9)``)."""
    limit = _max_chars()
    for value in (*args, *kwargs.values()):
        if _is_int(value) and abs(value) > limit:
            raise TemplateBudgetError(f"the template passes {value} as an argument, more "
                                      f"than the {limit:,} allowed")


def _join_size(separator, items) -> int:
    if not isinstance(items, (list, tuple, str)):
        return 0
    return (_text_size(separator) * len(items)
            + sum(len(str(x)) for x in items[:MAX_RANGE]))


# ---- a render request, as the renderer's process takes it ----

_MARK = re.compile("\ue000\\d+:(\\d+)\ue001")
_texts: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("_texts",
                                                                          default=None)


class Renderer:
    """Templates compiled once each, rendered within the bounds with Hugging Face's
    context (``raise_exception``, ``strftime_now``) and a ``tojson`` that writes the
    client's texts behind their marks, unable to write a control token."""

    def __init__(self):
        self._compiled: dict[tuple[str, str | None], jinja2.Template] = {}

    def template(self, source: str, specials: str | None) -> jinja2.Template:
        """``source`` compiled (once), with ``tojson`` escaping ``specials``."""
        key = (source, specials)
        if key not in self._compiled:
            environment = BoundedEnvironment()
            pattern = re.compile(specials) if specials else None
            environment.filters["tojson"] = functools.partial(_tojson, pattern)
            if len(self._compiled) >= 8:  # a server has a few models; a test, many
                self._compiled.clear()
            self._compiled[key] = environment.from_string(source)
        return self._compiled[key]

    def render(self, template: jinja2.Template, texts: list[str], context: dict,
               limits: Limits) -> str:
        """The rendered text; TemplateBudgetError past a bound, the template's own error
        otherwise."""
        token = _texts.set(texts)
        try:
            return template.environment.render(
                template, limits, raise_exception=_raise, strftime_now=_strftime_now,
                **context)
        finally:
            _texts.reset(token)


def _tojson(specials: re.Pattern | None, x, ensure_ascii=False, indent=None,
            separators=None, sort_keys=False):
    """Hugging Face's ``tojson``, of the texts behind the marks, unable to write a control
    token; its size bounded before it is indented."""
    texts = _texts.get()
    value = _unmarked(x, texts) if texts else x
    step(1 + _size(value) // CHARS_A_STEP)
    compact = json.dumps(value, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    check_size(len(compact), "a JSON text")
    if indent is not None or separators is not None:
        # Each of its values on a line of its own, indented once per level it is in.
        levels = compact.count("[") + compact.count("{") + 1
        check_size(len(compact) * (2 + _width(indent) * levels
                                   + sum(map(_text_size, separators or ()))), "a JSON text")
        compact = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                             separators=separators, sort_keys=sort_keys)
        check_size(len(compact), "a JSON text")
    if specials is None:
        return compact
    # Inside JSON a control token's text can only stand in a string, where an escape of its
    # first character reads the same.
    return specials.sub(lambda m: _json_escape(m.group()[0]) + m.group()[1:], compact)


def _unmarked(value, texts: list[str]):
    """``value`` with every mark replaced by its text (for JSON written by the template)."""
    def text(s):
        return _MARK.sub(lambda m: texts[int(m.group(1))], s) if "\ue000" in s else s
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {text(k) if isinstance(k, str) else k: _unmarked(v, texts)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_unmarked(v, texts) for v in value]
    return value


def _raise(message: str):
    raise ValueError(message)


def _strftime_now(form: str) -> str:
    return datetime.now().strftime(form)


def _json_escape(char: str) -> str:
    """``char`` as JSON's ``\\uXXXX`` escape (two, a surrogate pair, beyond the BMP)."""
    units = char.encode("utf-16-be")
    return "".join(f"\\u{int.from_bytes(units[i:i + 2], 'big'):04x}"
                   for i in range(0, len(units), 2))

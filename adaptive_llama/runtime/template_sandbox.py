"""Jinja with bounds, for chat templates, which are untrusted input: a GGUF's
``tokenizer.chat_template`` comes with a downloaded model.

Jinja's immutable sandbox stops attribute escapes (``__class__``, ``__globals__``) but not
work: nested ``range(100000)`` loops rendered for ever and kept a core busy after the client
left, and ``{% set s = 'x' * 200000000 %}`` took 195 MB. Here one render has a time budget
(:data:`MAX_RENDER_S`) and a step budget (:data:`MAX_STEPS`: calls, attribute and item
lookups, operators, loop turns over ``range``, output pieces), and no string or list that a
template builds, nor its output, may pass :data:`MAX_CHARS`. Each is checked before the work
is done, so a hostile template costs at most the budget, then fails with
:class:`TemplateBudgetError`.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

MAX_RENDER_S = 2.0  # seconds of one render
MAX_STEPS = 2_000_000  # steps of one render (about 1 s of plain Python here)
MAX_CHARS = 16 * 2**20  # characters (or items) of a value a template builds, and of its output
MAX_RANGE = 100_000  # items of one range(), as Jinja's own sandbox allows
_NUMBER = re.compile(r"\d+")


class TemplateBudgetError(ValueError):
    """A render that would pass one of the bounds (the message says which)."""


@dataclass
class _Budget:
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
    if budget.steps > MAX_STEPS:
        raise TemplateBudgetError(f"the template takes more than {MAX_STEPS:,} steps")
    if budget.steps % 1024 < count and time.monotonic() > budget.deadline:
        raise TemplateBudgetError(f"the template takes more than {MAX_RENDER_S:g} s")


def check_size(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise TemplateBudgetError(f"the template builds {what} of {size:,} characters or "
                                  f"items, more than the {MAX_CHARS:,} allowed")


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``a ~ b`` joined by :meth:`BoundedEnvironment.join`."""

    def visit_Concat(self, node, frame) -> None:  # noqa: N802 (Jinja's name)
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """llama-cpp-python's chat-template environment (Hugging Face's: trim_blocks,
    lstrip_blocks, loop controls, ``{% generation %}`` passed over), within the bounds."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**", "%", "//"})

    def __init__(self):
        super().__init__(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                         extensions=[Jinja2ChatFormatter.IgnoreGenerationTags,
                                     jinja2.ext.loopcontrols])
        self.globals["range"] = _bounded_range
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}

    def render(self, template: jinja2.Template, **context) -> str:
        """``template`` rendered within the bounds (TemplateBudgetError past them)."""
        token = _budget.set(_Budget(time.monotonic() + MAX_RENDER_S))
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
        elif operator == "+" and all(isinstance(x, (str, list, tuple)) for x in (left, right)):
            check_size(len(left) + len(right), "a joined value")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 4096:
            raise TemplateBudgetError(f"the template raises a number to the power {right}")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        step()
        _check_arguments(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name == "join" and args:
                _check_join(owner, args[0])
            elif name == "replace" and len(args) >= 2:
                check_size((len(owner) + 1) * (len(str(args[1])) + 1), "a string")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        # The sandbox hands a template its own wrapper of str.format (no __self__ left for
        # call() to look at): the widths are checked here, when the method is looked up.
        owner = getattr(value, "__self__", None)
        if isinstance(owner, str) and getattr(value, "__name__", "") in ("format",
                                                                          "format_map"):
            _check_format(owner)
        return super().wrap_str_format(value)

    def getattr(self, obj, attribute):
        step()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        step()
        return super().getitem(obj, argument)


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
    """A filter that counts as a step and takes no size past the bounds."""

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        step()
        _check_arguments(args, kwargs)
        if f.__name__ in ("do_join", "sync_do_join") and len(args) >= 3:
            _check_join(str(args[2]), args[1])
        elif f.__name__ == "do_format" and args:
            _check_format(str(args[0]))
        elif f.__name__ == "do_replace" and len(args) >= 4:
            check_size((len(str(args[1])) + 1) * (len(str(args[3])) + 1), "a string")
        return f(*args, **kwargs)

    return bounded


def _check_arguments(args: tuple, kwargs: dict) -> None:
    """No integer argument past MAX_CHARS (widths, counts: ``'x'.center(10**9)``)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
            raise TemplateBudgetError(f"the template passes {value} as an argument, more "
                                      f"than the {MAX_CHARS:,} allowed")


def _check_format(text: str) -> None:
    """No width or precision past MAX_CHARS in a format string (``'%0999999999d'``)."""
    for number in _NUMBER.findall(text):
        if len(number) > 8 and int(number) > MAX_CHARS:
            raise TemplateBudgetError(f"the template formats with a width of {number}")


def _check_join(separator: str, items) -> None:
    if isinstance(items, (list, tuple, str)):
        check_size(len(separator) * len(items)
                   + sum(len(str(x)) for x in items[:MAX_RANGE]), "a joined string")

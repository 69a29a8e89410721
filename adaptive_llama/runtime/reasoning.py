"""A reasoning model's thinking, apart from its answer.

Reasoning models (DeepSeek-R1 and its distills, Qwen3, QwQ) write their thinking between
``<think>`` and ``</think>`` before the answer. Some write the opening tag themselves; some
chat templates open it at the end of the generation prompt (DeepSeek-R1's newer templates),
so that the reply starts inside the thinking. gpt-oss writes OpenAI's harmony format: the
thinking is a message on the ``analysis`` channel, the answer one on the ``final`` channel
(``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...``),
and a reply may go to the final channel at once. :class:`ThinkingFormat` names the marks of
each (:data:`TAGS`, :data:`HARMONY`).

:class:`ThinkingSplitter` follows a reply as it streams, piece by piece, and says which text
is thinking and which is answer: a mark split over several pieces is held back until it is
known, whitespace around the thinking and before the answer is dropped, and a reply cut
inside the thinking (at the length limit) is all thinking.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
THINKING, ANSWER = "thinking", "answer"
_START = "start"  # nothing but whitespace yet: the reply may still open the thinking


@dataclass(frozen=True)
class ThinkingFormat:
    """How a model marks its thinking: the text that opens and closes it, what it writes
    between the close and the answer, the text that opens an answer written without
    thinking (dropped; empty: none), the control tokens the vocabulary has for these marks,
    and whether the generation prompt already opened the thinking (the reply then starts
    inside it)."""

    open: str = OPEN
    close: str = CLOSE
    answer_gap: str = "\n\n"
    answer_open: str = ""
    tokens: tuple[str, ...] = (OPEN, CLOSE)
    name: str = f"{OPEN}...{CLOSE}"  # as /show says it
    opened_by_prompt: bool = False


TAGS = ThinkingFormat()
HARMONY = ThinkingFormat(
    open="<|channel|>analysis<|message|>",
    close="<|end|><|start|>assistant<|channel|>final<|message|>", answer_gap="",
    answer_open="<|channel|>final<|message|>",
    tokens=("<|start|>", "<|channel|>", "<|message|>", "<|end|>"),
    name="harmony's analysis channel")


def template_format(source: str) -> ThinkingFormat | None:
    """How a chat template marks a reasoning model's thinking: harmony's channels (the
    template writes ``<|start|>`` and ``<|channel|>``, llama.cpp's own test for gpt-oss),
    else the tags when it writes or reads them (or takes Qwen3's ``enable_thinking``); None
    for a model that does not think."""
    if "<|start|>" in source and "<|channel|>" in source:
        return HARMONY
    if any(mark in source for mark in (OPEN, CLOSE, "enable_thinking")):
        return TAGS
    return None


class ThinkingSplitter:
    """Splits a streamed reply into thinking and answer (see the module docstring).

    :meth:`feed` takes the next piece of text and returns (phase, text) pairs, in order,
    for the text now known; :meth:`finish` returns what was held back at the end.
    """

    def __init__(self, form: ThinkingFormat = TAGS):
        self.form = form
        self.phase = THINKING if form.opened_by_prompt else _START
        self._held = ""          # text that may still be the start of a tag, or spaces
        self._fresh = True       # nothing given out in this phase yet: drop its first spaces

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._held += text
        while self._held:
            if self.phase == _START:
                if not self._start():
                    break
            elif self.phase == THINKING:
                if not self._thinking(out):
                    break
            else:
                self._answer(out)
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, in the phase it was in (a reply that ends before its first
        text is an empty answer)."""
        held, self._held = self._held, ""
        if not held or self.phase == _START and not held.strip():
            return []
        if self.phase == THINKING:  # its first spaces were dropped as they came
            return [(THINKING, held.rstrip())] if held.strip() else []
        return [(ANSWER, held)]

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its thinking now."""
        return self.phase == THINKING

    @property
    def undecided(self) -> bool:
        """Whether the reply has not yet said whether it thinks (its first text may still
        be the start of a mark)."""
        return self.phase == _START

    def _start(self) -> bool:
        """Before any text: the opening mark after optional whitespace starts the thinking,
        the answer's mark (dropped) or anything else the answer. False while it cannot be
        told yet."""
        stripped = self._held.lstrip()
        marks = [(mark, phase) for mark, phase in ((self.form.open, THINKING),
                                                   (self.form.answer_open, ANSWER)) if mark]
        for mark, phase in marks:
            if stripped.startswith(mark):
                self._held = stripped[len(mark):]
                self.phase = phase
                return True
        if any(mark.startswith(stripped) for mark, _ in marks):
            return False  # empty, or a part of a mark
        self.phase, self._fresh = ANSWER, False  # the answer as written
        return True

    def _thinking(self, out: list[tuple[str, str]]) -> bool:
        """Thinking up to the closing tag; False while the end of the text may be a part
        of it."""
        close = self.form.close
        if self._fresh:
            self._held = self._held.lstrip()
        at = self._held.find(close)
        if at >= 0:
            if self._held[:at].strip():
                out.append((THINKING, self._held[:at].rstrip()))
            self._held = self._held[at + len(close):]
            self.phase, self._fresh = ANSWER, True
            return True
        keep = _partial_suffix(self._held, close)
        body = self._held[:len(self._held) - keep]
        text = body.rstrip()  # spaces wait: they may be the last before the tag
        if text:
            out.append((THINKING, text))
            self._held = self._held[len(text):]
            self._fresh = False
        return False

    def _answer(self, out: list[tuple[str, str]]) -> None:
        text, self._held = self._held, ""
        if self._fresh:
            text = text.lstrip()
            if not text:
                return
            self._fresh = False
        out.append((ANSWER, text))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Thought(str):
    """A piece of a reasoning model's thinking, as a stream gives it out; a ``str``, so that
    a consumer that does not tell the phases apart still has all the text."""


def without_thinking(message: dict, form: ThinkingFormat) -> dict:
    """A chat template's message without the thinking an earlier answer may still hold
    (``<think>...</think>`` before its text, or harmony's channels): reasoning models'
    templates drop it, and so does a prompt built here for a template that does not."""
    content = message.get("content")
    if message.get("role") != "assistant" or not isinstance(content, str):
        return message
    # after the first close, as the splitter reads a reply: a second one is the answer's text
    answer = content.split(form.close, 1)[-1].lstrip() if form.close in content else content
    if form.answer_open:
        answer = answer.removeprefix(form.answer_open)
    return message if answer == content else {**message, "content": answer}


# What OpenAI's reasoning_effort and Ollama's think levels set the thinking budget to, in
# tokens (docs/reasoning.md).
EFFORT_BUDGETS = {"minimal": 0, "low": 1024, "medium": 4096, "high": 16384}


@dataclass(frozen=True)
class ThinkingSettings:
    """How a reasoning model's requests think unless they say otherwise: ``budget`` tokens
    of thinking at most (None: no bound; 0: none), then ``budget_message`` and the closing
    tag; ``sampler`` chooses the thinking's tokens (None: the reply's sampler)."""

    budget: int | None = None
    budget_message: str = ""
    sampler: object = None  # a SamplerSpec


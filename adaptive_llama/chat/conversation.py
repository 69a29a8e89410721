"""A conversation with an engine: messages, settings, and replies that fit the context window.

>>> from adaptive_llama import Chat, Engine
>>> chat = Chat(Engine("smollm2"), system="You are terse.", sampler="adaptive:eps=0.0005")
>>> for piece in (reply := chat.send("Name three rivers.")):
...     print(piece, end="", flush=True)
>>> reply.result.summary()["mean_k"]
"""

from __future__ import annotations

from ..runtime.engine import ContextOverflow, Engine, GenerationResult, Stream
from ..runtime.request import check_int
from ..samplers import SEED, SamplerSpec, spec_of


class Chat:
    """A conversation: the whole history, and the window of it that the model sees.

    When the rendered conversation plus room for the reply exceeds the context window, the
    oldest exchanges leave the window (the system prompt stays); they stay in ``messages``
    (and in a /save) and ``dropped`` counts them. A message that cannot fit even alone is
    refused with ContextOverflow and changes nothing. A reply that is interrupted joins the
    history with ``"interrupted": True``; a reasoning model's reply with its thinking in
    ``"reasoning"``, which the model is not shown again. ``reasoning_budget`` bounds a
    reasoning model's thinking (None: the engine's; 0: none, see docs/reasoning.md).

    Args:
        engine: the model.
        system: the system prompt, or None.
        sampler: the sampler spec of every reply (``send`` can override it per reply).
        max_tokens: the longest reply, >= 1.
        seed: every reply uses this seed; None: the engine's seed, and when the engine has
            none either a fresh random seed per reply (reported in the reply's result), so
            that ``regenerate`` gives another answer.
    """

    def __init__(self, engine: Engine, system: str | None = None,
                 sampler: SamplerSpec | str = "adaptive", max_tokens: int = 256,
                 seed: int | None = None):
        check_int("max_tokens", max_tokens, low=1)
        self.engine = engine
        self.system = system
        self.sampler = spec_of(sampler)
        self.max_tokens = max_tokens
        self.seed = None if seed is None else SEED.validate(seed)
        self.messages: list[dict] = []
        self.dropped = 0  # messages at the start of `messages` outside the window
        self.reasoning_budget: int | None = None

    @property
    def window(self) -> list[dict]:
        """The messages the model sees."""
        return self.messages[self.dropped:]

    def _conversation(self, messages: list[dict]) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in messages]

    def _fit(self, messages: list[dict], start: int) -> tuple[list[int], int]:
        """(prompt tokens, new window start) for ``messages``; changes nothing.

        Moves the start past the oldest exchanges until the prompt leaves room for a reply;
        ContextOverflow when the last message (with the system prompt) cannot fit at all.
        The prompt shrinks as the start moves on, so the first start that leaves room is
        found by bisection: a few renderings of the conversation, not one per message.
        """
        n_ctx = self.engine.n_ctx
        room = min(self.max_tokens, n_ctx // 4)
        starts = _exchange_starts(messages, start)
        rendered: dict[int, list[int]] = {}

        def prompt(i: int) -> list[int]:
            if i not in rendered:
                rendered[i] = self.engine.chat_prompt_tokens(
                    self._conversation(messages[starts[i]:]), thinking=self._thinking_switch())
            return rendered[i]

        low, high = 0, len(starts) - 1
        while low < high:
            middle = (low + high) // 2
            if len(prompt(middle)) + room <= n_ctx:
                high = middle
            else:
                low = middle + 1
        tokens = prompt(low)
        if len(tokens) >= n_ctx:
            what = "this message with the system prompt" if self.system else "this message"
            raise ContextOverflow(
                f"{what} alone is {len(tokens)} tokens, more than the context window "
                f"({n_ctx}); shorten it or raise the context size. The conversation is "
                "unchanged.")
        return tokens, starts[low]

    def send(self, text: str, **overrides) -> Stream:
        """Add a user message and stream the reply; the reply joins the history as it ends.

        ContextOverflow (nothing added) when the message cannot fit in the window; the
        errors of ``Engine.request`` for ``overrides`` (nothing added either).
        """
        messages = self.messages + [{"role": "user", "content": text}]
        return self._reply(messages, overrides)

    def regenerate(self, **overrides) -> Stream:
        """Answer the last user message again (a new seed unless the chat fixes one); the
        old reply is replaced."""
        messages = list(self.messages)
        if messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if len(messages) <= self.dropped:
            raise ValueError("there is no message to answer yet")
        return self._reply(messages, overrides)

    def _reply(self, messages: list[dict], overrides: dict) -> Stream:
        """The reply's stream; the history becomes ``messages`` once its request is
        checked, so that a request refused leaves the chat as it was."""
        tokens, start = self._fit(messages, self.dropped)
        options = dict(sampler=self.sampler, max_tokens=self.max_tokens, seed=self.seed,
                       reasoning_budget=self.reasoning_budget)
        request = self.engine.request(tokens, **{**options, **overrides})
        self.messages, self.dropped = messages, start
        stream = self.engine.run(request)
        stream.on_finish(self._add_reply)
        return stream

    def _thinking_switch(self) -> bool | None:
        """The template's ``enable_thinking``: false for a budget of 0 where it can."""
        if self.reasoning_budget == 0 and self.engine.can_turn_thinking_off():
            return False
        return None

    def _add_reply(self, result: GenerationResult) -> None:
        message = {"role": "assistant", "content": result.text}
        if result.reasoning:
            message["reasoning"] = result.reasoning
        if result.finish_reason == "interrupted":
            message["interrupted"] = True
        self.messages.append(message)

    def undo(self) -> bool:
        """Drop the last exchange (user message and its reply); False when there is none."""
        if len(self.messages) <= self.dropped:
            return False
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if len(self.messages) > self.dropped and self.messages[-1]["role"] == "user":
            self.messages.pop()
        return True

    def clear(self) -> None:
        self.messages.clear()
        self.dropped = 0

    def context_used(self) -> int:
        """Tokens the conversation in the window occupies now (0 when empty)."""
        conv = self._conversation(self.window)
        return len(self.engine.chat_prompt_tokens(conv)) if conv else 0


def _exchange_starts(messages: list[dict], start: int) -> list[int]:
    """Where the window may start, from ``start`` on: each time past one exchange (a
    message and the assistant's reply to it), down to the last message alone."""
    starts = [start]
    while len(messages) - start > 1:
        left = len(messages) - start
        start += 2 if left > 2 and messages[start + 1]["role"] == "assistant" else 1
        starts.append(start)
    return starts

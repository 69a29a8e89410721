"""Where a chat's window starts: the oldest exchanges leave it, the fewest that make room
for a reply, and finding them takes a few renderings of the conversation, not one each."""

import random

import pytest

from adaptive_llama.chat.conversation import Chat
from adaptive_llama.runtime.engine import ContextOverflow


class CountingEngine:
    """The unit layer's engine: a message costs 3 tokens of markup plus one per character."""

    def __init__(self, n_ctx):
        self.n_ctx = n_ctx
        self.renders = 0

    def chat_prompt_tokens(self, messages, thinking=None):
        self.renders += 1
        return [0] * sum(3 + len(m["content"]) for m in messages)


def first_fitting_start(chat, messages, start):
    """The window start by the rule itself: step past one exchange at a time (a message and
    the reply to it) until the prompt leaves room for a reply or one message is left."""
    room = min(chat.max_tokens, chat.engine.n_ctx // 4)
    while True:
        conversation = chat._conversation(messages[start:])
        left = len(messages) - start
        if len(chat.engine.chat_prompt_tokens(conversation)) + room <= chat.engine.n_ctx \
                or left <= 1:
            return start
        start += 2 if left > 2 and messages[start + 1]["role"] == "assistant" else 1


def random_conversation(rng, n):
    roles = ["user", "assistant"] * (n // 2) + ["user"] * (n % 2)
    for i in range(1, n):  # now and then two user messages in a row (an unanswered one)
        if rng.random() < 0.1:
            roles[i] = "user"
    return [{"role": r, "content": "x" * rng.randint(0, 40)} for r in roles]


@pytest.mark.parametrize("seed", range(40))
def test_the_window_starts_where_stepping_one_exchange_at_a_time_would(seed):
    rng = random.Random(seed)
    chat = Chat(CountingEngine(n_ctx=rng.choice([200, 400, 800])),
                system=rng.choice([None, "be brief"]), max_tokens=rng.choice([8, 64, 500]))
    messages = random_conversation(rng, rng.randint(1, 120))
    start = rng.randint(0, len(messages) - 1)
    expected = first_fitting_start(chat, messages, start)
    try:
        tokens, found = chat._fit(messages, start)
    except ContextOverflow:
        conversation = chat._conversation(messages[expected:])
        assert len(chat.engine.chat_prompt_tokens(conversation)) >= chat.engine.n_ctx
        return
    assert found == expected
    assert len(tokens) == len(chat.engine.chat_prompt_tokens(chat._conversation(
        messages[found:])))


def test_fitting_thousands_of_messages_renders_the_conversation_a_few_times():
    # 3,000 short messages in a 512-token window: stepping one exchange at a time rendered
    # the conversation about 1,500 times (minutes of CPU on a real template).
    engine = CountingEngine(n_ctx=512)
    chat = Chat(engine, max_tokens=64)
    chat.messages = [{"role": r, "content": "Hi"} for r in ["user", "assistant"] * 1500]
    tokens, start = chat._fit(chat.messages + [{"role": "user", "content": "Hi"}], 0)
    assert start % 2 == 0 and len(tokens) + 64 <= 512
    assert engine.renders <= 2 * 12 + 2  # about log2(1,500) renderings


def test_a_long_conversation_with_the_model_keeps_the_latest_exchanges_that_fit(engine):
    chat = Chat(engine, system="You are terse.", max_tokens=64)
    chat.messages = [{"role": r, "content": f"message {i}: " + "word " * 30}
                     for i, r in enumerate(["user", "assistant"] * 40)]
    question = {"role": "user", "content": "And now?"}
    tokens, start = chat._fit(chat.messages + [question], 0)
    assert chat.messages[start]["role"] == "user" and start > 0
    assert tokens == engine.chat_prompt_tokens(chat._conversation(chat.messages[start:]
                                                                  + [question]))
    assert len(tokens) + 64 <= engine.n_ctx
    # one exchange earlier would not have left room for the reply
    earlier = engine.chat_prompt_tokens(chat._conversation(chat.messages[start - 2:]
                                                           + [question]))
    assert len(earlier) + 64 > engine.n_ctx
    assert "You are terse." in engine.detokenize(tokens[:16])  # the system prompt stays

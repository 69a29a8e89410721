"""A reasoning model's thinking apart from its answer (adaptive_llama.runtime.reasoning)."""

import itertools
import json
import random
import subprocess
import sys

import ollama
import openai
import pytest
import reasoning_model as reasoning_model_file
from click.testing import CliRunner
from llama_cpp import LlamaGrammar
from reasoning_model import ANSWER_TEXT, CHAIN, FLAG, HARMONY_REPLY, THINKING_TEXT
from test_server import ollama_client_for, openai_client_for, serving

from adaptive_llama import Engine
from adaptive_llama.cli import main
from adaptive_llama.runtime.request import InvalidArgument
from adaptive_llama.samplers import spec_of
from adaptive_llama.runtime.reasoning import (ANSWER, HARMONY, THINKING, ThinkingFormat,
                                              ThinkingSplitter, Thought, template_format,
                                              without_thinking)

OPENED = ThinkingFormat(opened_by_prompt=True)


def split(pieces, form=ThinkingFormat()):
    """(thinking, answer) of a reply streamed in ``pieces``; each phase's parts in order."""
    splitter = ThinkingSplitter(form)
    parts = [part for piece in pieces for part in splitter.feed(piece)] + splitter.finish()
    phases = [phase for phase, _ in parts]
    assert phases == sorted(phases, key=[THINKING, ANSWER].index)  # thinking comes first
    assert all(text for _, text in parts)
    return ("".join(t for p, t in parts if p == THINKING),
            "".join(t for p, t in parts if p == ANSWER))


@pytest.mark.parametrize("reply, form, expected", [
    ("<think>Let me think</think>391", ThinkingFormat(), ("Let me think", "391")),
    ("\n<think>\nadd\n</think>\n\n391 is it.", ThinkingFormat(), ("add", "391 is it.")),
    ("391", ThinkingFormat(), ("", "391")),
    ("  391", ThinkingFormat(), ("", "  391")),  # no thinking: the answer as written
    ("<thin", ThinkingFormat(), ("", "<thin")),  # a part of the tag, then the end
    ("<thinking about it", ThinkingFormat(), ("", "<thinking about it")),
    ("add</think>391", OPENED, ("add", "391")),  # the template opened it
    ("add 3 and 4, then ", OPENED, ("add 3 and 4, then", "")),  # cut inside the thinking
    ("\n add  \n 3 </think>", OPENED, ("add  \n 3", "")),  # spaces inside stay
    ("<think>add, then</thi", ThinkingFormat(), ("add, then</thi", "")),
    ("<think>add </thi", ThinkingFormat(), ("add </thi", "")),  # held back, then given
    ("<think></think>\n\n391", ThinkingFormat(), ("", "391")),  # thinking off: empty
    ("</think>391 </think>", OPENED, ("", "391 </think>")),  # a second tag is answer text
    ("<think>a <think> b</think>c", ThinkingFormat(), ("a <think> b", "c")),
    ("", ThinkingFormat(), ("", "")),
    ("   ", ThinkingFormat(), ("", "")),
    # harmony (gpt-oss): the analysis channel, then the final one
    (HARMONY_REPLY, HARMONY, (THINKING_TEXT.strip(), ANSWER_TEXT)),
    ("<|channel|>final<|message|>391", HARMONY, ("", "391")),  # the answer at once
    ("<|channel|>analysis<|message|>add 3", HARMONY, ("add 3", "")),  # cut inside
    ("<|channel|>analysis<|message|>a<|end|>", HARMONY, ("a<|end|>", "")),  # cut after
    ("<|channel|>commentary<|message|>x", HARMONY, ("", "<|channel|>commentary<|message|>x")),
    ("<|channel|>fin", HARMONY, ("", "<|channel|>fin")),
    ("<think>a</think>b", HARMONY, ("", "<think>a</think>b")),  # the other format's marks
    ("<|channel|>analysis<|message|>a", ThinkingFormat(), ("", "<|channel|>analysis<|message|>a")),
])
def test_a_reply_splits_into_its_thinking_and_its_answer(reply, form, expected):
    assert split([reply], form) == expected


@pytest.mark.parametrize("reply, form", [
    ("\n<think>\nadd 3 and 4</think>\n\n7 <b>is</b> it.", ThinkingFormat()),
    ("add 3 and 4 < 8</think>\n\n7", OPENED),
    ("<think>cut in the mid", ThinkingFormat()),
    (HARMONY_REPLY, HARMONY),
    ("<|channel|>final<|message|> 7 <|end|>", HARMONY),
])
def test_every_way_to_cut_the_stream_gives_the_same_split(reply, form):
    whole = split([reply], form)
    for a, b in itertools.combinations(range(len(reply) + 1), 2):
        assert split([reply[:a], reply[a:b], reply[b:]], form) == whole, (a, b)
    rng = random.Random(7)
    pieces = []  # one character at a time, with empty pieces between
    for ch in reply:
        pieces += [ch, ""] if rng.random() < 0.3 else [ch]
    assert split(pieces, form) == whole


def test_text_is_given_out_as_soon_as_it_cannot_be_a_tag():
    splitter = ThinkingSplitter()
    assert splitter.feed(" <th") == []  # may still open the thinking
    assert splitter.feed("ink>\nstep one <") == [(THINKING, "step one")]
    assert splitter.feed("b") == [(THINKING, " <b")]
    assert splitter.thinking
    assert splitter.feed(" </thin") == []
    assert splitter.feed("k>\n") == []  # the answer's first spaces are dropped
    assert not splitter.thinking
    assert splitter.feed("\n7") == [(ANSWER, "7")]
    assert splitter.feed(" <think>") == [(ANSWER, " <think>")]
    assert splitter.finish() == []
    assert splitter.finish() == []  # nothing is given twice
    plain = ThinkingSplitter()
    assert plain.feed(" 391") == [(ANSWER, " 391")]  # not a tag: given at once


@pytest.mark.parametrize("source, form", [
    ("{{ '<|start|>assistant' }}{{ '<|channel|>final<|message|>' }}", HARMONY),
    ("{% if enable_thinking %}{% endif %}", ThinkingFormat()),
    ("{{ '<think>' }}", ThinkingFormat()),
    ("{{ '<|im_start|>assistant' }}", None),
    ("{{ '<|start|>assistant' }}", None),  # channels need both marks
])
def test_a_template_says_how_its_model_marks_its_thinking(source, form):
    assert template_format(source) == form


@pytest.mark.parametrize("content, form, answer", [
    (HARMONY_REPLY, HARMONY, ANSWER_TEXT),
    ("<|channel|>final<|message|>391", HARMONY, "391"),
    ("  391", HARMONY, "  391"),  # an answer as written stays as it is
    ("<think>a</think>\n\n391", ThinkingFormat(), "391"),
    ("<think>a</think>b </think> c", ThinkingFormat(), "b </think> c"),  # as split
    ("  391", ThinkingFormat(), "  391"),
])
def test_the_thinking_sent_back_in_an_answer_is_dropped(content, form, answer):
    sent = {"role": "assistant", "content": content}
    kept = without_thinking(sent, form)
    assert kept["content"] == answer
    assert (kept is sent) == (answer == content)  # unchanged: the message itself
    user = {"role": "user", "content": content}
    assert without_thinking(user, form) is user  # only answers lose it


# ---- a reasoning model (tests/reasoning_model.py: DeepSeek-R1-Distill's tokenizer) ----

@pytest.fixture(scope="module")
def r1(reasoning_model):
    engine = Engine(reasoning_model, n_ctx=512, seed=3)
    yield engine
    engine.close()


def chain_tokens(first: str, last: str) -> int:
    """How many tokens of the fixture's reply run from ``first`` to ``last``, both in."""
    return CHAIN.index(last) - CHAIN.index(first) + 1


def test_a_model_with_think_tokens_and_a_template_that_uses_them_is_a_reasoning_model(
        r1, engine):
    assert r1.thinking == ThinkingFormat()
    assert engine.thinking is None  # SmolLM2: no such tokens


@pytest.mark.parametrize("sampler", ["greedy", "adaptive", "min-p:p=0.1"])
def test_the_reply_of_a_reasoning_model_comes_apart_from_its_thinking(r1, sampler):
    result = r1.generate("What is 17 times 23?", chat=True, sampler=sampler, max_tokens=30)
    assert (result.reasoning, result.text) == (THINKING_TEXT.strip(), ANSWER_TEXT)
    assert result.thinks and result.finish_reason == "stop"
    assert result.reasoning_tokens == chain_tokens("<think>", "</think>")
    assert result.completion_tokens == chain_tokens("<think>", "!")
    figures = result.as_dict()
    assert (figures["reasoning"], figures["reasoning_tokens"]) == (result.reasoning,
                                                                  result.reasoning_tokens)


def test_thinking_false_keeps_the_reply_as_one_text(r1):
    result = r1.generate("Hi", chat=True, sampler="greedy", max_tokens=30, thinking=False)
    assert result.text == f"<think>{THINKING_TEXT}</think>\n\n{ANSWER_TEXT}"
    assert not result.thinks and result.reasoning == "" and "reasoning" not in result.as_dict()


def test_a_stream_gives_the_thinking_as_thoughts_then_the_answer(r1):
    pieces = list(r1.stream(r1.prompt_tokens("Hi", chat=True), sampler="greedy"))
    kinds = [isinstance(piece, Thought) for piece in pieces]
    assert kinds == sorted(kinds, reverse=True) and any(kinds) and not all(kinds)
    assert "".join(p for p in pieces if isinstance(p, Thought)) == THINKING_TEXT.strip()
    assert "".join(p for p in pieces if not isinstance(p, Thought)) == ANSWER_TEXT


def test_a_reply_cut_inside_its_thinking_is_all_thinking(r1):
    result = r1.generate("Hi", chat=True, sampler="greedy", max_tokens=4)  # <think>\nLet me
    assert (result.reasoning, result.text, result.finish_reason) == ("Let me", "", "length")
    assert result.reasoning_tokens == 4


def test_stop_strings_end_the_answer_not_the_thinking(r1):
    result = r1.generate("Hi", chat=True, sampler="greedy", max_tokens=30, stop=["think", "!"])
    assert (result.reasoning, result.text) == (THINKING_TEXT.strip(), "Hello")
    assert result.finish_reason == "stop_string"


def test_a_template_that_opens_the_thinking_gives_the_same_split(tmp_path):
    opened = reasoning_model_file.deepseek_template().replace(
        "{{'<｜Assistant｜>'}}{% endif %}", "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    assert opened != reasoning_model_file.deepseek_template()
    engine = Engine(reasoning_model_file.write(tmp_path / "opened.gguf", opened), n_ctx=512)
    try:
        prompt = engine.prompt_tokens("Hi", chat=True)
        assert engine.request(prompt, sampler="greedy").thinking.opened_by_prompt
        result = engine.generate("Hi", chat=True, sampler="greedy", max_tokens=30)
    finally:
        engine.close()
    assert (result.reasoning, result.text) == (THINKING_TEXT.strip(), ANSWER_TEXT)
    assert result.reasoning_tokens == chain_tokens("Let", "</think>")


def test_drafts_leave_a_reasoning_models_reply_as_it_was(r1, reasoning_model):
    drafted = Engine(reasoning_model, n_ctx=512, seed=3, draft="ngram")
    drafted.decoder.speculation.fixed = 4
    drafts = 0
    try:
        for prompt in ("Hi", "<think>\nLet me think</think>\n\nHello!"):
            ours = drafted.generate(prompt, chat=True, sampler="adaptive", max_tokens=30)
            theirs = r1.generate(prompt, chat=True, sampler="adaptive", max_tokens=30)
            assert (ours.tokens, ours.reasoning, ours.text) == (
                theirs.tokens, theirs.reasoning, theirs.text)
            drafts += ours.draft_accepted
    finally:
        drafted.close()
    assert drafts > 0  # the second prompt holds the reply: its drafts are kept


# ---- every surface: the server's routes (real clients), the CLI ----

@pytest.fixture(scope="module")
def qwen3_style(tmp_path_factory):
    """The tiny model with a Qwen3-style template, whose thinking enable_thinking turns off."""
    return reasoning_model_file.write(tmp_path_factory.mktemp("models") / "tiny-q3.gguf",
                                      reasoning_model_file.QWEN3_STYLE)


@pytest.fixture(scope="module")
def reasoning_server(reasoning_model, qwen3_style, smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning") / "server.log"
    yield from serving(reasoning_model, log, "-m", f"q3={qwen3_style}", "-m",
                       f"smollm2={smollm2_path}", "--sampler", "greedy")


@pytest.fixture
def openai_client(reasoning_server):
    return openai_client_for(reasoning_server)


@pytest.fixture
def ollama_client(reasoning_server):
    return ollama_client_for(reasoning_server)


HI = [{"role": "user", "content": "What is 17 times 23?"}]
R1 = "tiny-r1"  # the served file's stem names it


def test_openai_gives_the_thinking_as_reasoning_content(openai_client):
    reply = openai_client.chat.completions.create(model=R1, messages=HI)
    message = reply.choices[0].message
    assert message.content == ANSWER_TEXT
    assert message.model_extra["reasoning_content"] == THINKING_TEXT.strip()
    details = reply.usage.completion_tokens_details
    assert details.reasoning_tokens == chain_tokens("<think>", "</think>")


def test_openai_streams_the_thinking_as_reasoning_content_deltas(openai_client):
    thinking, answer, order = [], [], []
    for chunk in openai_client.chat.completions.create(model=R1, messages=HI, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        if (delta.model_extra or {}).get("reasoning_content"):
            thinking.append(delta.model_extra["reasoning_content"])
            order.append("thinking")
        if delta.content:
            answer.append(delta.content)
            order.append("answer")
    assert ("".join(thinking), "".join(answer)) == (THINKING_TEXT.strip(), ANSWER_TEXT)
    assert order == sorted(order, reverse=True)  # all the thinking first


def test_token_details_say_which_phase_each_token_was_in(openai_client, reasoning_server):
    # whole, and streamed: the same phases, the thinking's tokens first
    reply = openai_client.chat.completions.create(model=R1, messages=HI,
                                                  extra_body={"token_details": True})
    phases = [d["phase"] for d in reply.model_extra["token_details"]]
    thinking = chain_tokens("<think>", "</think>")
    assert phases == ["thinking"] * thinking + ["answer"] * (len(phases) - thinking)
    assert len(phases) == reply.usage.completion_tokens and len(phases) > thinking
    streamed = []
    for chunk in openai_client.chat.completions.create(
            model=R1, messages=HI, stream=True, extra_body={"token_details": True}):
        streamed += [d["phase"] for d in (chunk.model_extra or {}).get("token_details", [])]
    assert streamed == phases
    # not a reasoning model: no phase
    plain = openai_client.chat.completions.create(
        model="smollm2", messages=HI, max_tokens=3, extra_body={"token_details": True})
    assert {d["phase"] for d in plain.model_extra["token_details"]} == {None}


def test_reasoning_format_none_keeps_the_reply_as_one_text(openai_client):
    reply = openai_client.chat.completions.create(
        model=R1, messages=HI, extra_body={"reasoning_format": "none"})
    message = reply.choices[0].message
    assert message.content == f"<think>{THINKING_TEXT}</think>\n\n{ANSWER_TEXT}"
    assert "reasoning_content" not in (message.model_extra or {})


def test_thinking_sent_back_in_earlier_turns_is_not_shown_to_the_model(openai_client):
    def prompt_tokens(answer: dict) -> int:
        history = [*HI, {"role": "assistant", **answer}, {"role": "user", "content": "And?"}]
        reply = openai_client.chat.completions.create(model=R1, messages=history)
        return reply.usage.prompt_tokens

    plain = prompt_tokens({"content": ANSWER_TEXT})
    assert prompt_tokens({"content": ANSWER_TEXT, "reasoning_content": "x " * 50}) == plain
    tagged = f"<think>{'a long thought ' * 20}</think>\n\n{ANSWER_TEXT}"
    assert prompt_tokens({"content": tagged}) == plain


def test_ollama_gives_the_thinking_in_message_thinking(ollama_client):
    reply = ollama_client.chat(model=R1, messages=HI, think=True)
    assert (reply.message.thinking, reply.message.content) == (THINKING_TEXT.strip(),
                                                               ANSWER_TEXT)
    parts = list(ollama_client.chat(model=R1, messages=HI, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THINKING_TEXT.strip()
    assert "".join(p.message.content or "" for p in parts) == ANSWER_TEXT
    generated = ollama_client.generate(model=R1, prompt="What is 17 times 23?", think=True)
    assert (generated.thinking, generated.response) == (THINKING_TEXT.strip(), ANSWER_TEXT)


def test_think_false_turns_thinking_off_where_the_template_can(ollama_client):
    reply = ollama_client.chat(model="q3", messages=HI, think=False)
    assert (reply.message.thinking, reply.message.content) == (None, ANSWER_TEXT)
    assert ollama_client.chat(model="q3", messages=HI).message.thinking == (
        THINKING_TEXT.strip())
    with pytest.raises(ollama.ResponseError) as refused:
        ollama_client.chat(model=R1, messages=HI, think=False)
    assert refused.value.status_code == 400 and "cannot turn its thinking off" in str(
        refused.value) and R1 in str(refused.value)


def test_think_on_a_model_that_does_not_think_is_a_400(ollama_client):
    with pytest.raises(ollama.ResponseError) as refused:
        ollama_client.chat(model="smollm2", messages=HI, think=True)
    assert refused.value.status_code == 400 and "is not a reasoning model" in str(
        refused.value)
    assert ollama_client.chat(model="smollm2", messages=HI, think=False).message.content


def test_show_says_which_models_think(ollama_client):
    assert "thinking" in ollama_client.show(R1).capabilities
    assert "thinking" not in ollama_client.show("smollm2").capabilities


def test_generate_prints_the_answer_and_json_gives_the_thinking_beside_it(reasoning_model):
    def generate(*options):
        return subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "generate",
                               str(reasoning_model), "--prompt", "Hi", "--chat", "--ctx", "512",
                               "--sampler", "greedy", *options],
                              capture_output=True, text=True, timeout=120, check=True)

    plain = generate()
    assert plain.stdout.strip() == ANSWER_TEXT and THINKING_TEXT.strip() in plain.stderr
    figures = json.loads(generate("--json").stdout.splitlines()[-1])
    assert (figures["text"], figures["reasoning"]) == (ANSWER_TEXT, THINKING_TEXT.strip())
    assert figures["reasoning_tokens"] == chain_tokens("<think>", "</think>")


# ---- the thinking's budget and its own sampler ----

def thinking_of(engine, sampler="adaptive", **kwargs):
    """The fixture's reply to "Hi" with ``kwargs`` for the request."""
    request = engine.request(engine.prompt_tokens("Hi", chat=True), sampler=sampler,
                             max_tokens=40, **kwargs)
    stream = engine.run(request)
    stream.text()
    return stream.result


def test_a_spent_budget_closes_the_thinking_and_the_answer_follows(r1):
    result = thinking_of(r1, reasoning_budget=2)  # "\n" and "Let", then closed
    assert (result.reasoning, result.text) == ("Let", ANSWER_TEXT)
    # <think>, the two, then the forced "\n" and </think>
    assert result.reasoning_tokens == 5 and result.finish_reason == "stop"


def test_a_budget_never_ends_the_thinking_inside_a_character(r1):
    budget = CHAIN.index("Ã") - CHAIN.index("<think>")  # spent on é's first byte
    result = thinking_of(r1, reasoning_budget=budget)
    assert result.reasoning == THINKING_TEXT.strip()  # é whole, not a replacement character
    assert "\ufffd" not in result.reasoning + result.text


def test_the_budget_message_ends_the_thinking(reasoning_model):
    engine = Engine(reasoning_model, n_ctx=512, reasoning_budget=3,
                    reasoning_budget_message="Time to answer.")
    try:
        result = thinking_of(engine)
        assert (result.reasoning, result.text) == ("Let me\nTime to answer.", ANSWER_TEXT)
        assert thinking_of(engine, reasoning_budget=-1).reasoning == THINKING_TEXT.strip()
    finally:
        engine.close()


def test_a_budget_of_0_closes_the_thinking_at_once_where_the_template_cannot_turn_it_off(
        r1, reasoning_model, qwen3_style):
    assert not r1.can_turn_thinking_off()
    result = thinking_of(r1, reasoning_budget=0)
    assert (result.reasoning, result.text, result.reasoning_tokens) == ("", ANSWER_TEXT, 3)
    engine = Engine(qwen3_style, n_ctx=512, reasoning_budget=0)
    try:
        assert engine.can_turn_thinking_off()
        result = thinking_of(engine)  # the template wrote an empty thinking: no tokens of it
        assert (result.reasoning, result.text, result.reasoning_tokens) == ("", ANSWER_TEXT, 0)
    finally:
        engine.close()


@pytest.mark.parametrize("budget", [-2, 1.5, "3", True])
def test_a_bad_budget_is_refused_in_one_line(r1, reasoning_model, budget):
    with pytest.raises(InvalidArgument, match="`reasoning_budget` has to be an integer"):
        r1.request(r1.prompt_tokens("Hi", chat=True), reasoning_budget=budget)
    with pytest.raises(InvalidArgument, match="`reasoning_budget` has to be an integer"):
        Engine(reasoning_model, reasoning_budget=budget)


def test_the_thinking_has_its_own_sampler_and_the_answer_the_replys(r1):
    """The chain that chose a token shows in its figures: the adaptive sampler records each
    token it chooses, greedy none."""
    first_answer = chain_tokens("<think>", "</think>")  # the token after the closing tag
    for thinking, answer, recorded in (("greedy", "adaptive", False),
                                       ("adaptive", "greedy", True)):
        request = r1.request(r1.prompt_tokens("Hi", chat=True), sampler=answer,
                             reasoning_sampler=thinking, max_tokens=40)
        stream = r1.run(request)
        stream.text()
        result = stream.result
        phases = [stats is not None for stats in result.token_stats]
        assert phases == [recorded] * first_answer + [not recorded] * (
            result.completion_tokens - first_answer)
        assert result.summary()["reasoning_sampler"] == str(spec_of(thinking))
        assert (result.reasoning, result.text) == (THINKING_TEXT.strip(), ANSWER_TEXT)


def test_a_grammar_shapes_the_answer_and_leaves_the_thinking_free(r1):
    grammar = LlamaGrammar.from_string('root ::= "Hello" "!"', verbose=False)
    result = r1.generate("Hi", chat=True, sampler="greedy", max_tokens=40, grammar=grammar)
    assert (result.reasoning, result.text) == (THINKING_TEXT.strip(), ANSWER_TEXT)


def test_openai_takes_a_budget_an_effort_and_a_sampler_for_the_thinking(openai_client):
    def reply(**extra):
        return openai_client.chat.completions.create(model=R1, messages=HI, extra_body=extra)

    spent = reply(reasoning_budget=2).choices[0].message
    assert (spent.model_extra["reasoning_content"], spent.content) == ("Let", ANSWER_TEXT)
    assert reply(reasoning_effort="low").choices[0].message.model_extra[
        "reasoning_content"] == THINKING_TEXT.strip()  # 1,024 tokens: more than it needs
    stats = reply(reasoning_sampler="min-p:p=0.1").model_extra["sampler_stats"]
    assert stats["reasoning_sampler"] == str(spec_of("min-p:p=0.1"))


@pytest.mark.parametrize("extra, param", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_budget": -2}, "reasoning_budget"),
    ({"reasoning_budget": 10, "reasoning_effort": "low"}, "reasoning_budget"),
    ({"reasoning_sampler": "nucleus:p=2"}, "reasoning_sampler"),
])
def test_a_bad_thinking_field_is_a_400_naming_it(openai_client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=R1, messages=HI, extra_body=extra)
    assert param in str(refused.value)


def test_ollama_think_levels_set_the_budget(ollama_client):
    reply = ollama_client.chat(model=R1, messages=HI, think="low",
                               options={"reasoning_sampler": "greedy"})
    assert (reply.message.thinking, reply.message.content) == (THINKING_TEXT.strip(),
                                                               ANSWER_TEXT)


def test_the_repl_shows_hides_and_bounds_the_thinking(reasoning_model, tmp_path):
    saved = tmp_path / "chat.json"
    result = CliRunner().invoke(main, [
        "run", str(reasoning_model), "--ctx", "512", "--max-tokens", "40", "--sampler",
        "greedy"], input="\n".join([
            "Hi", "/set think hide", "Hi", "/set think off", "Hi", "/set reasoning-budget 2",
            "/set think show", "Hi", "/set reasoning-budget x", "/show",
            f"/save {saved}"]) + "\n")
    out = result.output
    assert result.exit_code == 0 and "Traceback" not in out
    assert out.count(THINKING_TEXT.strip()) == 1  # the first reply only: then hidden
    assert f"{THINKING_TEXT.strip()}\n{ANSWER_TEXT}" in out  # the answer on its own line
    assert f"Let\n{ANSWER_TEXT}" in out  # a budget of 2
    assert out.count(ANSWER_TEXT) == 4
    assert "takes a number of tokens" in out and "thinking    <think>...</think>" in out
    replies = [m for m in json.loads(saved.read_text())["messages"]
               if m["role"] == "assistant"]
    assert [m["content"] for m in replies] == [ANSWER_TEXT] * 4
    assert [m.get("reasoning") for m in replies] == [THINKING_TEXT.strip(),
                                                     THINKING_TEXT.strip(), None, "Let"]


# ---- a gpt-oss-style model: harmony's channels (tests/reasoning_model.py) ----

@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    return reasoning_model_file.write_harmony(tmp_path_factory.mktemp("models") / "oss.gguf")


@pytest.fixture(scope="module")
def oss(harmony_model):
    engine = Engine(harmony_model, n_ctx=512, seed=3)
    yield engine
    engine.close()


def answer_tokens(engine) -> int:
    return len(engine.tokenize(ANSWER_TEXT, add_bos=False))


@pytest.mark.parametrize("sampler", ["greedy", "adaptive", "top-h"])
def test_a_gpt_oss_style_reply_comes_apart_at_its_channels(oss, sampler):
    assert oss.thinking == HARMONY
    result = thinking_of(oss, sampler=sampler)
    assert (result.reasoning, result.text) == (THINKING_TEXT.strip(), ANSWER_TEXT)
    assert result.finish_reason == "stop"  # at <|return|>; <|end|> does not end it
    # every token before the answer: both channels' marks and the thinking
    assert result.reasoning_tokens == result.completion_tokens - answer_tokens(oss) > 10
    raw = thinking_of(oss, sampler=sampler, thinking=False)
    assert raw.text == HARMONY_REPLY and not raw.thinks


def test_a_gpt_oss_style_reply_on_the_final_channel_at_once_has_no_thinking(oss):
    request = oss.request(oss.chat_prompt_tokens([{"role": "user", "content": FLAG}]),
                          sampler="greedy", max_tokens=40)
    stream = oss.run(request)
    assert stream.text() == ANSWER_TEXT  # <|channel|>final<|message|> dropped
    assert (stream.result.reasoning, stream.result.reasoning_tokens) == ("", 0)


def test_a_spent_budget_closes_harmonys_thinking_with_its_own_marks(oss):
    result = thinking_of(oss, reasoning_budget=2)  # "Let me", then the final channel
    assert (result.reasoning, result.text) == ("Let me", ANSWER_TEXT)
    forced = oss.tokenize("\n", add_bos=False) + oss.tokenize(
        HARMONY.close, add_bos=False, special=True)
    assert result.reasoning_tokens == 3 + 2 + len(forced)  # the analysis mark, the two


def test_each_token_of_a_harmony_reply_says_its_phase(oss):
    result = thinking_of(oss, sampler="greedy", logprobs=0)
    phases = [p.phase for p in result.logprobs]
    thinking = result.reasoning_tokens
    assert phases == ["thinking"] * thinking + ["answer"] * answer_tokens(oss)


def test_the_thinking_has_its_own_sampler_on_harmonys_channels_too(oss):
    result = thinking_of(oss, sampler="adaptive", reasoning_sampler="greedy")
    assert (result.reasoning, result.text) == (THINKING_TEXT.strip(), ANSWER_TEXT)
    chosen = [s is not None for s in result.token_stats]  # adaptive's own tokens have stats
    assert chosen == [False] * result.reasoning_tokens + [True] * answer_tokens(oss)


def test_a_gpt_oss_style_model_is_served_with_its_thinking_apart(
        harmony_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("harmony") / "server.log"
    for port in serving(harmony_model, log, "--sampler", "greedy"):
        message = openai_client_for(port).chat.completions.create(
            model="oss", messages=HI).choices[0].message
        assert message.content == ANSWER_TEXT
        assert message.model_extra["reasoning_content"] == THINKING_TEXT.strip()
        ollama = ollama_client_for(port)
        assert "thinking" in ollama.show("oss").capabilities
        history = [*HI, {"role": "assistant", "content": HARMONY_REPLY}, *HI]
        reply = ollama.chat(model="oss", messages=history, think=True)
        assert (reply.message.thinking, reply.message.content) == (THINKING_TEXT.strip(),
                                                                   ANSWER_TEXT)

"""Hostile but fair input, generated: random specs, parameter values, /set lines and saved
chats at the CLI and the REPL (the server's share is in test_server.py). Whatever comes in:
no crash, no traceback, a one-line error, the conversation unchanged."""

import io
import json
import string

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive_llama.chat.repl import Repl
from adaptive_llama.cli import main
from adaptive_llama.samplers import SAMPLERS, SamplerSpec, SpecError, parse_spec

NASTY_NUMBERS = ["0", "-0", "-1", "1", "nan", "NaN", "inf", "-inf", "1e-300", "5e-324",
                 "1e-20", "1e400", "-1e400", str(2**31), str(2**32), str(2**70), "0x10",
                 "1_000", "", " ", "1e3", "0.5", "2.5", "abc", "1,5", "=", "\x00"]
values = st.one_of(st.sampled_from(NASTY_NUMBERS),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.integers(-2**80, 2**80).map(str),
                   st.text(string.printable, max_size=8))
keys = st.one_of(st.sampled_from(sorted({p.name for s in SAMPLERS.values()
                                          for p in s.all_params()})),
                 st.text(string.ascii_letters, max_size=6))
names = st.one_of(st.sampled_from(list(SAMPLERS)), st.text(string.printable, max_size=10))


@st.composite
def spec_texts(draw):
    """A sampler's text, at times with modifiers (or other samplers) joined by +."""
    return "+".join(draw(st.lists(entry_texts(), min_size=1, max_size=3)))


@st.composite
def entry_texts(draw):
    name = draw(names)
    items = draw(st.lists(st.tuples(keys, values), max_size=4))
    sep = draw(st.sampled_from([":", ":", " : ", ""]))
    return name + sep + ",".join(f"{k}={v}" for k, v in items)


def assert_one_line(message: str):
    assert message and "\n" not in message and "Traceback" not in message


@settings(max_examples=400, deadline=None)
@given(text=spec_texts())
def test_any_spec_text_parses_or_says_why_in_one_line(text):
    try:
        spec = parse_spec(text)
    except SpecError as exc:
        assert_one_line(str(exc))
        return
    assert isinstance(spec, SamplerSpec) and parse_spec(str(spec)) == spec


# The numba pass of `make test` runs this again: whatever the spec, the samplers of either
# backend run it or it is refused. (The REPL's commands below are the same code under both;
# a sampler they set runs as here.)
@pytest.mark.backend
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=spec_texts())
def test_generate_with_any_spec_runs_or_fails_in_one_line(smollm2_path, text):
    result = CliRunner().invoke(main, ["generate", str(smollm2_path), "--prompt", "Hi",
                                       "--max-tokens", "2", "--sampler", text, "--seed", "1"])
    assert result.exit_code in (0, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    if result.exit_code == 2:
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: --sampler:"), result.output


saved_values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=10), spec_texts(), st.lists(st.integers(), max_size=2))
saved_messages = st.one_of(saved_values, st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 3]),
                           "content": st.one_of(st.text(max_size=20), st.integers())}),
    saved_values), max_size=3))
saved_chats = st.one_of(
    st.fixed_dictionaries({}, optional={"messages": saved_messages, "seed": saved_values,
                                        "sampler": saved_values, "system": saved_values,
                                        "max_tokens": saved_values}),
    saved_values)

repl_lines = st.one_of(
    st.tuples(st.sampled_from(["eps", "temp", "seed", "max-tokens"]), values)
    .map(lambda kv: f"/set {kv[0]} {kv[1]}"),
    spec_texts().map(lambda s: f"/set sampler {s}"),
    spec_texts().map(lambda s: f"/compare {s}"),
    st.text(string.printable, max_size=12).map(lambda s: "/" + s.replace("\n", " ")),
    st.sampled_from(["/undo", "/regen", "/stats", "/show", "/trace on", "/trace off",
                     "/help", "/help samplers", "/save", "/load", "/set", "/set eps"]),
)


class Recorder(io.StringIO):
    def last_lines(self, since: int) -> str:
        return self.getvalue()[since:]


@pytest.fixture(scope="module")
def small_engine(smollm2_path):
    """A context of 256 tokens: a fuzzed /set max-tokens then costs a short reply at most
    (cut by the context, a path the REPL has to survive too), not a thousand tokens."""
    from adaptive_llama import Engine

    engine = Engine(smollm2_path, seed=1, n_ctx=256)
    yield engine
    engine.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lines=st.lists(repl_lines, min_size=1, max_size=6), saved=saved_chats)
def test_repl_survives_any_command_and_keeps_the_conversation(small_engine, tmp_path, lines,
                                                              saved):
    path = tmp_path / "saved.json"
    try:
        path.write_text(json.dumps(saved, allow_nan=True))
    except ValueError:  # numbers JSON cannot hold
        path.write_text("{}")
    out = Recorder()
    repl = Repl(small_engine, max_tokens=1, seed=1, out=out, read_line=lambda _: None)
    repl.reply(lambda: repl.chat.send("Hi"))
    for line in lines + [f"/load {path}"]:
        before = [dict(m) for m in repl.chat.messages]
        mark = len(out.getvalue())
        result = repl.command(line)  # any exception fails the test
        said = out.last_lines(mark)
        assert "Traceback" not in said and result in (None, "quit")
        if line.startswith(("/set", "/compare")) or (
                line.startswith("/load") and "loaded" not in said):
            assert repl.chat.messages == before, line
    repl.chat.max_tokens = 1  # whatever was set: the reply only has to come
    repl.reply(lambda: repl.chat.send("Still there?"))
    assert repl.chat.messages[-1]["role"] == "assistant"


# JSON schemas, valid or not, for structured output (tests/test_structured.py, the server).
scalars = st.one_of(st.none(), st.booleans(), st.integers(-99, 99), st.text(max_size=4))
# Counts small, at the bounds (1,000) and far past them: 30,000 killed the server once.
counts = st.one_of(st.integers(0, 4), st.sampled_from([-5, 999, 1000, 1001, 30_000, 10**9]))
hostile_patterns = st.one_of(
    st.integers(1, 60_000).map(lambda n: f"^a{{1,{n}}}$"),
    st.integers(1, 3000).map(lambda n: "^(" + "|".join(f"v{i}" for i in range(n)) + ")$"),
    st.tuples(st.integers(2, 4), st.integers(2, 40)).map(
        lambda lc: "^" + "(" * lc[0] + "a" + "".join(f"{{0,{lc[1]}}})" for _ in range(lc[0]))
        + "$"),
    st.sampled_from(["^(a)\\1$", "^(ab$", "^[\\d.]+\\.\\w\\s\\S$", "^[^\\]]*$", "^a\\\\$"]))
schemas = st.recursive(
    st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                                 "array", "strng"]),
        "enum": st.one_of(st.lists(scalars, min_size=0, max_size=3),
                          st.integers(1, 2000).map(lambda n: [f"v{i}" for i in range(n)])),
        "const": scalars,
        "pattern": st.one_of(st.text(alphabet="ab.*+?()[]{}|^$\\0123\"", max_size=6),
                             hostile_patterns),
        "format": st.sampled_from(["date", "uuid", "email"]),
        "maxLength": counts, "minLength": counts, "minimum": st.integers()}),
    lambda inner: st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["object", "array"]),
        "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
        "required": st.lists(st.text(max_size=4), max_size=2),
        "additionalProperties": st.one_of(st.booleans(), inner),
        "items": inner, "prefixItems": st.lists(inner, max_size=2),
        "minItems": counts, "maxItems": counts,
        "anyOf": st.lists(inner, min_size=1, max_size=3),
        "allOf": st.lists(inner, min_size=1, max_size=2)}),
    max_leaves=8)

"""The `llm` plugin, through llm's own CLI with a private LLM_USER_PATH (end to end)."""

import json

import pytest
from click.testing import CliRunner
from llm.cli import cli as llm_cli


@pytest.fixture(autouse=True)
def llm_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    return tmp_path


def llm(*args, input=None):
    result = CliRunner().invoke(llm_cli, list(args), input=input, catch_exceptions=False)
    return result


def logged(home):
    """The logged responses, oldest first, as `llm logs --json` gives them."""
    result = llm("logs", "--json", "-n", "0")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    for row in rows:
        row["response_json"] = json.dumps(row["response_json"])
    return sorted(rows, key=lambda row: row["datetime_utc"])


def test_the_bundled_models_are_listed():
    result = llm("models", "list")
    assert result.exit_code == 0
    assert "adaptive-llama: adaptive/smollm2" in result.output


def test_a_prompt_streams_and_is_logged_with_its_figures(llm_home):
    args = ["-m", "adaptive/smollm2", "Name a river.", "-o", "seed", "3",
            "-o", "max_tokens", "12", "-o", "sampler", "adaptive:eps=0.001"]
    streamed = llm(*args)
    whole = llm(*args, "--no-stream")
    assert streamed.exit_code == 0 and whole.exit_code == 0
    assert streamed.output.strip() and streamed.output == whole.output
    rows = logged(llm_home)
    assert len(rows) == 2 and rows[0]["response"] == streamed.output.rstrip("\n")
    figures = json.loads(rows[0]["response_json"])
    assert figures["seed"] == 3 and figures["sampler"].startswith("adaptive:eps=0.001")
    assert figures["completion_tokens"] <= 12 and figures["backend"] in ("c", "numba")


def test_epsilon_and_temperature_options_shape_the_spec(llm_home):
    result = llm("-m", "adaptive/smollm2", "Hi", "-o", "epsilon", "0.002", "-o",
                 "temperature", "0.7", "-o", "max_tokens", "4", "-o", "seed", "1")
    assert result.exit_code == 0, result.output
    figures = json.loads(logged(llm_home)[0]["response_json"])
    assert figures["sampler"].startswith("adaptive:eps=0.002") and "temp=0.7" in figures["sampler"]


def test_temperature_0_is_greedy_and_usage_is_logged(llm_home, engine):
    result = llm("-m", "adaptive/smollm2", "Hi", "-o", "temperature", "0", "-o",
                 "max_tokens", "5", "-o", "seed", "4")
    assert result.exit_code == 0, result.output
    row = logged(llm_home)[0]
    figures = json.loads(row["response_json"])
    assert figures["sampler"] == "greedy"
    assert (row["input_tokens"], row["output_tokens"]) == (figures["prompt_tokens"],
                                                           figures["completion_tokens"])
    assert row["output_tokens"] >= 1


def test_a_continued_conversation_sends_its_history(llm_home, engine):
    first = llm("-m", "adaptive/smollm2", "My name is Zed.", "-o", "max_tokens", "8")
    second = llm("-c", "What is my name?", "-o", "max_tokens", "8")
    assert first.exit_code == 0 and second.exit_code == 0
    one, two = logged(llm_home)
    assert one["conversation_id"] == two["conversation_id"]
    a, b = json.loads(one["response_json"]), json.loads(two["response_json"])
    # The follow-up sends the first exchange, the reply as it was shown, then the question:
    # exactly those three messages in the chat template, no system prompt, nothing twice.
    sent = [{"role": "user", "content": "My name is Zed."},
            {"role": "assistant", "content": one["response"]},
            {"role": "user", "content": "What is my name?"}]
    assert b["prompt_tokens"] == len(engine.chat_prompt_tokens(sent))
    assert a["prompt_tokens"] == len(engine.chat_prompt_tokens(sent[:1]))


def test_llm_chat_keeps_the_conversation(llm_home):
    result = llm("chat", "-m", "adaptive/smollm2", "-o", "max_tokens", "6",
                 input="Hello\nAnd again\nquit\n")
    assert result.exit_code == 0, result.output
    rows = logged(llm_home)
    assert [r["prompt"] for r in rows] == ["Hello", "And again"]
    assert rows[0]["conversation_id"] == rows[1]["conversation_id"]
    assert json.loads(rows[1]["response_json"])["prompt_tokens"] > \
        json.loads(rows[0]["response_json"])["prompt_tokens"]


@pytest.mark.parametrize("option,value,needle", [
    ("sampler", "nucleus", "unknown sampler"),
    ("sampler", "top-k:k=1e400", "k"),
    ("epsilon", "2", "epsilon"),
    ("seed", "-1", "seed"),
    ("max_tokens", "0", "max_tokens"),
])
def test_bad_options_are_one_line_errors(option, value, needle):
    result = llm("-m", "adaptive/smollm2", "Hi", "-o", option, value)
    assert result.exit_code != 0
    assert "Traceback" not in result.output and needle in result.output, result.output


def test_epsilon_for_a_sampler_without_one_is_refused():
    result = llm("-m", "adaptive/smollm2", "Hi", "-o", "sampler", "greedy", "-o", "epsilon",
                 "0.001")
    assert result.exit_code != 0 and "`epsilon` applies to adaptive and eta" in result.output


def test_a_registered_gguf_becomes_a_model(smollm2_path, tmp_path):
    added = llm("adaptive", "add", str(smollm2_path), "--name", "mini")
    assert added.exit_code == 0, added.output
    assert "adaptive-llama: adaptive/mini" in llm("models", "list").output
    reply = llm("-m", "adaptive/mini", "Hi", "-o", "max_tokens", "4", "-o", "seed", "2")
    assert reply.exit_code == 0 and reply.output.strip()
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    refused = llm("adaptive", "add", str(not_gguf))
    assert refused.exit_code != 0 and "GGUF" in refused.output
    missing = llm("adaptive", "add", str(tmp_path / "missing.gguf"))
    assert missing.exit_code != 0 and "Traceback" not in missing.output


def test_a_reasoning_models_reply_is_its_answer_without_the_thinking(reasoning_model):
    from reasoning_model import ANSWER_TEXT, THINKING_TEXT

    assert llm("adaptive", "add", str(reasoning_model), "--name", "r1").exit_code == 0
    for stream in ([], ["--no-stream"]):
        reply = llm("-m", "adaptive/r1", "What is 17 times 23?", "-o", "sampler", "greedy",
                    *stream)
        assert reply.exit_code == 0, reply.output
        assert reply.output.strip() == ANSWER_TEXT
        assert THINKING_TEXT.strip() not in reply.output

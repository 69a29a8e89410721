"""The chat REPL driven through its input (piped mode), on the bundled model."""

import json

from click.testing import CliRunner

from adaptive_llama.cli import main


def chat(*lines, args=()):
    result = CliRunner().invoke(main, ["run", "--max-tokens", "16", *args],
                                input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result.output


def test_piped_chat_is_plain_and_scriptable():
    out = chat("Hi", "/bye", "never read")
    assert "\033[" not in out and ">>>" not in out
    assert out.strip()


def test_help_and_unknown_command_suggestion():
    out = chat("/help", "/shwo", "/bye")
    assert "/compare" in out and "/trace" in out
    assert "unknown command /shwo. Did you mean /show?" in out


def test_set_good_and_bad_values_keep_the_old_one():
    out = chat("/set eps 0.001", "/set eps 2", "/set temp abc", "/set max-tokens 0",
               "/set seed 7", "/set sampler nucleus", "/show")
    assert "sampler adaptive:eps=0.001" in out
    assert "`eps` has to be in (0, 1), but is 2; kept adaptive:eps=0.001" in out
    assert "kept adaptive:eps=0.001" in out.split("/set temp")[0] or "temp" in out
    assert "max-tokens has to be an integer >= 1" in out
    assert "unknown sampler 'nucleus'" in out
    show = out.split("model       ")[1]
    assert "sampler     adaptive:eps=0.001" in show and "seed        7" in show


def test_stats_trace_undo_regen_clear():
    out = chat("/stats", "Hello there", "/stats", "/trace on", "Tell me a joke", "/undo",
               "/show", "/regen", "/show", "/clear", "/show", "/undo")
    assert "no reply yet" in out
    assert "tokens/s" in out and "k: mean" in out and "mean confidence" in out
    assert "trace on" in out and "[" in out.split("trace on")[1]  # piece[k] when piped
    shows = out.split("context     ")[1:]
    assert "(2 messages)" in shows[0]      # undo dropped the joke exchange
    assert "(2 messages)" in shows[1]      # regen replaced the last reply
    assert "(0 messages)" in shows[2]
    assert "nothing to undo" in out


def test_multiline_block_is_one_message():
    out = chat('"""', "first line", "second line", '"""', "/show")
    assert "(2 messages)" in out


def test_compare_reruns_the_last_prompt():
    out = chat("/compare greedy", "Name a colour.", "/compare greedy", "/compare bad")
    assert "say something first" in out
    assert "--- greedy ---" in out and "--- adaptive" in out
    assert "unknown sampler 'bad'" in out


def test_save_and_load_roundtrip(tmp_path):
    path = tmp_path / "chat.json"
    out = chat("/set eps 0.002", "/set system Be brief.", "Hello", f"/save {path}")
    assert "saved 2 messages" in out
    data = json.loads(path.read_text())
    assert data["sampler"].startswith("adaptive:eps=0.002") and data["system"] == "Be brief."
    out = chat(f"/load {path}", "/show")
    assert "loaded 2 messages" in out and "adaptive:eps=0.002" in out
    assert "Be brief." in out and "(2 messages)" in out


def test_bad_save_and_load_paths_lose_nothing(tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    out = chat("Hi", f"/load {tmp_path / 'missing.json'}", f"/load {corrupt}",
               "/save /proc/no/such/dir/x.json", "/show")
    assert "could not read" in out and "the chat is unchanged" in out
    assert "is not a saved chat" in out
    assert "could not save to" in out and "nothing was lost" in out
    assert "(2 messages)" in out


def test_long_conversation_drops_oldest_turns():
    lines = [f"Tell me fact number {i} about the ocean in detail." for i in range(14)]
    result = CliRunner().invoke(main, ["run", "--ctx", "256", "--max-tokens", "40",
                                       "--system", "You are helpful."],
                                input="\n".join(lines + ["/show"]) + "\n")
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert result.output.count("oldest messages are being dropped") == 1
    assert "of 256 tokens" in result.output

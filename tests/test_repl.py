"""The chat REPL driven through its input (piped mode), on the bundled model."""

import io
import json
import re

import pytest
from click.testing import CliRunner

from adaptive_llama.chat.repl import Repl
from adaptive_llama.cli import main
from adaptive_llama.kernel import BACKEND
from adaptive_llama.samplers import hot_epsilon_note, parse_spec


def chat(*lines, args=()):
    result = CliRunner().invoke(main, ["run", "--max-tokens", "16", *args],
                                input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result.output


def show_block(out: str, index: int = -1) -> dict:
    """One /show block as {field: value}."""
    block = out.split("model       ")[index]
    rows = [line.split(None, 1) for line in ("model " + block).splitlines()[:10]]
    return {row[0]: row[1] if len(row) > 1 else "" for row in rows}


def test_piped_chat_is_plain_and_scriptable():
    out = chat("Hi", "/show", "/bye", "/show", "never read")
    assert "\033[" not in out and ">>>" not in out
    assert out.count("model       ") == 1  # nothing after /bye runs
    assert "(2 messages)" in out


def test_help_lists_commands_and_samplers():
    out = chat("/help", "/help samplers", "/shwo", "/bye")
    assert "/compare" in out and "/trace" in out
    assert "adaptive     adaptive decoding (Zhu et al., 2024)" in out
    assert "eps=0.005 " in out and "in (0, 1)" in out
    assert "unknown command /shwo. Did you mean /show?" in out


def test_set_good_and_bad_values_keep_the_old_one():
    out = chat("/set eps 0.001", "/set eps 2", "/set temp abc", "/set temp 0.7",
               "/set max-tokens 0", "/set max-tokens 1e400", "/set seed 7", "/set seed -3",
               "/set seed 99999999999999999999", "/set sampler nucleus", "/show")
    assert "`eps` has to be in (0, 1), but is 2; kept the old value" in out
    assert "`temp` has to be a finite number, but is 'abc'; kept the old value" in out
    assert "`max-tokens` has to be an integer in [1, 2147483647], but is 0" in out
    assert "`max-tokens` has to be an integer, but is 1e400" in out
    assert "`seed` has to be an integer in [0, 4294967295], but is -3" in out
    assert "unknown sampler 'nucleus'" in out
    show = show_block(out)
    assert show["sampler"] == "adaptive:eps=0.001,mode=multinomial,temp=0.7"
    assert show["seed"] == "7" and show["max-tokens"] == "16"


def test_set_eps_on_a_sampler_without_eps_says_so():
    out = chat("/set sampler top-k:k=5", "/set eps 0.01", "/show")
    assert "top-k has no `eps`" in out
    assert show_block(out)["sampler"] == "top-k:k=5"


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


def test_regen_draws_a_new_seed_unless_one_is_fixed():
    out = chat("Tell me a story.", "/stats", "/regen", "/stats", "/regen", "/stats")
    seeds = [line.rsplit("seed ", 1)[1] for line in out.splitlines() if "tokens/s" in line]
    assert len(seeds) == 3 and len(set(seeds)) == 3
    out = chat("/set seed 5", "Tell me a story.", "/stats", "/regen", "/stats")
    seeds = [line.rsplit("seed ", 1)[1] for line in out.splitlines() if "tokens/s" in line]
    assert seeds == ["5", "5"]


def test_multiline_block_is_one_message():
    out = chat('"""', "first line", "second line", '"""', "/show")
    assert "(2 messages)" in out


INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")  # markdown's `code`, not a fence
CTRL_C = object()  # in a script: the line before came with a Ctrl-C in the same read


def scripted_repl(engine, *script):
    """A Repl reading ``script``; a line followed by CTRL_C had its Enter and a Ctrl-C arrive
    together, which the terminal reader reports in ``interrupt_pending``."""
    repl = Repl(engine, max_tokens=8, seed=1, out=io.StringIO())
    pending = list(script)

    def read_line(_prompt):
        if not pending:
            return None
        line = pending.pop(0)
        if pending and pending[0] is CTRL_C:
            pending.pop(0)
            repl.interrupt_pending = True
        return line

    repl.read_line = read_line
    repl.loop()
    return repl, repl.out.getvalue()


def test_ctrl_c_with_a_line_inside_a_block_drops_the_block_and_nothing_else(engine):
    repl, out = scripted_repl(engine, '"""', "Write a long story", CTRL_C, "about a whale",
                              '"""', "Name a colour.")
    # the rest of the dropped block is read as lines of its own: the whale line a message
    assert [m["content"] for m in repl.chat.messages[::2]] == ["about a whale",
                                                               "Name a colour."]
    assert "[interrupted]" not in out and repl.last.finish_reason != "interrupted"


def test_ctrl_c_with_a_blocks_closing_line_stops_its_reply_only(engine):
    repl, out = scripted_repl(engine, '"""', "Write a long story", '"""', CTRL_C,
                              "Name a colour.")
    assert out.count("[interrupted]") == 1
    assert [m["content"] for m in repl.chat.messages[::2]] == ["Write a long story",
                                                               "Name a colour."]
    assert repl.chat.messages[1]["content"] == ""  # stopped before its first token
    assert repl.last.finish_reason != "interrupted" and repl.last.completion_tokens > 1


@pytest.mark.parametrize("command", ["/set seed 3", "/show", "/compare greedy"])
def test_ctrl_c_with_a_command_is_spent_on_it(engine, command):
    repl, out = scripted_repl(engine, "Name a colour.", command, CTRL_C, "And another?")
    # /compare's reply is the one stopped; the next message's reply is whole
    assert out.count("[interrupted]") == (command == "/compare greedy")
    assert len(repl.chat.messages) == 4 and repl.last.finish_reason != "interrupted"


def test_compare_answers_the_last_message_again():
    out = chat("/compare greedy", "Name a colour.", "/compare greedy", "/compare bad",
               "/undo", "/compare greedy", "/show")
    assert out.count("say something first") == 2  # before any reply, and after /undo
    assert "--- greedy ---" in out and "--- adaptive" in out
    assert "unknown sampler 'bad'" in out
    assert "(0 messages)" in out  # /compare never added to the conversation


@pytest.mark.backend  # the backend it reports
def test_save_and_load_roundtrip(tmp_path):
    path = tmp_path / "chat.json"
    out = chat("/set eps 0.002", "/set system Be brief.", "/set seed 3", "Hello",
               f"/save {path}")
    assert "saved 2 messages" in out
    data = json.loads(path.read_text())
    assert data["sampler"].startswith("adaptive:eps=0.002") and data["system"] == "Be brief."
    assert data["seed"] == 3 and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    out = chat(f"/load {path}", "/show")
    assert "loaded 2 messages" in out
    show = show_block(out)
    assert show["sampler"].startswith("adaptive:eps=0.002") and show["seed"] == "3"
    assert show["system"] == "Be brief." and "(2 messages)" in show["context"]
    assert show["backend"].split()[0] == BACKEND
    assert show["layers"] == "CPU 0-29 and output"  # SmolLM2's 30 layers, here


@pytest.mark.parametrize("content,why", [
    ("{not json", "is not a saved chat"),
    ('{"messages": [], "seed": 1e400}', "`seed` has to be an integer, but is inf"),
    ('{"messages": [], "seed": -1}', "`seed` has to be an integer in [0, 4294967295]"),
    ('{"messages": [], "system": 42}', "`system` has to be text, but is 42"),
    ('{"messages": [], "max_tokens": -5}', "`max-tokens` has to be an integer in [1, "),
    ('{"messages": [], "max_tokens": true}', "have to be numbers"),
    ('{"messages": [], "sampler": "top-k:k=1e400"}', "`k` has to be an integer"),
    ('{"messages": [], "sampler": 3}', "has to be text"),
    ('{"messages": [{"role": "system", "content": "x"}]}', "`messages` has to be a list"),
    ('{"messages": [{"role": "user", "content": 5}]}', "`messages` has to be a list"),
    ('[1, 2]', "it is not a JSON object"),
    ('{"seed": 1}', "`messages` has to be a list"),
])
def test_a_bad_saved_chat_changes_nothing(tmp_path, content, why):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    out = chat("/set seed 9", "Hi", f"/load {bad}", "/show", "Again", "/show")
    assert f"{bad} is not a saved chat" in out and why in out
    assert "the chat is unchanged" in out
    first, second = show_block(out, -2), show_block(out, -1)
    assert first["seed"] == "9" and "(2 messages)" in first["context"]
    assert "(4 messages)" in second["context"]  # the chat goes on afterwards


def test_bad_save_and_load_paths_lose_nothing(tmp_path):
    out = chat("Hi", f"/load {tmp_path / 'missing.json'}", f"/load {tmp_path}",
               "/save /proc/no/such/dir/x.json", "/show")
    assert out.count("could not read") == 2 and "the chat is unchanged" in out
    assert "could not save to" in out and "nothing was lost" in out
    assert "(2 messages)" in out


def test_interrupted_flag_survives_save_and_load(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hel", "interrupted": True}]}))
    saved = tmp_path / "again.json"
    out = chat(f"/load {path}", f"/save {saved}")
    assert "loaded 2 messages" in out
    assert json.loads(saved.read_text())["messages"][1]["interrupted"] is True


def test_long_conversation_drops_oldest_turns_but_keeps_them_for_save(tmp_path):
    lines = [f"Tell me fact number {i} about the ocean in detail." for i in range(9)]
    path = tmp_path / "all.json"
    result = CliRunner().invoke(main, ["run", "--ctx", "256", "--max-tokens", "40",
                                       "--system", "You are helpful."],
                                input="\n".join(lines + ["/show", f"/save {path}"]) + "\n")
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert result.output.count("oldest messages are being dropped") == 1
    assert "of 256 tokens" in result.output
    outside = int(re.search(r"(\d+) outside the window", result.output)[1])
    assert outside >= 4  # several turns dropped, one notice
    assert len(json.loads(path.read_text())["messages"]) == 18


def test_a_message_too_long_for_the_window_is_refused_and_history_stays():
    huge = "word " * 3000
    out = chat("Hi", "Second", "/show", huge, "/show", "/set system " + huge, "Third",
               "/show", args=("--ctx", "512", "--max-tokens", "8"))
    assert "this message alone is" in out and "more than the context window (512)" in out
    assert "this message with the system prompt alone is" in out
    assert out.count("The conversation is unchanged.") == 2
    shows = out.split("context     ")[1:]
    assert all("(4 messages)" in s for s in shows)


def test_trace_top_shows_each_tokens_likeliest_alternatives():
    out = chat("/trace top", "Name a colour.", "/trace off", "Again.")
    traced = out.split("trace top")[1].split("trace off")[0]
    marks = re.findall(r"\[(\d+)\]\{([^{}]*)\}", traced)
    assert len(marks) >= 3
    for k, alternatives in marks:
        shares = [int(p) for p in re.findall(r" (\d+)%", alternatives)]
        assert len(shares) == 3 and shares == sorted(shares, reverse=True) and sum(shares) <= 101
    assert "{" not in out.split("trace off")[1]


def test_ollamas_and_llama_cpps_set_habits_map_onto_the_spec_as_the_server_does():
    out = chat("/set parameter temperature 0.5", "/show",
               "/set temperature 0", "/show",          # greedy everywhere
               "/set temperature 0.8", "/show",        # back to the sampler it replaced
               "/set top_k 20", "/show",               # Ollama's top_k chooses top-k
               "/set sampler min-p:p=0.1", "/show",    # keeps the earlier /set temp
               "/set sampler min-p:p=0.1,temp=1.2", "/show",  # unless it names one
               "/set repeat_penalty 1.1", "/set parameter num_predict 9", "/show",
               "/set system You are terse.", "/set system", "/show",
               "/set top_p x", "/set verbose maybe")
    samplers = [show_block(out, i)["sampler"] for i in range(1, 8)]
    assert samplers == [
        "adaptive:eps=0.005,mode=multinomial,temp=0.5", "greedy",
        "adaptive:eps=0.005,mode=multinomial,temp=0.8", "top-k:k=20,temp=0.8",
        "min-p:p=0.1,temp=0.8", "min-p:p=0.1,temp=1.2",
        "min-p:p=0.1,temp=1.2+penalties:repeat=1.1,freq=0,present=0,last_n=64"]
    assert show_block(out, 7)["max-tokens"] == "9"
    assert "system cleared" in out and show_block(out)["system"] == "(none)"
    assert "`top_p` has to be a number, but is 'x'; kept the old value" in out
    assert "`verbose` has to be on or off, but is 'maybe'" in out


def test_a_reply_cut_by_max_tokens_is_marked_and_verbose_adds_its_figures():
    out = chat("Tell me a long story.", "/set verbose on", "And another.",
               args=["--max-tokens", "3", "--seed", "4"])
    first, second = out.split("verbose on")
    assert "[cut at max-tokens 3: /set max-tokens N for longer replies]" in first
    assert "tok/s" not in first  # piped: no footer until /set verbose on
    assert re.search(r"\n3 tokens · [\d.]+ tok/s · mean k [\d.]+ · seed 4\n", second)


def test_an_empty_reply_is_marked_and_its_stats_say_so():
    from adaptive_llama.runtime.batching import GenerationResult

    repl = Repl.__new__(Repl)  # the footer of a reply that ended at its first token
    repl.out, repl.interactive, repl.verbose = io.StringIO(), False, True
    empty = GenerationResult(text="", finish_reason="stop", prompt_tokens=9,
                             completion_tokens=0, sampler="greedy", seed=5)
    repl.footer(empty)
    assert repl.out.getvalue().startswith("[empty reply: the model ended it at once")
    from adaptive_llama.chat.repl import format_stats

    assert format_stats(empty.summary()) == ("an empty reply: the model ended it at once "
                                             "(finish: stop, seed 5)")


def test_compare_without_a_spec_and_trace_say_what_they_do():
    out = chat("Hi", "/compare", "/trace on", "/trace top", "Hello")
    assert "usage: /compare SPEC, e.g. /compare top-p:p=0.9" in out
    assert "trace on: each token shows its candidate-set size k by [k] after it" in out
    assert "then {k=K: the likeliest tokens and their probabilities}" in out
    assert re.search(r"\[\d+\]\{'", out)  # /trace top: [k], then the alternatives


def test_run_and_generate_take_temp_and_n():
    out = chat("/show", args=["--temp", "0"])
    assert show_block(out)["sampler"] == "greedy"
    out = chat("/show", args=["--sampler", "min-p:p=0.1", "--temp", "0.6", "-n", "7"])
    assert show_block(out)["sampler"] == "min-p:p=0.1,temp=0.6"
    assert show_block(out)["max-tokens"] == "7"
    result = CliRunner().invoke(main, ["run", "--temp", "-1"], input="")
    assert result.exit_code == 2 and "--temp: `temperature` has to be in" in result.output
    # generate's model is optional, as run's and serve's: the bundled one
    result = CliRunner().invoke(main, ["generate", "--prompt", "1, 2, 3,", "--temp", "0",
                                       "-n", "6"])
    assert result.exit_code == 0 and result.output.startswith(" 4, 5"), result.output


def test_markdown_rendering_and_wrapping_of_a_real_reply():
    ask = ("Write a Python function that adds two numbers, in a code block.", "/bye")
    args = ("--sampler", "greedy", "--max-tokens", "120", "--no-save")
    written = chat(*ask, args=args)  # piped: the reply as the model wrote it
    assert "```python\ndef add_numbers(num1, num2):\n    return num1 + num2" in written
    # The model's answer has a code block and, in the prose after it, inline code.
    code = INLINE_CODE.findall(written.split("```\n", 1)[1])[0]
    result = CliRunner(env={"COLUMNS": "30"}).invoke(
        main, ["run", *args, "--markdown", "--wordwrap"], input="\n".join(ask) + "\n")
    assert result.exit_code == 0, result.output
    shown = result.output
    text = re.sub(r"\033\[[0-9;]*m", "", shown)
    # The code block is verbatim (its indentation kept), in the code colour, fences dim;
    assert "\n    return num1 + num2\n" in text
    assert "\033[36m    return num1 + num2" in shown and "\033[2m```python" in shown
    # inline code loses its backticks and takes the code colour;
    assert f"`{code}`" not in text and re.search(r"\033\[36m" + re.escape(code), shown)
    # the prose after it wraps at words to 30 columns, every word kept.
    prose = written.split("```\n", 1)[1].split()
    after = text.split("```\n", 1)[1]
    assert all(len(line) <= 30 for line in after.splitlines())
    assert after.split() == [word.replace("`", "") for word in prose]
    assert len(after.splitlines()) > len(written.split("```\n", 1)[1].splitlines())


def test_display_switches_are_off_when_piped_and_set_on_by_set():
    out = chat("/show", "/set markdown on", "/set wordwrap maybe", "/show", "/bye")
    first, second = out.split("markdown on\n", 1)
    assert "display     verbose off, markdown off, wordwrap off" in first
    assert "`wordwrap` has to be on or off, but is 'maybe'" in second
    assert "display     verbose off, markdown on, wordwrap off" in second


def test_run_hot_with_a_small_epsilon_the_repl_says_so_once_each_time():
    out = chat("/set temperature 1.5", "/set eps 0.001", "/set eps 0.005", "/set temp 0.9",
               "/set eps 0.0001", "/bye")
    notes = [line for line in out.splitlines() if line.startswith("note: above temperature")]
    assert len(notes) == 1 and "eps 0.001 fell behind min-p" in notes[0]
    started = chat("/bye", args=["--sampler", "adaptive:eps=0.0005", "--temp", "2"])
    assert "note: above temperature 1, adaptive with eps 0.0005" in started


@pytest.mark.parametrize("spec,noted", [
    ("adaptive:eps=0.004,temp=1.01", True), ("adaptive:eps=0.005,temp=2", False),
    ("adaptive:eps=0.0001,temp=1", False), ("min-p:p=0.05,temp=2", False),
    ("adaptive:eps=0.001,temp=1.5+penalties", True),
])
def test_the_hot_epsilon_note_brackets_both_thresholds(spec, noted):
    assert (hot_epsilon_note(parse_spec(spec)) is not None) == noted

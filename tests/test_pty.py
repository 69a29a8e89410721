"""The REPL in a real pseudo-terminal: Ctrl-C in the middle of a reply, and right after Enter."""

import io
import os
import re
import signal
import sys

import pexpect
import pytest
from test_repl import INLINE_CODE

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


def ignore_sigint():
    # What a background job of a non-interactive shell (`cmd &` in a script) inherits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def spawn(tmp_path, started_with=None, args=("--max-tokens", "400", "--sampler",
                                            "adaptive:eps=0.0001"), columns=200):
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path), TERM="xterm")
    env.pop("COLUMNS", None)
    child = pexpect.spawn(sys.executable, ["-m", "adaptive_llama.cli", "run", *args],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, columns),
                          preexec_fn=started_with)
    child.logfile_read = io.StringIO()  # shown when an expectation fails
    return child


def expect_interrupted_and_history_kept(child):
    try:
        child.expect(r"\[interrupted\]", timeout=15)
    except pexpect.TIMEOUT:
        raise AssertionError("Ctrl-C did not stop the reply within 15 s (is Python's SIGINT "
                             "handler installed?)") from None
    child.expect(">>>")
    child.send("/show\r")
    child.expect(r"\((\d+) messages\)")
    assert child.match.group(1) == "2"  # the question and the partial reply
    child.expect(">>>")
    child.send("/bye\r")
    child.expect(pexpect.EOF)


def drive(child, script) -> None:
    """Run ``script(child)``; on a failure show what the terminal showed; close the child."""
    try:
        script(child)
    except (pexpect.TIMEOUT, AssertionError) as exc:
        raise AssertionError(f"{exc}\nthe REPL's terminal output:\n"
                             f"{child.logfile_read.getvalue()}") from None
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.parametrize("started_with", [None, ignore_sigint], ids=["default", "sigint-ignored"])
def test_ctrl_c_stops_the_reply_and_keeps_the_history(tmp_path, started_with):
    def script(child):
        child.expect(">>>")
        child.send("Write a very long story about a lighthouse keeper.\r")
        child.expect(r"keeper\.")       # the message went in,
        child.expect(r"\x1b\[\?2004l")   # prompt_toolkit let go of the terminal,
        child.expect(r"[A-Za-z]{3,}\W+[A-Za-z]{3,}")  # and the reply is streaming
        child.sendintr()
        expect_interrupted_and_history_kept(child)

    drive(spawn(tmp_path, started_with), script)
    assert (tmp_path / "adaptive-llama" / "history").exists()  # input history persists


def test_ctrl_c_right_after_enter_stops_the_reply(tmp_path):
    # The Ctrl-C can reach prompt_toolkit in the same read as the Enter, while the terminal
    # is still raw: it used to wait as type-ahead for the next prompt (missed 2 times in 5).
    def script(child):
        child.expect(">>>")
        child.send("Write a very long story about a lighthouse keeper.\r\x03")
        expect_interrupted_and_history_kept(child)

    drive(spawn(tmp_path), script)


def test_ctrl_c_right_after_enter_inside_a_block_drops_the_block(tmp_path):
    # It used to be held: the block went on, and the Ctrl-C stopped the next reply.
    def script(child):
        child.expect(">>>")
        child.send('"""\r')
        child.expect(r"\.\.\.")
        child.send("Write a very long story\r\x03")
        child.expect(">>>")  # a fresh prompt: the block is gone
        child.send("/show\r")
        child.expect(r"\((\d+) messages\)")
        assert child.match.group(1) == "0"
        child.expect(">>>")
        child.send("/bye\r")
        child.expect(pexpect.EOF)
        assert "[interrupted]" not in child.logfile_read.getvalue()

    drive(spawn(tmp_path), script)


def test_a_terminal_reply_ends_with_its_footer_and_set_parameter_works(tmp_path):
    def script(child):
        child.expect(">>>")
        child.send("/set parameter temperature 0\r")
        child.expect("temp set; sampler greedy")
        child.send("/set max-tokens 4\r")
        child.expect(">>>")
        child.send("Hi\r")
        # On a terminal verbose is on: a dim footer follows the reply (and the cut mark).
        child.expect(r"\[cut at max-tokens 4")
        child.expect(r"4 tokens · [\d.]+ tok/s · seed \d+")
        child.expect(">>>")
        child.send("/trace on\r")
        child.expect(r"\033\[34mblue: k=1, sure\033\[0m")  # the legend, in its colours
        child.expect(">>>")
        child.send("/bye\r")
        child.expect(pexpect.EOF)

    drive(spawn(tmp_path), script)


def test_a_terminal_renders_markdown_wraps_at_words_and_set_markdown_off_shows_it_raw(tmp_path):
    def script(child):
        child.expect(">>>")
        child.send("Write a Python function that adds two numbers, in a code block.\r")
        child.expect(r"\x1b\[\?2004l")  # the reply starts
        # the code block in the code colour, verbatim; the fence line dim
        child.expect(re.escape("\033[2m```python"))
        child.expect(re.escape("\033[36m    return num1 + num2"))
        child.expect(r"tok/s")  # the footer
        reply = ANSI.sub("", child.before.split("```", 1)[1])  # the prose after the code
        assert "`" not in reply  # inline code shows without its backticks
        lines = [line for line in reply.replace("\r", "").split("\n") if line.strip()]
        assert len(lines) > 2 and all(len(line) <= 40 for line in lines), lines
        child.expect(">>>")
        child.send("/set markdown off\r")
        child.expect("markdown off")
        child.expect(">>>")
        child.send("/regen\r")  # greedy: the same reply, as the model wrote it
        child.expect(r"\x1b\[\?2004l")
        child.expect(r"tok/s")
        raw = ANSI.sub("", child.before)
        assert "```python" in raw and INLINE_CODE.search(raw.split("```", 2)[2])
        child.expect(">>>")
        child.send("/bye\r")
        child.expect(pexpect.EOF)

    drive(spawn(tmp_path, args=("--sampler", "greedy", "-n", "120"), columns=40), script)

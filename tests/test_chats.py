"""Saved chats: kept as they go, listed, resumed; a crash or Ctrl-C mid-reply loses nothing shown."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect

from adaptive_llama.chats import ChatStore


def store() -> ChatStore:
    return ChatStore(Path(os.environ["XDG_STATE_HOME"]) / "adaptive-llama" / "chats")


def run(*args, input):
    return subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "run", *args],
                          input=input, capture_output=True, text=True, timeout=300)


def test_a_chat_is_saved_as_it_goes_and_listed():
    out = run("--max-tokens", "6", input="Hello there\n/chats\n").stdout
    name, = store().names()
    data = store().load(name)
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][0]["content"] == "Hello there"
    assert f"* {name}" in out and "2 messages  Hello there" in out


def test_resume_continues_the_newest_chat_or_the_named_one():
    run("--max-tokens", "6", input="First chat\n")
    time.sleep(1.1)  # names and mtimes order the chats
    run("--max-tokens", "6", "--seed", "3", input="Second chat\n")
    second, first = store().names()
    out = run("--resume", "--max-tokens", "6", input="/show\nAnd more\n").stdout
    assert f"continuing {second}: 2 messages" in out and "(2 messages)" in out
    assert [m["content"] for m in store().load(second)["messages"]][::2] == [
        "Second chat", "And more"]
    assert store().load(second)["seed"] == 3  # the chat's own settings come back
    out = run("--resume", first, "--max-tokens", "6", input="/show\n").stdout
    assert f"continuing {first}: 2 messages" in out
    assert len(store().names()) == 2  # resuming writes to the same chat


def test_bad_resumes_are_one_line_errors():
    result = run("--resume", input="")
    assert result.returncode == 2 and "no saved chat to resume yet" in result.stderr
    run("--max-tokens", "4", input="Hi\n")
    for name, needle in [("nope", "no saved chat 'nope'"), ("../x", "not a chat name")]:
        result = run("--resume", name, input="")
        assert result.returncode == 2 and needle in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    broken = store().path("broken")
    broken.write_text("{not json")
    result = run("--resume", "broken", input="")
    assert result.returncode == 2 and "cannot read the saved chat 'broken'" in result.stderr
    broken.write_text(json.dumps({"messages": [{"role": "robot", "content": 1}]}))
    result = run("--resume", "broken", input="")
    assert result.returncode == 2 and "cannot be continued" in result.stderr


def test_no_save_keeps_nothing():
    run("--no-save", "--max-tokens", "4", input="Hi\n")
    assert store().names() == []


def spawn():
    env = dict(os.environ, TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "adaptive_llama.cli", "run", "--max-tokens",
                                           "400", "--sampler", "adaptive:eps=0.0001"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.logfile_read = io.StringIO()
    return child


def shown_reply(child) -> str:
    """The reply's text as the terminal showed it (after the echoed message)."""
    screen = child.logfile_read.getvalue()
    return screen.split("\x1b[?2004l", 1)[1].replace("\r\n", "\n")


def ask_for_a_long_reply(child, words: int) -> None:
    """Send the question and wait until ``words`` words of the reply are on the screen."""
    child.expect(">>>")
    child.send("Write a very long story about a lighthouse keeper.\r")
    child.expect(r"\x1b\[\?2004l")
    child.expect(" ".join([r"\w+"] * words))


def test_a_crash_mid_reply_loses_nothing_that_was_shown():
    child = spawn()
    try:
        ask_for_a_long_reply(child, 6)
        os.kill(child.pid, signal.SIGKILL)
        child.expect(pexpect.EOF)
        shown = shown_reply(child)
    finally:
        child.close(force=True)
    name, = store().names()
    user, reply = store().load(name)["messages"]
    assert user["content"] == "Write a very long story about a lighthouse keeper."
    assert reply["interrupted"] and len(shown.strip()) > 10
    assert reply["content"].startswith(shown.rstrip())  # everything shown, maybe a piece more


def test_ctrl_c_mid_reply_saves_the_partial_reply():
    child = spawn()
    try:
        ask_for_a_long_reply(child, 4)
        child.sendintr()
        child.expect(r"\[interrupted\]")
        child.expect(">>>")
        name, = store().names()
        user, reply = store().load(name)["messages"]
        assert reply["interrupted"] and reply["content"].strip()
        assert not store().path(name).with_suffix(".partial").exists()
        child.send("/bye\r")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)

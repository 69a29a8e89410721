"""Saved chats: kept as they go, listed, resumed; a crash or Ctrl-C mid-reply loses nothing shown."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect

from adaptive_llama.chat.saved import ChatStore


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
    reply = store().load(second)["messages"][1]["content"]
    recap = out.split(f"continuing {second}: 2 messages\n")[1]
    assert recap.startswith(f">>> Second chat\n{reply}\n")  # the last exchange, recalled
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
    for name, needle in [("nope", "no saved chat 'nope'"), ("a b", "not a chat name"),
                         ("../x", "no chat file '../x'"), ("x.json", "no chat file 'x.json'")]:
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


def test_resume_takes_a_chat_file_and_keeps_it_as_a_new_saved_chat(tmp_path):
    """A /save file, or the chat page's Export, continues in the REPL."""
    chat = tmp_path / "from-the-page.json"
    text = json.dumps({"version": 1, "sampler": "greedy", "seed": 5, "max_tokens": 6,
                       "system": "Be brief.", "messages": [
                           {"role": "user", "content": "Name a river."},
                           {"role": "assistant", "content": "The Nile."}]})
    chat.write_text(text)
    out = run("--resume", str(chat), input="/show\nAnd another?\n").stdout
    name, = store().names()
    assert f"continuing {name}: 2 messages" in out and "greedy" in out
    data = store().load(name)
    assert [m["content"] for m in data["messages"]][:3] == [
        "Name a river.", "The Nile.", "And another?"]
    assert data["system"] == "Be brief." and data["seed"] == 5 and data["max_tokens"] == 6
    assert chat.read_text() == text  # the file itself is left as it was
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"messages": "none"}))
    result = run("--resume", str(broken), input="")
    assert result.returncode == 2 and "cannot be continued" in result.stderr
    assert str(broken) in result.stderr and len(result.stderr.strip().splitlines()) == 1


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
    """The reply's words as the terminal showed them (after the echoed message), without
    its colours and with one space wherever it broke a line (the REPL wraps at words)."""
    screen = child.logfile_read.getvalue().split("\x1b[?2004l", 1)[1]
    return " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen).split())


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
    # everything shown, maybe a piece more
    assert " ".join(reply["content"].split()).startswith(shown)


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


def test_two_repls_never_write_one_chat():
    run("--max-tokens", "4", input="Mine\n")
    name, = store().names()
    before = store().path(name).read_text()
    holder = store()
    assert holder.claim(name)  # another REPL has it open
    out = run("--resume", name, "--max-tokens", "4", input="Theirs\n").stdout
    assert f"{name} is open in another REPL; continuing its 2 messages in a copy" in out
    assert store().path(name).read_text() == before
    copy, = set(store().names()) - {name}
    assert [m["content"] for m in store().load(copy)["messages"]][::2] == ["Mine", "Theirs"]


def test_two_repls_started_together_get_two_chats():
    procs = [subprocess.Popen([sys.executable, "-m", "adaptive_llama.cli", "run",
                               "--max-tokens", "4"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, text=True) for _ in range(2)]
    for i, proc in enumerate(procs):
        proc.communicate(f"Hello {i}\n", timeout=300)
    firsts = sorted(store().load(n)["messages"][0]["content"] for n in store().names())
    assert firsts == ["Hello 0", "Hello 1"]


def test_load_and_clear_start_a_new_chat_and_keep_the_old_one(tmp_path):
    other = tmp_path / "other.json"
    run("--max-tokens", "4", input=f"Keep me\n/save {other}\n")
    name, = store().names()
    out = run("--resume", name, "--max-tokens", "4",
              input=f"/load {other}\n/clear\nAfter clear\n").stdout
    assert "it stays saved as" in out
    assert [m["content"] for m in store().load(name)["messages"]][::2] == ["Keep me"]
    contents = sorted(m["content"] for n in store().names()
                      for m in store().load(n)["messages"] if m["role"] == "user")
    assert contents == ["After clear", "Keep me", "Keep me"]  # the /load became its own chat


def test_a_block_holding_a_command_is_text():
    run("--max-tokens", "4", input='"""\n/clear\n"""\n')
    name, = store().names()
    assert store().load(name)["messages"][0] == {"role": "user", "content": "/clear"}


def test_save_writes_through_links_and_refuses_what_is_not_a_file(tmp_path):
    target = tmp_path / "target.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = run("--max-tokens", "4", input=f"Hi\n/save {link}\n/save {fifo}\n/save ~nouser/x\n"
              f"/load {fifo}\n/load /dev/zero\n/load ~nouser/x\n/load {tmp_path}\n"
              "/show\n").stdout
    assert link.is_symlink() and json.loads(target.read_text())["messages"][0]["content"] == "Hi"
    assert f"saved 2 messages to {target}" in out
    assert stat_kind(fifo) == "fifo"
    assert out.count("could not save to") == 2 and "nothing was lost" in out
    assert out.count("the chat is unchanged") == 4, out
    assert "(2 messages)" in out  # the REPL went on, the chat intact


def stat_kind(path):
    import stat

    mode = os.lstat(path).st_mode
    return "fifo" if stat.S_ISFIFO(mode) else "file" if stat.S_ISREG(mode) else "other"


def test_damaged_chats_folder_entries_are_one_line_or_skipped():
    run("--max-tokens", "4", input="Hi\n")
    folder = store().folder
    (folder / "gone.json").symlink_to(folder / "nowhere.json")  # a dangling link
    numbered = store().path("numbered")
    numbered.write_text(json.dumps({"messages": [5]}))
    numbered.with_suffix(".partial").write_text("half a reply")
    out = run("--max-tokens", "4", input="/chats\n").stdout
    assert "saved in" in out and "Traceback" not in out
    result = run("--resume", "numbered", input="")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_unwritable_state_folder_means_a_chat_without_history(tmp_path):
    state = tmp_path / "state"
    state.write_text("a file where the folder should be")
    result = subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "run",
                             "--max-tokens", "4"], input="Hi\n/show\n", capture_output=True,
                            text=True, timeout=300, check=False,
                            env={**os.environ, "XDG_STATE_HOME": str(state)})
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "chats cannot be saved in" in result.stdout and "(2 messages)" in result.stdout


def test_the_command_line_wins_over_a_resumed_chat_and_show_says_so():
    run("--max-tokens", "30", "--sampler", "top-k:k=5", "--seed", "7", input="Hi\n")
    name, = store().names()
    out = run("--resume", "--max-tokens", "20", "--sampler", "greedy", "--system",
              "Be brief.", input="/show\n").stdout
    assert "sampler     greedy" in out and "max-tokens  20" in out and "seed        7" in out
    assert "system      Be brief." in out
    assert "sampler: command line" in out and "max-tokens: command line" in out
    assert f"seed: saved chat {name}" in out


def test_hostile_resume_files_are_one_line_and_leave_no_lock(tmp_path):
    cases = {
        "deep.json": "[" * 1000 + "]" * 1000,  # 2 KB nested 1,000 deep
        "surrogate.json": '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "system.json": '{"system": "\\udfff", "messages": []}',
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        result = run("--resume", str(path), input="")
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and str(path) in result.stderr
        assert "Traceback" not in result.stderr
    assert "`messages[0].content` holds '\\ud800' at character 1" in run(
        "--resume", str(tmp_path / "surrogate.json"), input="").stderr
    folder = store().folder
    assert not folder.exists() or not list(folder.glob("*.lock"))


def test_a_resumed_chat_shows_its_control_characters_visibly(tmp_path):
    chat = tmp_path / "escapes.json"
    chat.write_text(json.dumps({"messages": [
        {"role": "user", "content": "clear\x1b[2J\x1b]0;title\x07 \x1b]52;c;cHduZWQ=\x07"},
        {"role": "assistant", "content": "ok\x9b31m\x00"}]}))
    out = run("--resume", str(chat), input="").stdout
    assert "\x1b[2J" not in out and "\x1b]" not in out and "\x07" not in out
    assert "\x9b" not in out and "\x00" not in out
    assert "clear\\x1b[2J\\x1b]0;title\\x07" in out and "ok\\x9b31m\\x00" in out

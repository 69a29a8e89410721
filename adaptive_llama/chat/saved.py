"""Saved chats: each REPL conversation kept as it goes, in ``$XDG_STATE_HOME/adaptive-llama/chats``.

A chat is ``NAME.json`` (the /save format: settings and messages), rewritten atomically after
each message and command, and, while a reply streams, ``NAME.partial``, to which every piece is
appended as it is shown. A reply cut short by a crash is therefore on disk up to its last
shown piece; loading the chat adds it as an interrupted reply. ``adaptive-llama run --resume``
continues the newest chat, ``--resume NAME`` a given one; ``/chats`` lists them.

A REPL holds its chat's lock (``NAME.lock``, an advisory ``flock`` the system drops when the
process ends, however it ends), so that two REPLs never write one chat: the second continues in
a copy. Names carry random letters, so two REPLs started in the same second get two chats.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
MAX_CHAT_BYTES = 64 * 2**20  # a chat file larger than this is not one (/load /dev/zero)


def read_text_file(path: Path, limit: int = MAX_CHAT_BYTES) -> str:
    """A regular file's text, read without blocking (a FIFO) or without end (/dev/zero):
    ValueError for anything but a regular file of at most ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"it is larger than {limit // 2**20} MiB")
        return f.read(limit + 1).decode("utf-8")


def write_user_file(path: Path, text: str) -> Path:
    """Write a file the user named, atomically: through a symbolic link to its target, never
    over a FIFO, device or folder (ValueError). Returns the file written."""
    target = path.resolve()
    if target.exists() and not target.is_file():
        raise ValueError("it is not a regular file")
    write_atomically(target, text)
    return target


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".",
                               prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def state_folder() -> Path:
    """``$XDG_STATE_HOME/adaptive-llama`` (``~/.local/state/...``): saved chats, REPL history."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "adaptive-llama"


def chats_folder() -> Path:
    return state_folder() / "chats"


class ChatStore:
    """The saved chats in one folder (created on the first save)."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or chats_folder()
        self._partial = None  # the open .partial file of the reply being shown
        self._lock = None  # the open .lock file of the chat this process holds

    def path(self, name: str) -> Path:
        if not NAME.match(name):
            raise ValueError(f"{name!r} is not a chat name: letters, digits, '.', '_', '-'")
        return self.folder / f"{name}.json"

    def new_name(self) -> str:
        """A name no chat has: the time, and random letters for two REPLs in one second."""
        stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
        while True:
            name = f"{stamp}-{secrets.token_hex(2)}"
            if not self.path(name).exists():
                return name

    def claim(self, name: str) -> bool:
        """Hold chat ``name``'s lock (releasing the one held before); False when another
        process holds it. OSError when the folder cannot be created or written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = self.path(name).with_suffix(".lock").open("a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return False
        if self._lock is not None:
            self._lock.close()
        self._lock = lock
        return True

    def save(self, name: str, data: dict) -> None:
        """Write the chat (OSError if the folder cannot be written); its reply is complete,
        so the .partial file goes."""
        self.end_reply()
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(data, indent=2, ensure_ascii=False))
        path.with_suffix(".partial").unlink(missing_ok=True)

    def begin_reply(self, name: str) -> None:
        self.end_reply()
        self._partial = self.path(name).with_suffix(".partial").open("w", encoding="utf-8")

    def piece(self, text: str) -> None:
        """Append one shown piece of the reply (flushed: a crash after it keeps it)."""
        if self._partial is not None:
            self._partial.write(text)
            self._partial.flush()

    def end_reply(self) -> None:
        if self._partial is not None:
            self._partial.close()
            self._partial = None

    def load(self, name: str) -> dict:
        """The saved data, with a reply a crash cut short added as interrupted. OSError,
        ValueError (not a chat file, not JSON) as the file is."""
        path = self.path(name)
        data = json.loads(read_text_file(path))
        partial = path.with_suffix(".partial")
        if isinstance(data, dict) and partial.exists():
            messages = data.get("messages")
            if (isinstance(messages, list) and messages and isinstance(messages[-1], dict)
                    and messages[-1].get("role") == "user"):
                messages.append({"role": "assistant", "interrupted": True,
                                 "content": read_text_file(partial)})
        return data

    def names(self) -> list[str]:
        """Saved chats, newest first (a link to nothing, or a file gone meanwhile, is not)."""
        if not self.folder.is_dir():
            return []
        dated = []
        for path in self.folder.glob("*.json"):
            try:
                dated.append((path.stat().st_mtime, path.stem))
            except OSError:
                continue
        return [name for _, name in sorted(dated, reverse=True) if NAME.match(name)]

    def latest(self) -> str | None:
        names = self.names()
        return names[0] if names else None

    def describe(self, name: str) -> str:
        """One line: name, when, messages, the first words of the first message."""
        path = self.path(name)
        try:
            when = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime(
                "%Y-%m-%d %H:%M")
            messages = json.loads(read_text_file(path)).get("messages") or []
            first = next((m["content"] for m in messages if m.get("role") == "user"), "")
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            return f"{name}  (unreadable)"
        words = " ".join(str(first).split())
        words = words if len(words) <= 50 else words[:49] + "…"
        return f"{name}  {when}  {len(messages)} messages  {words}"

"""Saved chats: each REPL conversation kept as it goes, in ``$XDG_STATE_HOME/adaptive-llama/chats``.

A chat is ``NAME.json`` (the /save format: settings and messages), rewritten atomically after
each message and command, and, while a reply streams, ``NAME.partial``, to which every piece is
appended as it is shown. A reply cut short by a crash is therefore on disk up to its last
shown piece; loading the chat adds it as an interrupted reply. ``adaptive-llama run --resume``
continues the newest chat, ``--resume NAME`` a given one; ``/chats`` lists them.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import tempfile
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


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


def chats_folder() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "adaptive-llama" / "chats"


class ChatStore:
    """The saved chats in one folder (created on the first save)."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or chats_folder()
        self._partial = None  # the open .partial file of the reply being shown

    def path(self, name: str) -> Path:
        if not NAME.match(name):
            raise ValueError(f"{name!r} is not a chat name: letters, digits, '.', '_', '-'")
        return self.folder / f"{name}.json"

    def new_name(self) -> str:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
        name, n = stamp, 1
        while self.path(name).exists():
            n += 1
            name = f"{stamp}-{n}"
        return name

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
        ValueError (not JSON) as the file is."""
        path = self.path(name)
        data = json.loads(path.read_text(encoding="utf-8"))
        partial = path.with_suffix(".partial")
        if isinstance(data, dict) and partial.exists():
            messages = data.get("messages")
            if isinstance(messages, list) and messages and messages[-1].get("role") == "user":
                messages.append({"role": "assistant", "interrupted": True,
                                 "content": partial.read_text(encoding="utf-8")})
        return data

    def names(self) -> list[str]:
        """Saved chats, newest first."""
        if not self.folder.is_dir():
            return []
        files = [p for p in self.folder.glob("*.json") if NAME.match(p.stem)]
        return [p.stem for p in sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)]

    def latest(self) -> str | None:
        names = self.names()
        return names[0] if names else None

    def describe(self, name: str) -> str:
        """One line: name, when, messages, the first words of the first message."""
        path = self.path(name)
        when = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d %H:%M")
        try:
            messages = json.loads(path.read_text(encoding="utf-8")).get("messages") or []
            first = next((m["content"] for m in messages if m.get("role") == "user"), "")
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            return f"{name}  {when}  (unreadable)"
        words = " ".join(str(first).split())
        words = words if len(words) <= 50 else words[:49] + "…"
        return f"{name}  {when}  {len(messages)} messages  {words}"

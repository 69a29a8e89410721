"""The text of an attached PDF (server/pdf_text.py): read by pypdf in a process of its own,
every failure one line. The page's side is in test_web."""

import asyncio
import base64
import io

import pytest
from pdf_files import pdf_of
from pypdf import PdfReader, PdfWriter

from adaptive_llama.server import pdf_text
from adaptive_llama.server.pdf_text import PdfError, read


def text_of(pdf: bytes, name: str = "paper.pdf") -> dict:
    return asyncio.run(pdf_text.pdf_text(name, base64.b64encode(pdf).decode()))


def test_each_pages_text_in_order_and_the_page_count():
    answer = text_of(pdf_of(["First page (with brackets)", "", "Third page"]))
    assert answer == {"text": "First page (with brackets)\n\nThird page", "pages": 3}


def test_deflated_pages_read_the_same():
    assert read(pdf_of(["Packed text"], deflate=True)) == {"text": "Packed text", "pages": 1}


@pytest.mark.parametrize("pdf, why", [
    (pdf_of([""]), "paper.pdf has no text to read (a scan or images only)"),
    (b"%PDF-1.7\n\x00\x01\x02 binary", "paper.pdf is not a PDF that can be read ("),
    (pdf_of(["cut"])[:60], "paper.pdf is not a PDF that can be read ("),
    (b"GIF89a", "paper.pdf is not a PDF (it does not begin with %PDF-)"),
    (b"%PDF-" + b" " * pdf_text.MAX_PDF_BYTES, "paper.pdf is larger than 1 MiB"),
])
def test_what_cannot_be_read_is_said_in_one_line(pdf, why):
    with pytest.raises(PdfError) as error:
        text_of(pdf)
    assert str(error.value).startswith(why) and "\n" not in str(error.value)


def encrypted_pdf() -> bytes:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_of(["secret"]))))
    writer.encrypt("password", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def pdf_bomb() -> bytes:
    """200 KB that inflate to 80 MiB of one page's text."""
    bomb = pdf_of([], contents=[b"BT /F1 12 Tf 72 720 Td (" + b"a" * (80 * 2**20) + b") Tj ET"],
                  deflate=True)
    assert len(bomb) < 2**20
    return bomb


def test_an_encrypted_pdf_is_refused():
    with pytest.raises(PdfError) as error:
        text_of(encrypted_pdf())
    assert str(error.value) == "paper.pdf is encrypted: attach a copy without a password"


def test_a_pdf_bomb_is_refused_without_unpacking_it():
    with pytest.raises(PdfError) as error:
        text_of(pdf_bomb())
    assert str(error.value) == ("paper.pdf holds a stream larger than a PDF reader unpacks: "
                                "attach its text instead")


def test_the_readers_own_answers_in_this_process():
    """What the reader process answers, read here (the cases above come through it)."""
    assert read(encrypted_pdf()) == {"error": "is encrypted: attach a copy without a password"}
    assert read(pdf_bomb()) == {"error": "holds a stream larger than a PDF reader unpacks: "
                                         "attach its text instead"}
    assert read(pdf_of([""])) == {"error": "has no text to read (a scan or images only): "
                                           "attach its text instead"}
    assert read(b"%PDF-1.7\n\x00\x01\x02 binary") == {
        "error": "is not a PDF that can be read (PdfStreamError: Stream has ended unexpectedly)"}
    assert read(pdf_of(["One", " ", "Three"])) == {"text": "One\n\nThree", "pages": 3}


def test_a_pdf_that_takes_too_long_is_stopped(monkeypatch):
    monkeypatch.setattr(pdf_text, "DEADLINE_S", 0.001)
    with pytest.raises(PdfError) as error:
        text_of(pdf_of(["slow"]))
    assert str(error.value) == "paper.pdf took more than 0 s to read: attach its text instead"


def test_a_reader_that_dies_is_said_in_one_line(monkeypatch):
    """A reader stopped by its memory limit answers nothing: its end is said instead."""
    monkeypatch.setattr(pdf_text, "MAX_MEMORY", 16 * 2**20)  # too little for Python
    with pytest.raises(PdfError) as error:
        text_of(pdf_of(["text"]))
    assert str(error.value) == ("paper.pdf could not be read: it needs more than 16 MiB of "
                                "memory, or it broke the PDF reader")


def test_bytes_that_are_not_base64_are_said_so():
    """Not skipped over: "AAAA!" without its "!" would be three bytes of a file."""
    with pytest.raises(PdfError, match="^paper.pdf did not arrive whole"):
        asyncio.run(pdf_text.pdf_text("paper.pdf", "AAAA!"))


def test_a_pdf_of_exactly_the_limit_is_read():
    with pytest.raises(PdfError, match="^paper.pdf is not a PDF that can be read"):
        text_of(b"%PDF-" + b" " * (pdf_text.MAX_PDF_BYTES - 5))


def test_too_much_text_is_refused(monkeypatch):
    monkeypatch.setattr(pdf_text, "MAX_TEXT_CHARS", 10)
    assert read(pdf_of(["eleven char"])) == {"error": "holds more than 10 characters of text"}
    assert read(pdf_of(["ten chars!"])) == {"text": "ten chars!", "pages": 1}

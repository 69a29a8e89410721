"""Small PDFs written by hand for the tests: pages of text in Helvetica, each page's
content stream as given (raw, or deflated), with a cross-reference table pypdf reads
without repairs."""

import zlib


def pdf_of(pages: list[str], *, contents: list[bytes] | None = None, deflate=False) -> bytes:
    """A PDF of one page per text of ``pages`` (``contents``: each page's content stream,
    in place of the text's; ``deflate``: those streams FlateDecode-compressed)."""
    streams = contents or [b"BT /F1 12 Tf 72 720 Td (" + _escaped(text) + b") Tj ET"
                           for text in pages]
    count = len(streams)
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(count))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               f"<< /Type /Pages /Kids [{kids}] /Count {count} >>".encode(),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for i, stream in enumerate(streams):
        data = zlib.compress(stream) if deflate else stream
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources "
                       f"<< /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>".encode())
        objects.append(f"<< /Length {len(data)}{' /Filter /FlateDecode' if deflate else ''} >>"
                       .encode() + b"\nstream\n" + data + b"\nendstream")
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    out += (f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n"
            .encode())
    return bytes(out)


def _escaped(text: str) -> bytes:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1")

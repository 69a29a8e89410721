"""The chat page: ``GET /`` answers the page, ``GET /web/FILE`` its scripts and style sheet
(static files shipped in the package, :data:`PAGE_FOLDER`), ``GET /web/samplers.json`` the
sampler table the settings panel is built from, ``POST /web/typeset`` the code and math
of a reply, highlighted and typeset (:mod:`.typeset`), and ``POST /web/pdf-text`` the text of
a PDF attached to a question (:mod:`.pdf_text`).

The scripts and the style sheet are sent without their comments and layout whitespace
(rJSmin, rCSSmin: minifiers made to run as a file is served), so the package keeps them
readable and the page still needs no build step.

The page calls the OpenAI routes of the same server (same origin, so :mod:`.guard`'s Origin and
Host checks apply unchanged). Its files are served without the API key, since the page holds
no data and has to load before it can ask for the key; every route it calls still needs it.
Every answer here carries a Content-Security-Policy that allows scripts, styles and
connections from this origin only: no inline script, nothing from outside.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from rcssmin import cssmin
from rjsmin import jsmin

from ..samplers import SAMPLERS, Param
from .common import parse_body
from .errors import APIError
from .pdf_text import MAX_PDF_BYTES, PdfError, pdf_text
from .typeset import highlight, mathml

PAGE_FOLDER = Path(__file__).with_name("web")
# The page's own files: a fixed list, so that no request names a path of its choosing.
PAGE_FILES = {path.name: path for path in PAGE_FOLDER.iterdir()
              if path.suffix in (".html", ".js", ".css")}
CONTENT_TYPES = {".html": "text/html; charset=utf-8",
                 ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8",
                 ".json": "application/json"}
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page can change between versions: the browser checks before it reuses a copy.
    "Cache-Control": "no-cache",
}

router = APIRouter()


def is_page_path(path: str) -> bool:
    """Whether ``path`` is the page or one of its files: served without the API key."""
    return path == "/" or path.startswith("/web/")


MINIFIERS = {".js": jsmin, ".css": cssmin}


# Keyed on the file's bytes: an edited file is minified and packed again, the same one once.
@functools.lru_cache(maxsize=64)
def served_bytes(body: bytes, suffix: str, packed: bool) -> bytes:
    """What the browser gets of a page file: minified when it is a script or the style
    sheet (about 30% fewer bytes), then gzipped when ``packed`` (about a third of those)."""
    minify = MINIFIERS.get(suffix)
    if minify is not None:
        body = minify(body.decode()).encode()
    return gzip.compress(body, mtime=0) if packed else body


def _answer(request: Request, body: bytes, suffix: str) -> Response:
    """``body`` as a page file, gzipped for a browser that takes it."""
    headers = {**SECURITY_HEADERS, "Vary": "Accept-Encoding"}
    packed = "gzip" in request.headers.get("accept-encoding", "")
    if packed:
        headers["Content-Encoding"] = "gzip"
    return Response(served_bytes(body, suffix, packed), media_type=CONTENT_TYPES[suffix],
                    headers=headers)


@router.get("/")
async def page(request: Request):
    return _answer(request, PAGE_FILES["index.html"].read_bytes(), ".html")


@router.get("/web/samplers.json")
async def samplers(request: Request):
    return _answer(request, SAMPLER_TABLE, ".json")


@router.get("/web/{name}")
async def page_file(request: Request, name: str):
    path = PAGE_FILES.get(name)
    if path is None:
        raise APIError(404, f"the page has no file {name!r}", code="not_found")
    return _answer(request, path.read_bytes(), path.suffix)


class _Code(BaseModel):
    model_config = ConfigDict(extra="forbid")
    language: str = Field(max_length=64)
    text: str


class _Formula(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tex: str
    display: bool = False


class TypesetBody(BaseModel):
    """The code blocks and formulas of a reply, as the page found them."""
    model_config = ConfigDict(extra="forbid")
    code: list[_Code] = Field(default_factory=list, max_length=256)
    math: list[_Formula] = Field(default_factory=list, max_length=1024)


def _typeset(body: TypesetBody) -> dict:
    return {"code": [highlight(block.language, block.text) for block in body.code],
            "math": [mathml(formula.tex, formula.display) for formula in body.math]}


# A POST: not a page file, so it needs the API key when the server has one (.guard).
@router.post("/web/typeset")
async def typeset(request: Request):
    body = await parse_body(request, TypesetBody)
    return await asyncio.to_thread(_typeset, body)


class PdfBody(BaseModel):
    """A PDF the page attaches: its file name and its bytes in base64."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=255)
    data: str = Field(max_length=4 * (MAX_PDF_BYTES // 3 + 1))


@router.post("/web/pdf-text")
async def pdf(request: Request):
    body = await parse_body(request, PdfBody)
    try:
        return await pdf_text(body.name, body.data)
    except PdfError as error:
        raise APIError(400, str(error), code="unreadable_pdf") from None


def _param(param: Param) -> dict:
    return {"name": param.name, "type": "int" if param.kind is int else
            "text" if param.choices else "float",
            "default": param.default, "help": param.help, "range": param.range_text(),
            "choices": list(param.choices)}


def sampler_table() -> dict:
    """The samplers and modifiers, with their parameters, as the settings panel shows them."""
    return {"samplers": [{"name": s.name, "summary": s.summary, "modifier": s.is_modifier,
                          "takes_temp": s.takes_temp,
                          "params": [_param(p) for p in s.params]}
                         for s in SAMPLERS.values()]}


SAMPLER_TABLE = json.dumps(sampler_table()).encode()

"""The chat page: ``GET /`` answers the page, ``GET /web/FILE`` its scripts and style sheet
(static files shipped in the package, :data:`PAGE_FOLDER`), and ``GET /web/samplers.json`` the
sampler table the settings panel is built from.

The page calls the OpenAI routes of the same server (same origin, so :mod:`.guard`'s Origin and
Host checks apply unchanged). Its files are served without the API key, since the page holds
no data and has to load before it can ask for the key; every route it calls still needs it.
Every answer here carries a Content-Security-Policy that allows scripts, styles and
connections from this origin only: no inline script, nothing from outside.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from ..samplers import SAMPLERS, Param
from .errors import APIError

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


def _answer(body: bytes, suffix: str) -> Response:
    return Response(body, media_type=CONTENT_TYPES[suffix], headers=SECURITY_HEADERS)


@router.get("/")
async def page():
    return _answer(PAGE_FILES["index.html"].read_bytes(), ".html")


@router.get("/web/samplers.json")
async def samplers():
    return _answer(SAMPLER_TABLE, ".json")


@router.get("/web/{name}")
async def page_file(name: str):
    path = PAGE_FILES.get(name)
    if path is None:
        raise APIError(404, f"the page has no file {name!r}", code="not_found")
    return _answer(path.read_bytes(), path.suffix)


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

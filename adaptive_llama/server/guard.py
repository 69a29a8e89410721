"""Who may call the server: the API key, the browser origins and host names it answers, the
content types it reads, and the body size it accepts, checked before any route runs.

Without a key the server still refuses what a web page could send on the user's behalf:

- **Origin.** A browser names the page that sends a request in ``Origin``. A request with
  an ``Origin`` that is not a loopback page (``http://localhost:3000``, ``http://127.0.0.1``,
  ...), the server's own (its chat page, on the host the Host rule passed) or one that
  ``--allow-origin`` lists gets 403: a page the user visits cannot drive
  the model. Tools such as curl and the OpenAI and Ollama clients send no ``Origin``.
- **Content-Type.** A page may POST ``text/plain`` or a form without the browser asking
  the server first (a CORS "simple request"). Bodies have to be ``application/json`` (or
  come with no type); ``application/x-www-form-urlencoded``, which ``curl -d`` sends by
  default, is read as JSON only from a request without ``Origin``.
- **Host (DNS rebinding).** A page can make its own host name resolve to 127.0.0.1 and so
  read from the server as its own origin. On a loopback address the server answers only
  ``Host: localhost``, ``127.0.0.1`` or ``[::1]`` (any port) and names ``--allow-host``
  adds.

The chat page and its files (``GET /``, ``GET /web/...``, :mod:`.web`) load without the key,
so that the page can ask for it; the Host and Origin rules apply to them as to every route.

The key comes as ``Authorization: Bearer KEY`` (OpenAI's and Ollama's clients) or as
``x-api-key: KEY`` (Anthropic's). The answer is 401, 403, 413 or 415 in the protocol's error
shape.
"""

from __future__ import annotations

import hmac
import re
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from .errors import APIError, too_large
from .web import is_page_path

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# The pages of LOOPBACK_NAMES: one pattern for this check and for the CORS answers.
LOOPBACK_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
JSON_TYPES = ("application/json", "")
CURL_DEFAULT_TYPE = "application/x-www-form-urlencoded"


def check_api_key(key: str | None) -> str | None:
    """The key as given, or ValueError for one that would turn authentication off (empty)
    or that the OpenAI and Ollama clients cannot send (not printable ASCII)."""
    if key is None:
        return None
    if not key.strip():
        raise ValueError("the API key is empty, which would let every request in: give a "
                         "key, or leave --api-key and ADAPTIVE_LLAMA_API_KEY unset")
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise ValueError("the API key has to be printable ASCII without surrounding spaces "
                         "(HTTP clients cannot send other characters in a header)")
    return key


def _host_name(netloc: str) -> str:
    """``localhost`` of ``localhost:8080``, ``::1`` of ``[::1]:8080``, lower case."""
    try:
        return (urlsplit(f"//{netloc}").hostname or "").lower()
    except ValueError:  # a bad port or bracket
        return ""


def _same_origin(origin: str, headers: Headers) -> bool:
    """Whether the page that sends the request is this server's own (the chat page served
    on a public address): its origin names the host the request went to. The Host rule has
    already passed that host."""
    try:
        return urlsplit(origin).netloc.lower() == headers.get("host", "").lower() != ""
    except ValueError:
        return False


class Access:
    """The server's access rules (see the module docstring)."""

    def __init__(self, api_key: str | None = None, allow_origins: tuple[str, ...] = (),
                 allow_hosts: tuple[str, ...] | None = ()):
        """``allow_origins`` and ``allow_hosts``: the pages and host names allowed besides
        the loopback ones; ``allow_hosts`` None: any Host (a server bound to a public
        address cannot know the names it is reached by)."""
        self.api_key = check_api_key(api_key)
        self.allow_origins = {o.rstrip("/").lower() for o in allow_origins}
        self.allow_hosts = None if allow_hosts is None else \
            {h.lower() for h in (*LOOPBACK_NAMES, *allow_hosts)}

    def error(self, method: str, headers: Headers, path: str = "") -> APIError | None:
        """Why this request may not pass (None when it may)."""
        page = method == "GET" and is_page_path(path)
        return (self._host_error(headers) or self._origin_error(headers)
                or (None if page else self._key_error(headers))
                or self._type_error(method, headers))

    def _host_error(self, headers: Headers) -> APIError | None:
        if self.allow_hosts is None or _host_name(headers.get("host", "")) in self.allow_hosts:
            return None
        return APIError(403, f"this server does not answer the host name "
                        f"{headers.get('host', '')!r}: use http://localhost, or start it with "
                        "--allow-host NAME", code="host_not_allowed")

    def _origin_error(self, headers: Headers) -> APIError | None:
        origin = headers.get("origin")
        if origin is None or self.origin_allowed(origin) or _same_origin(origin, headers):
            return None
        return APIError(403, f"requests from the web page at {origin!r} are not allowed: "
                        "start the server with --allow-origin to allow it",
                        code="origin_not_allowed")

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        return ("*" in self.allow_origins or origin in self.allow_origins
                or re.fullmatch(LOOPBACK_ORIGIN, origin) is not None)

    def _key_error(self, headers: Headers) -> APIError | None:
        if self.api_key is None:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key")
        if given is not None and hmac.compare_digest(given.encode(), self.api_key.encode()):
            return None
        return APIError(401, "invalid or missing API key: send the header "
                        "'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY')",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})

    @staticmethod
    def _type_error(method: str, headers: Headers) -> APIError | None:
        if method != "POST":
            return None
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if kind in JSON_TYPES or (kind == CURL_DEFAULT_TYPE and "origin" not in headers):
            return None
        return APIError(415, f"the body has to be JSON (Content-Type: application/json), "
                        f"not {kind!r}", code="unsupported_media_type")


class Guard:
    """Pure ASGI middleware (which, unlike Starlette's BaseHTTPMiddleware, leaves
    disconnect detection working): the access rules, and a Content-Length over the limit."""

    def __init__(self, app, access: Access, max_body: int):
        self.app, self.access, self.max_body = app, access, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            error = self.access.error(scope["method"], headers, scope["path"])
            length = headers.get("content-length", "")
            if error is None and length.isdigit() and int(length) > self.max_body:
                error = too_large(self.max_body)
            if error is not None:
                return await error.response(scope["path"])(scope, receive, send)
        return await self.app(scope, receive, send)

"""Chat templates rendered in processes of their own, so that a render's deadline holds
whatever one call inside it does, and its memory is bounded.

A thread cannot be stopped in CPython, and one Jinja filter call (a ``sort`` of 16 million
items) runs for tens of seconds between the sandbox's checks while holding the GIL that
the server's other requests need. So each render is sent to a renderer process (this
module run as a program: :func:`main`), which the caller stops (SIGKILL) at the render's
deadline or when it gives up (``cancelled``: a client that left), and which cannot take
more than :data:`~.template_sandbox.MAX_MEMORY` of address space. Idle renderers are kept
for the next render; a stopped one is replaced when it is next needed.

Requests and replies are JSON, each after its length (4 bytes, big-endian), over the
renderer's stdin and stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from . import template_sandbox
from .template_sandbox import Limits, TemplateBudgetError

GRACE_S = 0.5  # past the render's deadline: its reply on the way, a busy machine
START_S = 60.0  # for a renderer to start (Python and Jinja imported), on a busy machine
KEEP_IDLE = 4  # renderers kept for the next renders
_HEADER = struct.Struct(">I")


class TemplateSyntax(ValueError):
    """A template that is no Jinja; ``line`` where Jinja found it, if it says."""

    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.line = line


class TemplateRenderError(ValueError):
    """The template's own error on this conversation (``raise_exception``, a type error),
    or a renderer that the template made crash."""


class TemplateCrashed(TemplateRenderError):
    """A renderer that ended before it answered (the template made it crash)."""


class TemplateCancelled(Exception):
    """The caller gave up on the render (its ``cancelled`` was set); the renderer stopped."""


def render(source: str, *, context: dict, texts: list[str] | None = None,
           specials: str | None = None, cancelled: threading.Event | None = None) -> str:
    """``source`` rendered with ``context`` (JSON values) in a renderer process, within the
    bounds of :mod:`.template_sandbox` read now. ``texts`` are the client texts behind the
    marks (for ``tojson``), ``specials`` the regular expression of the model's control
    tokens' texts (escaped in JSON the template writes).

    Raises:
        TemplateBudgetError: past a bound (the time bound: stopped at the deadline).
        TemplateSyntax: no Jinja.
        TemplateRenderError: the template's own error, or a renderer it made crash.
        TemplateCancelled: ``cancelled`` was set before the render ended.
    """
    limits = Limits(template_sandbox.MAX_RENDER_S, template_sandbox.MAX_STEPS,
                    template_sandbox.MAX_CHARS)
    request = json.dumps({"source": source, "specials": specials, "texts": texts or [],
                          "context": context, "limits": limits.__dict__},
                         ensure_ascii=False).encode("utf-8", "surrogatepass")
    renderer = _POOL.take()
    try:
        reply = renderer.ask(request, time.monotonic() + limits.max_s + GRACE_S,
                             cancelled.is_set if cancelled else lambda: False)
    except TemplateBudgetError:
        renderer.stop()
        raise TemplateBudgetError(f"the template takes more than {limits.max_s:g} s") \
            from None
    except BaseException:
        renderer.stop()
        raise
    if reply.get("retire"):
        renderer.stop()
    else:
        _POOL.give(renderer)
    return _result(reply)


def _result(reply: dict) -> str:
    if "text" in reply:
        return reply["text"]
    if "budget" in reply:
        raise TemplateBudgetError(reply["budget"])
    if "syntax" in reply:
        raise TemplateSyntax(reply["syntax"], reply.get("line"))
    raise TemplateRenderError(reply["error"])


class _Renderer:
    """One renderer process, used by one render at a time."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            started = self._read(1, time.monotonic() + START_S, lambda: False) == b"R"
        except (TemplateBudgetError, TemplateRenderError):
            started = False
        if not started:
            self.stop()
            raise TemplateRenderError("the chat template's renderer did not start")

    def ask(self, request: bytes, deadline: float, cancelled: Callable[[], bool]) -> dict:
        try:
            self.process.stdin.write(_HEADER.pack(len(request)) + request)
            self.process.stdin.flush()
        except OSError:
            raise TemplateCrashed(self._ended()) from None
        size = _HEADER.unpack(self._read(_HEADER.size, deadline, cancelled))[0]
        return json.loads(self._read(size, deadline, cancelled).decode("utf-8",
                                                                       "surrogatepass"))

    def _read(self, size: int, deadline: float, cancelled: Callable[[], bool]) -> bytes:
        """``size`` bytes of the reply; TemplateBudgetError at the deadline."""
        fd = self.process.stdout.fileno()
        data = bytearray()
        while len(data) < size:
            if cancelled():
                raise TemplateCancelled("the render was given up")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemplateBudgetError("past the deadline")
            if select.select([fd], [], [], min(left, 0.05))[0]:
                chunk = os.read(fd, size - len(data))
                if not chunk:
                    raise TemplateCrashed(self._ended())
                data += chunk
        return bytes(data)

    def _ended(self) -> str:
        code = self.process.wait()
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return f"the chat template stopped its renderer ({how})"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class _Pool:
    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[_Renderer] = []
        self._starting: threading.Thread | None = None

    def prestart(self) -> None:
        """Start a renderer in the background, unless one is idle or starting: a model's
        load then hides its start (Python and Jinja imported, about 0.2 s)."""
        with self._lock:
            if self._idle or (self._starting and self._starting.is_alive()):
                return
            self._starting = threading.Thread(target=self._start_one, daemon=True,
                                              name="template-renderer-start")
            self._starting.start()

    def _start_one(self) -> None:
        try:
            self.give(_Renderer())
        except (OSError, TemplateRenderError):
            pass  # take() starts one itself, and says why if it cannot

    def take(self) -> _Renderer:
        starting = self._starting
        if starting is not None and starting is not threading.current_thread():
            starting.join(START_S)
        with self._lock:
            while self._idle:
                renderer = self._idle.pop()
                if renderer.process.poll() is None:
                    return renderer
        return _Renderer()

    def give(self, renderer: _Renderer) -> None:
        with self._lock:
            if len(self._idle) < KEEP_IDLE:
                self._idle.append(renderer)
                return
        renderer.stop()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for renderer in idle:
            renderer.stop()


_POOL = _Pool()
atexit.register(_POOL.close)
prestart = _POOL.prestart


# ---- the renderer's side ----

def _limit_memory() -> None:
    try:
        import resource
    except ImportError:  # Windows: no address-space limit to set
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = template_sandbox.MAX_MEMORY
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):  # a platform that does not enforce it (macOS)
        pass


def _answer(renderer: template_sandbox.Renderer, request: dict) -> dict:
    import jinja2

    try:
        template = renderer.template(request["source"], request["specials"])
    except jinja2.TemplateSyntaxError as exc:
        return {"syntax": exc.message or str(exc), "line": exc.lineno}
    except (RecursionError, MemoryError, SyntaxError):  # Python's own limits on nesting
        return {"syntax": "it nests blocks or expressions too deeply", "line": None}
    try:
        return {"text": renderer.render(template, request["texts"], request["context"],
                                        Limits(**request["limits"]))}
    except TemplateBudgetError as exc:
        return {"budget": str(exc)}
    except MemoryError:
        mib = template_sandbox.MAX_MEMORY // 2**20
        return {"budget": f"the template needs more than {mib:,} MiB of memory",
                "retire": True}
    except RecursionError:
        return {"budget": "the template nests calls too deeply", "retire": True}
    except Exception as exc:  # noqa: BLE001 (the template's own error, whatever its kind)
        return {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}


def main() -> None:
    """Answer render requests on stdin until it closes."""
    _limit_memory()
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    renderer = template_sandbox.Renderer()
    sink.write(b"R")
    sink.flush()
    while header := source.read(_HEADER.size):
        body = source.read(_HEADER.unpack(header)[0])
        reply = _answer(renderer, json.loads(body.decode("utf-8", "surrogatepass")))
        data = json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass")
        sink.write(_HEADER.pack(len(data)) + data)
        sink.flush()
        if reply.get("retire"):
            return


if __name__ == "__main__":
    main()

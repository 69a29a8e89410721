"""The HTTP server behind ``adaptive-llama serve``: one model, with one llama.cpp context,
behind OpenAI's routes (:mod:`.openai`) and Ollama's (:mod:`.ollama`), plus llama-server's
``/tokenize`` and ``/detokenize`` (:mod:`.llamacpp`) and ``GET /health``.

This module assembles the application: the shared state (:class:`.common.Server`), who may
call it (:mod:`.guard`), errors in each protocol's shape (:mod:`.errors`); the routes of both
protocols are module functions that read the shared state from the request. The connection
handling (a deadline for each request) is :mod:`.protocol`.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.embeddings import Embedder
from ..runtime.engine import Engine
from ..samplers import SamplerSpec, spec_of
from . import llamacpp, ollama, openai
from .common import MAX_BODY, Server
from .errors import APIError
from .guard import LOOPBACK_ORIGIN, Access, Guard


def create_app(engine: Engine, sampler: SamplerSpec | str = "adaptive", *,
               api_key: str | None = None, max_queue: int = 8, model_id: str | None = None,
               max_body: int = MAX_BODY, allow_origins: tuple[str, ...] = (),
               allow_hosts: tuple[str, ...] | None = (),
               embedder: Embedder | None = None) -> FastAPI:
    """The ASGI application; run it with uvicorn (``adaptive-llama serve`` does).

    ``allow_origins``: web pages besides loopback ones that may call it (``"*"``: any);
    ``allow_hosts``: host names besides loopback ones it answers (None: any, for a server
    on a public address). See :mod:`.guard`. ValueError for an empty or non-ASCII key.
    ``embedder``: the embeddings' model (it closes with the app); None: the engine's own.
    """
    access = Access(api_key, allow_origins, allow_hosts)
    server = Server(engine, spec_of(sampler), max_queue, model_id, embedder)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        server.scheduler.stop()
        if embedder is not None:
            embedder.close()

    app = FastAPI(title="adaptive-llama", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.server = server
    app.state.max_body = max_body

    app.add_middleware(Guard, access=access, max_body=max_body)
    # Outermost: answers browsers' preflight requests, for the pages Access allows only.
    app.add_middleware(CORSMiddleware, allow_origins=sorted(access.allow_origins),
                       allow_origin_regex=LOOPBACK_ORIGIN, allow_methods=["GET", "POST"],
                       allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response(request.url.path)

    @app.get("/health")
    async def health():
        s = server.scheduler
        return {"status": "ok", "model": server.model_id, "sampler": str(server.sampler),
                "slots": engine.parallel, "running": s.running,
                "free": engine.parallel - s.running, "waiting": s.waiting,
                "threads": engine.threads, **s.counts}

    app.include_router(openai.router)
    app.include_router(ollama.router)
    app.include_router(llamacpp.router)
    return app

"""The HTTP server behind ``adaptive-llama serve``: one or several models (:mod:`.pool`: each
with its llama.cpp context, loaded on demand), behind OpenAI's routes (:mod:`.openai`, and
the Responses API, :mod:`.responses`), Anthropic's Messages API (:mod:`.messages`) and
Ollama's routes (:mod:`.ollama`), plus llama-server's
``/tokenize`` and ``/detokenize`` (:mod:`.llamacpp`), ``GET /health``, and the chat page at
``GET /`` (:mod:`.web`).

This module assembles the application: the shared state (:class:`.common.Server`), who may
call it (:mod:`.guard`), errors in each protocol's shape (:mod:`.errors`); the routes of both
protocols are module functions that read the shared state from the request. The connection
handling (a deadline for each request) is :mod:`.protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.embeddings import Embedder
from ..runtime.models import ModelError
from . import llamacpp, messages, ollama, openai, responses, web
from .common import MAX_BODY, Server
from .errors import APIError
from .guard import LOOPBACK_ORIGIN, Access, Guard
from .pool import LoadedModel, ModelPool
from .scheduler import Scheduler


def create_app(pool: ModelPool, *, api_key: str | None = None, max_body: int = MAX_BODY,
               allow_origins: tuple[str, ...] = (), allow_hosts: tuple[str, ...] | None = (),
               embedder: Embedder | None = None) -> FastAPI:
    """The ASGI application over the pool's models; run it with uvicorn (``adaptive-llama
    serve`` does). It unloads idle models while it runs and closes them all when it stops.

    ``allow_origins``: web pages besides loopback ones that may call it (``"*"``: any);
    ``allow_hosts``: host names besides loopback ones it answers (None: any, for a server
    on a public address). See :mod:`.guard`. ValueError for an empty or non-ASCII key.
    ``embedder``: the embeddings' model (it closes with the app); None: each served model's
    own.
    """
    access = Access(api_key, allow_origins, allow_hosts)
    server = Server(pool, embedder)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        unloading = asyncio.create_task(pool.keep_unloading())
        yield
        unloading.cancel()
        pool.close()
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

    _answer_errors(app)

    @app.get("/health")
    async def health():
        loaded = [_health_of(model) for model in pool.loaded]
        totals = {key: sum(m[key] for m in loaded)
                  for key in ("slots", "running", "free", "waiting", *Scheduler.OUTCOMES)}
        return {"status": "ok", "model": pool.default.name, **totals, "loaded": loaded}

    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(ollama.router)
    app.include_router(llamacpp.router)
    app.include_router(web.router)
    return app


def _answer_errors(app: FastAPI) -> None:
    """Every error as the protocols' error bodies."""
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(ModelError)
    async def model_error(request: Request, exc: ModelError):
        # A served model's file that went missing or is damaged: the server keeps serving.
        return APIError(500, str(exc), type="server_error",
                        param="model").response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response(request.url.path)


def _health_of(model: LoadedModel) -> dict:
    s = model.scheduler
    return {"name": model.name, "sampler": str(model.sampler), "slots": model.engine.parallel,
            "running": s.running, "free": model.engine.parallel - s.running,
            "waiting": s.waiting, "threads": model.engine.threads,
            "layers": model.engine.layers, **s.counts}

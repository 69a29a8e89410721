"""``adaptive-llama serve``: an OpenAI-compatible HTTP server (:mod:`.app`: routes, request
schemas, errors) over one engine run by a scheduler (:mod:`.scheduler`)."""

from .app import create_app

__all__ = ["create_app"]

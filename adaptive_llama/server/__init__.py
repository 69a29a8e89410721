"""``adaptive-llama serve``: one model behind OpenAI's and Ollama's HTTP APIs.

:mod:`.app` assembles the application; :mod:`.openai` and :mod:`.ollama` hold each protocol's
bodies and routes, and import only :mod:`.common`, the request rules and state they share;
:mod:`.scheduler` runs the engine; :mod:`.guard` decides who may call; :mod:`.protocol`
bounds the time a request may take to arrive.
"""

from .app import create_app

__all__ = ["create_app"]

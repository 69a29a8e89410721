"""The plugin for Simon Willison's ``llm``: adaptive decoding from ``llm -m adaptive/smollm2``.

Registered through the ``llm`` entry point in pyproject.toml. Models: ``adaptive/NAME`` for
each installed bundled model (``adaptive-llama models``) and for each GGUF registered with
``llm adaptive add PATH [--name NAME]`` (kept in ``adaptive-llama-models.json`` in llm's user
directory). Options (``-o name value``): ``sampler`` (any spec, as ``adaptive-llama samplers``
lists), ``epsilon`` (adaptive's or eta's), ``temperature`` (0: greedy), ``max_tokens``, ``seed``,
``n_gpu_layers``. Replies stream; conversations (``llm chat``, ``-c``) send their history
through the model's chat template; llm's log gets each reply's figures (``response_json``:
sampler, seed, backend, mean k...).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Optional

import click
import llm
from pydantic import Field, field_validator

from .runtime.models import BUNDLED, ModelError, check_gguf
from .runtime.reasoning import Thought
from .samplers import EPSILON, SEED, TEMP, SpecError, parse_spec, spec_from_options

DEFAULT_SPEC = parse_spec("adaptive")  # what -m adaptive-... runs without -o sampler

REGISTRY = "adaptive-llama-models.json"
PREFIX = "adaptive/"


def _registry_path() -> Path:
    return llm.user_dir() / REGISTRY


def registered_models() -> dict[str, str]:
    """{name: GGUF path} added with ``llm adaptive add``."""
    path = _registry_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise click.ClickException(f"{path} is not readable JSON ({exc}); fix or delete it")
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


@llm.hookimpl
def register_models(register):
    for name, bundled in BUNDLED.items():
        if bundled.installed():
            register(AdaptiveModel(PREFIX + name, name))
    for name, path in registered_models().items():
        register(AdaptiveModel(PREFIX + name, path))


@llm.hookimpl
def register_commands(cli):
    @cli.group(name="adaptive")
    def adaptive_group():
        """adaptive-llama: GGUF models with adaptive decoding."""

    @adaptive_group.command(name="add")
    @click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
    @click.option("--name", help="Model id after adaptive/ (default: the file's stem).")
    def add(path: Path, name: str | None):
        """Register a GGUF file as the model adaptive/NAME."""
        path = path.expanduser().resolve()
        try:
            check_gguf(path)
        except ModelError as exc:
            raise click.ClickException(str(exc)) from None
        name = name or path.stem
        if name in BUNDLED:
            raise click.ClickException(f"{name!r} is a bundled model's name; pick another")
        models = registered_models()
        models[name] = str(path)
        target = _registry_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(models, indent=2))
        tmp.replace(target)
        click.echo(f"added {PREFIX}{name} -> {path}")


_engines: dict[tuple[str, int], object] = {}
_engines_lock = threading.Lock()


def _engine(model: str, n_gpu_layers: int):
    """One loaded engine per (model, GPU layers), kept for the process (``llm chat``)."""
    from .runtime.engine import Engine

    with _engines_lock:
        key = (model, n_gpu_layers)
        if key not in _engines:
            try:
                _engines[key] = Engine(model, n_gpu_layers=n_gpu_layers)
            except (ModelError, ValueError) as exc:
                raise llm.ModelError(str(exc)) from None
        return _engines[key]


def _text(message) -> str:
    return "".join(getattr(part, "text", None) or "" for part in message.parts)


def _conversation(prompt, conversation) -> tuple[str | None, list[dict]]:
    """(system prompt, earlier messages) of the conversation this prompt continues.

    llm 0.3x hands the whole history, reloaded from its log for ``-c`` included, in
    ``prompt.messages`` (ending with this prompt); older llm only in ``conversation``."""
    messages = getattr(prompt, "messages", None)
    if messages is None:
        earlier = conversation.responses if conversation else []
        history = [m for r in earlier for m in ({"role": "user", "content": r.prompt.prompt},
                                                {"role": "assistant", "content": r.text()})]
        return prompt.system, history
    system, history = prompt.system, []
    for message in messages:
        if message.role == "system":
            system = _text(message) or system
        elif message.role in ("user", "assistant"):
            history.append({"role": message.role, "content": _text(message)})
    if history and history[-1]["role"] == "user":
        history.pop()  # this prompt: Chat.send adds it
    return system, history


class AdaptiveModel(llm.Model):
    can_stream = True

    class Options(llm.Options):
        sampler: Optional[str] = Field(
            None, description="Sampler spec, e.g. adaptive:eps=0.001, min-p:p=0.05, greedy "
            "(adaptive-llama samplers lists them); default adaptive")
        epsilon: Optional[float] = Field(
            None, description="adaptive's (or eta's) epsilon, in (0, 1)")
        temperature: Optional[float] = Field(
            None, description="Temperature, before truncation; 0: greedy")
        max_tokens: Optional[int] = Field(None, ge=1, description="Longest reply in tokens")
        seed: Optional[int] = Field(None, description="Random seed, 0 to 2**32 - 1")
        n_gpu_layers: Optional[int] = Field(
            None, ge=-1, description="Layers to offload to the GPU (-1: all)")

        @field_validator("sampler")
        @classmethod
        def _spec(cls, value):
            if value is not None:
                parse_spec(value)  # SpecError is a ValueError: llm prints it in one line
            return value

        @field_validator("epsilon")
        @classmethod
        def _epsilon(cls, value):
            return None if value is None else EPSILON.validate(value, name="epsilon")

        @field_validator("temperature")
        @classmethod
        def _temperature(cls, value):
            return value if value in (None, 0) else TEMP.validate(value, name="temperature")

        @field_validator("seed")
        @classmethod
        def _seed(cls, value):
            return None if value is None else SEED.validate(value, name="seed")

    def __init__(self, model_id: str, model: str):
        self.model_id = model_id
        self.model = model  # a bundled name or a GGUF path

    def __str__(self):
        return f"adaptive-llama: {self.model_id}"

    def spec(self, options):
        try:
            return spec_from_options(DEFAULT_SPEC, sampler=options.sampler,
                                     temperature=options.temperature, epsilon=options.epsilon)
        except SpecError as exc:
            raise llm.ModelError(str(exc)) from None

    def execute(self, prompt, stream, response, conversation):
        from .chat.conversation import Chat
        from .runtime.request import InvalidArgument

        options = prompt.options
        engine = _engine(self.model, options.n_gpu_layers or 0)
        settings = dict(sampler=self.spec(options), max_tokens=options.max_tokens or 256,
                        seed=options.seed)
        try:
            if engine.has_chat_template:
                system, history = _conversation(prompt, conversation)
                chat = Chat(engine, system=system, **settings)
                chat.messages = history
                reply = chat.send(prompt.prompt)
            else:  # a base model continues the text
                text = prompt.prompt if not prompt.system else f"{prompt.system}\n\n{prompt.prompt}"
                reply = engine.stream(engine.tokenize(text), **settings)
        except (InvalidArgument, SpecError) as exc:  # the prompt too long, among others
            raise llm.ModelError(str(exc)) from None
        yield from (piece for piece in reply if not isinstance(piece, Thought))  # the answer
        result = reply.result
        response.response_json = {"prompt_tokens": result.prompt_tokens, **result.summary()}
        response.set_usage(input=result.prompt_tokens, output=result.completion_tokens)

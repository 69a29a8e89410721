"""The ``adaptive-llama`` command: models, samplers, generate, run (the chat REPL), serve, eval,
rpc-worker.

User errors (a bad model file, a bad sampler spec, an over-long prompt) print one line,
``Error: ...``, and exit with status 2; no traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import os
import signal
import socket
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from .eval.config import GRIDS, TEMPERATURE_METHODS
from .runtime import config
from .runtime.limits import MAX_CTX, MAX_THREADS
from .runtime.models import ModelError, describe_models, resolve_model
from .runtime.reasoning import Thought
from .samplers import SEED, SpecError, parse_spec, spec_from_options, table, valid_specs

USER_ERRORS = (ModelError, SpecError, ValueError)


def fail(message: str) -> None:
    click.echo(f"Error: {message}", err=True)
    raise SystemExit(2)


def user_errors(fn):
    """Turn the package's user errors into one line and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            fail(str(exc))

    return wrapper


def _spec(ctx, param, value):
    try:
        return parse_spec(value)
    except SpecError as exc:
        fail(f"--{param.name.replace('_', '-')}: {exc}")


def _optional_spec(ctx, param, value):
    return None if value is None else _spec(ctx, param, value)


# config.toml key -> the commands' parameter; the command line (or its environment variable)
# wins over the file, the file over the built-in default.
CONFIG_PARAMS = {"sampler": "sampler", "system": "system", "ctx": "n_ctx",
                 "n_gpu_layers": "n_gpu_layers", "threads": "threads",
                 "backend_sampling": "backend_sampling", "markdown": "markdown",
                 "wordwrap": "wordwrap", "chat_template": "chat_template", "rpc": "rpc",
                 "tensor_split": "tensor_split", "draft": "draft", "draft_max": "draft_max",
                 "reasoning_budget": "reasoning_budget",
                 "reasoning_budget_message": "reasoning_budget_message",
                 "reasoning_sampler": "reasoning_sampler"}
GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def configured(fn):
    """Fill the options the command line left out from config.toml (the model's table, then
    [defaults]); where each value came from goes to the click context's meta["sources"]."""

    @functools.wraps(fn)
    def wrapper(**kwargs):
        kwargs, click.get_current_context().meta["sources"] = _settings(kwargs.get("model"),
                                                                        kwargs)
        _warn_misspelt_tables()
        return fn(**kwargs)

    return wrapper


def _settings(model: str | None, kwargs: dict) -> tuple[dict, dict]:
    """The command's arguments with what the command line left out taken from config.toml
    for ``model``, and where each setting came from. ConfigError: one line, exit 2."""
    ctx = click.get_current_context()
    settings = config.settings_for(model)
    kwargs, sources = dict(kwargs), {}
    for key, name in CONFIG_PARAMS.items():
        if name not in kwargs:
            continue
        if ctx.get_parameter_source(name) in GIVEN:
            sources[key] = "command line"
        elif key in settings.values:
            kwargs[name] = settings.values[key]
            sources[key] = settings.source[key]
        else:
            sources[key] = "built-in default"
    return kwargs, sources


def _warn_misspelt_tables() -> None:
    for warning in config.misspelt_tables():
        click.echo(f"Warning: {warning}", err=True)


def _rpc(ctx, param, value):
    if value is None:
        return None
    from .endpoints import parse_endpoints

    try:
        return parse_endpoints(value)
    except ValueError as exc:
        fail(f"--rpc {exc}")


def _tensor_split(ctx, param, value):
    if value is None:
        return None
    import llama_cpp

    from .runtime.request import check_shares

    try:
        return check_shares("tensor_split", [float(x) for x in value.split(",")],
                            llama_cpp.llama_max_devices())
    except ValueError:
        fail(f"--tensor-split: {value!r} is not a list of shares like 3,2 (non-negative "
             "numbers, not all 0)")


def model_options(fn):
    for option in reversed([
        click.option("--n-gpu-layers", type=int, default=0, show_default=True,
                     help="Layers to offload to the GPU (CUDA build; -1: all)."),
        click.option("--ctx", "n_ctx", type=click.IntRange(min=0, max=MAX_CTX), default=2048,
                     show_default=True, help="Context window in tokens, rounded up to a "
                     "multiple of 256 (0: the model's own)."),
        click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
                     help="CPU threads (default: the physical cores available, adapted "
                     "while decoding when other work competes for them)."),
        click.option("--seed", type=click.IntRange(int(SEED.low), int(SEED.high)),
                     default=None, help="Random seed (default: a new one each reply, "
                     "reported with its figures)."),
        click.option("--backend-sampling", is_flag=True,
                     help="Sample inside llama.cpp's graph, on the device holding the output "
                     "layer (greedy, top-k, top-p, min-p, adaptive; no logprobs or grammar)."),
        click.option("--chat-template", default=None, metavar="NAME|FILE",
                     help="A chat template in place of the model's own: a Jinja file, "
                     "chatml-tools (ChatML with tool calls, for SmolLM2 and other ChatML "
                     "models whose template has no tools), or a name of llama.cpp's "
                     "(llama3, chatml, gemma, command-r, ...)."),
        click.option("--rpc", default=None, metavar="HOST:PORT[,...]", callback=_rpc,
                     help="llama.cpp RPC workers (adaptive-llama rpc-worker) that hold the "
                     "model's layers (docs/distributed.md)."),
        click.option("--tensor-split", default=None, metavar="W[,W...]",
                     callback=_tensor_split, help="Share of the offloaded layers per device: "
                     "the --rpc workers in order, then this machine's GPUs (default: by free "
                     "memory)."),
        click.option("--rpc-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=300, show_default=True, metavar="SECONDS",
                     help="Longest decode step with --rpc workers before giving them up "
                     "(a frozen machine would stall the reply for ever)."),
        click.option("--draft", default=None, metavar="ngram|MODEL",
                     help="Speculative decoding: drafts from the conversation itself (ngram) "
                     "or from a smaller model with the same tokenizer; the same replies, "
                     "faster where drafts are kept (docs/performance.md)."),
        click.option("--draft-max", type=click.IntRange(1, 511), default=16,
                     show_default=True, help="Tokens drafted per step at most."),
        click.option("--reasoning-budget", type=click.IntRange(min=-1), default=-1,
                     show_default=True, metavar="N",
                     help="A reasoning model thinks at most N tokens, then answers (-1: no "
                     "bound; 0: no thinking; docs/reasoning.md)."),
        click.option("--reasoning-budget-message", default="", metavar="TEXT",
                     help="What a reasoning model's thinking ends with when its budget is "
                     "spent (before the closing tag)."),
        click.option("--reasoning-sampler", default=None, metavar="SPEC",
                     callback=_optional_spec, help="The sampler of a reasoning model's "
                     "thinking (default: the reply's --sampler)."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's own log."),
    ]):
        fn = option(fn)
    return fn


def template_source(chat_template: str | None) -> str | None:
    """The source of ``--chat-template`` (a built-in name or a file), or a one-line exit."""
    if chat_template is None:
        return None
    from .runtime.chat_template import load_template

    try:
        return load_template(chat_template)
    except ValueError as exc:
        fail(f"--chat-template {exc}")


@dataclasses.dataclass
class EngineOptions:
    """The engine's options as model_options declares them (and config.toml fills them):
    every command that loads a model builds its engine here."""

    n_gpu_layers: int
    n_ctx: int
    threads: int | None
    backend_sampling: bool
    chat_template: str | None
    rpc: list[str] | None
    tensor_split: list[float] | None
    rpc_timeout: float
    draft: str | None
    draft_max: int
    reasoning_budget: int
    reasoning_budget_message: str
    reasoning_sampler: object
    verbose: bool

    @classmethod
    def of(cls, options: dict) -> EngineOptions:
        """The engine's options among a command's (the others are left out)."""
        return cls(**{f.name: options[f.name] for f in dataclasses.fields(cls)})

    def load(self, model, *, seed: int | None = None, parallel: int = 1, sampler=None,
             show_progress: bool = False, template: str | None = None):
        """The Engine; with ``sampler``, also one that engine can run (else ValueError, not
        an exit: a server loads models while it serves); ``template``: the chat template's
        source, read already (else --chat-template's, read now)."""
        from .runtime.engine import Engine  # llama.cpp loads only for commands that need it

        if show_progress:
            click.echo(f"loading {model or 'smollm2 (bundled)'} ...", err=True)
        if self.n_gpu_layers and not self.rpc:
            from .llama.rpc import local_gpus

            if not local_gpus():
                click.echo(f"Note: this build of llama-cpp-python runs on the CPU only, so "
                           f"--n-gpu-layers {self.n_gpu_layers} changes nothing (README, "
                           "'CPU or CUDA', says how to build it for a GPU).", err=True)
        engine = Engine(model, n_gpu_layers=self.n_gpu_layers, n_ctx=self.n_ctx,
                        n_threads=self.threads, parallel=parallel, seed=seed,
                        verbose=self.verbose, backend_sampling=self.backend_sampling,
                        chat_template=template or template_source(self.chat_template),
                        rpc=self.rpc, tensor_split=self.tensor_split,
                        rpc_timeout=self.rpc_timeout, draft=self.draft,
                        draft_max=self.draft_max, reasoning_budget=self.reasoning_budget,
                        reasoning_budget_message=self.reasoning_budget_message,
                        reasoning_sampler=self.reasoning_sampler)
        if sampler is not None:
            try:
                engine.check_sampler(sampler)
            except SpecError as exc:
                engine.close()
                raise ValueError(f"--sampler: {exc}") from None
        return engine


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="adaptive-llama")
def main():
    """Adaptive decoding for GGUF models on llama.cpp: chat, generate, compare samplers."""
    if os.environ.get("ADAPTIVE_LLAMA_IMPL") or os.environ.get("ADAPTIVE_LLAMA_BACKEND"):
        try:  # a forced implementation that cannot run: one line now, not a traceback later
            from . import kernel  # noqa: F401
        except ImportError as exc:
            fail(str(exc))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors
def models(as_json):
    """List the bundled models: path, vocabulary, chat template, installed, and the settings
    config.toml gives each (with the table they come from)."""
    rows = describe_models()
    _warn_misspelt_tables()
    for r in rows:
        settings = config.settings_for(r["name"])
        r["settings"] = {key: {"value": str(value), "source": settings.source[key]}
                         for key, value in settings.values.items()}
    path = config.config_path()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        state = (f"{r['path']}{'' if r['ready'] else '  (joined from its parts on first use)'}"
                 if "path" in r else f"not installed: {r['install']}")
        click.echo(f"{r['name']:<{width}} vocab {r['vocab_size']:>7,}  chat template: "
                   f"{'yes' if r['chat_template'] else 'no ':<3}  start eps {r['start_eps']:g}"
                   f"  {r['description']}\n{'':<{width}} {state}")
        for key, s in r["settings"].items():
            click.echo(f"{'':<{width}} {key} = {s['value']}  (from {s['source']})")
    click.echo(f"settings file: {path}{'' if path.exists() else ' (none yet)'}")


@main.command()
def samplers():
    """Every sampler spec: parameters, defaults, valid ranges, what runs."""
    click.echo(table())


def temp_option(fn):
    return click.option("--temp", "temperature", type=float, default=None,
                        help="Temperature of the sampler (0: greedy), as the server's "
                             "`temperature`.")(fn)


def _with_temperature(sampler, temperature: float | None):
    """``--temp`` on top of ``--sampler``, mapped as the server maps `temperature`."""
    if temperature is None:
        return sampler
    try:
        return spec_from_options(sampler, temperature=temperature)
    except SpecError as exc:
        fail(f"--temp: {exc}")


@main.command()
@click.argument("model", required=False)
@click.option("--prompt", default=None, help="Prompt text (default: read stdin).")
@click.option("--sampler", default="adaptive", callback=_spec, show_default=True,
              help=f"Sampler spec: {valid_specs()}")
@temp_option
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=128,
              show_default=True)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the figures.")
@model_options
@user_errors
@configured
def generate(model, prompt, sampler, temperature, max_tokens, chat, stop, as_json, seed,
             **options):
    """Generate a continuation (or, with --chat, a reply) of a prompt, with MODEL (default:
    the bundled SmolLM2-135M-Instruct)."""
    sampler = _with_temperature(sampler, temperature)
    if prompt is None:
        # Bytes that are not UTF-8 become U+FFFD rather than a codec error.
        prompt = sys.stdin.buffer.read().decode("utf-8", "replace")
    engine = EngineOptions.of(options).load(model, seed=seed, sampler=sampler)
    stream = engine.stream(engine.prompt_tokens(prompt, chat=chat), sampler=sampler,
                           max_tokens=max_tokens, stop=list(stop))
    try:
        for piece in stream:  # a reasoning model's thinking on stderr, the answer on stdout
            if not as_json:
                click.echo(piece, nl=False, err=isinstance(piece, Thought))
    except KeyboardInterrupt:
        pass
    if as_json:
        placed = {"layers": engine.layers} if engine.rpc or engine.n_gpu_layers else {}
        click.echo(json.dumps({**stream.result.as_dict(), **placed}))
    else:
        click.echo()


@main.command()
@click.argument("model", required=False)
@click.option("--sampler", default="adaptive", callback=_spec, show_default=True,
              help="Sampler spec (see generate --help).")
@temp_option
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=256,
              show_default=True)
@click.option("--resume", "resume", is_flag=False, flag_value="", default=None,
              metavar="[NAME|FILE]", help="Continue the newest saved chat, the one named "
              "(/chats lists them), or a chat file (/save's, or the chat page's Export), "
              "kept from then on as a new saved chat.")
@click.option("--no-save", is_flag=True, help="Do not keep this chat in the saved chats.")
@click.option("--markdown/--no-markdown", default=None,
              help="Render markdown in replies (default: on a terminal; /set markdown).")
@click.option("--wordwrap/--no-wordwrap", default=None,
              help="Wrap replies at word boundaries (default: on a terminal; /set wordwrap).")
@model_options
@user_errors
@configured
def run(model, sampler, temperature, system, max_tokens, resume, no_save, markdown, wordwrap,
        seed, **options):
    """Chat with MODEL (default: the bundled SmolLM2-135M-Instruct). /help inside.

    Each chat is saved as it goes, in $XDG_STATE_HOME/adaptive-llama/chats (a reply cut off
    by a crash or Ctrl-C keeps what was shown); --resume continues one."""
    from .chat.repl import Repl, check_saved_chat
    from .chat.saved import ChatStore

    sampler = _with_temperature(sampler, temperature)
    store = None if no_save else ChatStore()
    if resume is not None:
        source, resume, saved = _saved_chat(store, resume)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    # The seed is the chat's (`/set seed` changes it), not the engine's.
    engine = EngineOptions.of(options).load(model, show_progress=interactive, sampler=sampler)
    if not engine.has_chat_template:
        fail(f"{engine.name} is a base model (no chat template in its GGUF), so it cannot "
             f"chat; continue text with it instead (adaptive-llama generate {model} "
             "--prompt TEXT), or give it a template (--chat-template)")
    ctx = click.get_current_context()
    repl = Repl(engine, sampler=sampler, system=system, max_tokens=max_tokens, seed=seed,
                interactive=interactive, sources=ctx.meta["sources"], store=store,
                chat_name=resume, markdown=markdown, wordwrap=wordwrap)
    if engine.rpc:
        from .llama.rpc import on_abort

        on_abort(repl.on_worker_lost)
    if resume is not None:
        try:
            repl.restore(check_saved_chat(saved, repl.chat))
        except (ValueError, RecursionError) as exc:
            fail(f"the saved chat {source!r} cannot be continued: {exc}")
        given = {key: value for key, value in (("sampler", sampler), ("system", system),
                                               ("max_tokens", max_tokens), ("seed", seed))
                 if ctx.get_parameter_source(key) in GIVEN
                 or (key == "sampler" and temperature is not None)}
        repl.take_settings(given, f"saved chat {source}")
        _continue(repl, store, resume)
        repl.autosave()  # a chat file's chat is in the saved chats from now on
    repl.loop()


def _saved_chat(store, resume: str) -> tuple[str, str, dict]:
    """What --resume names (the newest chat for ""), the saved chat it continues into (a
    chat file's is kept as a new one) and the data read; one line and exit 2 otherwise."""
    from .chat.saved import read_text_file

    if store is None:
        fail("--resume continues a saved chat, which --no-save turns off")
    resume = resume or store.latest()
    if resume is None:
        fail(f"there is no saved chat to resume yet (in {store.folder})")
    source = resume  # what the user named: a saved chat, or a chat file
    try:
        if _is_chat_file(resume):
            data = json.loads(read_text_file(Path(resume)))
            return source, store.new_name(), data
        return source, resume, store.load(resume)
    except FileNotFoundError:
        if _is_chat_file(source):
            fail(f"there is no chat file {source!r}")
        known = ", ".join(store.names()[:5]) or "none"
        fail(f"there is no saved chat {resume!r} in {store.folder} (newest: {known})")
    except (OSError, ValueError, RecursionError) as exc:
        fail(f"cannot read the saved chat {source!r} ({exc}); /chats lists the others")


def _is_chat_file(argument: str) -> bool:
    """Whether --resume names a file (a path, or a .json name) rather than a saved chat."""
    return os.sep in argument or argument.endswith(".json")


def _continue(repl, store, name: str) -> None:
    """Save into chat ``name`` from now on, or into a copy when another REPL holds it."""
    try:
        held = store.claim(name)
    except OSError as exc:
        repl.note(f"continuing {name} unsaved: {store.folder} cannot be written "
                  f"({exc.strerror or exc})")
        repl.store = None
        return
    if held:
        repl.note(f"continuing {name}: {len(repl.chat.messages)} messages")
        repl.recap()
        return
    repl.new_saved_chat()
    repl.note(f"{name} is open in another REPL; continuing its {len(repl.chat.messages)} "
              f"messages in a copy, {repl.chat_name}")
    repl.recap()


@main.command("eval")
@click.argument("model", required=False)
@click.option("--tasks", default="wiki,stories,ablation,latency,gsm8k", show_default=True,
              help="Comma-separated: wiki, stories, ablation, penalties, latency, gsm8k.")
@click.option("--methods", default=None,
              help=f"Comma-separated subset of {', '.join(GRIDS)} (default: all).")
@click.option("--temperatures", default=None,
              help="Comma-separated temperatures (e.g. 0.7,1.0,1.5,2.0) at which "
                   f"{', '.join(TEMPERATURE_METHODS)} run again at their tuned values.")
@click.option("--batch", type=click.IntRange(1, 64), default=16, show_default=True,
              help="Texts generated together (one decode step each); models of 1B and more "
                   "gain from 32 on a CPU.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help='JSONL of {"prefix": ..., "reference": ...} in place of wiki and stories.')
@click.option("--n-dev", type=click.IntRange(min=1), default=None, help="Dev prefixes (sweep).")
@click.option("--n-test", type=click.IntRange(min=1), default=None, help="Test prefixes.")
@click.option("--samples", type=click.IntRange(min=1), default=None,
              help="Samples per prefix (the paper: 5).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per continuation (the paper: 256).")
@click.option("--gsm8k-n", type=click.IntRange(min=1), default=None, help="GSM8K problems.")
@click.option("--gsm8k-max-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per GSM8K answer (default 160; --full 512). A chain of thought cut "
                   "short scores as wrong, so give a larger model room.")
@click.option("--gsm8k-sampler", "gsm8k_samplers", multiple=True, metavar="SPEC",
              help="A sampler GSM8K runs besides greedy and top-p, min-p and adaptive at T = "
                   "0.7, 1 and 1.5 (repeatable; e.g. adaptive:eps=0.005,temp=1.5).")
@click.option("--full", is_flag=True,
              help="The paper's sizes (1,000 test prefixes x 5 samples of 256 tokens, 200 dev; "
                   "many hours on a CPU) instead of 200 test and 64 dev texts of 64 tokens; "
                   "explicit sizes still win.")
@click.option("--out", default="benchmarks/results", show_default=True,
              help="Folder for generations.jsonl (resume cache) and the reports.")
@click.option("--seed", type=click.IntRange(int(SEED.low), int(SEED.high)), default=0,
              show_default=True)
@click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
              help="CPU threads (default: the physical cores, adapted to the load).")
@click.option("--n-gpu-layers", type=click.IntRange(min=-1), default=0, show_default=True,
              help="Layers to offload to the GPU (CUDA build; -1: all). Each sequence is "
                   "still sampled on the CPU: see benchmarks/eval_workers.py for a GPU machine.")
@click.option("--rpc", default=None, metavar="HOST:PORT[,...]", callback=_rpc,
              help="llama.cpp RPC workers that hold the model's layers (docs/distributed.md).")
@user_errors
def evaluate(model, tasks, methods, temperatures, batch, prompts_file, n_dev, n_test, samples,
             max_tokens, gsm8k_n, gsm8k_max_tokens, gsm8k_samplers, full, out, seed, threads,
             n_gpu_layers, rpc):
    """Score every sampler as the paper does: rep-n, diversity, MAUVE, coherence, k, GSM8K."""
    from .eval.data import load_prompts_file
    from .eval.run import EvalConfig, Evaluator, require_extras

    require_extras()
    _writable_folder(out, "--out")
    if prompts_file:
        load_prompts_file(prompts_file)  # a malformed line stops us before the model loads
    sizes = {k: v for k, v in dict(n_dev=n_dev, n_test=n_test, samples=samples,
                                    max_tokens=max_tokens, gsm8k_n=gsm8k_n,
                                    gsm8k_max_tokens=gsm8k_max_tokens).items()
             if v is not None}
    if methods is not None:
        sizes["methods"] = _listed(methods, "--methods")
    if temperatures is not None:
        try:
            sizes["temperatures"] = tuple(float(t) for t in _listed(temperatures,
                                                                    "--temperatures"))
        except ValueError:
            fail(f"--temperatures: {temperatures!r} is not a list of numbers like 0.7,1.0,1.5")
    make = EvalConfig.paper_sizes if full else EvalConfig
    config = make(model=model, tasks=_listed(tasks, "--tasks"), batch=batch,
                  gsm8k_samplers=gsm8k_samplers,
                  prompts_file=prompts_file, out=out, seed=seed, n_threads=threads,
                  n_gpu_layers=n_gpu_layers, rpc=tuple(rpc or ()),
                  command=" ".join(["adaptive-llama eval", *sys.argv[2:]]), **sizes)
    evaluator = Evaluator(config)
    try:
        evaluator.run()
    except KeyboardInterrupt:
        fail(f"interrupted; every finished generation is in {evaluator.cache.path} and "
             "the same command resumes from there")
    finally:
        evaluator.close()


def _writable_folder(folder: str, option: str) -> None:
    """Make ``folder`` if needed, or a one-line exit saying why it cannot hold files."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        fail(f"{option}: {folder} is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"{option}: {folder} cannot be created ({exc.strerror})")
    if not os.access(path, os.W_OK | os.X_OK):
        fail(f"{option}: {folder} is not writable; give another folder")


def _listed(text: str, option: str) -> tuple[str, ...]:
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    if not items:
        fail(f"{option}: give at least one, comma-separated")
    return items


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _free_port(host: str, port: int) -> int:
    """``port``, or for 0 the free port the system picks, checked before the model loads."""
    try:
        with socket.create_server((host, port)) as sock:
            return sock.getsockname()[1]
    except OSError as exc:
        fail(f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port")


@main.command()
@click.argument("models", nargs=-1, metavar="[MODEL]...")
@click.option("--model", "-m", "more_models", multiple=True, metavar="[NAME=]MODEL",
              help="A model to serve, as a bundled name or a GGUF path; NAME= sets the name "
                   "clients ask for (default: the bundled name or the file's stem); "
                   "repeatable. Default: every model in config.toml, else smollm2.")
@click.option("--max-loaded", type=click.IntRange(min=1), default=3, show_default=True,
              help="Models loaded at once (ollama's default); loading one more unloads the "
                   "least recently used idle one.")
@click.option("--keep-alive", default="5m", show_default=True, metavar="DURATION",
              callback=lambda ctx, param, value: _keep_alive(value),
              help="How long an idle model stays loaded (\"30s\", \"1h\", seconds; -1: for "
                   "ever); a request's keep_alive overrides it.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; other than loopback needs --allow-remote.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--allow-remote", is_flag=True,
              help="Allow a non-loopback --host: anyone who reaches it can use the model.")
@click.option("--api-key", envvar="ADAPTIVE_LLAMA_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every request "
                   "(or set ADAPTIVE_LLAMA_API_KEY).")
@click.option("--allow-origin", "allow_origins", multiple=True, metavar="ORIGIN",
              help="A web page (e.g. https://chat.example.com, or * for any) that may call "
                   "the server besides loopback pages; repeatable.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="A host name the server answers besides localhost, 127.0.0.1 and [::1] "
                   "(on a loopback --host); repeatable.")
@click.option("--sampler", default="adaptive", callback=_spec, show_default=True,
              help="Default sampler spec; a request's body field `sampler` overrides it.")
@click.option("--max-queue", type=click.IntRange(min=0), default=8, show_default=True,
              help="Requests that may wait for the model; one more gets 503.")
@click.option("--max-body", type=click.IntRange(min=1024), default=2 * 2**20,
              show_default=True, help="Largest request body in bytes; a larger one gets 413.")
@click.option("--read-timeout", type=click.FloatRange(min=0.1, max=3600), default=30,
              show_default=True, metavar="SECONDS",
              help="Time a client has to send each whole request (headers and body); a "
                   "slower connection is closed.")
@click.option("--parallel", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Requests decoded together (slots); the KV cache holds parallel x --ctx "
                   "tokens.")
@click.option("--embedding-model", default=None, metavar="MODEL",
              help="A GGUF (or bundled name) for /v1/embeddings and /api/embed; default: "
                   "the served model, mean-pooled.")
@model_options
@user_errors
def serve(**options):
    """Serve one or several models over the OpenAI and Ollama APIs (/v1/chat/completions,
    /api/chat, ...) and a chat page at http://HOST:PORT/; the first model loads now, the
    others on their first request."""
    _serve(open_page=False, **options)


@main.command("web", params=list(serve.params))
@user_errors
def web(**options):
    """Serve as `serve` does (the same options), and open the chat page in the default web
    browser once the model has loaded."""
    _serve(open_page=True, **options)


def _serve(models, more_models, max_loaded, keep_alive, host, port, allow_remote, api_key,
           allow_origins, allow_hosts, sampler, max_queue, max_body, read_timeout, parallel,
           embedding_model, seed, open_page: bool, **options):
    try:
        import uvicorn

        from .server import create_app
        from .server.guard import check_api_key
        from .server.pool import ModelPool
        from .server.protocol import with_read_timeout
    except ImportError as exc:
        fail(f"`serve` needs the server extra ({exc.name} is missing): "
             "pip install 'adaptive-llama[server]'")
    if api_key is None and "ADAPTIVE_LLAMA_API_KEY" in os.environ:  # click skips an empty one
        api_key = os.environ["ADAPTIVE_LLAMA_API_KEY"]
    try:
        check_api_key(api_key)
    except ValueError as exc:
        fail(f"--api-key: {exc}")
    if not _is_loopback(host):
        if not allow_remote:
            fail(f"--host {host} is reachable from other machines; add --allow-remote "
                 "to mean it (and consider --api-key)")
        click.echo(f"Warning: serving on {host}, reachable from other machines"
                   f"{'' if api_key else ' with no --api-key'}.", err=True)
    port = _free_port(host, port)
    options = dict(options, sampler=sampler)
    served = [_served(argument, options, parallel=parallel, seed=seed)
              for argument in (*models, *more_models) or _configured_models()]
    _warn_misspelt_tables()
    pool = ModelPool(served, max_loaded=max_loaded, keep_alive=keep_alive,
                     max_queue=max_queue)
    first = pool.load_now(pool.default)
    embedder = None
    if embedding_model is not None:
        from .runtime.embeddings import Embedder

        embedder = Embedder.open(resolve_model(embedding_model), first.engine.threads)
    # On a public address the server cannot know the names it is reached by: any Host.
    app = create_app(pool, api_key=api_key, max_body=max_body, allow_origins=allow_origins,
                     allow_hosts=allow_hosts if _is_loopback(host) else None,
                     embedder=embedder)
    others = f" (and {', '.join(m.name for m in served[1:])} on demand)" if served[1:] else ""
    page = f"http://{_url_host(host)}:{port}/"
    click.echo(f"Serving {first.name}{others} at {page}v1 (default sampler "
               f"{first.sampler}, {parallel} slots of {first.engine.n_ctx} tokens, "
               f"{first.engine.threads} threads); the chat page is {page}; Ctrl-C stops.",
               err=True)
    _log_requests()
    if open_page:
        _open_when_listening(host, port, page)
    uvicorn.run(app, host=host, port=port, http=with_read_timeout(read_timeout),
                log_level="info" if options["verbose"] else "warning")


def _url_host(host: str) -> str:
    """The host as a URL names it: 127.0.0.1 for any address (0.0.0.0, ::), brackets for
    IPv6."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _open_when_listening(host: str, port: int, page: str) -> None:
    """Open ``page`` in the default browser once the server accepts connections (a thread:
    uvicorn takes this one); where no browser can be started, say where the page is."""
    import threading
    import time
    import webbrowser

    def open_page():
        address = _url_host(host).strip("[]")  # where the page's address reaches the server
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection((address, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        if not webbrowser.open(page):
            click.echo(f"No web browser could be started here: open {page} in one.", err=True)

    threading.Thread(target=open_page, name="open-page", daemon=True).start()


@main.command("rpc-worker")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; other than loopback needs --allow-remote.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
              help="CPU threads of a CPU device (default: the physical cores available).")
@click.option("--device", default=None, metavar="NAME[,NAME...]",
              help="The devices to serve: cpu, cuda0, ... (default: this machine's GPUs, "
                   "else its CPU).")
@click.option("--cache", "cache_dir", default=None, metavar="DIR",
              help="Keep the large tensors hosts send in DIR, so that loading the same model "
                   "again sends only their hashes.")
@click.option("--allow-remote", is_flag=True,
              help="Allow a non-loopback --host. The RPC protocol has no authentication: "
                   "anyone who reaches the port can run work on this machine.")
@click.option("--supervised", is_flag=True, hidden=True,
              help="Run llama.cpp's RPC server itself (the worker's child process).")
@user_errors
def rpc_worker(host, port, threads, device, cache_dir, allow_remote, supervised):
    """Hold layers of a model for a host on another machine (llama.cpp's RPC server); the
    host names it with --rpc HOST:PORT. Serves one host at a time."""
    from .endpoints import is_loopback
    from .llama import rpc

    rpc.check_available()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        fail(f"--host {host}: there is no such host name here")
    if supervised:
        _rpc_server(address, port, threads, device, cache_dir)
    if not is_loopback(address):
        if not allow_remote:
            fail(f"--host {host} is reachable from other machines, and llama.cpp's RPC "
                 "protocol has no authentication: anyone who reaches the port can run work "
                 "here and read what it holds. Add --allow-remote on a trusted network only")
        click.echo(f"Warning: listening on {address}:{port} with no authentication; keep the "
                   "port closed to all but the host (a firewall, or a private network).",
                   err=True)
    rpc.check_bindable(address, port)
    devices = rpc.worker_devices(device)
    if cache_dir is not None:
        _writable_folder(cache_dir, "--cache")
    # Ctrl-C (and kill -INT) has to stop the worker even when it was started with SIGINT
    # ignored or blocked, as a background job of a script inherits it (Python keeps both).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    supervisor = _supervisor(address, port, threads, device, cache_dir)
    reach = f"{'THIS-MACHINE' if address == '0.0.0.0' else address}:{port}"
    click.echo(f"RPC worker on {address}:{port} serving {rpc.describe(devices)}; the host "
               f"runs with --rpc {reach}. Ctrl-C stops.", err=True)
    try:
        supervisor.serve_forever()
    except KeyboardInterrupt:
        supervisor.stop()
        click.echo("RPC worker stopped.", err=True)


def _supervisor(address: str, port: int, threads: int | None, device: str | None,
                cache_dir: str | None):
    """ggml's RPC server in a child process behind ``address:port``, started (see
    adaptive_llama.llama.rpc_supervisor)."""
    from .llama.rpc_supervisor import Supervisor

    def child(inner_port: int) -> list[str]:
        options = [f"--threads={threads}"] if threads else []
        options += [f"--device={device}"] if device else []
        options += [f"--cache={cache_dir}"] if cache_dir else []
        return [sys.executable, "-m", "adaptive_llama.cli", "rpc-worker", "--supervised",
                "--host", "127.0.0.1", "--port", str(inner_port), *options]

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, port))
    listener.listen(16)
    supervisor = Supervisor(listener, child, lambda line: click.echo(line, err=True))
    try:
        supervisor.start()
    except RuntimeError as exc:
        fail(str(exc))
    return supervisor


def _rpc_server(address: str, port: int, threads: int | None, device: str | None,
                cache_dir: str | None) -> None:
    """The supervised child: ggml's RPC server on ``address:port`` until it stops or the
    worker that started it ends."""
    from .llama import rpc
    from .llama.rpc_supervisor import end_with_stdin
    from .runtime.threads import default_threads

    end_with_stdin()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    _batch_invariant_worker()
    thread = rpc.serve_worker(address, port, threads or default_threads(),
                              rpc.worker_devices(device), cache_dir)
    thread.join()
    fail(f"llama.cpp's RPC server on {address}:{port} stopped")


def _batch_invariant_worker() -> None:
    """The worker's CPU backends compute attention as the host's engine does (see
    adaptive_llama.llama.cpu_attention), so that a reply is the same text with workers as
    on one machine; where that cannot be set, one warning says what it costs."""
    from .llama import cpu_attention

    try:
        cpu_attention.worker_attention()
    except cpu_attention.Unavailable as exc:
        click.echo(f"Warning: this worker's attention may compute a row otherwise in another "
                   f"batch ({exc}): the same seed can give another reply than on one "
                   "machine.", err=True)


def _keep_alive(value: str) -> float:
    from .server.pool import keep_alive_s

    try:
        return keep_alive_s(value)
    except ValueError as exc:
        fail(f"--keep-alive {exc}")


def _configured_models() -> list[str]:
    """The models config.toml has tables for that serve can find (bundled names and
    paths), each once, else the default bundled model; a note for each table naming no
    file."""
    found = {}
    for name in config.model_tables():
        try:
            path = resolve_model(name).resolve()
        except ModelError as exc:
            click.echo(f"Note: not serving [models.{name}]: {exc}", err=True)
            continue
        found.setdefault(path, name)  # two tables for one file: one model, the first's
    return list(found.values()) or [None]


def _served(argument: str | None, options: dict, *, parallel: int, seed: int | None):
    """One model to serve: its name, its file, its settings (the command line's, else its
    config.toml table's), and how to load it."""
    from .server.pool import ServedModel, served_name, split_named

    name, model = split_named(argument) if argument else (None, None)
    path = resolve_model(model)
    settings, _ = _settings(model, options)
    template = template_source(settings["chat_template"])  # read once, at the start
    engine_options = EngineOptions.of(settings)

    def load():
        return engine_options.load(path, seed=seed, parallel=parallel,
                                   sampler=settings["sampler"], template=template)

    return ServedModel(name or served_name(model or "", path), path, load, settings["sampler"],
                       template)


def _log_requests() -> None:
    """The server's own log on stderr from INFO on: one line per request as it ends, and
    the connections and bodies it gave up on (uvicorn's access log stays off)."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    server_log = logging.getLogger("adaptive_llama.server")
    server_log.addHandler(handler)
    server_log.setLevel(logging.INFO)
    server_log.propagate = False


if __name__ == "__main__":
    main()

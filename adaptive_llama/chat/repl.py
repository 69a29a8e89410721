"""The chat REPL behind ``adaptive-llama run``.

On a terminal: prompt_toolkit line editing, history kept across sessions, tab completion of
slash commands, colour. Piped (stdin not a terminal): plain lines in, plain text out, the same
commands, so ``printf 'Hi\\n/bye\\n' | adaptive-llama run`` is scriptable.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import shutil
import signal
import sys
from pathlib import Path

from .. import kernel
from ..runtime.engine import ContextOverflow, Engine, GenerationResult
from ..runtime.reasoning import Thought
from ..runtime.request import check_budget
from ..samplers import (
    INT32_MAX,
    SAMPLERS,
    SEED,
    Param,
    SamplerSpec,
    SpecError,
    hot_epsilon_note,
    parse_spec,
    spec_from_options,
    table,
)
from .conversation import Chat
from .markdown import MarkdownStream
from .saved import ChatStore, read_text_file, state_folder, write_user_file

COMMANDS = {
    "/help": "this list; /help samplers: every sampler and its parameters",
    "/set": "/set eps|temp|max-tokens VALUE, /set seed N|random, /set sampler SPEC, "
            "/set system [TEXT], /set verbose|markdown|wordwrap on|off, a reasoning "
            "model's /set think show|hide|off and /set reasoning-budget N; ollama's and "
            "llama.cpp's too: "
            "/set [parameter] temperature|top_k|top_p|min_p|repeat_penalty|num_predict VALUE",
    "/show": "model, sampler, parameters, context used",
    "/clear": "forget the conversation",
    "/undo": "drop the last exchange",
    "/regen": "answer the last message again",
    "/save": "/save FILE: conversation and settings as JSON",
    "/chats": "the saved chats (run --resume [NAME] continues one)",
    "/load": "/load FILE: restore a /save",
    "/stats": "figures of the last reply",
    "/trace": "/trace on|top|off: colour each token by its candidate-set size k (top: and "
              "show the model's most likely alternatives)",
    "/compare": "/compare SPEC: the last reply again, same seed, another sampler",
    "/bye": "quit (also Ctrl-D)",
}
SET_KEYS = ("eps", "temp", "seed", "max-tokens", "sampler", "system", "verbose", "markdown",
            "wordwrap", "think", "reasoning-budget")
THINK_VALUES = ("show", "hide", "off")  # /set think: the thinking shown, hidden, or none
# on|off switches of how replies show: the footer, markdown rendering, wrapping at words
DISPLAY_SWITCHES = ("verbose", "markdown", "wordwrap")
# ollama's `/set parameter NAME VALUE` names (llama.cpp's too) -> ours
SET_ALIASES = {"temperature": "temp", "num_predict": "max-tokens", "max_tokens": "max-tokens",
               "n_predict": "max-tokens", "epsilon": "eps"}
# Options that choose or modify the sampler as the server's fields do (spec_from_options).
SET_OPTIONS = {"top_k": int, "top_p": float, "min_p": float, "repeat_penalty": float,
               "repeat_last_n": int, "presence_penalty": float, "frequency_penalty": float}
_NAMES_TEMP = re.compile(r"[:,]\s*temp\s*=")  # a spec text that sets its own temperature
MULTILINE = '"""'
RECAP_CHARS = 400  # of each message of the last exchange, shown on --resume


def k_colour(k: int) -> str:
    """ANSI colour for a candidate-set size: blue = sure (k=1) ... red = hesitant (k>20)."""
    if k <= 1:
        return "\033[34m"
    if k <= 5:
        return "\033[32m"
    if k <= 20:
        return "\033[33m"
    return "\033[31m"


RESET = "\033[0m"


class Repl:
    def __init__(self, engine: Engine, sampler="adaptive", system=None, max_tokens=256,
                 seed=None, interactive=False, out=None, read_line=None, sources=None,
                 store: ChatStore | None = None, chat_name: str | None = None,
                 markdown: bool | None = None, wordwrap: bool | None = None):
        self.engine = engine
        # every message and command is saved as it happens (None: nothing is kept)
        self.store = store
        self.chat_name = chat_name
        # where sampler, system, ctx, threads... came from (command line, config.toml, /set)
        self.sources = dict(sources or {})
        self.chat = Chat(engine, system=system, sampler=sampler, max_tokens=max_tokens,
                         seed=seed)
        self.interactive = interactive
        self.out = out or sys.stdout
        self.read_line = read_line or (self._terminal_reader() if interactive else _plain_reader)
        self.trace = "off"  # "on": each token's k; "top": and its likeliest alternatives
        self.verbose = interactive  # a footer after each reply (/set verbose)
        self.show_thinking = True  # a reasoning model's thinking, dim (/set think)
        # by default on a terminal only: piped, a reply comes out exactly as the model wrote it
        self.markdown = interactive if markdown is None else markdown
        self.wordwrap = interactive if wordwrap is None else wordwrap
        self.temp_set: float | None = None  # a /set temp that a new /set sampler keeps
        self.before_greedy: SamplerSpec | None = None  # what temperature 0 replaced
        self.interrupt_pending = False  # a Ctrl-C came with the Enter of the line just read
        self.last: GenerationResult | None = None  # the last reply, while it is the last message
        self.warned_dropped = 0
        if chat_name is None:
            self.new_saved_chat()

    def new_saved_chat(self) -> None:
        """From now on, save into a new chat (its lock held); the one before stays as it is.
        A folder that cannot be written: the chat goes on unsaved, with one note."""
        if self.store is None:
            return
        try:
            name = self.store.new_name()
            self.store.claim(name)
        except OSError as exc:
            self.note(f"chats cannot be saved in {self.store.folder} "
                      f"({exc.strerror or exc}); this one is not kept")
            self.store, self.chat_name = None, None
            return
        self.chat_name = name

    # ---- output ----

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def note(self, text: str) -> None:
        """A message from the tool (dim on a terminal)."""
        self.say(f"\033[2m{text}{RESET}" if self.interactive else text)

    # ---- input ----

    def _terminal_reader(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.completion import WordCompleter
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
        from prompt_toolkit.keys import Keys

        words = [*COMMANDS, *SET_KEYS, *SET_ALIASES, *SET_OPTIONS, *SAMPLERS, "parameter",
                 "on", "off", "top", "samplers", "random"]
        path = state_folder() / "history"
        try:  # a history that cannot be written would fail on every Enter
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            if not os.access(path, os.W_OK):
                raise PermissionError(13, "not writable")
            history = FileHistory(str(path))
        except OSError as exc:
            self.note(f"line history is off: {path} cannot be written "
                      f"({exc.strerror or exc})")
            history = InMemoryHistory()
        session = PromptSession(history=history, completer=WordCompleter(words, sentence=True))

        def read(prompt: str) -> str | None:
            try:
                line = session.prompt(prompt)
            except EOFError:
                return None
            # A Ctrl-C pressed right after Enter can reach prompt_toolkit in the same read
            # as the Enter (the terminal is still raw): it is kept as type-ahead for the
            # next prompt instead of stopping the reply. Take it out and honour it.
            keys = get_typeahead(session.input)
            if any(k.key == Keys.ControlC for k in keys):
                self.interrupt_pending = True
                keys = [k for k in keys if k.key != Keys.ControlC]
            store_typeahead(session.input, keys)
            return line

        return read

    def read_message(self) -> tuple[str, bool] | None:
        """(text, whether it came as a \"\"\" block): one line, or a block over several
        lines, which is always text, never a command. None at end of input."""
        line = self.read_line(">>> " if self.interactive else "")
        if line is None:
            return None
        if not line.strip().startswith(MULTILINE):
            return line, False
        lines = [line.strip()[len(MULTILINE):]]
        while not lines[-1].rstrip().endswith(MULTILINE):
            if self.interrupt_pending:  # came with the Enter of a line inside the block:
                self.interrupt_pending = False  # drop the block, as Ctrl-C does at a prompt
                raise KeyboardInterrupt
            more = self.read_line("... " if self.interactive else "")
            if more is None:
                break
            lines.append(more)
        text = "\n".join(lines)
        return text.rstrip().removesuffix(MULTILINE).strip("\n"), True

    # ---- the loop ----

    def loop(self) -> None:
        if self.interactive:
            # Ctrl-C has to stop a reply even when we were started with SIGINT ignored (a
            # background job of a non-interactive shell inherits SIG_IGN, and Python keeps it).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.note(f"{self.engine.name}, sampler {self.chat.sampler}. /help for commands, "
                      "Ctrl-D or /bye to quit.")
        self._note_hot_epsilon()
        while True:
            try:
                message = self.read_message()
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, not an exit
                continue
            if message is None:
                return
            text, block = message
            if not text.strip():
                continue
            try:
                if text.strip().startswith("/") and not block:
                    if self.command(text.strip()) == "quit":
                        return
                else:
                    self.reply(lambda: self.chat.send(text, **self._reply_options()))
            except KeyboardInterrupt:  # in a command (a reply catches its own)
                self.note("[interrupted]")
            finally:  # a Ctrl-C that came with this line stops its reply or nothing later
                self.interrupt_pending = False
            self.autosave()

    def reply(self, start) -> None:
        try:
            stream = start()
        except ContextOverflow as exc:
            self.note(str(exc))
            return
        except KeyboardInterrupt:  # before the first token
            self.note("[interrupted]")
            return
        if self.autosave():  # the message, before its reply; then the reply as it shows
            self.store.begin_reply(self.chat_name)
        self.last = self.show_stream(stream, keep=self.store.piece if self.store else None)
        self.footer(self.last)
        if self.chat.dropped > self.warned_dropped and self.warned_dropped == 0:
            self.note("(the conversation outgrew the context window: the oldest messages "
                      "are being dropped from what the model sees; /save keeps them all)")
        self.warned_dropped = self.chat.dropped

    def show_stream(self, stream, keep=None) -> GenerationResult:
        """Print the reply as it comes (``keep`` gets each piece of the answer just before it
        shows): rendered and wrapped as /set markdown and wordwrap say, or each token marked
        with its k under /trace; a reasoning model's thinking dim before it."""
        render = self._renderer()
        thought = False
        try:
            if self.interrupt_pending:  # it came with the Enter: stop before the first token
                raise KeyboardInterrupt
            for piece in stream:
                if isinstance(piece, Thought):
                    if self.show_thinking:
                        self.say(f"\033[2m{piece}{RESET}" if self.interactive else piece,
                                 end="")
                        thought = True
                    continue
                if thought:  # the answer on a line of its own after the thinking
                    self.say()
                    thought = False
                if keep is not None:  # kept before it shows: nothing shown can be lost
                    keep(piece)
                if self.trace != "off":
                    piece = self._traced(stream, piece)
                self.say(render.feed(piece) if render else piece, end="")
        except KeyboardInterrupt:
            stream.cancel()
            self.say(render.finish() if render else "")
            self.note("[interrupted]")
        else:
            self.say(render.finish() if render else "")
        return stream.result

    def _renderer(self) -> MarkdownStream | None:
        if self.trace != "off" or not (self.markdown or self.wordwrap):
            return None  # a traced token keeps its colour and its [k] where it came
        width = shutil.get_terminal_size().columns if self.wordwrap else None
        return MarkdownStream(styles=self.markdown, width=width)

    def footer(self, result: GenerationResult) -> None:
        """How the reply went: a mark when it is empty or cut by max-tokens (always), and
        with /set verbose on, one dim line of figures."""
        if result.finish_reason == "interrupted":
            return
        if not result.text.strip():
            self.note("[empty reply: the model ended it at once; /regen tries again]")
        elif result.finish_reason == "length":
            self.note(f"[cut at max-tokens {self.chat.max_tokens}: /set max-tokens N for "
                      "longer replies]")
        if self.verbose:
            mean_k = f" · mean k {result.mean_k:.1f}" if result.mean_k is not None else ""
            drafts = f" · {result.drafts_kept}" if result.drafts_kept else ""
            phases = (f" ({result.reasoning_tokens} thinking, "
                      f"{result.completion_tokens - result.reasoning_tokens} answer)"
                      if result.thinks else "")
            self.note(f"{result.completion_tokens} tokens{phases} · "
                      f"{result.decode_tokens_per_s:.1f} tok/s{mean_k}{drafts} · "
                      f"seed {result.seed}")

    def _traced(self, stream, piece: str) -> str:
        """The piece marked with the k of its token: coloured, or piece[k] when piped; with
        /trace top, then {the likeliest tokens and their probabilities}."""
        k = stream.last_k
        marked = piece
        if k is not None:
            marked = f"{k_colour(k)}{piece}{RESET}" if self.interactive else f"{piece}[{k}]"
        entry = stream.last_logprob if self.trace == "top" else None
        if entry is None:
            return marked
        alternatives = ", ".join(f"{text.decode('utf-8', 'replace')!r} {math.exp(lp):.0%}"
                                 for _, text, lp in entry.top)
        if k is not None and self.interactive:  # piped, [k] is already there
            alternatives = f"k={k}: {alternatives}"
        return marked + (f"\033[2m{{{alternatives}}}{RESET}" if self.interactive
                         else f"{{{alternatives}}}")

    def _reply_options(self) -> dict:
        """What a reply needs for the current /trace: the alternatives of each token."""
        return {"logprobs": TRACE_ALTERNATIVES} if self.trace == "top" else {}

    # ---- commands ----

    def command(self, line: str):
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        handler = getattr(self, "cmd_" + name[1:].replace("-", "_"), None)
        if name not in COMMANDS or handler is None:
            near = difflib.get_close_matches(name, COMMANDS, n=1)
            hint = f" Did you mean {near[0]}?" if near else ""
            self.note(f"unknown command {name}.{hint} /help lists them.")
            return None
        return handler(arg)

    def cmd_help(self, arg):
        if arg == "samplers":
            self.say(table())
            return
        for name, text in COMMANDS.items():
            self.say(f"  {name:<10} {text}")
        self.say(f'  {MULTILINE:<10} start and end a message of several lines')

    def cmd_bye(self, arg):
        return "quit"

    def cmd_set(self, arg):
        key, _, value = arg.partition(" ")
        key, value = key.strip().lower(), value.strip()
        if key == "parameter":  # ollama's /set parameter NAME VALUE
            key, _, value = value.partition(" ")
            key, value = key.strip().lower(), value.strip()
        key = SET_ALIASES.get(key, key)
        if key not in (*SET_KEYS, *SET_OPTIONS) or not (value or key == "system"):
            self.note(f"usage: /set {'|'.join(SET_KEYS)} VALUE, or /set [parameter] "
                      f"temperature|{'|'.join(SET_OPTIONS)} VALUE")
            return
        chat = self.chat
        try:
            if key in DISPLAY_SWITCHES:
                setattr(self, key, _on_off(key, value))
                self.note(f"{key} {value.lower()}")
                return
            if key in ("think", "reasoning-budget"):
                self._set_thinking(key, value.lower())
                return
            if key == "system":
                chat.system = value or None
            elif key in ("sampler", "temp") or key in SET_OPTIONS:
                chat.sampler = self.engine.check_sampler(self._sampler_after(key, value))
            elif key == "eps":
                chat.sampler = chat.sampler.with_param("eps", value)
            elif key == "seed":
                chat.seed = None if value.lower() == "random" else SEED.validate(value)
            elif key == "max-tokens":
                chat.max_tokens = MAX_TOKENS.validate(value)
        except (SpecError, ValueError) as exc:
            self.note(f"{exc}; kept the old value")
            return
        self.sources[key if key in ("system", "seed", "max-tokens") else "sampler"] = "/set"
        self.note(f"{key} {'cleared' if key == 'system' and not value else 'set'}; sampler "
                  f"{chat.sampler}, seed {_seed_text(chat.seed)}, max-tokens "
                  f"{chat.max_tokens}")
        self._note_hot_epsilon()

    def _set_thinking(self, key: str, value: str) -> None:
        """/set think show|hide|off (off: a budget of 0) and /set reasoning-budget N
        (-1: no bound); ValueError for a value out of range."""
        if key == "think":
            if value not in THINK_VALUES:
                raise ValueError(f"/set think takes {', '.join(THINK_VALUES)}, not {value!r}")
            self.show_thinking = value == "show"
            if value == "off":
                self.chat.reasoning_budget = 0
            elif self.chat.reasoning_budget == 0:
                self.chat.reasoning_budget = None
        else:
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"/set reasoning-budget takes a number of tokens (-1: no "
                                 f"bound), not {value!r}") from None
            self.chat.reasoning_budget = check_budget("reasoning-budget", number)
        budget = self.chat.reasoning_budget
        self.note(f"thinking {'shown' if self.show_thinking else 'hidden'}, budget "
                  f"{'the engine default' if budget is None else budget if budget >= 0 else 'none'}"
                  f"{'' if self.engine.thinking else ' (this model does not think)'}")

    def _note_hot_epsilon(self) -> None:
        note = hot_epsilon_note(self.chat.sampler)
        if note:
            self.note(note)

    def _sampler_after(self, key: str, value: str) -> SamplerSpec:
        """The sampler after ``/set KEY VALUE``, as the server maps the same fields:
        temperature 0 is greedy (a later temperature above 0 brings back the sampler it
        replaced), top_k and the others choose or modify the sampler; a new sampler keeps
        an earlier /set temp unless its spec names a temperature."""
        current = self.chat.sampler
        if key == "sampler":
            spec = parse_spec(value)
            if (self.temp_set and spec.sampler.takes_temp
                    and not _NAMES_TEMP.search(value)):
                spec = spec.with_param("temp", self.temp_set)
            self.before_greedy = None
            return spec
        if key == "temp":
            if _is_zero(value):
                if current.name != "greedy":
                    self.before_greedy = current
                self.temp_set = None
                return spec_from_options(current, temperature=0)
            base = self.before_greedy if current.name == "greedy" and self.before_greedy \
                else current
            if not base.sampler.takes_temp:
                raise SpecError(f"{base.name} takes no temperature; /set sampler first")
            spec = base.with_param("temp", value)  # validated by the sampler table
            self.before_greedy, self.temp_set = None, spec.temp
            return spec
        try:
            option = SET_OPTIONS[key](value)
        except ValueError:
            raise SpecError(f"`{key}` has to be a number, but is {value!r}") from None
        return spec_from_options(current, **{key: option})

    def cmd_show(self, arg):
        chat = self.chat
        outside = f", {chat.dropped} outside the window" if chat.dropped else ""
        display = ", ".join(f"{key} {'on' if getattr(self, key) else 'off'}"
                            for key in DISPLAY_SWITCHES)
        self.say(f"model       {self.engine.path}\n"
                 f"sampler     {chat.sampler}\n"
                 f"backend     {_backend_text(self.engine)}\n"
                 f"seed        {_seed_text(chat.seed)}\n"
                 f"max-tokens  {chat.max_tokens}\n"
                 f"system      {chat.system or '(none)'}\n"
                 f"display     {display}\n"
                 f"threads     {self.engine.threads}"
                 f"{' (adapted to the load)' if self.engine.threads_adaptive else ''}\n"
                 f"context     {chat.context_used()} of {self.engine.n_ctx} tokens "
                 f"({len(chat.messages)} messages{outside})\n"
                 f"layers      {self.engine.placement()}\n"
                 f"drafts      {self.engine.draft or 'none'}\n"
                 f"thinking    {_thinking_text(self.engine)}")
        if self.sources:
            self.say("from        " + "; ".join(f"{key}: {source}"
                                                  for key, source in self.sources.items()))

    def on_worker_lost(self, line: str) -> None:
        """llama.cpp ends the process (an RPC worker lost): say how to go on. What was shown
        is already in the saved chat (show_stream keeps each piece before it shows)."""
        if self.store is not None and self.chat_name and self.chat.messages:
            self.note(f"the chat is saved as {self.chat_name}: `adaptive-llama run --resume "
                      f"{self.chat_name}` (with the same --rpc) continues it")

    def cmd_clear(self, arg):
        kept = self.chat_name if self.chat.messages else None
        self.chat.clear()
        self.last = None
        self.warned_dropped = 0
        self.new_saved_chat()
        self.note("conversation cleared" + (f"; it stays saved as {kept}" if kept and
                                            self.store else ""))

    def cmd_undo(self, arg):
        self.last = None
        self.note("last exchange dropped" if self.chat.undo() else "nothing to undo")

    def cmd_regen(self, arg):
        if len(self.chat.window) == 0:
            self.note("nothing to regenerate yet")
            return
        self.reply(lambda: self.chat.regenerate(**self._reply_options()))

    def cmd_stats(self, arg):
        if self.last is None:
            self.note("no reply yet")
            return
        self.say(format_stats(self.last.summary()))

    def cmd_trace(self, arg):
        if arg not in ("on", "top", "off"):
            self.note("usage: /trace on|top|off")
            return
        self.trace = arg
        if arg == "off":
            self.note("trace off")
            return
        if self.interactive:
            legend = "its colour: " + ", ".join(f"{k_colour(k)}{text}{RESET}"
                                                for k, text in TRACE_LEGEND)
        else:
            legend = "[k] after it (1: sure; more than 20: hesitant)"
        top = ("; then {k=K: the likeliest tokens and their probabilities}"
               if arg == "top" else "")
        self.note(f"trace {arg}: each token shows its candidate-set size k by {legend}{top}")

    def cmd_compare(self, arg):
        if not arg:
            self.note("usage: /compare SPEC, e.g. /compare top-p:p=0.9: your last message "
                      "answered again with the same seed by that sampler (/help samplers)")
            return
        window = self.chat.window
        if self.last is None or len(window) < 2 or window[-1]["role"] != "assistant":
            self.note("say something first: /compare answers your last message again")
            return
        try:
            other = self.engine.check_sampler(parse_spec(arg))
        except SpecError as exc:
            self.note(str(exc))
            return
        # The conversation before the last reply, answered by the other sampler with the
        # same seed; the probe is a throwaway Chat, so the conversation is unchanged.
        probe = Chat(self.engine, system=self.chat.system, sampler=other,
                     max_tokens=self.chat.max_tokens, seed=self.last.seed)
        probe.messages = [dict(m) for m in window[:-2]]
        self.say(f"--- {self.chat.sampler} ---\n{self.last.text}\n"
                 f"{format_stats(self.last.summary())}")
        self.say(f"--- {other} ---")
        try:
            stream = probe.send(window[-2]["content"])
        except ContextOverflow as exc:
            self.note(str(exc))
            return
        self.say(format_stats(self.show_stream(stream).summary()))

    def saved_data(self) -> dict:
        """The conversation and its settings, as /save writes them."""
        return {"version": 1, "model": str(self.engine.path), "sampler": str(self.chat.sampler),
                "seed": self.chat.seed, "max_tokens": self.chat.max_tokens,
                "system": self.chat.system, "messages": self.chat.messages}

    def autosave(self) -> bool:
        """Keep the chat in the store (once it has a message); False when nothing was saved."""
        if self.store is None or not (self.chat.messages or
                                      self.store.path(self.chat_name).exists()):
            return False
        try:
            self.store.save(self.chat_name, self.saved_data())
        except OSError as exc:
            self.note(f"could not save the chat in {self.store.folder}: "
                      f"{exc.strerror or exc}; it goes on unsaved")
            self.store = None
            return False
        return True

    def cmd_chats(self, arg):
        if self.store is None:
            self.note("chats are not being saved (run --no-save)")
            return
        names = self.store.names()
        for name in names[:20]:
            mark = "* " if name == self.chat_name else "  "
            self.say(mark + self.store.describe(name))
        self.note(f"{len(names)} saved in {self.store.folder}; "
                  "adaptive-llama run --resume NAME continues one")

    def cmd_save(self, arg):
        if not arg:
            self.note("usage: /save FILE")
            return
        data = self.saved_data()
        try:
            path = Path(arg).expanduser()
            written = write_user_file(path, json.dumps(data, indent=2, ensure_ascii=False))
        except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: ~nouser
            self.note(f"could not save to {arg}: {getattr(exc, 'strerror', None) or exc}; "
                      "nothing was lost")
            return
        self.note(f"saved {len(self.chat.messages)} messages to {written}")

    def cmd_load(self, arg):
        if not arg:
            self.note("usage: /load FILE")
            return
        try:
            path = Path(arg).expanduser()
            saved = read_saved_chat(path, self.chat)
        except (OSError, RuntimeError) as exc:  # RuntimeError: ~nouser
            self.note(f"could not read {arg}: {getattr(exc, 'strerror', None) or exc}; "
                      "the chat is unchanged")
            return
        except (ValueError, RecursionError) as exc:
            self.note(f"{arg} is not a saved chat ({exc}); the chat is unchanged")
            return
        self.restore(saved)
        self.new_saved_chat()  # the loaded chat is saved as a new one; the current one stays
        self.note(f"loaded {len(self.chat.messages)} messages; sampler {self.chat.sampler}, "
                  f"seed {_seed_text(self.chat.seed)}")

    def recap(self, limit: int = RECAP_CHARS) -> None:
        """The last exchange of a resumed chat, each message cut to ``limit`` characters."""
        last = self.chat.messages[-2:]
        for message in last:
            text = message["content"]
            text = text if len(text) <= limit else text[:limit].rstrip() + " ..."
            self.note(f"{'>>> ' if message['role'] == 'user' else ''}{visible(text)}")

    def take_settings(self, given: dict, restored_from: str) -> None:
        """After a restore: the values given on the command line win over the saved ones,
        and /show says where each came from."""
        chat = self.chat
        for key, value in given.items():
            setattr(chat, key, value)
        for key in ("sampler", "system", "max_tokens", "seed"):
            self.sources[key.replace("_", "-")] = ("command line" if key in given
                                                    else restored_from)

    def restore(self, saved: dict) -> None:
        """Take over a checked saved chat (:func:`check_saved_chat`): messages and settings."""
        chat = self.chat
        chat.clear()
        chat.messages, chat.sampler, chat.seed = saved["messages"], saved["sampler"], saved["seed"]
        chat.max_tokens, chat.system = saved["max_tokens"], saved["system"]
        self.last = None


TRACE_ALTERNATIVES = 3  # tokens /trace top shows beside each one


def _thinking_text(engine: Engine) -> str:
    """/show's line on a reasoning model's thinking."""
    if engine.thinking is None:
        return "none (not a reasoning model)"
    return (f"{engine.thinking.name}, shown dim before the answer"
            f"{'; its template can turn it off' if engine.can_turn_thinking_off() else ''}")
TRACE_LEGEND = ((1, "blue: k=1, sure"), (5, "green: 2-5"), (20, "yellow: 6-20"),
                (21, "red: more than 20, hesitant"))

MAX_TOKENS = Param("max-tokens", int, 256, "the longest reply, in tokens", low=1, high=INT32_MAX)


def read_saved_chat(path: Path, current: Chat) -> dict:
    """A /save file, every field checked (ValueError says which is wrong); fields it lacks
    keep the current chat's values."""
    return check_saved_chat(json.loads(read_text_file(path)), current)


def check_saved_chat(data, current: Chat) -> dict:
    """Saved chat data (a /save file's, or a saved chat's), as :func:`read_saved_chat`."""
    if not isinstance(data, dict):
        raise ValueError("it is not a JSON object")
    messages = data.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant")
            and isinstance(m.get("content"), str)
            and isinstance(m.get("interrupted", False), bool)
            and isinstance(m.get("reasoning", ""), str) for m in messages):
        raise ValueError("`messages` has to be a list of {role: user|assistant, content: text}")
    system = data.get("system", current.system)
    if system is not None and not isinstance(system, str):
        raise ValueError(f"`system` has to be text, but is {system!r}")
    for i, message in enumerate(messages):
        _check_text(message["content"], f"`messages[{i}].content`")
    if system is not None:
        _check_text(system, "`system`")
    sampler = data.get("sampler", str(current.sampler))
    seed = data.get("seed", current.seed)
    if isinstance(seed, bool) or isinstance(data.get("max_tokens"), bool):
        raise ValueError("`seed` and `max_tokens` have to be numbers")
    return {"messages": [dict(m) for m in messages], "system": system,
            "sampler": parse_spec(sampler),
            "seed": None if seed is None else SEED.validate(seed),
            "max_tokens": MAX_TOKENS.validate(data.get("max_tokens", current.max_tokens))}


def _check_text(text: str, field: str) -> None:
    """ValueError for text that cannot be written out: a lone surrogate (``"\\ud800"`` in
    JSON) is half of a character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} holds {text[exc.start]!r} at character {exc.start}, half of "
                         "a character (a lone surrogate), which is no text") from None


_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """``text`` with control characters written out (``\\x1b``): a saved chat is a file
    anyone may have written, and its escapes would clear the screen, retitle the window or
    set the clipboard."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _backend_text(engine) -> str:
    if engine.backend_sampling:
        return "graph (the whole chain inside llama.cpp's graph: backend sampling)"
    return f"{kernel.BACKEND} (adaptive and eta samplers)"


def _is_zero(value: str) -> bool:
    try:
        return float(value) == 0
    except ValueError:
        return False  # the sampler table's check says what is wrong with it


def _on_off(key: str, value: str) -> bool:
    if value.lower() not in ("on", "off"):
        raise ValueError(f"`{key}` has to be on or off, but is {value!r}")
    return value.lower() == "on"


def _seed_text(seed: int | None) -> str:
    return "random (a new one each reply)" if seed is None else str(seed)


def format_stats(summary: dict) -> str:
    """A reply's :meth:`GenerationResult.summary` as two lines of text."""
    if summary["completion_tokens"] == 0:
        return (f"an empty reply: the model ended it at once (finish: "
                f"{summary['finish_reason']}, seed {summary['seed']})")
    line = (f"{summary['completion_tokens']} tokens, {summary['decode_tokens_per_s']:.1f} "
            f"tokens/s, first token after {summary['time_to_first_token_s'] * 1000:.0f} ms, "
            f"finish: {summary['finish_reason']}, seed {summary['seed']}")
    if "mean_k" in summary:
        line += (f"\nk: mean {summary['mean_k']:.1f}, sd {summary['stdev_k']:.1f}, "
                 f"median {summary['median_k']}, max {summary['max_k']}")
        if summary["mean_conf"] is not None:
            line += f"; mean confidence {summary['mean_conf']:.3f}"
    if "drafter" in summary:
        line += (f"\ndrafts ({summary['drafter']}): {summary['draft_accepted']} of "
                 f"{summary['draft_tokens']} kept")
    return line


def _plain_reader(prompt: str) -> str | None:
    line = sys.stdin.buffer.readline().decode("utf-8", "replace")  # bad bytes: U+FFFD
    return None if line == "" else line.rstrip("\n")

"""The chat REPL behind ``adaptive-llama run``.

On a terminal: prompt_toolkit line editing, history kept across sessions, tab completion of
slash commands, colour. Piped (stdin not a terminal): plain lines in, plain text out, the same
commands, so ``printf 'Hi\\n/bye\\n' | adaptive-llama run`` is scriptable.
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from .engine import Chat, ContextOverflow, Engine
from .specs import SpecError, parse_spec

COMMANDS = {
    "/help": "this list",
    "/set": "/set eps|temp|seed|max-tokens VALUE, /set sampler SPEC, /set system TEXT",
    "/show": "model, sampler, parameters, context used",
    "/clear": "forget the conversation",
    "/undo": "drop the last exchange",
    "/regen": "answer the last message again",
    "/save": "/save FILE: conversation and settings as JSON",
    "/load": "/load FILE: restore a /save",
    "/stats": "figures of the last reply",
    "/trace": "/trace on|off: colour each token by its candidate-set size k",
    "/compare": "/compare SPEC: the last prompt again, same seed, another sampler",
    "/bye": "quit (also Ctrl-D)",
}
SET_KEYS = ("eps", "temp", "seed", "max-tokens", "sampler", "system")
MULTILINE = '"""'
HISTORY_FILE = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) \
    / "adaptive-llama" / "history"


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
                 seed=0, interactive=False, out=None, read_line=None):
        self.engine = engine
        self.chat = Chat(engine, system=system, sampler=sampler, max_tokens=max_tokens,
                         seed=seed)
        self.interactive = interactive
        self.out = out or sys.stdout
        self.read_line = read_line or (self._terminal_reader() if interactive else _plain_reader)
        self.trace = False
        self.last = None            # GenerationResult of the last reply
        self.last_prompt = None     # the user text of the last exchange
        self.warned_dropped = 0

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
        from prompt_toolkit.history import FileHistory

        HISTORY_FILE.parent.mkdir(parents=True, exist_ok=True)
        words = list(COMMANDS) + list(SET_KEYS) + ["on", "off"]
        session = PromptSession(history=FileHistory(str(HISTORY_FILE)),
                                completer=WordCompleter(words, sentence=True))

        def read(prompt: str) -> str | None:
            try:
                return session.prompt(prompt)
            except EOFError:
                return None

        return read

    def read_message(self) -> str | None:
        """One message: a line, or a \"\"\" block over several lines. None at end of input."""
        line = self.read_line(">>> " if self.interactive else "")
        if line is None:
            return None
        if not line.strip().startswith(MULTILINE):
            return line
        lines = [line.strip()[len(MULTILINE):]]
        while not lines[-1].rstrip().endswith(MULTILINE):
            more = self.read_line("... " if self.interactive else "")
            if more is None:
                break
            lines.append(more)
        text = "\n".join(lines)
        return text.rstrip().removesuffix(MULTILINE).strip("\n")

    # ---- the loop ----

    def loop(self) -> None:
        if self.interactive:
            # Ctrl-C has to stop a reply even when we were started with SIGINT ignored (a
            # background job of a non-interactive shell inherits SIG_IGN, and Python keeps it).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.note(f"{self.engine.name}, sampler {self.chat.sampler}. /help for commands, "
                      "Ctrl-D or /bye to quit.")
        while True:
            try:
                text = self.read_message()
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, not an exit
                continue
            if text is None:
                return
            if not text.strip():
                continue
            if text.strip().startswith("/") and "\n" not in text.strip():
                if self.command(text.strip()) == "quit":
                    return
            else:
                self.last_prompt = text
                self.reply(lambda: self.chat.send(text))

    def reply(self, start) -> None:
        try:
            stream = start()
        except ContextOverflow as exc:
            self.note(str(exc))
            return
        except KeyboardInterrupt:  # before the first token
            self.note("[interrupted]")
            return
        self.last = self.show_stream(stream)
        if self.chat.dropped > self.warned_dropped and self.warned_dropped == 0:
            self.note("(the conversation outgrew the context window: the oldest messages "
                      "are being dropped)")
        self.warned_dropped = self.chat.dropped

    def show_stream(self, stream):
        pieces = iter(stream)
        try:
            for piece in pieces:
                if self.trace:
                    self.say(self._traced(stream, piece), end="")
                else:
                    self.say(piece, end="")
        except KeyboardInterrupt:
            pieces.close()
            self.say("")
            self.note("[interrupted]")
        else:
            self.say("")
        return stream.result

    def _traced(self, stream, piece: str) -> str:
        """The piece marked with the k of its token: coloured, or piece[k] when piped."""
        k = stream.last_k
        if k is None:
            return piece
        return f"{k_colour(k)}{piece}{RESET}" if self.interactive else f"{piece}[{k}]"

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
        for name, text in COMMANDS.items():
            self.say(f"  {name:<10} {text}")
        self.say(f'  {MULTILINE:<10} start and end a message of several lines')

    def cmd_bye(self, arg):
        return "quit"

    def cmd_set(self, arg):
        key, _, value = arg.partition(" ")
        key, value = key.strip().lower(), value.strip()
        if key not in SET_KEYS or not value:
            self.note(f"usage: /set {'|'.join(SET_KEYS)} VALUE")
            return
        try:
            if key == "sampler":
                self.chat.sampler = parse_spec(value)
            elif key == "system":
                self.chat.system = value
            elif key == "eps":
                if "eps" not in self.chat.sampler.params:
                    raise SpecError(f"{self.chat.sampler.name} has no eps; "
                                    "/set sampler adaptive:eps=... first")
                self.chat.sampler = self.chat.sampler.with_param("eps", value)
            elif key == "temp":
                self.chat.sampler = self.chat.sampler.with_param("temp", value)
            elif key == "seed":
                self.chat.seed = int(value)
            elif key == "max-tokens":
                n = int(value)
                if n < 1:
                    raise ValueError
                self.chat.max_tokens = n
        except SpecError as exc:
            self.note(f"{exc}; kept {self.chat.sampler}")
            return
        except ValueError:
            self.note(f"{key} has to be an integer{' >= 1' if key == 'max-tokens' else ''}, "
                      f"not {value!r}; kept the old value")
            return
        self.note(f"{key} set; sampler {self.chat.sampler}, seed {self.chat.seed}, "
                  f"max-tokens {self.chat.max_tokens}")

    def cmd_show(self, arg):
        used = self.chat.context_used()
        self.say(f"model       {self.engine.path}\n"
                 f"sampler     {self.chat.sampler}\n"
                 f"seed        {self.chat.seed}\n"
                 f"max-tokens  {self.chat.max_tokens}\n"
                 f"system      {self.chat.system or '(none)'}\n"
                 f"context     {used} of {self.engine.n_ctx} tokens "
                 f"({len(self.chat.messages)} messages)")

    def cmd_clear(self, arg):
        self.chat.clear()
        self.last = None
        self.note("conversation cleared")

    def cmd_undo(self, arg):
        self.note("last exchange dropped" if self.chat.undo() else "nothing to undo")

    def cmd_regen(self, arg):
        if not self.chat.messages:
            self.note("nothing to regenerate yet")
            return
        self.reply(self.chat.regenerate)

    def cmd_stats(self, arg):
        r = self.last
        if r is None:
            self.note("no reply yet")
            return
        self.say(format_stats(r))

    def cmd_trace(self, arg):
        if arg not in ("on", "off"):
            self.note("usage: /trace on|off")
            return
        self.trace = arg == "on"
        self.note(f"trace {arg}")

    def cmd_compare(self, arg):
        if self.last_prompt is None or self.last is None:
            self.note("say something first: /compare reruns the last prompt")
            return
        try:
            other = parse_spec(arg)
        except SpecError as exc:
            self.note(str(exc))
            return
        # The conversation up to the last prompt, replayed with the other sampler.
        history = self.chat.messages
        cut = max(i for i, m in enumerate(history) if m["role"] == "user")
        probe = Chat(self.engine, system=self.chat.system, sampler=other,
                     max_tokens=self.chat.max_tokens, seed=self.chat.seed)
        probe.messages = [dict(m) for m in history[:cut]]
        self.say(f"--- {self.chat.sampler} ---\n{self.last.text}\n{format_stats(self.last)}")
        self.say(f"--- {other} ---")
        result = self.show_stream(probe.send(self.last_prompt))
        self.say(format_stats(result))

    def cmd_save(self, arg):
        if not arg:
            self.note("usage: /save FILE")
            return
        data = {"version": 1, "model": str(self.engine.path), "sampler": str(self.chat.sampler),
                "seed": self.chat.seed, "max_tokens": self.chat.max_tokens,
                "system": self.chat.system, "messages": self.chat.messages}
        path = Path(arg).expanduser()
        try:
            write_atomically(path, json.dumps(data, indent=2, ensure_ascii=False))
        except OSError as exc:
            self.note(f"could not save to {path}: {exc.strerror or exc}; nothing was lost")
            return
        self.note(f"saved {len(self.chat.messages)} messages to {path}")

    def cmd_load(self, arg):
        if not arg:
            self.note("usage: /load FILE")
            return
        path = Path(arg).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            messages = data["messages"]
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and m.get("role") in ("user", "assistant")
                    and isinstance(m.get("content"), str) for m in messages):
                raise ValueError("messages have to be {role: user|assistant, content: text}")
            sampler = parse_spec(data.get("sampler", str(self.chat.sampler)))
            seed = int(data.get("seed", self.chat.seed))
            max_tokens = int(data.get("max_tokens", self.chat.max_tokens))
            system = data.get("system")
        except OSError as exc:
            self.note(f"could not read {path}: {exc.strerror or exc}; the chat is unchanged")
            return
        except (ValueError, KeyError, TypeError) as exc:
            self.note(f"{path} is not a saved chat ({exc}); the chat is unchanged")
            return
        self.chat.messages = messages
        self.chat.sampler, self.chat.seed, self.chat.max_tokens = sampler, seed, max_tokens
        self.chat.system = system
        self.note(f"loaded {len(messages)} messages; sampler {sampler}, seed {seed}")


def format_stats(r) -> str:
    line = (f"{r.completion_tokens} tokens, {r.decode_tokens_per_s:.1f} tokens/s, "
            f"first token after {r.time_to_first_token_s * 1000:.0f} ms, "
            f"finish: {r.finish_reason}")
    if r.mean_k is not None:
        ks = sorted(s.k for s in r.token_stats)
        line += (f"\nk: mean {r.mean_k:.1f}, sd {r.stdev_k:.1f}, median {ks[len(ks) // 2]}, "
                 f"max {ks[-1]}")
        if r.mean_conf is not None:
            line += f"; mean confidence {r.mean_conf:.3f}"
    return line


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".",
                               prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plain_reader(prompt: str) -> str | None:
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")

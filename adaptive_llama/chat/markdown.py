"""Markdown in a streamed reply, rendered for a terminal as it arrives.

A reply comes a few characters at a time and is shown as it comes, so nothing is ever
redrawn: each line's kind is decided from its first characters, and only the word being
written is held back, so that it can move whole to the next line when it does not fit.

- headings bold (the ``#`` hidden, level 1 underlined too);
- ``**bold**``, ``*italic*`` / ``_italic_`` and `` `code` `` styled, their markers hidden
  (``\\*`` is a literal star; ``_`` inside a word, as in snake_case, is not a marker);
- list items with a bullet (numbers kept) and a hanging indent; quotes with a bar; a rule
  (``---``) as a line;
- fenced code verbatim, indentation kept and never wrapped, the fence lines dim;
  table rows verbatim;
- prose wrapped at word boundaries to the width (a word longer than a line is cut).

A newline of the reply stays a line break (chat replies use them for steps, poems and
addresses), and inline styles end with their line, so a stray ``*`` cannot restyle the rest
of the reply. Widths count terminal columns (wcwidth), so CJK text and emoji wrap right.
"""

from __future__ import annotations

import re

from wcwidth import wcwidth

RESET = "\033[0m"
BOLD, DIM, ITALIC, UNDERLINE, CODE = "\033[1m", "\033[2m", "\033[3m", "\033[4m", "\033[36m"
BULLET, QUOTE_BAR, RULE = "•", "│ ", "─"
FENCES = ("```", "~~~")

# What the start of a line can still become; the line waits while its start is undecided.
_MAY_GROW = re.compile(r"#{1,6}|\d{1,9}[.)]?|[-*_]|([-*_])(?: *\1)+ *")
_HEADING = re.compile(r"(#{1,6}) ")
_BULLET = re.compile(r"[-*+] ")
_NUMBERED = re.compile(r"\d{1,9}[.)] ")
_RULE_LINE = re.compile(r"([-*_])(?: *\1){2,} *")
_FENCE_START = re.compile(r"`{1,2}|~{1,2}")


def columns(text: str) -> int:
    """Terminal columns of ``text`` (a control character takes none)."""
    return sum(max(wcwidth(ch), 0) for ch in text)


class MarkdownStream:
    """``feed`` each piece of a reply and write what it returns, then ``finish`` (also on
    Ctrl-C) for what was held back. ``styles`` renders markdown; ``width`` (columns) wraps
    prose at word boundaries, None does not wrap. Fenced code stays verbatim either way."""

    def __init__(self, styles: bool = True, width: int | None = 80):
        self.styles = styles
        self.width = width if width is None else max(width, 8)
        self.in_fence = False
        self._start_line()

    def _start_line(self) -> None:
        self.head = ""  # the start of the line, while its kind is undecided
        self.kind: str | None = None  # "prose", "verbatim", "code" or "fence"
        self.word = ""  # the word being written, held back to wrap it whole
        self.space = False  # a space is due before the next word
        self.after_word = False  # a word is on this line of the screen
        self.column = 0
        self.indent, self.indent_columns = "", 0  # what continues a wrapped line
        self.line_style = ""  # a heading's
        self.bold = self.italic = self.code = False
        self.shown_style: str | None = ""  # the style the terminal is in (None: unknown)

    # ---- the stream ----

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if ch == "\n":
                self._end_line(out)
            elif self.kind is None:
                self.head += ch
                self._decide(out, line_ended=False)
            else:
                self._put(ch, out)
        return "".join(out)

    def finish(self) -> str:
        """What is still held back, with the styles reset."""
        out: list[str] = []
        if self.head and self.kind is None:
            self._decide(out, line_ended=True)
        self._flush_word(out)
        if self.styles and self.kind is not None:
            out.append(RESET)
        self._start_line()
        return "".join(out)

    def _put(self, ch: str, out: list[str]) -> None:
        if self.kind != "prose":
            out.append(ch)
        elif ch in " \t":
            self._flush_word(out)
            self.space = self.after_word
        elif columns(ch) == 2:  # CJK text breaks between any two wide characters
            self._flush_word(out)
            self.word = ch
            self._flush_word(out)
        else:
            self.word += ch
            if self.width is not None and len(self.word) >= self.width:
                self._flush_word(out)  # it cannot fit on a line anyway: show it as it comes

    def _end_line(self, out: list[str]) -> None:
        if self.kind is None and self.head:
            self._decide(out, line_ended=True)
        self._flush_word(out)
        if self.kind == "fence":
            self.in_fence = not self.in_fence
        if self.styles and self.kind is not None:
            out.append(RESET)
        out.append("\n")
        self._start_line()

    # ---- what a line is ----

    def _decide(self, out: list[str], line_ended: bool) -> None:
        """Choose the line's kind once its start says it (or the line ended)."""
        head = self.head
        rest = head.lstrip(" ")
        lead = head[:len(head) - len(rest)]
        if not line_ended and (not rest or _FENCE_START.fullmatch(rest)
                               or (self.styles and _MAY_GROW.fullmatch(rest))):
            return
        fence = rest.startswith(FENCES)
        if self.in_fence or fence:  # a fence line opens or closes; between them, code
            self._begin("fence" if fence else "code", DIM if fence else CODE, out)
            out.append(head)
        elif rest.startswith("|"):  # a table row
            self._begin("verbatim", "", out)
            out.append(head)
        elif not self.styles:
            self._prose(lead, "", rest, out)
        elif line_ended and _RULE_LINE.fullmatch(rest):
            self._begin("verbatim", DIM, out)
            out.append(RULE * min(self.width or 40, 40))
        elif match := _HEADING.match(rest):
            self.line_style = BOLD + (UNDERLINE if len(match[1]) == 1 else "")
            self._begin("prose", self.line_style, out)
            self._feed_prose(rest[match.end():], out)
        elif rest.startswith(">"):
            self._prose(lead, QUOTE_BAR, rest[1:].lstrip(" "), out, quote=True)
        elif match := _BULLET.match(rest) or _NUMBERED.match(rest):
            marker = BULLET + " " if match.re is _BULLET else match[0]
            self._prose(lead, marker, rest[match.end():], out)
        else:
            self._prose(lead, "", rest, out)

    def _begin(self, kind: str, style: str, out: list[str]) -> None:
        self.kind = kind
        if self.styles and style:
            out.append(style)
            self.shown_style = None

    def _prose(self, lead: str, marker: str, text: str, out: list[str],
               quote: bool = False) -> None:
        """A prose line after its indentation and marker (a list item's, a quote's): a
        wrapped line continues under the text, or, in a quote, after the quote's bar."""
        self.kind = "prose"
        self.column = columns(lead + marker)
        if quote:  # (quotes are markdown: styles are on; the line starts unstyled)
            marker = f"{DIM}{marker}{RESET}"
        out.append(lead + marker)
        self.indent = lead + (marker if quote else " " * (self.column - columns(lead)))
        self.indent_columns = self.column
        self._feed_prose(text, out)

    def _feed_prose(self, text: str, out: list[str]) -> None:
        for ch in text:
            self._put(ch, out)

    # ---- words ----

    def _flush_word(self, out: list[str]) -> None:
        if not self.word:
            return
        runs = self._styled(self.word) if self.styles else [("", self.word)]
        self.word = ""
        wide = sum(columns(text) for _, text in runs)
        space = 1 if self.space else 0
        if self.width is not None and self.after_word and \
                self.column + space + wide > self.width:
            self._wrap(out)
            space = 0
        if space:
            out.append(" ")
            self.column += 1
        self.space = False
        for style, text in runs:
            self._set_style(style, out)
            for ch in text:
                if self.width is not None and self.column + columns(ch) > self.width \
                        and self.column > self.indent_columns:
                    self._wrap(out)  # a word longer than the line: cut it
                    self._set_style(style, out)
                out.append(ch)
                self.column += columns(ch)
            self.after_word = True

    def _set_style(self, style: str, out: list[str]) -> None:
        style = self.line_style + style
        if self.styles and style != self.shown_style:
            out.append(RESET + style)
            self.shown_style = style

    def _wrap(self, out: list[str]) -> None:
        out.append((RESET if self.styles else "") + "\n" + self.indent)
        self.shown_style = ""
        self.column = self.indent_columns
        self.after_word = False

    def _styled(self, word: str) -> list[tuple[str, str]]:
        """The word as (style, visible text) runs, its emphasis and code markers taken
        out and the inline state (bold, italic, code) carried on to the next word."""
        runs: list[tuple[str, str]] = []
        text, i = "", 0

        def cut():
            nonlocal text
            if text:
                runs.append((self._inline_style(), text))
                text = ""

        while i < len(word):
            ch = word[i]
            if ch == "\\" and i + 1 < len(word) and not self.code:
                text += word[i + 1]
                i += 2
            elif ch == "`":
                cut()
                self.code = not self.code
                i += 1
            elif ch in "*_" and not self.code:
                end = i
                while end < len(word) and word[end] == ch and end - i < 3:
                    end += 1
                if _toggles(word, i, end):
                    cut()
                    self.bold ^= end - i >= 2
                    self.italic ^= end - i != 2
                else:
                    text += word[i:end]
                i = end
            else:
                text += ch
                i += 1
        cut()
        return runs

    def _inline_style(self) -> str:
        return ((BOLD if self.bold else "") + (ITALIC if self.italic else "")
                + (CODE if self.code else ""))


def _toggles(word: str, start: int, end: int) -> bool:
    """Whether the marker run word[start:end] opens or closes emphasis: it touches text on
    one side at least; an underscore only at a word's edge (snake_case is text)."""
    opens, closes = start == 0 and end < len(word), end == len(word) and start > 0
    if word[start] == "_":
        return opens or closes
    return opens or closes or (0 < start and end < len(word))

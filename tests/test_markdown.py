"""The streamed markdown renderer of the REPL (chat/markdown.py): hand-worked replies, and
properties that hold for any text cut into any pieces."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_llama.chat.markdown import (
    BOLD,
    CODE,
    DIM,
    ITALIC,
    UNDERLINE,
    MarkdownStream,
    columns,
)

ANSI = re.compile(r"\033\[[0-9;]*m")


def render(text: str, width: int | None = 40, styles: bool = True, piece: int = 3) -> str:
    """``text`` fed ``piece`` characters at a time, as a reply streams."""
    stream = MarkdownStream(styles=styles, width=width)
    shown = "".join(stream.feed(text[i:i + piece]) for i in range(0, len(text), piece))
    return shown + stream.finish()


def plain(shown: str) -> str:
    return ANSI.sub("", shown)


def styles_at(shown: str, text: str) -> set[str]:
    """The styles on (as their escape codes) where ``text`` first shows."""
    index = plain(shown).index(text)
    on: set[str] = set()
    visible = 0
    for part in re.split(r"(\033\[[0-9;]*m)", shown):
        if ANSI.fullmatch(part):
            on = set() if part == "\033[0m" else on | {part}
        elif visible + len(part) > index:
            return on
        else:
            visible += len(part)
    raise AssertionError(f"{text!r} is not shown")


def styled(shown: str, style: str, text: str) -> bool:
    """Whether ``text`` shows in ``style`` (a bold heading: BOLD + UNDERLINE)."""
    return set(re.findall(r"\033\[[0-9;]*m", style)) <= styles_at(shown, text)


def test_prose_wraps_at_word_boundaries():
    text = "The quick brown fox jumps over the lazy dog and runs far away."
    # 40 columns: "The quick brown fox jumps over the lazy" is 39; with " dog" it would be 43.
    assert plain(render(text)) == ("The quick brown fox jumps over the lazy\n"
                                   "dog and runs far away.")
    # 39 fits exactly in 39; 38 pushes "lazy" down.
    assert plain(render(text, width=39)).split("\n")[0].endswith("lazy")
    assert plain(render(text, width=38)).split("\n")[0].endswith("the")


def test_a_word_longer_than_the_line_is_cut_and_wide_characters_count_two_columns():
    assert plain(render("a " + "x" * 25, width=10)) == "a\nxxxxxxxxxx\nxxxxxxxxxx\nxxxxx"
    # 12 ideographs of 2 columns each: 5 per 10-column line (no spaces between them).
    assert plain(render("中" * 12, width=10)) == "中" * 5 + "\n" + "中" * 5 + "\n" + "中" * 2
    assert columns("中a") == 3


def test_newlines_of_the_reply_stay_line_breaks():
    assert plain(render("Roses are red,\nviolets are blue.\n\nThe end.")) == \
        "Roses are red,\nviolets are blue.\n\nThe end."


def test_inline_emphasis_and_code_are_styled_and_their_markers_hidden():
    shown = render("Use **bold words** and *this* or _that_ with `x = 1` here.", width=None)
    assert plain(shown) == "Use bold words and this or that with x = 1 here."
    assert styled(shown, BOLD, "bold") and styled(shown, BOLD, "words")
    assert styled(shown, ITALIC, "this") and styled(shown, ITALIC, "that")
    assert styled(shown, CODE, "x") and styled(shown, CODE, "1")
    assert not styled(shown, BOLD, "and") and not styled(shown, CODE, "here")


def test_stars_and_underscores_that_are_not_emphasis_stay_text():
    assert plain(render("2 * 3 = 6, snake_case_name, a ** b, \\*literal\\*", width=None)) == \
        "2 * 3 = 6, snake_case_name, a ** b, *literal*"


def test_an_unclosed_marker_ends_with_its_line():
    shown = render("a *stray star\nnext line", width=None)
    assert styled(shown, ITALIC, "stray") and not styled(shown, ITALIC, "next")


def test_headings_lists_quotes_and_rules():
    shown = render("# Title\n## Part\n- apple\n* pear\n  - nested\n3. third\n> quoted\n---\n"
                   "#hashtag\n")
    assert plain(shown) == ("Title\nPart\n• apple\n• pear\n  • nested\n3. third\n│ quoted\n"
                            + "─" * 40 + "\n#hashtag\n")
    assert styled(shown, BOLD + UNDERLINE, "Title") and styled(shown, BOLD, "Part")
    assert not styled(shown, UNDERLINE, "Part")


def test_a_list_item_and_a_quote_wrap_under_their_text():
    item = "- " + "word " * 12
    # "• " then words of 4 + 1 columns: 7 words reach column 2 + 34 = 36; an 8th needs 41.
    assert plain(render(item)).split("\n") == ["• " + " ".join(["word"] * 7),
                                               "  " + " ".join(["word"] * 5)]
    assert plain(render("> " + "word " * 12)).split("\n")[1].startswith("│ word")
    assert plain(render("10. " + "word " * 12)).split("\n")[1].startswith("    word")


def test_fenced_code_is_verbatim_and_never_wrapped():
    code = "    return  x  *  2   # " + "long " * 10
    shown = render(f"Code:\n```python\ndef f(x):\n{code}\n```\nafter  it", width=30)
    lines = plain(shown).split("\n")
    assert lines[:5] == ["Code:", "```python", "def f(x):", code, "```"]
    assert lines[5] == "after it"  # prose again: spaces collapse, wrapping resumes
    assert styled(shown, CODE, "def f(x):") and styled(shown, DIM, "```python")


def test_table_rows_are_verbatim():
    row = "| name | a very long cell that would wrap | x |"
    assert plain(render(row, width=20)) == row


def test_wrapping_only_keeps_the_text_as_written():
    text = "# Not a heading **here**\n- item"
    assert plain(render(text, styles=False, width=None)) == text
    assert ANSI.search(render(text, styles=False, width=None)) is None


def test_finish_shows_what_was_held_back():
    stream = MarkdownStream(width=40)
    assert plain(stream.feed("half a wor")) == "half a"  # "wor" may still grow
    assert plain(stream.finish()) == " wor"


# Replies made of the pieces that change how a line or a word shows.
replies = st.lists(st.sampled_from(list("aX *_`#->|1.\n\\中") + ["```", "**", "word ", "- "]),
                   max_size=80).map("".join)


@settings(max_examples=300, deadline=None)
@given(replies, st.integers(1, 7), st.integers(8, 50))
def test_any_cutting_into_pieces_shows_the_same(text, piece, width):
    assert render(text, width=width, piece=piece) == render(text, width=width, piece=len(text) + 1)


@settings(max_examples=300, deadline=None)
@given(replies, st.integers(8, 50))
def test_prose_lines_fit_the_width_and_no_visible_character_is_lost(text, width):
    shown = plain(render(text, width=width, styles=False))
    fence = False
    for line in shown.split("\n"):
        verbatim = fence or line.lstrip(" ").startswith(("```", "~~~", "|"))
        if line.lstrip(" ").startswith(("```", "~~~")):
            fence = not fence
        assert verbatim or columns(line) <= width, line
    assert re.sub(r"\s", "", shown) == re.sub(r"\s", "", text)


def test_emphasis_over_several_words_and_inside_a_heading():
    shown = render("*two words* then\n# A **bold** Xmas heading", width=None)
    assert plain(shown) == "two words then\nA bold Xmas heading"
    assert styled(shown, ITALIC, "two") and styled(shown, ITALIC, "words")
    assert not styled(shown, ITALIC, "then")
    assert styled(shown, BOLD, "bold") and styled(shown, BOLD + UNDERLINE, "Xmas")


def test_a_line_that_only_might_have_been_markup_stays_text():
    # "42", "-", "#" and "1." could each have grown into a list item, a rule or a heading.
    assert plain(render("42\n-\n#\n1.\n***\n")) == "42\n-\n#\n1.\n" + "─" * 40 + "\n"


def test_one_letter_emphasis_intraword_stars_cjk_at_once_and_a_rule_unwrapped():
    shown = render("*a b* 5*3*2\n---", width=None)
    assert plain(shown) == "a b 532\n" + "─" * 40
    assert styled(shown, ITALIC, "b") and styled(shown, ITALIC, "3")
    assert not styled(shown, ITALIC, "5") and not styled(shown, ITALIC, "2")
    # wide characters are shown as they come: any two of them may break a line
    assert plain(MarkdownStream(width=40).feed("中文")) == "中文"

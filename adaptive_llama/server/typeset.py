"""Code and math in the chat page's replies, typeset on the server by two well-kept
libraries instead of JavaScript shipped to every browser: Pygments highlights code in the
language its fence names, latex2mathml turns TeX into MathML, which browsers draw natively.

Both answer plain data, never markup for the page to parse: a code block becomes
``[[kind, text], ...]`` pieces (``kind`` one of :data:`KINDS`, or "" for plain text), a
formula a ``[tag, {attribute: value}, child, ...]`` tree of MathML whose tags and
attributes come from fixed lists. Text the model wrote stays text, so a reply that holds
markup shows it as characters. What cannot be typeset (an unknown language, TeX the
converter refuses) comes back as ``None``, and the page keeps showing it as written.
"""

from __future__ import annotations

from xml.etree import ElementTree

from latex2mathml.converter import convert
from pygments import lex
from pygments.lexers import get_lexer_by_name
from pygments.token import Comment, Keyword, Literal, Name, Number, Operator, String, Token
from pygments.util import ClassNotFound

# Pygments' token types, from the most specific, to the few kinds the page colours.
KINDS = (
    (Comment, "comment"), (String, "string"), (Number, "number"),
    (Keyword, "keyword"), (Name.Builtin, "builtin"), (Name.Function, "function"),
    (Name.Class, "type"), (Name.Decorator, "builtin"), (Literal, "string"),
    (Operator.Word, "keyword"), (Token.Generic.Deleted, "deleted"),
    (Token.Generic.Inserted, "inserted"), (Token.Generic.Heading, "keyword"),
)
LONGEST_CODE = 50_000  # characters of one block; a longer one stays plain
LONGEST_TEX = 2_000     # characters of one formula
DEEPEST_MATH = 48       # elements nested in one formula (the answer is encoded recursively)

MATHML = "{http://www.w3.org/1998/Math/MathML}"
MATHML_TAGS = frozenset((
    "math mrow mi mn mo ms mtext mspace mfrac msqrt mroot msub msup msubsup munder mover "
    "munderover mtable mtr mtd mstyle mpadded mphantom menclose merror semantics").split())
MATHML_ATTRIBUTES = frozenset((
    "display mathvariant stretchy fence separator lspace rspace columnalign rowalign "
    "columnspacing rowspacing columnlines rowlines displaystyle scriptlevel width height "
    "depth accent accentunder movablelimits largeop symmetric minsize maxsize "
    "linethickness notation form frame").split())


def _kind(token_type) -> str:
    for parent, kind in KINDS:
        if token_type in parent:
            return kind
    return ""


def highlight(language: str, code: str) -> list[list[str]] | None:
    """``code`` in pieces of one kind each, as Pygments' lexer for ``language`` reads it;
    ``None`` for a language Pygments does not know (it never guesses) or a block too long."""
    if len(code) > LONGEST_CODE:
        return None
    try:
        lexer = get_lexer_by_name(language, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return None
    pieces: list[list[str]] = []
    for token_type, text in lex(code, lexer):
        kind = _kind(token_type)
        if pieces and pieces[-1][0] == kind:
            pieces[-1][1] += text
        else:
            pieces.append([kind, text])
    return pieces


def _tree(element: ElementTree.Element, depth: int = 0) -> list:
    """One MathML element as [tag, attributes, children...]; ValueError for anything else."""
    tag = element.tag.removeprefix(MATHML)
    if tag not in MATHML_TAGS:
        raise ValueError(f"not a MathML element: {element.tag}")
    if depth > DEEPEST_MATH:
        raise ValueError(f"more than {DEEPEST_MATH} elements deep")
    attributes = {name: value for name, value in element.attrib.items()
                  if name in MATHML_ATTRIBUTES}
    node: list = [tag, attributes]
    if element.text:
        node.append(element.text)
    for child in element:
        node.append(_tree(child, depth + 1))
        if child.tail:
            node.append(child.tail)
    return node


def mathml(tex: str, display: bool) -> list | None:
    """The MathML of a TeX formula as a tree of plain data; ``None`` where the converter
    fails or writes anything but MathML (it copies ``\\text{...}`` through unescaped)."""
    if len(tex) > LONGEST_TEX:
        return None
    try:
        markup = convert(tex, display="block" if display else "inline")
        return _tree(ElementTree.fromstring(markup))
    except Exception:  # noqa: BLE001 - the model's TeX is untrusted: any failure shows it as written
        return None

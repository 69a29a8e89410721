"""Code and math of the chat page's replies, typeset on the server (server/typeset.py):
Pygments' pieces always add up to the code, and only MathML built from fixed lists of tags
and attributes ever leaves, whatever TeX the model wrote."""

from xml.etree import ElementTree

import pytest

from adaptive_llama.server import typeset
from adaptive_llama.server.typeset import (
    LONGEST_CODE,
    DEEPEST_MATH,
    LONGEST_TEX,
    MATHML_ATTRIBUTES,
    MATHML_TAGS,
    highlight,
    mathml,
)


def test_python_is_cut_into_kinds_that_add_up_to_the_code():
    code = "def f(x):\n    return 'a' + 1  # one\n"
    pieces = highlight("python", code)
    assert "".join(text for _, text in pieces) == code
    kinds = {text.strip(): kind for kind, text in pieces if text.strip()}
    assert kinds["def"] == kinds["return"] == "keyword"
    assert kinds["f"] == "function" and kinds["'a'"] == "string"
    assert kinds["1"] == "number" and kinds["# one"] == "comment"
    assert kinds["(x):"] == ""  # plain text has no kind
    # neighbours of one kind are merged: no two pieces in a row share it
    assert all(a[0] != b[0] for a, b in zip(pieces, pieces[1:]))


@pytest.mark.parametrize("language", ["py", "js", "c++", "rust", "bash", "diff", "json"])
def test_the_usual_fence_names_are_known_and_lose_no_character(language):
    code = "a = 1\n\tb\n  'x' // y # z\n-old\n+new\n"
    pieces = highlight(language, code)
    assert pieces is not None and "".join(text for _, text in pieces) == code


def test_code_without_a_last_newline_gets_none_added():
    pieces = highlight("python", "x = 1")
    assert "".join(text for _, text in pieces) == "x = 1"


def test_an_unknown_language_or_a_block_too_long_stays_plain():
    assert highlight("nosuchlanguage", "x = 1") is None
    assert highlight("python", "x" * LONGEST_CODE) is not None
    assert highlight("python", "x" * (LONGEST_CODE + 1)) is None


def tags_and_attributes(tree, tags=None, attributes=None):
    tags, attributes = tags if tags is not None else set(), attributes or set()
    tag, attrs, *children = tree
    tags.add(tag)
    attributes.update(attrs)
    for child in children:
        if isinstance(child, list):
            tags_and_attributes(child, tags, attributes)
    return tags, attributes


def test_a_formula_is_typeset_up_to_the_depth_allowed_and_no_deeper():
    # <math><mrow> around the braces' rows, <mi>x</mi> inside them: n braces, depth n + 2
    braces = DEEPEST_MATH - 2
    assert mathml("{" * braces + "x" + "}" * braces, False) is not None
    assert mathml("{" * (braces + 1) + "x" + "}" * (braces + 1), False) is None


def test_a_formula_becomes_a_tree_of_mathml():
    assert mathml("x^2", display=False) == [
        "math", {"display": "inline"}, ["mrow", {}, ["msup", {}, ["mi", {}, "x"], ["mn", {}, "2"]]]]
    tree = mathml(r"\frac{a}{b} + \sqrt{x^2}", display=False)
    assert tree[0] == "math" and tree[1] == {"display": "inline"}
    tags, _ = tags_and_attributes(tree)
    assert {"mfrac", "msqrt", "msup", "mi", "mn", "mo"} <= tags
    assert mathml("E = mc^2", display=True)[1] == {"display": "block"}


def test_text_between_elements_stays_in_its_place():
    markup = '<math xmlns="http://www.w3.org/1998/Math/MathML">a<mi>b</mi>c<mo>d</mo>e</math>'
    assert typeset._tree(ElementTree.fromstring(markup)) == [
        "math", {}, "a", ["mi", {}, "b"], "c", ["mo", {}, "d"], "e"]


def test_a_formula_as_long_as_allowed_is_typeset():
    assert mathml("x" * LONGEST_TEX, display=False) is not None


@pytest.mark.parametrize("tex", [
    r"\text{<img src=x onerror=alert(1)>}",       # copied through unescaped by the converter
    r"\text{<script>alert(1)</script>}",
    r"\text{a < b}",                                # not XML
    r"\text{</mi><a href='javascript:x'>y</a>}",
    "{" * 60 + "x" + "}" * 60,                      # deeper than DEEPEST_MATH
    "{" * 900 + "x" + "}" * 900,                    # deeper than Python's recursion
    "x" * (LONGEST_TEX + 1),
])
def test_tex_that_is_hostile_deep_or_too_long_is_refused_as_a_whole(tex):
    assert mathml(tex, display=False) is None


@pytest.mark.parametrize("tex", [r"\begin{matrix} a & b \\ c & d \end{matrix}",
                                 r"\mathbf{x} \cdot \hat{y}", r"\sum_{i=1}^{n} i^2",
                                 r"\left( \frac{1}{2} \right)", r"\overline{z} \not= 0"])
def test_only_listed_tags_and_attributes_leave(tex):
    tree = mathml(tex, display=True)
    assert tree is not None
    tags, attributes = tags_and_attributes(tree)
    assert tags <= MATHML_TAGS and attributes <= MATHML_ATTRIBUTES

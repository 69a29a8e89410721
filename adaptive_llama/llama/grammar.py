"""Structured output: a JSON schema as a llama.cpp grammar.

llama-cpp-python's converter (its port of llama.cpp's ``json_schema_to_grammar``) writes the
schema as GBNF; a chain applies the grammar before everything else (:mod:`.chain`), so the
sampler, adaptive or any other, chooses among the tokens the grammar allows and the reply
parses as JSON that the schema accepts. The converter passes over some keywords without a
word (``minimum``, ``uniqueItems``, ``format: email``, ...): a reply would then break the
schema while looking like success. So a schema is checked first, and one that uses a keyword
the grammar cannot enforce is refused with :class:`UnsupportedSchema`, naming the keyword and
where it stands.
"""

from __future__ import annotations

import itertools
import json
import os
import re

import llama_cpp
from llama_cpp.llama_grammar import RESERVED_NAMES, LlamaGrammar, SchemaConverter

from .schema import UnsupportedSchema, check_schema

__all__ = ["UnsupportedSchema", "check_schema", "json_grammar", "framed_json_grammar",
           "gbnf_grammar", "json_gbnf", "group_depth"]

# A grammar llama.cpp is given: at most this long, and its groups at most this deep (it
# parses a group by recursion; about 30,000 deep overflowed the stack and killed the process,
# and past about 2,000 it refuses the grammar).
MAX_GRAMMAR_BYTES = 512 * 1024
MAX_GROUP_DEPTH = 1024
ANY_OBJECT = {"type": "object"}  # JSON mode: any JSON object
_ANY_CHAR = 'char ::= [^"\\\\]'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F]'


def json_grammar(schema: dict | None = None) -> LlamaGrammar:
    """The grammar of JSON that ``schema`` accepts; None: any JSON object (JSON mode)."""
    return _parsed(json_gbnf(ANY_OBJECT if schema is None else schema), "root")


def framed_json_grammar(schema: dict, before: str, after: str,
                        separator: str | None = None) -> LlamaGrammar:
    """The grammar of ``before`` + JSON that ``schema`` accepts + ``after`` (literal texts);
    with a ``separator``, one or more of these, separated by it."""
    gbnf = json_gbnf(schema)
    top = "framed"  # the converter names rules after property paths: take a free name
    while re.search(f"^{top} ::= ", gbnf, re.M):
        top += "-x"
    one = f"{_literal(before)} root {_literal(after)}"
    body = one if separator is None else f"{one} ({_literal(separator)} {one})*"
    return _parsed(f"{top} ::= {body}\n{gbnf}", top)


def gbnf_grammar(gbnf: str) -> LlamaGrammar:
    """A grammar its caller wrote in GBNF (llama-server's ``grammar`` field), start rule
    ``root``; UnsupportedSchema when llama.cpp cannot parse it, when it passes the bounds,
    or when it names tokens (``<|im_end|>``, ``<[42]>``: parsing those needs the model's
    vocabulary, which a grammar checked before its request is queued does not have)."""
    if any(term.startswith("<") for term in _GBNF_TERM.findall(gbnf)):
        raise UnsupportedSchema("the grammar names tokens (<...>), which this server does "
                                "not take; write them as text")
    return _parsed(gbnf, "root", "the grammar")


def _parsed(gbnf: str, root: str, what: str = "the grammar the schema makes"
            ) -> LlamaGrammar:
    """The grammar, once llama.cpp has parsed it here (UnsupportedSchema if it cannot),
    so that a request learns it at once, not from the decoding thread."""
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise UnsupportedSchema(f"{what} has {len(gbnf):,} bytes, more than the "
                                f"{MAX_GRAMMAR_BYTES:,} allowed; make it smaller")
    if group_depth(gbnf) > MAX_GROUP_DEPTH:
        raise UnsupportedSchema(f"{what} nests more than {MAX_GROUP_DEPTH} groups deep; "
                                "make it (or its counts) smaller")
    # No vocabulary: a schema's grammar has no <token> terms, and parsing needs none else.
    sampler = llama_cpp.llama_sampler_init_grammar(None, gbnf.encode("utf-8"),
                                                   root.encode("utf-8"))
    if not sampler:
        raise UnsupportedSchema(f"llama.cpp cannot parse {what} (a rule it does not "
                                "define, left recursion, too many rules, or an escape "
                                "GBNF does not know, such as \\b)")
    llama_cpp.llama_sampler_free(sampler)
    grammar = LlamaGrammar.from_string(gbnf, verbose=False)
    grammar._root = root  # the start rule llama_sampler_init_grammar is given (see .chain)
    return grammar


_GBNF_TERM = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[()]|<')


def group_depth(gbnf: str) -> int:
    """How deep the grammar's groups ``( ... )`` nest (outside its literals and ranges)."""
    depth = deepest = 0
    for term in _GBNF_TERM.findall(gbnf):
        if term == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif term == ")":
            depth -= 1
    return deepest


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal (whose escapes are JSON's)."""
    return json.dumps(text)


def json_gbnf(schema: dict) -> str:
    """The GBNF (start rule ``root``) of JSON that ``schema`` accepts, once the schema is
    checked (:func:`check_schema`)."""
    check_schema(schema)
    try:
        gbnf = _converted(_with_gbnf_patterns(schema))
    except (ValueError, AssertionError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise UnsupportedSchema(f"the schema cannot become a grammar: {exc}") from None
    # The converter's string character is anything but a quote or a backslash, so a raw
    # newline or tab could stand inside a string, which JSON forbids (llama.cpp's own
    # converter leaves out the control characters, as here).
    if re.search("^char ::= ", gbnf, re.M) and _ANY_CHAR not in gbnf:
        raise RuntimeError("llama-cpp-python's JSON-schema converter writes another string "
                           "character rule than the one this release knows; update "
                           "adaptive_llama/llama/grammar.py")
    return gbnf.replace(_ANY_CHAR, _JSON_CHAR).replace(_ANY_DOT, _JSON_DOT)


_LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\r": "\\r", "\n": "\\n"}


class _Converter(SchemaConverter):
    """llama-cpp-python's converter, with GBNF literals whose backslashes are escaped: it
    wrote a constant or a property name holding a quote or a backslash (``"b\\"c"`` as
    JSON) as a literal llama.cpp cannot parse."""

    def _format_literal(self, literal: str) -> str:
        return '"' + re.sub(r'[\\\r\n"]', lambda m: _LITERAL_ESCAPES[m.group()], literal) + '"'

    def visit(self, schema, name):
        """An ``enum`` (the converter's own branch: no $ref, anyOf, list of types or const
        before it) as a prefix tree of its values' JSON texts: the converter's flat
        ``"a" | "b" | ...`` keeps one grammar stack per value, and 500 values sharing a
        prefix cost 0.15 s a token."""
        if isinstance(schema, dict) and "enum" in schema and not isinstance(
                schema.get("type"), list) and not {"$ref", "anyOf", "oneOf", "const"} & set(schema):
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            texts = sorted({json.dumps(v) for v in schema["enum"]})
            return self._add_rule(rule_name, self._prefix_tree(texts))
        return super().visit(schema, name)

    def resolve_refs(self, schema: dict, url: str) -> dict:
        """Every local ``$ref`` (checked: it points at a schema) registered under its whole
        pointer. The converter's own skipped what stands beside a ``$ref`` (the root's
        ``$defs`` beside the root's ``$ref``: a KeyError for a reference in them) and could
        not step into a list (``#/anyOf/0``)."""
        def visit(node) -> None:
            if isinstance(node, list):
                for item in node:
                    visit(item)
            elif isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#"):
                    node["$ref"] = f"{url}{ref}"
                    self._refs.setdefault(node["$ref"], _pointed_at(schema, ref))
                for value in node.values():
                    visit(value)

        visit(schema)
        return schema

    def _resolve_ref(self, ref: str) -> str:
        """The rule of the schema ``ref`` points at, named after its whole pointer: the
        converter named it after the pointer's last part, so that ``#/$defs/a/items`` and
        ``#/properties/b/items`` shared one rule, the first one's."""
        names = self.__dict__.setdefault("_ref_names", {})
        if ref not in names:
            base = "ref" + re.sub(r"[^a-zA-Z0-9]+", "-", ref.split("#", 1)[-1]).rstrip("-")
            names[ref] = base if base not in names.values() else f"{base}-{len(names)}"
        name = names[ref]
        if name not in self._rules and ref not in self._refs_being_resolved:
            self._refs_being_resolved.add(ref)
            name = self.visit(self._refs[ref], name)
            self._refs_being_resolved.remove(ref)
        return name

    def _prefix_tree(self, texts: list[str]) -> str:
        """GBNF matching exactly ``texts`` (distinct, sorted), each shared prefix once."""
        prefix = os.path.commonprefix(texts) if len(texts) > 1 else texts[0]
        rests = [t[len(prefix):] for t in texts]
        head = [self._format_literal(prefix)] if prefix else []
        if len(texts) == 1:
            return " ".join(head) or '""'
        branches = [self._prefix_tree(list(group))
                    for _, group in itertools.groupby((r for r in rests if r), key=lambda r: r[0])]
        tail = "(" + " | ".join(branches) + ")" + ("?" if "" in rests else "")
        return " ".join([*head, tail])


def _pointed_at(schema: dict, ref: str):
    """The value at the JSON pointer ``ref`` (``#/...``) in ``schema``."""
    target = schema
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        target = target[int(part)] if isinstance(target, list) else target[part]
    return target


def _converted(schema: dict) -> str:
    """The GBNF of a checked schema (as llama-cpp-python's ``json_schema_to_gbnf``)."""
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "stdin"), "")
    return converter.format_grammar()


# A pattern's escapes as the converter passes them on to llama.cpp, which knows only \x, \u,
# \t, \n, \r and a few more: "\d" or "\." would be grammars it cannot parse. Each becomes
# a range of hexadecimal escapes, inside or outside brackets.
# \s is the space alone: a tab or a line break stands in a JSON string only escaped, which
# the converter cannot write.
_CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": "\\x20"}
# What a JSON string cannot hold raw: a negated range leaves these out too.
_NOT_IN_JSON = "\\x22\\x5C\\x00-\\x1F\\x7F"
_ANY_DOT = 'dot ::= [^\\x0A\\x0D]'
_JSON_DOT = f'dot ::= [^{_NOT_IN_JSON}]'


def gbnf_pattern(pattern: str) -> str:
    """``pattern`` (a checked regular expression) written so that the converter makes GBNF
    llama.cpp parses, and that never writes a quote, a backslash or a control character raw
    inside the JSON string."""
    out, i, in_range = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(_escape(pattern[i + 1], in_range))
            i += 2
            continue
        if not in_range and c == "[":
            in_range = True
            negated = pattern[i + 1:i + 2] == "^"
            out.append("[^" if negated else "[")
            i += 2 if negated else 1
            if pattern[i:i + 1] == "]":  # a "]" first in a range is a character
                out.append("\\x5D")
                i += 1
            continue
        if in_range and c == "]":
            in_range = False
            out.append(_NOT_IN_JSON + "]" if negated else "]")
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _escape(char: str, in_range: bool) -> str:
    """One escaped character of a pattern (``\\d``, ``\\.``, ...) as GBNF takes it."""
    upper = char.upper()
    if char.lower() in _CLASSES:
        inside = _CLASSES[char.lower()]
        if char == upper:  # \D, \W, \S: the complement, outside a range only (else kept)
            return f"[^{inside}{_NOT_IN_JSON}]" if not in_range else "\\" + char
        return inside if in_range else f"[{inside}]"
    if not char.isalnum():
        code = f"\\x{ord(char):02X}" if ord(char) < 256 else f"\\u{ord(char):04X}"
        return code if in_range else f"[{code}]"
    return "\\" + char  # \x41, \u00e9, ...: GBNF's own escapes; others fail to parse


def _with_gbnf_patterns(schema):
    """The schema with each ``pattern`` (where a schema stands, not inside a value) as
    :func:`gbnf_pattern` writes it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = gbnf_pattern(out["pattern"])
    for keyword in ("properties", "$defs", "definitions"):
        if isinstance(out.get(keyword), dict):
            out[keyword] = {k: _with_gbnf_patterns(v) for k, v in out[keyword].items()}
    for keyword in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
        if isinstance(out.get(keyword), list):
            out[keyword] = [_with_gbnf_patterns(v) for v in out[keyword]]
    for keyword in ("items", "additionalProperties"):
        if isinstance(out.get(keyword), dict):
            out[keyword] = _with_gbnf_patterns(out[keyword])
    return out

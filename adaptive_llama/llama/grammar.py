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

import json
import re

from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf

# What the converter enforces, and what only describes (accepted, changes nothing).
ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
            "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
            "$defs", "definitions", "pattern", "format", "minLength", "maxLength"}
ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples",
               "readOnly", "writeOnly", "deprecated"}
FORMATS = ("date", "time", "date-time", "uuid")
ANY_OBJECT = {"type": "object"}  # JSON mode: any JSON object
_ANY_CHAR = 'char ::= [^"\\\\]'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F]'


class UnsupportedSchema(ValueError):
    """A schema the grammar cannot enforce (the message names what and where)."""


def json_grammar(schema: dict | None = None) -> LlamaGrammar:
    """The grammar of JSON that ``schema`` accepts; None: any JSON object (JSON mode)."""
    return LlamaGrammar.from_string(json_gbnf(ANY_OBJECT if schema is None else schema),
                                    verbose=False)


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
    grammar = LlamaGrammar.from_string(f"{top} ::= {body}\n{gbnf}", verbose=False)
    grammar._root = top  # the start rule llama_sampler_init_grammar is given (see .chain)
    return grammar


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal (whose escapes are JSON's)."""
    return json.dumps(text)


def json_gbnf(schema: dict) -> str:
    """The GBNF (start rule ``root``) of JSON that ``schema`` accepts, once the schema is
    checked (:func:`check_schema`)."""
    check_schema(schema)
    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except (ValueError, AssertionError, KeyError, TypeError, IndexError) as exc:
        raise UnsupportedSchema(f"the schema cannot become a grammar: {exc}") from None
    # The converter's string character is anything but a quote or a backslash, so a raw
    # newline or tab could stand inside a string, which JSON forbids (llama.cpp's own
    # converter leaves out the control characters, as here).
    if re.search("^char ::= ", gbnf, re.M) and _ANY_CHAR not in gbnf:
        raise RuntimeError("llama-cpp-python's JSON-schema converter writes another string "
                           "character rule than the one this release knows; update "
                           "adaptive_llama/llama/grammar.py")
    return gbnf.replace(_ANY_CHAR, _JSON_CHAR)


def check_schema(schema, where: str = "") -> None:
    """UnsupportedSchema for the first keyword (depth first) that the grammar cannot enforce;
    ``where`` is the JSON pointer of ``schema`` inside the whole one."""
    if not isinstance(schema, dict):
        if isinstance(schema, bool):
            raise UnsupportedSchema(f"a schema of true or false (at {where or '/'}) is not "
                                    "supported; write the type out")
        raise UnsupportedSchema(f"a schema has to be an object, but at {where or '/'} it is "
                                f"{json.dumps(schema)[:40]}")
    for keyword in schema:
        if keyword not in ENFORCED and keyword not in ANNOTATIONS:
            raise UnsupportedSchema(f"`{keyword}` (at {where or '/'}) is not supported by "
                                    "the grammar that constrains the reply; remove it")
    _check_string(schema, where)
    for keyword in ("properties", "$defs", "definitions"):
        for name, sub in _mapping(schema, keyword, where).items():
            check_schema(sub, f"{where}/{keyword}/{_pointer_part(name)}")
    for keyword in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for i, sub in enumerate(_list(schema, keyword, where)):
            check_schema(sub, f"{where}/{keyword}/{i}")
    items = schema.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            check_schema(sub, f"{where}/items/{i}")
    elif items is not None:
        check_schema(items, f"{where}/items")
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        check_schema(extra, f"{where}/additionalProperties")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise UnsupportedSchema(f"`$ref` (at {where or '/'}) can only point inside the "
                                f"schema (#/...), not to {ref!r}")


def _check_string(schema: dict, where: str) -> None:
    """The converter enforces one of pattern, format and a length on a string."""
    kinds = [k for k in ("pattern", "format") if k in schema]
    if "minLength" in schema or "maxLength" in schema:
        kinds.append("minLength/maxLength")
    if len(kinds) > 1:
        raise UnsupportedSchema(f"{' and '.join(f'`{k}`' for k in kinds)} together (at "
                                f"{where or '/'}) are not supported; keep one")
    form = schema.get("format")
    if form is not None and not (form in FORMATS or re.fullmatch(r"uuid[1-5]", str(form))):
        raise UnsupportedSchema(f"`format: {form}` (at {where or '/'}) is not supported; "
                                f"the grammar knows {', '.join(FORMATS)}")


def _mapping(schema: dict, keyword: str, where: str) -> dict:
    value = schema.get(keyword, {})
    if not isinstance(value, dict):
        raise UnsupportedSchema(f"`{keyword}` (at {where or '/'}) has to be an object")
    return value


def _list(schema: dict, keyword: str, where: str) -> list:
    value = schema.get(keyword, [])
    if not isinstance(value, list):
        raise UnsupportedSchema(f"`{keyword}` (at {where or '/'}) has to be a list")
    return value


def _pointer_part(name: str) -> str:
    """A property name as one part of a JSON pointer (RFC 6901), on one line."""
    return json.dumps(name.replace("~", "~0").replace("/", "~1"))[1:-1]

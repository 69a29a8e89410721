"""What a JSON schema may hold to become a grammar (:mod:`.grammar`): the keywords that
llama-cpp-python's converter enforces, in the combinations it enforces them, within bounds.

The converter takes one branch per schema (``$ref``, then ``anyOf``, a list of
types, ``const``, ``enum``, an object's ``properties``, ``allOf``, an array's ``items``, a
string's ``pattern``, ``format`` or lengths, else the bare type) and passes over every
other keyword of that schema without a word, as it passes over keywords it does not know
(``minimum``, ``uniqueItems``, ...). A reply would then break the schema while looking like
success, so :func:`check_schema` refuses both, and schemas no JSON can satisfy, naming the
keyword and where it stands (a JSON pointer).

The bounds keep the grammar small enough to parse and cheap enough to sample with: llama.cpp
parses a repetition of n as n nested groups (30,000 of them overflowed the stack and killed
the process), and a grammar with thousands of alternatives at one point costs seconds a
token for every sequence decoding beside it.
"""

from __future__ import annotations

import json
import re

try:  # the parser of Python's own regular expressions (3.11 renamed it)
    from re import _constants as _sre
    from re import _parser as _sre_parse
except ImportError:  # Python 3.10
    import sre_constants as _sre
    import sre_parse as _sre_parse

MAX_DEPTH = 32  # schemas nested inside one another
MAX_COUNT = 1000  # minItems, maxItems, minLength, maxLength, a pattern's {m,n}
MAX_VALUES = 1000  # enum and const values in one schema, all together
MAX_PATTERN = 500  # characters of one pattern
MAX_NESTED_COUNT = 128  # a pattern's nested quantifiers: the product of their largest counts
MAX_SUBSCHEMAS = 2000  # schemas in one schema, all together
MAX_OPTIONAL = 256  # optional properties of one object (the converter recurses once for each)

ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples",
               "readOnly", "writeOnly", "deprecated"}
CONTAINERS = {"$defs", "definitions"}  # hold schemas that $ref points at; enforce nothing
# Where a schema stands (a $ref may point there): a name, an index, or the place itself.
_SCHEMA_MAPS = {"$defs", "definitions", "properties"}
_SCHEMA_LISTS = {"anyOf", "allOf", "prefixItems", "items"}
_SCHEMA_ONE = {"items", "additionalProperties"}
FORMATS = ("date", "time", "date-time", "uuid")
_OBJECT = {"type", "properties", "required", "additionalProperties"}
_ITEMS = {"type", "items", "minItems", "maxItems"}
# Each branch of the converter: the keywords it enforces.
HONOURED = {
    "$ref": {"$ref"},
    "anyOf": {"anyOf"},
    "type list": {"type"},
    "const": {"const", "type"},
    "enum": {"enum", "type"},
    "properties": _OBJECT,
    "allOf": {"type", "allOf"},
    "tuple": {"type", "items", "prefixItems", "minItems", "maxItems"},
    "items": _ITEMS,
    "pattern": {"type", "pattern"},
    "format": {"type", "format"},
    "length": {"type", "minLength", "maxLength"},
    "type": {"type"},
}
ENFORCED = set().union(*HONOURED.values())
_JSON_TYPES = {"null": (type(None),), "boolean": (bool,), "string": (str,), "array": (list,),
               "object": (dict,), "number": (int, float), "integer": (int,)}
# A regular expression's quantifier {m}, {m,} or {m,n} (a brace that is escaped is skipped
# before this is tried).
_QUANTIFIER = re.compile(r"\{(\d*)(,?)(\d*)\}")
_BACK_REFERENCE = re.compile(r"\\[1-9]|\\k<")
# What a JSON string holds only escaped (and DEL, which grammar.py leaves out with them).
_NOT_IN_JSON = frozenset({*range(0x20), 0x22, 0x5C, 0x7F})
_NEGATED_CATEGORIES = {_sre.CATEGORY_NOT_DIGIT, _sre.CATEGORY_NOT_SPACE,
                       _sre.CATEGORY_NOT_WORD}


class UnsupportedSchema(ValueError):
    """A schema the grammar cannot enforce (the message names what and where)."""


def check_schema(schema) -> None:
    """UnsupportedSchema for the first thing (depth first) in ``schema`` that the grammar
    cannot enforce, that no JSON satisfies, or that passes a bound (:data:`MAX_COUNT`, ...)."""
    checker = _Checker(schema)
    checker.check(schema, "", 0)
    checker.no_recursion()


def _at(where: str) -> str:
    return f"(at {where or '/'})"


class _Checker:
    def __init__(self, root):
        self.root = root
        self.values = 0
        self.subschemas = 0
        self.refs: list[tuple[str, str]] = []  # (where a $ref stands, where it points)

    def check(self, schema, where: str, depth: int) -> None:
        if not isinstance(schema, dict):
            if isinstance(schema, bool):
                raise UnsupportedSchema(f"a schema of true or false {_at(where)} is not "
                                        "supported; write the type out")
            raise UnsupportedSchema(f"a schema has to be an object, but {_at(where)} it is "
                                    f"{json.dumps(schema)[:40]}")
        if depth > MAX_DEPTH:
            raise UnsupportedSchema(f"schemas are nested more than {MAX_DEPTH} deep "
                                    f"{_at(where)}")
        self.subschemas += 1
        if self.subschemas > MAX_SUBSCHEMAS:
            raise UnsupportedSchema(f"the schema holds more than {MAX_SUBSCHEMAS} schemas "
                                    f"(the last {_at(where)})")
        if "oneOf" in schema:
            raise UnsupportedSchema(f"`oneOf` {_at(where)} is not supported: the grammar "
                                    "cannot keep a reply from matching two of its schemas, "
                                    "which `oneOf` forbids; use `anyOf`")
        for keyword in schema:
            if keyword not in ENFORCED and keyword not in ANNOTATIONS | CONTAINERS:
                raise UnsupportedSchema(f"`{keyword}` {_at(where)} is not supported by "
                                        "the grammar that constrains the reply; remove it")
        branch = self._branch(schema, where)
        for keyword in schema:
            if keyword in ENFORCED and keyword not in HONOURED[branch]:
                raise UnsupportedSchema(f"`{keyword}` {_at(where)} is not enforced beside "
                                        f"`{_branch_keyword(branch, schema)}` by the grammar "
                                        "that constrains the reply; remove one of them")
        getattr(self, "_" + branch.replace(" ", "_").replace("$", ""))(schema, where, depth)
        for keyword in CONTAINERS:
            for name, sub in _mapping(schema, keyword, where).items():
                self.check(sub, f"{where}/{keyword}/{_pointer_part(name)}", depth + 1)

    @staticmethod
    def _branch(schema: dict, where: str) -> str:
        """The converter's branch for this schema (its ``visit``, in its order)."""
        kind = schema.get("type")
        if "$ref" in schema:
            return "$ref"
        if "anyOf" in schema:
            return "anyOf"
        if isinstance(kind, list):
            return "type list"
        if kind is not None and kind not in _JSON_TYPES:
            raise UnsupportedSchema(f"`type: {json.dumps(kind)[:40]}` {_at(where)} is not a "
                                    f"JSON type ({', '.join(_JSON_TYPES)})")
        for keyword in ("const", "enum"):
            if keyword in schema:
                return keyword
        if kind in (None, "object") and ("properties" in schema or (
                "additionalProperties" in schema and schema["additionalProperties"] is not True)):
            return "properties"
        if kind in (None, "object") and "allOf" in schema:
            return "allOf"
        if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
            tuple_form = "prefixItems" in schema or isinstance(schema.get("items"), list)
            return "tuple" if tuple_form else "items"
        if kind in (None, "string") and "pattern" in schema:
            return "pattern"
        if kind in (None, "string") and "format" in schema:
            return "format"
        if kind == "string" and ("minLength" in schema or "maxLength" in schema):
            return "length"
        if kind is None and any(k in schema for k in ENFORCED):
            keyword = next(k for k in schema if k in ENFORCED)
            raise UnsupportedSchema(f"`{keyword}` {_at(where)} needs the `type` it applies "
                                    "to beside it")
        return "type"

    # ---- one method a branch: its own rules, and the schemas inside it ----

    def _ref(self, schema: dict, where: str, depth: int) -> None:
        self._target(schema["$ref"], where)
        parts = schema["$ref"][1:].split("/")[1:] if schema["$ref"][1:] else []
        self.refs.append((where, "".join("/" + _pointer_part(_unescaped_pointer(p))
                                         for p in parts)))

    def no_recursion(self) -> None:
        """UnsupportedSchema for a schema that holds a reference to itself (directly or
        through others): the converter cannot write a grammar for it. A depth-first walk
        from each place a reference points at, through the references inside it."""
        state: dict[str, str] = {}

        def visit(place: str) -> str | None:
            state[place] = "open"
            for where, target in self.refs:
                if where == place or where.startswith(place + "/"):
                    if state.get(target) == "open":
                        return where
                    if target not in state and (found := visit(target)):
                        return found
            state[place] = "done"
            return None

        for _, target in self.refs:
            if target not in state and (found := visit(target)):
                raise UnsupportedSchema(f"`$ref` {_at(found)} points back at a schema that "
                                        "holds it (a recursive schema), which the grammar "
                                        "cannot write; give the nesting a fixed depth")

    def _target(self, ref, where: str) -> dict:
        """The schema a ``$ref`` points at: one the checker sees (the root, or one under
        ``$defs``, ``properties``, ``items``, ...), never a value (``default``,
        ``examples``, ``title``), whose keywords the checker would not see; and not a chain
        of references that comes back to itself, which describes no value."""
        if not (isinstance(ref, str) and ref.startswith("#")):
            raise UnsupportedSchema(f"`$ref` {_at(where)} can only point inside the "
                                    f"schema (#/...), not to {ref!r}")
        target, seen = self._lookup(ref), [ref]
        if target is None:
            raise UnsupportedSchema(f"`$ref` {_at(where)} has to point at a schema (the root, "
                                    "or one under $defs, definitions, properties, items, "
                                    "prefixItems, anyOf, allOf or additionalProperties), "
                                    f"but points at {ref[:60]!r}")
        follow = target
        while follow is not None and set(follow) - ANNOTATIONS == {"$ref"}:
            if follow["$ref"] in seen:
                raise UnsupportedSchema(f"`$ref` {_at(where)} starts a chain of references "
                                        f"that comes back to {follow['$ref'][:60]!r}: no "
                                        "value satisfies it")
            seen.append(follow["$ref"])
            follow = self._lookup(follow["$ref"])
        return target

    def _lookup(self, ref: str) -> dict | None:
        """The schema at the JSON pointer ``ref`` (``#/...``), reached through the places
        where schemas stand only; None if there is none."""
        target = self.root
        steps = [_unescaped_pointer(p) for p in ref[1:].split("/")[1:]] if ref[1:] else []
        while steps:
            keyword = steps.pop(0)
            place = target.get(keyword)
            if keyword in _SCHEMA_ONE and isinstance(place, dict):
                target = place
            elif keyword in _SCHEMA_MAPS and isinstance(place, dict) and steps:
                target = place.get(steps.pop(0))
            elif keyword in _SCHEMA_LISTS and isinstance(place, list) and steps:
                index = steps.pop(0)
                target = place[int(index)] if index.isdigit() and int(index) < len(
                    place) else None
            else:
                return None
            if not isinstance(target, dict):
                return None
        return target

    def _anyOf(self, schema: dict, where: str, depth: int) -> None:
        self._alternatives(schema, "anyOf", where, depth)

    def _alternatives(self, schema: dict, keyword: str, where: str, depth: int) -> None:
        alternatives = _list(schema, keyword, where)
        if not alternatives:
            raise UnsupportedSchema(f"`{keyword}` {_at(where)} has to hold a schema at least")
        for i, sub in enumerate(alternatives):
            self.check(sub, f"{where}/{keyword}/{i}", depth + 1)

    def _type_list(self, schema: dict, where: str, depth: int) -> None:
        kinds = schema["type"]
        if not kinds or any(k not in _JSON_TYPES for k in kinds):
            raise UnsupportedSchema(f"`type` {_at(where)} has to list JSON types "
                                    f"({', '.join(_JSON_TYPES)}), but is "
                                    f"{json.dumps(kinds)[:60]}")

    def _const(self, schema: dict, where: str, depth: int) -> None:
        self._constants([schema["const"]], "const", schema.get("type"), where)

    def _enum(self, schema: dict, where: str, depth: int) -> None:
        values = _list(schema, "enum", where)
        if not values:
            raise UnsupportedSchema(f"`enum` {_at(where)} is empty: no value satisfies it")
        self._constants(values, "enum", schema.get("type"), where)

    def _constants(self, values: list, keyword: str, kind, where: str) -> None:
        self.values += len(values)
        if self.values > MAX_VALUES:
            raise UnsupportedSchema(f"the schema holds more than {MAX_VALUES} `enum` and "
                                    f"`const` values (the last {_at(where)})")
        for value in values:
            if kind is not None and not _is_of_type(value, kind):
                raise UnsupportedSchema(f"`{keyword}` {_at(where)} holds "
                                        f"{json.dumps(value)[:40]}, which is not of "
                                        f"`type: {kind}`")

    def _properties(self, schema: dict, where: str, depth: int) -> None:
        properties = _mapping(schema, "properties", where)
        required = schema.get("required", [])
        if not (isinstance(required, list) and all(isinstance(n, str) for n in required)):
            raise UnsupportedSchema(f"`required` {_at(where)} has to be a list of names")
        missing = [n for n in required if n not in properties]
        if missing:
            raise UnsupportedSchema(f"`required` {_at(where)} names {missing[0]!r}, which "
                                    "`properties` does not define: the grammar enforces "
                                    "only the properties it defines")
        optional = len(properties) - len(set(required))
        if optional > MAX_OPTIONAL:
            raise UnsupportedSchema(f"`properties` {_at(where)} has {optional} optional "
                                    f"properties; at most {MAX_OPTIONAL} are allowed (list "
                                    "more of them in `required`)")
        for name, sub in properties.items():
            self.check(sub, f"{where}/properties/{_pointer_part(name)}", depth + 1)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            self.check(extra, f"{where}/additionalProperties", depth + 1)
        elif extra is not None and not isinstance(extra, bool):
            raise UnsupportedSchema(f"`additionalProperties` {_at(where)} has to be true, "
                                    "false or a schema")

    def _allOf(self, schema: dict, where: str, depth: int) -> None:
        """The converter merges the properties of object schemas, each of them required,
        into one object with no other properties; nothing else of an ``allOf`` holds."""
        seen: set[str] = set()
        for i, part in enumerate(_list(schema, "allOf", where)):
            at = f"{where}/allOf/{i}"
            target = self._resolved(part, at)
            if not (isinstance(target, dict) and "properties" in target
                    and target.get("type", "object") == "object"
                    and set(target) <= {"type", "properties", "required"} | ANNOTATIONS):
                raise UnsupportedSchema(f"`allOf` {_at(where)} merges object schemas made "
                                        f"of `properties` (and `required`) only, which "
                                        f"{at} is not")
            self._properties(target, at, depth + 1)
            twice = seen & set(target["properties"])
            if twice:
                raise UnsupportedSchema(f"`allOf` {_at(where)} defines the property "
                                        f"{sorted(twice)[0]!r} twice")
            seen |= set(target["properties"])

    def _resolved(self, part, where: str):
        """``part``, or the schema its ``$ref`` (alone beside annotations) points at."""
        if not (isinstance(part, dict) and "$ref" in part):
            return part
        return self._target(part["$ref"], where)

    def _tuple(self, schema: dict, where: str, depth: int) -> None:
        if "prefixItems" in schema and schema.get("items", False) is not False:
            raise UnsupportedSchema(f"`prefixItems` and `items` together {_at(where)} are "
                                    "not supported; the grammar writes a tuple of "
                                    "`prefixItems` only")
        keyword = "prefixItems" if "prefixItems" in schema else "items"  # items: false closes it
        items = _list(schema, keyword, where)
        if not items:
            raise UnsupportedSchema(f"`{keyword}` {_at(where)} has to hold a schema at least")
        low, high = self._counts(schema, "minItems", "maxItems", where)
        if not low <= len(items) <= (len(items) if high is None else high):
            raise UnsupportedSchema(f"`minItems`/`maxItems` {_at(where)} leave no room for "
                                    f"the {len(items)} items of `{keyword}`, the only length "
                                    "the grammar writes")
        for i, sub in enumerate(items):
            self.check(sub, f"{where}/{keyword}/{i}", depth + 1)

    def _items(self, schema: dict, where: str, depth: int) -> None:
        self._counts(schema, "minItems", "maxItems", where)
        if not schema["items"]:
            raise UnsupportedSchema(f"`items` {_at(where)} is empty; give the items' schema "
                                    "(`{\"type\": \"object\"}`, ...)")
        self.check(schema["items"], f"{where}/items", depth + 1)

    def _pattern(self, schema: dict, where: str, depth: int) -> None:
        pattern = schema["pattern"]
        problem = _pattern_problem(pattern)
        if problem:
            raise UnsupportedSchema(f"`pattern` {_at(where)} {problem}")

    def _format(self, schema: dict, where: str, depth: int) -> None:
        form = schema["format"]
        if not (form in FORMATS or re.fullmatch(r"uuid[1-5]", str(form))):
            raise UnsupportedSchema(f"`format: {form}` {_at(where)} is not supported; "
                                    f"the grammar knows {', '.join(FORMATS)}")

    def _length(self, schema: dict, where: str, depth: int) -> None:
        self._counts(schema, "minLength", "maxLength", where)

    def _type(self, schema: dict, where: str, depth: int) -> None:
        pass  # the bare type: nothing more to check

    # ---- shared rules ----

    @staticmethod
    def _counts(schema: dict, low_key: str, high_key: str, where: str) -> tuple[int, int | None]:
        """A minimum and maximum count, each an integer in [0, MAX_COUNT], in order."""
        counts = []
        for key in (low_key, high_key):
            value = schema.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_COUNT):
                raise UnsupportedSchema(f"`{key}` {_at(where)} has to be an integer in "
                                        f"[0, {MAX_COUNT}], but is {json.dumps(value)[:40]}")
            counts.append(value)
        low, high = counts[0] or 0, counts[1]
        if high is not None and low > high:
            raise UnsupportedSchema(f"`{low_key}` {low} is above `{high_key}` {high} "
                                    f"{_at(where)}: no value satisfies both")
        return low, high


def _pattern_problem(pattern) -> str | None:
    """What keeps ``pattern`` from becoming a grammar, or None."""
    if not isinstance(pattern, str):
        return "has to be a string"
    if len(pattern) > MAX_PATTERN:
        return f"is longer than {MAX_PATTERN} characters ({len(pattern)})"
    if not (pattern.startswith("^") and pattern.endswith("$")):
        return "has to start with ^ and end with $ (the grammar matches the whole string)"
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"is not a valid regular expression: {exc}"
    if _matches_unescaped(_sre_parse.parse(pattern)):
        return ("can match a quote, a backslash or a control character, which a JSON "
                "string holds only escaped; the grammar would write them raw")
    if _BACK_REFERENCE.search(pattern):
        return "holds a back-reference, which a grammar cannot match"
    if "(?" in pattern:
        return "holds (?...) (a lookaround or a named group), which the grammar does not know"
    return _quantifier_problem(pattern)


def _matches_unescaped(parsed) -> bool:
    """Whether a parsed pattern can match a character that a JSON string holds only escaped,
    with its escapes decoded (``\\x22``, ``\\u005c``, ``\\N{...}``, octal, a raw control
    character) and its ranges spanned. ``.``, a negated range and ``\\D``, ``\\S``,
    ``\\W`` cannot: the grammar leaves those characters out of them (grammar.py)."""
    for op, value in parsed:
        if op == _sre.LITERAL and value in _NOT_IN_JSON:
            return True
        if op == _sre.IN and value and value[0][0] != _sre.NEGATE and (
                len(value) > 1 or value[0][0] != _sre.CATEGORY) and any(
                _unescaped_in_range(*item) for item in value):
            return True
        if op == _sre.BRANCH and any(_matches_unescaped(b) for b in value[1]):
            return True
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT) and _matches_unescaped(value[2]):
            return True
        if op == _sre.SUBPATTERN and _matches_unescaped(value[-1]):
            return True
    return False


def _unescaped_in_range(op, value) -> bool:
    if op == _sre.LITERAL:
        return value in _NOT_IN_JSON
    if op == _sre.RANGE:
        return any(value[0] <= code <= value[1] for code in _NOT_IN_JSON)
    return op == _sre.CATEGORY and value in _NEGATED_CATEGORIES


def _quantifier_problem(pattern: str) -> str | None:
    """A quantifier over :data:`MAX_COUNT`, or quantified groups nested so that the
    product of their counts passes :data:`MAX_NESTED_COUNT`, or None. A count is the
    largest of ``{m,n}``, m + 2 for ``{m,}``, 2 for ``?``, ``*``, ``+`` and ``{0,1}``; a
    fixed ``{n}`` over an atom with no choice inside counts 1.

    A grammar matches ``((a{0,6}){0,6}){0,6}`` by keeping every way the text read so far
    splits among the groups: 0.2 s a token here, against 0.03 s for ``((a{0,4}){0,4}){0,4}``.
    """
    inner = [1]  # per open group: the largest product of counts inside it so far
    last = 1  # the product inside the atom a quantifier would apply to
    i = 0
    while i < len(pattern):
        c = pattern[i]
        quantifier = _QUANTIFIER.match(pattern, i) if c == "{" else None
        if c == "\\":
            i, last = i + 2, 1
            continue
        if c == "[":
            end = i + 1 + (pattern[i + 1:i + 2] == "]")
            while end < len(pattern) and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            i, last = end + 1, 1
            continue
        if c == "(":
            inner.append(1)
        elif c == ")" and len(inner) > 1:
            last = inner.pop()
            inner[-1] = max(inner[-1], last)
            i += 1
            continue
        elif c in "*+?" or quantifier:
            if c in "*+?" and i and pattern[i - 1] in "*+?}":  # lazy: *? +? ?? {m,n}?
                i += 1
                continue
            if quantifier:
                largest = _largest_count(quantifier)
                if isinstance(largest, str):
                    return largest
                comma, i = quantifier.group(2), quantifier.end()
            else:
                largest, i = 2, i + 1
            # A fixed count over an atom with no choice in it ({3} over a letter) adds none.
            product = 1 if quantifier and not comma and last == 1 else largest * last
            if last > 1 and product > MAX_NESTED_COUNT:
                return (f"nests quantified groups whose counts multiply to {product} (at "
                        f"character {i}); at most {MAX_NESTED_COUNT} are allowed, as each "
                        "way of splitting the text among them costs time at every token")
            inner[-1] = max(inner[-1], product)
            last = 1
            continue
        last = 1
        i += 1
    return None


def _largest_count(quantifier: re.Match) -> int | str:
    """A ``{m}``, ``{m,}`` or ``{m,n}`` quantifier's count as _quantifier_problem counts it,
    or what is wrong with it."""
    low, comma, high = quantifier.groups()
    if not low and not high:
        return f"holds an empty quantifier {quantifier.group()}"
    for count in (low, high):
        if count and int(count) > MAX_COUNT:
            return (f"repeats up to {count} times ({quantifier.group()}); at most "
                    f"{MAX_COUNT} are allowed")
    largest = int(high) if high else int(low) + (2 if comma else 0)
    if comma and high and int(high) > int(low or 0):
        largest = max(largest, 2)  # {0,1} chooses as ? does
    return largest


def _branch_keyword(branch: str, schema: dict) -> str:
    """The keyword that chose the branch, as a message names it."""
    if branch in ("type list", "type"):
        return f"type: {json.dumps(schema.get('type'))}"
    if branch == "tuple":
        return "prefixItems" if "prefixItems" in schema else "items"
    if branch == "length":
        return "minLength" if "minLength" in schema else "maxLength"
    return branch


def _is_of_type(value, kind) -> bool:
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        types = _JSON_TYPES.get(k, ())
        if isinstance(value, bool) and bool not in types:
            continue
        if isinstance(value, types) or (k == "integer" and isinstance(value, float)
                                        and value.is_integer()):
            return True
    return False


def _mapping(schema: dict, keyword: str, where: str) -> dict:
    value = schema.get(keyword, {})
    if not isinstance(value, dict):
        raise UnsupportedSchema(f"`{keyword}` {_at(where)} has to be an object")
    return value


def _list(schema: dict, keyword: str, where: str) -> list:
    value = schema.get(keyword, [])
    if not isinstance(value, list):
        raise UnsupportedSchema(f"`{keyword}` {_at(where)} has to be a list")
    return value


def _unescaped_pointer(part: str) -> str:
    """One part of a JSON pointer (RFC 6901) as the name it stands for."""
    return part.replace("~1", "/").replace("~0", "~")


def _pointer_part(name: str) -> str:
    """A property name as one part of a JSON pointer (RFC 6901), on one line."""
    return json.dumps(name.replace("~", "~0").replace("/", "~1"))[1:-1]

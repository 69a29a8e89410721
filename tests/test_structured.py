"""Structured output: JSON schemas as grammars, checked first; JSON mode and schemas through
the engine, the OpenAI client and the Ollama client on the bundled model."""

import json
import re

import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from llama_cpp import LlamaGrammar
from test_fuzz import schemas
from test_server import API_KEY, raw, server, server_log, serving  # noqa: F401 (fixtures)

from adaptive_llama.llama.grammar import (
    MAX_GROUP_DEPTH,
    UnsupportedSchema,
    check_schema,
    group_depth,
    json_grammar,
)
from adaptive_llama.llama.schema import MAX_COUNT, MAX_DEPTH, MAX_NESTED_COUNT, MAX_VALUES
from adaptive_llama.samplers import SpecError

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"},
                         "pet": {"enum": ["cat", "dog", "none"]},
                         "tags": {"type": "array", "items": {"type": "boolean"},
                                  "maxItems": 3}},
          "required": ["name", "age", "pet", "tags"], "additionalProperties": False}


def follows_person(value) -> bool:
    """PERSON checked by hand (no JSON-schema package in the test extra)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "pet", "tags"}
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and value["pet"] in ("cat", "dog", "none")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(isinstance(t, bool) for t in value["tags"]))


# ---- the schema check: what the grammar enforces, what it would let pass silently ----

@pytest.mark.parametrize("schema", [
    PERSON,
    {"type": "object"},
    {"$defs": {"id": {"type": "string", "format": "uuid"}},
     "type": "object", "properties": {"id": {"$ref": "#/$defs/id"}}},
    {"anyOf": [{"type": "integer"}, {"type": "null"}], "title": "maybe", "description": "x"},
    {"type": "array", "prefixItems": [{"const": 1}, {"type": "string", "pattern": "^a+$"}]},
    {"type": "string", "format": "date-time"},
    {"type": "object", "properties": {"minimum": {"type": "number"}}},  # a property's name
])
def test_schemas_the_grammar_enforces_pass(schema):
    check_schema(schema)
    assert json_grammar(schema)._grammar.strip()


@pytest.mark.parametrize("schema,message", [
    ({"type": "integer", "minimum": 3}, "`minimum` \\(at /\\) is not supported"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "`uniqueItems` \\(at /properties/a\\)"),
    ({"properties": {"e": {"type": "string", "format": "email"}}},
     "`format: email` \\(at /properties/e\\) is not supported"),
    ({"type": "string", "pattern": "^a$", "maxLength": 3},
     "`maxLength` \\(at /\\) is not enforced beside `pattern`"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "`not` \\(at /anyOf/1\\)"),
    ({"$ref": "https://example.com/s.json"}, "can only point inside the schema"),
    ({"type": "strng"}, "`type: \"strng\"` \\(at /\\) is not a JSON type"),
    ({"properties": {"a": True}}, "a schema of true or false \\(at /properties/a\\)"),
    ({"properties": []}, "`properties` \\(at /\\) has to be an object"),
])
def test_keywords_the_grammar_would_ignore_are_refused_by_name(schema, message):
    with pytest.raises(UnsupportedSchema, match=message):
        json_grammar(schema)


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def pattern_nesting(levels: int, count: int) -> str:
    inner = "a"
    for _ in range(levels):
        inner = f"({inner}{{0,{count}}})"
    return f"^{inner}$"


def enum_of(n: int) -> dict:
    return {"enum": [f"value {i}" for i in range(n)]}


STRING, ARRAY = {"type": "string"}, {"type": "array", "items": {"type": "integer"}}

# Each bound, at its limit (accepted) and one past it (refused, naming the keyword).
BOUNDS = [
    ({**STRING, "maxLength": MAX_COUNT}, {**STRING, "maxLength": MAX_COUNT + 1}, "`maxLength`"),
    ({**STRING, "minLength": MAX_COUNT}, {**STRING, "minLength": MAX_COUNT + 1}, "`minLength`"),
    ({**ARRAY, "maxItems": MAX_COUNT}, {**ARRAY, "maxItems": MAX_COUNT + 1}, "`maxItems`"),
    ({**ARRAY, "minItems": MAX_COUNT}, {**ARRAY, "minItems": MAX_COUNT + 1}, "`minItems`"),
    ({**STRING, "pattern": f"^a{{1,{MAX_COUNT}}}$"},
     {**STRING, "pattern": f"^a{{1,{MAX_COUNT + 1}}}$"}, "`pattern` .*repeats up to"),
    ({**STRING, "pattern": f"^(ab){{{MAX_COUNT}}}$"},
     {**STRING, "pattern": f"^(ab){{{MAX_COUNT + 1},}}$"}, "`pattern` .*repeats up to"),
    ({**STRING, "pattern": pattern_nesting(2, 11)}, {**STRING, "pattern": pattern_nesting(2, 12)},
     f"multiply to 144 .*at most {MAX_NESTED_COUNT}"),
    ({**STRING, "pattern": pattern_nesting(3, 5)}, {**STRING, "pattern": pattern_nesting(3, 6)},
     "`pattern` .*nests quantified groups"),
    (enum_of(MAX_VALUES), enum_of(MAX_VALUES + 1), f"more than {MAX_VALUES} `enum`"),
    ({"type": "object", "properties": {"a": enum_of(MAX_VALUES - 1), "b": {"const": 1}}},
     {"type": "object", "properties": {"a": enum_of(MAX_VALUES), "b": {"const": 1}}},
     "the last \\(at /properties/b\\)"),
    (nested(MAX_DEPTH), nested(MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} deep"),
]


@pytest.mark.parametrize("at_limit,past_it,message", BOUNDS)
def test_each_bound_takes_its_limit_and_refuses_one_more(at_limit, past_it, message):
    assert json_grammar(at_limit)._grammar
    with pytest.raises(UnsupportedSchema, match=message):
        json_grammar(past_it)


def test_a_count_llama_cpp_would_parse_by_deep_recursion_never_reaches_it():
    # A maxLength of n is n nested groups: 30,000 overflowed llama.cpp's stack (the server
    # died), more than 1,000 it refused. Refused here before llama.cpp sees it, at any size.
    deepest = json_grammar({**STRING, "maxLength": MAX_COUNT})._grammar
    assert MAX_COUNT <= group_depth(deepest) <= MAX_GROUP_DEPTH
    for huge in (30_000, 10**9):
        for schema in ({**STRING, "maxLength": huge}, {**ARRAY, "maxItems": huge},
                       {**STRING, "pattern": f"^a{{1,{huge}}}$"}):
            with pytest.raises(UnsupportedSchema, match=str(huge)):
                json_grammar(schema)


def test_group_depth_counts_groups_not_parentheses_in_literals_or_ranges():
    assert group_depth('root ::= ("(" [()] (a)?)? ")"') == 2
    assert group_depth('root ::= "\\"(" x') == 0


# Schemas no JSON satisfies, or whose grammar would let a reply break them: 400s that name
# the keyword and where it stands.
@pytest.mark.parametrize("schema,message", [
    ({**ARRAY, "minItems": 5, "maxItems": 2}, "`minItems` 5 is above `maxItems` 2 \\(at /\\)"),
    ({**STRING, "minLength": 3, "maxLength": 1}, "`minLength` 3 is above `maxLength` 1"),
    ({**STRING, "maxLength": -5}, "`maxLength` \\(at /\\) has to be an integer in"),
    ({**STRING, "maxLength": 2.5}, "`maxLength` .* but is 2.5"),
    ({**STRING, "maxLength": True}, "`maxLength` .* but is true"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "`allOf` \\(at /\\) merges object"),
    ({"allOf": [{"properties": {"a": STRING}}, {"properties": {"a": STRING}}]},
     "defines the property 'a' twice"),
    ({"allOf": [{"properties": {"a": STRING}, "additionalProperties": True}]},
     "/allOf/0 is not"),
    ({"type": "object", "properties": {"a": {"allOf": [{"$ref": "#/$defs/x"}]}}},
     "`\\$ref` \\(at /properties/a/allOf/0\\) has to point at a schema"),
    ({**STRING, "pattern": "^(ab$"}, "`pattern` \\(at /\\) is not a valid regular expression"),
    ({**STRING, "pattern": "^(a)\\1$"}, "back-reference"),
    ({**STRING, "pattern": "^(?=a)a$"}, "lookaround"),
    ({**STRING, "pattern": "ab"}, "has to start with \\^ and end with \\$"),
    ({**STRING, "pattern": "^a\\bc$"}, "llama.cpp cannot parse the grammar"),
    ({**STRING, "pattern": '^a"b$'}, "can match a quote, a backslash or a control"),
    ({**STRING, "pattern": "^a\\\\b$"}, "can match a quote, a backslash or a control"),
    ({**STRING, "pattern": "^a\\tb$"}, "can match a quote, a backslash or a control"),
    ({"enum": []}, "`enum` \\(at /\\) is empty"),
    ({"type": "string", "enum": ["a", 1]}, "holds 1, which is not of `type: string`"),
    ({"type": "integer", "const": "1"}, "holds \"1\", which is not of `type: integer`"),
    ({"type": "object", "properties": {"a": STRING}, "required": ["b"]},
     "`required` \\(at /\\) names 'b', which `properties` does not define"),
    ({"type": "object", "required": ["b"]}, "`required` \\(at /\\) is not enforced beside"),
    ({"type": "array", "minItems": 2}, "`minItems` \\(at /\\) is not enforced beside"),
    ({"type": ["string", "null"], "maxLength": 3}, "`maxLength` \\(at /\\) is not enforced"),
    ({"enum": ["ab", "abc"], "maxLength": 2}, "`maxLength` \\(at /\\) is not enforced"),
    ({**STRING, "pattern": "^a+$", "minLength": 2},
     "`minLength` \\(at /\\) is not enforced beside `pattern`"),
    ({"anyOf": [STRING], "type": "integer"}, "`type` \\(at /\\) is not enforced beside `anyOf`"),
    ({"anyOf": []}, "`anyOf` \\(at /\\) has to hold a schema"),
    ({"type": "array", "prefixItems": [STRING], "items": STRING},
     "`prefixItems` and `items` together"),
    ({"type": "array", "prefixItems": [STRING, STRING], "maxItems": 1},
     "leave no room for the 2 items"),
    ({"$ref": "#/$defs/a", "maxLength": 2, "$defs": {"a": STRING}},
     "`maxLength` \\(at /\\) is not enforced beside `\\$ref`"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"type": "integer", "maximum": 3}}}}}},
     "`maximum` \\(at /properties/a/properties/b/items\\)"),
    ({"type": "array", "items": {"type": "array", "items": [STRING], "maxItems": 0}},
     "\\(at /items\\) leave no room"),
])
def test_schemas_no_reply_could_follow_are_refused_by_name(schema, message):
    with pytest.raises(UnsupportedSchema, match=message):
        json_grammar(schema)


@pytest.mark.parametrize("schema", [
    {"allOf": [{"properties": {"a": STRING}}, {"$ref": "#/$defs/b"}],
     "$defs": {"b": {"type": "object", "properties": {"b": {"type": "integer"}},
                     "required": ["b"]}}},
    {"type": "array", "prefixItems": [STRING, {"type": "integer"}], "items": False,
     "minItems": 2, "maxItems": 2},
    {"type": "string", "enum": ["a", "b"]}, {"type": "number", "const": 2},
    {**STRING, "pattern": "^[a-z]+(\\.[a-z]+)*@x\\.org$"},  # nested unbounded: no blow-up
    {**STRING, "pattern": "^(\\+[0-9]{1,3})?[0-9]{4,14}$"},
])
def test_combinations_the_grammar_does_enforce_pass(schema):
    check_schema(schema)
    assert json_grammar(schema)._grammar


# ---- through the engine, with adaptive decoding choosing inside the grammar ----

@pytest.mark.parametrize("sampler", ["adaptive:eps=0.001", "adaptive:eps=0.001,temp=1.5",
                                     "top-p:p=0.9", "greedy"])
def test_every_reply_under_a_schema_parses_and_follows_it(engine, sampler):
    tokens = engine.chat_prompt_tokens([{"role": "user", "content": "Describe a person."}])
    for seed in range(3):
        result = engine.stream(tokens, sampler=sampler, seed=seed, max_tokens=120,
                               grammar=json_grammar(PERSON))
        text = result.text()
        assert result.result.finish_reason == "stop", (sampler, seed, text)
        assert follows_person(json.loads(text)), (sampler, seed, text)


def test_json_mode_gives_an_object_where_the_model_alone_does_not(engine):
    tokens = engine.chat_prompt_tokens([{"role": "user", "content": "Say hello."}])
    plain = engine.stream(tokens, sampler="greedy", max_tokens=40).text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)  # the model answers in prose: the grammar is what makes JSON
    constrained = engine.stream(tokens, sampler="greedy", max_tokens=120,
                                grammar=json_grammar()).text()
    assert isinstance(json.loads(constrained), dict)


# ---- through the real clients ----

@pytest.fixture
def openai_client(server):  # noqa: F811
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=API_KEY,
                         max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def free_objects_parse(ask) -> None:
    """Any JSON object (no schema) may hold a string the model goes on with past max_tokens:
    over a few seeds, every reply that ended by itself parses as an object, and some do."""
    ended = 0
    for seed in (3, 4, 5, 6):
        text, finish = ask(seed)
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
            ended += 1
    assert ended


def test_openai_json_schema_and_json_object_replies_parse(openai_client):
    r = openai_client.chat.completions.create(
        model="any", messages=ASK, max_tokens=120, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert follows_person(json.loads(r.choices[0].message.content))
    assert r.choices[0].finish_reason == "stop"

    def json_object(seed):
        r = openai_client.chat.completions.create(
            model="any", messages=ASK, max_tokens=160, seed=seed,
            response_format={"type": "json_object"})
        return r.choices[0].message.content, r.choices[0].finish_reason

    free_objects_parse(json_object)


def test_openai_streamed_json_joins_into_the_same_reply(openai_client):
    kwargs = dict(model="any", messages=ASK, max_tokens=120, seed=5,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": PERSON}})
    whole = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = openai_client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and follows_person(json.loads(streamed))


def test_completions_take_a_response_format_too(server):  # noqa: F811
    status, _, payload = raw("POST", server, "/v1/completions", {
        "prompt": "A person:", "max_tokens": 120, "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}})
    assert status == 200 and follows_person(json.loads(payload["choices"][0]["text"]))


@pytest.mark.parametrize("response_format,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}}},
     "`response_format`: `maximum` (at /properties/n) is not supported"),
    ({"type": "json_schema"}, "`response_format.json_schema` is required"),
    ({"type": "xml"}, "`response_format.type`"),
])
def test_openai_formats_the_server_cannot_enforce_are_400s(openai_client, response_format,
                                                           needle):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="any", messages=ASK, max_tokens=4,
                                              response_format=response_format)
    assert needle in caught.value.body["message"]


@pytest.fixture
def ollama_client(server):  # noqa: F811
    return ollama.Client(host=f"http://127.0.0.1:{server}",
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_ollama_format_json_and_schema(ollama_client):
    r = ollama_client.chat(model="smollm2", messages=ASK, format=PERSON, stream=False,
                           options={"seed": 2, "num_predict": 120})
    assert follows_person(json.loads(r.message.content))

    def format_json(seed):
        r = ollama_client.generate(model="smollm2", prompt="A person as JSON:", format="json",
                                   stream=False, options={"seed": seed, "num_predict": 160})
        return r.response, r.done_reason

    free_objects_parse(format_json)


@pytest.mark.parametrize("fmt,needle", [
    ("yaml", "`format`"),
    ({"type": "integer", "multipleOf": 2}, "`format`: `multipleOf` (at /) is not supported"),
])
def test_ollama_formats_the_server_cannot_enforce_are_400s(server, fmt, needle):  # noqa: F811
    status, _, payload = raw("POST", server, "/api/chat", {
        "model": "smollm2", "messages": ASK, "stream": False, "format": fmt})
    assert status == 400 and needle in payload["error"]


@pytest.fixture
def graph_server(smollm2_path, tmp_path):
    yield from serving(smollm2_path, tmp_path / "server.log", "--backend-sampling")


def test_under_backend_sampling_a_format_is_a_400_that_names_it(graph_server):
    status, _, payload = raw("POST", graph_server, "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 4, "response_format": {"type": "json_object"}})
    assert status == 400 and payload["error"]["param"] == "response_format"
    assert "grammar cannot run inside llama.cpp's graph" in payload["error"]["message"]
    status, _, payload = raw("POST", graph_server, "/api/chat", {
        "model": "smollm2", "messages": ASK, "stream": False, "format": "json"})
    assert status == 400 and "format: a grammar cannot run" in payload["error"]
    # the same request without a format runs
    assert raw("POST", graph_server, "/v1/chat/completions",
               {"messages": ASK, "max_tokens": 4})[0] == 200


def test_strings_leave_out_the_control_characters_json_forbids():
    gbnf = json_grammar({"type": "string"})._grammar
    assert '[^"\\\\\\x7F\\x00-\\x1F]' in gbnf and '[^"\\\\]' not in gbnf


def test_a_grammar_llama_cpp_cannot_parse_is_a_spec_error_not_a_crash(engine):
    broken = LlamaGrammar.from_string('root ::= "a" undefined-rule', verbose=False)
    with pytest.raises(SpecError, match="cannot parse the grammar"):
        engine.generate("Hi", grammar=broken, max_tokens=2)
    assert engine.generate("Hi", sampler="greedy", max_tokens=2).completion_tokens


VALIDATE = Draft202012Validator  # jsonschema: the reply checked against the schema itself

# Accepted schemas whose grammar is easy to get wrong: merged objects, tuples, typed enums,
# patterns with escapes the converter cannot write as they are, negated ranges, any char.
TRICKY = [
    {"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"b": {"type": "boolean"}}}]},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"const": 7}],
     "items": False},
    {"type": "object", "properties": {"code": {"type": "string",
                                                "pattern": "^[A-Z]{2}\\.\\d{2,4}-\\w$"}},
     "required": ["code"]},
    {"type": "string", "pattern": "^[^a-z]{3,6}$"},
    {"type": "string", "pattern": "^x.{2,5}\\S$"},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b\"c", "d\\e", "f\ng"]},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"a\"b": {"type": "integer"}, "c\\d": {"const": "\\"},
                                      "e\nf": {"type": "boolean"}},
     "required": ["a\"b", "c\\d", "e\nf"]},
    {"type": "object", "properties": {"n": {"type": ["integer", "null"]},
                                      "s": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["n", "s"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", TRICKY)
def test_replies_under_tricky_accepted_schemas_follow_them(engine, schema):
    tokens = engine.chat_prompt_tokens([{"role": "user", "content": "Answer in JSON."}])
    finished = 0
    for seed in range(4):
        result = engine.stream(tokens, sampler="adaptive:eps=0.0005,temp=1.5", seed=seed,
                               max_tokens=80, grammar=json_grammar(schema))
        text = result.text()
        if result.result.finish_reason == "stop":
            VALIDATE(schema).validate(json.loads(text))
            finished += 1
    assert finished, "no reply finished within 80 tokens"


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_a_reply_under_any_accepted_schema_follows_it(engine, schema, seed):
    try:
        grammar = json_grammar(schema)
    except UnsupportedSchema:
        return  # refusals are test_any_schema_is_a_grammar_llama_cpp_takes_or_a_clear_refusal's
    tokens = engine.chat_prompt_tokens([{"role": "user", "content": "JSON, please."}])
    result = engine.stream(tokens, sampler="adaptive:temp=1.5", seed=seed, max_tokens=48,
                           grammar=grammar)
    text = result.text()
    if result.result.finish_reason == "stop":
        VALIDATE(schema).validate(json.loads(text))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas)
def test_any_schema_is_a_grammar_llama_cpp_takes_or_a_clear_refusal(engine, schema):
    try:
        grammar = json_grammar(schema)
    except UnsupportedSchema as exc:
        assert "\n" not in str(exc)
        return
    tokens = engine.tokenize("x")
    request = engine.request(tokens, sampler="greedy", max_tokens=1, grammar=grammar)
    engine.run(request).cancel()  # the chain, grammar included, is built and freed


# ---- what mutation testing showed the tests above would miss: paths, branches, bounds ----

@pytest.mark.parametrize("schema,message", [
    # additionalProperties alone chooses the object branch, and its schema is checked
    ({"type": "object", "additionalProperties": {"type": "integer", "maximum": 2}},
     "`maximum` \\(at /additionalProperties\\)"),
    ({"additionalProperties": False, "minItems": 1}, "`minItems` \\(at /\\) is not enforced "
     "beside `properties`"),
    ({"type": "object", "properties": {}, "additionalProperties": 3},
     "`additionalProperties` \\(at /\\) has to be true, false or a schema"),
    ({"type": "object", "properties": {"a": STRING}, "required": "a"},
     "`required` \\(at /\\) has to be a list of names"),
    ({"type": "object", "properties": {"a": STRING}, "required": [1]},
     "`required` \\(at /\\) has to be a list of names"),
    # a length beside a type it does not apply to; a keyword with no type at all
    ({"type": "integer", "maxLength": 3}, "`maxLength` \\(at /\\) is not enforced beside "
     "`type: \"integer\"`"),
    ({"minItems": 2}, "`minItems` \\(at /\\) needs the `type` it applies to"),
    ({"type": "string", "format": "date", "maxLength": 3}, "`maxLength` \\(at /\\) is not "
     "enforced beside `format`"),
    ({"type": "string", "format": "email"}, "`format: email` \\(at /\\)"),
    ({"type": ["string", "null"], "enum": ["a", None]}, "`enum` \\(at /\\) is not enforced "
     "beside `type: \\[\"string\", \"null\"\\]`"),
    # schemas in containers, tuples, allOf and alternatives: each named where it stands
    ({"$defs": {"x": {"type": "integer", "maximum": 1}}, "type": "object"},
     "`maximum` \\(at /\\$defs/x\\)"),
    ({"definitions": {"a/b~c": {"not": {}}}, "type": "object"},
     "`not` \\(at /definitions/a~1b~0c\\)"),
    ({"type": "array", "prefixItems": [STRING, {"type": "integer", "minimum": 0}]},
     "`minimum` \\(at /prefixItems/1\\)"),
    ({"type": "array", "items": [STRING, {"type": "integer", "minimum": 0}]},
     "`minimum` \\(at /items/1\\)"),
    ({"type": "array", "prefixItems": [STRING, STRING], "minItems": 3},
     "leave no room for the 2 items"),
    ({"type": "array", "prefixItems": []}, "`prefixItems` \\(at /\\) has to hold a schema"),
    ({"type": "array", "items": {}}, "`items` \\(at /\\) is empty"),
    ({"allOf": [{"properties": {"a": {"type": "integer", "minimum": 1}}}]},
     "`minimum` \\(at /allOf/0/properties/a\\)"),
    ({"allOf": [{"type": "string", "properties": {"a": STRING}}]}, "/allOf/0 is not"),
    ({"allOf": [{"$ref": "#/$defs/s"}], "$defs": {"s": STRING}}, "/allOf/0 is not"),
    ({"anyOf": [STRING, {"type": "integer", "minimum": 1}]}, "`minimum` \\(at /anyOf/1\\)"),
    ({"properties": {"a": {"oneOf": []}}}, "`oneOf` \\(at /properties/a\\) is not supported"),
    ({"type": [], "title": "x"}, "`type` \\(at /\\) has to list JSON types"),
    ({"type": ["string", "text"]}, "`type` \\(at /\\) has to list JSON types"),
    ({"type": "array", "items": {"enum": [True]}, "maxItems": 2, "minItems": "1"},
     "`minItems` \\(at /\\) has to be an integer"),
    ({"type": "object", "properties": {"a": {"$ref": 3}}},
     "`\\$ref` \\(at /properties/a\\) can only point inside"),
])
def test_each_rule_is_named_with_where_it_stands(schema, message):
    with pytest.raises(UnsupportedSchema, match=message):
        json_grammar(schema)


def test_the_count_of_schemas_is_bounded():
    from adaptive_llama.llama.schema import MAX_SUBSCHEMAS

    def wide(n):  # one object, n - 1 properties (all required: optional ones have a bound)
        names = [f"p{i}" for i in range(n - 1)]
        return {"type": "object", "required": names,
                "properties": {name: {"type": "integer"} for name in names}}
    check_schema(wide(MAX_SUBSCHEMAS))
    with pytest.raises(UnsupportedSchema, match=f"more than {MAX_SUBSCHEMAS} schemas"):
        check_schema(wide(MAX_SUBSCHEMAS + 1))


def test_an_object_has_at_most_max_optional_properties():
    from adaptive_llama.llama.schema import MAX_OPTIONAL

    def optional(n, required=0):
        names = [f"p{i}" for i in range(n)]
        return {"type": "object", "required": names[:required],
                "properties": {name: {"type": "integer"} for name in names}}
    json_grammar(optional(MAX_OPTIONAL))
    json_grammar(optional(MAX_OPTIONAL + 10, required=10))
    with pytest.raises(UnsupportedSchema, match=f"has {MAX_OPTIONAL + 1} optional properties"):
        json_grammar(optional(MAX_OPTIONAL + 1))
    # 986 of them were a RecursionError in the converter: a plain-text 500
    with pytest.raises(UnsupportedSchema, match="optional properties"):
        json_grammar(optional(986))


# Escapes of what a JSON string holds only escaped: decoded before the pattern is checked.
@pytest.mark.parametrize("pattern", [
    "^\\x22$", "^\\u0022$", "^\\x5c$", "^\\u005c$", "^\\x5C+$", "^a\x01$", "^a\nb$",
    "^\\N{QUOTATION MARK}$", "^\\042$", "^[ -~]+$", "^[!-#]$", "^[\\x00-\\x1f]$",
    "^(a|\\x22)$", "^[a\\s\\S]$", "^x\\x7f$",
])
def test_patterns_that_can_match_an_unescaped_character_are_refused(pattern):
    with pytest.raises(UnsupportedSchema, match="can match a quote, a backslash or a control"):
        json_grammar({"type": "string", "pattern": pattern})


@pytest.mark.parametrize("pattern", [
    "^[ -!#-\\x5b\\x5d-~]+$", "^.+$", "^[^@]+@[^@]+$", "^\\S+\\s\\w\\d\\D\\W$", "^[\\x23-\\x5b]$", "^a\\.b$",
])
def test_patterns_whose_characters_json_holds_raw_pass(pattern, engine):
    grammar = json_grammar({"type": "string", "pattern": pattern})
    for seed in range(3):
        text = engine.generate("Write:", grammar=grammar, sampler="adaptive", seed=seed,
                               max_tokens=24).text
        if text.endswith('"'):  # not cut by max_tokens
            value = json.loads(text)
            assert re.fullmatch(pattern, value), (pattern, value)


@pytest.mark.parametrize("schema,message", [
    # keywords behind a $ref into a value, which the check did not see
    ({"$ref": "#/default", "default": {"type": "integer", "maximum": 3}},
     "has to point at a schema"),
    ({"$ref": "#/examples/0", "examples": [{"type": "array", "uniqueItems": True}]},
     "has to point at a schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/default/x"}},
      "default": {"x": {"type": "string", "minLength": 2, "maxLength": 2000}}},
     "has to point at a schema"),
    ({"$ref": "#/title", "title": "x"}, "has to point at a schema"),
    ({"$ref": "#/$defs", "$defs": {"a": STRING}}, "has to point at a schema"),
    ({"type": "object", "properties": {"a": STRING, "c": {"$ref": "#/properties/b"}}},
     "\\(at /properties/c\\) has to point at a schema"),
    ({"anyOf": [STRING, {"$ref": "#/anyOf/7"}]}, "\\(at /anyOf/1\\) has to point at"),
    # oneOf is not enforced: refused in words
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "`oneOf` \\(at /\\) is not supported"),
    ({"oneOf": [{"type": "integer"}, {"type": "integer"}]}, "`oneOf`"),
    # references that never end
    ({"$ref": "#"}, "comes back to '#'"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "comes back to '#/\\$defs/a'"),
    ({"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "$ref": "#/$defs/n"}}}, "required": ["kids"]}}, "$ref": "#/$defs/n"},
     "\\(at /\\$defs/n/properties/kids/items\\) points back at a schema that holds it"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#"}}}},
     "\\(at /properties/a/items\\) points back"),
])
def test_references_only_to_schemas_the_check_sees_and_that_end(schema, message):
    with pytest.raises(UnsupportedSchema, match=message):
        json_grammar(schema)


def test_references_to_schema_places_still_pass():
    defs = {"$defs": {"s": STRING, "list": {"type": "array", "items": {"$ref": "#/$defs/s"}}}}
    for schema in ({**defs, "$ref": "#/$defs/list"},
                   {"type": "object", "properties": {"a": STRING, "b": {"$ref": "#/properties/a"}}},
                   {"anyOf": [STRING, {"$ref": "#/anyOf/0"}]},
                   {"type": "array", "items": [STRING, {"$ref": "#/items/0"}]}):
        json_grammar(schema)


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "object", "properties": {"a": STRING}, "required": ["a"],
                "description": "x"}]},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "object", "additionalProperties": False},
    {"type": "integer", "enum": [1, 2.0]}, {"type": "number", "enum": [1, 2.5]},
    {"enum": ["a", None]}, {"type": "boolean", "const": False},
    {"type": "array", "items": [STRING]}, {"type": "array", "prefixItems": [STRING],
                                           "minItems": 1, "maxItems": 1},
])
def test_the_rules_leave_what_the_grammar_enforces_alone(schema):
    assert json_grammar(schema)._grammar


@pytest.mark.parametrize("schema", [
    {"type": "integer", "enum": [1, True]}, {"type": "integer", "enum": [1.5]},
    {"type": "null", "const": 0}, {"type": "boolean", "const": 0},
])
def test_enum_values_of_another_type_are_refused(schema):
    with pytest.raises(UnsupportedSchema, match="which is not of `type:"):
        json_grammar(schema)


# A pattern's quantifiers: what counts towards the nesting bound, and what does not.
@pytest.mark.parametrize("pattern,refused", [
    ("^(a{0,64})*$", False), ("^(a{0,65})*$", True),        # * counts as 2
    ("^(a{0,64})+$", False), ("^(a{0,65})?$", True),        # so do + and ?
    ("^(a{0,12}){8,}$", False), ("^(a{0,12}){9,}$", True),  # {m,}: m + 2
    ("^((a{0,12})b){10}$", False), ("^((a{0,12})b){11}$", True),  # through a plain group
    ("^(a{0,100})(b{0,100})(c{0,100})$", False),            # side by side: no product
    ("^(a{0,12}|b{0,12}){10}$", False), ("^(a|b{0,13}){10}$", True),  # alternatives: the largest
    ("^(a{0,64}?)*$", False), ("^(a{0,65}?)*?$", True),      # a lazy ? adds nothing
    ("^\\(a{0,100}\\){0,100}$", False),                      # escaped parentheses: no group
    ("^[(]a{0,100}[)]{0,100}$", False),                      # parentheses in a range
    ("^[]()]a{0,100}[)]{0,100}$", False), ("^[\\](]a{0,100}[)]{0,100}$", False),
    ("^a\\{0,2000\\}$", False),                              # an escaped brace: no quantifier
    ("^a{,5}$", False), ("^a{}$", True),                      # {,n}: {0,n}; {} no count
    ("^a{1001,}$", True), ("^(a{0,1}){1000}$", True), ("^(a){1000}$", False),
    ("^(a{0,1}){64}$", False), ("^(a{0,1}){65}$", True), ("^(a{2}){1000}$", False),
])
def test_the_nesting_bound_counts_what_multiplies(pattern, refused):
    from adaptive_llama.llama.schema import _quantifier_problem
    assert (_quantifier_problem(pattern) is not None) == refused, _quantifier_problem(pattern)

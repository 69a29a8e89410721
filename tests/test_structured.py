"""Structured output: JSON schemas as grammars, checked first; JSON mode and schemas through
the engine, the OpenAI client and the Ollama client on the bundled model."""

import json

import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from llama_cpp import LlamaGrammar
from test_fuzz import schemas
from test_server import API_KEY, raw, server, server_log, serving  # noqa: F401 (fixtures)

from adaptive_llama.llama.grammar import UnsupportedSchema, check_schema, json_grammar
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
     "`pattern` and `minLength/maxLength` together"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "`not` \\(at /anyOf/1\\)"),
    ({"$ref": "https://example.com/s.json"}, "can only point inside the schema"),
    ({"type": "strng"}, "cannot become a grammar"),
    ({"properties": {"a": True}}, "a schema of true or false \\(at /properties/a\\)"),
    ({"properties": []}, "`properties` \\(at /\\) has to be an object"),
])
def test_keywords_the_grammar_would_ignore_are_refused_by_name(schema, message):
    with pytest.raises(UnsupportedSchema, match=message):
        json_grammar(schema)


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


def test_openai_json_schema_and_json_object_replies_parse(openai_client):
    r = openai_client.chat.completions.create(
        model="any", messages=ASK, max_tokens=120, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert follows_person(json.loads(r.choices[0].message.content))
    assert r.choices[0].finish_reason == "stop"
    r = openai_client.chat.completions.create(
        model="any", messages=ASK, max_tokens=120, seed=3,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


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
    r = ollama_client.generate(model="smollm2", prompt="A person as JSON:", format="json",
                               stream=False, options={"seed": 2, "num_predict": 120})
    assert isinstance(json.loads(r.response), dict)


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

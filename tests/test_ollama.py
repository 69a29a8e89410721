"""Ollama's routes on `adaptive-llama serve`, driven by the `ollama` Python client (end to end)."""

import json
import math

import ollama
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import (  # noqa: F401 (fixtures)
    API_KEY,
    SAMPLING_OPTIONS,
    json_values,
    raw,
    server,
    server_log,
    wait_idle,
)

MODEL = "smollm2"  # the bundled model's short name
HELLO = [{"role": "user", "content": "Name one colour."}]


@pytest.fixture
def client(server):  # noqa: F811
    return ollama.Client(host=f"http://127.0.0.1:{server}",
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_tags_show_and_version_describe_the_served_model(client, server):  # noqa: F811
    models = client.list().models
    assert [m.model for m in models] == [MODEL]
    assert models[0].size > 50_000_000 and models[0].details.format == "gguf"
    shown = client.show(MODEL)
    assert "im_start" in shown.template  # SmolLM2's chat template
    status, _, body = raw("GET", server, "/api/version")
    assert status == 200 and body["version"]
    assert tuple(map(int, body["version"].split("."))) >= (0, 5, 0)  # what clients require


def test_details_and_model_info_are_written_as_ollama_writes_them(client):
    details = client.list().models[0].details
    # SmolLM2's GGUF says general.file_type 3: llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_1
    assert (details.family, details.parameter_size, details.quantization_level) == \
        ("llama", "135M", "Q4_1")
    info = client.show(MODEL).modelinfo
    assert info["llama.context_length"] == 8192 and info["general.architecture"] == "llama"
    assert info["general.parameter_count"] == 134_515_008
    assert not any(key.startswith("tokenizer.") for key in info)


def test_chat_streams_the_same_text_as_one_object(client):
    options = {"seed": 5, "num_predict": 16, "sampler": "adaptive:eps=0.0005"}
    whole = client.chat(MODEL, messages=HELLO, options=options)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.done_reason in ("stop", "length") and 1 <= whole.eval_count <= 16
    assert whole.prompt_eval_count > 5 and whole.eval_duration > 0
    parts = list(client.chat(MODEL, messages=HELLO, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_chat_history_reaches_the_model(client):
    messages = [{"role": "system", "content": "Answer with one word."},
                {"role": "user", "content": "Say 'banana'."},
                {"role": "assistant", "content": "banana"},
                {"role": "user", "content": "Again, the same word."}]
    reply = client.chat(MODEL, messages=messages, options={"temperature": 0, "num_predict": 8})
    assert "banana" in reply.message.content.lower()


def test_generate_counts_on_greedily_and_stops_where_asked(client):
    reply = client.generate(MODEL, prompt="1, 2, 3, 4, 5,", raw=True,
                            options={"temperature": 0, "num_predict": 12})
    assert reply.response.startswith(" 6, 7")
    stopped = client.generate(MODEL, prompt="1, 2, 3, 4, 5,", raw=True,
                              options={"temperature": 0, "num_predict": 12, "stop": ["8"]})
    assert stopped.response.rstrip(", ").endswith("7") and "8" not in stopped.response
    assert stopped.done_reason == "stop"
    loaded = client.generate(MODEL, prompt="")  # Ollama's way to load a model
    assert loaded.done and loaded.response == ""


@pytest.mark.parametrize("options,sampler", [
    ({}, "adaptive:eps=0.005"),
    ({"sampler": "eta:eps=0.0009"}, "eta:eps=0.0009"),
    ({"min_p": 0.1, "top_p": 0.9, "top_k": 40}, "min-p:p=0.1"),
    ({"top_p": 0.9, "top_k": 40}, "top-p:p=0.9"),
    ({"top_k": 40, "temperature": 0.7}, "top-k:k=40,temp=0.7"),
    ({"temperature": 0, "sampler": "adaptive"}, "greedy"),
    ({"repeat_penalty": 1.2, "repeat_last_n": 32},
     "adaptive:eps=0.005,mode=multinomial+penalties:repeat=1.2,freq=0,present=0,last_n=32"),
    ({"presence_penalty": 0.5, "frequency_penalty": 0.25, "repeat_last_n": -1},
     "adaptive:eps=0.005,mode=multinomial+penalties:repeat=1,freq=0.25,present=0.5,"
     "last_n=1048576"),
    ({"repeat_penalty": 1.2, "repeat_last_n": 0}, "adaptive:eps=0.005,mode=multinomial"),
    ({"mirostat": 2, "mirostat_tau": 3.0, "top_k": 40}, "mirostat:tau=3,eta=0.1"),
    ({"mirostat": 1, "mirostat_eta": 0.2}, "mirostat1:tau=5,eta=0.2,m=100"),
    ({"adaptive_target": 0.3, "adaptive_decay": 0.5}, "adaptive-p:target=0.3,decay=0.5"),
    ({"adaptive_target": -1, "min_p": 0.1}, "min-p:p=0.1"),
    ({"sampler": "p-less:temp=1.2"}, "p-less:temp=1.2"),
    ({"sampler": "top-n-sigma:n=1,temp=1.5"}, "dist:temp=1.5+top-n-sigma:n=1"),
])
def test_options_choose_the_sampler(server, options, sampler):  # noqa: F811
    status, _, body = raw("POST", server, "/api/generate", {
        "model": MODEL, "prompt": "Hello", "stream": False,
        "options": {"num_predict": 2, **options}})
    assert status == 200, body
    assert body["sampler_stats"]["sampler"].startswith(sampler)


def test_a_client_that_streams_gets_ndjson(server):  # noqa: F811
    status, headers, payload = raw("POST", server, "/api/chat", {
        "model": MODEL, "messages": HELLO, "options": {"num_predict": 4, "seed": 1}},
        parse=False)
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in payload.decode().splitlines()]
    assert lines[-1]["done"] and "sampler_stats" in lines[-1]
    assert all("message" in line for line in lines)


@pytest.mark.parametrize("path,body,status,needle", [
    ("/api/chat", b"{not json", 400, "not valid JSON"),
    ("/api/chat", {"messages": HELLO}, 400, "`model`"),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "keep_alive": "soon"}, 400,
     "`keep_alive` has to be a duration"),
    ("/api/chat", {"model": "llama3", "messages": HELLO}, 404,
     "model 'llama3' not found; this server serves smollm2"),
    ("/api/show", {"model": "llama3"}, 404, "'llama3' not found"),
    ("/api/chat", {"model": MODEL, "messages": HELLO, "options": {"sampler": "nucleus"}},
     400, "options.sampler"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"temperature": "hot"}},
     400, "options.temperature"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"seed": -1}}, 400,
     "options.seed"),
    ("/api/generate", {"model": MODEL, "prompt": "word " * 600, "raw": True}, 400,
     "context window"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"repeat_penalty": 0}},
     400, "options.repeat_penalty: `repeat_penalty` has to be in (0, 10]"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"mirostat": 3}},
     400, "options.mirostat"),
    ("/api/generate", {"model": MODEL, "prompt": "x",
                       "options": {"adaptive_target": 0.3, "min_p": 0.05}},
     400, "options.adaptive_target: `adaptive_target`: adaptive-p runs alone here"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"adaptive_target": 2}},
     400, "options.adaptive_target: `adaptive_target` has to be in [0, 1]"),
    ("/api/generate", {"model": MODEL, "prompt": "word " * 20, "raw": True,
                       "options": {"num_ctx": 10}}, 400, "`options.num_ctx` is 10"),
    ("/api/show", {}, 400, "`model`"),
    ("/api/nothing", {}, 404, "Not Found"),
])
def test_bad_requests_get_ollamas_error_shape_and_the_server_keeps_serving(
        server, client, path, body, status, needle):  # noqa: F811
    got, _, answer = raw("POST", server, path, body)
    assert got == status and set(answer) == {"error"} and needle in answer["error"], answer
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(MODEL, messages=HELLO, options={"sampler": "top-k:k=1e400"})
    assert caught.value.status_code == 400 and "k" in caught.value.error
    assert client.chat(MODEL, messages=HELLO, options={"num_predict": 4}).done
    wait_idle(server)


def test_the_api_key_guards_the_ollama_routes_too(server):  # noqa: F811
    status, headers, body = raw("GET", server, "/api/tags", key=None)
    assert status == 401 and set(body) == {"error"} and "API key" in body["error"]
    assert headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=f"http://127.0.0.1:{server}").list()
    assert caught.value.status_code == 401


def test_options_of_the_ollama_client_reach_the_chain(client):
    """The ollama package's own Options: penalties, mirostat and num_ctx act."""
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat"
    plain = client.generate(MODEL, prompt=prompt, raw=True,
                            options={"temperature": 0, "num_predict": 3})
    assert plain.response.startswith(" sat")
    penalised = client.generate(MODEL, prompt=prompt, raw=True, options={
        "temperature": 0, "num_predict": 3, "repeat_penalty": 1.5, "repeat_last_n": 64})
    assert not penalised.response.startswith(" sat")  # " sat" is in the prompt
    # num_ctx: this request's window, prompt included, inside the slot's.
    tokens = plain.prompt_eval_count
    short = client.generate(MODEL, prompt=prompt, raw=True,
                            options={"temperature": 0, "num_ctx": tokens + 2})
    assert short.eval_count == 2 and short.done_reason == "length"


@pytest.mark.parametrize("num_predict", [-1, -2])
def test_num_predict_below_zero_runs_until_the_context_is_full(client, num_predict):
    # Ollama: -1 is "no limit" (-2: "fill the context"); here both stop where the slot's
    # window ends, never before it unless the model ends its reply.
    prompt = "Count on: " + ", ".join(str(i) for i in range(1, 40))
    reply = client.generate(MODEL, prompt=prompt, raw=True,
                            options={"temperature": 0, "num_predict": num_predict})
    assert reply.done_reason == "length"
    assert reply.prompt_eval_count + reply.eval_count == 512  # --ctx: each slot's window


@pytest.mark.parametrize("value,shown", [(8192, 8192), (1e-5, 1e-5), ("135M", "135M"),
                                         (math.inf, "inf"), (math.nan, "nan"),
                                         ([1.0, -math.inf], [1.0, "-inf"])])
def test_model_info_values_are_what_json_can_hold(value, shown):
    from adaptive_llama.server.ollama import _json_safe

    assert _json_safe(value) == shown and type(_json_safe(value)) is type(shown)


@settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fields=st.fixed_dictionaries({}, optional={
    "keep_alive": st.one_of(json_values, st.sampled_from(["5m", "-1", "1h30m", "0s"])),
    "format": json_values, "stream": json_values, "raw": json_values,
    "options": st.one_of(json_values, st.fixed_dictionaries({}, optional={
        name: json_values for name in ("temperature", "top_p", "seed", "num_ctx",
                                       "num_predict", "sampler", *SAMPLING_OPTIONS)}))}))
def test_any_ollama_fields_get_an_answer_or_a_400(server, fields):  # noqa: F811
    body = {"model": MODEL, "prompt": "Hi", **fields}
    options = body.get("options")
    if isinstance(options, dict) and isinstance(options.get("num_predict"), int):
        options["num_predict"] = min(options["num_predict"], 3)
    else:
        body["options"] = {**(options if isinstance(options, dict) else {}), "num_predict": 3}
    status, _, payload = raw("POST", server, "/api/generate", json.dumps(body).encode(),
                             parse=False)
    assert status in (200, 400), payload
    if status == 400:
        error = json.loads(payload)["error"]
        assert isinstance(error, str) and "\n" not in error
    assert raw("GET", server, "/health")[2]["status"] == "ok"

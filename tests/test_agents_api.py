"""The APIs agents call: OpenAI's Responses API and Anthropic's Messages API, through the
real ``openai`` and ``anthropic`` SDKs against a real ``serve`` (the bundled model with the
chatml-tools template, and the tiny reasoning model of tests/reasoning_model.py), and raw
HTTP where the SDKs hide the wire (status codes, error shapes, a dropped connection)."""

import json
import socket
import time

import anthropic
import jsonschema
import openai
import pytest
from reasoning_model import ANSWER_TEXT, THINKING_TEXT
from test_server import API_KEY, openai_client_for, raw, serving, wait_idle
from test_tools import ASK, WEATHER, follows_weather

QUESTION = "Name three colours."
FLAT_TOOLS = [{"type": "function", "name": "get_weather",
               "description": "The weather in a city now", "parameters": WEATHER}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city now",
                    "input_schema": WEATHER}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def agents_server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("agents") / "server.log"
    yield from serving(smollm2_path, log, "--chat-template", "chatml-tools", "--ctx", "1024",
                       "--sampler", "greedy")


@pytest.fixture(scope="module")
def thinking_server(reasoning_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("agents-r1") / "server.log"
    yield from serving(reasoning_model, log, "--sampler", "greedy")


@pytest.fixture
def openai_client(agents_server):
    return openai_client_for(agents_server)


def anthropic_client_for(port, key=API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=key,
                               max_retries=0, timeout=120)


@pytest.fixture
def claude(agents_server):
    return anthropic_client_for(agents_server)


# ---- Responses ----

def test_a_response_is_the_chat_routes_reply_and_its_stream_adds_up_to_it(openai_client):
    chat = openai_client.chat.completions.create(
        model="any", messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": QUESTION}], max_tokens=24)
    whole = openai_client.responses.create(model="any", instructions="Be brief.",
                                           input=QUESTION, max_output_tokens=24)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    with openai_client.responses.stream(model="any", instructions="Be brief.",
                                        input=QUESTION, max_output_tokens=24) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == whole.status


def test_the_token_limit_makes_a_response_incomplete(openai_client):
    cut = openai_client.responses.create(model="any", input=QUESTION, max_output_tokens=3)
    assert cut.status == "incomplete"
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def test_a_required_call_comes_as_a_function_call_item_and_its_output_goes_back(
        openai_client):
    first = openai_client.responses.create(model="any", input=ASK, tools=FLAT_TOOLS,
                                           tool_choice="required", max_output_tokens=120,
                                           parallel_tool_calls=False)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and follows_weather(json.loads(call.arguments))
    follow_up = [*ASK, {"type": "function_call", "call_id": call.call_id,
                        "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id,
                  "output": "sunny, 22 C"}]
    second = openai_client.responses.create(model="any", input=follow_up, tools=FLAT_TOOLS,
                                            max_output_tokens=8)
    # the call and its result were rendered into the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    with openai_client.responses.stream(
            model="any", input=ASK, tools=FLAT_TOOLS, max_output_tokens=120,
            tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    [item] = [i for i in final.output if i.type == "function_call"]
    assert len(done) == 1 and done[0].arguments == item.arguments
    assert follows_weather(json.loads(item.arguments))


def test_a_json_schema_format_shapes_the_output_text(openai_client):
    response = openai_client.responses.create(
        model="any", input="Invent a person.", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(response.output_text), PERSON)


@pytest.mark.parametrize("body,param,needle", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id",
     "keeps no responses"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input.1.call_id", "no function_call before it"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0", "text only"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type",
     "not 'web_search_call'"),
    ({"input": [{"role": "user", "content": "hi"}] * 10_000}, "input", "at most"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}}},
     "text.format", "minimum"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input.0.arguments", "required"),
])
def test_responses_that_cannot_be_done_are_400s_naming_the_field(agents_server, body, param,
                                                                  needle):
    status, _, payload = raw("POST", agents_server, "/v1/responses",
                             {"max_output_tokens": 4, **body})
    assert status == 400, payload
    assert payload["error"]["param"] == param and needle in payload["error"]["message"]
    status, _, payload = raw("POST", agents_server, "/v1/responses",
                             {"input": "hi", "max_output_tokens": 2})
    assert status == 200 and payload["status"] == "incomplete"


def test_a_responses_thinking_comes_as_a_reasoning_item(thinking_server):
    client = openai_client_for(thinking_server)
    whole = client.responses.create(model="r1", input="What is 17 times 23?")
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THINKING_TEXT.strip()
    assert whole.output_text == ANSWER_TEXT
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model="r1", input="What is 17 times 23?") as stream:
        events = list(stream)
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thinking == THINKING_TEXT.strip()
    # no thinking at all with effort "none"
    plain = client.responses.create(model="r1", input="What is 17 times 23?",
                                    reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["message"]


# ---- Messages ----

def test_a_message_is_the_chat_routes_reply_and_its_stream_adds_up_to_it(claude,
                                                                          openai_client):
    chat = openai_client.chat.completions.create(
        model="any", messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": QUESTION}], max_tokens=24)
    whole = claude.messages.create(model="local", system="Be brief.",
                                   max_tokens=24,
                                   messages=[{"role": "user", "content": QUESTION}])
    assert [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    with claude.messages.stream(model="local", system="Be brief.", max_tokens=24,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    counted = claude.messages.count_tokens(model="local", system="Be brief.",
                                           messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == whole.usage.input_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(claude):
    ask = [{"role": "user", "content": QUESTION}]
    whole = claude.messages.create(model="m", max_tokens=40, messages=ask).content[0].text
    word = whole.split()[len(whole.split()) // 2]
    cut = claude.messages.create(model="m", max_tokens=40, messages=ask,
                                 stop_sequences=["never there", word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == whole[:whole.index(word)]


def test_a_forced_tool_use_and_its_result_sent_back(claude):
    first = claude.messages.create(model="m", max_tokens=120, messages=ASK,
                                   tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and follows_weather(use.input)
    history = [*ASK, {"role": "assistant", "content": [block.model_dump()
                                                       for block in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "sunny, 22 C"}]}]
    second = claude.messages.create(model="m", max_tokens=8, messages=history,
                                    tools=ANTHROPIC_TOOLS)
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    with claude.messages.stream(model="m", max_tokens=120, messages=ASK,
                                tools=ANTHROPIC_TOOLS, tool_choice={
                                    "type": "any", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    [streamed] = [block for block in final.content if block.type == "tool_use"]
    assert follows_weather(streamed.input) and final.stop_reason == "tool_use"


@pytest.mark.parametrize("body,needle", [
    ({"messages": ASK}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "text only"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                  "tool_use_id": "toolu_x",
                                                  "content": "1"}]}]},
     "no tool_use before it"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "'hologram'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 10_000}]},
     "at most"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                       "content": "Sure"}]}, "end with a user"),
    ({"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0"),
    ({"messages": ASK, "thinking": {"type": "enabled"}}, "budget_tokens"),
])
def test_messages_that_cannot_be_done_are_400s_in_anthropics_shape(agents_server, body,
                                                                   needle):
    body = {"model": "m", "max_tokens": 4, **body} if "max_tokens" not in needle else \
        {"model": "m", **body}
    status, _, payload = raw("POST", agents_server, "/v1/messages", body,
                             headers={"x-api-key": API_KEY}, key=None)
    assert status == 400, payload
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert needle in payload["error"]["message"]
    status, _, _ = raw("POST", agents_server, "/v1/messages",
                       {"model": "m", "max_tokens": 2, "messages": ASK})
    assert status == 200


def test_the_key_comes_as_x_api_key_and_a_wrong_one_is_anthropics_401(agents_server):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic_client_for(agents_server, key="wrong").messages.create(
            model="m", max_tokens=2, messages=ASK)
    assert caught.value.body["error"]["type"] == "authentication_error"
    status, _, payload = raw("GET", agents_server, "/v1/models", key=None,
                             headers={"x-api-key": API_KEY})
    assert status == 200 and payload["data"]


def test_a_message_thinks_only_when_the_request_enables_it(thinking_server):
    client = anthropic_client_for(thinking_server)
    ask = [{"role": "user", "content": "What is 17 times 23?"}]
    thought = client.messages.create(model="r1", max_tokens=64, messages=ask,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in thought.content] == ["thinking", "text"]
    assert thought.content[0].thinking == THINKING_TEXT.strip()
    assert thought.content[1].text == ANSWER_TEXT
    with client.messages.stream(model="r1", max_tokens=64, messages=ask, thinking={
            "type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THINKING_TEXT.strip()
    plain = client.messages.create(model="r1", max_tokens=64, messages=ask)
    assert [block.type for block in plain.content] == ["text"]
    assert plain.usage.output_tokens < thought.usage.output_tokens


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "m", "max_tokens": 400, "stream": True, "messages": [
        {"role": "user", "content": "Count from 1 to 1000."}]}),
    ("/v1/responses", {"max_output_tokens": 400, "stream": True,
                       "input": "Count from 1 to 1000."}),
])
def test_a_client_that_leaves_mid_stream_frees_its_slot(agents_server, path, body):
    with socket.create_connection(("127.0.0.1", agents_server)) as sock:
        data = json.dumps(body).encode()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                     f"application/json\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        seen = b""
        deadline = time.monotonic() + 60
        while b"delta" not in seen and time.monotonic() < deadline:
            seen += sock.recv(4096)
        assert b"delta" in seen
    idle = wait_idle(agents_server)
    assert idle["cancelled"] >= 1


# ---- what clients written for llama-server expect ----

YES_NO = 'root ::= "yes" | "no"'


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", {"messages": ASK}),
                                       ("/v1/completions", {"prompt": "Is it sunny?"})])
def test_llama_servers_constraints_are_honoured(agents_server, path, base):
    for field, check in [
            ({"grammar": YES_NO}, lambda text: text in ("yes", "no")),
            ({"json_schema": PERSON}, lambda text: jsonschema.validate(json.loads(text),
                                                                       PERSON) is None),
            ({"response_format": {"type": "json_object", "schema": PERSON}},
             lambda text: jsonschema.validate(json.loads(text), PERSON) is None)]:
        status, _, payload = raw("POST", agents_server, path,
                                 {**base, **field, "max_tokens": 60})
        assert status == 200, payload
        choice = payload["choices"][0]
        assert check(choice["message"]["content"] if "message" in choice else choice["text"])


@pytest.mark.parametrize("fields,param,needle", [
    ({"grammar": YES_NO, "json_schema": PERSON}, "grammar", "both constrain"),
    ({"grammar": 'root ::= "a" | <|im_end|>'}, "grammar", "names tokens"),
    ({"grammar": "root ::= missing"}, "grammar", "cannot parse"),
    ({"grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "grammar", "deep"),
    ({"json_schema": {"type": "integer", "minimum": 3}}, "json_schema", "minimum"),
])
def test_constraints_that_cannot_be_done_are_400s(agents_server, fields, param, needle):
    status, _, payload = raw("POST", agents_server, "/v1/chat/completions",
                             {"messages": ASK, "max_tokens": 4, **fields})
    assert status == 400 and payload["error"]["param"] == param
    assert needle in payload["error"]["message"]


def test_the_routes_answer_without_v1_and_name_a_system_fingerprint(agents_server):
    bare = openai.OpenAI(base_url=f"http://127.0.0.1:{agents_server}", api_key=API_KEY,
                         max_retries=0)
    assert [m.id for m in bare.models.list().data] == ["smollm2"]
    reply = bare.chat.completions.create(model="m", messages=ASK, max_tokens=4)
    assert reply.system_fingerprint.startswith("adaptive-llama-")
    assert bare.completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].text
    assert len(bare.embeddings.create(model="m", input="Hi").data[0].embedding) > 0


def test_n_gives_choices_each_with_the_next_seed_streamed_or_not(openai_client):
    ask = dict(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
               extra_body={"sampler": "adaptive:temp=1.5"})
    alone = [openai_client.chat.completions.create(**ask, seed=5 + i) for i in range(3)]
    together = openai_client.chat.completions.create(**ask, seed=5, n=3)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.message.content for c in together.choices] == [
        a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in together.choices}) > 1
    assert together.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts, finished = ["", "", ""], set()
    for chunk in openai_client.chat.completions.create(
            **ask, seed=5, n=3, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == together.usage.completion_tokens
    assert texts == [c.message.content for c in together.choices] and finished == {0, 1, 2}


def test_logit_bias_bans_and_forces_tokens_before_the_sampler(openai_client, agents_server,
                                                              engine):
    ask = dict(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
               logprobs=True)
    plain = openai_client.chat.completions.create(**ask).choices[0].logprobs.content[0]
    first = engine.tokenize(plain.token, add_bos=False)
    assert len(first) == 1
    banned = openai_client.chat.completions.create(**ask, logit_bias={str(first[0]): -100})
    assert banned.choices[0].logprobs.content[0].token != plain.token
    forced = engine.tokenize(" river", add_bos=False)
    status, _, payload = raw("POST", agents_server, "/v1/completions", {
        "prompt": "Hello", "max_tokens": 3, "logprobs": 0, "logit_bias": [[forced[0], 100]]})
    assert status == 200 and payload["choices"][0]["logprobs"]["tokens"] == [" river"] * 3
    for bias, needle in [({"x": 1}, "not a token id"), ({"999999": 1}, "not a token id"),
                         ({str(first[0]): 101}, "[-100, 100]")]:
        status, _, payload = raw("POST", agents_server, "/v1/chat/completions",
                                 {"messages": ASK, "max_tokens": 2, "logit_bias": bias})
        assert status == 400 and payload["error"]["param"] == "logit_bias"
        assert needle in payload["error"]["message"]


def test_llama_servers_completion_route_whole_and_streamed(agents_server, engine):
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 6, "n_probs": 2}
    status, _, whole = raw("POST", agents_server, "/completion", body)
    assert status == 200 and whole["stop"] is True and whole["stop_type"] == "limit"
    assert whole["tokens_predicted"] == 6 and whole["tokens_evaluated"] > 0
    assert whole["timings"]["predicted_n"] == 6
    probabilities = whole["completion_probabilities"]
    assert "".join(p["token"] for p in probabilities) == whole["content"]
    assert all(len(p["top_logprobs"]) == 2 for p in probabilities)
    status, _, stream = raw("POST", agents_server, "/completion", {**body, "stream": True},
                            parse=False)
    lines = [json.loads(line[5:]) for line in stream.decode().splitlines()
             if line.startswith("data:")]
    assert "".join(line["content"] for line in lines[:-1]) == whole["content"]
    assert lines[-1]["stop"] is True and lines[-1]["content"] == whole["content"]
    word = whole["content"].split()[1]
    status, _, cut = raw("POST", agents_server, "/completion",
                         {"prompt": body["prompt"], "n_predict": 6, "stop": [word]})
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    tokens = engine.tokenize(body["prompt"])
    status, _, by_ids = raw("POST", agents_server, "/completion",
                            {"prompt": tokens, "n_predict": 6})
    assert by_ids["content"] == whole["content"]
    status, _, error = raw("POST", agents_server, "/completion",
                           {"prompt": [10 ** 9], "n_predict": 2})
    assert status == 400 and error["error"]["code"] == 400
    assert "prompt.0" in error["error"]["message"]


def test_llama_servers_props_slots_template_and_metrics(agents_server):
    status, _, props = raw("GET", agents_server, "/props")
    assert status == 200 and props["total_slots"] >= 1
    assert props["default_generation_settings"]["n_ctx"] == 1024
    assert "tool_call" in props["chat_template"]  # the chatml-tools template it serves
    status, _, slots = raw("GET", agents_server, "/slots")
    assert [slot["id"] for slot in slots] == list(range(props["total_slots"]))
    status, _, refused = raw("POST", agents_server, "/slots/0?action=save", {})
    assert status == 400 and "does not save" in refused["error"]["message"]
    status, _, applied = raw("POST", agents_server, "/apply-template",
                             {"messages": [{"role": "user", "content": "Hi there"}]})
    assert status == 200
    assert applied["prompt"].endswith("<|im_start|>assistant\n")
    assert "Hi there" in applied["prompt"]
    raw("POST", agents_server, "/completion", {"prompt": "Hello", "n_predict": 3})
    status, headers, text = raw("GET", agents_server, "/metrics", parse=False)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    values = dict(line.rsplit(" ", 1) for line in text.decode().splitlines()
                  if not line.startswith("#"))
    assert float(values['llamacpp:tokens_predicted_total{model="smollm2"}']) >= 3
    assert float(values['llamacpp:prompt_tokens_total{model="smollm2"}']) > 0
    assert 'adaptive_llama:requests_total{model="smollm2",outcome="completed"}' in values

"""The fast layer under tests/test_agents_api.py: how the Responses and Messages routes
translate a request into the chat route's, and their replies and stream events, checked
without a server (the end-to-end tests drive the same code through the real SDKs). Every
reply and event is also read with the official SDKs' own types, as a client reads it."""

import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from adaptive_llama.runtime.batching import GenerationResult
from adaptive_llama.runtime.tools import ToolCall
from adaptive_llama.server import messages as anthropic
from adaptive_llama.server import responses
from adaptive_llama.server.errors import APIError
from adaptive_llama.server.messages import MessagesBody
from adaptive_llama.server.responses import ResponsesBody

CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather",
        "arguments": "{\"city\": \"Oslo\"}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "rain"}
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def result(text="Hi.", finish="stop", reasoning="", prompt=7, completion=3, stop=""):
    return GenerationResult(text=text, finish_reason=finish, prompt_tokens=prompt,
                            completion_tokens=completion, sampler="greedy", seed=1,
                            reasoning=reasoning, reasoning_tokens=2 if reasoning else 0,
                            thinks=bool(reasoning), stop_string=stop)


def refusal(make) -> APIError:
    with pytest.raises(APIError) as refused:
        make()
    assert refused.value.status == 400
    return refused.value


# ---- Responses: the request ----

def responses_messages(**body):
    return ResponsesBody.model_validate(body).messages()


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    assert responses_messages(input="Hi", instructions="Be brief.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert responses_messages(input="Hi") == [{"role": "user", "content": "Hi"}]


def test_items_become_messages_calls_join_one_turn_and_outputs_name_their_function():
    second = {**CALL, "call_id": "c2"}
    messages = responses_messages(input=[
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather "},
                     {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "reasoning", "summary": []},  # earlier thinking: not shown again
        CALL, second, OUTPUT, {**OUTPUT, "call_id": "c2", "output": "sun"}])
    assert messages[0] == {"role": "user", "content": "Weather in Oslo?"}
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["content"] is None and len(messages) == 4
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "name": "get_weather",
                           "content": "rain"}
    assert messages[3]["content"] == "sun"


def test_a_call_after_an_assistant_message_joins_it():
    messages = responses_messages(input=[
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": "Let me look."}, CALL, OUTPUT])
    assert messages[1]["content"] == "Let me look." and len(messages[1]["tool_calls"]) == 1


@pytest.mark.parametrize("items, param", [
    ([OUTPUT], "input.0.call_id"),                    # a result of no call
    ([CALL, {**CALL}], "input.1.call_id"),             # two calls, one id
    ([{"type": "message", "role": "user"}], "input.0"),  # no content
    ([{"type": "message", "content": "x"}], "input.0"),  # no role
    ([{**CALL, "name": None}], "input.0.name"),
    ([{"type": "function_call_output", "output": "x"}], "input.0.call_id"),
    ([{"type": "web_search_call"}], "input.0.type"),
    ([{"type": "message", "role": "user",
       "content": [{"type": "input_image", "image_url": "x"}]}], "input.0.content.0"),
    ([{"type": "reasoning"}], "input"),                # nothing left to answer
])
def test_an_item_that_does_not_fit_is_a_400_naming_it(items, param):
    assert refusal(lambda: responses_messages(input=items)).param == param


def test_a_responses_request_becomes_the_chat_routes():
    chat = ResponsesBody.model_validate({
        "input": "Hi", "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, "seed": 4, "sampler": "min-p", "top_k": 5,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                            "strict": True}},
        "reasoning": {"effort": "low"}}).chat_body()
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.seed) == (
        9, 0.5, 0.9, 4)
    streamed = ResponsesBody.model_validate({"input": "Hi", "stream": True, "model": "m"})
    assert (streamed.chat_body().stream, streamed.chat_body().model) == (True, "m")
    assert chat.tools[0].function.name == "get_weather" and chat.parallel_tool_calls is False
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert (chat.reasoning_effort, chat.reasoning_budget, chat.sampler, chat.top_k) == (
        "low", None, "min-p", 5)
    off = ResponsesBody.model_validate({"input": "Hi", "reasoning": {"effort": "none"},
                                        "text": {"format": {"type": "json_object"}}})
    chat = off.chat_body()
    assert (chat.reasoning_effort, chat.reasoning_budget) == (None, 0)
    assert chat.response_format.type == "json_object"


@pytest.mark.parametrize("field, value", [
    ("previous_response_id", "resp_1"), ("conversation", "conv_1"),
    ("include", ["message.output_text.logprobs"])])
def test_what_a_stateless_server_cannot_do_is_a_400_naming_it(field, value):
    body = ResponsesBody.model_validate({"input": "Hi", field: value})
    error = refusal(body.chat_body)
    assert (error.param, error.code) == (field, "unsupported_field")


# ---- Responses: the reply ----

def head(**body):
    return responses._Head(ResponsesBody.model_validate({"input": "Hi", **body}), "m")


def test_a_response_says_its_status_usage_and_text():
    h = head(max_output_tokens=5)
    assert h.response([])["status"] == "in_progress" and h.response([])["usage"] is None
    done = h.response(responses._final_output(result("Hello."), []), result("Hello."))
    assert (done["status"], done["output_text"], done["incomplete_details"]) == (
        "completed", "Hello.", None)
    assert done["usage"] == {"input_tokens": 7,
                             "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 10}
    Response.model_validate(done)
    cut = h.response([], result(finish="length"))
    assert (cut["status"], cut["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})
    assert h.response([], status="failed", error="x")["error"]["message"] == "x"
    assert done["max_output_tokens"] == 5 and done["truncation"] == "disabled"


def test_a_whole_replys_items_are_its_thinking_its_text_and_its_calls():
    reply = result('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                   '</tool_call>', reasoning="Rain?")
    items = responses._final_output(reply, ["get_weather"])
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Rain?"}]
    assert json.loads(items[1]["arguments"]) == {"city": "Oslo"}
    Response.model_validate(head().response(items, reply))
    plain = responses._final_output(result(""), [])
    assert [i["type"] for i in plain] == ["message"]  # an empty reply is an empty message


OPENAI_EVENT = TypeAdapter(ResponseStreamEvent)
ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)


def events_of(events, sdk_type: TypeAdapter):
    """The events' data, each read with the SDK's type of a stream event."""
    data = [json.loads(e["data"]) for e in events]
    for d in data:
        if d["type"] != "error":  # Anthropic's error event is not a message event
            sdk_type.validate_python(d)
    return data


def test_a_stream_opens_fills_and_closes_each_item_in_numbered_events():
    stream = responses._Events(head())
    events = (stream.start() + stream.text("thinking", "Hm") + stream.text("text", "Hel")
              + stream.text("text", "lo") + stream.call(ToolCall("get_weather", {"c": 1}, "c1"))
              + stream.end(result("Hello")))
    data = events_of(events, OPENAI_EVENT)
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["event"] for e in events] == [d["type"] for d in data]
    final = data[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output_text"] == "Hello" and data[12]["text"] == "Hello"
    assert [d.get("output_index") for d in data[2:5]] == [0, 0, 0]
    assert data[-2]["output_index"] == 2
    failed = events_of(responses._Events(head()).failed("boom"), OPENAI_EVENT)
    assert failed[-1]["type"] == "response.failed"
    cut = events_of(responses._Events(head()).end(result(finish="length")), OPENAI_EVENT)
    assert cut[-1]["type"] == "response.incomplete"


# ---- Messages: the request ----

def chat_of(**body):
    return MessagesBody.model_validate({"max_tokens": 9, **body}).chat_body()


USE = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "rain"}


def test_a_messages_request_becomes_the_chat_routes():
    chat = chat_of(system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
                   messages=[{"role": "user", "content": "Weather?"},
                             {"role": "assistant", "content": [
                                 {"type": "thinking", "thinking": "Hm"},
                                 {"type": "text", "text": "Looking."}, USE]},
                             {"role": "user", "content": [
                                 RESULT, {"type": "text", "text": "And now?"}]}],
                   tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   stop_sequences=["END"], temperature=0.5, top_k=5,
                   thinking={"type": "enabled", "budget_tokens": 64})
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be\n\nbrief."
    assistant = chat.messages[2]
    assert assistant.content == "Looking." and assistant.tool_calls[0].id == "t1"
    assert json.loads(assistant.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert chat.messages[3].content == "rain" and chat.messages[4].content == "And now?"
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop, chat.reasoning_budget) == (
        "required", False, ["END"], 64)
    assert (chat.max_tokens, chat.temperature, chat.top_k) == (9, 0.5, 5)
    assert chat.messages[1].content == "Weather?"
    plain = chat_of(messages=[{"role": "user", "content": "Hi"}], top_p=0.8, seed=3,
                    sampler="eta", stream=True, model="m")
    assert (plain.reasoning_budget, plain.top_p, plain.seed, plain.sampler, plain.stream,
            plain.model) == (0, 0.8, 3, "eta", True, "m")


def test_blocks_of_one_message_join_and_results_alone_add_no_empty_user_message():
    chat = chat_of(messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                     {"type": "text", "text": "now?"}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}, USE]},
        {"role": "user", "content": [RESULT]}])
    assert chat.messages[0].content == "Weather now?"
    assert chat.messages[1].content is None and chat.messages[1].tool_calls[0].id == "t1"
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]


def test_a_tool_result_marked_as_an_error_says_so_and_a_named_choice_is_a_function():
    chat = chat_of(messages=[{"role": "user", "content": "Weather?"},
                             {"role": "assistant", "content": [USE]},
                             {"role": "user", "content": [
                                 {**RESULT, "is_error": True,
                                  "content": [{"type": "text", "text": "no network"}]}]}],
                   tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
                   tool_choice={"type": "tool", "name": "get_weather"})
    assert chat.messages[2].content == "Error: no network"
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls


@pytest.mark.parametrize("messages, extra, param", [
    ([{"role": "user", "content": [RESULT]}], {}, "messages.0.content.0.tool_use_id"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [USE, USE]},
      {"role": "user", "content": "y"}], {}, "messages.1.content.1.id"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1"}]}, {"role": "user", "content": "y"}], {},
     "messages.1.content.0"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], {},
     "messages.0.content.0"),
    ([{"role": "user", "content": [{"type": "tool_use", **USE}]}], {},
     "messages.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "bogus"}]}], {}, "messages.0.content.0.type"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], {},
     "messages.1"),
    ([{"role": "user", "content": "x"}], {"thinking": {"type": "enabled"}},
     "thinking.budget_tokens"),
    ([{"role": "user", "content": "x"}], {"tool_choice": {"type": "tool"}},
     "tool_choice.name"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [USE]},
      {"role": "user", "content": [{**RESULT, "content": [{"type": "image"}]}]}], {},
     "messages.2.content.0.content.0"),
])
def test_a_block_that_does_not_fit_is_a_400_naming_it(messages, extra, param):
    assert refusal(lambda: chat_of(messages=messages, **extra)).param == param


# ---- Messages: the reply ----

@pytest.mark.parametrize("finish, calls, reason", [
    ("stop", False, "end_turn"), ("stop", True, "tool_use"), ("length", True, "max_tokens"),
    ("stop_string", False, "stop_sequence"), ("interrupted", False, "end_turn")])
def test_the_engines_ends_are_anthropics_stop_reasons(finish, calls, reason):
    assert anthropic._stop_reason(result(finish=finish), calls) == reason


def test_a_whole_message_holds_its_thinking_only_when_asked_and_its_calls():
    reply = result('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                   '</tool_call>', reasoning="Rain?")
    content, calls = anthropic._final_content(reply, ["get_weather"], thinking=True)
    assert [b["type"] for b in content] == ["thinking", "text", "tool_use"] and calls
    assert content[2]["input"] == {"city": "Oslo"}
    content, _ = anthropic._final_content(reply, ["get_weather"], thinking=False)
    assert [b["type"] for b in content] == ["text", "tool_use"]
    message = anthropic._message("m", content, result(stop="END", finish="stop_string"))
    Message.model_validate(message)
    Message.model_validate(anthropic._message("m", *anthropic._final_content(
        reply, ["get_weather"], thinking=True)[:1], reply, calls=True))
    assert (message["stop_reason"], message["stop_sequence"], message["usage"]) == (
        "stop_sequence", "END", {"input_tokens": 7, "output_tokens": 3})


def test_a_message_stream_starts_fills_and_stops_each_block():
    blocks = anthropic._Blocks("m", prompt_tokens=7, thinking=True)
    events = (blocks.start() + blocks.text("thinking", "Hm") + blocks.text("text", "Hel")
              + blocks.text("text", "lo") + blocks.call(ToolCall("get_weather", {"c": 1}, "t1"))
              + blocks.end(result("Hello")))
    data = events_of(events, ANTHROPIC_EVENT)
    assert [(d["type"], d.get("index")) for d in data] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
        ("content_block_delta", 2), ("content_block_stop", 2), ("message_delta", None),
        ("message_stop", None)]
    assert data[0]["message"]["usage"]["input_tokens"] == 7
    assert data[2]["delta"] == {"type": "thinking_delta", "thinking": "Hm"}
    assert data[9]["delta"] == {"type": "input_json_delta", "partial_json": '{"c": 1}'}
    assert data[11]["delta"]["stop_reason"] == "tool_use"
    hidden = anthropic._Blocks("m", 7, thinking=False)
    assert hidden.text("thinking", "Hm") == []
    empty = events_of(hidden.end(result("")), ANTHROPIC_EVENT)
    assert [d["type"] for d in empty] == ["content_block_start", "content_block_stop",
                                          "message_delta", "message_stop"]
    failed = events_of(anthropic._Blocks("m", 7, True).failed("boom"), ANTHROPIC_EVENT)
    assert failed[-1]["error"]["type"] == "api_error"

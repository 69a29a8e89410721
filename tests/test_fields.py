"""Every request field OpenAI and llama-server document, sent to a real `serve`: each is
honoured (the reply shows it), changes nothing here (the reply is the one without it), or is
refused (a 400 that names it). None is silently ignored.

The fields are those of OpenAI's Chat Completions and Completions references and of
llama-server's README (tools/server: /completion and its OpenAI routes). Every request has
a seed, so that the same request gets the same reply and a field's effect shows."""

import json

import pytest
from test_server import raw, serving

CHAT, COMPLETIONS, LLAMA = "/v1/chat/completions", "/v1/completions", "/completion"
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]
BASE = {
    CHAT: {"messages": STORY, "max_tokens": 12, "seed": 5, "temperature": 1.5},
    COMPLETIONS: {"prompt": "Once upon a time", "max_tokens": 12, "seed": 5,
                  "temperature": 1.5},
    LLAMA: {"prompt": "Once upon a time", "n_predict": 12, "seed": 5, "temperature": 1.5},
}
TOOL = {"type": "function", "function": {"name": "get_time", "description": "the time",
                                         "parameters": {"type": "object"}}}
SHORT = {"messages": [{"role": "user", "content": "Say hi."}], "prompt": "Hi",
         "max_tokens": 60, "n_predict": 60, "temperature": 0}

# (field, value, what the baseline also gets): the reply differs from the baseline's.
SAMPLING = [
    ("temperature", 0, {}), ("top_p", 0.05, {}), ("top_k", 1, {}), ("min_p", 0.9, {}),
    ("typical_p", 0.05, {}), ("seed", 6, {}), ("sampler", "min-p:p=0.3", {}),
    ("stop", [" "], {}), ("logit_bias", {"0": 100}, {}),  # token 0 ends the reply
    ("frequency_penalty", 2.0, {}), ("presence_penalty", 2.0, {}),
    ("repeat_penalty", 1.5, {}), ("repeat_last_n", 8, {"repeat_penalty": 1.5}),
    ("dry_multiplier", 0.8, {}), ("dry_base", 3.0, {"dry_multiplier": 0.8}),
    ("dry_allowed_length", 4, {"dry_multiplier": 0.8}),
    ("dry_penalty_last_n", 16, {"dry_multiplier": 0.8}),
    ("dry_sequence_breakers", ["\n", ":", "\"", "*"], None),  # llama.cpp's: as without
    ("top_n_sigma", 1.0, {}), ("xtc_probability", 0.5, {}),
    ("xtc_threshold", 0.2, {"xtc_probability": 0.5}), ("mirostat", 2, {}),
    ("mirostat_tau", 2.0, {"mirostat": 2}), ("mirostat_eta", 0.5, {"mirostat": 2}),
    ("adaptive_target", 0.5, {}), ("adaptive_decay", 0.5, {"adaptive_target": 0.5}),
    ("grammar", 'root ::= "yes"', {}), ("json_schema", {"type": "object"}, {}),
    ("ignore_eos", True, SHORT), ("n_predict", 3, {"max_tokens": None, "n_predict": 12}),
]
# llama-server's fields this server does not do: refused, and a value that changes nothing
# accepted (as its clients send it).
UNDONE = [
    ("dynatemp_range", 0.5, 0.0), ("dynatemp_exponent", 2.0, 1.0), ("min_keep", 5, 0),
    ("samplers", ["top_k", "temperature"], None), ("n_indent", 2, 0),
    ("t_max_predict_ms", 100, 0), ("image_data", [{"data": "aGk=", "id": 1}], []),
    ("multimodal_data", ["aGk="], []), ("lora", [{"id": 0, "scale": 1.0}], []),
    ("post_sampling_probs", True, False), ("return_tokens", True, False),
    ("response_fields", ["content"], []), ("timings_per_token", True, False),
    ("return_progress", True, False), ("chat_template_kwargs", {"enable_thinking": False}, {}),
    ("thinking_forced_open", True, False), ("n_cmpl", 2, 1),
]
# Fields that change nothing about a reply here: bookkeeping, caching hints.
NOTHING = [("user", "u-1"), ("cache_prompt", False), ("id_slot", 0), ("n_keep", 10)]

ROUTES = {
    CHAT: {
        "honoured": [*SAMPLING, ("max_tokens", 3, {}), ("max_completion_tokens", 3, {}),
                     ("n", 2, {}), ("logprobs", True, {}),
                     ("top_logprobs", 2, {"logprobs": True}),
                     ("response_format", {"type": "json_object"}, {}),
                     ("tools", [TOOL], {}), ("tool_choice", "none", {"tools": [TOOL]}),
                     ("token_details", True, {}), ("n_probs", 0, None)],
        "undone": [*UNDONE, ("n_probs", 2, 0), ("functions", [TOOL["function"]], []),
                   ("function_call", {"name": "get_time"}, "none"),
                   ("audio", {"voice": "alloy", "format": "wav"}, None),
                   ("modalities", ["text", "audio"], ["text"]),
                   ("web_search_options", {}, None), ("verbosity", "low", "medium"),
                   ("add_generation_prompt", False, True), ("chat_template", "chatml", ""),
                   ("parse_tool_calls", False, True)],
        "nothing": [*NOTHING, ("metadata", {"k": "v"}), ("store", True),
                    ("service_tier", "auto"), ("prompt_cache_key", "k"),
                    ("safety_identifier", "s"), ("model", "smollm2"),
                    ("prediction", {"type": "content", "content": "A cat"}),
                    ("parallel_tool_calls", False), ("reasoning_format", "none")],
    },
    COMPLETIONS: {
        "honoured": [*SAMPLING, ("max_tokens", 3, {}), ("n", 2, {}), ("logprobs", 2, {})],
        "undone": [*UNDONE, ("echo", True, False), ("suffix", " The end.", ""),
                   ("best_of", 2, 1), ("reasoning_format", "deepseek", "none")],
        "nothing": [*NOTHING, ("model", "smollm2")],
    },
    LLAMA: {
        "honoured": [*SAMPLING, ("n_probs", 2, {})],
        "undone": UNDONE,
        "nothing": NOTHING,
    },
}
# What changes from one request to the next whatever the fields: ids, clocks, speeds.
VOLATILE = {"id", "created", "timings", "decode_tokens_per_s", "time_to_first_token_s",
            "prompt_eval_s", "prompt_evaluated"}  # the last: what the cache held


@pytest.fixture(scope="module")
def port(smollm2_path, tmp_path_factory):
    yield from serving(smollm2_path, tmp_path_factory.mktemp("fields") / "server.log",
                       "--sampler", "adaptive", "--chat-template", "chatml-tools")


def stable(value):
    """A reply without what changes between two sends of one request."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


# The fields of one route's baseline that another's does not take.
NOT_TAKEN = {CHAT: ("prompt",), COMPLETIONS: ("messages",), LLAMA: ("messages", "max_tokens")}


def send(port, route, body):
    """(status, parsed reply) of ``body`` (None values left out) sent to ``route``."""
    body = {k: v for k, v in body.items() if v is not None and k not in NOT_TAKEN[route]}
    status, _, reply = raw("POST", port, route, body, timeout=120)
    return status, reply


BASELINES: dict[str, tuple[int, object]] = {}


def baseline(port, route, body):
    """The reply to a baseline, sent once: a seeded request gets the same reply every time
    (test_server checks it), and each route has a few baselines for some 200 fields."""
    key = json.dumps([route, body], sort_keys=True)
    if key not in BASELINES:
        BASELINES[key] = send(port, route, body)
    return BASELINES[key]


def cases(kind):
    return [pytest.param(route, *case, id=f"{route}:{case[0]}")
            for route, kinds in ROUTES.items() for case in kinds[kind]]


@pytest.mark.parametrize("route, field, value, extra", cases("honoured"))
def test_a_field_that_changes_the_reply_is_honoured(port, route, field, value, extra):
    base = {**BASE[route], **(extra or {})}
    status, without = baseline(port, route, base)
    assert status == 200, without
    status, reply = send(port, route, {**base, field: value})
    assert status == 200, reply
    if extra is None:  # a value that asks for what the server does anyway
        assert stable(reply) == stable(without)
    else:
        assert stable(reply) != stable(without), f"`{field}` changed nothing"


@pytest.mark.parametrize("route, field, value, harmless", cases("undone"))
def test_a_field_this_server_does_not_do_is_refused_unless_it_changes_nothing(
        port, route, field, value, harmless):
    status, reply = send(port, route, {**BASE[route], field: value})
    assert status == 400 and field in json.dumps(reply), reply
    status, without = baseline(port, route, BASE[route])
    status, reply = send(port, route, {**BASE[route], field: harmless})
    assert status == 200 and stable(reply) == stable(without), reply


@pytest.mark.parametrize("route, field, value",
                         [pytest.param(route, *case, id=f"{route}:{case[0]}")
                          for route, kinds in ROUTES.items() for case in kinds["nothing"]])
def test_a_field_that_changes_nothing_here_leaves_the_reply_as_it_was(port, route, field,
                                                                     value):
    status, without = baseline(port, route, BASE[route])
    status, reply = send(port, route, {**BASE[route], field: value})
    assert status == 200 and stable(reply) == stable(without), reply


@pytest.mark.parametrize("route", list(ROUTES))
def test_stream_streams(port, route):
    status, _, payload = raw("POST", port, route, {**BASE[route], "stream": True},
                             parse=False, timeout=120)
    assert status == 200 and payload.lstrip().startswith(b"data:")


@pytest.mark.parametrize("route", list(ROUTES))
def test_n_predict_0_is_a_400_naming_it_on_every_route(port, route):
    status, reply = send(port, route, {**BASE[route], "max_tokens": None, "n_predict": 0})
    assert status == 400 and "n_predict" in json.dumps(reply), reply

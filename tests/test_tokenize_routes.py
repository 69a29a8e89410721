"""llama-server's /tokenize and /detokenize on `adaptive-llama serve` (end to end)."""

import pytest
from test_server import raw, server, server_log  # noqa: F401 (fixtures)

TEXT = "Hello, naïve café – 東京 🚀!"


def tokenize(port, **body):
    status, _, answer = raw("POST", port, "/tokenize", body)
    assert status == 200, answer
    return answer["tokens"]


def test_tokens_are_the_models_and_read_back(server, engine):  # noqa: F811
    tokens = tokenize(server, content=TEXT)
    assert tokens == engine.tokenize(TEXT, False, True)
    status, _, answer = raw("POST", server, "/detokenize", {"tokens": tokens})
    assert status == 200 and answer == {"content": TEXT}


def test_pieces_join_into_the_text_even_when_a_character_is_split(server):  # noqa: F811
    pieces = tokenize(server, content=TEXT, with_pieces=True)
    assert all(set(p) == {"id", "piece"} for p in pieces)
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list)
                      else p["piece"].encode() for p in pieces)
    assert joined == TEXT.encode()
    assert [p["id"] for p in pieces] == tokenize(server, content=TEXT)


def test_markup_is_read_as_control_tokens_only_when_asked(server, engine):  # noqa: F811
    markup = "<|im_start|>user"
    parsed = tokenize(server, content=markup)
    literal = tokenize(server, content=markup, parse_special=False)
    assert len(parsed) < len(literal)
    status, _, answer = raw("POST", server, "/detokenize", {"tokens": parsed})
    assert answer["content"] == markup  # control tokens written out as their text
    bos = tokenize(server, content="Hi", add_special=True)
    assert bos == engine.tokenize("Hi", True, True)


@pytest.mark.parametrize("path,body,needle", [
    ("/detokenize", {"tokens": [1, 10**6]}, "`tokens.1`: 1000000 is not a token"),
    ("/detokenize", {"tokens": [-1]}, "`tokens.0`: -1 is not a token"),
    ("/detokenize", {"tokens": ["1"]}, "`tokens.0`"),
    ("/tokenize", {"content": 5}, "`content`"),
    ("/tokenize", {}, "`content`"),
])
def test_bad_bodies_get_a_400_and_the_server_keeps_serving(server, path, body,  # noqa: F811
                                                          needle):
    status, _, answer = raw("POST", server, path, body)
    assert status == 400 and needle in answer["error"]["message"], answer
    assert tokenize(server, content="ok")


def test_the_api_key_guards_them(server):  # noqa: F811
    status, _, _ = raw("POST", server, "/tokenize", {"content": "x"}, key=None)
    assert status == 401

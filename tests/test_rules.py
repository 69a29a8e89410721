"""Rules pinned down as rules, each over the inputs on both sides of it: the Origin check's
loopback pages, the chat page's exemptions, and a saved chat's field checks (/load,
--resume)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptive_llama.chat.conversation import Chat
from adaptive_llama.chat.repl import check_saved_chat
from adaptive_llama.samplers import parse_spec
from adaptive_llama.server.guard import Access

# ---- Origin: loopback pages pass, whatever their scheme and port; nothing else does ----

LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "[::1]", "LOCALHOST", "Localhost"]
ports = st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}"))


@given(scheme=st.sampled_from(["http", "https", "HTTP"]), host=st.sampled_from(LOOPBACK_HOSTS),
       port=ports, slash=st.sampled_from(["", "/"]))
def test_every_loopback_page_is_an_allowed_origin(scheme, host, port, slash):
    assert Access().origin_allowed(f"{scheme}://{host}{port}{slash}")


@pytest.mark.parametrize("origin", [
    "http://localhost.evil.com", "http://127.0.0.1.evil.com", "http://evil-localhost",
    "http://evillocalhost", "http://localhost:3000.evil.com", "http://localhost@evil.com",
    "http://evil.com/localhost", "http://evil.com?http://localhost", "http://127.0.0.2",
    "http://[::1].evil", "http://[::2]", "ftp://localhost", "file://localhost", "null",
    "http://localhost:", "http://localhost:abc", "localhost", "http://0.0.0.0",
    "http://127.0.0.1:80/x", " http://localhost", "http://localhost\n",
])
def test_a_page_that_only_looks_like_loopback_is_refused(origin):
    assert not Access().origin_allowed(origin)


def test_allowed_origins_are_exact_case_and_slash_aside():
    access = Access(allow_origins=("https://app.example.com/",))
    assert access.origin_allowed("https://app.example.com")
    assert access.origin_allowed("HTTPS://APP.EXAMPLE.COM/")
    for other in ("https://app.example.com.evil", "http://app.example.com",
                  "https://example.com", "https://app.example.com:8443"):
        assert not access.origin_allowed(other), other
    assert Access(allow_origins=("*",)).origin_allowed("https://anything.example")


# ---- the chat page: its files load without the key; its own origin may call the API ----

def _headers(**values):
    from starlette.datastructures import Headers

    return Headers({k.replace("_", "-"): v for k, v in values.items()})


@pytest.mark.parametrize("method,path,needs_key", [
    ("GET", "/", False), ("GET", "/web/app.js", False), ("GET", "/web/samplers.json", False),
    ("POST", "/", True), ("GET", "/v1/models", True), ("GET", "/health", True),
    ("GET", "/webx", True), ("GET", "//", True), ("POST", "/web/app.js", True),
])
def test_only_the_page_and_its_files_load_without_the_key(method, path, needs_key):
    error = Access("key").error(method, _headers(host="localhost:8080"), path)
    assert (error is not None and error.status == 401) is needs_key
    assert Access("key").error(method, _headers(host="localhost:8080",
                                                authorization="Bearer key"), path) is None


@pytest.mark.parametrize("origin,host,allowed", [
    ("http://10.0.0.2:8080", "10.0.0.2:8080", True),     # the page, served on a LAN address
    ("http://chat.lan:8080", "CHAT.lan:8080", True),
    ("http://10.0.0.2:8081", "10.0.0.2:8080", False),    # another port is another page
    ("http://evil.example", "10.0.0.2:8080", False),
    ("http://10.0.0.2:8080", "", False),
])
def test_the_servers_own_page_is_an_allowed_origin(origin, host, allowed):
    headers = _headers(origin=origin, host=host, content_type="application/json")
    error = Access(allow_hosts=None).error("POST", headers, "/v1/chat/completions")
    assert (error is None) is allowed, error and error.message


def test_the_page_is_still_refused_to_other_sites_and_host_names():
    page = "/"
    assert Access("key").error("GET", _headers(host="localhost", origin="https://evil.example"),
                               page).status == 403
    assert Access("key").error("GET", _headers(host="rebound.evil.example"), page).status == 403


# ---- a saved chat: every field checked, each on both sides of its rule ----

class _Current:
    """The fields of a chat that a saved one's missing fields keep (a stand-in for
    :class:`Chat`, which needs an engine)."""
    system, sampler, seed, max_tokens = "be brief", parse_spec("greedy"), 7, 99


GOOD = {"messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello", "interrupted": True}],
        "system": "s", "sampler": "min-p:p=0.1", "seed": 3, "max_tokens": 12}


@pytest.mark.parametrize("field,value,needle", [
    ("messages", None, "`messages`"), ("messages", {"role": "user"}, "`messages`"),
    ("messages", [{"role": "system", "content": "x"}], "`messages`"),
    ("messages", [{"role": "tool", "content": "x"}], "`messages`"),
    ("messages", [{"role": "user", "content": 3}], "`messages`"),
    ("messages", [{"role": "user"}], "`messages`"),
    ("messages", [{"role": "user", "content": "x", "interrupted": "yes"}], "`messages`"),
    ("messages", ["hi"], "`messages`"),
    ("system", 3, "`system`"), ("system", ["a"], "`system`"),
    ("sampler", "nucleus", "unknown sampler"), ("sampler", "top-k:k=0", "`k`"),
    ("seed", True, "`seed`"), ("seed", -1, "`seed`"), ("seed", 2**32, "`seed`"),
    ("seed", "x", "`seed`"), ("max_tokens", False, "`max_tokens`"),
    ("max_tokens", 0, "max"), ("max_tokens", 1.5, "max"),
])
def test_a_saved_chat_with_one_bad_field_is_refused_naming_it(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        check_saved_chat({**GOOD, field: value}, _Current())


def test_a_saved_chat_with_good_fields_is_taken_as_it_is():
    saved = check_saved_chat(GOOD, _Current())
    assert saved["messages"] == GOOD["messages"] and saved["system"] == "s"
    assert saved["sampler"] == parse_spec("min-p:p=0.1")
    assert (saved["seed"], saved["max_tokens"]) == (3, 12)
    assert check_saved_chat({**GOOD, "seed": None, "system": None}, _Current())["seed"] is None
    assert check_saved_chat({**GOOD, "seed": 2**32 - 1}, _Current())["seed"] == 2**32 - 1


def test_fields_a_saved_chat_lacks_keep_the_current_values():
    saved = check_saved_chat({"messages": []}, _Current())
    assert (saved["system"], saved["sampler"], saved["seed"], saved["max_tokens"]) == (
        "be brief", parse_spec("greedy"), 7, 99)
    for bad in (None, [], "x", 3):
        with pytest.raises(ValueError, match="not a JSON object|`messages`"):
            check_saved_chat(bad, _Current())


def test_the_stand_in_has_the_fields_a_chat_has():
    assert {"system", "sampler", "seed", "max_tokens"} <= set(Chat.__init__.__code__.co_varnames)

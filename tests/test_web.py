"""The chat page in a real browser: Debian's Chromium (/usr/bin/chromium), driven by Playwright,
against a real `adaptive-llama serve` on the bundled model.

Without Chromium the browser tests are skipped, except under CI=true, where they fail: .ci/run
installs it, so CI always runs them. ADAPTIVE_LLAMA_CHROMIUM names another Chromium binary.
"""

import gzip
import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from pdf_files import pdf_of
from test_server import API_KEY, free_port, raw, serving

from adaptive_llama.chat.repl import check_saved_chat
from adaptive_llama.samplers import parse_spec

CHROMIUM = (os.environ.get("ADAPTIVE_LLAMA_CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser"))
# As the machine's notes say: without the background-networking flags Chromium keeps trying
# to reach Google's hosts, which a closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]
KEY = API_KEY  # serving() checks /health with it
REPLY_S = 120_000  # ms a reply may take in these tests
QUESTION = "Name three rivers."
PHONE = {"viewport": {"width": 390, "height": 780}, "has_touch": True, "is_mobile": True}


def _launch_browser():
    if CHROMIUM is None or not os.path.exists(CHROMIUM):
        why = "no Chromium here (apt-get install chromium, or set ADAPTIVE_LLAMA_CHROMIUM)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}: CI runs the browser tests, so .ci/run installs it")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    return playwright, playwright.chromium.launch(executable_path=CHROMIUM,
                                                  args=CHROMIUM_ARGS)


@pytest.fixture(scope="module")
def browser():
    playwright, chromium = _launch_browser()
    yield chromium
    chromium.close()
    playwright.stop()


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("web") / "server.log"
    yield from serving(smollm2_path, log, "--parallel", "2", "--ctx", "2048",
                       "--model", f"twin={smollm2_path}", api_key=None)


@pytest.fixture(scope="module")
def keyed_server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("web-key") / "server.log"
    yield from serving(smollm2_path, log, api_key=KEY)


def wait_until(tab, expression: str, timeout_s: float = 30):
    """Poll a JavaScript expression until it is true. (Playwright's wait_for_function
    evaluates a string in the page, which the page's policy forbids: no unsafe-eval.)"""
    deadline = time.monotonic() + timeout_s
    while not tab.evaluate(expression):
        if time.monotonic() > deadline:
            pytest.fail(f"still false after {timeout_s} s: {expression}")
        time.sleep(0.05)


class Page:
    """One browser tab on the page, with what it printed and asked for."""

    def __init__(self, context, port: int):
        self.base = f"http://127.0.0.1:{port}"
        self.port = port
        self.tab = context.new_page()
        self.errors: list[str] = []
        self.requests: list = []
        self.failed: list[str] = []  # requests the browser counts as failed (or aborted)
        self.tab.on("requestfailed", lambda r: self.failed.append(f"{r.url} {r.failure}"))
        self.tab.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.tab.on("pageerror", lambda e: self.errors.append(str(e)))
        self.tab.on("request", lambda r: self.requests.append(r))

    def open(self, wait_models=True):
        self.tab.goto(self.base + "/")
        if wait_models:
            self.tab.wait_for_selector("#model option", state="attached")
            wait_until(self.tab, "document.querySelectorAll('#sampler option').length")
        return self

    def settings(self, **values):
        """Set fields of the settings panel (by element id, or NAME.PARAM for a sampler's
        or modifier's parameter), as a user types them."""
        self.tab.click("#open-settings")
        for name, value in values.items():
            selector = f"#{name.replace('_', '-')}" if "." not in name \
                else f"[name='{name}']"
            if isinstance(value, bool):
                self.tab.set_checked(selector, value)
            elif name == "sampler":
                self.tab.select_option(selector, value)
            else:
                self.tab.fill(selector, str(value))
        self.tab.click("#close-settings")

    def send(self, text=QUESTION):
        self.tab.fill("#input", text)
        self.tab.press("#input", "Enter")
        return self.wait_reply()

    def start_reply(self, text: str, shown: int = 20, **settings):
        """Send ``text`` with these settings; return once its reply, still streaming, shows
        more than ``shown`` characters."""
        self.settings(**settings)
        self.tab.fill("#input", text)
        self.tab.press("#input", "Enter")
        wait_until(self.tab, "document.querySelector('.content.streaming')?.textContent.length"
                             f" > {shown}", timeout_s=REPLY_S / 1000)

    def wait_reply(self):
        self.tab.wait_for_selector("#stop", state="hidden", timeout=REPLY_S)
        self.tab.wait_for_selector("#send", state="visible")

    def chats(self) -> list[dict]:
        """The chats as the page keeps them in IndexedDB, the newest first."""
        return self.tab.evaluate("import('/web/store.js').then((store) => store.storedChats())")

    def messages(self) -> list[dict]:
        return self.chats()[0]["messages"]

    def error(self) -> str:
        return "" if self.tab.is_hidden("#error") else self.tab.inner_text("#error-text")


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1200, "height": 850})
    tab = Page(context, server)
    yield tab
    context.close()


def reply_of(port: int, text: str, **body) -> dict:
    """The server's own answer to one question, with token_details (not through the page)."""
    status, _, answer = raw("POST", port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}], "token_details": True, **body},
        key=None)
    assert status == 200, answer
    return answer


# ---- the page itself ----

def test_the_page_loads_same_origin_only_under_its_policy(page):
    page.open()
    status, headers, html = raw("GET", page.port, "/", key=None, parse=False)
    assert status == 200 and b"<script type=\"module\" src=\"/web/app.js\">" in html
    policy = headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    assert "unsafe-inline" not in policy
    assert all(r.url.startswith(page.base + "/") or r.url.startswith("blob:")
               for r in page.requests), [r.url for r in page.requests]
    assert page.tab.title() == "adaptive-llama"
    assert page.errors == []


def test_an_inline_script_is_refused_by_the_policy(page):
    """The policy is live: a script element added to the page does not run."""
    page.open()
    page.tab.evaluate("""() => { const s = document.createElement('script');
        s.textContent = 'window.ran = true'; document.body.append(s); }""")
    assert page.tab.evaluate("window.ran === undefined")
    assert any("Content Security Policy" in e for e in page.errors)


def test_the_page_files_need_no_key_but_the_api_does(keyed_server):
    assert raw("GET", keyed_server, "/", key=None, parse=False)[0] == 200
    assert raw("GET", keyed_server, "/web/app.js", key=None, parse=False)[0] == 200
    assert raw("GET", keyed_server, "/v1/models", key=None)[0] == 401
    assert raw("GET", keyed_server, "/web/secret.py", key=None)[0] == 404
    # the page's typesetting is a POST of the reply's text: it needs the key, as the API does
    assert raw("POST", keyed_server, "/web/typeset", {"code": []}, key=None)[0] == 401
    assert raw("POST", keyed_server, "/web/pdf-text", {"name": "a.pdf", "data": ""},
               key=None)[0] == 401
    status, _, answer = raw("POST", keyed_server, "/web/typeset",
                            {"code": [{"language": "python", "text": "x = 1"}],
                             "math": [{"tex": "x^2"}]}, key=KEY)
    assert status == 200 and answer["code"][0][0] == ["", "x = "]
    assert answer["math"][0][0] == "math"
    assert raw("POST", keyed_server, "/web/typeset", {"code": [{"text": "x"}]},
               key=KEY)[0] == 400  # no language
    # Another site's page gets nothing, the page included.
    assert raw("GET", keyed_server, "/", key=None, parse=False,
               headers={"Origin": "https://evil.example"})[0] == 403


def test_the_page_files_are_gzipped_for_a_browser_that_takes_it(keyed_server):
    for path in ["/", "/web/app.js", "/web/style.css", "/web/samplers.json"]:
        status, headers, plain = raw("GET", keyed_server, path, key=None, parse=False)
        assert status == 200 and "Content-Encoding" not in headers
        status, headers, packed = raw("GET", keyed_server, path, key=None, parse=False,
                                      headers={"Accept-Encoding": "gzip, deflate, br"})
        assert status == 200 and headers["Content-Encoding"] == "gzip"
        assert "Accept-Encoding" in headers["Vary"] and "default-src 'none'" in \
            headers["Content-Security-Policy"]
        assert gzip.decompress(packed) == plain and len(packed) < len(plain)


def test_the_scripts_and_style_are_sent_minified_and_every_module_still_runs(page):
    """What the browser gets of each script and of the style sheet is its source without
    comments and layout (a quarter or more fewer bytes), and every module of the page still
    imports in the browser without an error: a minifier that broke one would show here."""
    page.open()
    folder = Path(__file__).parents[1] / "adaptive_llama" / "server" / "web"
    sources = {path.name: path.read_bytes() for path in folder.iterdir()
               if path.suffix in (".js", ".css")}
    for name, source in sources.items():
        status, _, sent = raw("GET", page.port, f"/web/{name}", key=None, parse=False)
        assert status == 200 and len(sent) < 0.9 * len(source), name
        assert b"\n  " in source and b"\n  " not in sent, name  # no indented lines left
    modules = sorted(name for name in sources if name.endswith(".js"))
    imported = page.tab.evaluate("""async (names) => {
        const out = [];
        for (const name of names) out.push(typeof await import('/web/' + name));
        return out; }""", modules)
    assert imported == ["object"] * len(modules) and page.errors == []
    # the page works on what it was sent: a question gets its reply
    page.settings(seed=3, max_tokens=8)
    page.send()
    assert page.messages()[1]["content"] and page.errors == []


# ---- chatting ----

def test_a_reply_streams_in_and_the_chat_survives_a_reload(page):
    page.open()
    page.settings(seed=11, max_tokens=48)
    page.tab.evaluate("""() => { window.seenStreaming = 0;
        new MutationObserver(() => {
            const live = document.querySelector('.content.streaming');
            if (live && live.textContent) window.seenStreaming += 1;
        }).observe(document.body, {subtree: true, childList: true, characterData: true}); }""")
    page.send()
    assert page.tab.evaluate("window.seenStreaming") > 3  # it grew piece by piece
    messages = page.messages()
    assert [m["role"] for m in messages] == ["user", "assistant"]
    direct = reply_of(page.port, QUESTION, seed=11, max_tokens=48)
    assert messages[1]["content"] == direct["choices"][0]["message"]["content"] != ""
    assert page.tab.inner_text(".message.user .content") == QUESTION
    page.tab.reload()
    page.tab.wait_for_selector(".message.assistant")
    assert page.messages() == messages
    assert page.errors == []


def test_the_question_shows_above_its_reply_while_it_streams(page):
    page.open()
    page.start_reply("Write a story about a lighthouse keeper.", max_tokens=200,
                     sampler="greedy")
    assert page.tab.inner_text(".message.user .content") == \
        "Write a story about a lighthouse keeper."
    roles = page.tab.eval_on_selector_all(".message", "ms => ms.map(m => m.className)")
    assert roles == ["message user", "message assistant"]
    # Nothing offers what cannot be done while it streams: no Retry or Edit of the question
    # being answered, no Copy, Regenerate or Compare of a reply not whole yet.
    for name in ("retry", "edit"):
        assert page.tab.is_hidden(f".message.user .{name}")
    for name in ("copy", "regenerate", "compare"):
        assert page.tab.is_hidden(f".message.assistant .{name}")
    page.tab.click("#stop")
    page.wait_reply()
    assert page.tab.is_visible(".message.assistant .copy")
    assert page.tab.is_visible(".message.assistant .regenerate")


def test_the_view_follows_a_reply_that_grows_below_the_fold_on_a_phone(browser, server):
    context = browser.new_context(**{**PHONE, "viewport": {"width": 390, "height": 700}})
    page = Page(context, server).open()
    page.settings(max_tokens=400, sampler="greedy")
    page.tab.fill("#input", "Write a long story about a lighthouse keeper and his dog.")
    page.tab.press("#input", "Enter")
    overflow = ("(() => { const m = document.getElementById('messages');"
                " return document.querySelector('.content.streaming')"
                " && m.scrollHeight > m.clientHeight + 300; })()")
    wait_until(page.tab, overflow, timeout_s=REPLY_S / 1000)
    time.sleep(0.3)  # a frame or two: the view follows once a frame
    bottom_gap = page.tab.evaluate("(() => { const m = document.getElementById('messages');"
                                   " return m.scrollHeight - m.scrollTop - m.clientHeight; })()")
    streaming = page.tab.evaluate("Boolean(document.querySelector('.content.streaming'))")
    page.tab.click("#stop")
    page.wait_reply()
    context.close()
    assert streaming and bottom_gap < 120  # followed while it streamed, not at the end


def test_tokens_turned_on_and_off_mid_reply_keep_it_streaming(page):
    page.open()
    page.start_reply("Write a long story about a lighthouse keeper.", max_tokens=300,
                     sampler="greedy")
    page.tab.check("#token-view")
    count = "document.querySelectorAll('.content.streaming .tok').length"
    wait_until(page.tab, f"{count} > 0")
    first = page.tab.evaluate(count)
    wait_until(page.tab, f"{count} > {first} + 5")  # it goes on growing, as tokens
    page.tab.uncheck("#token-view")
    length = "document.querySelector('.content.streaming')?.textContent.length || 0"
    shown = page.tab.evaluate(length)
    wait_until(page.tab, f"{length} > {shown} + 20")  # and on, as text
    assert page.tab.evaluate("document.querySelectorAll('.content.streaming .tok').length") == 0
    page.tab.click("#stop")
    page.wait_reply()
    assert page.errors == []


def test_enter_sends_and_shift_enter_makes_a_new_line(page):
    page.open()
    page.tab.click("#input")
    page.tab.keyboard.type("first line")
    page.tab.keyboard.press("Shift+Enter")
    page.tab.keyboard.type("second")
    assert page.tab.input_value("#input") == "first line\nsecond"
    assert page.tab.locator(".message").count() == 0
    page.settings(max_tokens=4)
    page.tab.press("#input", "Enter")
    page.wait_reply()
    assert page.messages()[0]["content"] == "first line\nsecond"


def test_stop_ends_the_reply_and_keeps_what_came(page):
    page.open()
    page.start_reply("Write a very long story about a lighthouse keeper.", shown=40,
                     max_tokens=1500, sampler="greedy")
    page.tab.click("#stop")
    page.wait_reply()
    reply = page.messages()[-1]
    assert reply["interrupted"] is True and len(reply["content"]) > 40
    assert "stopped" in page.tab.inner_text(".message.assistant .meta")
    deadline = time.monotonic() + 10  # the server stops generating too
    while raw("GET", page.port, "/health", key=None)[2]["running"] and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert raw("GET", page.port, "/health", key=None)[2]["running"] == 0


def test_the_browser_counts_every_reply_that_ended_as_finished_and_a_stopped_one_aborted(page):
    """Chromium counted most streams whose body a script read as aborted (net::ERR_ABORTED,
    as its network panel shows them), though every byte had come: the page now holds each
    request to its end."""
    page.open()
    page.settings(max_tokens=12)
    for question in ("Say hello.", "Name a colour.", "Count to three.", "Name a river."):
        page.send(question)
    wait_until(page.tab, "performance.getEntriesByType('resource').filter((e) =>"
                         " e.name.endsWith('/v1/chat/completions')).length === 4")
    assert len(page.messages()) == 8 and page.failed == []
    page.start_reply("Write a very long story about a lighthouse keeper.", shown=20,
                     max_tokens=1500)
    page.tab.click("#stop")
    page.wait_reply()
    assert page.failed == [f"{page.base}/v1/chat/completions net::ERR_ABORTED"]
    assert page.errors == []


def test_regenerate_with_a_seed_gives_the_same_reply_and_without_one_a_new_seed(page):
    page.open()
    page.settings(seed=7, max_tokens=32)
    page.send()
    first = page.messages()[-1]
    page.tab.click(".message.assistant .regenerate")
    page.wait_reply()
    again = page.messages()[-1]
    assert len(page.messages()) == 2
    assert again["content"] == first["content"] and again["stats"]["seed"] == 7
    page.settings(seed="")
    page.tab.click(".message.assistant .regenerate")
    page.wait_reply()
    assert page.messages()[-1]["stats"]["seed"] != 7


def test_edit_resends_the_last_question(page):
    page.open()
    page.settings(max_tokens=8)
    page.send("Name a colour.")
    page.tab.click(".message.user .edit")
    page.tab.fill(".edit-area", "Name a fruit.")
    page.tab.click(".resend")
    page.wait_reply()
    messages = page.messages()
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Name a fruit." and messages[1]["content"]
    assert messages[0]["versions"][0]["content"] == "Name a colour."


def shown_texts(page) -> list[str]:
    return page.tab.locator(".message .content").all_inner_texts()


def test_editing_an_earlier_question_branches_and_the_old_branch_comes_back(page):
    page.open()
    page.settings(max_tokens=6, seed=5)
    page.send("Name a colour.")
    page.send("And a second one?")
    before = shown_texts(page)
    assert len(before) == 4
    page.tab.locator(".message.user .edit").first.click()
    page.tab.fill(".edit-area", "Name a fruit.")
    page.tab.press(".edit-area", "Enter")
    page.wait_reply()
    assert [m["content"] for m in page.messages()][0] == "Name a fruit."
    assert len(page.messages()) == 2  # the turns after the edited question are in its old branch
    first = page.tab.locator(".message.user").first
    assert first.locator(".version-count").inner_text() == "2/2"
    first.locator(".earlier").click()
    assert shown_texts(page) == before  # the old branch whole: both turns, as they were
    assert page.tab.locator(".message.user").first.locator(".version-count").inner_text() == "1/2"
    page.tab.reload()
    page.tab.wait_for_selector(".version-count")
    assert shown_texts(page) == before
    page.tab.locator(".message.user").first.locator(".later").click()
    assert shown_texts(page)[0] == "Name a fruit." and len(page.messages()) == 2
    assert page.errors == []


def test_regenerating_an_earlier_reply_keeps_the_turns_after_it_in_its_branch(page):
    page.open()
    page.settings(max_tokens=6)
    page.send("Name a colour.")
    page.send("And a second one?")
    before = shown_texts(page)
    page.tab.locator(".message.assistant .regenerate").first.click()
    page.wait_reply()
    messages = page.messages()
    assert len(messages) == 2 and messages[1]["versions"][0]["rest"][0]["content"] == \
        "And a second one?"
    page.tab.locator(".message.assistant .earlier").first.click()
    assert shown_texts(page) == before
    assert page.errors == []


def test_an_edited_question_keeps_its_attached_files(page, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("Rivers: Nile, Amazon.")
    page.open()
    page.settings(max_tokens=4)
    page.tab.set_input_files("#attach-file", [str(notes)])
    page.tab.wait_for_selector("#attachments .file-chip")
    page.send("Summarise.")
    page.tab.click(".message.user .edit")
    assert page.tab.input_value(".edit-area") == "Summarise."  # the text typed, not the file
    page.tab.fill(".edit-area", "List them.")
    page.tab.click(".resend")
    page.wait_reply()
    question = page.messages()[0]
    assert question["content"] == "List them.\n\nnotes.txt:\n```\nRivers: Nile, Amazon.\n```"
    assert question["files"] == ["notes.txt"] and question["typed"] == "List them."


def test_a_bad_setting_shows_the_servers_one_line_error_and_keeps_the_question(page):
    page.open()
    page.settings(**{"adaptive.eps": 2, "max_tokens": 8})
    page.tab.fill("#input", QUESTION)
    page.tab.press("#input", "Enter")
    page.tab.wait_for_selector("#error", state="visible")
    assert "`eps` has to be in (0, 1), but is 2" in page.error()
    assert [m["role"] for m in page.messages()] == ["user"]
    page.settings(**{"adaptive.eps": 0.01, "penalties.on": True, "penalties.repeat": 1.3})
    assert page.tab.inner_text("#spec") == "adaptive:eps=0.01+penalties:repeat=1.3"
    page.tab.click(".message.user .retry")
    page.wait_reply()
    assert page.error() == ""
    stats = page.messages()[-1]["stats"]
    assert stats["sampler"].startswith("adaptive:eps=0.01") and "penalties:repeat=1.3" in \
        stats["sampler"]


@pytest.mark.parametrize("field,value,needle", [
    ("seed", "abc", "seed has to be a whole number below 4294967296 (or empty for a random "
                    "one), but is abc"),
    ("max_tokens", "0", "max tokens has to be a whole number of 1 or more (or empty), but is 0"),
])
def test_a_bad_seed_or_max_tokens_is_said_before_sending(page, field, value, needle):
    page.open()
    page.settings(**{field: value})
    page.requests.clear()
    page.tab.fill("#input", QUESTION)
    page.tab.press("#input", "Enter")
    page.tab.wait_for_selector("#error", state="visible")
    assert page.error() == needle
    assert page.tab.input_value("#input") == QUESTION  # kept, to send once it is right
    assert not [r for r in page.requests if r.url.endswith("/v1/chat/completions")]
    assert page.tab.locator(".message").count() == 0


def test_a_question_sent_after_a_refused_one_takes_its_place(page):
    page.open()
    page.settings(**{"adaptive.eps": 2, "max_tokens": 4})
    for _ in range(2):  # refused twice
        page.tab.fill("#input", "Say hello.")
        page.tab.press("#input", "Enter")
        page.tab.wait_for_selector("#error", state="visible")
        page.wait_reply()
    assert [m["role"] for m in page.messages()] == ["user"]
    page.settings(**{"adaptive.eps": 0.01})
    page.requests.clear()
    page.send("Say goodbye.")
    sent = [json.loads(r.post_data) for r in page.requests
            if r.url.endswith("/v1/chat/completions")]
    assert [m["content"] for m in sent[-1]["messages"]] == ["Say goodbye."]
    assert [m["role"] for m in page.messages()] == ["user", "assistant"]


def test_a_question_sent_after_a_refused_edit_keeps_the_branch_the_edit_replaced(page):
    page.open()
    page.settings(max_tokens=4)
    page.send("Name a colour.")
    before = shown_texts(page)
    page.settings(**{"adaptive.eps": 2})  # the edited question's reply is refused
    page.tab.click(".message.user .edit")
    page.tab.fill(".edit-area", "Name a fruit.")
    page.tab.click(".resend")
    page.tab.wait_for_selector("#error", state="visible")
    page.wait_reply()
    page.settings(**{"adaptive.eps": 0.01})
    page.send("Name a tree.")  # takes the unanswered question's place
    assert [m["content"] for m in page.messages()][0] == "Name a tree."
    assert page.tab.inner_text(".message.user .version-count") == "3/3"
    page.tab.click(".message.user .earlier")
    page.tab.click(".message.user .earlier")
    assert shown_texts(page) == before  # the first branch, whole


def test_the_model_picker_lists_the_servers_models_and_sends_the_choice(page):
    page.open()
    options = page.tab.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert options == [m["id"] for m in raw("GET", page.port, "/v1/models", key=None)[2]["data"]]
    assert options == ["smollm2", "twin"]
    page.tab.select_option("#model", "twin")
    page.settings(max_tokens=4)
    page.send()
    sent = [json.loads(r.post_data) for r in page.requests
            if r.url.endswith("/v1/chat/completions")]
    assert sent[-1]["model"] == "twin" and sent[-1]["token_details"] is True


def test_copy_puts_the_reply_on_the_clipboard(browser, server):
    context = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
    page = Page(context, server).open()
    page.settings(max_tokens=16, seed=3)
    page.send()
    page.tab.click(".message.assistant .copy")
    assert page.tab.evaluate("navigator.clipboard.readText()") == page.messages()[-1]["content"]
    assert page.tab.inner_text(".message.assistant .copy") == "Copied"
    wait_until(page.tab, "document.querySelector('.message.assistant .copy').textContent"
                         " === 'Copy'", timeout_s=5)  # and then ready for the next copy
    context.close()


# ---- the sampler, visible ----

def test_the_token_view_shows_each_tokens_k_and_candidates(page):
    page.open()
    page.settings(seed=5, max_tokens=40, temperature=0.8)
    page.send()
    page.tab.check("#token-view")
    reply = page.messages()[-1]
    details = reply["details"]
    spans = page.tab.locator(".message.assistant .tok")
    assert spans.count() == len(details) == reply["stats"]["completion_tokens"]
    assert "".join(d["text"] for d in details) == reply["content"]
    # The page shows what the server computed: the same seed through the API gives the same
    # tokens with the same k.
    direct = reply_of(page.port, QUESTION, seed=5, max_tokens=40, sampler=reply["spec"],
                      temperature=0.8)
    assert [(d["text"], d["k"]) for d in direct["token_details"]] == \
        [(d["text"], d["k"]) for d in details]
    bucket = {1: "k-1", 5: "k-5", 20: "k-20"}
    for i in (0, len(details) // 2, len(details) - 1):
        k = details[i]["k"]
        want = next((c for limit, c in bucket.items() if k <= limit), "k-many")
        assert want in spans.nth(i).get_attribute("class")
    spans.nth(2).hover()
    card = page.tab.inner_text("#card")
    assert f"k = {details[2]['k']}" in card and "kept mass" in card
    assert page.tab.locator("#card li:not(.cut)").count() == len(details[2]["top"]) == 5
    # the sampler's cut drawn under the k-th candidate, where it falls among those shown
    cut_at = next(i for i, d in enumerate(details) if 1 <= d["k"] < 5)
    spans.nth(cut_at).hover()
    above = page.tab.evaluate("[...document.querySelectorAll('#card li')]"
                              ".findIndex((li) => li.classList.contains('cut'))")
    assert above == details[cut_at]["k"]
    assert page.tab.inner_text("#card .cut") == f"cut: the {details[cut_at]['k']} above kept"
    points = page.tab.get_attribute(".message.assistant .plot-k", "points").split()
    assert len(points) == len(details)
    page.tab.mouse.move(0, 0)
    assert page.tab.is_hidden("#card")
    if os.environ.get("ADAPTIVE_LLAMA_SCREENSHOTS"):
        spans.nth(2).hover()
        page.tab.screenshot(path=os.path.join(os.environ["ADAPTIVE_LLAMA_SCREENSHOTS"],
                                              "web-token-view.png"))


def test_compare_marks_the_first_token_where_two_samplers_part(page):
    page.open()
    page.settings(seed=21, max_tokens=40, temperature=1.5)
    page.send("Tell me about the sea.")
    original = page.messages()[-1]
    page.tab.click(".message.assistant .compare")
    page.tab.fill("#compare-spec", "greedy")
    page.tab.click("#compare-run")
    page.wait_reply()
    greedy = reply_of(page.port, "Tell me about the sea.", seed=21, max_tokens=40,
                      sampler="greedy")
    a = [d["text"] for d in original["details"]]
    b = [d["text"] for d in greedy["token_details"]]
    part = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    verdict = page.tab.locator(".verdict")
    assert verdict.inner_text() == f"They part at token {part + 1}."
    marked = page.tab.locator(".comparison .tok.diverge")
    assert marked.count() == 2
    assert [marked.nth(i).get_attribute("data-i") for i in range(2)] == [str(part)] * 2
    assert page.tab.locator(".comparison .column").nth(1).inner_text().endswith(
        greedy["choices"][0]["message"]["content"][-20:])
    # kept with its reply: a reload draws it again, the same mark where they part
    page.tab.reload()
    page.tab.wait_for_selector(".comparison .verdict")
    assert page.tab.inner_text(".verdict") == f"They part at token {part + 1}."
    assert [page.tab.locator(".comparison .tok.diverge").nth(i).get_attribute("data-i")
            for i in range(2)] == [str(part)] * 2
    kept = page.messages()[-1]["comparison"]
    assert (kept["spec"], kept["seed"]) == ("greedy", 21) and "left" not in kept
    # the sampler is picked from the server's list, or typed with its parameters
    listed = page.tab.eval_on_selector_all("#compare-samplers option", "os => os.map(o => o.value)")
    assert {"greedy", "adaptive", "min-p", "p-less", "top-h"} <= set(listed)
    assert not {"penalties", "dry", "xtc"} & set(listed)  # modifiers are no samplers alone
    # The same sampler and seed again: the same reply, token for token.
    page.tab.click(".message.assistant .compare")
    assert page.tab.input_value("#compare-spec") == "greedy"  # the last one compared
    page.tab.fill("#compare-spec", original["stats"]["sampler"])
    page.tab.click("#compare-run")
    page.wait_reply()
    assert page.tab.inner_text(".verdict") == "Same text, token for token."


# ---- conversations in and out ----

def test_a_stopped_reply_keeps_its_seed_and_compares_against_it(page):
    page.open()
    page.settings(max_tokens=300, seed="")
    page.tab.fill("#input", "Write a long story about a lighthouse keeper.")
    page.tab.press("#input", "Enter")
    wait_until(page.tab, "document.querySelectorAll('.content.streaming').length && "
               "document.querySelector('.content.streaming').textContent.length > 60",
               timeout_s=REPLY_S / 1000)
    page.tab.click("#stop")
    page.wait_reply()
    stopped = page.messages()[-1]
    assert stopped["interrupted"] and isinstance(stopped["seed"], int)
    meta = page.tab.inner_text(".message.assistant .meta")
    assert f"seed {stopped['seed']}" in meta and "tokens" in meta and "adaptive" in meta
    # the same sampler and seed on the other side: the same text as far as the stop (past
    # it, a few tokens are enough: random seeds would part within them)
    page.settings(max_tokens=len(stopped["details"]) + 8)
    page.tab.click(".message.assistant .compare")
    page.tab.fill("#compare-spec", stopped["spec"])
    page.tab.click("#compare-run")
    wait_until(page.tab, "document.querySelector('.verdict')?.textContent !== 'Comparing…'",
               timeout_s=REPLY_S / 1000)
    titles = page.tab.eval_on_selector_all(".column-title", "ts => ts.map(t => t.textContent)")
    assert all(t.endswith(f"seed {stopped['seed']}") for t in titles) and len(titles) == 2
    verdict = page.tab.inner_text(".verdict")
    assert verdict != "They part at token 1."
    at = int(page.tab.get_attribute(".verdict", "data-at") or -1)
    assert at == -1 or at >= len(stopped["details"]) - 1  # they part only where it stopped


def test_export_writes_the_repls_save_file_and_import_reads_it_back(page, tmp_path):
    page.open()
    page.settings(seed=4, max_tokens=12, system="Answer briefly.")
    page.send()
    with page.tab.expect_download() as download:
        page.tab.click("#export")
    path = tmp_path / "chat.json"
    download.value.save_as(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["seed"] == 4 and data["max_tokens"] == 12
    assert data["system"] == "Answer briefly."
    assert [m["content"] for m in data["messages"]] == \
        [m["content"] for m in page.messages()]
    fresh = SimpleNamespace(system=None, sampler="adaptive", seed=None, max_tokens=256)
    saved = check_saved_chat(data, fresh)  # as the REPL reads a /load file
    assert saved["seed"] == 4 and saved["sampler"] == parse_spec(data["sampler"])
    repl = subprocess.run([sys.executable, "-m", "adaptive_llama.cli", "run", "--resume",
                           str(path)], input="/show\n", capture_output=True, text=True,
                          timeout=300)
    assert repl.returncode == 0 and ": 2 messages" in repl.stdout, repl.stderr
    assert "Answer briefly." in repl.stdout  # /show: the chat's system prompt came along
    data["messages"].append({"role": "user", "content": "And a fourth?"})
    path.write_text(json.dumps(data))
    page.tab.set_input_files("#import-file", str(path))
    wait_until(page.tab, "document.querySelectorAll('.message').length === 3")
    assert len(page.chats()) == 2 and page.messages()[-1]["content"] == "And a fourth?"
    assert page.tab.input_value("#system") == "Answer briefly."


def test_a_file_that_is_not_a_chat_is_refused_in_one_line(page, tmp_path):
    page.open()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}))
    page.tab.set_input_files("#import-file", str(bad))
    page.tab.wait_for_selector("#error", state="visible")
    assert page.error() == ("Cannot import bad.json: `messages` has to be a list of "
                            "{role: user|assistant, content: text}")
    assert page.chats() in (None, [])


HOSTILE = ('<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
           '[click](javascript:window.pwned=3) **bold** `<b>code</b>`')


def test_hostile_text_is_shown_as_text_never_run(page, tmp_path):
    page.open()
    chat = tmp_path / "hostile.json"
    chat.write_text(json.dumps({"version": 1, "messages": [
        {"role": "user", "content": HOSTILE}, {"role": "assistant", "content": HOSTILE}]}))
    page.tab.set_input_files("#import-file", str(chat))
    page.tab.wait_for_selector(".message.assistant")
    holder = page.tab.locator("#messages")
    assert holder.locator("script, img, b").count() == 0
    assert holder.locator("a").count() == 0  # a javascript: link stays text
    assert holder.locator("strong").inner_text() == "bold"
    assert "<script>window.pwned = 1</script>" in page.tab.inner_text(".message.user")
    assert '<img src=x onerror="window.pwned = 2">' in page.tab.inner_text(".message.assistant")
    # A streamed reply's token view takes its tokens' text the same way.
    page.tab.evaluate("""async (hostile) => {
        const { LiveReply } = await import('/web/reply.js');
        const content = document.createElement('div');
        document.body.append(content);
        const live = new LiveReply(content, {role: 'assistant', content: ''}, true);
        live.add(hostile, [{text: hostile, logprob: -1, top: [{text: hostile, p: 0.5}],
                            k: 3, mass: 0.9, entropy: 1}]);
        live.finish(); }""", HOSTILE)
    assert page.tab.locator("body > div script, body > div img").count() == 0
    page.tab.wait_for_timeout(200)
    assert page.tab.evaluate("window.pwned === undefined")


def test_markdown_renders_while_the_reply_streams(page):
    # The page's own LiveReply fed a reply in chunks, as the stream feeds it: the code block
    # and the bold text are drawn before the reply ends, never shown as raw ``` and **.
    page.open()
    drawn = page.tab.evaluate(r"""async () => {
        const { LiveReply } = await import('/web/reply.js');
        const holder = document.getElementById('messages');
        const content = holder.appendChild(document.createElement('div'));
        const message = { role: 'assistant', content: '' };
        const live = new LiveReply(content, message, false);
        const frame = () => new Promise((done) => requestAnimationFrame(() => setTimeout(done, 30)));
        // a blank line inside the code block does not end it; the frames in between draw
        // the finished blocks once and the growing one again
        for (const piece of ['Some **bold', '** text.\n\n```py', 'thon\nx = 1\n\n',
                             'y = 2\n', '```\n\nAfter *that*.']) {
            live.add(piece, []);
            await frame();
        }
        return { streaming: content.classList.contains('streaming'),
                 strong: content.querySelector('strong')?.textContent,
                 code: [...content.querySelectorAll('pre code')].map((c) => c.textContent),
                 em: content.querySelector('em')?.textContent,
                 raw: content.textContent.includes('```') || content.textContent.includes('**') };
    }""")
    assert drawn == {"streaming": True, "strong": "bold", "code": ["x = 1\n\ny = 2"],
                     "em": "that", "raw": False}


def test_markdown_renders_lists_tables_and_code_blocks(page, tmp_path):
    page.open()
    text = ("# Title\n\nSome `inline` and **bold** text, see https://example.org.\n\n"
            "- one\n- two\n  - nested\n\n1. first\n2. second\n\n| a | b |\n|---|---|\n"
            "| 1 | 2 |\n\n> quoted\n\n```python\nprint('hi')\n```\n")
    chat = tmp_path / "md.json"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "md"},
                                             {"role": "assistant", "content": text}]}))
    page.tab.set_input_files("#import-file", str(chat))
    reply = page.tab.locator(".message.assistant .content")
    reply.wait_for()
    assert reply.locator("h1").inner_text() == "Title"
    assert reply.locator("p code").inner_text() == "inline"
    assert reply.locator(":scope > ul > li").count() == 2
    assert reply.locator("ul ul li").count() == 1
    assert reply.locator(":scope > ol > li").count() == 2
    assert reply.locator("td").all_inner_texts() == ["1", "2"]
    assert reply.locator("blockquote").inner_text() == "quoted"
    assert reply.locator("pre code").inner_text() == "print('hi')"
    assert reply.locator(".code-language").inner_text() == "python"
    assert reply.locator("a").get_attribute("href") == "https://example.org"


def test_code_is_highlighted_and_math_typeset_and_hostile_tex_stays_text(page, tmp_path):
    code = "def f(x):\n    return x + 1  # one"
    text = ("Euler: $e^{i\\pi} + 1 = 0$, and it costs $5 or $10.\n\n"
            "$$\n\\frac{a}{b} = \\sqrt{x}\n$$\n\n"
            "Bad: $\\text{<img src=x onerror=alert(1)>}$\n\n"
            f"```python\n{code}\n```\n\n```nosuchlanguage\nplain words\n```\n")
    chat = tmp_path / "typeset.json"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "maths"},
                                             {"role": "assistant", "content": text}]}))
    page.open()
    page.tab.set_input_files("#import-file", str(chat))
    reply = page.tab.locator(".message.assistant .content")
    wait_until(page.tab, "document.querySelectorAll('.message.assistant math').length === 2 && "
                         "document.querySelector('.message.assistant .hl-keyword')")
    python = reply.locator("code[data-language='python']")
    assert python.inner_text() == code  # coloured, not changed
    assert python.locator(".hl-keyword").all_inner_texts() == ["def", "return"]
    assert python.locator(".hl-comment").inner_text() == "# one"
    assert python.locator(".hl-number").inner_text() == "1"
    assert reply.locator("code[data-language='nosuchlanguage'] span").count() == 0
    inline, display = reply.locator("math").all()
    assert inline.get_attribute("display") == "inline" and inline.locator("msup").count() == 1
    assert display.get_attribute("display") == "block"
    assert display.locator("mfrac").count() == 1 and display.locator("msqrt").count() == 1
    assert "costs $5 or $10." in reply.locator("p").first.inner_text()  # money, not math
    bad = reply.locator(".math:not(.display)").nth(1)
    assert bad.inner_text() == "$\\text{<img src=x onerror=alert(1)>}$"  # as written
    assert page.tab.locator(".content img").count() == 0
    typeset = [r for r in page.requests if r.url.endswith("/web/typeset")]
    assert len(typeset) == 1  # the reply's blocks and formulas asked for together
    assert page.errors == []
    if os.environ.get("ADAPTIVE_LLAMA_SCREENSHOTS"):
        page.tab.locator(".message.assistant").screenshot(path=os.path.join(
            os.environ["ADAPTIVE_LLAMA_SCREENSHOTS"], "web-code-math.png"))


def test_the_key_is_asked_once_per_tab(browser, keyed_server):
    context = browser.new_context()
    page = Page(context, keyed_server)
    page.tab.goto(page.base + "/")
    page.tab.wait_for_selector("#key-dialog[open]")
    page.tab.fill("#key-input", "wrong")
    page.tab.press("#key-input", "Enter")
    wait_until(page.tab,
               "document.querySelector('#key-note').textContent.includes('not accepted')")
    page.tab.fill("#key-input", KEY)
    page.tab.click("#key-ok")
    page.tab.wait_for_selector("#model option", state="attached")
    page.settings(max_tokens=4)
    page.send()
    assert page.messages()[-1]["role"] == "assistant"
    page.tab.reload()  # the same tab keeps the key
    page.tab.wait_for_selector("#model option", state="attached")
    assert page.tab.locator("#key-dialog[open]").count() == 0
    other = Page(context, keyed_server)  # a new tab asks again
    other.tab.goto(other.base + "/")
    other.tab.wait_for_selector("#key-dialog[open]")
    context.close()


# ---- looks ----

def test_the_theme_toggles_and_a_phone_width_fits(browser, server):
    context = browser.new_context(viewport={"width": 390, "height": 780}, color_scheme="light")
    page = Page(context, server).open()
    assert page.tab.evaluate("document.documentElement.dataset.theme") == "light"
    background = "getComputedStyle(document.body).backgroundColor"
    light = page.tab.evaluate(background)
    page.tab.click("#theme")
    assert page.tab.evaluate("document.documentElement.dataset.theme") == "dark"
    assert page.tab.evaluate(background) != light
    page.settings(max_tokens=24)
    page.send()
    assert page.tab.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert page.tab.evaluate("document.getElementById('sidebar').getBoundingClientRect()"
                             ".right <= 0")  # the chats slide in on demand
    page.tab.click("#toggle-sidebar")
    wait_until(page.tab, "document.getElementById('sidebar')"
                               ".getBoundingClientRect().left >= 0")
    assert page.tab.get_attribute("#toggle-sidebar", "aria-expanded") == "true"
    page.tab.click("#toggle-sidebar")  # the open list leaves its toggle in reach: it closes
    wait_until(page.tab, "document.getElementById('sidebar')"
                               ".getBoundingClientRect().right <= 0")
    assert page.tab.get_attribute("#toggle-sidebar", "aria-expanded") == "false"
    context.close()


def test_the_keyboard_reaches_everything_and_escape_stops_and_closes(page):
    page.open()
    page.settings(max_tokens=12, seed=3)
    # Settings: focus goes in, says it is open, and comes back out on Escape
    page.tab.click("#open-settings")
    assert page.tab.evaluate("document.activeElement.id") == "system"
    assert page.tab.get_attribute("#open-settings", "aria-expanded") == "true"
    page.tab.keyboard.press("Escape")
    assert page.tab.is_hidden("#settings")
    assert page.tab.evaluate("document.activeElement.id") == "open-settings"
    # Import is a button Tab reaches
    assert page.tab.evaluate("document.getElementById('import').tabIndex") == 0
    page.tab.check("#token-view")
    page.send()
    # the reply in the token view is one Tab stop; the arrows show each token's card
    reply = page.tab.locator(".message.assistant .content")
    assert reply.get_attribute("tabindex") == "0"
    reply.focus()
    page.tab.keyboard.press("ArrowRight")
    first = page.tab.inner_text("#card")
    page.tab.keyboard.press("ArrowRight")
    assert page.tab.is_visible("#card") and "k = " in first
    page.tab.keyboard.press("Escape")
    assert page.tab.is_hidden("#card")
    # Escape stops a reply; the focus goes back to the message box, not to <body>
    page.settings(max_tokens=1500, sampler="greedy", seed="")
    page.tab.fill("#input", "Write a very long story about a lighthouse keeper.")
    page.tab.press("#input", "Enter")
    wait_until(page.tab, "document.getElementById('messages').getAttribute('aria-busy')"
               " === 'true' && document.querySelector('.content.streaming')?.textContent.length"
               " > 20", timeout_s=REPLY_S / 1000)
    page.tab.keyboard.press("Escape")
    page.wait_reply()
    assert page.messages()[-1]["interrupted"] is True
    assert page.tab.evaluate("document.activeElement.id") == "input"
    assert page.tab.get_attribute("#messages", "aria-busy") == "false"


CONTRAST = r"""() => {
    const lum = (rgb) => {
        const [r, g, b] = rgb.match(/\d+/g).slice(0, 3).map((v) => {
            const c = v / 255;
            return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; });
        return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
    return [...document.querySelectorAll('.k-legend .k-swatch')].map((span) => {
        const style = getComputedStyle(span);
        const [a, b] = [lum(style.color), lum(style.backgroundColor)].sort((x, y) => y - x);
        return { k: span.className, ratio: (a + 0.05) / (b + 0.05),
                 line: style.textDecorationLine + ' ' + style.textDecorationStyle }; });
}"""


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_token_colours_meet_wcag_aa_and_a_legend_says_what_they_mean(browser, server, theme):
    context = browser.new_context(color_scheme=theme)
    page = Page(context, server).open()
    page.settings(max_tokens=8, seed=3)
    page.tab.check("#token-view")
    page.send()
    legend = page.tab.inner_text(".k-legend")
    assert "sure" in legend and "hesitant" in legend
    buckets = page.tab.evaluate(CONTRAST)
    assert len(buckets) == 4
    assert all(b["ratio"] >= 4.5 for b in buckets), buckets  # WCAG 2.2 AA, normal text
    assert len({b["line"] for b in buckets}) == 4  # not colour alone: each its own underline
    context.close()


def test_a_tap_on_a_token_shows_its_card_on_a_phone(browser, server):
    context = browser.new_context(**PHONE)
    page = Page(context, server).open()
    page.settings(max_tokens=12, seed=3)
    page.tab.check("#token-view")
    page.send()
    span = page.tab.locator(".message.assistant .tok").nth(1)
    span.tap()
    time.sleep(0.3)  # the mouse events a touch screen sends after a tap come and go
    assert page.tab.is_visible("#card") and "k = " in page.tab.inner_text("#card")
    page.tab.tap(".message.user .content")  # a tap elsewhere puts it away
    assert page.tab.is_hidden("#card")
    assert page.errors == []
    context.close()


# ---- `adaptive-llama web` ----

def test_web_serves_and_opens_the_page_in_the_browser(smollm2_path, tmp_path):
    opened = tmp_path / "opened"
    browser_cmd = tmp_path / "browser"
    browser_cmd.write_text(f"#!/bin/sh\necho \"$1\" > {opened}\n")
    browser_cmd.chmod(0o755)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "adaptive_llama.cli", "web",
                             str(smollm2_path), "--port", str(port), "--ctx", "256"],
                            env={**os.environ, "BROWSER": str(browser_cmd)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not opened.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert opened.read_text().strip() == f"http://127.0.0.1:{port}/"
        assert raw("GET", port, "/", key=None, parse=False)[0] == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert f"the chat page is http://127.0.0.1:{port}/" in err


# ---- a reasoning model's thinking ----

@pytest.fixture(scope="module")
def thinking_port(reasoning_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("web-r1") / "server.log"
    yield from serving(reasoning_model, log, "--sampler", "greedy", api_key=None)


def test_a_reasoning_models_thinking_streams_in_a_block_of_its_own(browser, thinking_port):
    from reasoning_model import ANSWER_TEXT, THINKING_TEXT

    context = browser.new_context(viewport={"width": 1200, "height": 850})
    page = Page(context, thinking_port).open()
    page.tab.evaluate("""() => { window.openWhileStreaming = false;
        new MutationObserver(() => {
            if (document.querySelector('.content.streaming')
                && document.querySelector('details.thinking[open] .thinking-text')
                       ?.textContent) window.openWhileStreaming = true;
        }).observe(document.body, {subtree: true, childList: true, attributes: true,
                                   characterData: true}); }""")
    page.send("What is 17 times 23?")
    reply = page.tab.locator(".message.assistant").last
    assert reply.locator(".content").inner_text().strip() == ANSWER_TEXT
    block = reply.locator("details.thinking")
    assert block.locator(".thinking-text").text_content() == THINKING_TEXT.strip()
    assert not block.evaluate("b => b.open")  # folded once the answer came
    assert block.locator("summary").inner_text().startswith("Thought for ")
    assert page.tab.evaluate("window.openWhileStreaming")
    saved = page.messages()[-1]
    assert (saved["content"], saved["reasoning"]) == (ANSWER_TEXT, THINKING_TEXT.strip())
    # the next question sends the answers back without their thinking
    page.send("And 2 times 3?")
    sent = [json.loads(r.post_data) for r in page.requests
            if r.url.endswith("/v1/chat/completions")][-1]["messages"]
    assert THINKING_TEXT.strip() not in json.dumps(sent) and sent[1]["content"] == ANSWER_TEXT
    # a reload keeps each thinking, folded; the token view shows its tokens dimmed instead
    page.tab.reload()
    page.tab.wait_for_selector(".message.assistant")
    assert page.tab.locator("details.thinking:not([open])").count() == 2
    page.tab.check("#token-view")
    assert page.tab.locator("details.thinking").count() == 0
    thought = page.tab.locator(".message.assistant").last.locator(".tok.thought")
    assert "Let me think" in "".join(thought.all_text_contents())
    assert page.errors == []
    context.close()


# ---- chats: switching, reloading, deleting, importing ----

def settings_saved(page) -> dict:
    return page.tab.evaluate("JSON.parse(localStorage.getItem('adaptive-llama.settings'))")


def test_new_chat_while_a_reply_streams_stops_it_keeps_it_and_opens_an_empty_chat(page):
    page.open()
    page.start_reply("Write a long story about a lighthouse keeper.", max_tokens=300,
                     sampler="greedy")
    page.tab.click("#new-chat")
    page.tab.wait_for_selector("#send", state="visible")
    wait_until(page.tab, "document.querySelector('#messages .empty') !== null")
    assert page.tab.locator("#messages .message").count() == 0
    (old,) = page.chats()
    question, reply = old["messages"]
    assert question["content"].startswith("Write a long story")
    assert reply["interrupted"] and len(reply["content"]) > 20
    page.tab.click("#chat-list .chat-title")  # and back: the stopped reply is there
    wait_until(page.tab, "document.querySelectorAll('.message').length === 2")
    assert "stopped" in page.tab.locator(".message.assistant .meta").inner_text()
    assert page.errors == []


def test_a_reload_opens_the_chat_that_was_open(page):
    page.open()
    page.settings(max_tokens=4)
    page.send("First chat")
    page.tab.click("#new-chat")
    page.send("Second chat")
    page.tab.locator("#chat-list .chat-title", has_text="First chat").click()
    wait_until(page.tab, "document.querySelector('.message.user')?.textContent"
                         ".includes('First chat')")
    page.tab.reload()
    page.tab.wait_for_selector(".message.user")
    assert "First chat" in page.tab.locator(".message.user").first.inner_text()
    assert page.tab.locator("#chat-list li.active").inner_text().startswith("First chat")


def test_chats_kept_in_local_storage_by_an_earlier_page_move_to_indexeddb(page):
    old = [{"id": "old-2", "title": "Newer", "updated": 2, "model": "", "system": "",
            "messages": [{"role": "user", "content": "Newer question"},
                         {"role": "assistant", "content": "Newer reply"}]},
           {"id": "old-1", "title": "Older", "updated": 1, "model": "", "system": "",
            "messages": [{"role": "user", "content": "Older question"}]}]
    page.open(wait_models=False)
    page.tab.evaluate("(chats) => localStorage.setItem('adaptive-llama.chats', "
                      "JSON.stringify(chats))", old)
    page.open()
    assert page.tab.locator("#chat-list .chat-title").all_inner_texts() == ["Newer", "Older"]
    assert page.tab.locator(".message .content").all_inner_texts() == ["Newer question",
                                                                        "Newer reply"]
    assert [c["title"] for c in page.chats()] == ["Newer", "Older"]
    assert page.tab.evaluate("localStorage.getItem('adaptive-llama.chats')") is None
    page.tab.reload()  # read from IndexedDB now
    page.tab.wait_for_selector("#chat-list .chat-title")
    assert page.tab.locator("#chat-list .chat-title").all_inner_texts() == ["Newer", "Older"]
    # A move cut short (the tab closed after the chats were written, before the old key
    # went) ends on the next visit: each chat once, and the one not moved yet moved too.
    newest = {"id": "old-3", "title": "Newest", "updated": 3, "model": "", "system": "",
              "messages": [{"role": "user", "content": "Newest question"}]}
    page.tab.evaluate("(chats) => localStorage.setItem('adaptive-llama.chats', "
                      "JSON.stringify(chats))", [newest, *old])
    page.tab.reload()
    wait_until(page.tab, "document.querySelectorAll('#chat-list .chat-title').length === 3")
    assert page.tab.locator("#chat-list .chat-title").all_inner_texts() == [
        "Newest", "Newer", "Older"]
    assert [c["title"] for c in page.chats()] == ["Newest", "Newer", "Older"]
    assert page.tab.evaluate("localStorage.getItem('adaptive-llama.chats')") is None
    assert page.errors == []


def test_a_deleted_chat_comes_back_with_undo(page):
    page.open()
    page.settings(max_tokens=4)
    page.send("Keep me")
    page.tab.click("#chat-list .delete-chat")
    assert page.chats() == [] and page.tab.is_visible("#notice")
    assert 'Deleted "Keep me"' in page.tab.inner_text("#notice-text")
    page.tab.click("#notice-undo")
    assert [c["title"] for c in page.chats()] == ["Keep me"]
    wait_until(page.tab, "document.querySelectorAll('.message').length === 2")
    assert page.tab.is_hidden("#notice")


def test_import_says_which_settings_it_took_and_undo_puts_them_back(page, tmp_path):
    page.open()
    page.settings(seed=5, max_tokens=20)
    path = tmp_path / "from-the-repl.json"
    path.write_text(json.dumps({"version": 1, "sampler": "min-p:p=0.2", "seed": 9,
                                "max_tokens": 33, "messages": [
                                    {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello."}]}))
    page.tab.set_input_files("#import-file", str(path))
    page.tab.wait_for_selector("#notice", state="visible")
    said = page.tab.inner_text("#notice-text")
    assert "from-the-repl.json" in said and "sampler min-p:p=0.2" in said
    assert "seed 9" in said and "max tokens 33" in said
    assert (settings_saved(page)["seed"], settings_saved(page)["maxTokens"]) == (9, 33)
    page.tab.click("#notice-undo")
    assert (settings_saved(page)["seed"], settings_saved(page)["maxTokens"]) == ("5", "20")
    assert page.messages()[-1]["content"] == "Hello."  # the chat itself stays


def test_each_reply_says_its_prompts_tokens_those_cached_and_its_speed(page):
    page.open()
    page.settings(max_tokens=4, seed=1, system="You answer questions. " * 30)  # > 64 tokens
    page.send("Name a river.")
    first = page.tab.locator(".message.assistant .meta").last.inner_text()
    assert re.search(r"prompt \d+ tokens in \d+\.\d\d s, \d+ tok/s", first), first
    page.send("Name another.")  # the system prompt's whole chunks come from the cache
    second = page.tab.locator(".message.assistant .meta").last.inner_text()
    cached = re.search(r"prompt (\d+) tokens \((\d+) cached\)", second)
    assert cached and 64 <= int(cached[2]) < int(cached[1]), second
    stats = page.messages()[-1]["stats"]
    assert stats["prompt_tokens"] - stats["prompt_evaluated"] == int(cached[2])


def test_chats_are_searched_by_their_words_renamed_in_place_and_shortcuts_work(page):
    page.open()
    page.settings(max_tokens=4)
    page.send("Tell me about otters")
    page.tab.keyboard.press("Control+Shift+O")  # a new chat, the input focused
    assert page.tab.locator("#messages .message").count() == 0
    assert page.tab.evaluate("document.activeElement.id") == "input"
    page.send("Something on volcanoes")
    page.tab.keyboard.press("Control+k")
    assert page.tab.evaluate("document.activeElement.id") == "chat-search"
    page.tab.keyboard.type("OTTERS")  # words of a message, in any case
    titles = page.tab.locator("#chat-list .chat-title").all_inner_texts()
    assert titles == ["Tell me about otters"]
    page.tab.fill("#chat-search", "no such words anywhere")
    assert "No chat holds these words." in page.tab.inner_text("#chat-list")
    page.tab.fill("#chat-search", "")
    assert page.tab.locator("#chat-list .chat-title").count() == 2
    page.tab.locator("#chat-list .chat-title").first.dblclick()
    page.tab.fill("#chat-list input.rename", "  Volcanoes  ")
    page.tab.press("#chat-list input.rename", "Enter")
    assert [c["title"] for c in page.chats()] == ["Volcanoes", "Tell me about otters"]
    page.tab.locator("#chat-list .chat-title").first.dblclick()
    page.tab.fill("#chat-list input.rename", "Not kept")
    page.tab.press("#chat-list input.rename", "Escape")  # cancels
    assert page.chats()[0]["title"] == "Volcanoes"
    page.tab.locator("#chat-list .chat-title").first.dblclick()
    page.tab.fill("#chat-list input.rename", "   ")
    page.tab.press("#chat-list input.rename", "Enter")  # empty: the old title stays
    assert page.chats()[0]["title"] == "Volcanoes"
    page.send("And lava?")  # a chat's title is not overwritten by its next question
    assert page.chats()[0]["title"] == "Volcanoes"
    assert "Ctrl+K search" in page.tab.inner_text("#shortcuts")
    assert page.errors == []


# ---- accessibility ----

def axe_violations(tab) -> list[str]:
    """What axe-core finds against WCAG 2.2 A and AA (and best practices) on the page now."""
    from axe_playwright_python.sync_playwright import Axe

    found = Axe().run(tab).response["violations"]
    return [f"{v['id']} ({v['impact']}): {v['help']} at "
            f"{[n['target'] for n in v['nodes'][:3]]}" for v in found]


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_axe_finds_nothing_on_the_page_in_either_theme(page, theme):
    page.open()
    current = "document.documentElement.dataset.theme"
    if page.tab.evaluate(current) != theme:
        page.tab.click("#theme")
    assert page.tab.evaluate(current) == theme
    page.settings(max_tokens=24, seed=3)
    page.send()
    assert axe_violations(page.tab) == []  # a reply as text, its actions and figures
    page.tab.check("#token-view")
    assert axe_violations(page.tab) == []  # as coloured tokens, with the legend
    page.tab.click("#open-settings")
    assert axe_violations(page.tab) == []  # the settings panel
    page.tab.click("#close-settings")
    page.tab.click(".message.assistant .compare")
    assert axe_violations(page.tab) == []  # the compare dialog


def test_axe_finds_nothing_on_a_phone_with_the_chats_open_a_card_pinned_and_math(
        browser, server, tmp_path):
    context = browser.new_context(**PHONE)
    page = Page(context, server).open()
    page.settings(max_tokens=16, seed=3)
    page.tab.check("#token-view")
    page.send()
    page.tab.locator(".message.assistant .tok").nth(1).tap()
    page.tab.wait_for_selector("#card", state="visible")
    assert axe_violations(page.tab) == []  # a reply as tokens, a card pinned by a tap
    page.tab.tap("#toggle-sidebar")
    assert page.tab.get_attribute("#toggle-sidebar", "aria-expanded") == "true"
    assert axe_violations(page.tab) == []  # the list of chats over the page
    page.tab.tap("#toggle-sidebar")
    page.tab.uncheck("#token-view")
    chat = tmp_path / "maths.json"
    chat.write_text(json.dumps({"messages": [
        {"role": "user", "content": "maths"},
        {"role": "assistant", "content": "So $x^2$ and\n\n$$\\frac{1}{2}$$\n\n"
                                         "```python\nx = 1  # one\n```"}]}))
    page.tab.set_input_files("#import-file", str(chat))
    wait_until(page.tab, "document.querySelectorAll('.message.assistant math').length === 2"
                         " && document.querySelector('.hl-comment')")
    assert axe_violations(page.tab) == []  # typeset math and highlighted code
    context.close()


def test_regenerate_keeps_the_earlier_replies_as_versions_to_go_back_to(page):
    page.open()
    page.settings(max_tokens=12)  # no seed: each reply gets a fresh one
    page.send()
    first = page.messages()[-1]
    page.tab.click(".message.assistant .regenerate")
    page.wait_reply()
    second = page.messages()[-1]
    assert second["seed"] != first["seed"]
    count = ".message.assistant .version-count"
    assert page.tab.inner_text(count) == "2/2"
    assert page.tab.is_disabled(".message.assistant .later")
    page.tab.click(".message.assistant .earlier")
    assert page.tab.inner_text(count) == "1/2"
    shown = page.messages()[-1]
    assert (shown["content"], shown["seed"]) == (first["content"], first["seed"])
    assert shown["versions"][0] is None and shown["versions"][1]["seed"] == second["seed"]
    page.tab.check("#token-view")  # the tokens' own text: the version shown, exactly
    assert page.tab.text_content(".message.assistant .content") == first["content"]
    page.tab.uncheck("#token-view")
    page.tab.click(".message.assistant .regenerate")  # a third, after both
    page.wait_reply()
    assert page.tab.inner_text(count) == "3/3"
    page.tab.reload()
    page.tab.wait_for_selector(count)
    assert page.tab.inner_text(count) == "3/3"
    assert len(page.messages()) == 2  # one question, one reply with its versions
    page.send("And one more?")  # the reply keeps its versions; this turn joins the third's branch
    assert page.tab.inner_text(count) == "3/3" and len(page.messages()) == 4
    page.tab.click(".message.assistant .earlier")
    assert len(page.messages()) == 2
    page.tab.click(".message.assistant .later")
    assert len(page.messages()) == 4 and page.messages()[2]["content"] == "And one more?"
    assert page.errors == []


def test_a_full_storage_drops_an_earlier_versions_token_details_first(page, browser, server):
    # Chromium refuses writes past its quota when the quota is set before the page first
    # opens its storage: what an empty one takes is read in a tab of its own first.
    empty = Page(browser.new_context(), server).open()
    used = empty.tab.evaluate("navigator.storage.estimate().then((e) => e.usage)")
    empty.tab.context.close()
    devtools = page.tab.context.new_cdp_session(page.tab)
    devtools.send("Storage.overrideQuotaForOrigin",
                  {"origin": page.base, "quotaSize": used + 96_000})
    page.open()
    page.settings(max_tokens=48, sampler="greedy")
    page.send("Write a long story about a lighthouse keeper.")
    page.settings(max_tokens=4)
    page.tab.click(".message.assistant .regenerate")
    page.wait_reply()
    earlier = page.chats()[0]["messages"][-1]["versions"][0]
    assert earlier["details"]
    # Titles of random letters (storage compresses what repeats) grow until nothing fits:
    # the earlier version's details go first, then the shown reply's (a few tokens' worth),
    # then an error says so.
    letters = random.Random(0)
    lost = []
    for size in range(4_000, 400_000, 4_000):
        title = "".join(letters.choices(string.ascii_letters, k=size))
        page.tab.locator("#chat-list .chat-title").first.dblclick()
        page.tab.fill("#chat-list input.rename", title)
        page.tab.press("#chat-list input.rename", "Enter")
        page.tab.evaluate("window.adaptiveLlama.saved")  # the write, and any retry, ended
        if page.error():
            break
        chat = page.chats()[0]
        assert chat["title"] == title  # it fitted, with what was dropped for it
        reply = chat["messages"][-1]
        now = ["earlier" if "details" not in reply["versions"][0] else "",
               "shown" if "details" not in reply else ""]
        lost = [part for part in now if part] if any(now) else lost
        if "shown" in lost:
            assert "earlier" in lost  # never the shown reply's before the earlier one's
    assert lost[:1] == ["earlier"]  # it went before the error came
    assert page.error().startswith("The browser's storage is full")
    reply = page.chats()[0]["messages"][-1]
    assert reply["versions"][0]["content"] == earlier["content"] and reply["content"]


# ---- attached files ----

def test_text_files_are_attached_by_name_and_a_binary_one_is_refused(page, tmp_path):
    code = tmp_path / "fib.py"
    code.write_text("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
                    "# ```a fence inside```\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("Not this one.")
    binary = tmp_path / "photo.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    page.open()
    page.settings(max_tokens=8)
    page.tab.set_input_files("#attach-file", [str(code), str(notes), str(binary)])
    page.tab.wait_for_selector("#error", state="visible")
    assert page.error().startswith("Cannot attach photo.png is not text")
    chips = "#attachments .file-chip"
    wait_until(page.tab, f"document.querySelectorAll('{chips}').length === 2")
    page.tab.click("#attachments [aria-label='Remove notes.txt']")  # taken off again
    assert page.tab.locator(chips).all_text_contents() == ["fib.py×"]
    page.send("What does this do?")
    sent = [json.loads(r.post_data) for r in page.requests
            if r.url.endswith("/v1/chat/completions")][-1]["messages"][-1]["content"]
    assert sent.startswith("What does this do?\n\nfib.py:\n````\ndef fib(n):")
    assert sent.endswith("# ```a fence inside```\n````") and "Not this one" not in sent
    question = page.tab.locator(".message.user").last
    assert question.locator(".content").inner_text() == "What does this do?"
    assert question.locator(".files .file-chip").inner_text() == "fib.py"
    assert page.tab.locator(chips).count() == 0  # the next question carries none
    saved = page.messages()[-2]
    assert saved["content"] == sent and saved["files"] == ["fib.py"]


def test_a_pdfs_text_is_attached_and_one_that_cannot_be_read_is_said_in_one_line(page,
                                                                                   tmp_path):
    paper = tmp_path / "paper.pdf"
    paper.write_bytes(pdf_of(["Rivers of Europe", "The Danube flows east."], deflate=True))
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(pdf_of(["cut short"])[:80])
    page.open()
    page.settings(max_tokens=8)
    page.tab.set_input_files("#attach-file", [str(broken)])
    page.tab.wait_for_selector("#error", state="visible")
    assert page.error().startswith("Cannot attach broken.pdf is not a PDF that can be read (")
    page.tab.set_input_files("#attach-file", [str(paper)])
    wait_until(page.tab, "document.querySelectorAll('#attachments .file-chip').length === 1")
    page.send("Summarise.")
    sent = page.messages()[-2]
    assert sent["content"] == ("Summarise.\n\npaper.pdf:\n```\nRivers of Europe\n\n"
                               "The Danube flows east.\n```")
    assert sent["files"] == ["paper.pdf"] and page.messages()[-1]["content"]
    # the browser's own line for the refused one's answer, and nothing else
    assert page.errors == ["Failed to load resource: the server responded with a status of "
                           "400 (Bad Request)"]

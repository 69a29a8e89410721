"""Chat templates are untrusted input (a GGUF's comes with a downloaded model): a render is
bounded in time, steps and size, and a template that is no Jinja or passes the bounds on a
short conversation is refused when it is loaded, in one line naming it."""

import re
import subprocess
import sys
import threading
import time

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import raw, serving

from adaptive_llama.runtime.chat_template import ChatTemplate, TemplateError, load_template
from adaptive_llama.runtime.template_process import (
    GRACE_S,
    TemplateCancelled,
    TemplateRenderError,
    TemplateSyntax,
    render,
)
from adaptive_llama.runtime.template_sandbox import (
    MAX_CHARS,
    MAX_MEMORY,
    MAX_RENDER_S,
    MAX_STEPS,
    TemplateBudgetError,
)

HI = [{"role": "user", "content": "hi"}]


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, bos="<s>", eos="</s>", specials=lambda: None)


# Each template passes one bound on any conversation: refused at load, within the budget.
HOSTILE = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
                          "{% endfor %}{% endfor %}",
    "a huge repetition": "{% set s = 'x' * 200000000 %}{{ s|length }}",
    "doubling by ~": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling by +": "{% set ns = namespace(s=['x']) %}{% for i in range(40) %}"
                     "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "a wide centre": "{{ 'x'.center(1000000000) }}",
    "a wide centre filter": "{{ 'x'|center(1000000000) }}",
    "a wide format": "{{ '%0999999999d' % 1 }}",
    "a wide str.format": "{{ '{:999999999}'.format(1) }}",
    "a huge join": "{{ ('x' * 1000000).join(range(100000)|list) }}",
    "a huge replace": "{{ ('x' * 100000).replace('', 'y' * 1000) }}",
    "a huge power": "{{ 10 ** 100000000 }}",
    "exponential macro calls": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}"
                               "{% endif %}{% endmacro %}{{ f(40) }}",
    "a flood of output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_template_past_the_bounds_is_refused_at_load_within_the_budget(name):
    start = time.monotonic()
    with pytest.raises(TemplateError) as caught:
        ChatTemplate(HOSTILE[name], bos="", eos="", specials=lambda: None,
                     origin="the chat template of evil.gguf")
    assert time.monotonic() - start < MAX_RENDER_S + 1
    message = str(caught.value)
    assert message.startswith("the chat template of evil.gguf cannot be used")
    assert "\n" not in message


# 100,000 steps a message: the load's four messages pass, 30 do not.
GREEDY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for n in range(100000) %}"
          "{% endfor %}{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_a_template_past_the_bounds_only_on_long_input_fails_that_render_only(monkeypatch):
    # Fine on the load's short conversation; a render of a long one passes the bounds.
    from adaptive_llama.runtime import template_sandbox
    monkeypatch.setattr(template_sandbox, "MAX_STEPS", 20_000)
    greedy = template(GREEDY.replace("100000", "2000"))
    assert greedy.render(HI)[0]
    start = time.monotonic()
    with pytest.raises(TemplateBudgetError, match="more than 20,000 steps"):
        greedy.render(HI * 30)
    assert time.monotonic() - start < MAX_RENDER_S + 1
    assert greedy.render(HI)[0]  # the next render has its own budget


def test_the_bounds_leave_room_for_real_conversations(engine):
    # SmolLM2's own template on 4,000 messages of 1,000 characters.
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "w" * 1000}
                for i in range(4000)]
    parts, _ = engine.chat_template.render(messages)
    assert sum(len(p) for p, text in parts if text) == 4_000_000
    assert MAX_CHARS > 4_000_000 and MAX_STEPS > 10 * len(messages)


@pytest.mark.parametrize("source,line", [
    ("{% for m in messages %}{{ m.content }\n{% endfor %}", "line 1: unexpected '}'"),
    ("hello\n{% if x %}\nno end", "line 3: Unexpected end of template"),
    ("{{ messages[0].content | nosuchfilter }}", "line 1: No filter named 'nosuchfilter'"),
])
def test_a_template_that_is_no_jinja_is_one_line_naming_it_and_the_line(source, line):
    with pytest.raises(TemplateError) as caught:
        ChatTemplate(source, bos="", eos="", specials=lambda: None, origin="the chat "
                     "template of m.gguf (its tokenizer.chat_template)")
    message = str(caught.value)
    assert "\n" not in message and line in message
    assert message.startswith("the chat template of m.gguf (its tokenizer.chat_template)")


def test_the_sandbox_still_holds():
    for source in ("{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}",
                   "{{ range.__globals__ }}", "{{ raise_exception.__globals__ }}"):
        try:
            shown = "".join(p for p, _ in template(source).render(HI)[0])
        except Exception as exc:  # noqa: BLE001 (a refusal is as good)
            shown = str(exc)
        assert "<class" not in shown and "__builtins__" not in shown and "{'" not in shown


# ---- the same, from the command line and from a GGUF's own template ----

def with_template(path, tmp_path, source: str):
    """A copy of the GGUF whose tokenizer.chat_template is ``source``, padded to the
    original's length with a Jinja comment (no offset in the file moves)."""
    data = path.read_bytes()
    from adaptive_llama.runtime.gguf_header import read_header
    original = read_header(path).chat_template.encode()
    padding = len(original) - len(source.encode()) - len("{##}")
    assert padding >= 0 and data.count(original) == 1
    copy = tmp_path / "evil.gguf"
    copy.write_bytes(data.replace(original, source.encode() + b"{#" + b" " * padding + b"#}"))
    return copy


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "adaptive_llama.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("source,needle", [
    (HOSTILE["nested range loops"], "takes more than"),
    ("{% for m in messages %}{{ m.content }\n{% endfor %}", "is not valid Jinja: line 1"),
])
def test_a_gguf_with_such_a_template_is_one_line_at_start(smollm2_path, tmp_path, source,
                                                          needle):
    evil = with_template(smollm2_path, tmp_path, source)
    for args in (["generate", str(evil), "--chat", "--prompt", "hi", "-n", "1"],
                 ["serve", str(evil), "--port", "0"]):
        result = cli(*args)
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert "evil.gguf (its tokenizer.chat_template)" in lines[0] and needle in lines[0]
    # A template of one's own in its place: the model's is not used.
    fixed = cli("generate", str(evil), "--chat", "--prompt", "hi", "-n", "1",
                "--chat-template", "chatml-tools")
    assert fixed.returncode == 0, fixed.stderr


def test_chat_template_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text(HOSTILE["a huge repetition"])
    with pytest.raises(ValueError, match=f"{bad} cannot be used"):
        load_template(str(bad))
    result = cli("serve", "--chat-template", str(bad))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert str(bad) in result.stderr


# ---- random template sources: a template, or a one-line refusal; a render that ends ----

pieces = st.sampled_from([
    "{{ messages[0].content }}", "{% for m in messages %}", "{% endfor %}",
    "{% for i in range(N) %}", "{{ 'x' * N }}", "{{ i }}", "{% if messages %}", "{% endif %}",
    "{% set ns = namespace(s='ab') %}", "{% set ns.s = ns.s ~ ns.s %}",
    "{% set ns.s = ns.s + ns.s %}", "{{ ns.s|length }}", "{{ (range(N)|list)|join('x') }}",
    "{{ 'a'.center(N) }}", "{{ '%0Nd' % 1 }}", "{{ m.content }}", "{{ raise_exception('no') }}",
    "{{ messages[0].__class__ }}", "}}", "{%", "{{ tools|tojson }}", "{{ bos_token }}",
])
sizes = st.sampled_from(["2", "1000", "100000", "10000000", "1000000000"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.tuples(pieces, sizes), min_size=1, max_size=8))
def test_any_template_source_loads_and_renders_within_the_bounds_or_says_why(parts):
    source = "".join(p.replace("N", n) for p, n in parts)
    start = time.monotonic()
    try:
        loaded = ChatTemplate(source, bos="", eos="", specials=lambda: None, origin="t")
    except TemplateError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("t ")
        return
    finally:
        assert time.monotonic() - start < MAX_RENDER_S + 1
    start = time.monotonic()
    try:
        parts_out, _ = loaded.render([{"role": "user", "content": "hello " * 50}])
        assert sum(len(p) for p, _ in parts_out) <= MAX_CHARS
    except Exception:  # noqa: BLE001 (the template's own error, or a bound)
        pass
    assert time.monotonic() - start < MAX_RENDER_S + 1


def test_a_server_refuses_a_render_past_the_bounds_and_serves_the_next(smollm2_path,
                                                                       tmp_path):
    greedy = tmp_path / "greedy.jinja"
    greedy.write_text(GREEDY)
    for port in serving(smollm2_path, tmp_path / "server.log", "--chat-template", str(greedy)):
        status, _, body = raw("POST", port, "/v1/chat/completions",
                              {"messages": HI * 30, "max_tokens": 1})
        assert status == 400 and "more than" in body["error"]["message"]
        status, _, body = raw("POST", port, "/v1/chat/completions",
                              {"messages": HI, "max_tokens": 1})
        assert status == 200


# ---- what the bounds must not change: Jinja as Hugging Face renders chat templates ----

def rendered(source: str, messages=HI) -> str:
    return "".join(part for part, _ in template(source).render(messages)[0])


@pytest.mark.parametrize("source,expected", [
    ("{{ 'a' ~ 'b' ~ 1 }}", "ab1"),
    ("{{ 3 * 4 }} {{ 'ab' * 2 }} {{ 2 * 'c' }} {{ [1] * 2 }}", "12 abab cc [1, 1]"),
    ("{{ 1 + 2 }} {{ 'a' + 'b' }} {{ [1] + [2] }}", "3 ab [1, 2]"),
    ("{{ 2 ** 10 }} {{ 2 ** 4096 > 0 }} {{ 7 % 3 }} {{ 'a%sb' % 'x' }} {{ 7 // 2 }}",
     "1024 True 1 axb 3"),
    ("{{ '{}-{}'.format(1, 2) }} {{ '%s'|format(5) }} {{ 'x'.center(5) }}|", "1-2 5   x  |"),
    ("{{ ','.join(['a', 'b']) }} {{ ['a', 'b']|join('-') }} {{ 'aa'.replace('a', 'b') }}",
     "a,b a-b bb"),
    ("{{ 'abc'|replace('b', 'x') }} {{ range(3)|list }} {{ 'ab'|length }}", "axc [0, 1, 2] 2"),
    ("{% for i in range(3) %}{{ i }}{{ loop.length }}{{ loop.last }} {% endfor %}"
     "{{ range(5)[1] }}{{ range(5)[1:3]|list }}{{ 2 in range(3) }}{{ range(4)|length }}",
     "03False 13False 23True 1[1, 2]True4"),
    ("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}", "012"),
    ("{% if true %}\n  a\n{% endif %}\nb", "  a\nb"),  # trim_blocks, lstrip_blocks
    ("  {% if true %}x{% endif %}", "x"),
    ("{% generation %}kept{% endgeneration %}", "kept"),
    ("{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}", "<s></s>True"),
])
def test_templates_render_as_jinja_does_within_the_bounds(source, expected):
    assert rendered(source) == expected


@pytest.mark.parametrize("source,refused", [
    ("{{ 2 ** 4096 > 0 }}", False), ("{{ 2 ** 4097 }}", True), ("{{ 2 ** -4097 }}", True),
    (f"{{{{ 'x' * {2**24} }}}}", False), (f"{{{{ 'x' * {2**24 + 1} }}}}", True),
    (f"{{{{ {2**24 + 1} * 'x' }}}}", True), (f"{{{{ [0] * {2**24 + 1} }}}}", True),
    (f"{{{{ ('x' * {2**23}) + ('y' * {2**23}) }}}}", False),
    (f"{{{{ ('x' * {2**23}) + ('y' * {2**23 + 1}) }}}}", True),
    (f"{{{{ ('x' * {2**23}) ~ ('y' * {2**23 + 1}) }}}}", True),
    (f"{{{{ 'x'.ljust({2**24}) }}}}", False), (f"{{{{ 'x'.ljust({2**24 + 1}) }}}}", True),
    (f"{{{{ 'x'|center({2**24 + 1}) }}}}", True),
    (f"{{{{ '%0{2**24 + 1}d' % 1 }}}}", True), (f"{{{{ '%0{2**24 + 1}d'|format(1) }}}}", True),
    (f"{{{{ '{{:{2**24 + 1}}}'.format(1) }}}}", True),
    (f"{{{{ '{{x:{2**24 + 1}}}'.format_map({{'x': 1}}) }}}}", True),
    (f"{{{{ ('x' * {2**12}).replace('', 'y' * {2**12}) }}}}", True),
    (f"{{{{ ('x' * {2**12})|replace('x', 'y' * {2**13}) }}}}", True),
    (f"{{{{ ('x' * {2**12}).join(range({2**12})|list) }}}}", True),
    (f"{{{{ (range({2**12})|list)|join('y' * {2**12}) }}}}", True),
    ("{{ range(100000)|length }}", False), ("{{ range(100001)|length }}", True),
])
def test_each_size_bound_takes_its_limit_and_refuses_past_it(source, refused):
    if refused:  # at load, or at the first render
        with pytest.raises((TemplateError, TemplateBudgetError),
                           match="more than|power|width"):
            rendered(source)
    else:
        assert rendered(source)


@pytest.mark.parametrize("source", ["{{ '{:99999999999}'.format(1) }}",
                                    "{{ '%099999999999d' % 1 }}",
                                    "{{ '%099999999999d'|format(1) }}"])
def test_a_width_past_the_bound_is_named_before_anything_is_built(source):
    start = time.monotonic()
    with pytest.raises((TemplateError, TemplateBudgetError),
                       match="formats with a width of 0?99999999999, more than"):
        rendered(source)
    assert time.monotonic() - start < 1


def test_the_step_bound_is_counted_not_timed(monkeypatch):
    from adaptive_llama.runtime import template_sandbox
    monkeypatch.setattr(template_sandbox, "MAX_STEPS", 1000)
    assert rendered("{% for i in range(900) %}{% endfor %}") == ""
    slow = template("{% for m in messages %}{% for i in range(200) %}{% endfor %}{% endfor %}")
    with pytest.raises(TemplateBudgetError, match="more than 1,000 steps"):
        slow.render(HI * 6)


def test_the_time_bound_stops_a_render_that_stays_under_the_steps(monkeypatch):
    from adaptive_llama.runtime import template_sandbox
    monkeypatch.setattr(template_sandbox, "MAX_RENDER_S", 0.2)
    start = time.monotonic()
    with pytest.raises(TemplateError, match="more than 0.2 s"):
        rendered("{% for i in range(100000) %}{% for j in range(100000) %}"
                 "{% endfor %}{% endfor %}")
    assert time.monotonic() - start < 1.5


# ---- one call whose cost grows from its arguments, hidden from the load's conversation ----

def hidden(call: str) -> str:
    """A template that is plain ChatML, but for a conversation of seven messages."""
    return ("{% if messages|length == 7 %}" + call + "{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n")


# Each is refused by a size bound before it runs, or (repeated, where one call's cost
# depends on the machine's speed) by the step or the time bound, whichever comes first.
ONE_CALL = {
    "sort": "{% for i in range(10) %}{{ ('x' * 16000000)|list|sort|length }}{% endfor %}",
    "wide format fields": "{{ ('{0:>16000000}' * 40).format(1) }}",
    "title, ten times": "{% for i in range(10) %}{{ ('x' * 15000000)|title|length }}"
                        "{% endfor %}",
    "wordwrap": "{{ ('x ' * 4500000)|wordwrap(1)|length }}",
    "expandtabs": "{{ ('\\t' * 1000000).expandtabs(100)|length }}",
    "indent": "{{ ('x\\n' * 1000000)|indent(100)|length }}",
    "lipsum": "{{ lipsum(10000, max=1000)|length }}",
    "batch": "{% for i in range(10) %}{{ ('xy' * 8000000)|batch(1)|list|length }}"
             "{% endfor %}",
    "unique": "{% for i in range(10) %}{{ ('x' * 16000000)|list|unique|list|length }}"
              "{% endfor %}",
    "urlize": "{{ ('x.co ' * 3000000)|urlize|length }}",
    "striptags": "{% for i in range(20) %}{{ ('<a>' * 5000000)|striptags|length }}"
                 "{% endfor %}",
    "% formatting": "{{ ('%s' * 40) % ((('x' * 1000000),) * 40) }}",
    "a list as text": "{{ ('x' * 16000000)|list|string|length }}",
    "integer growth": "{% set ns = namespace(n=3) %}{% for i in range(64) %}"
                      "{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n > 0 }}",
}


@pytest.mark.parametrize("name", ONE_CALL)
def test_one_call_past_the_bounds_ends_within_them_on_the_conversation_it_hides_for(name):
    evil = template(hidden(ONE_CALL[name]))  # the load's four messages do not reach it
    assert "".join(p for p, _ in evil.render(HI)[0]).endswith("<|im_start|>assistant")
    start = time.monotonic()
    with pytest.raises(TemplateBudgetError, match="more than|power|bits"):
        evil.render(HI * 7)
    assert time.monotonic() - start < MAX_RENDER_S + GRACE_S + 1
    assert evil.render(HI)[0]  # the next render has its own renderer and budget


BIG_TEXT = "('x\\n <a> y.co\\t' * 300000)"  # 4.5 M characters of each kind a filter reads
BIG_LIST = "range(100000)|list"
ARGUMENTS = ["", "(16000000)", "('y' * 1000)", "(16000000, 'y' * 1000)",
             "('y' * 1000, 16000000)", "(0, 16000000, 16000000)"]


def _each_call():
    """Every filter and every method a template can call, on a large value, with large
    arguments."""
    from adaptive_llama.runtime.template_sandbox import BoundedEnvironment

    for name in BoundedEnvironment().filters:
        for value in (BIG_TEXT, BIG_LIST):
            for args in ARGUMENTS:
                yield f"{{{{ {value}|{name}{args} }}}}"
    for value, kind in ((BIG_TEXT, str), (BIG_LIST, list), ("{'a': " + BIG_TEXT + "}", dict)):
        for name in dir(kind):
            if not name.startswith("_"):
                for args in ARGUMENTS:
                    yield f"{{{{ ({value}).{name}{args or '()'} }}}}"
    for args in ARGUMENTS:
        yield f"{{{{ lipsum{args or '()'} }}}}"


def test_every_filter_and_method_stays_within_the_bounds(monkeypatch):
    """The documented bounds hold whatever a template calls: each render ends with its text
    or an error by the deadline, and no text past MAX_CHARS comes back."""
    from adaptive_llama.runtime import template_sandbox
    deadline_s = 0.1  # a short one: about 90 of the 1,068 calls reach it
    monkeypatch.setattr(template_sandbox, "MAX_RENDER_S", deadline_s)
    slowest = 0.0
    for source in _each_call():
        start = time.monotonic()
        try:
            text = render(source, context={})
            assert len(text) <= MAX_CHARS, source
        except (TemplateBudgetError, TemplateRenderError, TemplateSyntax):
            pass
        took = time.monotonic() - start
        slowest = max(slowest, took)
        assert took < deadline_s + GRACE_S + 1, source
    assert slowest > deadline_s  # some did reach the deadline: the walk is large enough


def test_a_render_given_up_stops_its_renderer_at_once():
    cancelled = threading.Event()
    threading.Timer(0.2, cancelled.set).start()
    start = time.monotonic()
    with pytest.raises(TemplateCancelled):
        render(ONE_CALL["sort"], context={}, cancelled=cancelled)
    assert time.monotonic() - start < 0.2 + 0.5
    assert render("{{ 1 + 1 }}", context={}) == "2"


def test_renders_run_beside_each_other():
    """A hostile render does not hold up another one (each has its own process)."""
    slow = threading.Thread(target=lambda: pytest.raises(TemplateBudgetError, render,
                                                         ONE_CALL["sort"], context={}))
    slow.start()
    time.sleep(0.3)
    start = time.monotonic()
    assert render("{{ messages[0].content }}", context={"messages": HI}) == "hi"
    assert time.monotonic() - start < 1.0
    slow.join()


@pytest.mark.parametrize("source", [
    "{{ " + "(" * 100 + "1" + ")" * 100 + " }}",
    "{% if true %}" * 100 + "x" + "{% endif %}" * 100,
    "{% macro m() %}{{ caller() }}{% endmacro %}" + "{% call m() %}" * 100 + "x"
    + "{% endcall %}" * 100,
    "{{ [" * 100 + "1" + "]" * 100 + " }}",
])
def test_a_template_nested_deep_is_one_line(source, tmp_path):
    with pytest.raises(TemplateError) as caught:
        ChatTemplate(source, bos="", eos="", specials=lambda: None, origin="t")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("t ")
    path = tmp_path / "deep.jinja"
    path.write_text(source)
    for args in (["generate", "--chat", "--prompt", "hi", "-n", "1"], ["serve", "--port", "0"]):
        result = cli(*args, "--chat-template", str(path))
        assert result.returncode != 0
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert str(path) in result.stderr


def test_the_renderer_has_its_memory_bounded():
    from adaptive_llama.runtime import template_process
    child = template_process._Renderer()
    try:
        limits = Path(f"/proc/{child.process.pid}/limits").read_text()
    finally:
        child.stop()
    soft = next(line.split()[3] for line in limits.splitlines()
                if line.startswith("Max address space"))
    assert int(soft) == MAX_MEMORY


def _children(pid: int) -> dict[int, str]:
    """The child processes of ``pid`` and their states (R: running)."""
    states = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            states[int(child)] = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0]
        except OSError:
            pass
    return states


def test_a_server_stops_a_render_when_its_client_leaves_and_serves_others_meanwhile(
        smollm2_path, tmp_path):
    evil = tmp_path / "evil.jinja"
    evil.write_text(hidden(ONE_CALL["sort"]))
    log = tmp_path / "server.log"
    for port in serving(smollm2_path, log, "--chat-template", str(evil)):
        listening = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"],
                                   capture_output=True, text=True).stdout
        server_pid = int(re.search(r"pid=(\d+)", listening).group(1))
        leaving = threading.Thread(target=lambda: pytest.raises(
            OSError, raw, "POST", port, "/v1/chat/completions",
            {"messages": HI * 7, "max_tokens": 1}, timeout=0.6))
        leaving.start()
        time.sleep(0.3)
        busy = [pid for pid, state in _children(server_pid).items() if state == "R"]
        start = time.monotonic()  # another client is served while that render runs
        status, _, _ = raw("POST", port, "/v1/chat/completions",
                           {"messages": HI, "max_tokens": 1})
        assert status == 200 and time.monotonic() - start < 1.5
        leaving.join()
        time.sleep(0.6)  # the client left at 0.6 s; the render's deadline is at 2 s
        assert busy and not set(busy) & set(_children(server_pid))


def test_a_renderer_started_ahead_is_the_one_a_render_takes():
    """Engine starts a renderer while the model loads (about 0.2 s of a command's start)."""
    from adaptive_llama.runtime import template_process
    pool = template_process._Pool()
    pool.prestart()
    pool.prestart()  # one is starting already: no second
    ahead = pool.take()  # waits for it, then takes it
    try:
        assert pool._idle == [] and ahead.process.poll() is None
        pool.give(ahead)
        pool.prestart()  # one is idle: none more
        assert pool._idle == [ahead] and not pool._starting.is_alive()
    finally:
        pool.close()


# ---- llama.cpp's built-in templates, by name ----

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a river <|im_end|><|eot_id|>"},
                {"role": "assistant", "content": "The Thames."},
                {"role": "user", "content": "Another?"}]


def test_every_llama_cpp_template_name_renders_with_the_clients_texts_apart():
    from adaptive_llama.runtime.chat_template import llama_cpp_names

    names = llama_cpp_names()
    assert {"llama3", "chatml", "gemma", "command-r", "mistral-v7", "phi4"} <= set(names)
    for name in names:
        parts, wrote_bos = template(load_template(name)).render(CONVERSATION)
        texts = [part for part, is_text in parts if is_text]
        markup = "".join(part for part, is_text in parts if not is_text)
        # every text a client gave comes back whole, as text, never inside the markup
        assert set(texts) <= {m["content"] for m in CONVERSATION} and "Another?" in texts, name
        assert "Name a river" not in markup and "<|eot_id|><|eot_id|>" not in markup, name
        assert wrote_bos is False  # these write no BOS: the engine adds the model's


def test_a_llama_cpp_template_renders_as_llama_cpp_does():
    parts, _ = template(load_template("llama3")).render(CONVERSATION[:2])
    assert "".join(part for part, _ in parts) == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a river <|im_end|><|eot_id|>"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_chatml_by_name_gives_the_tokens_of_smollm2s_own_template(smollm2_path):
    from adaptive_llama import Engine

    messages = CONVERSATION[:2]
    own = Engine(smollm2_path, n_ctx=256)
    named = Engine(smollm2_path, n_ctx=256, chat_template=load_template("chatml"))
    try:
        tokens = named.chat_prompt_tokens(messages)
        assert tokens == own.chat_prompt_tokens(messages)
        # the client's <|im_end|> stays text: one control token per turn mark only
        im_end = own.tokenize("<|im_end|>", add_bos=False, special=True)
        assert tokens.count(im_end[0]) == 2
        reply = named.stream(tokens, max_tokens=4, seed=1)
        reply.text()
        assert reply.result.completion_tokens > 0
    finally:
        own.close()
        named.close()


def test_a_server_given_a_llama_cpp_template_name_serves_with_it(smollm2_path, tmp_path):
    for port in serving(smollm2_path, tmp_path / "server.log", "--chat-template", "llama3"):
        status, _, body = raw("POST", port, "/apply-template", {"messages": CONVERSATION[:2]})
        assert status == 200
        assert "<|im_start|>" not in body["prompt"]  # llama3's markup, not the model's own
        assert "<|start_header_id|>user<|end_header_id|>\n\nName a river" in body["prompt"]
        status, _, body = raw("POST", port, "/v1/chat/completions",
                              {"messages": HI, "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] > 0

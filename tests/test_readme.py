"""The Python examples of README.md and docs/ run as written (on the bundled model; a server
example against a real `adaptive-llama serve` on a free port in place of 8080)."""

import contextlib
import io
import re
from pathlib import Path

import pytest
from test_chain import without_extra_buffer_types
from test_server import serving

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [(page, i, code) for page in PAGES for i, code in
            enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


@pytest.fixture(scope="module")
def local_server(tmp_path_factory):
    yield from serving(None, tmp_path_factory.mktemp("readme") / "server.log", api_key=None)


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    yield from serving(None, tmp_path_factory.mktemp("readme") / "server.log",
                       "--chat-template", "chatml-tools", api_key=None)


@pytest.mark.parametrize("page,index,code", EXAMPLES,
                         ids=[f"{p.name}-{i}" for p, i, _ in EXAMPLES])
def test_the_example_runs_as_written(page, index, code, request, monkeypatch):
    if "127.0.0.1:8080" in code:  # a client of `adaptive-llama serve` (with tools: as said)
        port = request.getfixturevalue("tools_server" if "chatml-tools" in code
                                       else "local_server")
        code = code.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    without_extra_buffer_types(monkeypatch)  # README, "AMX CPUs": our CI's CPUs need it
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"{page.name} example {index}", "exec"), {})
    lines = printed.getvalue().strip().splitlines()
    assert lines, "the example prints nothing"
    assert not any(line.rstrip().endswith("None") for line in lines), printed.getvalue()


def test_every_page_with_python_has_its_examples_found():
    assert len([e for e in EXAMPLES if e[0].name == "README.md"]) >= 3


def test_the_readme_stays_short():
    """Read in five minutes: figures and details live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300

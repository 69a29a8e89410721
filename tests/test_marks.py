"""The numba pass of `make test` runs only the tests marked `backend` (their outcome depends
on which implementation of the kernel and the in-chain samplers runs, C or numba): every test
that uses the kernel or the sampler chain by name has to carry the mark."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent
# What a test imports to reach an implementation: the kernel, the chain, the numba samplers.
BACKEND_MODULES = ("adaptive_llama.kernel", "adaptive_llama.llama.chain",
                   "adaptive_llama.llama.numba_samplers")
BACKEND_NAMES = {"kernel", "chain", "numba_samplers", "adaptive_k", "adaptive_stats",
                 "AdaptiveStats", "IMPL", "BACKEND", "SamplerChain", "use_sampler"}


def backend_imports(tree: ast.AST) -> set[str]:
    """The names a module (or a function) binds to the kernel, the chain or their parts."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(BACKEND_MODULES):
                names |= {alias.asname or alias.name for alias in node.names}
            elif node.module in ("adaptive_llama", "adaptive_llama.llama"):
                names |= {alias.asname or alias.name for alias in node.names
                          if alias.name in BACKEND_NAMES}
        elif isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names
                      if alias.name.startswith(BACKEND_MODULES)}
    return names


def is_marked(decorators: list[ast.expr]) -> bool:
    return any("backend" in ast.unparse(d) for d in decorators)


def module_marked(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Assign) and any(
        getattr(t, "id", "") == "pytestmark" for t in node.targets)
        and "backend" in ast.unparse(node.value) for node in tree.body)


def unmarked_backend_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    if module_marked(tree):
        return []
    imported = backend_imports(tree)
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if ((used & imported) or backend_imports(node)) and not is_marked(
                    node.decorator_list):
                found.append(f"{path.name}::{node.name}")
    return found


def test_every_test_that_uses_the_kernel_or_the_chain_is_marked_backend():
    unmarked = [t for path in sorted(TESTS.glob("test_*.py"))
                for t in unmarked_backend_tests(path)]
    assert unmarked == []


def test_the_check_finds_an_unmarked_test(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("from adaptive_llama.kernel import adaptive_k\n"
                    "import pytest\n\n"
                    "def test_a():\n    adaptive_k\n\n"
                    "@pytest.mark.backend\ndef test_b():\n    adaptive_k\n\n"
                    "def test_c():\n    from adaptive_llama import kernel\n\n"
                    "def test_d():\n    pass\n")
    assert unmarked_backend_tests(path) == ["test_x.py::test_a", "test_x.py::test_c"]
    path.write_text("import pytest\npytestmark = pytest.mark.backend\n" + path.read_text())
    assert unmarked_backend_tests(path) == []


def test_the_cases_the_numba_pass_leaves_out_choose_the_backend_themselves():
    """conftest leaves out of the numba pass every case with a `backend` parameter: each
    fixture of that name takes C and numba as parameters and sets kernel.BACKEND to its
    own, so such a case runs the same in both passes."""
    fixtures = [node for path in sorted(TESTS.glob("test_*.py"))
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.FunctionDef) and node.name == "backend"]
    assert fixtures
    for fixture in fixtures:
        source = ast.unparse(fixture)
        assert "params=['c', 'numba']" in source, source
        assert "monkeypatch.setattr(kernel, 'BACKEND', request.param)" in source, source

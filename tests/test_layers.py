"""The package's layers, read from its own imports (every import statement, those inside
functions too): lower layers never import higher ones, siblings do not import each other, and
no modules import each other in a circle."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "adaptive_llama"
# From the bottom up; a module may import its own layer and the ones below.
LAYERS = [
    {"samplers", "kernel", "endpoints"},  # the maths, the sampler table, workers' addresses
    {"llama"},                        # every contact with llama.h
    {"runtime"},                      # engine, batching, threads, models, settings
    {"chat", "eval", "server"},       # what runs on the engine; siblings, independent
    {"cli", "llm_plugin", ""},        # the front ends, and the package's public names
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The package modules ``path`` imports (as names under the package, "" for the root)."""
    here = module_name(path).split(".") if module_name(path) else []
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:  # `from . import kernel` names a module
                candidate = target + [alias.name]
                is_module = (PACKAGE.joinpath(*candidate).with_suffix(".py").exists()
                             or PACKAGE.joinpath(*candidate).is_dir())
                found.add(".".join(candidate if is_module else target))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found |= {n.removeprefix("adaptive_llama").lstrip(".") for n in names
                      if n and (n == "adaptive_llama" or n.startswith("adaptive_llama."))}
    return found - {module_name(path)}


GRAPH = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_every_module_has_a_layer():
    assert {m.split(".")[0] for m in GRAPH} <= set().union(*LAYERS)
    assert "kernel.reference" in GRAPH and "server.common" in GRAPH  # the reader sees them


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_module_imports_a_higher_layer_or_a_sibling(module):
    own = module.split(".")[0]
    for target in GRAPH[module]:
        if module == "" or target.split(".")[0] == own:
            continue  # the root re-exports; a folder's modules import each other
        if layer_of(module) == 0:  # the bottom: the kernel reads epsilon's range in the table
            assert layer_of(target) == 0, f"{module} imports {target}"
        else:
            assert layer_of(target) < layer_of(module), f"{module} imports {target}"


def test_the_sampler_table_imports_nothing_of_the_package():
    assert GRAPH["samplers"] == set()


def test_the_protocols_share_only_the_common_server_module():
    for protocol in ("server.openai", "server.ollama"):
        server_imports = {t for t in GRAPH[protocol] if t.startswith("server")}
        assert server_imports == {"server.common"}, (protocol, server_imports)


def test_no_import_circles():
    def reaches(start: str, goal: str, seen: set) -> bool:
        for target in GRAPH.get(start, ()):
            if target == goal or (target not in seen and
                                  reaches(target, goal, seen | {target})):
                return True
        return False

    circles = [m for m in GRAPH if m and reaches(m, m, set())]
    assert circles == []


def test_no_function_is_longer_than_60_lines():
    """A function that long has parts with names of their own: split it there."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{module_name(path)}.{node.name}: {lines} lines")
    assert long == []

"""The package's layers (docs/design.md, *Map of the code*): every import of a kvexport module, at
module level or inside a function, points to the same layer or one below it, and no two modules
import each other through any chain. The tests share code through tests/helpers/ only. Read from
the source, so nothing is imported here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvexport"
TESTS = PACKAGE.parent / "tests"
# An import of a test module or of conftest.py (fixtures reach tests by name), also inside the code a
# test runs in a subprocess.
TEST_MODULE_IMPORT = re.compile(
    r"\b(?:from|import)\s+(?:tests\.)?(?:test_\w+|conftest)\b|\btests\.(?:test_\w+|conftest)\b"
)

# Lowest first. A module belongs to the first layer one of whose prefixes it starts with.
LAYERS = (
    (
        "ground",
        (
            "kvexport.errors",
            "kvexport.io",
            "kvexport.progress",
            "kvexport.config",
            "kvexport.artifact",
            "kvexport.remote",
            "kvexport.options",
        ),
    ),
    ("native", ("kvexport.native",)),
    ("ops", ("kvexport.ops",)),
    ("model", ("kvexport.model",)),
    ("cached", ("kvexport.cached",)),
    ("importers", ("kvexport.importers",)),
    ("host", ("kvexport.host",)),
    ("trace", ("kvexport.trace",)),
    ("export", ("kvexport.export",)),
    ("serving", ("kvexport.serving",)),
    ("bench", ("kvexport.bench",)),
    ("commands", ("kvexport.commands", "kvexport.__main__")),
)
# Layers of one rank that must not import each other either.
SIBLINGS = {"export": "serving", "serving": "export"}
# The build lifecycle: what runs a package reads where native code lies and what it needs
# (paths, elf, isa) but never imports the code that builds it.
BUILD_MODULES = ("kvexport.native.build", "kvexport.native.toolchain", "kvexport.native.selftest")
RUNTIME_LAYERS = ("ops", "model", "cached", "host", "serving")
# The package's root is its public facade (kvexport.load, kvexport.Package): it imports the host
# layer lazily, and is imported only for __version__.
FACADE = "kvexport"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {Path(__file__).name}")


def imports_of(module: str) -> set[str]:
    """The kvexport modules `module` imports (the longest existing module each names)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        if module != FACADE:
            layer_of(module)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, targets in graph.items():
        if module == FACADE:
            continue
        for target in targets:
            if target == FACADE:
                continue
            here, there = layer_of(module), layer_of(target)
            if there > here or SIBLINGS.get(LAYERS[here][0]) == LAYERS[there][0]:
                upward.append(f"{module} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})")
    return upward


def test_no_import_points_upward():
    upward = upward_imports(GRAPH)
    assert not upward, "\n".join(upward)


def test_an_upward_import_is_found():
    assert upward_imports(
        {
            "kvexport.ops.library": {"kvexport.host.package", "kvexport.errors"},
            "kvexport.export.build": {"kvexport.serving.triton"},
            "kvexport.host.package": {"kvexport.ops.library"},
        }
    ) == [
        "kvexport.ops.library (ops) imports kvexport.host.package (host)",
        "kvexport.export.build (export) imports kvexport.serving.triton (serving)",
    ]


def test_run_time_code_never_imports_the_builder():
    reached = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module != FACADE and LAYERS[layer_of(module)][0] in RUNTIME_LAYERS
        for target in targets
        if target.startswith(BUILD_MODULES)
    ]
    assert not reached, "\n".join(reached)


def test_the_facade_is_imported_for_its_version_only():
    users = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(alias.name == FACADE for alias in node.names):
                users.append(f"{module}: import {FACADE}")
            if isinstance(node, ast.ImportFrom) and node.module == FACADE and not node.level:
                users += [
                    f"{module}: from {FACADE} import {a.name}"
                    for a in node.names
                    if a.name != "__version__" and f"{FACADE}.{a.name}" not in MODULES
                ]
    assert not users, "\n".join(users)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_circle():
    assert cycles({m: t - {FACADE} for m, t in GRAPH.items() if m != FACADE}) == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_circle_finder_finds_circles(graph, expected):
    assert cycles(graph) == expected


def test_no_test_module_imports_another_or_conftest():
    sources = [path for path in sorted(TESTS.rglob("*.py")) if path != Path(__file__).resolve()]  # not its examples
    found = [
        f"{path.relative_to(TESTS.parent)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if TEST_MODULE_IMPORT.search(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("from tests.test_serve import Client", True),
        ("from tests.conftest import TINY", True),
        ('code = "from tests.test_remote_tier import worker"', True),
        ("import test_ops", True),
        ("from tests.helpers.serving import Client", False),
        ("# see tests/test_serve.py", False),
    ],
)
def test_an_import_of_a_test_module_is_found(line, found):
    assert bool(TEST_MODULE_IMPORT.search(line)) == found

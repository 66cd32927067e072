"""The module import graph of client/ and server/ has no cycles.

Every ``import`` statement counts, wherever it is: at module level, inside a function, or
under ``if TYPE_CHECKING``. A cycle is removed by moving the shared part down a layer, not
by hiding one edge inside a function (it still runs, later and in a surprising order) or
behind TYPE_CHECKING (the two modules still know each other).

The graph is read from the source with `ast` (nothing is imported): relative imports are
resolved against the module's package, ``from pkg import name`` points at ``pkg.name`` when
that is a module and at ``pkg`` otherwise, and imports of anything outside the two packages
are left out. Importing ``a.b.c`` is an edge to ``a.b.c`` only: the parent packages'
``__init__`` modules run too, but a package that re-exports its submodules would otherwise
be in a cycle with each of them.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"client": "recorder_client", "server": "recorder_server"}

# Cycles known today, each the exact set of modules in one strongly connected component.
# Remove an entry in the commit that breaks its cycle; the test fails while a listed cycle
# no longer exists, so that the entry cannot outlive it.
KNOWN_CYCLES: dict[frozenset[str], str] = {}

Edge = tuple[str, int]  # (imported module, line of the import statement)


def module_files(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Module name -> source file, for every .py file under each package directory."""
    modules = {}
    for directory, package in packages.items():
        for path in sorted((root / directory).rglob("*.py")):
            parts = [package, *path.relative_to(root / directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line of the first such import}, within ``modules``."""

    def known(name: str | None) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else known(source))
            for target in targets:
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def describe(graph: dict[str, dict[str, int]], component: frozenset[str]) -> str:
    """One concrete cycle through the component, each step with the importing line."""
    start = min(component)
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:  # the shortest way back to start, inside the component
        node = queue.popleft()
        if start in graph[node]:
            path = [node]
            while path[-1] != start:
                path.append(previous[path[-1]])
            path.reverse()
            path.append(start)
            break
        for child in graph[node]:
            if child in component and child not in previous and child != start:
                previous[child] = node
                queue.append(child)
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(path, path[1:])]
    return "import cycle over " + ", ".join(sorted(component)) + ":\n  " + "\n  ".join(steps)


def test_client_and_server_have_no_import_cycles() -> None:
    modules = module_files(ROOT, PACKAGES)
    graph = import_graph(modules)
    # The graph is the real one: a resolver that lost the relative imports would find
    # no cycle at all.
    assert len(modules) > 80, sorted(modules)
    assert "recorder_server.store.sources" in graph["recorder_server.store.repository"]
    assert "recorder_server.metrics.names" in graph["recorder_server.metrics.catalog"]
    found = cycles(graph)
    new = [describe(graph, c) for c in found if c not in KNOWN_CYCLES]
    assert not new, "\n\n".join(new)
    gone = [why for c, why in KNOWN_CYCLES.items() if c not in found]
    assert not gone, f"fixed cycles still listed in KNOWN_CYCLES, remove them: {gone}"


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    """A cycle hidden in a function body, or behind TYPE_CHECKING, is still a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .sub import b\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import C\n    return C\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nC = 2\n"
    )
    (pkg / "d.py").write_text("import pkg.sub.b\nimport numpy\n")
    graph = import_graph(module_files(tmp_path, {"pkg": "pkg"}))
    assert graph == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.sub.b": 1},
        "pkg.c": {"pkg.a": 3},
        "pkg.d": {"pkg.sub.b": 1},
        "pkg.sub": {},
        "pkg.sub.b": {"pkg.c": 2},
    }
    (component,) = cycles(graph)
    assert component == {"pkg.a", "pkg.sub.b", "pkg.c"}
    assert describe(graph, component) == (
        "import cycle over pkg.a, pkg.c, pkg.sub.b:\n"
        "  pkg.a (line 1) -> pkg.sub.b\n"
        "  pkg.sub.b (line 2) -> pkg.c\n"
        "  pkg.c (line 3) -> pkg.a"
    )

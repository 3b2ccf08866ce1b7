"""The package's rooms import each other one way only: no new import circle inside agentsandbox/.

A circle means two modules own parts of one contract, so a change to either needs
both open.  Every import counts, at module level or inside a function (a lazy
import is still a dependency), except those under ``if TYPE_CHECKING:``, which
exist for annotations alone and never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "agentsandbox"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _typeCheckingOnly(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        # Under ``if TYPE_CHECKING:`` only the ``else`` branch ever runs.
        statements = node.orelse if isinstance(node, ast.If) and _typeCheckingOnly(node) else [node]
        for statement in statements:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                yield statement
            yield from _imports(statement)


def importGraph() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports."""
    known = modules()

    def owner(name: str) -> str | None:
        # ``from agentsandbox.egress import proxy`` names a module; ``from
        # agentsandbox.config import load`` names a module's attribute.
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                named = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for imported in named:
                if imported == "agentsandbox" or not imported.startswith("agentsandbox."):
                    continue
                target = owner(imported)
                # A package's __init__ runs before its modules; that is not a use of it.
                if target and target != name and not name.startswith(target + "."):
                    targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    onStack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        onStack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in onStack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                onStack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_should() -> None:
    graph = importGraph()
    assert "agentsandbox.egress.proxy" in graph
    assert "agentsandbox.config" in graph["agentsandbox.egress.proxy"]
    # A lazy import inside a function counts.
    assert "agentsandbox.egress.http" in graph["agentsandbox.egress.proxy"]


def test_type_checking_imports_do_not_count_but_their_else_and_lazy_ones_do() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import typeonly\nelse:\n    import runtime\n"
        "def f():\n    import lazy\n"
    )
    names = [alias.name for node in _imports(ast.parse(source)) for alias in node.names]
    assert names == ["TYPE_CHECKING", "runtime", "lazy"]


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_inside_the_package() -> None:
    # The last two went with issue 14: egress's (proxy <-> http/socks, when the
    # decision types moved to grant.py) and config <-> policy (when the hook's
    # policy cache moved from policy.py into hook.py).
    graph = importGraph()
    found = circles(graph)
    described = [
        " ; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(group)))}" for m in group) for group in found
    ]
    assert found == [], "import circles:\n" + "\n".join(described)

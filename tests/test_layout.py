"""The package's rooms import each other one way only: down the floors, and in no circle.

A circle means two modules own parts of one contract, so a change to either needs
both open.  Every import counts: at module level, inside a function (a lazy
import is still a dependency) and under ``if TYPE_CHECKING:`` (an annotation
that names a module is a dependency on its contract too).

The package stands on floors (``FLOORS``): values, then the config, the
policy, the proxy and the broker, the service, the commands.  A module imports
its own floor and the ones below; an import that ran from a floor up to a
higher one would be listed in ``UPWARD`` with why (at most two; none today).
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


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it stands (module, function, ``if TYPE_CHECKING:``)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


#: The floors, lowest first: each names modules (or packages: every module in it)
#: of ``agentsandbox``; the longest name that matches places a module.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("values", (
        "paths", "files", "tools", "hookjson", "oneshot", "packaged", "egressdir", "allowlist",
        "egress.rules", "egress.dispatchwire", "egress.http11", "egress.leakscan", "egress.github",
        "egress.compat", "egress.sessions", "egress.nodelay", "egress.privates",
        "broker.spool", "broker.procfs", "approvals", "configedit", "controlpeer",
    )),
    ("config", ("config",)),
    ("policy", ("policy", "machine", "loader", "cli", "reload", "srt", "claude")),
    ("egress and broker", ("egress", "broker", "tokens", "audit", "probes", "desktop", "notify")),
    ("service", ("service", "tap", "serve")),
    ("commands", ("commands", "doctor", "run", "setup", "hook", "hookstart", "policyhelper", "approvecli",
                   "watch", "__main__")),
)  # fmt: skip

#: The imports that run from a floor up to a higher one, and why each may.
UPWARD: dict[tuple[str, str], str] = {
    # None: loading the config in force (machine.narrow, the policy's layout check)
    # lives in loader.py, above the config's grammar, so config.py imports neither.
}


def floorOf(module: str) -> int | None:
    """The index in ``FLOORS`` of ``module`` (``agentsandbox.X``), or None if it has none."""
    name = module.removeprefix("agentsandbox.")
    placed: tuple[int, int] | None = None
    for index, (_, names) in enumerate(FLOORS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and (placed is None or len(prefix) > placed[1]):
                placed = (index, len(prefix))
    return None if placed is None else placed[0]


def upwardImports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    found = set()
    for module, targets in graph.items():
        here = floorOf(module)
        for target in targets:
            there = floorOf(target)
            if here is not None and there is not None and there > here:
                found.add((module, target))
    return found


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
    # A lazy import inside a function counts (the broker client loads the config
    # only when no spool is named), and one under TYPE_CHECKING (policy names
    # Config in annotations alone).
    assert "agentsandbox.loader" in graph["agentsandbox.broker.client"]
    assert "agentsandbox.config" in graph["agentsandbox.policy"]
    # Loading reaches up to the policy; the grammar below it does not.
    assert {"agentsandbox.policy", "agentsandbox.machine"} <= graph["agentsandbox.loader"]
    assert not graph["agentsandbox.config"] & {"agentsandbox.policy", "agentsandbox.machine", "agentsandbox.loader"}


def test_every_import_counts_lazy_and_type_checking_ones_too() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import typeonly\nelse:\n    import runtime\n"
        "def f():\n    import lazy\n"
    )
    names = sorted(alias.name for node in _imports(ast.parse(source)) for alias in node.names)
    assert names == ["TYPE_CHECKING", "lazy", "runtime", "typeonly"]


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_module_stands_on_a_floor() -> None:
    # A new module is placed in FLOORS by whoever adds it.
    assert sorted(m for m in importGraph() if m != "agentsandbox" and floorOf(m) is None) == []


def test_at_most_two_imports_run_up_a_floor_and_they_are_listed() -> None:
    upward = upwardImports(importGraph())
    described = [f"{a} ({FLOORS[floorOf(a) or 0][0]}) -> {b} ({FLOORS[floorOf(b) or 0][0]})" for a, b in sorted(upward)]
    assert upward == set(UPWARD), "imports up a floor:\n" + "\n".join(described)
    assert len(UPWARD) <= 2


def test_no_import_circle_inside_the_package() -> None:
    # Every import counts, the listed upward ones included: a listed import up a
    # floor is allowed, a circle never is.
    graph = importGraph()
    found = circles(graph)
    described = [
        " ; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(group)))}" for m in group) for group in found
    ]
    assert found == [], "import circles:\n" + "\n".join(described)

"""The package's modules form layers: the import graph (module-level and
function-level imports alike) has no cycle, so nothing imports upward, and
each module stays small enough to read in one sitting."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "ray_elastic")
MAX_LINES = 550


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        deps = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    deps.add(t)
        # A package's __init__ re-exports its modules; the modules never
        # need the package itself, so that edge is not a layer violation.
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_controller_layers():
    g = import_graph()
    # The controller sits on top; the data plane and the policy never reach up to it.
    for low in ("ray_elastic.policy", "ray_elastic.step_runner", "ray_elastic.failure_location",
                "ray_elastic.membership", "ray_elastic.preemption", "ray_elastic.recording",
                "ray_elastic.ray_backend", "ray_elastic.errors", "ray_elastic.config"):
        assert "ray_elastic.controller" not in g[low], low
    # Only the Ray backend and the step runner touch Ray's step calls.
    assert "ray_elastic.controller" in g and not any(
        d in g["ray_elastic.controller"] for d in ("ray_elastic.step_runner", "ray_elastic.slice_group")
    )


def test_modules_are_small():
    big = {n: sum(1 for _ in open(p)) for n, p in _modules().items()}
    big = {n: lines for n, lines in big.items() if lines > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"

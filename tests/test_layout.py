"""The package's layout is its architecture: subpackages by concern, in
layers. The import graph (module-level and function-level imports alike)
has no cycle; no layer imports a higher one; the controller never touches
Ray itself (the cluster layer does); no module reaches into another's
private names; and each module stays small enough to read in one sitting."""

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


# Lowest first. The user's vocabulary (errors, configs, the program, its
# layout, callbacks) is at the bottom: every layer may speak it. The entry
# points (the public package, the CLI, elastic_retry) are at the top.
LAYERS = [
    ("ray_elastic.errors", "ray_elastic.paths", "ray_elastic.config", "ray_elastic.layout", "ray_elastic.program",
     "ray_elastic.callbacks", "ray_elastic.data"),
    ("ray_elastic.failures",),
    ("ray_elastic.checkpoint",),
    ("ray_elastic.observe",),
    ("ray_elastic.dispatch",),
    ("ray_elastic.worker",),
    ("ray_elastic.cluster",),
    ("ray_elastic.control",),
    ("ray_elastic", "ray_elastic.trainer", "ray_elastic.cli", "ray_elastic.cli_options", "ray_elastic.retry"),
]

# Private names of Ray's own, each used in one place for a reason given
# there: drain notices, the dashboard's metrics port, the worker's IO loop.
RAY_PRIVATE = {
    ("ray_elastic.cluster.drain", "ray._raylet"),
    ("ray_elastic.observe.metrics", "ray._config"),
    ("ray_elastic.worker.warm_pool", "ray._private"),
}


def layer_of(module: str) -> int:
    best = None
    for rank, members in enumerate(LAYERS):
        for m in members:
            if module == m or (m != "ray_elastic" and module.startswith(m + ".")):
                if best is None or len(m) > best[1]:
                    best = (rank, len(m))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def test_every_module_has_a_layer():
    for name in _modules():
        layer_of(name)


def test_no_layer_imports_upward():
    up = [f"{m} -> {d}" for m, deps in import_graph().items() for d in deps if layer_of(d) > layer_of(m)]
    assert not up, "imports of a higher layer: " + ", ".join(sorted(up))


def test_layer_check_catches_an_upward_import():
    assert layer_of("ray_elastic.dispatch.step_runner") < layer_of("ray_elastic.control.controller")
    assert layer_of("ray_elastic.worker.actor") > layer_of("ray_elastic.dispatch.assignment")


def _ray_imports(path: str) -> list[int]:
    with open(path) as f:
        tree = ast.parse(f.read())
    return [n.lineno for n in ast.walk(tree)
            if (isinstance(n, ast.Import) and any(a.name == "ray" or a.name.startswith("ray.") for a in n.names))
            or (isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and
                (n.module == "ray" or n.module.startswith("ray.")))]


def test_the_controller_never_touches_ray():
    """The control layer decides and carries out through the backend
    interface (cluster/backend.py); Ray handles live below it."""
    found = {n: _ray_imports(p) for n, p in _modules().items() if n.startswith("ray_elastic.control")}
    assert not {n: lines for n, lines in found.items() if lines}


def private_uses(path: str, module: str) -> list[str]:
    """Imports of a private name, and private attributes read off anything
    but self or cls: a module's private names are its own."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            out += [f"{module}:{n.lineno} imports {n.module}.{a.name}" for a in n.names if private(a.name)]
        elif isinstance(n, ast.Import):
            out += [f"{module}:{n.lineno} imports {a.name}" for a in n.names
                    if any(private(part) for part in a.name.split("."))]
        elif isinstance(n, ast.Attribute) and private(n.attr):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if (module, ast.unparse(n)) in RAY_PRIVATE or (module, ast.unparse(n).split(".")[0] + "." + n.attr) in RAY_PRIVATE:
                continue
            out.append(f"{module}:{n.lineno} reads {ast.unparse(n)}")
    return out


def test_no_private_name_crosses_a_module():
    found = [u for n, p in _modules().items() for u in private_uses(p, n)]
    assert not found, "private names used outside their module:\n" + "\n".join(found)


def test_private_check_finds_one(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from a import _b\nimport c._d\nx = runner._gather\ny = self._ok\nz = mod.__name__\n")
    found = private_uses(str(p), "m")
    assert len(found) == 3 and "_b" in found[0] and "c._d" in found[1] and "runner._gather" in found[2]
def test_modules_are_small():
    big = {n: sum(1 for _ in open(p)) for n, p in _modules().items()}
    big = {n: lines for n, lines in big.items() if lines > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_a_worker_process_imports_none_of_the_drivers_side():
    """A new worker process (a replacement, a warm one, a node's watcher)
    imports its actor's module through the package; the package's names
    load on first use, so the controller and Orbax are no part of its
    start (~0.3 s of CPU each, a quarter of a bare worker's imports)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; import ray_elastic.worker.actor, ray_elastic.failures.process_state; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ray_elastic', 'orbax'))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                       check=True).stdout)
    assert "ray_elastic.worker.actor" in loaded
    driver_side = [m for m in loaded if m.startswith(("orbax", "ray_elastic.control", "ray_elastic.trainer",
                                                       "ray_elastic.observe", "ray_elastic.cluster"))]
    assert driver_side == []


def test_the_package_still_gives_every_public_name():
    import ray_elastic

    for name in ray_elastic.__all__:
        assert getattr(ray_elastic, name).__name__ == name
    assert {"ElasticTrainer", "ElasticConfig", "Callback"} <= set(dir(ray_elastic))
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ray_elastic.Nope  # noqa: B018

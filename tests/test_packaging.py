"""What a new user installs is what the code imports, and a wheel carries
every package.

Every module that ray_elastic/, examples/, bench/ and tests/ import (the
notebook's code cells too) must come from the standard library, the repo,
or a distribution that pyproject.toml declares: a dependency, the extras the
README's test command installs, or what those require in turn
(importlib.metadata). So an undeclared import fails here on any machine,
not only on a fresh one where it happens to be missing.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("ray_elastic", "examples", "bench", "tests")
README_EXTRAS = ("test", "bench")  # pip install -e ".[test,bench]"


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_closure(project: dict, extras: tuple[str, ...]) -> set[str]:
    """Normalised names of the distributions that installing the project
    with `extras` brings in: its requirements and theirs, markers evaluated
    for this interpreter and the extras each requirement asks for."""
    todo = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        todo += [Requirement(r) for r in project["optional-dependencies"][extra]]
    seen: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        new = set(req.extras) - seen.get(name, set())
        if name in seen and not new:
            continue
        seen.setdefault(name, set()).update(req.extras)
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: its own imports cannot be checked
        for line in requires:
            sub = Requirement(line)
            envs = [{"extra": e} for e in ("", *seen[name])]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append(sub)
    return set(seen)


def _sources(tops: tuple[str, ...]) -> list[tuple[str, str]]:
    """(path, code) of every Python file under `tops`, and the notebook's cells."""
    out = []
    for top in tops:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith(".py"):
                    with open(path) as fh:
                        out.append((path, fh.read()))
                elif f.endswith(".ipynb"):
                    with open(path) as fh:
                        cells = json.load(fh)["cells"]
                    code = "\n".join(
                        "".join(c["source"]) for c in cells if c["cell_type"] == "code"
                    )
                    # Jupyter's magics and shell escapes are not Python.
                    code = "\n".join(l for l in code.splitlines() if not l.lstrip().startswith(("%", "!")))
                    out.append((path, code))
    return out


def imported_modules(code: str) -> set[str]:
    """Top-level names of the absolute imports in `code`, wherever they are
    (inside functions too: those run on workers)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _local_modules() -> set[str]:
    """Names importable from the repo itself: its top-level folders and
    the modules beside each scanned file (tests import their siblings)."""
    local = set(SCANNED)
    for top in SCANNED:
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, top)):
            local.update(f[:-3] for f in files if f.endswith(".py"))
            local.update(dirs)
    return local


def undeclared_imports(project: dict, extras: tuple[str, ...], tops: tuple[str, ...] = SCANNED) -> dict[str, list[str]]:
    allowed = declared_closure(project, extras)
    dists_of = metadata.packages_distributions()
    local = _local_modules()
    bad: dict[str, list[str]] = {}
    for path, code in _sources(tops):
        for mod in sorted(imported_modules(code)):
            if mod in sys.stdlib_module_names or mod in local or mod == "__future__":
                continue
            if not any(_norm(d) in allowed for d in dists_of.get(mod, [])):
                bad.setdefault(mod, []).append(os.path.relpath(path, ROOT))
    return bad


def test_every_import_is_declared():
    bad = undeclared_imports(_pyproject(), README_EXTRAS)
    assert not bad, (
        "imported but not provided by pyproject.toml's dependencies or the "
        f"extras {README_EXTRAS} (add the distribution there, or drop the import): "
        + "; ".join(f"{m} in {', '.join(paths)}" for m, paths in bad.items())
    )


def test_the_runtime_needs_no_extra():
    """`pip install .` (no extras) runs the package and the demo's model."""
    bad = undeclared_imports(_pyproject(), (), tops=("ray_elastic", "examples"))
    bad = {m: [p for p in paths if not p.endswith(".ipynb")] for m, paths in bad.items()}
    bad = {m: paths for m, paths in bad.items() if paths}
    assert not bad, "the runtime imports what only an extra installs: " + "; ".join(
        f"{m} in {', '.join(paths)}" for m, paths in bad.items()
    )


def test_the_check_can_fail():
    """Drop a declared extra and its imports show up as undeclared."""
    project = _pyproject()
    bad = undeclared_imports(project, ("bench",))  # without the test extra
    assert "pytest" in bad and any(p.startswith("tests") for p in bad["pytest"])
    assert "ray" in undeclared_imports({**project, "dependencies": []}, ())


def test_imports_are_found_everywhere():
    code = "import a.b\nfrom c.d import e\nfrom . import f\ndef g():\n    import h\n"
    assert imported_modules(code) == {"a", "c", "h"}


def test_wheel_lists_every_package():
    """pyproject.toml lists packages by hand (examples/ ships as
    ray_elastic.examples), so every package folder must be in that list."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for dirpath, dirs, files in os.walk(os.path.join(ROOT, "ray_elastic")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    assert found | {"ray_elastic.examples"} == listed
    assert os.path.exists(os.path.join(ROOT, "examples", "__init__.py"))


@pytest.mark.parametrize("sub", ["demo", "checkpoints", "timeline"])
def test_every_cli_option_has_help_with_its_default(sub):
    from ray_elastic.cli import build_parser

    parser = build_parser()
    sp = next(a for a in parser._actions if a.dest == "command").choices[sub]
    for action in sp._actions:
        if action.dest == "help":
            continue
        assert action.help, f"ray-elastic {sub} {action.option_strings or action.dest}: no help"
        if action.option_strings and action.default is not None and action.default is not False:
            text = action.help % {"default": action.default, "choices": action.choices}
            assert "default" in text, f"ray-elastic {sub} {action.option_strings}: help names no default"


@pytest.mark.slow
@pytest.mark.cluster
def test_wheel_runs_the_demo_from_an_empty_folder(tmp_path):
    """`pip install .` (a wheel, not editable), then `ray-elastic demo` from
    a folder with nothing in it: the demo finds its model in the package,
    survives its fault, and its output carries no Ray process dump.
    (The wheel goes into a folder of its own that shadows the editable
    install; its dependencies are this environment's.)"""
    wheels, site, empty, src = (tmp_path / d for d in ("wheels", "site", "empty", "src"))
    empty.mkdir()
    # Build from a copy: setuptools leaves build/ and *.egg-info behind.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(src)], check=True, timeout=300)
    (wheel,) = wheels.glob("ray_elastic-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import ray_elastic, ray_elastic.examples.lm as m; print(ray_elastic.__file__, m.__file__)"],
        cwd=empty, env=env, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert all(p.startswith(str(site)) for p in where), where

    run = subprocess.run(
        [str(site / "bin" / "ray-elastic"), "demo", "--steps", "40"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=400,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "failure node_died slice 1" in out and "steps 40/40" in out, out
    for noise in ("state-dump", "(raylet)", "core_worker.cc"):
        assert noise not in out, f"Ray's own output reached the demo's terminal: {noise}\n{out}"
    ray_log_line = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING|ERROR) ")
    assert not [l for l in out.splitlines() if ray_log_line.match(l)], out
    where = re.search(r"Ray's logs: (\S+) \(what Ray printed here: (\S+)\)", out)
    assert where and os.path.isdir(where.group(1)), out
    with open(where.group(2)) as f:
        assert "Connected to Ray cluster" in f.read()  # Ray's own lines went here instead


def test_the_default_folders_never_shadow_the_package(tmp_path):
    """Every folder the project makes by default (its working folder in the
    temp folder, the compile cache, the rescue folder, the demo's output)
    has a name Python cannot import, so a script or notebook started in
    the temp folder still imports the installed package. Made for real
    in a stand-in temp folder, then imported from there."""
    from ray_elastic import ElasticConfig
    from ray_elastic.checkpoint.config import CheckpointConfig
    from ray_elastic.paths import WORK_DIR

    import tempfile

    tmp = tempfile.gettempdir()
    made = [ElasticConfig().compile_cache_dir, CheckpointConfig(path=str(tmp_path / "c")).rescue_dir, WORK_DIR]
    for path in made:
        first = os.path.relpath(path, tmp).split(os.sep)[0]
        assert not first.isidentifier(), f"{path}: {first!r} could be imported as a module from {tmp}"
    # The same names, made in a temp folder of this test's own, from which
    # Python is started: the package it imports is the installed one.
    fake_tmp = tmp_path / "tmp"
    for path in made:
        (fake_tmp / os.path.relpath(path, tmp)).mkdir(parents=True, exist_ok=True)
    code = "import ray_elastic; print(ray_elastic.ElasticTrainer.__name__, ray_elastic.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=fake_tmp, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ElasticTrainer ") and str(fake_tmp) not in out.stdout, out.stdout
    # And the check can fail: a folder named like the package does shadow it.
    (fake_tmp / "ray_elastic").mkdir()
    shadowed = subprocess.run([sys.executable, "-c", code], cwd=fake_tmp, capture_output=True, text=True, timeout=120)
    assert shadowed.returncode != 0 and "ElasticTrainer" in shadowed.stderr

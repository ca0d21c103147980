"""The example notebook, run top to bottom as a user would run it.

`examples/elastic_training.ipynb` is executed with nbclient in a fresh
python3 kernel whose working directory is examples/ (where Jupyter would
start it). RAY_ADDRESS is removed from the kernel's environment, so the
notebook starts its own local multi-node cluster, and RAY_TMPDIR points at a
folder of this test's own, so every Ray process the kernel starts can be
found, and ended, afterwards. The notebook must run without an error, and
its summary cell must report every requested step done and the injected
failure recovered.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time

import pytest

# slow: it runs the same trainer as the e2e tests, in a kernel (README: Tests).
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
pytest.importorskip("matplotlib", reason="the notebook plots with matplotlib, which is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOK = os.path.join(EXAMPLES, "elastic_training.ipynb")


def _kernel_available() -> bool:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
        return True
    except NoSuchKernel:
        return False


def _pids_using(folder: str) -> list[int]:
    """Processes whose command line names our Ray temp dir: all of them
    carry their session dir there."""
    mine = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if folder in f.read().decode(errors="replace"):
                    mine.append(int(entry))
        except OSError:
            continue
    return mine


def _kill_leftovers(folder: str, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _pids_using(folder)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    return _pids_using(folder)


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stdout")


def test_notebook_runs_and_recovers():
    if not _kernel_available():
        pytest.skip("no python3 Jupyter kernel (pip install ipykernel)")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Short: Ray's socket paths under it must stay below 108 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="re-nb-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["RAY_TMPDIR"] = ray_tmp
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=240, resources={"metadata": {"path": EXAMPLES}},
    )
    try:
        client.execute(env=env)
    finally:
        left = _kill_leftovers(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"Ray processes of the notebook still alive: {left}"

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    figures = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(figures) == 2, "the loss curve and the timeline"

    (summary_cell,) = [c for c in nb.cells if "summary" in c.get("metadata", {}).get("tags", [])]
    last_line = _stdout(summary_cell).strip().splitlines()[-1]
    summary = json.loads(last_line)
    assert summary["steps_completed"] == summary["steps_requested"] == 120, summary
    assert summary["failures"] == 1 and summary["recovered"] == 1, summary
    assert summary["failure_kinds"] == ["process_died"], summary
    assert summary["driver_pid_unchanged"], summary
    assert "done" in _stdout(nb.cells[-1])

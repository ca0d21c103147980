"""The Ray Train peer benchmark (bench/raytrain.py) and its charts
(bench/charts.py), as pure logic: the charts and the figures from a run's
events. A real Ray Train run (its JaxTrainer, a worker SIGKILLed mid-run,
a restart from the last committed checkpoint; two minutes here) is left
out of CI to keep it within its time: `python -m bench compare --quick
--systems raytrain --scenarios kill --runs 1` runs one.
"""

from __future__ import annotations

import os

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_run(system: str, scenario: str, recovered_s) -> dict:
    # 1 step per 0.1 s, a fault at step 12, restart at 20 s from step 10.
    timeline = [[0.1 * k, k] for k in range(1, 13)]
    timeline += [[20.0 + 0.1 * (k - 10), k] for k in range(11, 31)]
    return {
        "system": system,
        "scenario": scenario,
        "timeline": timeline,
        "markers": [
            {"t": 1.25, "event": "fault"},
            {"t": 3.0, "event": "detect"},
            {"t": 18.0, "event": "restart", "world": 2},
            {"t": 19.5, "event": "restore", "step": 10},
            {"t": 25.0, "event": "something-else"},
        ],
        "recovered_s": recovered_s,
        "detected_s": 1.75,
        "steps_rewound": 3,
        "goodput": 0.4,
    }


def test_charts_make_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.charts import _segments, bar_chart, timeline_png

    runs = [_synthetic_run("raytrain", "kill", 18.85), _synthetic_run("raytrain", "stop", None)]
    runs.append({"system": "empty", "scenario": "kill", "timeline": [], "markers": []})
    tl = timeline_png(runs, str(tmp_path / "timeline.png"), title="synthetic")
    rows = [
        {"system": "raytrain", "scenario": "kill", "recovered_s": 18.85},
        {"system": "raytrain", "scenario": "stop", "recovered_s": None},
        {"system": "ray_elastic", "scenario": "kill",
         "recovered_s": {"n": 3, "median": 1.2, "min": 1.0, "max": 1.6}},
        {"system": "ray_elastic", "scenario": "remove_node", "recovered_s": {"n": 0}},
    ]
    bars = bar_chart(rows, str(tmp_path / "bars.png"), title="synthetic")
    for path in (tl, bars):
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.getsize(path) > 5000
    # A restart from an older checkpoint breaks the line.
    assert [len(s) for s in _segments(runs[0]["timeline"])] == [12, 20]
    with pytest.raises(ValueError):
        timeline_png([], str(tmp_path / "none.png"))
    with pytest.raises(ValueError):
        bar_chart([], str(tmp_path / "none.png"))


def test_figures_from_events():
    """Figures from a hand-made event log (no cluster)."""
    from bench.raytrain import _figures

    t0, ev = 1000.0, []
    for k in range(1, 9):  # attempt 1 (rank-0 pid 10): steps 1..8, 0.5 s each
        ev.append({"ev": "step", "rank": 0, "step": k, "dur": 0.5, "pid": 10, "t": t0 + 5 + 0.5 * k})
    ev.append({"ev": "detect", "ranks": [1], "error": ["X"], "t": t0 + 11.0})
    ev.append({"ev": "start", "rank": 0, "world": 2, "pid": 20, "t": t0 + 20.0})
    ev.append({"ev": "restore", "rank": 0, "step": 5, "pid": 20, "t": t0 + 22.0})
    for k in range(6, 13):  # attempt 2: steps 6..12
        ev.append({"ev": "step", "rank": 0, "step": k, "dur": 0.5, "pid": 20, "t": t0 + 22 + 0.5 * (k - 5)})
    out = _figures(ev, t0, t0 + 30.0, fault_t=t0 + 9.2, old_rank0_pid=10)
    assert out["steps_completed"] == 12
    assert out["fault_t"] == pytest.approx(9.2)
    assert out["detected_s"] == pytest.approx(1.8)
    assert out["recovered_s"] == pytest.approx(22.5 - 9.2)
    assert out["steps_rewound"] == 8 + 1 - 5
    assert out["steps_redone_total"] == 3
    assert out["productive_s"] == pytest.approx(12 * 0.5)
    assert out["goodput"] == pytest.approx(6.0 / 30.0)
    assert out["step_time_s"] == pytest.approx(0.5)
    assert [m["event"] for m in out["markers"]] == ["fault", "detect", "restart", "restore"]

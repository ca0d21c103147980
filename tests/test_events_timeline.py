"""EventLog, read_events and `ray-elastic timeline`, from synthetic hook
calls (no Ray)."""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ray_elastic.cli import main
from ray_elastic.errors import EventsFileError
from ray_elastic.observe.events import EventLog, read_events
from ray_elastic.observe.report import FailureRecord, RunReport
from ray_elastic.observe.timeline import load_timeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class FakeClock:
    def __init__(self):
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _simulate(callbacks, clock: FakeClock, steps=30, fail_at=10, policy="pause", extra_events=()):
    """Drive callbacks as the controller does: a run of `steps` steps with a
    failure at `fail_at`, a wait (pause) or a shrink (resize), a rewind of one
    step, and a recovery. Returns the RunReport it built."""
    trainer = SimpleNamespace(config=SimpleNamespace(policy=policy, num_slices=2, required_slices=2), steps=steps)
    report = RunReport(policy=policy, num_slices=2, steps_requested=steps)
    t0 = clock.now

    def event(name, **fields):
        e = {"t": round(clock.now - t0, 4), "event": name, **fields}
        report.events.append(e)
        for cb in callbacks:
            cb.on_event(e)

    def step(k, slices):
        clock.now += 0.2
        loss = 5.0 / (1 + k * 0.1)
        del report.losses[k - 1:], report.step_times[k - 1:], report.slices_per_step[k - 1:]
        report.losses.append(loss)
        report.step_times.append(0.2)
        report.slices_per_step.append(slices)
        for cb in callbacks:
            cb.on_step(k, {"loss": loss, "slices": slices, "step_s": 0.2})

    for cb in callbacks:
        cb.on_start(trainer)
    clock.now += 0.05
    event("reserve", slices=2)
    clock.now += 2.0
    event("slice_ready", slice=0, setup_s=2.0)
    event("slice_ready", slice=1, setup_s=2.0)
    event("start", slices=[0, 1])
    k = 0
    while k < fail_at:
        k += 1
        step(k, 2)
    event("fault", kind="kill", slice=1, host=0, step=k)
    clock.now += 0.3
    event("detected", kind="process_died", slice=1, host=0, step=k, detected_s=0.3)
    event("replace", slice=1)
    event("rewind", from_step=k, to_step=k - 1)
    k -= 1
    if policy == "pause":
        event("wait", deadline_s=120.0, step=k)
        clock.now += 4.0
        event("slice_ready", slice=1, setup_s=4.0)
        event("grow", joined=[1], slices=[0, 1], step=k)
        live = 2
    else:
        event("shrink", slices=[0], step=k)
        live = 1
    t_fault = report.events[-1]["t"]
    k += 1
    step(k, live)
    rec = round(clock.now - t0 - t_fault, 4)
    event("recovered", slice=1, step=k, recovered_s=rec)
    for name, fields in extra_events:
        event(name, **fields)
    while k < steps:
        k += 1
        step(k, live)
    event("end", steps=k)
    report.steps_completed = k
    report.wall_s = clock.now - t0
    report.productive_s = 0.2 * k
    report.final_loss = report.losses[-1]
    report.failures.append(FailureRecord("process_died", 1, 0, fail_at, 0.3, rec, 1, live, "live"))
    for cb in callbacks:
        cb.on_end(report)
    return report


# The timeline needs matplotlib (the "bench" extra, which CI installs).
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed"
)


def _assert_png(path, min_bytes=20_000):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > min_bytes, f"{path}: only {len(data)} bytes"
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width >= 800 and height >= 400
    return data


# -- EventLog / read_events ----------------------------------------------------------


def test_event_log_round_trip(tmp_path):
    path = tmp_path / "run.events.jsonl"
    clock = FakeClock()
    report = _simulate([EventLog(path, clock=clock)], clock, extra_events=[("checkpoint_saved", {"step": 10, "path": "/x"})])
    records = read_events(path)

    assert records[0]["event"] == "run" and records[0]["policy"] == "pause" and records[0]["steps"] == 30
    assert records[-1]["event"] == "summary" and records[-1]["steps_completed"] == 30
    assert records[-1]["failures"][0]["kind"] == "process_died"
    # Every controller event is there, in order, as given (unknown ones too).
    events = [r for r in records if r["event"] not in ("run", "step", "summary")]
    assert events == report.events
    assert any(e["event"] == "checkpoint_saved" and e["path"] == "/x" for e in events)
    # A step record per step, on the events' clock: the redone step 10 twice.
    steps = [r for r in records if r["event"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, 11)) + list(range(10, 31))
    assert all(set(s) >= {"t", "step", "loss", "slices", "step_s"} for s in steps)
    ts = [r["t"] for r in records[1:-1]]
    assert ts == sorted(ts)
    start_t = next(e["t"] for e in events if e["event"] == "start")
    assert steps[0]["t"] == pytest.approx(start_t + 0.2, abs=1e-6)


def test_event_log_every_n_keeps_steps_near_events(tmp_path):
    path = tmp_path / "ev.jsonl"
    clock = FakeClock()
    _simulate([EventLog(path, every=5, clock=clock)], clock, policy="resize")
    steps = [r["step"] for r in read_events(path) if r["event"] == "step"]
    # Every 5th, the first after each event (start, recovery) and the last.
    assert steps == [1, 5, 10, 10, 11, 15, 20, 25, 30], steps


def test_event_log_is_flushed_as_it_goes(tmp_path):
    """A driver that dies mid-run leaves what was written; a cut-off last
    line is skipped."""
    path = tmp_path / "ev.jsonl"
    clock = FakeClock()
    log = EventLog(path, clock=clock)
    log.on_start(SimpleNamespace(config=SimpleNamespace(policy="resize", num_slices=2), steps=5))
    log.on_event({"t": 0.1, "event": "start", "slices": [0, 1]})
    clock.now += 1
    log.on_step(1, {"loss": 2.0, "slices": 2, "step_s": 0.5})
    # Read while the file is still open (no on_end): everything is there.
    assert [r["event"] for r in read_events(path)] == ["run", "start", "step"]
    with open(path, "a") as f:
        f.write('{"t": 1.5, "event": "det')  # the writer died here
    assert [r["event"] for r in read_events(path)] == ["run", "start", "step"]
    log.close()


def test_read_events_errors(tmp_path):
    with pytest.raises(EventsFileError, match="no such file"):
        read_events(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "event": "start"}\nnot json\n{"t": 1, "event": "end"}\n')
    with pytest.raises(EventsFileError, match="line 2: not JSON"):
        read_events(bad)
    noevent = tmp_path / "noevent.jsonl"
    noevent.write_text('{"t": 0}\n')
    with pytest.raises(EventsFileError, match="line 1: not an event record"):
        read_events(noevent)


def test_event_log_never_breaks_the_run(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    log = EventLog(blocker / "sub" / "ev.jsonl")  # a file where a folder should be
    log.on_start(SimpleNamespace(config=None, steps=3))
    log.on_event({"t": 0.0, "event": "start", "slices": [0]})
    log.on_step(1, {"loss": float("nan"), "slices": 1, "step_s": 0.1})
    log.on_end(None)


def test_event_log_writes_nan_as_null(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path)
    log.on_start(SimpleNamespace(config=None, steps=3))
    log.on_step(1, {"loss": float("nan"), "slices": 1, "step_s": 0.1})
    log.close()
    assert read_events(path)[-1]["loss"] is None  # strict JSON, loadable anywhere


# -- the timeline --------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("timeline")
    clock = FakeClock()
    events = d / "run.events.jsonl"
    report = _simulate(
        [EventLog(events, clock=clock)], clock,
        extra_events=[("checkpoint_saved", {"step": 10}), ("restore", {"step": 10})],
    )
    rep = d / "run.json"
    report.write(str(rep))
    return d, events, rep, report


def test_report_timeline_rebuilds_step_times(run_files):
    _, events, rep, report = run_files
    exact = load_timeline(str(events))
    rebuilt = load_timeline(str(rep))
    assert exact.source == "events" and rebuilt.source == "report"
    assert [p.step for p in rebuilt.steps] == list(range(1, 31))
    # The kept steps land where the events file says they happened.
    exact_t = {p.step: p.t for p in exact.steps}  # the later record wins: the redone step
    for p in rebuilt.steps:
        assert p.t == pytest.approx(exact_t[p.step], abs=1e-3), p
    assert rebuilt.steps[-1].loss == pytest.approx(report.final_loss)
    assert [p.slices for p in rebuilt.steps] == report.slices_per_step


@needs_matplotlib
def test_cli_timeline_from_events_file(run_files, capsys):
    d, events, _, _ = run_files
    out = d / "from_events.png"
    assert main(["timeline", str(events), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    _assert_png(out)


@needs_matplotlib
def test_cli_timeline_from_report(run_files):
    d, _, rep, _ = run_files
    out = d / "from_report.png"
    assert main(["timeline", "--report", str(rep), "-o", str(out)]) == 0
    _assert_png(out)
    # A report given as the positional argument is recognised too, and the
    # default output sits next to it.
    assert main(["timeline", str(rep)]) == 0
    _assert_png(d / "run.png")


@needs_matplotlib
def test_cli_timeline_resize_run(tmp_path):
    clock = FakeClock()
    events = tmp_path / "resize.jsonl"
    _simulate([EventLog(events, clock=clock)], clock, policy="resize")
    assert main(["timeline", str(events), "-o", str(tmp_path / "r.png")]) == 0
    _assert_png(tmp_path / "r.png")


@needs_matplotlib
def test_cli_timeline_as_a_process(run_files, tmp_path):
    """The real command line: `python -m ray_elastic.cli timeline ...`."""
    _, events, _, _ = run_files
    out = tmp_path / "proc.png"
    p = subprocess.run(
        [sys.executable, "-m", "ray_elastic.cli", "timeline", str(events), "-o", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stderr
    _assert_png(out)


@pytest.mark.parametrize(
    "content, args, message",
    [
        (None, [], "no such file"),
        ("this is not json\n", [], "not JSON"),
        ("", [], "empty file"),
        ('{"a": 1}\n', [], "not an event record"),
        ('[1, 2, 3]', [], "not an event record"),
        ('{"t": 0, "event": "run"}\n', [], "no events or steps"),
        ('{"t": 0, "event": "start", "slices": [0]}\n', ["--report"], "not a run report"),
    ],
)
def test_cli_timeline_bad_input(tmp_path, capsys, content, args, message):
    path = tmp_path / "input.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "out.png"
    rc = main(["timeline", *args, str(path), "-o", str(out)])
    assert rc != 0
    err = capsys.readouterr().err
    assert "error" in err and message in err and str(path) in err
    assert not out.exists()


def test_cli_timeline_needs_exactly_one_input(tmp_path, capsys):
    assert main(["timeline"]) != 0
    assert main(["timeline", "a.jsonl", "--report", "b.json"]) != 0
    assert "one of them" in capsys.readouterr().err

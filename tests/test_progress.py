"""ProgressCallback with a fake stream and synthetic hook calls (no Ray)."""

from __future__ import annotations

import io
import threading
import time
from types import SimpleNamespace

import pytest

from ray_elastic.callbacks import Phase, RunStatus
from ray_elastic.observe.progress import ProgressCallback
from ray_elastic.observe.report import FailureRecord, RunReport


class FakeStream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _trainer(num_slices=2, steps=10):
    return SimpleNamespace(config=SimpleNamespace(num_slices=num_slices, policy="pause"), steps=steps)


def _report(steps=10, done=10, error="", failures=()):
    r = RunReport(policy="pause", num_slices=2, steps_requested=steps, steps_completed=done,
                  final_loss=1.2345, wall_s=12.0, productive_s=9.0, error=error)
    r.failures = list(failures)
    return r


def _wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _start(p: ProgressCallback, trainer) -> list:
    """on_start, returning the refresher threads it started."""
    before = set(threading.enumerate())
    p.on_start(trainer)
    # By name: a thread of Ray's own that calls into Python (an earlier
    # test's late error report) shows up in the list too.
    return [t for t in threading.enumerate() if t not in before and t.name.startswith("ray_elastic")]


def _run_with_failure(p: ProgressCallback, clock: FakeClock, stream: FakeStream, check_wait=None) -> list:
    threads = _start(p, _trainer())
    p.on_event({"t": 0.1, "event": "reserve", "slices": 2})
    p.on_event({"t": 2.0, "event": "start", "slices": [0, 1]})
    p.on_state(RunStatus(Phase.TRAINING, 2.0, 0, 2))
    for s in range(1, 4):
        p.on_step(s, {"loss": 3.0 - s * 0.1, "slices": 2, "step_s": 0.25})
    p.on_event({"t": 3.0, "event": "fault", "kind": "kill", "slice": 1, "host": 0, "step": 3})
    p.on_event({"t": 3.2, "event": "detected", "kind": "process_died", "slice": 1, "host": 0, "step": 3, "detected_s": 0.2})
    p.on_event({"t": 3.3, "event": "replace", "slice": 1})
    p.on_event({"t": 3.4, "event": "wait", "deadline_s": 120.0, "step": 3})
    p.on_state(RunStatus(Phase.WAITING, 3.4, 3, 1, pending=(1,), deadline_s=120.0))
    if check_wait is not None:
        check_wait()
    p.on_event({"t": 9.0, "event": "slice_ready", "slice": 1, "setup_s": 5.6})
    p.on_event({"t": 9.5, "event": "grow", "joined": [1], "slices": [0, 1], "step": 3})
    p.on_state(RunStatus(Phase.RECOVERING, 9.5, 3, 2, pending=(1,)))
    p.on_event({"t": 9.9, "event": "recovered", "slice": 1, "step": 4, "recovered_s": 6.9})
    p.on_state(RunStatus(Phase.TRAINING, 9.9, 4, 2))
    p.on_step(4, {"loss": 2.6, "slices": 2, "step_s": 0.3})
    p.on_event({"t": 10.0, "event": "checkpoint_saved", "step": 4})
    for s in range(5, 11):
        p.on_step(s, {"loss": 2.6 - s * 0.1, "slices": 2, "step_s": 0.25})
    p.on_event({"t": 12.0, "event": "end", "steps": 10})
    p.on_state(RunStatus(Phase.DONE, 12.0, 10, 2))
    rec = FailureRecord(kind="process_died", slice=1, host=0, step=3, detected_s=0.2, recovered_s=6.9)
    p.on_end(_report(failures=[rec]))
    return threads


def test_terminal_live_line_and_waiting_counter():
    stream, clock = FakeStream(tty=True), FakeClock()
    p = ProgressCallback(10, stream=stream, refresh_s=0.02, clock=clock)
    assert p.tty

    def check_wait():
        # The background thread redraws the waiting line as time passes,
        # with no hook being called.
        clock.now += 7
        assert _wait_for(lambda: "waiting 7 s for slice 1 (timeout 2m00s)" in stream.getvalue()), stream.getvalue()[-300:]
        clock.now += 5
        assert _wait_for(lambda: "waiting 12 s for slice 1" in stream.getvalue())

    threads = _run_with_failure(p, clock, stream, check_wait)
    assert len(threads) == 1
    out = stream.getvalue()
    # A live line redrawn in place with carriage return + clear-to-end-of-line.
    assert "\r\x1b[K" in out
    assert "step 3/10 [" in out and "loss 2.7000" in out and "slices 2/2" in out and "0.25 s/step" in out
    assert "eta" in out
    # Failures and recoveries printed as lines of their own.
    assert "slice 1 failed (process_died) at step 3, detected in 0.20 s\n" in out
    assert "recovered: step 4 done 6.90 s after the fault, on 2 slice(s)\n" in out
    assert "checkpoint saved (step 4)" in out  # unknown events shown on the line
    # The summary ends the output; nothing is redrawn after it.
    assert out.endswith("done: 10/10 steps, final loss 1.2345, 1 failure(s) (recovered in 6.9 s), wall 12.0 s, goodput 0.75\n")
    # The refresher stopped at on_end.
    assert not threads[0].is_alive()
    time.sleep(0.1)
    assert stream.getvalue() == out


def test_not_a_terminal_only_important_lines():
    stream, clock = FakeStream(tty=False), FakeClock()
    p = ProgressCallback(10, stream=stream, refresh_s=0.02, clock=clock)
    assert not p.tty

    def check_wait():
        clock.now += 7
        time.sleep(0.1)
        assert "waiting 7 s" not in stream.getvalue()  # no live line

    assert _run_with_failure(p, clock, stream, check_wait) == []  # no thread
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    assert not any(line.startswith("step ") for line in lines)  # no per-step chatter
    assert any("slice 1 failed (process_died) at step 3" in line for line in lines)
    assert any("waiting for a replacement of slice 1 (up to 120 s)" in line for line in lines)
    assert any("recovered: step 4" in line for line in lines)
    assert not any("checkpoint" in line for line in lines)
    assert lines[-1].startswith("done: 10/10 steps")
    assert len(lines) == 5, lines  # detected, wait, grow, recovered, summary


def test_failed_run_and_shrink_lines():
    stream = FakeStream(tty=False)
    p = ProgressCallback(10, stream=stream)
    p.on_start(_trainer())
    p.on_event({"t": 1.0, "event": "start", "slices": [0, 1]})
    p.on_step(1, {"loss": 3.0, "slices": 2, "step_s": 0.2})
    p.on_event({"t": 2.0, "event": "detected", "kind": "node_died", "slice": 0, "host": 0, "step": 1, "detected_s": 1.5})
    p.on_event({"t": 2.1, "event": "replace", "slice": 0})
    p.on_event({"t": 2.2, "event": "shrink", "slices": [1], "step": 1})
    p.on_end(_report(done=1, error="slice 0 could not be replaced within 5 s"))
    out = stream.getvalue()
    assert "training on 1 slice(s) while slice 0 is replaced" in out
    assert "run failed at step 1/10: slice 0 could not be replaced within 5 s" in out
    assert "done: 1/10 steps" in out


def test_terminal_all_events_mode_prints_every_event():
    stream = FakeStream(tty=True)
    p = ProgressCallback(5, stream=stream, events="all", refresh_s=10)
    threads = _start(p, _trainer(steps=5))
    p.on_event({"t": 0.5, "event": "reserve", "slices": 2})
    p.on_event({"t": 1.0, "event": "start", "slices": [0, 1]})
    p.on_step(1, {"loss": 3.0, "slices": 2, "step_s": 0.2})
    p.on_end(_report(steps=5, done=1))
    out = stream.getvalue()
    assert "reserve: slices=2\n" in out and "start: slices=[0, 1]\n" in out
    assert len(threads) == 1 and not threads[0].is_alive()


def test_bad_events_mode_rejected():
    with pytest.raises(ValueError):
        ProgressCallback(10, events="some")


def test_closed_stream_does_not_raise():
    stream = FakeStream(tty=True)
    p = ProgressCallback(3, stream=stream, refresh_s=10)
    p.on_start(_trainer(steps=3))
    stream.close()
    p.on_step(1, {"loss": 1.0, "slices": 2, "step_s": 0.1})  # must not take training down
    p.on_event({"t": 1.0, "event": "detected", "kind": "hung", "slice": 1, "host": 0, "step": 1, "detected_s": 10.0})
    p.on_end(_report(steps=3, done=1))


def test_tie_break_lines_say_who_replayed_and_whom_it_named():
    stream = FakeStream(tty=False)
    p = ProgressCallback(10, stream=stream)
    p.on_start(_trainer())
    p.on_event({"t": 1.0, "event": "start", "slices": [0, 1]})
    p.on_event({"t": 2.0, "event": "tie_break", "step": 8, "replayed_from": 5, "by": "replay", "slices": [0, 1],
                "named": [[1, 0]], "seconds": 1.25})
    p.on_event({"t": 3.0, "event": "tie_break", "step": 9, "replayed_from": 8, "by": "spare", "slices": [2],
                "named": [], "seconds": 0.5})
    p.on_event({"t": 4.0, "event": "tie_break", "step": 3, "by": None, "named": [],
                "reason": "no verified snapshot to replay from"})
    out = stream.getvalue()
    assert "two replicas differ at step 8: each slice replayed it from step 5 in 1.2 s: slice 1 host 0" in out
    assert "two replicas differ at step 9: the spare replayed it from step 8 in 0.5 s: neither told apart" in out
    assert "two replicas differ at step 3: no verified snapshot to replay from" in out

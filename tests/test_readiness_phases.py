"""Readiness phases travel from the workers' set-up to SliceUp and the
slice_ready event (no cluster)."""

from __future__ import annotations

import time

from ray_elastic.cluster.backend import SliceUp
from ray_elastic.control.membership import Membership
from ray_elastic.cluster.slice_group import _phases


def test_slice_phases_take_the_slowest_host_and_the_report_delay():
    now = time.time()
    setups = [{"phases": {"imports": 1.0, "compile": 2.0}, "ready_at": now - 0.5},
              {"phases": {"imports": 1.5, "compile": 1.0}, "ready_at": now - 0.2}]
    out = _phases(setups)
    assert out["imports"] == 1.5 and out["compile"] == 2.0
    assert 0.15 <= out["report"] < 5
    assert _phases([{"setup_s": 1.0}]) == {}  # a backend that does not time them


def test_slice_ready_event_carries_the_phases():
    class Backend:
        def __init__(self, ups):
            self.ups = ups

        def poll(self, block_s=0.0):
            ups, self.ups = self.ups, []
            return ups

    events = []
    m = Membership(Backend([SliceUp(1, 3.0, {"compile": 1.2}), SliceUp(2, 2.0)]), snapshots=None,
                   emit=lambda name, **kw: events.append((name, kw)))
    m.coming |= {1, 2}
    m.poll()
    assert events[0] == ("slice_ready", {"slice": 1, "setup_s": 3.0, "phases": {"compile": 1.2}})
    assert events[1] == ("slice_ready", {"slice": 2, "setup_s": 2.0})  # the fields as before
    assert m.ready == {1, 2} and not m.coming
    assert SliceUp(3, 1.0).phases == {}


def test_process_start_is_on_the_wall_clock():
    import os

    import pytest

    from ray_elastic.worker.readiness import _process_started_at

    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    import psutil

    started = _process_started_at()
    # This test process's start as the kernel has it (psutil reads the same
    # /proc fields another way), not a bound on its age: a whole CI session
    # runs past an hour.
    assert started is not None and abs(started - psutil.Process().create_time()) < 1.0, started


_MARKS = [("setup_start", 102.71), ("imports", 102.8), ("jax_init", 103.0), ("program_build", 103.0),
          ("initial_state", 103.5), ("compile", 104.9)]
_FIRST = ("process_start", "actor_load", "args_load", "warm_process")


def test_a_new_process_reports_its_start_and_loads():
    from ray_elastic.worker.readiness import readiness_phases

    # Created at 100; the process started 0.3 s later, loaded the worker's
    # module at 101.5 and ran its constructor at 102.7.
    out = readiness_phases(100.0, 101.5, 102.7, _MARKS, process_at=100.3)
    assert {k: out[k] for k in _FIRST if k in out} == {"process_start": 0.3, "actor_load": 1.2, "args_load": 1.2}
    assert out["queue"] == 0.01 and out["compile"] == 1.4 and out["program_build"] == 0.0
    assert list(out) == ["process_start", "actor_load", "args_load", "queue", "imports", "jax_init",
                         "program_build", "initial_state", "compile"]
    assert all(v >= 0 for v in out.values()), out


def test_a_process_started_within_a_clock_tick_of_the_creation_is_a_new_one():
    """Ray starts an actor's process 1 to 20 ms after its creation here,
    and the kernel floors a process's start to a clock tick (10 ms): one
    that reads as started 8 ms before the creation was started for it."""
    from ray_elastic.worker.readiness import readiness_phases

    out = readiness_phases(100.0, 101.5, 102.7, _MARKS, process_at=99.992)
    assert "warm_process" not in out and out["process_start"] == 0.0, out
    assert out["actor_load"] == 1.5 and out["args_load"] == 1.2, out


def test_a_warm_process_reports_its_taking_not_its_age():
    """A warm pool's process started 50 s before the actor's creation, with
    the worker's module imported ahead: its first phase is warm_process,
    the creation to the constructor, never a negative process_start."""
    from ray_elastic.worker.readiness import readiness_phases

    out = readiness_phases(100.0, 52.0, 100.45, _MARKS, process_at=50.0)
    assert out["warm_process"] == 0.45
    assert not {"process_start", "actor_load", "args_load"} & set(out), out
    assert list(out)[:2] == ["warm_process", "queue"]
    assert all(v >= 0 for v in out.values()), out
    # An idle process Ray kept, without the pool's imports: the same phase,
    # which then holds the imports.
    assert readiness_phases(100.0, 101.0, 102.0, _MARKS, process_at=50.0)["warm_process"] == 2.0


def test_phases_across_two_clocks_are_never_negative():
    """The creation is on the driver's clock, the rest on the worker's: a
    worker whose clock runs behind still reports durations >= 0."""
    from ray_elastic.worker.readiness import readiness_phases

    behind = readiness_phases(100.0, 99.5, 99.96, [("setup_start", 99.97), ("imports", 99.95)], process_at=99.0)
    assert behind == {"warm_process": 0.0, "queue": 0.01, "imports": 0.0}
    assert all(v >= 0 for v in readiness_phases(None, 99.0, 99.5, _MARKS).values())


def test_a_workers_phases_from_its_own_process():
    """A worker's set-up phases (readiness_phases) read its process's
    start from the kernel: an actor created after it is in a process
    started ahead (warm), one created before it in a process started for
    it."""
    from ray_elastic.worker.readiness import _process_started_at, readiness_phases

    started = _process_started_at()
    if started is None:
        import pytest

        pytest.skip("no /proc")
    now = time.time()
    marks = [("setup_start", now), ("imports", now)]
    warm = readiness_phases(now - 0.1, started, now, marks)
    cold = readiness_phases(started - 0.5, started + 0.1, now, marks)
    assert "warm_process" in warm and "process_start" not in warm
    assert "process_start" in cold and "warm_process" not in cold and 0.4 <= cold["process_start"] <= 0.6
    assert all(v >= 0 for v in (*warm.values(), *cold.values()))


def test_a_slice_of_warm_and_new_hosts_carries_both_and_reports_no_negative_delay():
    now = time.time()
    setups = [{"phases": {"warm_process": 0.4, "compile": 1.0}, "ready_at": now - 0.5},
              {"phases": {"process_start": 0.2, "actor_load": 1.5, "args_load": 1.1, "compile": 2.0},
               "ready_at": now + 5.0}]  # a host whose clock runs ahead of the driver's
    out = _phases(setups)
    assert out["warm_process"] == 0.4 and out["process_start"] == 0.2 and out["compile"] == 2.0
    assert out["report"] == 0.0

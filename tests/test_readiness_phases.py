"""Readiness phases travel from the workers' set-up to SliceUp and the
slice_ready event (no cluster)."""

from __future__ import annotations

import time

from ray_elastic.backend import SliceUp
from ray_elastic.membership import Membership
from ray_elastic.slice_group import _phases


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

    from ray_elastic.readiness import _process_started_at

    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    started = _process_started_at()
    assert started is not None and 0 <= time.time() - started < 3600  # this test process's age

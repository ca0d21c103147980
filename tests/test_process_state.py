"""A silent worker told busy from stopped by its node's kernel
(failures/process_state.py), and a replacement that waits for the
processes it replaces to exit (worker/predecessors.py): on real child
processes (running, SIGSTOPped, exited), and the locator's decision over
a fake probe. tests/test_elastic_e2e.py holds a real worker's GIL and
stops a real worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from ray_elastic.errors import FailureKind
from ray_elastic.failures.process_state import BUSY, GONE, STOPPED, proc_state
from ray_elastic.worker.predecessors import Predecessor, wait_gone
from tests.test_failure_location import _live, _locator, _Probe


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    if p.poll() is None:
        p.kill()
        p.wait()


def test_the_kernel_tells_running_from_stopped_from_gone(child):
    assert proc_state(child.pid) == BUSY
    child.send_signal(signal.SIGSTOP)
    deadline = time.time() + 5
    while proc_state(child.pid) != STOPPED and time.time() < deadline:
        time.sleep(0.01)
    assert proc_state(child.pid) == STOPPED
    child.send_signal(signal.SIGKILL)
    deadline = time.time() + 5
    while proc_state(child.pid) != GONE and time.time() < deadline:
        time.sleep(0.01)
    assert proc_state(child.pid) == GONE  # a zombie until reaped: exited all the same
    child.wait()
    assert proc_state(child.pid) == GONE


class _Beats:
    """The heartbeats' side of `watch`: one host silent for 1.2 s."""

    def __init__(self):
        self.forgotten = []

    def quiet(self, live, waiting, step):
        return (1, 0, 1.2)

    def forget(self, s):
        self.forgotten.append(s)


class _SilentProbe(_Probe):
    def ping(self, worker, timeout_s):
        from ray import exceptions as rex

        raise rex.GetTimeoutError()


def _infos_live(pid=4242):
    live = _live()
    for s in live.values():
        for i in s.infos:
            i["pid"] = pid
    return live


@pytest.mark.parametrize("state,kind", [(BUSY, None), (STOPPED, FailureKind.HUNG), (GONE, FailureKind.PROCESS_DIED),
                                        (None, FailureKind.HUNG)])
def test_a_silent_host_is_a_failure_unless_its_process_runs(state, kind):
    loc = _locator(_SilentProbe(states={4242: state}))
    loc.heartbeats = _Beats()
    f = loc.watch(_infos_live(), waiting=[1], step=7)
    if kind is None:
        assert f is None and loc.busy_silences == 1  # busy (its GIL held): it will answer again
    else:
        assert f.kind == kind and (f.slice_id, f.host, f.step) == (1, 0, 7) and loc.busy_silences == 0
        assert "no heartbeat for 1.2 s" in f.cause
        if state is not None:
            assert state in f.cause or kind == FailureKind.PROCESS_DIED


def test_a_replacement_waits_for_its_predecessor_and_kills_one_that_lingers(child):
    started = psutil.Process(child.pid).create_time()
    other = Predecessor(child.pid, started, "another-node")
    gone = wait_gone([other], "this-node")
    assert gone.pids == () and child.poll() is None  # another node's process is not ours to touch
    reused = Predecessor(child.pid, started - 100.0, "this-node")
    assert wait_gone([reused], "this-node").killed == () and child.poll() is None  # the pid names another process now
    t0 = time.monotonic()
    gone = wait_gone([Predecessor(child.pid, started, "this-node")], "this-node", grace_s=0.3)
    assert gone.pids == gone.killed == (child.pid,) and gone.waited_s >= 0.3
    assert time.monotonic() - t0 < 5
    assert proc_state(child.pid) == GONE


def test_a_predecessor_that_exits_within_the_grace_is_not_killed():
    clock = {"t": 0.0}
    running = {"left": 3}

    def is_running(p):
        running["left"] -= 1
        return running["left"] > 0

    def never(pid):
        raise AssertionError("killed a process that was exiting")

    def sleep(s):
        clock["t"] += s

    gone = wait_gone([Predecessor(1, 0.0, "n")], "n", grace_s=2.0, clock=lambda: clock["t"], sleep=sleep,
                     running=is_running, kill=never)
    assert gone.killed == () and gone.pids == (1,) and 0 < gone.waited_s < 2.0

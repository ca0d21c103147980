"""Unit tests for ray_elastic.failures.faults: parsing and the injector (no cluster)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from ray_elastic.failures.faults import FAULT_KINDS, Fault, FaultInjector


def group(*infos):
    return list(infos)


def info(pid, node_id):
    return {"pid": pid, "node_id": node_id}


# parse -------------------------------------------------------------------------


def test_parse_three_parts():
    f = Fault.parse("kill:1:20")
    assert f == Fault(kind="kill", slice_id=1, step=20, host=0)


def test_parse_four_parts():
    f = Fault.parse("stop:0:3:1")
    assert (f.kind, f.slice_id, f.step, f.host) == ("stop", 0, 3, 1)


def test_parse_remove_node():
    assert Fault.parse("remove_node:2:5").kind == "remove_node"


@pytest.mark.parametrize(
    "text",
    [
        "explode:1:2",  # unknown kind
        "KILL:1:2",
        "kill:1",  # too few parts
        "kill",
        "",
        "kill:1:2:3:4",  # too many
        "kill:a:2",  # not an int
        "kill:1:2.5",
        "kill:-1:2",  # negative
        "kill:1:-2",
        "kill:1:2:-1",
    ],
)
def test_parse_invalid(text):
    with pytest.raises(ValueError):
        Fault.parse(text)


def test_fault_kinds():
    assert set(FAULT_KINDS) == {"kill", "remove_node", "stop", "term", "freeze_node", "slow", "corrupt", "gil", "oom"}
    assert Fault("gil", 1, 5, ms=5000).ms == 5000
    with pytest.raises(ValueError, match="ms"):
        Fault("gil", 1, 5)
    with pytest.raises(ValueError, match="fault kind"):
        Fault("nuke", 0, 0)


# injector with remove_node ------------------------------------------------------------


def test_remove_node_needs_callback():
    with pytest.raises(ValueError, match="remove_node"):
        FaultInjector([Fault("remove_node", 0, 1)])
    # kill/stop faults need none
    FaultInjector([Fault("kill", 0, 1), Fault("stop", 1, 1)])


def test_remove_node_fires_once_at_its_step():
    calls = []
    inj = FaultInjector([Fault("remove_node", 1, 5, host=1)], remove_node=calls.append)
    live = {
        0: group(info(100, "n0a"), info(101, "n0b")),
        1: group(info(200, "n1a"), info(201, "n1b")),
    }
    for step in range(5):
        assert inj.fire_due(step, live) == []
    assert calls == []

    before = time.time()
    fired = inj.fire_due(5, live)
    assert calls == ["n1b"]
    assert len(fired) == 1
    f = fired[0]
    assert f.fault == Fault("remove_node", 1, 5, host=1)
    assert (f.pid, f.node_id) == (201, "n1b")
    assert before <= f.at_wall <= time.time()
    assert inj.pending == []
    assert inj.fired == fired
    assert inj.last_for(1) is f
    assert inj.last_for(0) is None

    # never again, even if the same step repeats (e.g. after a restart)
    assert inj.fire_due(5, live) == []
    assert inj.fire_due(6, live) == []
    assert calls == ["n1b"]


def test_faults_for_dead_slices_are_ignored_and_kept():
    calls = []
    inj = FaultInjector([Fault("remove_node", 2, 3)], remove_node=calls.append)
    live = {0: group(info(1, "a")), 1: group(info(2, "b"))}
    assert inj.fire_due(3, live) == []
    assert calls == []
    assert len(inj.pending) == 1
    # once the slice is live at that step, it fires
    live[2] = group(info(3, "c"))
    assert [f.node_id for f in inj.fire_due(3, live)] == ["c"]
    assert calls == ["c"]


def test_several_faults_same_step():
    calls = []
    faults = [Fault("remove_node", 0, 2), Fault("remove_node", 1, 2), Fault("remove_node", 0, 4)]
    inj = FaultInjector(faults, remove_node=calls.append)
    live = {0: group(info(1, "a")), 1: group(info(2, "b"))}
    fired = inj.fire_due(2, live)
    assert sorted(calls) == ["a", "b"]
    assert {f.fault for f in fired} == set(faults[:2])
    assert inj.pending == [faults[2]]
    inj.fire_due(4, live)
    assert calls[-1] == "a" and len(calls) == 3
    assert inj.last_for(0).fault == faults[2]


def test_host_out_of_range_raises():
    inj = FaultInjector([Fault("remove_node", 0, 1, host=3)], remove_node=lambda n: None)
    with pytest.raises(ValueError, match="only 1 hosts"):
        inj.fire_due(1, {0: group(info(1, "a"))})


# kill / stop on our own subprocess ---------------------------------------------------------


def proc_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # the state is the field after the ')' that closes the command name
    return stat.rsplit(")", 1)[1].split()[0]


def wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "30"])
    try:
        yield p
    finally:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
        p.wait(timeout=5)


def test_kill_fault_kills_process(sleeper):
    inj = FaultInjector([Fault("kill", 0, 2)])
    live = {0: group(info(sleeper.pid, "node"))}
    assert inj.fire_due(1, live) == []
    assert sleeper.poll() is None
    fired = inj.fire_due(2, live)
    assert [f.pid for f in fired] == [sleeper.pid]
    assert sleeper.wait(timeout=5) == -signal.SIGKILL


def test_stop_fault_stops_process(sleeper):
    inj = FaultInjector([Fault("stop", 0, 0)])
    live = {0: group(info(sleeper.pid, "node"))}
    assert proc_state(sleeper.pid) in ("S", "R", "D")  # D: a loaded machine's exec still paging in
    inj.fire_due(0, live)
    assert wait_for(lambda: proc_state(sleeper.pid) == "T")
    assert sleeper.poll() is None  # stopped, not dead


def test_freeze_node_fault_calls_its_action_once():
    calls = []
    with pytest.raises(ValueError, match="freeze_node"):
        FaultInjector([Fault("freeze_node", 0, 1)])
    inj = FaultInjector([Fault("freeze_node", 0, 2)], freeze_node=calls.append)
    hosts = {0: [info(7, "n0")]}
    assert inj.fire_due(1, hosts) == [] and calls == []
    assert [f.node_id for f in inj.fire_due(2, hosts)] == ["n0"]
    assert calls == ["n0"] and inj.pending == []

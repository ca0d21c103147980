"""Heartbeats (failures/heartbeats.py) as pure logic: pings sent only while
a slice waits, at most one in flight per host, a host whose ping goes
unanswered for the timeout named hung, and none named while every ping is
answered, however long the step. Plus the `slow` fault's parsing. The real
thing (a SIGSTOPped worker, a frozen node, a slowed slice) runs on a
cluster in tests/test_heartbeats_e2e.py."""

from __future__ import annotations

import types

import pytest

from ray_elastic.errors import ConfigError
from ray_elastic.failures.faults import Fault
from ray_elastic.failures.heartbeats import Heartbeats


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


class _Pings:
    """Sent pings are refs ("ping", worker, n); a worker in `silent` never answers."""

    def __init__(self):
        self.sent, self.silent = [], set()

    def send(self, worker):
        self.sent.append(worker)
        return ("ping", worker, len(self.sent))

    def answered(self, refs):
        return [r for r in refs if r[1] not in self.silent]


def _live(n_slices=2, hosts=2):
    return {s: types.SimpleNamespace(workers=[f"w{s}.{h}" for h in range(hosts)]) for s in range(n_slices)}


def _beats(timeout_s=1.0):
    clock, pings = _Clock(), _Pings()
    return Heartbeats(pings.send, pings.answered, clock, timeout_s=timeout_s, every_s=0.25), clock, pings


def test_pings_go_only_to_waiting_slices():
    beats, clock, pings = _beats()
    live = _live()
    assert beats.quiet(live, {1}, 5) is None
    assert pings.sent == ["w1.0", "w1.1"]  # every host of the waiting slice at once, none of the other
    clock.t = 0.1
    assert beats.quiet(live, {1}, 5) is None and len(pings.sent) == 2  # one in flight per host


def test_one_ping_in_flight_per_host_and_one_per_interval():
    beats, clock, pings = _beats()
    live = _live(1, 1)
    beats.quiet(live, {0}, 5)  # a ping at once
    for t in (0.01, 0.1, 0.2):  # answered at 0.01: the next one is due 0.25 s later
        clock.t = t
        beats.quiet(live, {0}, 5)
    assert len(pings.sent) == 1
    clock.t = 0.3
    beats.quiet(live, {0}, 5)
    assert len(pings.sent) == 2


def test_a_host_that_stops_answering_is_named_after_the_timeout():
    beats, clock, pings = _beats(timeout_s=1.0)
    live = _live()
    beats.quiet(live, {0, 1}, 5)
    pings.silent.add("w1.1")  # SIGSTOPped
    found = None
    while found is None and clock.t < 5:
        clock.t = round(clock.t + 0.25, 2)
        found = beats.quiet(live, {0, 1}, 5)
    s, h, silent_s = found
    assert (s, h) == (1, 1) and silent_s >= 1.0
    assert clock.t <= 1.25  # pinged at 0, unanswered for 1 s: found within a poll after 1 s
    beats.forget(1)
    clock.t += 0.25
    assert beats.quiet(live, {0}, 5) is None  # the others still answer


def test_a_long_step_whose_hosts_answer_is_never_hung():
    beats, clock, pings = _beats(timeout_s=1.0)
    live = _live()
    for i in range(400):  # 100 s of waiting: 20x and more a slow step
        clock.t = i * 0.25
        assert beats.quiet(live, {0, 1}, 5) is None
    assert len(pings.sent) > 100


def test_a_replacement_worker_starts_afresh():
    beats, clock, pings = _beats(timeout_s=1.0)
    live = _live(1, 1)
    pings.silent.add("w0.0")
    beats.quiet(live, {0}, 5)  # a ping to the old worker, never answered
    live[0].workers = ["new0.0"]
    clock.t = 1.5
    assert beats.quiet(live, {0}, 5) is None  # the new handle is not blamed for the old one's ping


def _silent_for(beats, clock, live, step, until_s=30.0):
    """Poll every 0.25 s at `step` until a host is named; (found, time)."""
    found = None
    while found is None and clock.t < until_s:
        clock.t = round(clock.t + 0.25, 2)
        found = beats.quiet(live, {0}, step)
    return found, clock.t


def _first_step_beats():
    clock, pings = _Clock(), _Pings()
    beats = Heartbeats(pings.send, pings.answered, clock, timeout_s=1.0, every_s=0.25, first_timeout_s=15.0)
    return beats, clock, pings


def test_a_new_process_gets_the_first_step_timeout_in_its_first_step():
    """A new process, starved of CPU while it compiles beside its peers,
    is not named at the usual timeout; a frozen one is, at the longer."""
    beats, clock, pings = _first_step_beats()
    live = _live(1, 1)
    beats.started(live, 0)
    beats.quiet(live, {0}, 0)
    pings.silent.add("w0.0")
    found, t = _silent_for(beats, clock, live, 0)
    assert found is not None and found[:2] == (0, 0)
    assert 15.0 <= t <= 15.5 and found[2] >= 15.0


def test_past_its_first_step_a_host_gets_the_usual_timeout():
    beats, clock, pings = _first_step_beats()
    live = _live(1, 1)
    beats.started(live, 3)
    beats.quiet(live, {0}, 3)  # pinged in its first step, answered
    clock.t = 2.0
    beats.started(live, 4)  # the same process: not new
    assert beats.quiet(live, {0}, 4) is None
    pings.silent.add("w0.0")
    start = clock.t
    found, t = _silent_for(beats, clock, live, 4)
    assert found is not None and t - start <= 1.5
    # A replacement (a new process) is in its own first step again.
    beats.forget(0)
    live[0].workers = ["new0.0"]
    pings.silent = {"new0.0"}
    beats.started(live, 9)
    start = clock.t
    found, t = _silent_for(beats, clock, live, 9, until_s=start + 30)
    assert found is not None and t - start >= 15.0


def test_a_host_first_pinged_long_after_its_start_gets_the_usual_timeout():
    """Short steps: no wait outlasts a poll, so a host is first pinged
    many steps after it started, maybe in the very step it froze in."""
    beats, clock, pings = _first_step_beats()
    live = _live(1, 1)
    beats.started(live, 0)
    for k in range(1, 50):  # steps too short to be pinged in
        clock.t += 0.1
        beats.started(live, k)
    pings.silent.add("w0.0")
    start = clock.t
    found, t = _silent_for(beats, clock, live, 49)
    assert found is not None and t - start <= 1.5
    # Likewise a host the heartbeats never saw start (first seen in a wait).
    beats2, clock2, pings2 = _first_step_beats()
    pings2.silent.add("w0.0")
    found, t = _silent_for(beats2, clock2, live, 7)
    assert found is not None and t <= 1.5


def test_a_ping_out_across_the_first_step_boundary_gets_the_usual_timeout_from_then():
    beats, clock, pings = _first_step_beats()
    live = _live(1, 1)
    pings.silent.add("w0.0")
    beats.started(live, 0)
    beats.quiet(live, {0}, 0)
    clock.t = 10.0  # still out, within the first step's timeout
    assert beats.quiet(live, {0}, 0) is None
    clock.t = 10.5  # the next step: counted afresh from here, not from 0
    beats.started(live, 1)
    assert beats.quiet(live, {0}, 1) is None
    clock.t = 11.25
    assert beats.quiet(live, {0}, 1) is None
    clock.t = 11.5
    assert beats.quiet(live, {0}, 1) is not None


def test_without_a_first_step_timeout_every_step_gets_the_usual_one():
    beats, clock, pings = _beats(timeout_s=1.0)
    live = _live(1, 1)
    beats.quiet(live, {0}, 0)
    pings.silent.add("w0.0")
    found, t = _silent_for(beats, clock, live, 0)
    assert found is not None and t <= 1.5


def test_slow_fault_parses_and_needs_its_milliseconds():
    f = Fault.parse("slow:1:20:0:grads:500")
    assert (f.kind, f.slice_id, f.step, f.host, f.phase, f.ms) == ("slow", 1, 20, 0, "grads", 500)
    assert Fault.parse("kill:1:20").ms == 0
    with pytest.raises(ConfigError, match="ms"):
        Fault("slow", 1, 20)
    with pytest.raises(ConfigError, match="ms"):
        Fault("kill", 1, 20, ms=100)
    with pytest.raises(ConfigError, match="MS must be integers"):
        Fault.parse("slow:1:20:0:grads:fast")


def test_a_slice_is_known_once_its_hosts_have_run_a_step_and_a_replacement_is_not():
    """Which slices a recovery's watched waits may watch (location.known):
    those whose hosts were seen in a step; a joining slice's new processes,
    maybe still starting, are left to the call's timeout."""
    beats, clock, pings = _beats()
    live = _live()
    assert not beats.knows(live, 0) and not beats.knows(live, 1)
    beats.started(live, 5)
    assert beats.knows(live, 0) and beats.knows(live, 1)
    live[1] = types.SimpleNamespace(workers=["w1.0", "new.1"])  # host 1 of slice 1 replaced: a new process
    assert beats.knows(live, 0) and not beats.knows(live, 1)
    beats.forget(0)  # found hung
    assert not beats.knows(live, 0)

"""Unit tests (no Ray cluster, no JAX) for in-memory snapshots: when they
are taken (ray_elastic.control.snapshot_schedule: fixed intervals, the
Young-Daly "auto" interval from a measured cost and the all-slices MTBF
estimate), how they are sealed and restored (ray_elastic.checkpoint.
snapshots.SnapshotStore, with a fake `fetch` instead of ray.get), the glue
that emits the `snapshot` event (ray_elastic.control.snapshotting), and the
two settings' validation in ElasticConfig."""

from __future__ import annotations

import math
import threading
import types

import pytest

from ray_elastic.checkpoint.snapshots import SnapshotStore
from ray_elastic.config import ElasticConfig
from ray_elastic.control.snapshot_schedule import PROBE_STEP, SnapshotCost, SnapshotSchedule, young_daly_steps
from ray_elastic.control.snapshotting import Snapshotting
from ray_elastic.errors import ConfigError


@pytest.mark.parametrize("cost, mtbf, step, want", [
    (2.0, 3600.0, 1.0, 120), (2.0, 3600.0, 0.5, 240), (0.7, 3600.0, 1.0, 71),  # sqrt(5040) = 70.99
    (0.0, 3600.0, 1.0, 1), (-5.0, 3600.0, 1.0, 1), (1e-6, 1.0, 100.0, 1),  # never below 1
    (2.0, 3600.0, 0.0, 1), (2.0, 3600.0, -1.0, 1),  # no median step yet
])
def test_young_daly_steps(cost, mtbf, step, want):
    assert young_daly_steps(cost, mtbf, step) == want


def test_fixed_interval_with_two_slices_and_every_one_with_one():
    s = SnapshotSchedule(every_one=3, every_replicated=4, mtbf_s=3600.0)
    assert [k for k in range(1, 13) if s.due(k, 2)] == [4, 8, 12]
    assert [k for k in range(1, 13) if s.due(k, 1)] == [3, 6, 9, 12]
    assert s.interval() == s.gap() == 4


@pytest.mark.parametrize("replicated", [4, "auto"])
def test_every_one_zero_turns_snapshots_off(replicated):
    s = SnapshotSchedule(every_one=0, every_replicated=replicated, mtbf_s=3600.0)
    assert not any(s.due(k, live) for k in range(0, 50) for live in (1, 2, 3))


def warm(s, steps):
    for k in steps:
        assert not s.due(k, 2) and s.step_done(k, 1.0, False) is None, k


def probe(s, snap_s=1.5, next_s=1.2, at=PROBE_STEP):
    """Steps 1..at-1 of 1 s, the probe at `at` (sealing during it), then a step
    of `next_s` with nothing sealing, which closes the measurement."""
    warm(s, range(1, at))
    assert s.due(at, 2)
    s.taken(at)
    assert s.step_done(at, snap_s, True) is None
    assert not s.due(at + 1, 2)  # one is being measured
    return s.step_done(at + 1, next_s, False)


def test_auto_probes_once_then_uses_young_daly():
    s = SnapshotSchedule(every_one=1, every_replicated="auto", mtbf_s=3600.0)
    assert s.interval() == PROBE_STEP  # nothing measured yet
    cost = probe(s)
    assert cost == SnapshotCost(step=PROBE_STEP, step_path_s=0.7, steps=2)
    assert s.median_step_s() == 1.0 and math.isclose(s.cost_s(), 0.7)
    assert s.interval() == young_daly_steps(0.7, 3600.0, 1.0) == 71
    due = [k for k in range(PROBE_STEP + 2, 200) if s.due(k, 2)]
    assert due[0] == PROBE_STEP + 71
    assert s.due(PROBE_STEP + 71, 1)  # one live slice: every_one still rules


def test_auto_probe_counts_from_the_start_step():
    s = SnapshotSchedule(every_one=1, every_replicated="auto", mtbf_s=3600.0, start_step=10)
    assert [k for k in range(10, 10 + PROBE_STEP + 1) if s.due(k, 2)] == [10 + PROBE_STEP]


def test_steps_while_sealing_all_count_and_the_median_ignores_them():
    s = SnapshotSchedule(every_one=1, every_replicated="auto", mtbf_s=3600.0)
    warm(s, range(1, 5))
    s.taken(5)
    for k, d in [(5, 3.0), (6, 2.0), (7, 2.0)]:
        assert s.step_done(k, d, True) is None
    assert s.step_done(8, 1.5, False) == SnapshotCost(5, 4.5, 4)
    assert s.median_step_s() == 1.0  # the slow steps measured the snapshot, not the step


def test_nothing_is_due_while_one_is_measured_even_past_the_interval():
    s = SnapshotSchedule(1, "auto", mtbf_s=1.0)
    probe(s)
    assert s.interval() == 1  # sqrt(2 * 0.7 * 1) = 1.18 steps
    # The probe overlapped two steps: the next comes two steps after it, the
    # gap the event reports, not Young-Daly's one.
    assert s.gap() == 2 and not s.due(6, 2)
    assert s.due(7, 2)
    s.taken(7)
    assert s.step_done(7, 1.0, True) is None
    assert not s.due(8, 2) and not s.due(9, 2)
    assert s.step_done(8, 1.0, False) == SnapshotCost(7, 0.0, 2)
    assert s.due(9, 2)


def test_a_dearer_snapshot_gets_a_longer_interval():
    cheap, dear = (SnapshotSchedule(1, "auto", 3600.0) for _ in range(2))
    probe(cheap, 1.5, 1.2)
    assert probe(dear, 3.0, 1.2).step_path_s == 2.2
    assert dear.interval() == young_daly_steps(2.2, 3600.0, 1.0) == 126
    assert dear.interval() > cheap.interval() == 71


def test_losing_every_slice_lowers_the_mtbf_estimate_and_the_interval():
    s = SnapshotSchedule(1, "auto", 3600.0, now=100.0)
    probe(s)
    before = s.interval()
    s.all_lost(now=500.0)  # 400 s into the run
    assert s.mtbf_s() == (3600.0 + 400.0) / 2
    assert s.interval() == young_daly_steps(0.7, 2000.0, 1.0) == 53 < before
    s.all_lost(now=900.0)
    assert math.isclose(s.mtbf_s(), (3600.0 + 800.0) / 3)
    assert s.interval() < 53


def test_restart_below_the_last_snapshot_moves_the_next_one():
    s = SnapshotSchedule(1, "auto", 3600.0)
    probe(s)  # last = 5, interval 71
    s.restart(50)  # ahead of the last snapshot: nothing moves
    assert not s.due(75, 2) and s.due(76, 2)
    s.restart(3)  # rewound below it
    assert not s.due(73, 2) and s.due(74, 2)


def test_a_snapshot_measured_at_no_cost_is_floored():
    s = SnapshotSchedule(1, "auto", 86400.0)
    warm(s, range(1, 5))
    s.taken(5)
    assert s.step_done(5, 0.8, False) == SnapshotCost(5, 0.0, 1)  # faster than the median: noise, never below 0
    assert math.isclose(s.cost_s(), 0.01)  # 1% of a step
    assert s.interval() == young_daly_steps(0.01, 86400.0, 1.0) == 42


@pytest.mark.parametrize("case", ["restart_mid_measurement", "alone_before_probe"])
def test_auto_probes_again_when_nothing_was_measured(case):
    s = SnapshotSchedule(1, "auto", 3600.0)
    if case == "restart_mid_measurement":  # probe taken, a slice lost before it sealed
        warm(s, range(1, PROBE_STEP))
        s.taken(PROBE_STEP)
        s.step_done(PROBE_STEP, 1.5, True)
        s.restart(PROBE_STEP + 1)
        first = 2 * PROBE_STEP + 1  # a new probe, PROBE_STEP steps after the restart
    else:  # one slice live for a while (snapshots alone), then the replacement joins
        warm(s, range(1, 3))
        assert s.due(3, 1)
        s.taken_alone(3)
        first = PROBE_STEP  # the probe, as planned, once two slices are live
    assert next(k for k in range(first - 3, 500) if s.due(k, 2)) == first


def fake_fetch(gates=None, fail_steps=()):
    """Status refs are ("st", step, slice): fetched into status dicts; any
    other ref (the pinned copy) into ("value", ref)."""
    def fetch(refs, timeout_s):
        if isinstance(refs, list):
            step = refs[0][1]
            if gates and step in gates:
                assert gates[step].wait(5)
            if step in fail_steps:
                raise RuntimeError("worker lost mid-copy")
            return [{"step": r[1], "bytes": 100 + r[2], "views_cpu_s": 0.1} for r in refs]
        return ("value", refs)
    return fetch


def offer_all(store, step, slices, ref=lambda s: f"ref{s}"):
    store.expect(step, len(slices))
    for s in slices:
        store.offer(step, s, ref(s), f"n{s}", done=(("st", step, s),))


def test_two_slice_snapshot_completes_only_when_sealed_and_a_failed_seal_keeps_the_last():
    store = SnapshotStore(fetch=fake_fetch(fail_steps={7}))
    try:
        store.expect(5, 2)
        store.offer(5, 0, "ref0", "n0", done=(("st", 5, 0),))
        assert store.copy_of(5) is None and not store.sealing()  # one copy of two
        store.offer(5, 1, "ref1", "n1", done=(("st", 5, 1),))
        store.wait_sealed(5)
        assert store.latest_step() == 5 and not store.sealing()
        [r] = store.take_records()
        assert (r.step, r.bytes_per_host, r.copies) == (5, 101, 2)
        assert math.isclose(r.views_cpu_s, 0.2) and r.seal_s >= 0
        assert store.take_records() == []
        assert not store.has_pinned_copy
        assert store.restore_source(lambda n: True) == (5, "ref0")
        assert store.restore_source(lambda n: n != "n0") == (5, "ref1")
        assert store.restore_source(lambda n: False) is None  # nothing pinned
        offer_all(store, 7, [0, 1])
        store.wait_sealed(5)
        assert store.latest_step() == 5 and store.take_records() == [] and not store.sealing()
    finally:
        store.close()


def test_a_copy_is_handed_out_while_sealing_and_a_late_older_seal_does_not_win():
    gates = {3: threading.Event()}
    store = SnapshotStore(fetch=fake_fetch(gates))
    try:
        offer_all(store, 3, [0, 1])
        assert store.sealing() and store.latest_step() is None
        assert store.copy_of(3) == "ref0"
        offer_all(store, 4, [0, 1])  # seals at once, while 3 still seals
        store.wait_sealed(0.2)
        assert store.latest_step() == 4
        gates[3].set()
        store.wait_sealed(5)
        assert store.latest_step() == 4 and not store.sealing()
        assert [r.step for r in store.take_records()] == [4]
        assert store.copy_of(4) == "ref0" and store.copy_of(3) is None
    finally:
        gates[3].set()
        store.close()


def test_one_slice_pins_a_copy_unless_sharded():
    store = SnapshotStore(fetch=fake_fetch())
    try:
        offer_all(store, 4, [0])
        store.wait_sealed(5)
        assert store.latest_step() == 4 and store.has_pinned_copy
        assert store.restore_source(lambda n: True) == (4, "ref0")
        assert store.restore_source(lambda n: False) == (4, ("value", "ref0"))
        store.expect(6, 1)  # sharded: a tuple of parts, one per host; never pinned
        store.offer(6, 0, ("p0", "p1"), ["h0", "h1"], done=(("st", 6, 0),))
        store.wait_sealed(5)
        assert store.latest_step() == 6 and not store.has_pinned_copy
        assert store.restore_source(lambda n: True) == (6, ("p0", "p1"))
        assert store.restore_source(lambda n: n != "h1") is None  # one part gone
    finally:
        store.close()


def test_a_closed_store_holds_no_copy_of_the_state():
    """The run is over: a driver that keeps its trainer must not keep its
    snapshots in the object store (the soak counted them after a run)."""
    store = SnapshotStore(fetch=fake_fetch())
    offer_all(store, 4, [0])
    store.wait_sealed(5)
    store.expect(5, 2)  # one taken, not yet offered
    assert store.has_pinned_copy and store.restore_source(lambda n: True) == (4, "ref0")
    store.close()
    assert store.latest_step() is None and not store.has_pinned_copy and not store.sealing()
    assert store.restore_source(lambda n: True) is None and store.copy_of(4) is None and store.copy_of(5) is None
    assert [r.step for r in store.take_records()] == [4]  # the records stay


def test_snapshotting_takes_two_slices_and_emits_one_event_per_measured_snapshot():
    gates = {5: threading.Event()}
    store, events = SnapshotStore(fetch=fake_fetch(gates)), []
    try:
        snap = Snapshotting(ElasticConfig(all_slices_mtbf_s=3600.0), store, lambda step: None,
                            lambda name, **f: events.append((name, f)), now=0.0)
        counts = {"taken": 0}
        real_taken = snap.schedule.taken
        snap.schedule.taken = lambda step: (counts.__setitem__("taken", counts["taken"] + 1), real_taken(step))
        nodes_of = lambda s: [f"n{s}"]  # noqa: E731
        empty = types.SimpleNamespace(snapshots={}, snapshot_status={})
        for k in range(1, PROBE_STEP):
            assert snap.takers(k, {0, 1, 2}) == frozenset()
            snap.step_done(k, empty, 1.0, nodes_of, 5.0)
        assert snap.takers(5, {2, 0, 1}) == frozenset({0, 1})
        assert snap.takers(5, {0, 1, 2}) == frozenset({0, 1}) and counts["taken"] == 1
        result = types.SimpleNamespace(snapshots={0: "ref0", 1: "ref1"},
                                       snapshot_status={s: (("st", 5, s),) for s in (0, 1)})
        snap.step_done(5, result, 1.5, nodes_of, 5.0)  # still sealing
        assert events == [] and snap.takers(6, {0, 1, 2}) == frozenset()
        gates[5].set()
        store.wait_sealed(5)
        snap.step_done(6, empty, 1.2, nodes_of, 5.0)
        [(name, f)] = events
        interval = young_daly_steps(0.7, 3600.0, 1.0)
        assert name == "snapshot" and f == dict(
            step=5, reason="probe", step_path_s=0.7, steps_overlapped=2, bytes_per_host=101, seal_s=f["seal_s"],
            views_cpu_s=0.2, interval=interval, next_at=5 + interval, max_redo_steps=interval + 2, mtbf_s=3600.0)
        assert snap.pin_wait_s == 0.0  # two copies: no pin to wait for
    finally:
        gates[5].set()
        store.close()


@pytest.mark.parametrize("setting, value", [("snapshot_every_replicated", v) for v in ("never", 0, -3, 2.5, True)]
                         + [("all_slices_mtbf_s", v) for v in (0, -1.0, "3600", float("nan"))])
def test_bad_snapshot_settings_name_themselves(setting, value):
    with pytest.raises(ConfigError) as info:
        ElasticConfig(**{setting: value})
    assert info.value.setting == setting and str(info.value).startswith(f"{setting}:")


def test_good_snapshot_settings():
    assert ElasticConfig().snapshot_every_replicated == "auto"
    assert ElasticConfig(snapshot_every_replicated=10).snapshot_every_replicated == 10
    assert ElasticConfig(all_slices_mtbf_s=0.5).all_slices_mtbf_s == 0.5


def test_each_snapshot_says_why_it_was_taken_and_when_the_next_is_due():
    s = SnapshotSchedule(1, "auto", 86400.0)
    warm(s, range(1, 5))
    assert s.reason(4, 2) is None and s.reason(5, 2) == "probe" and s.next_at() is None
    s.taken(5)
    assert s.reason(6, 2) is None  # one is being measured
    s.step_done(5, 1.5, False)
    gap = s.gap()
    assert s.next_at() == 5 + gap
    assert s.reason(5 + gap - 1, 2) is None and s.reason(5 + gap, 2) == "schedule"
    assert s.reason(7, 1) == "schedule"  # one live slice: every `snapshot_every` steps

"""Unit tests (no Ray cluster, no JAX) for state checks
(ray_elastic.control.integrity: comparing the replicas' fingerprints,
naming the odd slice by majority, the retry budget) and for the snapshot
retention they drive (ray_elastic.checkpoint.snapshots.SnapshotStore:
verified_through, restore_source(verified=True), discard_after), with a
fake `fetch` instead of ray.get."""

from __future__ import annotations

import pytest

from ray_elastic.checkpoint.snapshots import SnapshotStore
from ray_elastic import ElasticConfig
from ray_elastic.control.checking import Checks
from ray_elastic.control.integrity import Divergence, StateChecks, spend_retry
from ray_elastic.errors import RunFailed

GOOD, BAD = [11, 11, 11, 11], [11, 99, 11, 11]


def m(fp=None, replicated=True, **extra):
    out = {"loss": 1.0, **extra}
    if fp is not None:
        out["fingerprint"] = list(fp)
        out["replicated"] = replicated
    return out


def test_agreement_verifies_the_step():
    checks = StateChecks(every=5, start_step=3)
    assert checks.verified == 3
    assert checks.check(10, {(0, 0): m(GOOD), (1, 0): m(GOOD), (2, 0): m(GOOD)}) is None
    assert checks.verified == 10
    assert checks.check(15, {(0, 0): m(GOOD), (1, 0): m(GOOD)}) is None
    assert checks.verified == 15


def test_three_slices_one_odd_is_named():
    checks = StateChecks(every=5, start_step=10)
    other = [12, 12, 12, 12]
    found = checks.check(15, {(0, 0): m(GOOD), (1, 0): m(other), (2, 0): m(GOOD)})
    assert isinstance(found, Divergence)
    assert found.step == 15 and found.named == ((1, 0),) and found.verified == 10
    assert "slice 1 host 0" in found.detail and "2 of 3" in found.detail
    assert checks.verified == 10  # not verified


def test_two_slices_that_differ_are_found_but_not_named():
    checks = StateChecks(every=5)
    assert checks.check(5, {(0, 0): m(GOOD), (1, 0): m(GOOD)}) is None
    found = checks.check(10, {(0, 0): m(GOOD), (1, 0): m([12, 12, 12, 12])})
    assert found is not None and found.named == () and found.step == 10
    assert "no majority" in found.detail
    assert found.verified == 5 and checks.verified == 5


def test_a_three_way_split_names_no_slice():
    checks = StateChecks(every=1)
    found = checks.check(1, {(0, 0): m([1] * 4), (1, 0): m([2] * 4), (2, 0): m([3] * 4)})
    assert found is not None and found.named == () and "no majority" in found.detail
    assert checks.verified == 0


def test_a_replicated_host_whose_devices_disagree_names_itself_even_with_two_slices():
    checks = StateChecks(every=1, start_step=4)
    found = checks.check(6, {(0, 0): m(GOOD), (1, 0): m(BAD)})
    assert found is not None
    assert (1, 0) in found.named and (0, 0) not in found.named
    assert "slice 1 host 0" in found.detail and "different bits" in found.detail
    assert found.verified == 4 and checks.verified == 4


def test_a_replicated_host_whose_devices_disagree_is_named_with_three_slices():
    checks = StateChecks(every=1)
    found = checks.check(2, {(0, 0): m(GOOD), (1, 0): m(GOOD), (2, 0): m(BAD)})
    assert found is not None and found.named == ((2, 0),)


def test_sharded_per_device_prints_may_differ():
    checks = StateChecks(every=1)
    shards = [1, 2, 3, 4]
    metrics = {(0, 0): m(shards, replicated=False), (1, 0): m(shards, replicated=False)}
    assert checks.check(7, metrics) is None and checks.verified == 7
    # Without the flag a host's devices are not compared with each other either.
    assert checks.check(8, {(0, 0): {"fingerprint": shards}, (1, 0): {"fingerprint": shards}}) is None
    assert checks.verified == 8
    # But the same device of another slice must match.
    found = checks.check(9, {(0, 0): m(shards, replicated=False), (1, 0): m([1, 2, 3, 5], replicated=False),
                             (2, 0): m(shards, replicated=False)})
    assert found is not None and found.named == ((1, 0),) and checks.verified == 8


def test_multi_host_slices_are_compared_host_by_host():
    checks = StateChecks(every=1)
    h0, h1 = [1, 2], [3, 4]  # the hosts of a slice hold different shards
    sharded = lambda fp: m(fp, replicated=False)  # noqa: E731
    ok = {(s, h): sharded(h0 if h == 0 else h1) for s in range(3) for h in range(2)}
    assert checks.check(3, ok) is None and checks.verified == 3
    bad = {**ok, (2, 1): sharded([3, 5])}
    found = checks.check(4, bad)
    assert found is not None and found.named == ((2, 1),) and "slice 2 host 1" in found.detail
    assert checks.verified == 3
    # Two slices of two hosts: host 1 differs (unnamed), host 0 agrees.
    two = {(s, h): sharded(h0 if h == 0 else h1) for s in range(2) for h in range(2)}
    found = checks.check(5, {**two, (1, 1): sharded([3, 5])})
    assert found is not None and found.named == ()
    assert found.detail == "host 1: no majority among slices [0, 1]"  # host 0 agreed


def test_no_fingerprints_is_no_check():
    checks = StateChecks(every=5, start_step=2)
    assert checks.check(5, {}) is None
    assert checks.check(6, {(0, 0): m(), (1, 0): m()}) is None
    assert checks.verified == 2
    # Hosts without a print are left out of the comparison.
    assert checks.check(10, {(0, 0): m(GOOD), (1, 0): m()}) is None
    assert checks.verified == 10


def test_restart_resets_the_verified_step():
    checks = StateChecks(every=1)
    assert checks.check(8, {(0, 0): m(GOOD), (1, 0): m(GOOD)}) is None
    checks.restart(4)
    assert checks.verified == 4
    found = checks.check(5, {(0, 0): m(GOOD), (1, 0): m([1] * 4)})
    assert found is not None and found.verified == 4


def test_spend_retry_counts_and_then_fails_naming_max_retries():
    found = Divergence(step=12, named=(), verified=10, detail="host 0: no majority among slices [0, 1]")
    assert spend_retry(found, 0, 2) == 1
    assert spend_retry(found, 1, 2) == 2
    with pytest.raises(RunFailed) as err:
        spend_retry(found, 2, 2)
    assert err.value.setting == "max_retries"
    assert "step 12" in str(err.value) and "no majority" in str(err.value)
    with pytest.raises(RunFailed):
        spend_retry(found, 5, 2)
    with pytest.raises(RunFailed):
        spend_retry(found, 0, 0)


# --- SnapshotStore retention -------------------------------------------------

def fetch(refs, timeout_s):
    """Statuses (a list of refs) into status dicts; any other ref (a pinned copy) into ("value", ref)."""
    if isinstance(refs, list):
        return [{"bytes": 1} for _ in refs]
    return ("value", refs)


def take(store, step, slices=(0, 1)):
    """A snapshot of `step` copied by two slices, sealed at once (no statuses to wait on, nothing pinned)."""
    store.expect(step, len(slices))
    for s in slices:
        store.offer(step, s, f"ref{s}@{step}", f"n{s}", done=())


def kept(store):
    return [p.step for p in store._kept]


@pytest.fixture
def store():
    s = SnapshotStore(fetch=fetch)
    yield s
    s.close()


def alive(n):
    return True


def test_without_checks_only_the_newest_snapshot_is_kept(store):
    for step in (2, 4, 6):
        take(store, step)
        assert store.latest_step() == step and kept(store) == [step]
    assert store.restore_source(alive) == (6, "ref0@6")
    assert store.restore_source(alive, verified=True) == (6, "ref0@6")  # every snapshot counts as verified


def test_verified_snapshots_are_kept_until_a_newer_one_is_verified(store):
    store.verified_through(0)
    for step in (2, 4, 6, 8):
        take(store, step)
    assert kept(store) == [2, 4, 6, 8]  # none verified yet: all kept
    store.verified_through(5)
    assert kept(store) == [4, 6, 8]  # the newest with step <= 5, and every newer one
    assert store.restore_source(alive, verified=True) == (4, "ref0@4")
    assert store.restore_source(alive) == (8, "ref0@8")
    assert store.latest_step() == 8
    store.verified_through(6)
    assert kept(store) == [6, 8]
    assert store.restore_source(alive, verified=True) == (6, "ref0@6")
    take(store, 10)
    assert kept(store) == [6, 8, 10]
    store.verified_through(10)
    assert kept(store) == [10]
    assert store.restore_source(alive, verified=True) == store.restore_source(alive) == (10, "ref0@10")


def test_restore_source_verified_takes_a_live_copy(store):
    store.verified_through(0)
    take(store, 2)
    take(store, 4)
    store.verified_through(3)
    assert store.restore_source(lambda n: n != "n0", verified=True) == (2, "ref1@2")
    assert store.restore_source(lambda n: False, verified=True) is None  # no live copy, nothing pinned


def test_discard_after_drops_newer_snapshots(store):
    store.verified_through(0)
    for step in (2, 4, 6, 8):
        take(store, step)
    store.verified_through(4)
    assert kept(store) == [4, 6, 8]
    store.discard_after(4)
    assert kept(store) == [4]
    assert store.latest_step() == 4
    assert store.restore_source(alive) == store.restore_source(alive, verified=True) == (4, "ref0@4")
    # The run goes on from 4: a new snapshot follows it.
    take(store, 6)
    assert kept(store) == [4, 6] and store.restore_source(alive) == (6, "ref0@6")


def test_discard_after_a_step_before_every_snapshot_drops_them_all(store):
    store.verified_through(0)
    take(store, 3)
    take(store, 5)
    store.discard_after(1)
    assert kept(store) == [] and store.latest_step() is None
    assert store.restore_source(alive) is None and store.restore_source(alive, verified=True) is None


def test_with_none_verified_restore_source_verified_is_none(store):
    store.verified_through(0)
    take(store, 2)
    take(store, 4)
    assert store.restore_source(alive, verified=True) is None
    assert store.restore_source(alive) == (4, "ref0@4")
    store.verified_through(1)
    assert store.restore_source(alive, verified=True) is None
    assert kept(store) == [2, 4]


def test_an_empty_store_has_no_restore_source(store):
    assert store.restore_source(alive) is None
    assert store.restore_source(alive, verified=True) is None
    store.verified_through(3)
    assert store.restore_source(alive, verified=True) is None


# --- Checks.after_step (control/checking.py) / timing (drive the store) ------

def _checks(state_every: int, events=None) -> Checks:
    config = ElasticConfig(num_slices=2, state_check_every=state_every, grad_check_every=0)
    return Checks(config, lambda name, **f: (events if events is not None else []).append((name, f)))


def test_after_step_with_checks_off_verifies_every_step(store):
    checks = _checks(0)
    for step in (2, 4):
        take(store, step)
        # Even differing prints are not compared with checks off.
        assert checks.after_step(step, {(0, 0): m(GOOD), (1, 0): m([1] * 4)}, store) is None
    assert kept(store) == [4]
    assert store.restore_source(alive, verified=True) == (4, "ref0@4")


def test_after_step_keeps_snapshots_until_a_check_agrees(store):
    events: list = []
    checks = _checks(4, events)
    plain = {(0, 0): m(), (1, 0): m()}
    agree = {(0, 0): m(GOOD), (1, 0): m(GOOD)}
    assert checks.after_step(1, plain, store) is None  # verified_through(0): the start
    take(store, 2)
    assert checks.after_step(2, plain, store) is None
    assert checks.after_step(3, plain, store) is None
    assert kept(store) == [2] and store.restore_source(alive, verified=True) is None
    assert checks.after_step(4, agree, store) is None
    assert checks.state.verified == 4 and store.restore_source(alive, verified=True) == (2, "ref0@2")
    take(store, 6)
    found = checks.after_step(8, {(0, 0): m(GOOD), (1, 0): m([1] * 4)}, store)
    assert found is not None and found.verified == 4 and found.named == ()
    assert [name for name, _ in events] == ["diverged"] and events[0][1]["step"] == 8
    assert kept(store) == [2, 6]
    assert store.restore_source(alive, verified=True) == (2, "ref0@2")  # 6 may hold the corrupted state
    assert store.restore_source(alive) == (6, "ref0@6")


def test_timing_is_the_slowest_host_s_fingerprint_seconds():
    assert StateChecks.timing({(0, 0): {"fingerprint_s": 0.5}, (1, 0): {"fingerprint_s": 1.5}, (2, 0): {}}) == {
        "check_s": 1.5}
    assert StateChecks.timing({(0, 0): {"loss": 1.0}}) == {}
    assert StateChecks.timing({}) == {}

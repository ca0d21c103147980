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
from ray_elastic.control.stragglers import Straggler, Stragglers
from ray_elastic.control.integrity import Divergence, StateChecks, spend_retry
from ray_elastic.errors import ConfigError, RunFailed

GOOD, BAD = [11, 11, 11, 11], [11, 99, 11, 11]


def m(fp=None, replicated=True, at=None, **extra):
    """A host's apply metrics; with `fp`, its fingerprint of the state of
    step `at` (for `check` below, which says the step, when None)."""
    out = {"loss": 1.0, **extra}
    if fp is not None:
        out.update({"fingerprint": list(fp)} if at is None else {"fingerprints": {at: list(fp)}})
        out["replicated"] = replicated
    return out


def check(checks, step, metrics):
    """`checks.check` on metrics whose hosts report their fingerprint
    ("fingerprint" in `metrics`) of the state of `step`."""
    return checks.check({key: {**{k: v for k, v in mm.items() if k != "fingerprint"},
                               **({"fingerprints": {step: mm["fingerprint"]}} if "fingerprint" in mm else {})}
                         for key, mm in metrics.items()})


def test_agreement_verifies_the_step():
    checks = StateChecks(every=5, start_step=3)
    assert checks.verified == 3
    assert check(checks, 10, {(0, 0): m(GOOD), (1, 0): m(GOOD), (2, 0): m(GOOD)}) is None
    assert checks.verified == 10
    assert check(checks, 15, {(0, 0): m(GOOD), (1, 0): m(GOOD)}) is None
    assert checks.verified == 15


def test_three_slices_one_odd_is_named():
    checks = StateChecks(every=5, start_step=10)
    other = [12, 12, 12, 12]
    found = check(checks, 15, {(0, 0): m(GOOD), (1, 0): m(other), (2, 0): m(GOOD)})
    assert isinstance(found, Divergence)
    assert found.step == 15 and found.named == ((1, 0),) and found.verified == 10
    assert "slice 1 host 0" in found.detail and "2 of 3" in found.detail
    assert checks.verified == 10  # not verified


def test_two_slices_that_differ_are_found_but_not_named():
    checks = StateChecks(every=5)
    assert check(checks, 5, {(0, 0): m(GOOD), (1, 0): m(GOOD)}) is None
    found = check(checks, 10, {(0, 0): m(GOOD), (1, 0): m([12, 12, 12, 12])})
    assert found is not None and found.named == () and found.step == 10
    assert "no majority" in found.detail
    assert found.verified == 5 and checks.verified == 5


def test_a_three_way_split_names_no_slice():
    checks = StateChecks(every=1)
    found = check(checks, 1, {(0, 0): m([1] * 4), (1, 0): m([2] * 4), (2, 0): m([3] * 4)})
    assert found is not None and found.named == () and "no majority" in found.detail
    assert checks.verified == 0


def test_a_replicated_host_whose_devices_disagree_names_itself_even_with_two_slices():
    checks = StateChecks(every=1, start_step=4)
    found = check(checks, 6, {(0, 0): m(GOOD), (1, 0): m(BAD)})
    assert found is not None
    assert (1, 0) in found.named and (0, 0) not in found.named
    assert "slice 1 host 0" in found.detail and "different bits" in found.detail
    assert found.verified == 4 and checks.verified == 4
    # Its prints are what differ from slice 0's: named, with nothing left
    # unsettled (no "no majority" beside it), on the host it named.
    assert found.named == ((1, 0),) and found.detail == "slice 1 host 0: its devices hold different bits"


def test_a_slice_that_named_itself_is_left_out_of_its_hosts_vote():
    odd = [12, 12, 12, 12]
    # Of the other three, two agree: the third is named too, by majority.
    found = check(StateChecks(every=1), 3, {(0, 0): m(GOOD), (1, 0): m(GOOD), (2, 0): m(odd), (3, 0): m(BAD)})
    assert found.named == ((2, 0), (3, 0)) and "slice 2 host 0 differs from 2 of 3 slices" in found.detail
    # The two others differ: no majority among them.
    found = check(StateChecks(every=1), 3, {(0, 0): m(GOOD), (1, 0): m(odd), (2, 0): m(BAD)})
    assert found.named == ((2, 0),) and found.detail.endswith("host 0: no majority among slices [0, 1]")
    # Every slice named itself: none is left to vote.
    found = check(StateChecks(every=1), 3, {(0, 0): m(BAD), (1, 0): m([11, 11, 99, 11])})
    assert found.named == ((0, 0), (1, 0))


def test_a_replicated_host_whose_devices_disagree_is_named_with_three_slices():
    checks = StateChecks(every=1)
    found = check(checks, 2, {(0, 0): m(GOOD), (1, 0): m(GOOD), (2, 0): m(BAD)})
    assert found is not None and found.named == ((2, 0),)


def test_sharded_per_device_prints_may_differ():
    checks = StateChecks(every=1)
    shards = [1, 2, 3, 4]
    metrics = {(0, 0): m(shards, replicated=False), (1, 0): m(shards, replicated=False)}
    assert check(checks, 7, metrics) is None and checks.verified == 7
    # Without the flag a host's devices are not compared with each other either.
    assert check(checks, 8, {(0, 0): {"fingerprint": shards}, (1, 0): {"fingerprint": shards}}) is None
    assert checks.verified == 8
    # But the same device of another slice must match.
    found = check(checks, 9, {(0, 0): m(shards, replicated=False), (1, 0): m([1, 2, 3, 5], replicated=False),
                             (2, 0): m(shards, replicated=False)})
    assert found is not None and found.named == ((1, 0),) and checks.verified == 8


def test_multi_host_slices_are_compared_host_by_host():
    checks = StateChecks(every=1)
    h0, h1 = [1, 2], [3, 4]  # the hosts of a slice hold different shards
    sharded = lambda fp: m(fp, replicated=False)  # noqa: E731
    ok = {(s, h): sharded(h0 if h == 0 else h1) for s in range(3) for h in range(2)}
    assert check(checks, 3, ok) is None and checks.verified == 3
    bad = {**ok, (2, 1): sharded([3, 5])}
    found = check(checks, 4, bad)
    assert found is not None and found.named == ((2, 1),) and "slice 2 host 1" in found.detail
    assert checks.verified == 3
    # Two slices of two hosts: host 1 differs (unnamed), host 0 agrees.
    two = {(s, h): sharded(h0 if h == 0 else h1) for s in range(2) for h in range(2)}
    found = check(checks, 5, {**two, (1, 1): sharded([3, 5])})
    assert found is not None and found.named == ()
    assert found.detail == "host 1: no majority among slices [0, 1]"  # host 0 agreed


def test_no_fingerprints_is_no_check():
    checks = StateChecks(every=5, start_step=2)
    assert check(checks, 5, {}) is None
    assert check(checks, 6, {(0, 0): m(), (1, 0): m()}) is None
    assert checks.verified == 2
    # Hosts without a print are left out of the comparison.
    assert check(checks, 10, {(0, 0): m(GOOD), (1, 0): m()}) is None
    assert checks.verified == 10


def test_restart_resets_the_verified_step():
    checks = StateChecks(every=1)
    assert check(checks, 8, {(0, 0): m(GOOD), (1, 0): m(GOOD)}) is None
    checks.restart(4)
    assert checks.verified == 4
    found = check(checks, 5, {(0, 0): m(GOOD), (1, 0): m([1] * 4)})
    assert found is not None and found.verified == 4


def test_each_state_step_reported_is_compared_oldest_first():
    checks = StateChecks(every=1, start_step=3)
    # The run's last apply reports the state it started from and its new one.
    both = {(s, 0): m(fingerprints={4: GOOD, 5: GOOD}) for s in range(3)}
    assert checks.check(both) is None and checks.verified == 5
    checks = StateChecks(every=1, start_step=3)
    bad = {**both, (1, 0): m(fingerprints={4: [12] * 4, 5: [13] * 4})}
    found = checks.check(bad)
    assert found.step == 4 and found.named == ((1, 0),) and found.verified == 3
    assert found.failure().step == 3  # the apply of step 3 made the state of step 4
    # A host that reports no print of a state (it loaded it) is left out of that comparison.
    checks = StateChecks(every=1, start_step=3)
    partial = {(0, 0): m(fingerprints={4: GOOD}), (1, 0): m(fingerprints={4: GOOD}), (2, 0): m()}
    assert checks.check(partial) is None and checks.verified == 4


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


def test_restore_source_at_most_a_step_and_at_most_four_kept(store):
    """A rollback asks for the newest snapshot of its divergence's verified
    step or older; snapshots nothing verifies are kept four at most."""
    store.verified_through(0)
    for step in (2, 4, 6, 8, 10):
        take(store, step)
    assert kept(store) == [4, 6, 8, 10]  # the oldest unverified one dropped: memory is bounded
    assert store.restore_source(alive, at_most=7) == (6, "ref0@6")
    assert store.restore_source(alive, at_most=3) is None
    store.verified_through(9)
    assert kept(store) == [8, 10]
    assert store.restore_source(alive, verified=True, at_most=9) == (8, "ref0@8")
    assert store.restore_source(alive, verified=True, at_most=5) is None  # 4 went once 8 was verified


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
        assert checks.after_step(step, {(0, 0): m(GOOD, at=step), (1, 0): m([1] * 4, at=step)}, store) is None
    assert kept(store) == [4]
    assert store.restore_source(alive, verified=True) == (4, "ref0@4")


def test_after_step_keeps_snapshots_until_a_check_agrees(store):
    events: list = []
    checks = _checks(4, events)
    plain = {(0, 0): m(), (1, 0): m()}
    agree = {(0, 0): m(GOOD, at=4), (1, 0): m(GOOD, at=4)}
    assert checks.after_step(1, plain, store) is None  # verified_through(0): the start
    take(store, 2)
    assert checks.after_step(2, plain, store) is None
    assert checks.after_step(3, plain, store) is None
    assert kept(store) == [2] and store.restore_source(alive, verified=True) is None
    assert checks.after_step(5, agree, store) is None  # the state of step 4, reported by the next apply
    assert checks.state.verified == 4 and store.restore_source(alive, verified=True) == (2, "ref0@2")
    take(store, 6)
    found = checks.after_step(9, {(0, 0): m(GOOD, at=8), (1, 0): m([1] * 4, at=8)}, store)
    assert found is not None and found.verified == 4 and found.named == ()
    assert [name for name, _ in events] == ["diverged"] and events[0][1]["step"] == 8
    assert kept(store) == [2, 6]
    assert store.restore_source(alive, verified=True) == (2, "ref0@2")  # 6 may hold the corrupted state
    assert store.restore_source(alive) == (6, "ref0@6")


def test_timing_is_the_slowest_host_s_fingerprint_seconds():
    assert StateChecks.timing({(0, 0): {"fingerprint_s": 0.5, "fingerprint_wait_s": 0.25},
                               (1, 0): {"fingerprint_s": 1.5, "fingerprint_wait_s": 0.0}, (2, 0): {}}) == {
        "check_s": 1.5, "check_wait_s": 0.25}
    assert StateChecks.timing({(0, 0): {"loss": 1.0}}) == {}
    assert StateChecks.timing({}) == {}


# --- Gradient cross-checks (GradChecks: plan / judge / floor / restart) -------

from ray_elastic.control import checking as _checking  # noqa: E402
from ray_elastic.control.integrity import CrossCheck, GradChecks  # noqa: E402


def _assign(live, shards_per_slice=1):
    """slice -> its shards (slice s owns shards 10*s, 10*s + 1, ...)."""
    return {s: tuple(10 * s + k for k in range(shards_per_slice)) for s in live}


def _plans(checks, live, steps):
    return [(c.owner, c.checkers) for c in (checks.plan(step, live, _assign(live)) for step in steps)]


def test_grad_plan_rotates_owner_and_single_checker_with_two_live_slices():
    checks = GradChecks(every=5)
    assert _plans(checks, [0, 1], (5, 10, 15, 20)) == [(0, (1,)), (1, (0,)), (0, (1,)), (1, (0,))]


def test_grad_plan_rotates_owner_and_two_checkers_with_three_live_slices():
    checks = GradChecks(every=5)
    plans = [checks.plan(step, [2, 0, 1], _assign([0, 1, 2])) for step in (5, 10, 15, 20)]  # live gets sorted
    assert [(c.step, c.owner, c.shard, c.checkers) for c in plans] == [
        (5, 0, 0, (1, 2)), (10, 1, 10, (2, 0)), (15, 2, 20, (0, 1)), (20, 0, 0, (1, 2))]
    assert all(isinstance(c, CrossCheck) for c in plans)


def test_grad_plan_rotates_with_four_live_slices_and_takes_the_owner_s_first_shard():
    checks = GradChecks(every=3)
    live = [3, 1, 0, 2]
    plans = [checks.plan(step, live, _assign(live, shards_per_slice=2)) for step in (3, 6, 9, 12, 15)]
    assert [(c.owner, c.shard, c.checkers) for c in plans] == [
        (0, 0, (1, 2)), (1, 10, (2, 3)), (2, 20, (3, 0)), (3, 30, (0, 1)), (0, 0, (1, 2))]


def test_grad_plan_uses_the_live_slices_ids_not_positions():
    checks = GradChecks(every=1)
    assert _plans(checks, [7, 3, 5], (1, 2, 3)) == [(3, (5, 7)), (5, (7, 3)), (7, (3, 5))]


def test_grad_plan_is_not_due_off_schedule_and_does_not_advance_the_rotation():
    checks = GradChecks(every=5)
    live = [0, 1, 2]
    assert not checks.due(0) and not checks.due(3) and checks.due(5) and checks.due(10) and not checks.due(11)
    for step in (0, 1, 4, 6, 9):
        assert checks.plan(step, live, _assign(live)) is None
    assert checks.plan(5, live, _assign(live)).owner == 0  # the skipped steps did not move the rotation
    assert checks.plan(10, [0], _assign([0])) is None  # one live slice: nothing to compare with
    assert checks.plan(10, [], {}) is None
    assert checks.plan(10, live, _assign(live)).owner == 1  # nor did the plans with too few slices


def test_grad_plan_with_every_zero_is_never_due():
    checks = GradChecks(every=0)
    for step in (0, 1, 5, 50, 100):
        assert not checks.due(step)
        assert checks.plan(step, [0, 1, 2], _assign([0, 1, 2])) is None


def test_grad_plan_owner_without_shards_is_no_check_and_the_rotation_moves_on():
    checks = GradChecks(every=1)
    live = [0, 1, 2]
    assign = {0: (), 1: (10,), 2: (20,)}
    assert checks.plan(1, live, assign) is None  # slice 0's turn, it holds no shard
    assert checks.plan(2, live, {1: (10,), 2: (20,)}) == CrossCheck(2, 1, 10, (2, 0))  # missing entry too
    assert checks.plan(3, live, {0: (0,), 1: (10,)}) is None  # slice 2 not in the assignment
    assert checks.plan(4, live, assign) is None  # slice 0 again


def test_grad_judge_all_agree_marks_every_compared_slice_clean():
    checks = GradChecks(every=10)
    live = [0, 1, 2]
    assert checks.floor(live) == 0 and checks.clean(1) == 0
    check = CrossCheck(10, 0, 0, (1, 2))
    assert checks.judge(check, {0: {0: 5}, 1: {0: 5}, 2: {0: 5}}) is None
    assert [checks.clean(s) for s in live] == [10, 10, 10] and checks.floor(live) == 10
    assert checks.floor([0, 1, 2, 3]) == 0  # slice 3 never checked: the start
    assert checks.floor([]) == 0
    # An older check judged late does not move a clean step back.
    assert checks.judge(CrossCheck(5, 1, 10, (2, 0)), {1: {0: 3}, 2: {0: 3}, 0: {0: 3}}) is None
    assert checks.floor(live) == 10


def test_grad_judge_three_computations_one_odd_owner_is_named():
    checks = GradChecks(every=10)
    assert checks.judge(CrossCheck(10, 0, 0, (1, 2)), {0: {0: 5}, 1: {0: 5}, 2: {0: 5}}) is None
    found = checks.judge(CrossCheck(20, 1, 10, (2, 0)), {1: {0: 7}, 2: {0: 5}, 0: {0: 5}})
    assert isinstance(found, Divergence)
    assert found.step == 21 and found.named == ((1, 0),) and found.verified == 10
    assert "slice(s) [1]" in found.detail and "2 of 3" in found.detail
    assert "shard 10" in found.detail and "step 20" in found.detail
    assert [checks.clean(s) for s in (0, 1, 2)] == [10, 10, 10]  # a divergence marks no one clean


def test_grad_judge_odd_checker_is_named_with_its_own_clean_step():
    checks = GradChecks(every=5, start_step=3)
    # Slice 2 was last clean at 5 (with 0); slice 1 never: the start.
    assert checks.judge(CrossCheck(5, 0, 0, (2,)), {0: {0: 1}, 2: {0: 1}}) is None
    found = checks.judge(CrossCheck(10, 0, 0, (1, 2)), {0: {0: 4}, 1: {0: 4}, 2: {0: 9}})
    assert found.named == ((2, 0),) and found.verified == 5 and found.step == 11
    found = checks.judge(CrossCheck(10, 0, 0, (1, 2)), {0: {0: 4}, 1: {0: 8}, 2: {0: 4}})
    assert found.named == ((1, 0),) and found.verified == 3


def test_grad_judge_two_computations_that_differ_name_no_one():
    checks = GradChecks(every=5)
    assert checks.judge(CrossCheck(5, 0, 0, (1,)), {0: {0: 2}, 1: {0: 2}}) is None
    found = checks.judge(CrossCheck(10, 1, 10, (0,)), {1: {0: 2}, 0: {0: 3}})
    assert found is not None and found.named == () and found.step == 11 and found.verified == 5
    assert "no majority among slices [0, 1]" in found.detail
    assert checks.clean(0) == checks.clean(1) == 5


def test_grad_judge_three_way_split_names_no_one_and_verified_is_the_oldest_clean():
    checks = GradChecks(every=5)
    checks.judge(CrossCheck(5, 0, 0, (1,)), {0: {0: 1}, 1: {0: 1}})  # 0 and 1 clean at 5; 2 at the start
    found = checks.judge(CrossCheck(10, 0, 0, (1, 2)), {0: {0: 1}, 1: {0: 2}, 2: {0: 3}})
    assert found.named == () and "no majority among slices [0, 1, 2]" in found.detail and found.verified == 0


def test_grad_judge_a_missed_checker_leaves_two_to_compare():
    checks = GradChecks(every=5)
    check = CrossCheck(5, 0, 0, (1, 2))
    assert checks.judge(check, {0: {0: 5}, 1: None, 2: {0: 5}}) is None
    assert (checks.clean(0), checks.clean(1), checks.clean(2)) == (5, 0, 5)  # the missed one is not clean
    assert checks.floor([0, 1, 2]) == 0 and checks.floor([0, 2]) == 5
    found = checks.judge(CrossCheck(10, 0, 0, (1, 2)), {0: {0: 5}, 1: {}, 2: {0: 6}})  # {}: missed too
    assert found is not None and found.named == () and "no majority among slices [0, 2]" in found.detail
    assert found.verified == 5


def test_grad_judge_with_fewer_than_two_prints_is_no_check():
    checks = GradChecks(every=5, start_step=2)
    check = CrossCheck(5, 0, 0, (1, 2))
    assert checks.judge(check, {0: {0: 5}, 1: None, 2: None}) is None
    assert checks.judge(check, {0: {0: 5}}) is None
    assert checks.judge(check, {0: None, 1: {0: 9}, 2: {}}) is None
    assert checks.judge(check, {}) is None
    assert [checks.clean(s) for s in (0, 1, 2)] == [2, 2, 2] and checks.floor([0, 1, 2]) == 2


def test_grad_judge_multi_host_prints_are_compared_as_a_whole_naming_the_differing_host():
    checks = GradChecks(every=1)
    check = CrossCheck(1, 0, 0, (1, 2))
    good = {0: 1, 1: 2}
    assert checks.judge(check, {0: dict(good), 1: {1: 2, 0: 1}, 2: dict(good)}) is None  # host order is moot
    assert checks.floor([0, 1, 2]) == 1
    found = checks.judge(CrossCheck(2, 1, 10, (2, 0)), {1: dict(good), 2: {0: 1, 1: 3}, 0: dict(good)})
    assert found.named == ((2, 1),) and found.verified == 1
    found = checks.judge(CrossCheck(3, 2, 20, (0, 1)), {2: dict(good), 0: {0: 7, 1: 8}, 1: dict(good)})
    assert found.named == ((0, 0),)  # the first host that differs
    # Two slices whose host 1 differs: the whole print differs, no majority.
    found = checks.judge(CrossCheck(4, 0, 0, (1,)), {0: dict(good), 1: {0: 1, 1: 9}})
    assert found.named == () and "no majority" in found.detail


def test_grad_restart_clamps_clean_steps():
    checks = GradChecks(every=5)
    live = [0, 1, 2]
    checks.judge(CrossCheck(20, 0, 0, (1, 2)), {s: {0: 1} for s in live})
    assert checks.floor(live) == 20
    checks.restart(15)
    assert [checks.clean(s) for s in live] == [15, 15, 15] and checks.floor(live) == 15
    checks.restart(25)  # a later step does not raise them
    assert checks.floor(live) == 15
    assert checks.clean(3) == 0 and checks.floor(live + [3]) == 0  # a warm restart keeps the start


def test_grad_warm_restart_before_the_start_lowers_it():
    checks = GradChecks(every=5, start_step=10)
    checks.restart(4)
    assert checks.clean(0) == 4 and checks.floor([0, 1]) == 4


def test_grad_cold_restart_sets_the_start():
    checks = GradChecks(every=5)
    checks.restart(30, cold=True)
    assert checks.clean(0) == 30 and checks.floor([0, 1, 2]) == 30
    checks.judge(CrossCheck(40, 0, 0, (1, 2)), {s: {0: 1} for s in (0, 1, 2)})
    assert checks.floor([0, 1, 2]) == 40
    checks.restart(35, cold=True)
    assert checks.floor([0, 1, 2]) == 35 and checks.clean(9) == 35
    found = checks.judge(CrossCheck(40, 1, 10, (0,)), {1: {0: 1}, 0: {0: 2}})
    assert found.verified == 35


def test_grad_judge_odd_slice_missing_a_host_is_named_not_a_crash():
    checks = GradChecks(every=1)
    found = checks.judge(CrossCheck(1, 0, 0, (1, 2)), {0: {0: 5, 1: 6}, 1: {0: 5, 1: 6}, 2: {0: 5}})
    assert found is not None and [s for s, _ in found.named] == [2]


# --- Checks: issue / after_step with a fake backend ---------------------------

class FakeBackend:
    """recompute -> one token per host; fetch -> the prints set for those tokens
    (a slice in `lost` raises, as a lost checker's ray.get would)."""

    def __init__(self, hosts=1):
        self.hosts = hosts
        self.prints: dict = {}  # token -> fingerprint (None: the state had moved on)
        self.lost: set = set()
        self.recomputed: list = []
        self.fetched: list = []

    def recompute(self, slice_id, step, shard):
        self.recomputed.append((slice_id, step, shard))
        return [f"s{slice_id}h{h}@{step}" for h in range(self.hosts)]

    def answer(self, slice_id, step, *fps):
        for h, fp in enumerate(fps):
            self.prints[f"s{slice_id}h{h}@{step}"] = fp

    def fetch(self, refs, timeout_s):
        self.fetched.append((list(refs), timeout_s))
        if any(r.startswith(tuple(f"s{s}h" for s in self.lost)) for r in refs):
            raise TimeoutError("lost")
        return [self.prints[r] for r in refs]


class FakeSnapshots:
    def __init__(self):
        self.calls: list = []

    def verified_through(self, step):
        self.calls.append(step)


def _grad_checks(state_every=0, grad_every=10, num_slices=3):
    events: list = []
    config = ElasticConfig(num_slices=num_slices, state_check_every=state_every, grad_check_every=grad_every)
    return Checks(config, lambda name, **f: events.append((name, f))), events


def _step_metrics(live, owner=None, shard=None, fps=(), hosts=1, state_fp=None, at=None):
    """(slice, host) -> metrics; the owner's hosts carry grad_prints[shard] = fps[host]."""
    out = {}
    for s in live:
        for h in range(hosts):
            mm = {"loss": 1.0}
            if s == owner:
                mm["grad_prints"] = {shard: fps[h]}
            if state_fp is not None:
                mm["fingerprints"], mm["replicated"] = {at: list(state_fp)}, True
            out[(s, h)] = mm
    return out


def test_checks_no_ahead_is_true_on_due_cross_check_steps_only():
    checks, _ = _grad_checks(grad_every=10)
    assert [s for s in range(0, 31) if checks.no_ahead(s)] == [10, 20, 30]
    off, _ = _grad_checks(grad_every=0)
    assert not any(off.no_ahead(s) for s in range(0, 31))


def test_checks_issue_recomputes_on_the_checkers_only_when_due():
    checks, _ = _grad_checks(grad_every=10)
    backend = FakeBackend()
    live = [0, 1, 2]
    checks.issue(9, live, _assign(live), backend)
    assert backend.recomputed == []
    checks.issue(10, [2, 1, 0], _assign(live), backend)
    assert backend.recomputed == [(1, 10, 0), (2, 10, 0)]
    checks.issue(20, live, _assign(live), backend)
    assert backend.recomputed[2:] == [(2, 20, 10), (0, 20, 10)]


def test_checks_cycle_finds_a_corrupted_owner():
    checks, events = _grad_checks(grad_every=10)
    backend, snaps = FakeBackend(), FakeSnapshots()
    live = [0, 1, 2]
    # Step 10: owner 0 (shard 0), checkers 1, 2, all agree.
    checks.issue(10, live, _assign(live), backend)
    backend.answer(1, 10, 55)
    backend.answer(2, 10, 55)
    assert checks.after_step(11, _step_metrics(live, owner=0, shard=0, fps=[55]), snaps) is None
    assert backend.fetched and all(t == _checking._FETCH_S for _, t in backend.fetched)
    assert snaps.calls == [10]  # min(step 11 with state checks off, the grads floor 10)
    assert events == []
    # Steps 11..19: nothing to judge; the floor stays at 10.
    checks.issue(11, live, _assign(live), backend)
    assert checks.after_step(12, _step_metrics(live), snaps) is None
    assert snaps.calls == [10, 10]
    # Step 20: owner 1 (shard 10), checkers 2, 0; the owner's gradient is wrong.
    checks.issue(20, live, _assign(live), backend)
    backend.answer(2, 20, 77)
    backend.answer(0, 20, 77)
    found = checks.after_step(21, _step_metrics(live, owner=1, shard=10, fps=[66]), snaps)
    assert isinstance(found, Divergence)
    assert found.step == 21 and found.named == ((1, 0),) and found.verified == 10
    assert snaps.calls[-1] == 10
    assert len(events) == 1 and events[0][0] == "diverged"
    fields = events[0][1]
    assert fields["step"] == 21 and fields["named"] == [[1, 0]] and fields["verified"] == 10
    assert fields["detail"] == found.detail


def test_checks_verified_through_is_the_min_of_state_and_grads():
    checks, _ = _grad_checks(state_every=4, grad_every=10)
    backend, snaps = FakeBackend(), FakeSnapshots()
    live = [0, 1, 2]
    assert checks.after_step(9, _step_metrics(live, state_fp=GOOD, at=8), snaps) is None
    assert checks.state.verified == 8 and snaps.calls == [0]  # the grads floor: nothing cross-checked yet
    checks.issue(10, live, _assign(live), backend)
    backend.answer(1, 10, 3)
    backend.answer(2, 10, 3)
    assert checks.after_step(11, _step_metrics(live, owner=0, shard=0, fps=[3]), snaps) is None
    assert checks.grads.floor(live) == 10 and snaps.calls[-1] == 8  # the state check is older
    assert checks.after_step(13, _step_metrics(live, state_fp=GOOD, at=12), snaps) is None
    assert snaps.calls[-1] == 10  # now the cross-check is


def test_checks_state_divergence_takes_precedence_over_the_cross_check():
    checks, events = _grad_checks(state_every=1, grad_every=10)
    backend, snaps = FakeBackend(), FakeSnapshots()
    live = [0, 1, 2]
    checks.issue(10, live, _assign(live), backend)
    metrics = _step_metrics(live, owner=0, shard=0, fps=[3], state_fp=GOOD, at=11)
    metrics[(2, 0)]["fingerprints"] = {11: [12, 12, 12, 12]}
    found = checks.after_step(11, metrics, snaps)
    assert found.named == ((2, 0),) and found.step == 11 and backend.fetched == []
    assert [n for n, _ in events] == ["diverged"]


def test_checks_a_lost_checker_is_a_missed_check():
    checks, events = _grad_checks(grad_every=10, num_slices=2)
    backend, snaps = FakeBackend(), FakeSnapshots()
    live = [0, 1]
    checks.issue(10, live, _assign(live), backend)
    backend.lost.add(1)
    assert checks.after_step(11, _step_metrics(live, owner=0, shard=0, fps=[3]), snaps) is None
    assert events == [] and snaps.calls == [0]
    assert checks.grads.clean(0) == checks.grads.clean(1) == 0


def test_checks_a_lost_checker_of_three_leaves_the_other_two_compared():
    checks, events = _grad_checks(grad_every=10)
    backend, snaps = FakeBackend(), FakeSnapshots()
    live = [0, 1, 2]
    checks.issue(10, live, _assign(live), backend)
    backend.answer(1, 10, 3)
    backend.lost.add(2)
    assert checks.after_step(11, _step_metrics(live, owner=0, shard=0, fps=[3]), snaps) is None
    assert (checks.grads.clean(0), checks.grads.clean(1), checks.grads.clean(2)) == (10, 10, 0)
    assert snaps.calls == [0] and events == []
    # The same, but the one checker left disagrees: found, no one named.
    checks.issue(20, live, _assign(live), backend)  # owner 1, checkers 2, 0
    backend.lost = {0}
    backend.answer(2, 20, 4)
    found = checks.after_step(21, _step_metrics(live, owner=1, shard=10, fps=[5]), snaps)
    assert found is not None and found.named == () and found.verified == 0  # slice 2 never clean
    assert [n for n, _ in events] == ["diverged"] and events[0][1]["named"] == []


def test_checks_a_checker_whose_host_0_answers_none_missed_the_check():
    checks, events = _grad_checks(grad_every=10, num_slices=2)
    backend, snaps = FakeBackend(), FakeSnapshots()
    live = [0, 1]
    checks.issue(10, live, _assign(live), backend)
    backend.answer(1, 10, None)  # the state had moved on
    assert checks.after_step(11, _step_metrics(live, owner=0, shard=0, fps=[99]), snaps) is None
    assert events == [] and checks.grads.floor(live) == 0


def test_checks_multi_host_cycle_names_the_checker_s_differing_host():
    checks, events = _grad_checks(grad_every=10)
    backend, snaps = FakeBackend(hosts=2), FakeSnapshots()
    live = [0, 1, 2]
    checks.issue(10, live, _assign(live), backend)
    backend.answer(1, 10, 1, 2)
    backend.answer(2, 10, 1, 9)
    found = checks.after_step(11, _step_metrics(live, owner=0, shard=0, fps=[1, 2], hosts=2), snaps)
    assert found is not None and found.named == ((2, 1),) and events[0][1]["named"] == [[2, 1]]


def test_checks_after_step_ignores_a_stale_cross_check():
    checks, events = _grad_checks(grad_every=10)
    backend, snaps = FakeBackend(), FakeSnapshots()
    live = [0, 1, 2]
    checks.issue(10, live, _assign(live), backend)
    backend.answer(1, 10, 1)
    backend.answer(2, 10, 1)
    bad = _step_metrics(live, owner=0, shard=0, fps=[2])
    assert checks.after_step(12, bad, snaps) is None  # not the step after the cross-check's
    assert backend.fetched == [] and events == []
    assert checks.after_step(11, bad, snaps) is None  # and the cross-check is gone
    assert backend.fetched == [] and events == [] and checks.grads.floor(live) == 0


def test_checks_restart_drops_the_issued_cross_check():
    checks, events = _grad_checks(grad_every=10)
    backend, snaps = FakeBackend(), FakeSnapshots()
    live = [0, 1, 2]
    checks.issue(10, live, _assign(live), backend)
    backend.answer(1, 10, 1)
    backend.answer(2, 10, 1)
    checks.restart(10)
    assert checks.after_step(11, _step_metrics(live, owner=0, shard=0, fps=[2]), snaps) is None
    assert backend.fetched == [] and events == []
    checks.restart(40, cold=True)
    assert checks.grads.floor(live) == 40 and checks.state.verified == 40


# --- Stragglers (control/stragglers.py) -------------------------------------

def _times(**per_slice):
    """(slice, host 0) -> metrics with grads_s for 2 shards each: s0=0.1 ..."""
    return {(int(k[1:]), 0): {"grads_s": 2 * t, "grads_shards": 2} for k, t in per_slice.items()}


def _observe(det, step, metrics, spare=False, policy="pause", required=1):
    return det.observe(step, metrics, spare_ready=spare, policy=policy, required=required)


def test_a_slice_slow_for_the_set_steps_is_named_once_with_its_action():
    det = Stragglers(factor=1.3, steps=3)
    assert _observe(det, 1, _times(s0=0.1, s1=0.2)) is None
    assert _observe(det, 2, _times(s0=0.1, s1=0.2)) is None
    found = _observe(det, 3, _times(s0=0.1, s1=0.2))
    assert found == Straggler(3, 1, 0, 2.0, 3, "report")
    assert found.failure() is None and found.rolls_back is False
    # Reported once per slowdown: still slow, not again.
    assert all(_observe(det, k, _times(s0=0.1, s1=0.2)) is None for k in range(4, 10))
    # It recovers, then slows again: reported again after the set steps.
    assert _observe(det, 10, _times(s0=0.1, s1=0.1)) is None
    assert [_observe(det, k, _times(s0=0.1, s1=0.2)) is not None for k in (11, 12, 13)] == [False, False, True]


def test_a_slowdown_of_too_few_seconds_is_not_a_straggler():
    """Ten slow steps of 50 ms (a warm process starting beside a healthy
    worker made it 2.8x slower for that long) are half a second: not a
    lasting slowdown. A real one is named once its slow gradient calls add
    up to min_s, reported with the steps it took."""
    det = Stragglers(factor=1.3, steps=10, min_s=10.0)
    fast = _times(s0=0.025, s1=0.07)  # 2 shards: slice 1's calls take 0.14 s a step
    assert all(_observe(det, k, fast) is None for k in range(1, 11))
    assert _observe(det, 11, _times(s0=0.025, s1=0.025)) is None  # over: the count and the seconds start again
    slow = _times(s0=0.5, s1=1.0)  # 2 s a step
    assert [_observe(det, k, slow) for k in range(12, 21)] == [None] * 9  # 18 s, but 9 steps
    found = _observe(det, 21, slow)
    assert (found.step, found.slice_id, found.steps, found.ratio) == (21, 1, 10, 2.0)
    det = Stragglers(factor=1.3, steps=10, min_s=10.0)
    found = [k for k in range(1, 200) if _observe(det, k, fast) is not None]
    assert found == [72]  # 72 steps of 0.14 s: the first past 10 s; then reported once only


def test_straggler_min_s_is_checked():
    for bad in (-1.0, float("nan"), "10"):
        with pytest.raises(ConfigError, match="straggler_min_s"):
            ElasticConfig(straggler_min_s=bad)
    assert ElasticConfig().straggler_min_s == 10.0


def test_a_fast_step_resets_the_count():
    det = Stragglers(factor=1.3, steps=3)
    for k, s1 in enumerate((0.2, 0.2, 0.12, 0.2, 0.2), start=1):  # 0.12 is under 1.3x: the run restarts
        assert _observe(det, k, _times(s0=0.1, s1=s1)) is None
    assert _observe(det, 6, _times(s0=0.1, s1=0.2)) is not None


def test_the_action_depends_on_spares_policy_and_what_is_faster():
    def first(**kw):
        det = Stragglers(factor=1.3, steps=1)
        return _observe(det, 5, kw.pop("times"), **kw)

    two = _times(s0=0.1, s1=0.15)  # 1.5x
    four = _times(s0=0.1, s1=0.1, s2=0.1, s3=0.15)
    assert first(times=two, spare=True).action == "swap"
    assert first(times=two, policy="resize").action == "report"  # alone 2x slower than 1.5x: kept
    assert first(times=four, policy="resize").action == "remove"  # 4/3 < 1.5: faster without it
    assert first(times=four, policy="pause").action == "report"
    assert first(times=four, policy="resize", required=4).action == "report"  # may not go below min slices
    swap = first(times=two, spare=True)
    failure = swap.failure()
    assert failure.kind.value == "straggler" and (failure.slice_id, failure.host, failure.step) == (1, 0, 5)


def test_time_per_shard_and_the_slowest_host_count():
    det = Stragglers(factor=1.3, steps=1)
    # Slice 1 computes 4 shards in 0.4 s: as fast per shard as slice 0's 2 in 0.2 s.
    even = {(0, 0): {"grads_s": 0.2, "grads_shards": 2}, (1, 0): {"grads_s": 0.4, "grads_shards": 4}}
    assert _observe(det, 1, even) is None
    # A two-host slice is as slow as its slowest host, which is named.
    hosts = {(0, 0): {"grads_s": 0.2, "grads_shards": 2}, (0, 1): {"grads_s": 0.2, "grads_shards": 2},
             (1, 0): {"grads_s": 0.2, "grads_shards": 2}, (1, 1): {"grads_s": 0.6, "grads_shards": 2}}
    found = _observe(det, 2, hosts)
    assert (found.slice_id, found.host, found.ratio) == (1, 1, 3.0)


def test_off_one_slice_or_no_times_is_nothing():
    assert _observe(Stragglers(factor=0, steps=1), 1, _times(s0=0.1, s1=1.0)) is None
    det = Stragglers(factor=1.3, steps=1)
    assert _observe(det, 1, _times(s0=0.1)) is None
    assert _observe(det, 2, {(0, 0): {"loss": 1.0}, (1, 0): {"loss": 1.0}}) is None


def test_a_slice_gone_from_the_step_is_forgotten():
    det = Stragglers(factor=1.3, steps=2)
    assert _observe(det, 1, _times(s0=0.1, s1=0.2, s2=0.1)) is None
    assert _observe(det, 2, _times(s0=0.1, s2=0.1)) is None  # slice 1 lost: its count dropped
    assert _observe(det, 3, _times(s0=0.1, s1=0.2, s2=0.1)) is None  # its replacement starts from 0
    assert _observe(det, 4, _times(s0=0.1, s1=0.2, s2=0.1)) is not None


def test_grad_judge_keeps_the_newest_agreed_check_as_a_known_answer():
    checks = GradChecks(every=3)
    assert checks.agreed is None
    first, second = CrossCheck(3, 0, 0, (1,)), CrossCheck(6, 1, 1, (0,))
    assert checks.judge(first, {0: {0: 7}, 1: {0: 7}}) is None
    assert checks.judge(second, {0: {0: 9}, 1: {0: 9}}) is None
    assert checks.agreed == (second, {0: 9})
    assert checks.judge(CrossCheck(9, 0, 0, (1,)), {0: {0: 1}, 1: {0: 2}}) is not None
    assert checks.agreed == (second, {0: 9})  # a mismatch is no known answer
    checks.restart(6)
    assert checks.agreed == (second, {0: 9})  # its state is still there
    checks.restart(5)
    assert checks.agreed is None
    assert checks.judge(first, {0: {0: 7}, 1: {0: 7}}) is None
    checks.restart(3, cold=True)
    assert checks.agreed is None


def test_the_newest_verified_snapshot_outlives_newer_unverified_ones(store):
    """It is the rollback's target and a tie-break's known answer: four
    unverified ones after it drop the oldest of those, never it."""
    store.verified_through(0)
    take(store, 2)
    store.verified_through(2)
    for step in (4, 6, 8, 10):
        take(store, step)
    assert kept(store) == [2, 6, 8, 10]
    assert store.restore_source(alive, verified=True) == (2, "ref0@2")
    assert store.restore_source(alive, at_most=5) == (2, "ref0@2")

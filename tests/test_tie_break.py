"""Unit tests (no Ray cluster, no JAX) for the tie-break between two
replicas whose states differ (ray_elastic.control.tie_break): which slice
the replays name, and how `settle` drives the backend (a fake), falls
back when there is nothing to replay from, and reports it."""

from __future__ import annotations

from ray_elastic.control.integrity import CrossCheck, Divergence
from ray_elastic.control.tie_break import judge, settle, settle_grads

GOOD, BAD, ODD = (11, 11), (12, 12), (13, 13)
FOUND = Divergence(step=8, named=(), verified=5, detail="host 0: no majority among slices [0, 1]")


def test_the_spare_agrees_with_one_slice_and_names_the_other():
    got = judge(FOUND, {0: {0: GOOD}, 1: {0: BAD}}, {2: {0: GOOD}}, spare=2)
    assert got.named == ((1, 0),) and "spare, slice 2" in got.detail and got.detail.startswith(FOUND.detail)
    assert got.failure().slice_id == 1 and got.failure().step == 7
    got = judge(FOUND, {0: {0: BAD}, 1: {0: GOOD}}, {2: {0: GOOD}}, spare=2)
    assert got.named == ((0, 0),)


def test_a_spare_that_agrees_with_neither_or_did_not_answer_names_no_one():
    assert judge(FOUND, {0: {0: GOOD}, 1: {0: BAD}}, {2: {0: ODD}}, spare=2) == FOUND
    assert judge(FOUND, {0: {0: GOOD}, 1: {0: BAD}}, {}, spare=2) == FOUND


def test_the_spare_names_per_host_of_a_multi_host_slice():
    original = {0: {0: GOOD, 1: GOOD}, 1: {0: GOOD, 1: BAD}}
    got = judge(FOUND, original, {2: {0: GOOD, 1: GOOD}}, spare=2)
    assert got.named == ((1, 1),)


def test_without_a_spare_the_slice_that_cannot_repeat_its_state_is_named():
    # A flip once in slice 1's memory: both replays make the good state.
    got = judge(FOUND, {0: {0: GOOD}, 1: {0: BAD}}, {0: {0: GOOD}, 1: {0: GOOD}})
    assert got.named == ((1, 0),) and "slice 0 made its own state again, slice 1 did not" in got.detail
    # Chips that compute wrong unevenly: slice 0 repeats itself, slice 1 makes a third value.
    assert judge(FOUND, {0: {0: GOOD}, 1: {0: BAD}}, {0: {0: GOOD}, 1: {0: ODD}}).named == ((1, 0),)
    assert judge(FOUND, {0: {0: BAD}, 1: {0: GOOD}}, {0: {0: GOOD}, 1: {0: GOOD}}).named == ((0, 0),)


def test_without_a_spare_two_that_each_repeat_themselves_or_a_missing_replay_name_no_one():
    assert judge(FOUND, {0: {0: GOOD}, 1: {0: BAD}}, {0: {0: GOOD}, 1: {0: BAD}}) == FOUND
    assert judge(FOUND, {0: {0: GOOD}, 1: {0: BAD}}, {0: {0: ODD}, 1: {0: ODD}}) == FOUND
    assert judge(FOUND, {0: {0: GOOD}, 1: {0: BAD}}, {0: {0: GOOD}}) == FOUND  # slice 1's replay failed


class FakeSnapshots:
    def __init__(self, newest=(5, "snap@5")):
        self.newest, self.asked = newest, []

    def restore_source(self, node_alive, at_most=None):
        self.asked.append(at_most)
        return self.newest if self.newest and self.newest[0] <= at_most else None


class FakeBackend:
    """load, run_step and fingerprint record their calls; fetch answers the
    prints set per slice; a slice in `fail` raises in its replay's steps."""

    def __init__(self, prints, fail=()):
        self.prints, self.fail = prints, set(fail)
        self.loads, self.steps, self.printed, self.deadlines = [], [], [], []

    def node_alive(self, node_id):
        return True

    def load(self, slices, source, timeout_s):
        self.loads.append((list(slices), source))

    def run_step(self, step, slices, assignment, takers, deadline_s, on_issued, ahead=None):
        assert takers == frozenset()
        self.deadlines.append(deadline_s)
        if slices[0] in self.fail:
            raise TimeoutError("replay hung")
        self.steps.append((step, list(slices), dict(assignment)))

    def fingerprint(self, slice_id):
        self.printed.append(slice_id)
        return [(slice_id, h) for h in range(len(self.prints[slice_id]))]

    def fetch(self, refs, timeout_s=None):
        assert timeout_s and timeout_s > 0
        return [list(self.prints[s][h]) for s, h in refs]


def _metrics(prints, at=8):
    return {(s, h): {"loss": 1.0, "fingerprints": {at: list(fp)}} for s, hosts in prints.items()
            for h, fp in enumerate(hosts)}


def _clock():
    t = iter(range(100))
    return lambda: float(next(t))


def test_settle_replays_on_the_spare_from_the_newest_verified_snapshot():
    events = []
    backend = FakeBackend({2: [GOOD]})
    got = settle(FOUND, _metrics({0: [BAD], 1: [GOOD]}), FakeSnapshots(), backend, [3, 2], 4,
                 lambda name, **f: events.append((name, f)), clock=_clock(), step_deadline_s=7.0)
    assert got.named == ((0, 0),)
    # Steps 5, 6 and 7 on the spare alone, every shard its own: the state of step 8.
    assert backend.loads == [([2], "snap@5")] and backend.printed == [2]
    assert backend.steps == [(k, [2], {2: (0, 1, 2, 3)}) for k in (5, 6, 7)]
    assert backend.deadlines == [7.0] * 3  # each replayed step, the deadline it is given
    assert events == [("tie_break", {"step": 8, "replayed_from": 5, "by": "spare", "slices": [2],
                                     "named": [[0, 0]], "seconds": 1.0})]


def test_settle_without_a_spare_replays_on_both_slices():
    events = []
    backend = FakeBackend({0: [GOOD], 1: [GOOD]})
    got = settle(FOUND, _metrics({0: [GOOD], 1: [BAD]}), FakeSnapshots(), backend, [], 2,
                 lambda name, **f: events.append((name, f)), clock=_clock())
    assert got.named == ((1, 0),) and backend.loads == [([0], "snap@5"), ([1], "snap@5")]
    assert [(k, s) for k, s, _ in backend.steps] == [(5, [0]), (6, [0]), (7, [0]), (5, [1]), (6, [1]), (7, [1])]
    assert events[0][1]["by"] == "replay" and events[0][1]["slices"] == [0, 1]


def test_settle_a_hung_replay_gives_no_vote():
    backend = FakeBackend({0: [GOOD], 1: [GOOD]}, fail={1})
    assert settle(FOUND, _metrics({0: [GOOD], 1: [BAD]}), FakeSnapshots(), backend, [], 2,
                  lambda *a, **f: None) == FOUND
    assert backend.printed == [0]


def test_settle_leaves_it_when_there_is_nothing_to_replay_or_to_break():
    events = []
    ev = lambda name, **f: events.append(name)  # noqa: E731
    backend = FakeBackend({2: [GOOD]})
    # No verified snapshot at or before the verified step.
    assert settle(FOUND, _metrics({0: [BAD], 1: [GOOD]}), FakeSnapshots(newest=(7, "s")), backend, [2], 2,
                  ev) == FOUND
    assert events == ["tie_break"]  # said, with the reason
    events.clear()
    # Three slices: a majority's job, not a tie-break's.
    assert settle(FOUND, _metrics({0: [BAD], 1: [GOOD], 2: [ODD]}), FakeSnapshots(), backend, [], 2, ev) == FOUND
    # Already named (a replicated slice whose devices disagree).
    named = Divergence(8, ((1, 0),), 5, "d")
    assert settle(named, _metrics({0: [GOOD], 1: [BAD]}), FakeSnapshots(), backend, [2], 2, ev) is named
    assert backend.loads == [] and events == []


# A cross-check of shard 3 at step 9, owned by slice 0, computed again by slice 1.
CHECK = CrossCheck(step=9, owner=0, shard=3, checkers=(1,))
GRAD_FOUND = Divergence(step=10, named=(), verified=6, detail="the gradient of shard 3 at step 9: no majority")


class GradSnapshots(FakeSnapshots):
    def __init__(self, newest=(9, "snap@9")):
        super().__init__(newest)
        self.waited = 0

    def wait_sealed(self, timeout):
        self.waited += 1
        return 0.0


class GradBackend(FakeBackend):
    """recompute answers each host's fingerprint set per slice (None from
    host 0: the slice's state was not the check's)."""

    def __init__(self, grads, fail=()):
        super().__init__({}, fail)
        self.grads, self.recomputed = grads, []

    def recompute(self, slice_id, step, shard):
        if slice_id in self.fail:
            raise RuntimeError("lost")
        self.recomputed.append((slice_id, step, shard))
        return ("grads", slice_id)

    def fetch(self, refs, timeout_s=None):
        assert timeout_s and timeout_s > 0
        return list(self.grads[refs[1]])


def test_a_gradient_mismatch_is_settled_by_the_spare_from_the_check_step_s_snapshot():
    events = []
    backend, snaps = GradBackend({2: [21]}), GradSnapshots()
    got = settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, snaps, backend, [2],
                       lambda name, **f: events.append((name, f)), clock=_clock())
    assert got.named == ((1, 0),) and "the spare, slice 2, computed it again" in got.detail
    # The state both slices computed from, not a replay from an older one; no step run.
    assert snaps.asked == [9] and snaps.waited == 1 and backend.loads == [([2], "snap@9")] and backend.steps == []
    assert backend.recomputed == [(2, 9, 3)]
    assert events == [("tie_break", {"step": 9, "of": "gradient", "shard": 3, "by": "spare", "slices": [2],
                                     "named": [[1, 0]], "seconds": 1.0})]


def test_without_a_spare_the_slice_that_cannot_repeat_its_gradient_is_named():
    # A flip once: slice 0's second computation is the good value, slice 1 repeats its own.
    backend = GradBackend({0: [66], 1: [66]})
    got = settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, GradSnapshots(), backend, [],
                       lambda *a, **f: None)
    assert got.named == ((0, 0),) and "slice 1 made its own gradient again, slice 0 did not" in got.detail
    assert backend.loads == [([0], "snap@9"), ([1], "snap@9")]
    # A fault that repeats exactly on its slice: each repeats itself, no one named.
    backend = GradBackend({0: [21], 1: [66]})
    assert settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, GradSnapshots(), backend, [],
                        lambda *a, **f: None) == GRAD_FOUND


def test_a_gradient_mismatch_stays_unnamed_without_the_check_step_s_snapshot_or_a_vote():
    events = []
    ev = lambda name, **f: events.append((name, f))  # noqa: E731
    # Only an older snapshot: a replay from it would not make the state both computed from.
    backend = GradBackend({2: [21]})
    assert settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, GradSnapshots(newest=(6, "s")), backend,
                        [2], ev) == GRAD_FOUND
    assert backend.loads == [] and events[0][1]["reason"] == "no snapshot of the cross-check's step"
    # The spare was lost in its computation, or its state was not the check's (None).
    for backend in (GradBackend({2: [21]}, fail={2}), GradBackend({2: [None]})):
        assert settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, GradSnapshots(), backend, [2],
                            lambda *a, **f: None) == GRAD_FOUND


# The newest cross-check both slices agreed on: shard 1 at step 6, whose
# gradient's fingerprint (host 0) was 42.
KNOWN = (CrossCheck(step=6, owner=1, shard=1, checkers=(0,)), {0: 42})


class KeptSnapshots(GradSnapshots):
    """The check step's snapshot and the older verified one."""

    def __init__(self, steps=(6, 9)):
        super().__init__()
        self.steps = steps

    def restore_source(self, node_alive, at_most=None):
        self.asked.append(at_most)
        kept = [s for s in self.steps if s <= at_most]
        return (kept[-1], f"snap@{kept[-1]}") if kept else None


class StepBackend(GradBackend):
    """recompute answers per (slice, step): {(slice, step): [host prints]}."""

    def recompute(self, slice_id, step, shard):
        self.recomputed.append((slice_id, step, shard))
        return ("grads", (slice_id, step))


def test_a_lasting_fault_that_repeats_itself_is_named_by_the_known_answer():
    events = []
    # Each repeats its own gradient of step 9; from step 6's state slice 0
    # makes the agreed 42 again, slice 1 (its chips gone bad) does not.
    backend = StepBackend({(0, 9): [21], (1, 9): [66], (0, 6): [42], (1, 6): [43]})
    got = settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, KeptSnapshots(), backend, [],
                       lambda name, **f: events.append((name, f)), clock=_clock(), known=KNOWN)
    assert got.named == ((1, 0),) and got.verified == GRAD_FOUND.verified
    assert "slice 0 made it again, slice 1 did not" in got.detail
    assert backend.loads == [([0], "snap@9"), ([1], "snap@9"), ([0], "snap@6"), ([1], "snap@6")]
    assert backend.recomputed == [(0, 9, 3), (1, 9, 3), (0, 6, 1), (1, 6, 1)]
    assert events == [("tie_break", {"step": 9, "of": "gradient", "shard": 3, "by": "known_answer", "slices": [0, 1],
                                     "known_step": 6, "known_shard": 1, "named": [[1, 0]], "seconds": 1.0})]


def test_the_known_answer_names_no_one_when_both_or_neither_make_it_or_it_is_gone():
    prints = {0: {0: 21}, 1: {0: 66}}
    for at_6 in ([42], [42]), ([40], [43]):  # both make it (not lasting), neither does
        backend = StepBackend({(0, 9): [21], (1, 9): [66], (0, 6): at_6[0], (1, 6): at_6[1]})
        assert settle_grads(GRAD_FOUND, CHECK, prints, KeptSnapshots(), backend, [], lambda *a, **f: None,
                            known=KNOWN) == GRAD_FOUND
    # The known check's state is no longer kept: nothing loaded for it.
    backend = StepBackend({(0, 9): [21], (1, 9): [66]})
    assert settle_grads(GRAD_FOUND, CHECK, prints, KeptSnapshots(steps=(5, 9)), backend, [], lambda *a, **f: None,
                        known=KNOWN) == GRAD_FOUND
    assert backend.loads == [([0], "snap@9"), ([1], "snap@9")]
    # No known answer, or a flip once (settled by the first recomputation): no second round.
    backend = StepBackend({(0, 9): [21], (1, 9): [66]})
    assert settle_grads(GRAD_FOUND, CHECK, prints, KeptSnapshots(), backend, [], lambda *a, **f: None) == GRAD_FOUND
    backend = StepBackend({(0, 9): [66], (1, 9): [66]})
    got = settle_grads(GRAD_FOUND, CHECK, prints, KeptSnapshots(), backend, [], lambda *a, **f: None, known=KNOWN)
    assert got.named == ((0, 0),) and all(step == 9 for _, step, _ in backend.recomputed)


class RetakeBackend(GradBackend):
    """GradBackend whose steps are recorded (a step after the recomputes
    takes the slices back to the run's state)."""

    def run_step(self, step, slices, assignment, takers, deadline_s, on_issued):
        self.steps.append((step, tuple(slices), dict(assignment)))


def test_a_checker_whose_first_computation_is_not_repeated_evicts_no_one():
    # The owner (slice 0) applied 21; the checker (slice 1) printed 66
    # once; computing again from the check step's state both make 21.
    events = []
    backend = RetakeBackend({0: [21], 1: [21]})
    got = settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, GradSnapshots(), backend, [],
                       lambda name, **f: events.append((name, f)), clock=_clock(), shards=4)
    assert got is None  # no divergence: nothing wrong entered the state, no slice is shown faulty
    # The slices were loaded with the check step's state, then took step 9 again: back at step 10.
    assert backend.loads == [([0], "snap@9"), ([1], "snap@9")]
    assert backend.steps == [(9, (0, 1), {0: (0, 2), 1: (1, 3)})]
    [(name, f)] = events
    assert name == "tie_break" and f["named"] == [] and f["retaken"] is True and "not repeated" in f["dismissed"]
    # Taking the step again failed: the run rolls back as for an unnamed divergence.
    backend = RetakeBackend({0: [21], 1: [21]}, fail=())

    def broken(*a, **k):
        raise RuntimeError("lost")

    backend.run_step = broken
    assert settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, GradSnapshots(), backend, [],
                        lambda *a, **f: None, shards=4) == GRAD_FOUND
    # The owner's gradient, the one applied, is the one not repeated: named, as before.
    backend = RetakeBackend({0: [66], 1: [66]})
    assert settle_grads(GRAD_FOUND, CHECK, {0: {0: 21}, 1: {0: 66}}, GradSnapshots(), backend, [],
                        lambda *a, **f: None, shards=4).named == ((0, 0),)

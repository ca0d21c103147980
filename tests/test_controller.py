"""The controller, one step at a time, over a pure-Python fake of the
cluster (no Ray): every policy decision path with injected failures, on a
fake clock, in well under a second each. The same paths run on a real
local cluster in test_elastic_e2e.py."""

from __future__ import annotations

import pytest

from ray_elastic import ElasticConfig
from ray_elastic.control.controller import Controller, Seams
from ray_elastic.cluster.backend import SliceUp
from ray_elastic.errors import FailureKind, ReplacementTimeout, RetryBudgetExhausted, RunFailed, StateLoadFailed
from ray_elastic.failures.location import failure
from ray_elastic.dispatch.step_runner import PartialStep, StepResult


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeBackend:
    """Slices as step counters. A slice comes up `setup_s` after it is
    started while `capacity` allows; `fail_at[(step, slice)]` is the kind
    of failure that step raises on that slice."""

    def __init__(self, clock: FakeClock, num_shards: int, setup_s: float = 2.0, step_s: float = 0.1):
        self.clock = clock
        self.num_shards = num_shards
        self.setup_s = setup_s
        self.step_s = step_s
        self.capacity = True  # may replacements be placed?
        self.fail_at: dict[tuple[int, int], FailureKind] = {}
        self.coming: dict[int, float] = {}  # slice -> time it comes up
        self.held: dict[int, int] = {}  # set-up slice -> the step its state is at
        self.started: list[int] = []
        self.steps_run: list[tuple[int, tuple]] = []
        self.partial_steps = False  # failures carry the survivors' finished gradients
        self.finished: list[tuple[int, tuple]] = []
        self.aheads: list[tuple[int, object]] = []  # (step, the next step's assignment it was given)
        self.silent: set = set()  # (step, slice) failures whose node does not answer
        self.new_groups: list[int] = []  # slices restarted on a new placement group
        self.evicted: list[str] = []  # nodes a new group must keep off
        self.unplaced: set = set()  # slices whose group Ray could not place
        self.lost_nodes: set = set()  # nodes whose raylet refuses connections

    def placed(self, s):
        return s not in self.unplaced

    def start(self, s, new_group=False, evict=()):
        self.retire(s)
        self.started.append(s)
        if new_group:
            self.new_groups.append(s)
        self.evicted.extend(evict)
        self.coming[s] = self.clock.now + self.setup_s

    def poll(self, block_s=0.0):
        self.clock.now += block_s
        up = []
        for s, at in sorted(self.coming.items()):
            if at <= self.clock.now and (self.capacity or len(self.started) <= self.num_shards):
                del self.coming[s]
                self.held[s] = 0
                up.append(SliceUp(s, self.setup_s))
        return up

    def run_step(self, k, slices, assignment, takers, deadline_s, on_issued, ahead=None):
        self.aheads.append((k, None if ahead is None else dict(ahead)))
        on_issued()
        self.clock.now += self.step_s
        for s in slices:
            if (k, s) in self.fail_at:
                kind = self.fail_at.pop((k, s))
                if getattr(self, "applied_before_failure", False):  # the others applied the step
                    for t in slices:
                        if t != s:
                            self.held[t] = k + 1
                    self.applied_result = StepResult({(t, 0): {"loss": 1.0 / (k + 1)} for t in slices if t != s}, {})
                partial = None
                if self.partial_steps:  # the others finished their gradients
                    partial = PartialStep(k, dict(assignment), {t: ("grads", t) for t in slices if t != s})
                raise failure(kind, s, 0, k, "injected", partial=partial, node_silent=(k, s) in self.silent)
        assert sorted(sum((tuple(v) for v in assignment.values()), ())) == list(range(self.num_shards)), "every shard, every step"
        return self._complete(k, slices, takers)

    def finish_step(self, partial, slices, takers, deadline_s):
        self.clock.now += self.step_s
        self.finished.append((partial.step, tuple(slices)))
        return self._complete(partial.step, slices, takers)

    def _complete(self, k, slices, takers):
        assert all(self.held[s] == k for s in slices), "slices out of step"
        for s in slices:
            self.held[s] = k + 1
        self.steps_run.append((k, tuple(slices)))
        metrics = {(s, 0): {"loss": 1.0 / (k + 1)} for s in slices}
        return StepResult(metrics, {s: ("state", k + 1) for s in takers})

    def applied(self, step, slices):
        return getattr(self, "applied_result", None)

    def load(self, slices, source, timeout_s):
        if source is None:
            raise StateLoadFailed([], "no source")
        for s in slices:
            self.held[s] = source[1]

    def held_steps(self, slices, step, abort_waits=False):
        self.aborted_waits = getattr(self, "aborted_waits", []) + [abort_waits]
        for s in sorted(set(getattr(self, "fail_held", ())) & set(slices)):
            self.fail_held.discard(s)
            raise failure(FailureKind.PROCESS_DIED, s, 0, step, "found dead while reconciling")
        return {s: self.held[s] for s in slices}

    def locate(self, slices, step, cause):
        return failure(FailureKind.HUNG, min(slices), 0, step, str(cause))

    def state(self, s):
        return ("state", self.held[s])

    def fetch(self, ref, timeout_s=None):
        return ref

    def hosts(self, s):
        return [{"pid": 100 + s, "node_id": f"node{s}", "ip": "127.0.0.1"}]

    def node_alive(self, node_id):
        return node_id not in self.lost_nodes and int(node_id[4:]) in self.held

    def retire(self, s):
        self.held.pop(s, None)
        self.coming.pop(s, None)

    def attach_checkpoints(self, coordinator, s):
        pass

    def shutdown(self, keep=False):
        pass


def run(config: ElasticConfig, steps: int = 10, **backend_args):
    clock = FakeClock()
    backend = FakeBackend(clock, config.num_slices, **backend_args)
    trainer = Controller(lambda: None, config, steps, seams=Seams(clock=clock, backend=backend))
    return trainer, backend


def events(report) -> list[str]:
    return [e["event"] for e in report.events]


def test_failure_free_run_takes_every_step_on_every_slice():
    trainer, backend = run(ElasticConfig(num_slices=2))
    report = trainer.fit()
    assert report.steps_completed == 10 and report.failures == []
    assert backend.steps_run == [(k, (0, 1)) for k in range(10)]
    assert report.losses == [1.0 / (k + 1) for k in range(10)]


def test_resize_shrinks_then_grows_back():
    trainer, backend = run(ElasticConfig(num_slices=2, policy="resize", min_slices=1), steps=40)
    backend.fail_at[(5, 1)] = FailureKind.NODE_DIED
    report = trainer.fit()
    assert report.steps_completed == 40
    (f,) = report.failures
    assert (f.kind, f.slice, f.step, f.slices_after, f.steps_rewound, f.restored_from) == ("node_died", 1, 5, 1, 1, "live")
    seq = events(report)
    assert seq.index("detected") < seq.index("shrink") < seq.index("grow")
    # Trained on one slice while the replacement came up, then on both.
    assert 1 in report.slices_per_step and report.slices_per_step[-1] == 2
    assert backend.steps_run[5] == (5, (0,))  # step 5 redone on the survivor at once


def test_pause_waits_for_the_replacement_and_never_trains_on_fewer():
    trainer, backend = run(ElasticConfig(num_slices=2, policy="pause", timeout_s=60), steps=20)
    backend.fail_at[(3, 0)] = FailureKind.PROCESS_DIED
    report = trainer.fit()
    assert report.steps_completed == 20
    assert set(report.slices_per_step) == {2}
    seq = events(report)
    assert seq.index("wait") < seq.index("slice_ready", seq.index("wait")) < seq.index("grow")
    (f,) = report.failures
    assert f.kind == "process_died" and f.recovered_s is not None and f.recovered_s >= 2.0  # the set-up time


def test_a_handled_failure_leaves_nothing_its_frames_held_to_the_cyclic_collector():
    """A failure found as a value and raised from a local (`lost =
    locator.watch(...); raise lost`, as the step runner does) is held by
    the frame its traceback holds. Once the controller has handled it, what
    that frame held (on a cluster: a step's gradient chunks' ObjectRefs,
    whose objects stay in Ray's object store while any ref lives) is freed
    at once, not at Python's next cyclic collection (off here)."""
    import gc
    import weakref

    class Chunk:  # stands for an ObjectRef the failing frame held
        pass

    trainer, backend = run(ElasticConfig(num_slices=2, policy="resize", min_slices=1), steps=12)
    held: list = []
    real = backend.run_step

    def run_step(k, slices, *args, **kw):
        if k == 5 and not held:
            chunk = Chunk()
            held.append(weakref.ref(chunk))
            lost = failure(FailureKind.PROCESS_DIED, 1, 0, k, "injected")
            raise lost
        return real(k, slices, *args, **kw)

    backend.run_step = run_step
    gc.collect()
    gc.disable()
    try:
        report = trainer.fit()
        assert [f.step for f in report.failures] == [5] and report.steps_completed == 12
        assert held[0]() is None, gc.get_referrers(held[0]())
    finally:
        gc.enable()


def test_fails_when_the_retry_budget_is_spent():
    trainer, backend = run(ElasticConfig(num_slices=2, policy="resize", min_slices=1, max_retries=1), steps=30)
    backend.fail_at[(3, 1)] = FailureKind.PROCESS_DIED
    backend.fail_at[(12, 0)] = FailureKind.HUNG
    with pytest.raises(RetryBudgetExhausted, match="max_retries"):
        trainer.fit()
    assert trainer.report.outcome == "failed" and "max_retries" in trainer.report.error
    assert [f.kind for f in trainer.report.failures] == ["process_died", "hung"]


def test_fails_when_no_replacement_comes_within_timeout():
    trainer, backend = run(ElasticConfig(num_slices=2, policy="pause", timeout_s=30), steps=20)
    backend.fail_at[(4, 1)] = FailureKind.NODE_DIED
    backend.capacity = False
    with pytest.raises(ReplacementTimeout, match="timeout_s"):
        trainer.fit()
    assert trainer.report.steps_completed == 4
    assert events(trainer.report)[-1] == "end"


def test_a_start_that_times_out_tells_unplaced_slices_from_slow_ones():
    config = ElasticConfig(num_slices=3, policy="pause", timeout_s=30, first_step_deadline_s=40)
    trainer, backend = run(config, steps=5, setup_s=1e6)  # set-up never ends
    backend.unplaced = {2}
    with pytest.raises(RunFailed) as got:
        trainer.fit()
    msg = str(got.value)
    assert got.value.setting == "num_slices"  # the first problem: more nodes, or fewer slices
    assert "only 0 of 3 slices were ready within 40 s" in msg
    assert "slice(s) [2] could not be placed" in msg and "lower num_slices" in msg
    assert "slice(s) [0, 1] were placed, but their workers were still starting" in msg
    # Every slice placed, none set up in time: the deadline is what to change.
    trainer, backend = run(config, steps=5, setup_s=1e6)
    with pytest.raises(RunFailed) as got:
        trainer.fit()
    assert got.value.setting == "first_step_deadline_s" and "could not be placed" not in str(got.value)
    assert "raise first_step_deadline_s" in str(got.value)


def test_losing_every_slice_restores_the_newest_snapshot():
    # One slice: snapshots every step; losing it rewinds to the last one.
    trainer, backend = run(ElasticConfig(num_slices=1, policy="pause", timeout_s=60), steps=12)
    backend.fail_at[(7, 0)] = FailureKind.NODE_DIED
    report = trainer.fit()
    assert report.steps_completed == 12
    (f,) = report.failures
    assert f.restored_from == "snapshot" and f.steps_rewound == 1
    assert any(e["event"] == "restore" and e["step"] == 7 for e in report.events)


def test_run_state_is_typed():
    from ray_elastic.control.states import Running, Waiting

    trainer, backend = run(ElasticConfig(num_slices=2, policy="pause", timeout_s=60), steps=6)
    seen = []
    backend.fail_at[(2, 1)] = FailureKind.NODE_DIED
    orig = backend.poll

    def poll(block_s=0.0):
        seen.append(trainer.state)
        return orig(block_s)

    backend.poll = poll
    trainer.fit()
    assert any(isinstance(s, Waiting) for s in seen)
    assert isinstance(trainer.state, Running) and not trainer.state.fresh


def test_resize_completes_the_step_in_flight_on_the_survivors():
    trainer, backend = run(ElasticConfig(num_slices=2, policy="resize", min_slices=1), steps=12)
    backend.partial_steps = True
    backend.fail_at[(5, 1)] = FailureKind.PROCESS_DIED
    report = trainer.fit()
    (f,) = report.failures
    assert (f.steps_rewound, f.compute_redone, f.slices_after) == (0, 0.5, 1)
    assert backend.finished == [(5, (0,))]
    assert [k for k, _ in backend.steps_run] == list(range(12))  # no step run twice
    assert report.losses == [1.0 / (k + 1) for k in range(12)]


def _fail_mid_apply(backend, k: int, lost: int, held: dict, kind=FailureKind.PROCESS_DIED) -> None:
    """Step k fails on slice `lost` after some survivors applied it:
    `held` sets the steps they are left at (-1: a slice whose hosts hold
    different steps)."""
    real = backend.run_step

    def run_step(step, slices, *a, **kw):
        if step == k and lost in slices:
            backend.held.update(held)
            raise failure(kind, lost, 0, step, "injected mid-apply")
        return real(step, slices, *a, **kw)

    backend.run_step = run_step


@pytest.mark.parametrize("kind,abort", [(FailureKind.PROCESS_DIED, False), (FailureKind.NODE_DIED, True),
                                        (FailureKind.HUNG, True)])
def test_survivors_stop_waiting_for_gradients_only_from_a_node_gone_or_silent(kind, abort):
    """A lost node's gradients may never arrive (Ray's pull waits out its
    timeout): the survivors' calls still waiting for them give up. A dead
    process's gradients are in its node's object store and still arrive,
    so the survivors complete the step."""
    trainer, backend = run(ElasticConfig(num_slices=3, policy="resize"), steps=8)
    _fail_mid_apply(backend, 5, 2, {0: 5, 1: 5}, kind)
    report = trainer.fit()
    assert report.steps_completed == 8 and backend.aborted_waits == [abort]


@pytest.mark.parametrize("held,redone", [({0: 6, 1: 5}, 0), ({0: 5, 1: -1}, 1)])
def test_survivors_apart_after_a_failure_mid_apply_take_the_newest_whole_state(held, redone):
    """Slice 2 dies mid-apply of step 5: slice 0 applied it and slice 1 did
    not (nothing is redone), or slice 1's hosts are apart (no whole slice
    applied it: step 5 is redone, as any step in flight without its
    gradients). The slices behind load the newest state a whole slice holds
    (its memory: the newest snapshot, of step 4, is older); nothing is
    rolled back to the snapshot."""
    trainer, backend = run(ElasticConfig(num_slices=3, policy="resize", snapshot_every_replicated=4), steps=10)
    _fail_mid_apply(backend, 5, 2, held)
    report = trainer.fit()
    (f,) = report.failures
    assert f.steps_rewound == redone and report.steps_completed == 10
    assert not any(e["event"] == "rewind" for e in report.events)
    newest = max(held.values())
    assert [k for k, _ in backend.steps_run].count(newest) == 1  # the step after it, once


def test_survivors_with_no_whole_state_go_back_to_the_snapshot():
    trainer, backend = run(ElasticConfig(num_slices=3, policy="resize", snapshot_every_replicated=4), steps=10)
    _fail_mid_apply(backend, 5, 2, {0: -1, 1: -1})
    report = trainer.fit()
    (f,) = report.failures
    assert f.steps_rewound == 2 and report.steps_completed == 10  # back to step 4's snapshot
    assert any(e["event"] == "rewind" and e["to_step"] == 4 for e in report.events)


@pytest.mark.parametrize("spares", [0, 1])
def test_pause_finishes_the_step_in_flight_once_the_replacement_joins(spares):
    """Paused, the survivors' gradients of the step in flight are kept: the
    step is finished (the lost slice's shards computed again) on the full
    mesh once the replacement, or at once the spare, has joined."""
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=60, spare_slices=spares)
    trainer, backend = run(config, steps=8)
    backend.partial_steps = True
    backend.fail_at[(5, 1)] = FailureKind.PROCESS_DIED
    report = trainer.fit()
    (f,) = report.failures
    joined = 2 if spares else 1
    assert backend.finished == [(5, tuple(sorted((0, joined))))]
    assert (f.steps_rewound, f.compute_redone) == (0, 0.5)
    assert report.steps_completed == 8 and [k for k, _ in backend.steps_run].count(5) == 1


def test_pause_redoes_the_step_when_a_second_slice_is_lost_while_waiting():
    """A second failure drops the kept gradients (they may be the lost
    slice's): the step is then redone whole."""
    trainer, backend = run(ElasticConfig(num_slices=3, policy="pause", timeout_s=60), steps=8, setup_s=5.0)
    backend.partial_steps = True
    backend.fail_at[(5, 1)] = FailureKind.PROCESS_DIED
    backend.fail_held = {2}  # slice 2 is found dead by the reconcile after slice 1's loss
    report = trainer.fit()
    assert backend.finished == []
    assert [f.steps_rewound for f in report.failures] == [1, 1]


def test_pause_with_a_hot_spare_recovers_without_waiting_for_a_new_slice():
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=60, spare_slices=1)
    trainer, backend = run(config, steps=20, setup_s=5.0)
    backend.fail_at[(6, 1)] = FailureKind.NODE_DIED
    report = trainer.fit()
    assert report.steps_completed == 20 and set(report.slices_per_step) == {2}
    (f,) = report.failures
    assert f.recovered_s < backend.setup_s  # the spare was ready: no set-up waited for
    grow = next(e for e in report.events if e["event"] == "grow")
    assert grow["joined"] == [2]  # the spare took slice 1's place
    assert backend.started.count(1) == 2  # slice 1's replacement: the next spare
    start = next(e for e in report.events if e["event"] == "start")
    assert start["slices"] == [0, 1] and start["spares"] == [2]


def test_spares_never_train_beyond_num_slices():
    trainer, backend = run(ElasticConfig(num_slices=2, spare_slices=2), steps=10)
    report = trainer.fit()
    assert set(report.slices_per_step) == {2}
    assert all(len(sl) == 2 for _, sl in backend.steps_run)


def test_a_silent_node_s_slice_is_replaced_on_a_new_placement_group():
    """A hung slice whose node does not answer keeps its old group's bundle
    there until Ray declares the node dead: its replacement starts on a new
    group; a hang on a node that answers reuses the old one."""
    config = ElasticConfig(num_slices=2, policy="pause")
    trainer, backend = run(config, steps=12)
    backend.fail_at[(3, 1)] = FailureKind.HUNG
    backend.silent.add((3, 1))
    backend.fail_at[(7, 0)] = FailureKind.HUNG
    report = trainer.fit()
    assert report.steps_completed == 12
    assert backend.new_groups == [1]
    assert backend.evicted == ["node1"]  # the silent node: Ray counts it alive, no group may wait on it
    replaces = [e for e in report.events if e["event"] == "replace"]
    assert [(e["slice"], e.get("new_group", False)) for e in replaces] == [(1, True), (0, False)]


def test_a_lost_node_s_slice_is_replaced_on_a_new_group_kept_off_that_node():
    """A slice whose node is gone (its raylet refuses connections) gets a
    new group kept off that node: left in the old group, the node's bundle
    is one Ray reschedules after its health checks, retrying without pause
    while no node can take it. A node_died whose host's own node still
    answers (the inputs it waited for were lost elsewhere) reuses the group."""
    config = ElasticConfig(num_slices=2, policy="pause")
    trainer, backend = run(config, steps=12)
    backend.fail_at[(3, 1)] = FailureKind.NODE_DIED
    backend.lost_nodes.add("node1")
    backend.fail_at[(7, 0)] = FailureKind.NODE_DIED
    report = trainer.fit()
    assert report.steps_completed == 12
    assert backend.new_groups == [1]
    assert backend.evicted == ["node1"]
    replaces = [e for e in report.events if e["event"] == "replace"]
    assert [(e["slice"], e.get("new_group", False)) for e in replaces] == [(1, True), (0, False)]


@pytest.mark.parametrize("policy", ["resize", "pause"])
def test_a_step_the_survivors_applied_before_the_failure_counts(policy):
    """A slice lost in the apply phase after the survivors had applied the
    step: nothing is redone, and the step's loss is in the report."""
    config = ElasticConfig(num_slices=2, policy=policy, timeout_s=60, **({"min_slices": 1} if policy == "resize" else {}))
    trainer, backend = run(config, steps=8)
    backend.applied_before_failure = True
    backend.fail_at[(5, 1)] = FailureKind.NODE_DIED
    report = trainer.fit()
    (f,) = report.failures
    assert f.steps_rewound == 0 and report.steps_completed == 8
    assert report.losses[5] == 1.0 / 6 and len(report.losses) == 8
    assert [k for k, _ in backend.steps_run].count(5) == 0  # never run again
    assert report.slices_per_step[5] == 2  # computed by both slices, the lost one included

"""Silent data corruption on a real cluster: a `corrupt` fault flips a real
bit in one worker's state (on one device, after its apply), the state
fingerprints differ, and the run names the slice, evicts it (its
replacement lands on another node), rolls back to the newest verified
snapshot and ends bitwise equal to a failure-free run. With two slices a
tie-break names the slice: a spare, or each slice, replays the steps
since the verified snapshot."""

from __future__ import annotations

import time

import pytest

from ray_elastic import Callback, ElasticConfig, ElasticTrainer, Fault

from tests.run_checks import assert_no_failures, assert_same_state, events

pytestmark = pytest.mark.cluster

STEPS = 16
FAULT_AT = 8
# Snapshots every step, so that one of the verified step is there for a
# tie-break to replay from (the interval chosen otherwise depends on this
# machine's timings).
EVERY_STEP = {"snapshot_every": 1, "snapshot_every_replicated": 1}


def _run(factory, config, faults=()):
    trainer = ElasticTrainer(factory, config, STEPS, faults=faults, keep_final_state=True)
    return trainer, trainer.fit()


@pytest.fixture(scope="module")
def ref3(cluster, lm_factory):
    """A failure-free run on three slices (the checks change no number)."""
    cluster.ensure_nodes(4)
    ref, report = _run(lm_factory, ElasticConfig(num_slices=3, policy="pause", timeout_s=120.0, grad_check_every=3))
    assert not report.failures and not events(report, "diverged")
    return ref


@pytest.fixture(scope="module")
def ref2(cluster, lm_factory):
    """A failure-free run on two slices."""
    cluster.ensure_nodes(2)
    ref, report = _run(lm_factory, ElasticConfig(num_slices=2, policy="resize", state_check_every=1, **EVERY_STEP))
    assert not report.failures and not events(report, "diverged")
    return ref


def test_a_corrupted_slice_is_named_evicted_and_the_run_rolled_back(nodes, lm_factory, ref3):
    nodes(4)  # three slices and the evicted one's replacement
    config = ElasticConfig(num_slices=3, policy="pause", timeout_s=120.0, state_check_every=1)
    ref = ref3

    seen: dict = {}
    holder: dict = {}

    def node_of_slice_1(e):
        if e["event"] == "fault" or (e["event"] == "grow" and 1 in e["joined"]):
            seen[e["event"]] = holder["trainer"].hosts(1)[0]["node_id"]

    trainer = holder["trainer"] = ElasticTrainer(
        lm_factory, config, STEPS, faults=(Fault("corrupt", 1, FAULT_AT, target="state"),), keep_final_state=True,
        on_event=node_of_slice_1)
    report = trainer.fit()
    assert report.steps_completed == STEPS
    [diverged] = events(report, "diverged")
    # The bit flips in the state the fault step's apply (or, if the fault
    # landed after it, the next one) makes; its fingerprint, made while
    # the next step's gradients compute, comes with the next apply.
    assert diverged["step"] in (FAULT_AT + 1, FAULT_AT + 2), diverged
    assert diverged["named"] == [[1, 0]]
    [f] = report.failures
    assert f.kind == "corrupted" and f.slice == 1
    assert f.restored_from == "snapshot"
    restore = [e for e in events(report, "restore") if e.get("verified")][-1]
    assert restore["step"] <= diverged["verified"] == diverged["step"] - 1
    assert f.steps_rewound == diverged["step"] - restore["step"]
    # The replacement is kept off the evicted host's node.
    assert seen.get("grow") and seen["grow"] != seen["fault"], seen
    assert_same_state(trainer.final_state, ref.final_state, STEPS)


# Under pause: the cross-check names the slice whatever the policy, and
# an eviction under resize is the replays' test's below.
@pytest.mark.parametrize("policy", ["pause"])
def test_a_slice_corrupting_its_gradients_is_caught_by_a_cross_check(nodes, lm_factory, ref3, policy):
    """Wrong gradients leave the replicas equal: the cross-check every 3
    steps (shard recomputed by the two other slices) names the slice, and
    the rollback goes back past its last clean check."""
    nodes(4)
    config = ElasticConfig(num_slices=3, policy=policy, timeout_s=120.0, grad_check_every=3)
    fault_at = 7  # between checks: the first corrupted update lands before the check at step 9 sees it
    trainer, report = _run(lm_factory, config, faults=(Fault("corrupt", 1, fault_at, target="grads+"),))
    assert report.steps_completed == STEPS
    diverged = events(report, "diverged")
    assert diverged and diverged[0]["named"] == [[1, 0]] and "gradient of shard" in diverged[0]["detail"]
    # Found within 2 * grad_check_every * slices steps of the fault.
    assert fault_at < diverged[0]["step"] <= fault_at + 2 * 3 * 3, diverged[0]
    assert diverged[0]["verified"] < fault_at + 1  # the last clean check came before the first bad gradient
    [f] = report.failures
    assert f.kind == "corrupted" and f.slice == 1
    restore = [e for e in events(report, "restore") if e["source"] in ("snapshot", "pending")]
    assert restore and restore[0]["step"] <= diverged[0]["verified"]
    assert_same_state(trainer.final_state, ref3.final_state, STEPS)


def test_two_slices_that_disagree_at_the_last_step_are_told_apart_by_replays(nodes, lm_factory, ref2, monkeypatch):
    """A bit flipped once by the last apply: no apply follows to report its
    state's fingerprint, so the last apply makes it itself, and the run
    does not end on it. No majority and no spare: each slice replays the
    steps since the verified snapshot alone; the one whose bit flipped
    does not make its state again, the other does, so the first is named,
    evicted, and the run goes on on the other (resize)."""
    monkeypatch.setenv("RAY_ELASTIC_PIPELINE", "0")  # the fault lands before the last apply is issued
    nodes(2)
    config = ElasticConfig(num_slices=2, policy="resize", state_check_every=1, **EVERY_STEP)
    trainer, report = _run(lm_factory, config, faults=(Fault("corrupt", 0, STEPS - 1, target="state"),))
    [tie] = events(report, "tie_break")
    [diverged] = events(report, "diverged")
    assert diverged["step"] == STEPS and diverged["verified"] == STEPS - 1, diverged
    assert tie["by"] == "replay" and tie["slices"] == [0, 1] and tie["named"] == [[0, 0]], tie
    assert tie["replayed_from"] <= diverged["verified"] < tie["step"] == diverged["step"]
    assert diverged["named"] == [[0, 0]] and "tie-break" in diverged["detail"]
    [f] = report.failures
    assert f.kind == "corrupted" and f.slice == 0 and f.restored_from == "snapshot"
    restore = [e for e in events(report, "restore") if e.get("verified")][-1]
    assert restore["step"] <= diverged["verified"]
    assert report.steps_completed == STEPS
    assert_same_state(trainer.final_state, ref2.final_state, STEPS)


def test_a_spare_breaks_the_tie_between_two_slices(nodes, lm_factory, ref2):
    """Two slices and a ready spare: the spare replays from the verified
    snapshot, agrees with the slice whose state is right, and the other is
    named and replaced by the spare."""
    nodes(4)  # two slices, the spare, and the evicted one's replacement (the next spare)
    config = ElasticConfig(num_slices=2, spare_slices=1, policy="pause", timeout_s=120.0, state_check_every=1,
                           **EVERY_STEP)
    ready: list = []

    class HoldForTheSpare(Callback):
        """The steps before the fault wait (a second each) until the spare
        is set up: on a busy machine its set-up can outlast them, and the
        tie-break then (rightly) replays on the two slices instead."""

        def on_event(self, e):
            if e["event"] == "slice_ready" and e["slice"] == 2:
                ready.append(e)

        def on_step(self, step, metrics):
            if step < FAULT_AT and not ready:
                time.sleep(1.0)

    trainer = ElasticTrainer(lm_factory, config, STEPS, faults=(Fault("corrupt", 1, FAULT_AT, target="state"),),
                             keep_final_state=True, callbacks=[HoldForTheSpare()])
    report = trainer.fit()
    fault = events(report, "fault")[0]
    assert ready and ready[0]["t"] < fault["t"], (ready, fault)  # the premise: a ready spare at the fault
    [tie] = events(report, "tie_break")
    assert tie["by"] == "spare" and tie["slices"] == [2] and tie["named"] == [[1, 0]], tie
    [f] = report.failures
    assert f.kind == "corrupted" and f.slice == 1
    assert 2 in next(e for e in events(report, "grow"))["joined"]  # the spare took its place
    assert report.steps_completed == STEPS
    assert_same_state(trainer.final_state, ref2.final_state, STEPS)


class _HoldForTheSpare(Callback):
    """The steps before `until` wait (a second each) until slice `spare` is
    set up: on a busy machine its set-up can outlast them, and a tie-break
    then (rightly) goes to the two slices instead."""

    def __init__(self, spare: int, until: int):
        self.spare, self.until, self.ready = spare, until, []

    def on_event(self, e):
        if e["event"] == "slice_ready" and e["slice"] == self.spare:
            self.ready.append(e)

    def on_step(self, step, metrics):
        if step < self.until and not self.ready:
            time.sleep(1.0)


def test_a_spare_names_the_slice_behind_a_gradient_mismatch_of_two(nodes, lm_factory, ref2):
    """Two slices, one sending wrong gradients from step 7 on: the cross-
    check of step 9 disagrees with no majority; the spare loads the state of
    step 9 (the snapshot kept for it) and computes the shard again, so the
    slice is named, replaced by the spare, and the run ends bitwise equal."""
    nodes(4)
    config = ElasticConfig(num_slices=2, spare_slices=1, policy="pause", timeout_s=120.0, grad_check_every=3,
                           state_check_every=3)  # the check step's state verified: the tie-break's premise
    hold = _HoldForTheSpare(spare=2, until=7)
    trainer = ElasticTrainer(lm_factory, config, STEPS, faults=(Fault("corrupt", 1, 7, target="grads+"),),
                             keep_final_state=True, callbacks=[hold])
    report = trainer.fit()
    fault = events(report, "fault")[0]
    assert hold.ready and hold.ready[0]["t"] < fault["t"], (hold.ready, fault)  # the premise: a ready spare
    [tie] = events(report, "tie_break")
    assert (tie["of"], tie["step"], tie["by"], tie["slices"], tie["named"]) == ("gradient", 9, "spare", [2], [[1, 0]])
    [diverged] = events(report, "diverged")
    assert diverged["named"] == [[1, 0]] and "computed it again" in diverged["detail"]
    [f] = report.failures
    assert f.kind == "corrupted" and f.slice == 1
    assert 2 in next(e for e in events(report, "grow"))["joined"]
    assert report.steps_completed == STEPS
    assert_same_state(trainer.final_state, ref2.final_state, STEPS)


@pytest.mark.slow  # the same path as the spare's; its unit tests: test_tie_break.py
def test_without_a_spare_a_gradient_flipped_once_is_told_apart_by_computing_it_again(nodes, lm_factory, ref2):
    """Two slices, no spare, slice 1 flips a bit of its gradient once, at
    the cross-check of step 6 whose shard it owns: each slice loads the
    state of step 6 and computes the shard again; slice 0 repeats itself,
    slice 1 does not, so slice 1 is named."""
    nodes(3)
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=120.0, grad_check_every=3, state_check_every=3)
    trainer, report = _run(lm_factory, config, faults=(Fault("corrupt", 1, 6, target="grads"),))
    [tie] = events(report, "tie_break")
    assert (tie["of"], tie["step"], tie["by"], tie["slices"], tie["named"]) == ("gradient", 6, "replay", [0, 1],
                                                                               [[1, 0]]), tie
    [f] = report.failures
    assert f.kind == "corrupted" and f.slice == 1
    assert report.steps_completed == STEPS
    assert_same_state(trainer.final_state, ref2.final_state, STEPS)


def test_a_checker_glitch_that_is_not_repeated_evicts_no_one(nodes, lm_factory, ref2):
    """Two slices, no spare: slice 1's computation for the cross-check of
    step 9 (slice 0's shard) flips a bit once; no step applies it. Both
    slices, computing the shard again from step 9's state, make the
    gradient slice 0 sent, so nothing wrong entered the state and no chip
    is shown faulty: no failure, no rollback, the step since taken again,
    the end bitwise equal."""
    nodes(3)
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=120.0, grad_check_every=3, state_check_every=3)
    trainer, report = _run(lm_factory, config, faults=(Fault("corrupt", 1, 7, target="check"),))
    [tie] = events(report, "tie_break")
    assert (tie["of"], tie["step"], tie["by"], tie["named"], tie["retaken"]) == ("gradient", 9, "replay", [], True), tie
    assert "not repeated" in tie["dismissed"]
    assert_no_failures(report)
    assert not events(report, "diverged") and not events(report, "restore") and not events(report, "rewind")
    assert report.steps_completed == STEPS
    assert_same_state(trainer.final_state, ref2.final_state, STEPS)


def test_without_a_spare_a_lasting_gradient_fault_is_named_by_the_known_answer(nodes, lm_factory, ref2):
    """Two slices, no spare, slice 1 computing every gradient wrong from
    step 7 on: the cross-check of step 9 disagrees, and each slice, loading
    step 9's state, repeats its own gradient. Each then computes again the
    gradient of the check of step 6, which both had agreed on, from step
    6's state: slice 0 makes it again, slice 1 does not, so slice 1 is
    named, evicted, and the run rolls back to step 6 and ends bitwise
    equal."""
    nodes(3)
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=120.0, grad_check_every=3, state_check_every=3)
    trainer, report = _run(lm_factory, config, faults=(Fault("corrupt", 1, 7, target="grads+"),))
    [tie] = events(report, "tie_break")
    assert (tie["of"], tie["step"], tie["by"], tie["known_step"], tie["named"]) == ("gradient", 9, "known_answer", 6,
                                                                                   [[1, 0]]), tie
    [diverged] = events(report, "diverged")
    assert diverged["named"] == [[1, 0]] and "slice 0 made it again, slice 1 did not" in diverged["detail"]
    [f] = report.failures
    assert f.kind == "corrupted" and f.slice == 1
    restore = [e for e in events(report, "restore") if e.get("verified")]
    assert restore and restore[0]["step"] == 6
    assert report.steps_completed == STEPS
    assert_same_state(trainer.final_state, ref2.final_state, STEPS)

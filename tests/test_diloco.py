"""DiLoCo's pure parts: its flags' validation, the rounds' bookkeeping
(control/diloco.py) and the metrics averaged over replicas. The runs
themselves are in test_diloco_e2e.py."""

from __future__ import annotations

import pytest

from ray_elastic import CheckpointConfig, ElasticConfig, ElasticTrainer, Fault
from ray_elastic.control.diloco import Rounds
from ray_elastic.dispatch.calls import replica_mean
from ray_elastic.errors import ConfigError


def test_maxtext_defaults_and_the_checks_that_do_not_apply():
    c = ElasticConfig(enable_diloco=True)
    assert (c.diloco_sync_period, c.diloco_outer_lr, c.diloco_outer_momentum) == (36, 0.3, 0.9)
    # The replicas differ between synchronizations by design.
    assert (c.state_check_every, c.grad_check_every, c.snapshot_every) == (0, 0, 0)
    plain = ElasticConfig()
    assert not plain.enable_diloco and plain.state_check_every == 10 and plain.snapshot_every == 1


@pytest.mark.parametrize("kw, setting", [
    ({"diloco_sync_period": 0}, "diloco_sync_period"),
    ({"diloco_outer_lr": 0.0}, "diloco_outer_lr"),
    ({"diloco_outer_momentum": 1.0}, "diloco_outer_momentum"),
    ({"enable_diloco": 1}, "enable_diloco"),
    ({"enable_diloco": True, "num_slices": 2, "batch_shards": 3}, "batch_shards"),
    ({"enable_diloco": True, "exchange": "direct"}, "enable_diloco"),
    ({"enable_diloco": True, "num_slices": 4, "slices_per_leader": 2}, "enable_diloco"),
])
def test_bad_flags_name_the_setting(kw, setting):
    with pytest.raises(ConfigError) as e:
        ElasticConfig(**kw)
    assert e.value.setting == setting


def test_fault_phases_other_than_the_inner_steps_are_refused():
    with pytest.raises(ConfigError) as e:
        ElasticTrainer(lambda: None, ElasticConfig(enable_diloco=True), 4, faults=[Fault("kill", 1, 2, phase="apply")])
    assert e.value.setting == "faults"


def test_a_checkpoint_without_diloco_or_of_other_replicas_is_refused(tmp_path):
    import numpy as np

    from ray_elastic.checkpoint.store import CheckpointStore

    plain = str(tmp_path / "plain")
    CheckpointStore(plain).save(2, {"params": {"w": np.zeros(2, np.float32)}}, {"seed": 0, "batch_shards": 2})
    rounds = Rounds(ElasticConfig(enable_diloco=True), 8, checkpoint=CheckpointConfig(plain))
    with pytest.raises(ConfigError) as e:
        rounds.preflight()
    assert e.value.setting == "checkpoint.path" and "without DiLoCo" in str(e.value)
    three = str(tmp_path / "three")
    CheckpointStore(three).save(2, {"global": {"w": np.zeros(2, np.float32)}},
                                {"seed": 0, "batch_shards": 3, "diloco": {"num_replicas": 3}})
    rounds = Rounds(ElasticConfig(enable_diloco=True), 8, checkpoint=CheckpointConfig(three))
    with pytest.raises(ConfigError) as e:
        rounds.preflight()
    assert e.value.setting in ("batch_shards", "num_slices")
    assert Rounds(ElasticConfig(enable_diloco=True), 8, checkpoint=CheckpointConfig(str(tmp_path / "new"))).preflight() is None


def test_rounds_end_every_period_and_at_the_run_end():
    r = Rounds(ElasticConfig(num_slices=3, batch_shards=6, enable_diloco=True, diloco_sync_period=4), steps=10)
    assert [k for k in range(11) if r.boundary(k)] == [4, 8, 10]
    assert [r.shards_of(i) for i in range(3)] == [(0, 3), (1, 4), (2, 5)]
    assert r.assignment({0, 2}) == {0: (0, 3), 2: (2, 5)}
    assert r.owed(4) and not r.owed(5)
    r.round_start = 4  # synchronized at 4
    assert not r.owed(4) and r.owed(8)


def test_joins_wait_for_a_round_start_under_resize_only():
    resize = Rounds(ElasticConfig(enable_diloco=True, policy="resize", diloco_sync_period=4), steps=12)
    pause = Rounds(ElasticConfig(enable_diloco=True, diloco_sync_period=4), steps=12)
    off = Rounds(ElasticConfig(policy="resize"), steps=12)
    resize.round_start = pause.round_start = 4
    assert [resize.may_join(k) for k in (4, 5, 7)] == [True, False, False]
    assert all(pause.may_join(k) for k in (4, 5, 7)) and off.may_join(5) and not off.owed(4)


def test_a_slice_live_without_a_replica_takes_the_lowest_free_one():
    r = Rounds(ElasticConfig(num_slices=3, enable_diloco=True), steps=8)
    assert r.replica_map({0, 3, 2}) == {0: 0, 2: 2, 3: 1}


def test_metrics_are_averaged_over_replicas_in_replica_order():
    metrics = {(5, 0): {"loss": 3.0, "aux": {"acc": 0.5}}, (5, 1): {"loss": 3.0, "aux": {"acc": 0.5}},
               (0, 0): {"loss": 1.0, "aux": {"acc": 0.25}}}
    out = replica_mean(metrics, {0: 0, 5: 1})
    assert out[(0, 0)]["loss"] == out[(5, 1)]["loss"] == 2.0
    assert out[(5, 0)]["aux"] == {"acc": 0.375} and out[(0, 0)]["replica_loss"] == 1.0


def test_the_demo_and_job_driver_option():
    from ray_elastic.cli import build_parser
    from ray_elastic.cli_options import elastic_config

    from ray_elastic import CpuSlice

    args = build_parser().parse_args(["demo", "--diloco", "10", "--policy", "pause"])
    config = elastic_config(args, CpuSlice())
    assert config.enable_diloco and config.diloco_sync_period == 10 and config.diloco_outer_lr == 0.3
    assert not elastic_config(build_parser().parse_args(["demo"]), CpuSlice()).enable_diloco
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--diloco", "0"])


def test_progress_lines_show_the_rounds_and_the_bytes():
    import io

    from ray_elastic.observe.progress import ProgressCallback

    stream = io.StringIO()
    p = ProgressCallback(12, stream=stream)
    p.on_event({"t": 1.0, "event": "diloco_sync", "step": 4, "replicas": [0, 1], "slices": [0, 1],
                "bytes_across_slices": 892360})
    p.on_event({"t": 2.0, "event": "diloco_caught_up", "slice": 2, "replica": 1, "steps": 2})
    p.on_event({"t": 3.0, "event": "diloco_sync", "step": 8, "replicas": [0], "slices": [0],
                "bytes_across_slices": 0, "lost": [1]})
    p.on_event({"t": 4.0, "event": "diloco_sync_undone", "step": 8, "hosts": 1})
    lines = stream.getvalue().splitlines()
    assert "step 4: DiLoCo replicas [0, 1] synchronized, 0.89 MB across slices (0.89 MB in all)" in lines[0]
    assert "slice 2 took replica 1's place and recomputed its 2 inner step(s) of the round" in lines[1]
    assert "replica(s) [1] left this round" in lines[2] and "(0.89 MB in all)" in lines[2]
    assert "taken back on 1 host(s): the round from step 8 ends again with every replica" in lines[3]


def test_sync_faults_are_for_diloco_runs_only():
    with pytest.raises(ConfigError) as e:
        ElasticTrainer(lambda: None, ElasticConfig(), 4, faults=[Fault("kill", 1, 2, phase="sync")])
    assert e.value.setting == "faults"


class _Remote:
    """An actor method's stand-in: records each call's arguments."""

    def __init__(self, calls: list):
        self.calls = calls

    def options(self, **_):
        return self

    def remote(self, *args):
        self.calls.append(args)
        return object()


class _Worker:
    def __init__(self):
        self.calls: list = []
        self.inner_step = _Remote(self.calls)


class _Gather:
    def gather(self, calls, k, wait, live):
        return {(c.slice_id, c.host): {"loss": 1.0} for c in calls}


def test_an_inner_step_waits_for_the_round_start_state_asked_before_it():
    """Ray runs a threaded actor's calls in no set order: the state of a
    round's start, asked of a host before its next inner step, is that
    step's dependency, or it could be taken a step late. Only that host's
    next step waits for it, and not a replacement worker's."""
    from types import SimpleNamespace

    from ray_elastic.dispatch.diloco_runner import DilocoRunner

    a, b, c = _Worker(), _Worker(), _Worker()
    live = {0: SimpleNamespace(workers=[a, b])}
    runner = DilocoRunner(_Gather(), spec=None, blocks=1, clock=lambda: 0.0)
    state = object()
    runner.hold_before_next(0, [a], [state])
    runner.inner(4, live, {0: (0,)}, {0: 0}, 10.0, lambda: None)
    assert a.calls[-1][3:] == (state,) and b.calls[-1][3:] == ()
    runner.inner(5, live, {0: (0,)}, {0: 0}, 10.0, lambda: None)
    assert a.calls[-1][3:] == ()
    runner.hold_before_next(0, [a], [state])
    runner.inner(8, {0: SimpleNamespace(workers=[c, b])}, {0: (0,)}, {0: 0}, 10.0, lambda: None)
    assert c.calls[-1][3:] == ()


def test_a_retired_slice_s_held_round_start_states_are_let_go():
    """The states held for a slice's next inner step go when it leaves:
    its id may not be live again, and they would stay referenced (in the
    object store, on a cluster) as long as the backend."""
    import weakref

    from ray_elastic.dispatch.diloco_runner import DilocoRunner

    class State:
        pass

    a, b = _Worker(), _Worker()
    runner = DilocoRunner(_Gather(), spec=None, blocks=1, clock=lambda: 0.0)
    mine, other = State(), State()
    kept, kept_other = weakref.ref(mine), weakref.ref(other)
    runner.hold_before_next(1, [a], [mine])
    runner.hold_before_next(2, [b], [other])
    del mine, other
    assert kept() is not None
    runner.forget(1)
    assert kept() is None and kept_other() is not None  # slice 2's stays for its next step


class _JoinBackend:
    """A backend whose joiner's node goes while it recomputes its round."""

    def __init__(self):
        self.started: list = []

    def undo_sync(self, live, to, deadline_s):
        return []

    def node_alive(self, node):
        return node != "gone"

    def load(self, slices, ref, timeout_s):
        pass

    def catch_up(self, s, donor, steps, shards, deadline_s):
        from ray_elastic.errors import NodeDied

        raise NodeDied(s, 0, 6, "the node's raylet stopped taking connections")

    def hosts(self, s):
        return [{"node_id": "gone"}]

    def retire(self, s):
        pass

    def start(self, s, new_group=False, evict=()):
        self.started.append((s, new_group, evict))


def test_a_joiner_whose_node_went_is_replaced_away_from_it():
    """A spare lost with its node while it recomputes the round is
    replaced on a new group kept off that node, as a live slice is."""
    from ray_elastic.checkpoint.snapshots import SnapshotStore
    from ray_elastic.control.membership import Membership

    rounds = Rounds(ElasticConfig(num_slices=2, spare_slices=1, enable_diloco=True, diloco_sync_period=4), steps=12)
    backend = _JoinBackend()
    members = Membership(backend, SnapshotStore(), lambda *a, **k: None)
    members.live, members.ready = {0}, {2}
    rounds.round_start = 4
    rounds.keep_round_states({0: [("r0", ("a",))], 1: [("r1", ("b",))]})
    assert rounds.join([2], 6, members, 10.0) is False
    assert backend.started == [(2, True, ("gone",))] and members.coming == {2} and 2 not in members.live


class _RecomputingBackend(_JoinBackend):
    """A backend whose joiner recomputes its replica's steps, each with a
    loss of its own: step k's is 10 + k."""

    def catch_up(self, s, donor, steps, shards, deadline_s):
        self.started.append(("caught up", s, tuple(steps)))
        return {k: {(s, 0): {"loss": 10.0 + k, "aux": {"acc": 0.5}}} for k in steps}

    def hosts(self, s):
        return [{"node_id": "n"}]


def _survivor(loss: float) -> dict:
    return {(0, 0): {"loss": loss, "aux": {"acc": 0.25}}}


def test_under_pause_the_step_a_replica_was_lost_in_reports_every_replicas_loss():
    """Replica 1 (slice 1) is lost in inner step 5; replica 0 took it.
    Held until the spare (slice 2) recomputes replica 1's steps 4 and 5,
    the step's loss is then the mean of both replicas' in replica order:
    the failure-free step's, bit for bit."""
    from ray_elastic.checkpoint.snapshots import SnapshotStore
    from ray_elastic.control.membership import Membership
    from ray_elastic.dispatch.calls import StepResult

    rounds = Rounds(ElasticConfig(num_slices=2, spare_slices=1, enable_diloco=True, diloco_sync_period=4), steps=12)
    backend = _RecomputingBackend()
    members = Membership(backend, SnapshotStore(), lambda *a, **k: None)
    members.live, members.ready = {0}, {2}
    rounds.round_start = 4
    rounds.keep_round_states({0: [("r0", ("n",))], 1: [("r1", ("n",))]})
    survivors, held = rounds.survivors_step(5, StepResult(_survivor(0.1), {}), paused=True)
    assert held and survivors.loss == 0.1 and survivors.aux == {"acc": 0.25}
    assert rounds.recomputed() is None  # replica 1's loss is not in yet
    assert rounds.join([2], 6, members, 10.0)
    assert ("caught up", 2, (4, 5)) in backend.started
    full = rounds.recomputed()
    free = replica_mean({(0, 0): {"loss": 0.1, "aux": {"acc": 0.25}}, (1, 0): {"loss": 15.0, "aux": {"acc": 0.5}}},
                        {0: 0, 1: 1})
    assert full.loss == free[(0, 0)]["loss"] == (0.1 + 15.0) / 2 and full.aux == {"acc": 0.375}
    assert rounds.recomputed() is None  # reported once


def test_under_resize_the_step_a_replica_was_lost_in_reports_the_survivors_mean():
    """No one recomputes a replica lost under resize: its step's loss is
    the mean over the replicas left, those its round's outer step averages;
    a replica that took over a lost one's id keeps its own place in the order."""
    from ray_elastic.dispatch.calls import StepResult

    rounds = Rounds(ElasticConfig(num_slices=3, batch_shards=3, enable_diloco=True, policy="resize"), steps=8)
    rounds.replicas = {0: 0, 1: 1, 4: 2}
    metrics = {(4, 0): {"loss": 3.0, "aux": {}}, (0, 0): {"loss": 1.0, "aux": {}}}
    result, held = rounds.survivors_step(5, StepResult(metrics, {}), paused=False)
    assert not held and result.loss == 2.0 and result.metrics[(4, 0)]["replica_loss"] == 3.0
    assert rounds.recomputed() is None


def test_a_held_step_is_forgotten_when_the_run_goes_back_before_it():
    from ray_elastic.checkpoint.snapshots import SnapshotStore
    from ray_elastic.control.membership import Membership
    from ray_elastic.dispatch.calls import StepResult

    rounds = Rounds(ElasticConfig(num_slices=2, spare_slices=1, enable_diloco=True, diloco_sync_period=4), steps=12)
    rounds.round_start = 4
    rounds.keep_round_states({0: [("r0", ("n",))], 1: [("r1", ("n",))]})
    rounds.survivors_step(5, StepResult(_survivor(0.1), {}), paused=True)
    rounds.restart(4)  # every replica lost: back to the round's start, step 5 taken again and reported then
    members = Membership(_RecomputingBackend(), SnapshotStore(), lambda *a, **k: None)
    members.live, members.ready = {0}, {2}
    assert rounds.join([2], 6, members, 10.0)
    assert rounds.recomputed() is None


class _Heard:
    def __init__(self):
        self.steps: list = []

    def on_step(self, step, metrics):
        self.steps.append((step, metrics["loss"], metrics["acc"]))


def test_a_held_report_goes_out_with_every_replicas_loss_or_as_it_is():
    from ray_elastic.control.step_reports import StepReports
    from ray_elastic.dispatch.calls import StepResult

    heard = _Heard()
    reports = StepReports([heard])
    survivors = StepResult({(0, 0): {"loss": 1.0, "aux": {"acc": 0.25}}}, {})
    reports.report(6, survivors, 0.5, 2, held=True)
    assert reports.holding and heard.steps == []
    reports.release(6, StepResult({(0, 0): {"loss": 2.0, "aux": {"acc": 0.5}}}, {}))
    assert heard.steps == [(6, 2.0, 0.5)] and not reports.holding
    reports.report(7, survivors, 0.5, 2, held=True)
    reports.release(5)  # the run went back to step 5: step 7 is taken again, and reported then
    reports.report(8, survivors, 0.5, 2, held=True)
    reports.release(8)  # the run ended before the replacement joined: the survivors' loss
    assert heard.steps == [(6, 2.0, 0.5), (8, 1.0, 0.25)]


def test_a_closed_run_keeps_no_round_start_state():
    """The run is over: the round-start states and global copies it kept
    (pause) are let go, so a driver keeping the trainer keeps none."""
    rounds = Rounds(ElasticConfig(num_slices=2, enable_diloco=True, diloco_sync_period=4), steps=12)
    rounds.round_start = 4
    rounds.keep_round_states({0: [("r0", ("a",))], 1: [("r1", ("b",))]})
    assert rounds.round_state_refs() == {0: "r0", 1: "r1"}
    rounds.close()
    assert rounds.round_state_refs() == {}


def test_the_final_state_is_the_lowest_replicas():
    """After replacements the lowest slice id may hold another replica:
    the final state is replica 0's, as in a failure-free run."""
    rounds = Rounds(ElasticConfig(num_slices=3, batch_shards=3, enable_diloco=True), steps=8)
    rounds.replicas = {0: 2, 1: 1, 3: 0}
    assert rounds.first({0, 1, 3}) == 3
    assert Rounds(ElasticConfig(num_slices=3), steps=8).first({2, 0, 1}) == 0

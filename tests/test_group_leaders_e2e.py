"""Group leaders (`slices_per_leader`) on a real local Ray cluster with
real JAX workers: the same results as the driver alone, bitwise, with and
without failures; a slice killed in the gradient phase redoes no step; a
leader whose process is killed is replaced without losing a slice or a
step. The reduction tree's fan-in is lowered to 2 so that 4 slices in 2
groups have a tree (2 shards per leader, one level each; the driver sums
the two)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import ray

from ray_elastic import ElasticConfig, ElasticTrainer, Fault
from ray_elastic.callbacks import Callback
from ray_elastic.dispatch.grouped_runner import GroupedRunner
from tests.test_elastic_e2e import _assert_bitwise_equal

pytestmark = pytest.mark.cluster

STEPS = 12
FAIL_AT = 5


# First in the module: it needs one node, and the runs after it four; run
# after them, it would remove three nodes busy with their kept slices.
@ray.remote(num_cpus=0, max_concurrency=2)
class _Gate:
    """Holds a value back until released: an input that comes late, as a
    driver's call that reaches a worker after the calls waiting on it."""

    def __init__(self):
        self._open = threading.Event()

    def hold(self, refs: list):
        self._open.wait(300)
        return ray.get(refs[0])

    def release(self) -> None:
        self._open.set()


def test_a_worker_runs_a_ready_call_beside_as_many_waiting_calls_as_a_step_can_leave(nodes, lm_factory):
    """With leaders, a worker may get calls that wait on a call from the
    other caller (the driver's top of the tree) before that call: it must
    still run it. On one real slice worker, 12 reduce calls (two steps'
    worth at the most: slice_group.WAITING_CALLS) wait for a held input;
    a reduce issued after them, whose input is in, completes meanwhile,
    and once the input comes the 12 give its sum. With the 3 threads the
    worker had, the ready call waited behind them (a stalled step)."""
    import os
    import time

    from ray_elastic.cluster.slice_group import WAITING_CALLS, RaySlices
    from ray_elastic.config import CpuSlice

    waiting = 12
    assert WAITING_CALLS > waiting
    nodes(1)
    slices = RaySlices(CpuSlice(), lm_factory, seed=0, num_shards=1, run_name=f"test-threads-{os.getpid()}")
    gate = _Gate.remote()
    try:
        p = slices.start(0)
        deadline = time.monotonic() + 180
        live = None
        while live is None and time.monotonic() < deadline:
            live = slices.poll(p)
            time.sleep(0.2)
        assert live is not None, "the slice did not start"
        w = live.workers[0]
        _, payload = w.compute_grads.options(num_returns=2, concurrency_group="compute").remote(0, (0,))
        held = gate.hold.remote([payload])
        late = [w.reduce.options(num_returns=2).remote(0, (0,), [held]) for _ in range(waiting)]
        ready_status, ready_sum = w.reduce.options(num_returns=2).remote(0, (0,), [payload])
        ray.get(ready_status, timeout=60)  # a stalled worker raises GetTimeoutError here
        assert not ray.wait([s for s, _ in late], num_returns=1, timeout=0)[0], "the held input came early"
        gate.release.remote()
        import jax
        import numpy as np

        want = jax.tree.leaves(ray.get(ready_sum))
        assert want
        for status, got in late:
            assert ray.get(status, timeout=60) == ray.get(ready_status)
            for x, y in zip(jax.tree.leaves(ray.get(got)), want, strict=True):
                np.testing.assert_array_equal(x, y)
    finally:
        ray.kill(gate)
        slices.shutdown()


@pytest.fixture
def fan_in_2(monkeypatch):
    import ray_elastic.dispatch.step_runner as step_runner

    monkeypatch.setattr(step_runner, "APPLY_FAN_IN", 2)


def _run(factory, leaders: int, faults=(), on_event=None, cluster=None, **kw):
    kw.setdefault("policy", "resize")
    cfg = ElasticConfig(num_slices=4, timeout_s=120.0, slices_per_leader=leaders, **kw)
    trainer = ElasticTrainer(factory, cfg, STEPS, faults=faults, on_event=on_event, keep_final_state=True,
                             remove_node=cluster.remove_node if cluster else None)
    return trainer, trainer.fit()


@pytest.fixture(scope="module")
def reference(cluster, lm_factory):
    """The driver alone, no leaders, no failure, fan-in 2, with the
    default exchange (the reduce-scatter): at one shard per slice it adds
    in the order of the leaders' tree, so the leaders' runs must give its
    bits. (The direct hand-off's pipelined tree running through without a
    stall: tests/test_elastic_e2e.py::test_reduction_tree_pipelined_runs_through,
    slow, with the tree's levels counted.)"""
    import ray_elastic.dispatch.step_runner as step_runner

    cluster.ensure_nodes(4)
    saved = step_runner.APPLY_FAN_IN
    step_runner.APPLY_FAN_IN = 2
    try:
        trainer, report = _run(lm_factory, 0)
    finally:
        step_runner.APPLY_FAN_IN = saved
    assert report.steps_completed == STEPS and not report.failures
    runner = trainer.members.backend.runner
    assert not isinstance(runner, GroupedRunner) and runner.steps_ahead >= STEPS - 2
    return trainer.final_state


@pytest.mark.slow
def test_a_slice_killed_in_the_gradient_phase_redoes_no_step(reference, nodes, lm_factory, fan_in_2):
    """Slice 1 (leader 0's group, with slice 0) is killed as step 0's
    gradient calls are issued (the first step: nothing was issued ahead,
    so its gradients are still to come): leader 0 reports a process death
    in the gradient phase, the other leader's part is kept, slice 0
    computes the lost shard, and the step completes on the 3 survivors."""
    nodes(4)
    events = []
    trainer, report = _run(lm_factory, 2, faults=(Fault("kill", 1, 0),), on_event=events.append)
    assert report.steps_completed == STEPS and len(report.failures) == 1
    f = report.failures[0]
    assert f.kind == "process_died" and f.slice == 1 and f.step == 0
    assert f.steps_rewound == 0 and f.compute_redone == 0.25, report.events
    assert any(e["event"] == "step_completed_on_survivors" and e["shards_recomputed"] == 1 for e in events)
    # What the leaders did, not what the driver expected: one shard computed again, all told.
    assert trainer.members.backend.runner.shards_recomputed == 1
    assert report.slices_per_step[0] == 3
    _assert_bitwise_equal(trainer.final_state, reference)


def test_a_killed_leader_is_replaced_and_nothing_is_lost(reference, nodes, lm_factory, fan_in_2):
    """A leader's process is SIGKILLed mid-step (while its step call waits
    on its group's calls): the driver starts another, which issues the
    group's part again; no slice is lost, no step redone."""
    nodes(4)
    killed = []

    class Kill(Callback):
        def on_start(self, trainer):
            self.trainer = trainer

        def on_step(self, step, metrics):
            if step == FAIL_AT and not killed:
                leader = self.trainer.members.backend.runner.leaders[0]
                pid = ray.get(leader.ping.remote())
                killed.append(pid)
                # Once the next step's calls are out, not between steps.
                threading.Timer(0.1, os.kill, (pid, signal.SIGKILL)).start()

    # A step slowed past the 10 s deadline floor by a busy machine (the
    # suite's other processes on 2 cores) would count as a slice failure;
    # the point here is that a leader's loss is none.
    cfg = ElasticConfig(num_slices=4, policy="resize", timeout_s=120.0, slices_per_leader=2,
                        step_deadline_floor_s=60.0)
    trainer = ElasticTrainer(lm_factory, cfg, STEPS, callbacks=[Kill()], keep_final_state=True)
    report = trainer.fit()
    assert killed
    assert report.steps_completed == STEPS and not report.failures
    runner = trainer.members.backend.runner
    assert runner.leaders_replaced == 1
    # Its replacement took over the step it died in: it applied the sum, or
    # issued its group's part again.
    assert sum(runner.leader_restarts.values()) == 1, runner.leader_restarts
    _assert_bitwise_equal(trainer.final_state, reference)


@pytest.mark.slow
def test_a_node_removed_with_leaders(reference, nodes, lm_factory, fan_in_2):
    """Slice 2's node (leader 1's group) is removed with its processes:
    leader 1 finds the node gone, the other leader's call is called off,
    the survivors settle and the run ends bitwise as the reference."""
    cluster = nodes(4)
    trainer, report = _run(lm_factory, 2, faults=(Fault("remove_node", 2, FAIL_AT),), cluster=cluster)
    assert report.steps_completed == STEPS and len(report.failures) == 1
    f = report.failures[0]
    assert f.kind == "node_died" and f.slice == 2 and f.steps_rewound <= 1
    _assert_bitwise_equal(trainer.final_state, reference)


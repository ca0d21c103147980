"""Slices kept from a completed run for the driver's next one
(ElasticConfig.keep_workers, cluster/kept_workers.py), on a real local
cluster: the next run starts in the same processes, with the same program
or another, and computes, bit for bit, what new workers compute, after a
run with faults that last only for it too; a fault that outlasts its run,
a run that cannot use them and `release_workers()` leave none behind."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest
import ray

from ray_elastic import Callback, ConfigError, CpuSlice, ElasticConfig, ElasticTrainer, Fault, release_workers
from ray_elastic.config import KEEP_WORKERS_ENV

pytestmark = pytest.mark.cluster

STEPS = 8


class _Pids(Callback):
    """Each slice's worker pids, read once the run is under way."""

    def __init__(self):
        self.trainer = None
        self.pids: dict[int, list[int]] = {}

    def on_start(self, trainer):
        self.trainer = trainer

    def on_step(self, step, metrics):
        if not self.pids:
            self.pids = {s: [h["pid"] for h in self.trainer.hosts(s)] for s in self.trainer.members.live}


def _run(factory, keep=True, seed=0, faults=(), remove_node=None, events=None, **config):
    pids, events = _Pids(), ([] if events is None else events)
    config.setdefault("num_slices", 2)
    trainer = ElasticTrainer(factory, ElasticConfig(policy="pause", keep_workers=keep, seed=seed, **config),
                             STEPS, faults=faults, callbacks=[pids], keep_final_state=True, on_event=events.append,
                             remove_node=remove_node)
    report = trainer.fit()
    assert report.steps_completed == STEPS, report.failures
    assert len(report.failures) == sum(f.kind == "remove_node" for f in faults), report.failures
    kept: dict = {}  # per slice, its first start (a replacement's comes later)
    for e in events:
        if e["event"] == "slice_ready":
            kept.setdefault(e["slice"], "kept_process" in e.get("phases", {}))
    return trainer, pids.pids, kept


def _gone(pids, within_s: float = 30.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.2)
    return False


def _idle_processes(cluster, settle_s: float = 3.0, at_least: int = 0, within_s: float = 30.0) -> int:
    """Ray's idle worker processes of `cluster` (the warm pool's among
    them: children of its raylets, not another cluster's on this machine),
    once those asked for have had time to start (`settle_s`, and on a
    loaded machine up to `within_s` for `at_least` of them)."""
    end = time.monotonic() + within_s
    while True:
        time.sleep(settle_s)
        count = _idle_now(cluster)
        if count >= at_least or time.monotonic() > end:
            return count


def _idle_now(cluster) -> int:
    import os

    session = os.path.basename(os.path.dirname(cluster.logs_dir))
    count = 0
    for p in psutil.process_iter(["cmdline"]):
        if not (p.info["cmdline"] or [""])[0].startswith("ray::IDLE"):
            continue
        try:
            parent = p.parent()
            count += parent is not None and any(session in a for a in parent.cmdline())
        except psutil.Error:  # gone meanwhile
            pass
    return count


def _bitwise(a, b) -> bool:
    """Two final states (whole trees, or one part per host of a sharded
    layout's blocks) equal bit for bit."""
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) > 0 and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.fixture
def fresh(nodes):
    """Two nodes and nothing kept from earlier tests; nothing kept after."""
    release_workers()
    nodes(2)
    yield
    release_workers()


def test_the_next_run_starts_in_the_kept_processes_and_ends_bitwise_equal(fresh, cluster, lm_factory):
    first, pids1, kept1 = _run(lm_factory)
    assert kept1 == {0: False, 1: False}  # nothing was kept before it
    idle = _idle_processes(cluster, at_least=1)
    assert idle > 0  # the warm pool's, at least
    # Faults that last only for their run: a delay, and a bit flipped in
    # every gradient slice 1 sends from step 3 on (both slices apply the
    # flipped sum: they stay equal, and the run ends on other bits).
    faults = (Fault("slow", 1, 2, ms=50), Fault("corrupt", 1, 3, target="grads+"))
    second, pids2, kept2 = _run(lm_factory, faults=faults)
    assert kept2 == {0: True, 1: True}
    assert pids2 == pids1  # the same processes, not new ones
    assert not _bitwise(first.final_state, second.final_state)  # the corruption took effect
    # The warm processes the first run's workers asked for serve them still:
    # a kept worker asks for none again (they would pile up run after run).
    assert _idle_processes(cluster) <= idle
    # Both processes were kept through those faults, and the next run in
    # them computes what new workers computed, bit for bit: no fault
    # outlasted its run. An `oom` fault, whose process may keep the memory
    # it touched, is not kept past its run.
    third, pids3, kept3 = _run(lm_factory, faults=(Fault("oom", 1, 2, ms=64),))
    assert kept3 == {0: True, 1: True} and pids3 == pids1
    assert _bitwise(first.final_state, third.final_state)
    # A run that keeps nothing still takes what was kept: slice 0's worker;
    # slice 1's, which had an `oom` fault, was not kept.
    fourth, pids4, kept4 = _run(lm_factory, keep=False)
    assert kept4 == {0: True, 1: False}
    assert pids4[0] == pids1[0] and pids4[1] != pids1[1]
    assert _bitwise(first.final_state, fourth.final_state)
    assert _gone([p for ps in (pids1, pids4) for x in ps.values() for p in x])
    assert release_workers() == 0


def test_a_replacement_gets_the_node_a_slice_left_kept_holds(fresh, cluster, lm_factory):
    """A run of 1 slice after one of 2 (the same 2 batch shards, so its
    workers are the same): slice 1 stays kept, on the only
    other node. Slice 0's node removed, its replacement needs that node:
    the kept slice is released for it, the run finishes."""
    _run(lm_factory)
    _, _, kept = _run(lm_factory, num_slices=1, batch_shards=2, timeout_s=60.0, faults=(Fault("remove_node", 0, 3),),
                      remove_node=cluster.remove_node)
    assert kept == {0: True}
    assert release_workers() == 1  # the replacement's own slice, kept at the end


def test_kept_multi_host_sharded_slices_end_bitwise_equal(nodes):
    """A slice of 2 hosts (one jax.distributed system), the state sharded
    (fsdp): the kept slice keeps its JAX system and makes its shards of
    the step-0 state again."""
    import functools

    import examples.lm as lm

    release_workers()
    nodes(2)
    factory = functools.partial(lm.make_program, lm.LMConfig(), lm.sharded_layout("fsdp"))
    shape = dict(num_slices=1, slice=CpuSlice(hosts=2), batch_shards=2, step_deadline_floor_s=30.0, timeout_s=180.0)
    try:
        first, pids1, _ = _run(factory, **shape)
        second, pids2, kept2 = _run(factory, **shape)
    finally:
        release_workers()
    assert kept2 == {0: True} and pids2 == pids1
    assert isinstance(first.final_state, tuple)  # one part per host
    assert _bitwise(first.final_state, second.final_state)


def test_another_program_runs_in_the_kept_processes_and_ends_bitwise_equal(fresh, lm_factory):
    """Another program (another model width, and another seed) on slices
    of the same shape: the kept processes drop the last program and build
    and compile the new one (SliceWorker.reprogram), computing what new
    workers compute; then the first program again, in them still."""
    import functools

    import examples.lm as lm

    other = functools.partial(lm.make_program, lm.LMConfig(d_model=32, mlp_dim=128))
    reference, ref_pids, kept0 = _run(other, keep=False, seed=1)  # new workers, none kept after
    assert kept0 == {0: False, 1: False}
    first, pids1, _ = _run(lm_factory)
    assert _gone([p for ps in ref_pids.values() for p in ps])
    second, pids2, kept2 = _run(other, seed=1)
    assert kept2 == {0: True, 1: True} and pids2 == pids1
    assert _bitwise(reference.final_state, second.final_state)
    assert not _bitwise(first.final_state, second.final_state)  # another program's state, not a stale one
    third, pids3, kept3 = _run(lm_factory)
    assert kept3 == {0: True, 1: True} and pids3 == pids1
    assert _bitwise(first.final_state, third.final_state)


def test_another_shape_or_release_workers_ends_the_kept_ones(fresh, cluster, lm_factory):
    _, pids1, _ = _run(lm_factory)
    events = []
    # Two devices a host: another environment (XLA's device count), so
    # other processes: the kept ones are released.
    _, pids2, kept2 = _run(lm_factory, slice=CpuSlice(devices_per_host=2), events=events)
    assert kept2 == {0: False, 1: False}
    assert _gone([p for ps in pids1.values() for p in ps])
    # The new workers waited for the released processes on their nodes to
    # exit (an accelerator's memory is free only then: worker/predecessors.py).
    waited = {p for e in events if e["event"] == "slice_ready" for p in e.get("predecessors", {}).get("pids", ())}
    assert waited and waited <= {p for ps in pids1.values() for p in ps}, waited
    assert release_workers() == 2
    assert _gone([p for ps in pids2.values() for p in ps])
    parked = {pg.id.hex() for pg in cluster.parked.values()}  # the shared cluster's idle nodes (local_cluster.py)
    assert not [pg for pg in ray.util.placement_group_table().values()
                if pg["state"] == "CREATED" and pg["placement_group_id"] not in parked]


def test_keep_workers_is_a_bool_and_defaults_from_the_driver_s_environment(monkeypatch):
    monkeypatch.delenv(KEEP_WORKERS_ENV, raising=False)
    assert ElasticConfig().keep_workers is False
    monkeypatch.setenv(KEEP_WORKERS_ENV, "1")
    assert ElasticConfig().keep_workers is True
    with pytest.raises(ConfigError, match="keep_workers"):
        ElasticConfig(keep_workers="yes")


def test_an_edited_module_of_the_users_gives_another_key(tmp_path, monkeypatch):
    """The factory's code reaches a worker by name only when it lives in a
    module (cloudpickle): the files of the user's loaded modules are part
    of the key, so an edited one gets new workers, never stale ones. Here
    the factory is a partial over a library function and the model code
    sits in a module of its own: both a notebook's shape."""
    import functools
    import importlib
    import sys

    from ray_elastic.cluster.kept_workers import kept_key, process_key

    (tmp_path / "my_model_for_kept.py").write_text("WIDTH = 64\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("my_model_for_kept")
    try:
        factory = functools.partial(max, 1)  # its module says nothing of the model's
        before = process_key(factory, "shape")
        assert process_key(factory, "shape") == before
        assert kept_key(factory, before, 0) != kept_key(factory, before, 1)  # another seed: the same processes
        (tmp_path / "my_model_for_kept.py").write_text("WIDTH = 128  # edited\n")
        assert process_key(factory, "shape") != before  # new processes: none has the old module
        assert mod.WIDTH == 64
    finally:
        sys.modules.pop("my_model_for_kept", None)

"""Sharded state on real local clusters: 2 slices x 2 hosts x 2 devices,
FSDP over each slice's 4 devices (the example LM's `sharded_layout`).

Each host holds only its own blocks; the cross-slice exchange, snapshots
and a replacement's load go host i to host i. Faults are real (a SIGKILLed
worker, a preemption notice); every recovered run ends bitwise equal, host
by host, to a failure-free run with the same layout. A node removed from a
two-host sharded slice, in each phase of a step: tests/test_shapes_e2e.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ray_elastic import Callback, CpuSlice, ElasticConfig, ElasticTrainer, Fault
from tests.run_checks import assert_no_failures

pytestmark = pytest.mark.cluster

STEPS = 8
FAIL_AT = 3
CKPT_AT = 5  # the failure-free run's one checkpoint, where the cold starts resume
HOSTS, DEVICES = 2, 2


@pytest.fixture(scope="module")
def fsdp_factory():
    import examples.lm as lm

    return functools.partial(lm.make_program, lm.LMConfig(), lm.sharded_layout("fsdp"))


def _config(**kw) -> ElasticConfig:
    kw.setdefault("num_slices", 2)
    kw.setdefault("step_deadline_floor_s", 5.0)
    kw.setdefault("timeout_s", 180.0)
    return ElasticConfig(slice=CpuSlice(hosts=HOSTS, devices_per_host=DEVICES), **kw)


def _run(factory, config, cluster, faults=(), on_event=None, keep=True):
    trainer = ElasticTrainer(factory, config, STEPS, faults=faults, remove_node=cluster.remove_node,
                             on_event=on_event, keep_final_state=keep)
    return trainer, trainer.fit()


def _assert_same_blocks(a: list, b: list) -> None:
    """Two sharded final states (one part per host) bitwise equal, host by host."""
    assert len(a) == len(b) == HOSTS
    for pa, pb in zip(a, b):
        assert pa["step"] == pb["step"] == STEPS
        assert pa["blocks"].keys() == pb["blocks"].keys()
        for key in pa["blocks"]:
            np.testing.assert_array_equal(pa["blocks"][key], pb["blocks"][key], err_msg=str(key))


@pytest.fixture(scope="module")
def baseline(cluster, fsdp_factory, tmp_path_factory):
    """The failure-free run; it also writes the checkpoint of step
    CKPT_AT that the cold-start tests resume from (a save changes nothing
    in the run, so one run serves both)."""
    from ray_elastic import CheckpointConfig

    cluster.ensure_nodes(2 * HOSTS)
    path = str(tmp_path_factory.mktemp("sharded") / "ckpt")
    # The state checked every step, and a gradient cross-check every other
    # step (the check's recomputation and the step's gradients both run
    # collectives across a slice's two hosts): a slice of two processes
    # fingerprints within its apply, and healthy replicas must never differ.
    checked = []

    class Checked(Callback):
        def on_step(self, step, metrics):
            checked.append("check_s" in metrics)

    trainer = ElasticTrainer(fsdp_factory, _config(policy="pause", state_check_every=1, grad_check_every=2), STEPS,
                             keep_final_state=True,
                             checkpoint=CheckpointConfig(path, save_every=CKPT_AT, save_at_end=False),
                             callbacks=[Checked()])
    report = trainer.fit()
    assert report.steps_completed == STEPS and not report.failures
    assert checked == [True] * STEPS
    assert not [e for e in report.events if e["event"] in ("diverged", "tie_break")]
    # Pipelined dispatch (the default) runs sharded layouts too: each
    # host index's apply takes its own tree of host i's blocks.
    assert trainer.members.backend.runner.steps_ahead > 0
    assert report.losses[-1] < report.losses[0]
    _check_whole(trainer)
    return {"state": trainer.final_state, "losses": report.losses, "checkpoint": path, "events": report.events}


def _check_whole(trainer) -> None:
    """final_params() puts the hosts' blocks together: every block of every
    host is where its key says in the whole arrays, which have the model's
    shapes (the example LM's params, made on the driver)."""
    import jax

    import examples.lm as lm

    whole = trainer.whole_final_state()
    assert whole["step"] == STEPS and trainer.final_params() is not None
    shapes = jax.eval_shape(lambda: lm.make_program(lm.LMConfig()).init_params(jax.random.PRNGKey(0)))
    assert [a.shape for a in jax.tree.leaves(whole["params"])] == [a.shape for a in jax.tree.leaves(shapes)]
    leaves = {"p": jax.tree.leaves(whole["params"]), "o": jax.tree.leaves(whole["opt_state"])}
    for part in trainer.final_state:
        for (tag, i, key), block in part["blocks"].items():
            np.testing.assert_array_equal(leaves[tag][i][tuple(slice(a, b) for a, b in key)], block)


@pytest.fixture(scope="module")
def sharded_checkpoint(baseline):
    """The checkpoint of step CKPT_AT, written by 2 slices x 2 hosts x 2
    devices, and by the hosts of one slice (host_writes.py), not the
    writer actor."""
    started = [e for e in baseline["events"] if e["event"] == "checkpoint_started"]
    assert [e["step"] for e in started] == [CKPT_AT]
    assert all(e.get("hosts") == HOSTS for e in started), started
    return baseline["checkpoint"]


def test_each_device_holds_a_quarter_of_every_sharded_parameter(baseline):
    import examples.lm as lm
    import jax

    abstract = jax.eval_shape(lm.make_program(lm.LMConfig()).init_params, jax.random.PRNGKey(0))
    shapes = [a.shape for a in jax.tree.leaves(abstract)]
    specs = jax.tree.leaves(lm.param_logical_axes(abstract), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    sharded = [i for i, spec in enumerate(specs) if "embed" in tuple(spec)]
    assert len(sharded) >= 10  # every weight of the model dimension
    seen = {}
    for host, part in enumerate(baseline["state"]):
        assert part["host"] == host
        for (tag, i, key), block in part["blocks"].items():
            if tag != "p":
                continue
            seen.setdefault(i, []).append((host, key, block.size))
    for i in sharded:
        full = int(np.prod(shapes[i]))
        blocks = seen[i]
        # Four distinct quarters, two on each host: no host holds more.
        assert sorted(size for _, _, size in blocks) == [full // 4] * 4, (i, shapes[i], blocks)
        assert len({key for _, key, _ in blocks}) == 4
        for host in range(HOSTS):
            assert sum(size for h, _, size in blocks if h == host) == full // 2
    # Replicated leaves (LayerNorm): each host holds the whole leaf once.
    for i in set(range(len(shapes))) - set(sharded):
        assert [size for _, _, size in seen[i]] == [int(np.prod(shapes[i]))] * HOSTS


# Under pause; resize's sharded path (the survivors finish the step, one
# slice left) is test_shapes_e2e's node removals'.
@pytest.mark.parametrize("policy", ["pause"])
def test_worker_killed_run_ends_bitwise_equal(cluster, fsdp_factory, baseline, policy, monkeypatch):
    """...and the driver never materialises the state: no snapshot pin and
    nothing fetched into the driver, even with one slice left (resize after
    the kill, snapshots every step), but the final state this test asks for
    (`keep_final_state`: one part per host, fetched after the last step)."""
    from ray_elastic.cluster import ray_backend
    cluster.ensure_nodes(2 * HOSTS)
    fetched = []
    real = ray_backend.RayBackend.fetch
    monkeypatch.setattr(ray_backend.RayBackend, "fetch", lambda self, ref, timeout_s=None: (
        fetched.append((type(ref).__name__, trainer.step)), real(self, ref, timeout_s))[1])
    # Then a preemption notice (SIGTERM) to a host of the other slice: on a
    # multi-host slice JAX's own preemption service would take the signal
    # and the notice would be lost.
    faults = (Fault("kill", slice_id=1, step=FAIL_AT, host=1),)
    if policy == "pause":
        faults += (Fault("term", slice_id=0, step=FAIL_AT + 1, host=1),)
    # Gradient cross-checks every other step, through the replacement.
    trainer = ElasticTrainer(fsdp_factory, _config(policy=policy, snapshot_every=1, grad_check_every=2,
                                                   state_check_every=2), STEPS, faults=faults, keep_final_state=True)
    report = trainer.fit()
    assert report.steps_completed == STEPS
    assert [(f.kind, f.slice) for f in report.failures] == [("process_died", 1), ("preempted", 0)][:len(faults)]
    assert not [e for e in report.events if e["event"] in ("diverged", "tie_break")]
    _assert_same_blocks(trainer.final_state, baseline["state"])
    # Only the final state, asked for by the test (the cross-checks' lists
    # of fingerprints, one int per host, are all else the driver reads).
    assert [f for f in fetched if f[0] != "list"] == [("tuple", STEPS)]
    assert not trainer.snapshots.has_pinned_copy


# Onto the same layout (2 slices of 2 hosts x 2 devices): test_shapes_e2e's
# cold starts of its 2x2 fsdp_tp shape.
@pytest.mark.parametrize("slices,hosts", [(2, 1), (1, 1)])
def test_cold_start_from_a_sharded_checkpoint_onto_other_hosts(cluster, fsdp_factory, baseline, sharded_checkpoint,
                                                               slices, hosts):
    """Saved from 2 slices of 2 hosts x 2 devices, resumed on 2 slices, or
    on 1 (batch_shards=2: it computes both shards), of 1 host x 4 devices
    (the same fsdp=4 mesh over other processes), or on the same layout:
    the run continues with the losses of the uninterrupted one."""
    from ray_elastic import CheckpointConfig

    cluster.ensure_nodes(slices * hosts)
    wide = ElasticConfig(num_slices=slices, batch_shards=2, slice=CpuSlice(hosts=hosts, devices_per_host=4 // hosts),
                         policy="pause", step_deadline_floor_s=5.0, timeout_s=180.0)
    resumed = ElasticTrainer(fsdp_factory, wide, STEPS,
                             checkpoint=CheckpointConfig(sharded_checkpoint, save_every=0, save_at_end=False))
    report = resumed.fit()
    assert report.steps_completed == STEPS
    assert_no_failures(report)
    assert [e for e in report.events if e["event"] == "restore"][0]["step"] == CKPT_AT
    np.testing.assert_allclose(report.losses[CKPT_AT:], baseline["losses"][CKPT_AT:], rtol=1e-5)


def test_each_host_writes_its_own_shards_and_plain_orbax_reads_them(sharded_checkpoint):
    """Item 5 of the sharded-state issue: the hosts' own shard files, one
    commit, and a checkpoint that plain Orbax restores (to whole numpy
    arrays, on one process) with the checksums the hosts recorded."""
    import os

    import orbax.checkpoint as ocp

    from ray_elastic.checkpoint import integrity

    step = CKPT_AT
    state_dir = os.path.join(sharded_checkpoint, str(step), "state")
    names = set(os.listdir(state_dir))
    assert {"ocdbt.process_0", "ocdbt.process_1", "commit_success.txt"} <= names or \
        {"ocdbt.process_0", "ocdbt.process_1"} <= names, names
    # Both hosts' files hold data (each wrote its half of every sharded leaf).
    sizes = {p: sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(state_dir, p)) for f in fs)
             for p in ("ocdbt.process_0", "ocdbt.process_1")}
    assert all(v > 100_000 for v in sizes.values()), sizes
    with open(os.path.join(sharded_checkpoint, str(step), integrity.ITEM, "metadata")) as f:
        recorded = __import__("json").load(f)["arrays"]
    assert recorded and all("sum32" in v for v in recorded.values())
    meta = ocp.StandardCheckpointer().metadata(os.path.join(state_dir))
    meta = getattr(meta, "item_metadata", meta)
    import jax

    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta)
    restored = ocp.CheckpointManager(sharded_checkpoint).restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    assert integrity.check_arrays(step, restored.state, recorded) == len(recorded)

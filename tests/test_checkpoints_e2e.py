"""Durable checkpoints end to end, on a real local cluster, against local
disk and a real GCS-compatible server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import ray

from ray_elastic import CheckpointConfig, ConfigError, ElasticConfig, ElasticTrainer, Fault
from ray_elastic.callbacks import FunctionCallback
from ray_elastic.checkpoint import CheckpointStore, refresh_listings
from tests.run_checks import assert_no_failures

pytestmark = pytest.mark.cluster

DRIVER = os.path.join(os.path.dirname(__file__), "drivers", "ckpt_driver.py")


def _leaves(state):
    import jax

    return jax.tree.leaves((state["params"], state["opt_state"]))


def _assert_equal(a, b):
    assert a["step"] == b["step"]
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def reference(failure_free):
    """Failure-free, checkpoint-free run of 16 steps (pause, 2 slices)."""
    trainer, report = failure_free(16)
    assert_no_failures(report)
    return trainer.final_state


def _trainer(factory, steps, path, **kw):
    ck = {k: kw.pop(k) for k in list(kw) if k in ("save_every", "keep", "continuous", "max_failed_saves", "storage_retries", "retry_backoff_s")}
    config = kw.pop("config", ElasticConfig(num_slices=2, policy="pause"))
    remove = kw.pop("cluster_remove", None)
    return ElasticTrainer(
        factory, config, steps, checkpoint=CheckpointConfig(path, **ck), keep_final_state=True,
        remove_node=remove, **kw,
    )


@pytest.mark.slow
def test_cold_start_after_cluster_torn_down(nodes, lm_factory, reference, tmp_path, gcs):
    """Job 1 runs on its own cluster, which is then torn down entirely. Job
    2, a new driver on another cluster, resumes from the newest committed
    step and ends bitwise equal to a run that never stopped. On gs://,
    where the new driver must find the steps in a bucket it did not write;
    a cold start from a local folder another run wrote: the default run's
    test_shapes_e2e removals and test_sharded_e2e's cold start onto other
    hosts."""
    path = f"gs://ckpt/{uuid.uuid4().hex[:8]}"
    out = subprocess.run(
        [sys.executable, DRIVER, "--path", path, "--steps", "10", "--save-every", "4", "--report", str(tmp_path / "r1.json")],
        capture_output=True, text=True, timeout=240, env=os.environ.copy(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EXIT completed" in out.stdout
    assert_no_failures(json.loads((tmp_path / "r1.json").read_text()))
    assert CheckpointStore(path).latest_committed() == 10

    nodes(2)
    trainer = _trainer(lm_factory, 16, path, save_every=4)
    report = trainer.fit()
    assert_no_failures(report)
    assert report.resumed_from == 10
    assert report.steps_completed == 16
    assert any(e["event"] == "restore" and e.get("cold_start") for e in report.events)
    _assert_equal(trainer.final_state, reference)
    # Users are not locked in: plain Orbax reads it back.
    import orbax.checkpoint as ocp
    from etils import epath

    import jax

    refresh_listings()  # this process listed the bucket before the writes
    plain = ocp.StandardCheckpointer().restore(epath.Path(path) / "16" / "state")
    ours = jax.tree.leaves(trainer.final_state["params"])
    theirs = jax.tree.leaves(plain["params"])
    assert len(ours) == len(theirs) > 0
    for x, y in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_every_node_lost_restores_from_checkpoint(nodes, lm_factory, reference, tmp_path):
    """Both slices' nodes go in the same step: every in-memory snapshot goes
    with them, so the newest state left is the committed checkpoint (step
    6), and the run resumes from it, ending where a run without failures
    ends."""
    cluster = nodes(2)
    added = []

    def on_event(e):
        if e["event"] == "wait" and not added:
            added.extend([cluster.add_node(), cluster.add_node()])

    trainer = _trainer(
        lm_factory, 16, str(tmp_path / "ck"), save_every=6, cluster_remove=cluster.remove_node,
        faults=(Fault("remove_node", 0, 8), Fault("remove_node", 1, 8)),
    )

    def on_step(step, loss, slices):
        if step == 7:  # let step 6's checkpoint commit before the nodes go
            deadline = time.monotonic() + 60
            while trainer.checkpoints.last_saved != 6 and time.monotonic() < deadline:
                trainer.checkpoints.poll(block_s=0.5)

    trainer.add_callback(FunctionCallback(on_step=on_step, on_event=on_event))
    report = trainer.fit()
    assert report.failures[-1].restored_from == "checkpoint"
    assert any(e["event"] == "restore" and e["source"] == "checkpoint" and e["step"] == 6 for e in report.events)
    assert max(f.steps_rewound for f in report.failures) == 3  # steps 7, 8 and the one in flight
    _assert_equal(trainer.final_state, reference)


@pytest.mark.slow
def test_checkpoint_writer_killed_mid_write_is_recovered(nodes, lm_factory, gcs):
    """The server freezes while step 4 is being written and the writer is
    SIGKILLed mid-write: training goes on, a new writer takes over, the
    half-written step never blocks anything, and the final step commits."""
    nodes(2)
    path = f"gs://ckpt/{uuid.uuid4().hex[:8]}"
    trainer = _trainer(lm_factory, 20, path, save_every=4)
    seen = {}

    def on_step(step, loss, slices):
        c = trainer.checkpoints
        if "pid" not in seen and c.writer_running:
            seen["pid"] = c.writer_pid()
        if step == 4:
            gcs.pause()  # step 4's save, submitted right after this, hangs
        if step == 6 and "killed" not in seen:
            assert c.busy()
            os.kill(seen["pid"], signal.SIGKILL)
            seen["killed"] = True
            gcs.resume()

    trainer.add_callback(FunctionCallback(on_step=on_step))
    try:
        report = trainer.fit()
    finally:
        gcs.resume()
    assert seen.get("killed")
    failed = [e for e in report.events if e["event"] == "checkpoint_failed"]
    assert failed and failed[0]["step"] == 4 and "died" in failed[0]["reason"]
    store = CheckpointStore(path)
    assert store.latest_committed() == 20
    assert 4 not in store.committed_steps()
    assert all(s.committed for s in store.steps())


def test_sigterm_to_driver_checkpoints_last_step_and_exits_cleanly(nodes, tmp_path):
    """A preemption notice by SIGTERM to the driver (a job's driver on a
    cluster that stays up): the step in flight finishes, is checkpointed
    and committed, and the driver exits 0. No completed step is lost."""
    cluster = nodes(2)
    path = str(tmp_path / "ck")
    proc = subprocess.Popen(
        [sys.executable, DRIVER, "--path", path, "--steps", "400", "--save-every", "50", "--report", str(tmp_path / "r.json"),
         "--address", cluster.address],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ.copy(),
    )
    last_step, sent_at, saved_at = 0, None, None
    try:
        for line in proc.stdout:
            parts = line.split()
            if parts[:1] == ["STEP"]:
                last_step = int(parts[1])
                if last_step == 8 and sent_at is None:
                    sent_at = time.time()
                    proc.send_signal(signal.SIGTERM)
            elif parts[:2] == ["EVENT", "preempt_saved"]:
                saved_at = float(parts[3])
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["outcome"] == "preempted"
    assert CheckpointStore(path).latest_committed() == last_step == report["steps_completed"]
    assert saved_at is not None and saved_at - sent_at < 5.0


def test_drain_notice_checkpoints_then_resizes_losing_nothing(nodes, lm_factory, tmp_path):
    """A Ray drain notice (preemption, 15 s deadline) for slice 1's node:
    the last completed step is committed before the deadline, the slice is
    taken out at a step boundary (no step redone), and a replacement node
    brings the run back to two slices."""
    from ray_elastic.cluster.drain import drain_node

    cluster = nodes(2)
    path = str(tmp_path / "ck")
    trainer = _trainer(
        lm_factory, 250, path, save_every=1000,
        config=ElasticConfig(num_slices=2, policy="resize"),
    )
    seen = {}

    def on_step(step, loss, slices):
        if step == 6 and "node" not in seen:
            seen["node"] = trainer.hosts(1)[0]["node_id"]
            seen["t"] = time.time()
            assert drain_node(seen["node"], deadline_s=15)

    def on_event(e):
        if e["event"] == "preempt_saved":
            seen["saved"] = (time.time(), e["step"])
            seen["run_waited"] = e["run_waited"]
        if e["event"] == "shrink" and "replaced" not in seen:
            seen["replaced"] = True
            cluster.remove_node(seen["node"])  # the cloud takes the node away
            cluster.add_node()

    trainer.add_callback(FunctionCallback(on_step=on_step, on_event=on_event))
    report = trainer.fit()
    f = report.failures[0]
    assert f.kind == "preempted" and f.slice == 1 and f.steps_rewound == 0
    saved_t, saved_step = seen["saved"]
    assert saved_t - seen["t"] < 15.0
    assert saved_step in CheckpointStore(path).committed_steps()
    assert seen["run_waited"] is False  # slice 0 holds the state: saved from its copy as the run went on
    assert report.steps_completed == 250 and report.slices_per_step[-1] == 2


@pytest.mark.slow
def test_storage_down_mid_run_then_back(nodes, lm_factory, gcs):
    """The GCS server is stopped mid-run and started again: training never
    stops, saves fail or wait meanwhile, and later steps commit."""
    nodes(2)
    path = f"gs://ckpt/{uuid.uuid4().hex[:8]}"
    trainer = _trainer(lm_factory, 150, path, save_every=10, storage_retries=6, retry_backoff_s=0.5, max_failed_saves=10)

    def on_step(step, loss, slices):
        if step == 12:
            gcs.stop()
        if step == 60:
            gcs.start()

    trainer.add_callback(FunctionCallback(on_step=on_step))
    try:
        report = trainer.fit()
    finally:
        if gcs.proc is None:
            gcs.start()
    assert report.steps_completed == 150
    store = CheckpointStore(path)
    assert store.latest_committed() == 150
    assert 10 in store.committed_steps() or 20 in store.committed_steps() or store.committed_steps()


def test_bucket_missing_fails_before_reserving(cluster, lm_factory, gcs):
    before = len(ray.util.placement_group_table())
    with pytest.raises(ConfigError, match="checkpoint.path") as info:
        _trainer(lm_factory, 5, "gs://no-such-bucket/run").fit()
    assert "does not exist" in str(info.value)
    assert len(ray.util.placement_group_table()) == before


def test_checkpoint_from_other_seed_is_refused(nodes, lm_factory, tmp_path):
    nodes(2)
    path = str(tmp_path / "ck")
    assert_no_failures(_trainer(lm_factory, 4, path, save_every=2).fit())
    other = ElasticConfig(num_slices=2, policy="pause", seed=7)
    with pytest.raises(ConfigError, match="seed"):
        _trainer(lm_factory, 8, path, config=other).fit()


def test_checkpoints_cli_lists_committed_and_incomplete(tmp_path, capsys):
    from ray_elastic.cli import main

    path = tmp_path / "ck"
    store = CheckpointStore(str(path))
    store.save(3, {"params": {"w": np.ones(4, np.float32)}, "opt_state": []}, {"seed": 0})
    # What a writer killed mid-write leaves behind locally: Orbax's tmp folder.
    (path / "5.orbax-checkpoint-tmp-1234").mkdir()
    assert main(["checkpoints", str(path)]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "INCOMPLETE" in out and "latest committed: 3" in out
    assert main(["checkpoints", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["committed"]) for r in rows] == [(3, True), (5, False)]


def test_a_save_failing_in_ray_elastic_itself_rescues_the_state(nodes, tmp_path, monkeypatch):
    """A save that fails in ray_elastic's own code (a bug injected into the
    hosts' save call, on a one-host sharded slice) is not retried as a
    storage error: the newest state is rescued to local disk at once, the
    run stops with an error saying where, and the rescued step restores."""
    import functools

    import examples.lm as lm

    from ray_elastic import CheckpointSaveFailed, CpuSlice
    from ray_elastic.checkpoint.coordinator import CheckpointCoordinator

    real = CheckpointCoordinator.use_hosts

    def buggy(self, save_on_hosts):
        def save(parts, *args):
            raise TypeError("'ray.ObjectRef' object is not subscriptable")  # the kind of bug it stands for
        real(self, save)

    monkeypatch.setattr(CheckpointCoordinator, "use_hosts", buggy)
    nodes(2)
    factory = functools.partial(lm.make_program, lm.LMConfig(), lm.sharded_layout("fsdp"))
    config = ElasticConfig(num_slices=2, policy="pause", slice=CpuSlice(hosts=1, devices_per_host=1))
    rescue = str(tmp_path / "rescue")
    trainer = ElasticTrainer(factory, config, 20, keep_final_state=True,
                             checkpoint=CheckpointConfig(str(tmp_path / "ck"), save_every=4, rescue_dir=rescue))
    with pytest.raises(CheckpointSaveFailed) as err:
        trainer.fit()
    message = str(err.value)
    assert "in ray_elastic itself" in message and "TypeError" in message and err.value.setting == "checkpoint.path"
    where = next(e for e in trainer.report.events if e["event"] == "checkpoint_rescued")
    assert where["step"] == 4 and where["path"] in message
    assert CheckpointStore(where["path"]).latest_committed() == 4
    state, meta = CheckpointStore(where["path"]).restore(4)
    assert meta["step"] == 4 and trainer.report.outcome == "failed"

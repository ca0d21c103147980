"""Checkpoint integrity end to end, on a real local cluster, against local
disk and a real GCS-compatible server: a run saves checkpoints, the bytes
of its newest step's data file are flipped on disk, and a new run on the
same path resumes from the step before, reports the damaged one, and ends
bitwise where a run that never stopped ends. And during a run: every slice
lost while the newest checkpoint is damaged."""

from __future__ import annotations

import glob
import os
import uuid

import numpy as np
import pytest

from ray_elastic import CheckpointConfig, ElasticConfig, ElasticTrainer
from ray_elastic.checkpoint import CheckpointStore, refresh_listings
from tests.run_checks import assert_no_failures

pytestmark = pytest.mark.cluster


def _leaves(state):
    import jax

    return jax.tree.leaves((state["params"], state["opt_state"]))


@pytest.fixture(scope="module")
def reference(failure_free):
    """Failure-free, checkpoint-free run of 16 steps (pause, 2 slices)."""
    trainer, report = failure_free(16)
    assert_no_failures(report)
    return trainer.final_state


def _trainer(factory, steps, path):
    config = ElasticConfig(num_slices=2, policy="pause")
    return ElasticTrainer(factory, config, steps, checkpoint=CheckpointConfig(path, save_every=4), keep_final_state=True)


def _flip_data_file(step_folder: str) -> str:
    data = max(glob.glob(os.path.join(step_folder, "state", "ocdbt.process_0", "d", "*")), key=os.path.getsize)
    with open(data, "r+b") as f:
        raw = bytearray(f.read())
        for off in range(len(raw) // 2, len(raw) // 2 + 256, 16):
            raw[off] ^= 0xFF
        f.seek(0)
        f.write(raw)
    return os.path.relpath(data, step_folder)


def test_cold_start_skips_damaged_newest_step(nodes, lm_factory, reference, gcs):
    """On gs://. A local folder's damaged newest step skipped at a cold
    start: the same preflight in tests/test_checkpoint_integrity.py
    (local-bitflip), and mid-run, through the trainer, below."""
    prefix = uuid.uuid4().hex[:8]
    path, disk = f"gs://ckpt/{prefix}", os.path.join(gcs.root, "ckpt", prefix)
    nodes(2)
    first = _trainer(lm_factory, 10, path).fit()
    assert first.steps_completed == 10
    assert_no_failures(first)
    committed = CheckpointStore(path).committed_steps()
    assert committed[-1] == 10 and len(committed) >= 2, committed  # a periodic save may be skipped while one is in flight
    before = committed[-2]
    bad = _flip_data_file(os.path.join(disk, "10"))

    nodes(2)
    trainer = _trainer(lm_factory, 16, path)
    report = trainer.fit()
    assert report.resumed_from == before
    assert report.steps_completed == 16
    [damaged] = [e for e in report.events if e["event"] == "checkpoint_damaged"]
    assert (damaged["step"], damaged["file"], damaged["moved_to"], damaged["instead"]) == (10, bad, "10.damaged", before)
    assert "checksum mismatch" in damaged["reason"]
    assert any(e["event"] == "restore" and e.get("cold_start") and e["step"] == before for e in report.events)
    # Bitwise where a run that never stopped ends: the data position is exact.
    for x, y in zip(_leaves(trainer.final_state), _leaves(reference)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    store = CheckpointStore(path)
    assert store.latest_committed() == 16
    assert [s.name for s in store.steps() if s.damaged] == ["10.damaged"]
    assert 10 not in store.committed_steps()
    import orbax.checkpoint as ocp

    refresh_listings()
    assert ocp.CheckpointManager(path).latest_step() == 16


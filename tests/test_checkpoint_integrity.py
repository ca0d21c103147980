"""Checkpoint integrity on local disk and a real GCS-compatible server: a
damaged newest step (bit flips in a data file, a truncated file, a missing
file, a damaged metadata file) is reported by step, file and reason, moved
aside as `<step>.damaged` where plain Orbax no longer sees it, and the
next-newest committed step is restored instead; `ray-elastic checkpoints
--verify` lists it and exits 1. The damage is done to the bytes on disk
(fake-gcs-server serves a folder, so its objects are damaged the same way)."""

from __future__ import annotations

import glob
import os
import pickle
import shutil
import time
import uuid

import numpy as np
import pytest

from ray_elastic.checkpoint import CheckpointConfig, CheckpointStore, StorageError, refresh_listings
from ray_elastic.checkpoint.coordinator import CheckpointCoordinator
from ray_elastic.checkpoint.writer import CheckpointWriter
from ray_elastic.cli import main
from ray_elastic.errors import CheckpointDamaged, ConfigError


@pytest.fixture(params=["local", "gcs"])
def where(request, tmp_path):
    """(checkpoint.path, the folder on this machine holding its bytes)."""
    if request.param == "local":
        path = str(tmp_path / "ckpt")
        return path, path
    server = request.getfixturevalue("gcs")
    prefix = uuid.uuid4().hex[:8]
    return f"gs://ckpt/{prefix}", os.path.join(server.root, "ckpt", prefix)


def _state(k: int) -> dict:
    # 2 MiB of noise: one data file bigger than the quick check's limit, so
    # a flipped bit in it is caught by the restored arrays' checksums.
    rng = np.random.default_rng(k)
    return {"params": {"w": rng.standard_normal((512, 1024)).astype(np.float32), "b": np.full((3,), k, np.float32)},
            "opt_state": [np.asarray(k, np.int32)]}


def _template():
    return {"params": {"w": np.zeros((512, 1024), np.float32), "b": np.zeros((3,), np.float32)},
            "opt_state": [np.zeros((), np.int32)]}


def _saved(path: str, steps=(1, 2, 3)) -> CheckpointStore:
    store = CheckpointStore(path, keep=5)
    for k in steps:
        store.save(k, _state(k), {"seed": 0, "num_slices": 2, "step": k})
    return store


def _flip(path: str, offsets) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for off in offsets:
            data[off] ^= 0xFF
        f.seek(0)
        f.write(data)


def _damage(folder: str, kind: str) -> str:
    """Damage one file of a step folder on disk; returns its path relative
    to the step folder (what the report must name)."""
    data = max(glob.glob(os.path.join(folder, "state", "ocdbt.process_0", "d", "*")), key=os.path.getsize)
    if kind == "bitflip":
        size = os.path.getsize(data)
        _flip(data, range(size // 2, size // 2 + 64, 8))
    elif kind == "truncate":
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) // 2)
    elif kind == "missing":
        os.remove(data)
    elif kind == "metadata":
        data = os.path.join(folder, "state", "_METADATA")
        _flip(data, [os.path.getsize(data) // 2])
    return os.path.relpath(data, folder)


REASON = {"bitflip": "checksum mismatch", "truncate": "truncated", "missing": "missing", "metadata": "checksum mismatch"}


def _assert_state(state, k: int) -> None:
    want = _state(k)
    np.testing.assert_array_equal(state["params"]["w"], want["params"]["w"])
    assert int(np.asarray(state["opt_state"][0])) == k


def _plain_orbax_latest(path: str):
    import orbax.checkpoint as ocp

    refresh_listings()
    return ocp.CheckpointManager(path).latest_step()


@pytest.mark.parametrize("kind", ["bitflip", "truncate", "missing", "metadata"])
def test_cold_start_skips_damaged_newest_step(where, kind, capsys):
    """--verify names the damaged step and file and exits 1; a cold start
    (the coordinator's preflight) reports step, file and reason, moves the
    step aside and resumes from the next-newest; plain Orbax and the
    listing agree; saving goes on."""
    if where[0].startswith("gs://") and kind in ("truncate", "missing"):
        # A file cut short or gone reads the same through either store's
        # listing; gs:// takes the bit flip and the metadata (a minute of CI).
        pytest.skip("truncate and missing: on a local folder")
    path, disk = where
    store = _saved(path)
    bad = _damage(os.path.join(disk, "3"), kind)

    assert main(["checkpoints", path, "--verify"]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["3"])
    assert "DAMAGED" in row and bad in row and REASON[kind] in row, out
    assert all("ok (files and arrays)" in line for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])), out
    assert store.committed_steps() == [1, 2, 3]  # --verify alone moves nothing

    events = []
    coordinator = CheckpointCoordinator(CheckpointConfig(path), {"seed": 0, "num_slices": 2},
                                        lambda name, **f: events.append({"event": name, **f}))
    assert coordinator.preflight() == 2
    assert events == [{"event": "checkpoint_damaged", "step": 3, "file": bad, "reason": events[0]["reason"],
                       "moved_to": "3.damaged", "instead": 2}]
    assert REASON[kind] in events[0]["reason"]

    state, meta = CheckpointStore(path).restore(template=_template())
    assert meta["step"] == 2
    _assert_state(state, 2)
    assert _plain_orbax_latest(path) == 2  # the marker plain Orbax understands

    assert main(["checkpoints", path]) == 0  # a listing is not a check
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "3.damaged" in line)
    assert "DAMAGED" in row and bad in row and REASON[kind] in row, out
    assert "latest committed: 2" in out
    assert main(["checkpoints", path, "--verify"]) == 1  # still there, as evidence
    capsys.readouterr()

    store = CheckpointStore(path, keep=5)
    store.save(3, _state(3), {"seed": 0, "step": 3})  # the step is written again, beside the damaged one
    assert store.committed_steps() == [1, 2, 3]
    _assert_state(store.restore(template=_template())[0], 3)
    assert [s.name for s in store.steps() if s.damaged] == ["3.damaged"]


def test_restore_during_run_falls_back(where):
    """What the writer does when the controller restores after losing every
    slice: bits flipped in a big data file pass the quick listing check,
    are caught by the restored arrays' checksums, and the step before is
    restored; the answer says which step and why."""
    path, disk = where
    _saved(path)
    bad = _damage(os.path.join(disk, "3"), "bitflip")
    assert CheckpointStore(path).newest_intact(full=False) == (3, [])  # quick check: sizes, metadata

    writer = CheckpointWriter(path, keep=5, retries=0, backoff_s=0.0)
    info, state = writer.restore(3, _template())
    assert info["step"] == state.step == 2 and info["requested"] == 3
    [d] = info["damaged"]
    assert (d["step"], d["file"], d["moved_to"]) == (3, bad, "3.damaged")
    assert "checksum mismatch" in d["reason"]
    _assert_state(state.trees(), 2)
    assert CheckpointStore(path).committed_steps() == [1, 2]


def test_in_run_listing_skips_truncated_step(tmp_path):
    """The controller's in-run listing (latest_committed) moves a step with
    a truncated file aside and offers the one before, so the step it
    rewinds to is the step restore_ref delivers."""
    path = str(tmp_path / "ck")
    _saved(path)
    bad = _damage(os.path.join(path, "3"), "truncate")
    events = []
    coordinator = CheckpointCoordinator(CheckpointConfig(path), {}, lambda name, **f: events.append((name, f)))
    assert coordinator.latest_committed() == 2
    assert [(n, f["step"], f["file"]) for n, f in events] == [("checkpoint_damaged", 3, bad)]
    assert coordinator.latest_committed() == 2 and len(events) == 1
    assert [d["step"] for d in coordinator.damaged] == [3]


def test_every_step_damaged(tmp_path):
    """Nothing intact left: a restore says so, naming each damaged step; a
    cold start reports them and starts from scratch."""
    path = str(tmp_path / "ck")
    _saved(path, steps=(1, 2))
    for step in (1, 2):
        _damage(os.path.join(path, str(step)), "metadata")
    with pytest.raises(StorageError, match=r"no intact committed checkpoint.*step 2: state/_METADATA.*step 1: state/_METADATA"):
        CheckpointStore(path).restore_intact(None, _template())
    _saved(path, steps=(1, 2))
    for step in (1, 2):
        _damage(os.path.join(path, str(step)), "missing")
    events = []
    coordinator = CheckpointCoordinator(CheckpointConfig(path), {}, lambda name, **f: events.append(f))
    assert coordinator.preflight() is None
    assert [(e["step"], e["instead"]) for e in events] == [(2, None), (1, None)]


def test_step_without_checksums_still_restores(tmp_path, capsys):
    """A step written before checksums existed (or whose writer died right
    after the commit) is restored on Orbax's word, and --verify says so."""
    path = str(tmp_path / "ck")
    _saved(path, steps=(1,))
    os.remove(os.path.join(path, "1", "files.json"))
    shutil.rmtree(os.path.join(path, "1", "checksums"))
    _assert_state(CheckpointStore(path).restore(template=_template())[0], 1)
    assert main(["checkpoints", path, "--verify"]) == 0
    assert "ok (readable (no checksums recorded))" in capsys.readouterr().out


def test_storage_outage_is_not_damage(gcs, gcs_outage_fails_fast):
    """A server that does not answer during a restore is an outage: an
    error, and no step is moved aside."""
    path = f"gs://ckpt/{uuid.uuid4().hex[:8]}"
    _saved(path, steps=(1, 2))
    gcs.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            CheckpointStore(path, retries=0).restore_intact(None, _template())
        assert not isinstance(info.value, CheckpointDamaged)
    finally:
        gcs.start()
    assert time.monotonic() - t0 < 120  # gcsfs's own retries, then an error
    assert CheckpointStore(path).committed_steps() == [1, 2]


def test_checkpoint_damaged_pickles():
    e = CheckpointDamaged(7, "state/_METADATA", "missing")
    back = pickle.loads(pickle.dumps(e))
    assert (back.step, back.file, back.reason, str(back)) == (7, "state/_METADATA", "missing", str(e))
    assert isinstance(back, StorageError)


@pytest.mark.parametrize("written,adopt,expected", [
    ({"exchange_blocks": 4}, ("exchange_blocks",), 4),  # the first run's order, on another slice count
    ({}, ("exchange_blocks",), 8),  # a checkpoint from before the fact: shard order (blocks = batch_shards)
    ({"exchange_blocks": 4}, (), 8),  # the direct hand-off adds in shard order whatever the checkpoint says
])
def test_a_resumed_run_takes_the_sums_order_from_its_checkpoint(tmp_path, written, adopt, expected):
    """The blocks that order the gradients' sum (dispatch/exchange_plan.py)
    are a fact of the run a checkpoint records; a cold start with another
    num_slices adopts them, so it adds as the first run did (bitwise equal
    to it), and its own saves record them again. A different seed or
    batch_shards is still refused."""
    path = str(tmp_path / "ckpt")
    CheckpointStore(path).save(1, _state(1), {"seed": 0, "batch_shards": 8, "step": 1, **written})
    facts = {"seed": 0, "batch_shards": 8, "exchange_blocks": 8 if not adopt else 2}
    coordinator = CheckpointCoordinator(CheckpointConfig(path), facts, lambda name, **f: None, adopt=adopt)
    assert coordinator.preflight() == 1
    assert coordinator.facts["exchange_blocks"] == expected
    with pytest.raises(ConfigError) as e:
        CheckpointCoordinator(CheckpointConfig(path), {**facts, "batch_shards": 4}, lambda name, **f: None,
                              adopt=adopt).preflight()
    assert e.value.setting == "batch_shards"

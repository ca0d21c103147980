"""Sharded checkpoints written by the hosts themselves
(ray_elastic/checkpoint/host_writes.py), in real JAX processes: two
processes of one "slice" each write their own shards, one commit; a host
that dies mid-save leaves no committed step; a restore onto one process
with four devices reads the same arrays; plain Orbax reads the step and its
recorded checksums hold."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ray_elastic.checkpoint import integrity
from ray_elastic.checkpoint.integrity import sum32
from ray_elastic.checkpoint.store import CheckpointStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "drivers", "host_writes_driver.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(mode: str, pid: int, port: int, path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, DRIVER, mode, str(pid), str(port), path], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen, timeout: float = 120) -> dict:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()  # SIGKILL: jax.distributed catches SIGTERM (its preemption notifier) and runs on
        p.communicate()
        raise
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_sum32_adds_up_over_blocks_and_sees_every_bit():
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.int32, np.float64, np.float16, np.uint8):
        a = (rng.standard_normal((6, 10)) * 100).astype(dtype)
        blocks = [(slice(0, 3), slice(0, 4)), (slice(0, 3), slice(4, 10)), (slice(3, 6), slice(0, 10))]
        assert sum(sum32(a[i], i, a.shape) for i in blocks) % (1 << 32) == sum32(a), dtype
        for byte in range(a.nbytes):
            b = a.copy()
            b.reshape(-1).view(np.uint8)[byte] ^= 1 << (byte % 8)
            assert sum32(b) != sum32(a), (dtype, byte)
    swapped = np.array([1.0, 2.0], np.float32)
    assert sum32(swapped) != sum32(swapped[::-1].copy())  # positions count
    assert sum32(np.array(3, np.int32)) == 3  # a 0-d array: its word, weight 1


def test_hosts_write_their_own_shards_and_any_layout_reads_them(tmp_path):
    path = str(tmp_path / "ck")
    port = _port()
    procs = [_start("save", h, port, path) for h in (0, 1)]
    infos = [_result(p) for p in procs]
    assert [i["host"] for i in infos] == [0, 1]
    # w (64x8 float32, 2 KiB) is split over 4 devices: each host wrote half;
    # the replicated leaves count once, on host 0 (replica 0 of their blocks).
    assert infos[1]["bytes_written"] == 64 * 8 * 4 // 2, infos
    assert infos[0]["bytes_written"] == 64 * 8 * 4 // 2 + 8 * 4 + 4, infos
    assert CheckpointStore(path).committed_steps() == [1]
    state_dir = tmp_path / "ck" / "1" / "state"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state_dir))
    # One process, four devices, another sharding: the same values.
    got = _result(_start("restore1", 0, 0, path))
    assert got["ok"] and got["meta"] == {"step": 1} and len(got["blocks"]) == 4, got
    # Plain Orbax, no template of ours: whole numpy arrays, checksums hold.
    import orbax.checkpoint as ocp

    restored = ocp.CheckpointManager(path).restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(
        {"params": {"w": np.zeros((64, 8), np.float32), "b": np.zeros(8, np.int32), "count": np.zeros((), np.int32)}})))
    np.testing.assert_array_equal(restored.state["params"]["w"], np.arange(512, dtype=np.float32).reshape(64, 8) / 7)
    recorded = integrity.recorded_arrays(CheckpointStore(path).dir, 1)
    assert integrity.check_arrays(1, restored.state, recorded) == 3
    # Every file of the step was recorded by host 0 after the commit.
    assert integrity.check_files(path, "1", 1, full=True) is True


def test_a_host_that_dies_mid_save_leaves_no_committed_step(tmp_path):
    path = str(tmp_path / "ck")
    port = _port()
    p0, p1 = _start("die", 0, port, path), _start("die", 1, port, path)
    try:
        p1.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p0.kill(), p1.kill()
        raise
    assert p1.returncode == 3  # died after the checksum rendezvous, before writing
    # Host 0 waits for host 1 at Orbax's barrier (or fails when the JAX
    # coordination service finds host 1 gone): nothing is committed. Its
    # own part (a few KiB) is written in well under a second, so a commit
    # that did not wait for host 1 would show within these 3 s.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and p0.poll() is None:
        assert CheckpointStore(path).committed_steps() == []
        time.sleep(1.0)
    p0.kill()
    p0.communicate()
    store = CheckpointStore(path)
    assert store.committed_steps() == []
    store.sweep()  # what the next save does first: the half-written step goes
    assert [s.name for s in store.steps()] == []


def test_a_step_the_hosts_find_damaged_is_set_aside_and_the_join_retried():
    """In a run (every slice lost, the newest checkpoint the source), the
    hosts reading a sharded step find its arrays damaged: the step is moved
    aside through the coordinator and the join reports failure, so the
    controller takes the next source (the next-newest step)."""
    from ray_elastic.checkpoint.host_writes import HostRestore
    from ray_elastic.errors import CheckpointDamaged
    from ray_elastic.control.membership import Membership, StateSource

    class Backend:
        def load(self, slices, source, timeout_s):
            raise CheckpointDamaged(source.step, "state", "array params/w: sum32 1 read, 2 written")

    class Checkpoints:
        damaged: list = []

        def damaged_on_load(self, d):
            self.damaged.append((d.step, d.file))

    ck = Checkpoints()
    m = Membership(Backend(), snapshots=None, emit=lambda *a, **k: None, checkpoints=ck)
    m.ready = {1}
    assert m.join([1], StateSource("checkpoint", 20, HostRestore("/x", 3, 20))) is False
    assert ck.damaged == [(20, "state")] and m.live == set() and m.ready == {1}

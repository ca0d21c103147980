"""The checkpoint store against local disk and a real GCS-compatible server
(fake-gcs-server): commit, keep, incomplete steps after a writer killed
mid-write, storage down at start, failed saves not cached."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from ray_elastic.checkpoint import CheckpointConfig, CheckpointStore, StorageError
from ray_elastic.errors import ConfigError


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    request.getfixturevalue("gcs")
    return f"gs://ckpt/{uuid.uuid4().hex[:8]}"


def _state(k: float, n: int = 4):
    return {"params": {"w": np.full((n, 3), k, np.float32)}, "opt_state": [np.asarray(int(k), np.int32)]}


def test_save_restore_and_keep(root):
    store = CheckpointStore(root, keep=2)
    store.preflight()
    for k in (1, 2, 3):
        info = store.save(k, _state(k), {"seed": 0})
        assert info["step"] == k and info["bytes"] > 0
    assert store.committed_steps() == [2, 3]  # keep=2 dropped step 1
    state, meta = store.restore()
    assert meta == {"seed": 0}
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 3.0, np.float32))
    assert store.read_meta(3) == {"seed": 0}


def test_saves_reuse_one_manager_until_a_failure(tmp_path):
    """Periodic saves share one Orbax manager (building one and sweeping the
    folder per save cost as much CPU as the save); a failed save drops it,
    so the next save starts afresh and sweeps what the failure left."""
    blocker = tmp_path / "blocked"
    store = CheckpointStore(str(blocker / "ckpt"), keep=3, retries=0)
    store.save(1, _state(1.0), {})
    mgr = store._mgr
    store.save(2, _state(2.0), {})
    assert store._mgr is mgr
    store.save(2, _state(9.0), {})  # already written (a redo after a rewind): kept as is
    state, _ = store.restore(2)
    assert int(state["opt_state"][0]) == 2
    os.rename(blocker, tmp_path / "moved")
    blocker.write_text("not a folder")  # the storage breaks for real
    with pytest.raises(StorageError, match="step 3"):
        store.save(3, _state(3.0), {})
    assert store._mgr is None
    blocker.unlink()
    os.rename(tmp_path / "moved", blocker)
    store.save(4, _state(4.0), {})
    assert store._mgr is not None and store._mgr is not mgr
    assert store.committed_steps() == [1, 2, 4]


def test_background_saves_take_idle_cpu_and_escalate_when_starved():
    """A periodic save runs in Linux's idle CPU class, in every thread,
    threads started during it included (Orbax's); one still running after
    the grace period is put back in the normal class (late, never starved),
    and the block always ends in the normal class."""
    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no SCHED_IDLE on this OS")
    code = textwrap.dedent("""
        import os, threading, time
        from ray_elastic.checkpoint.cpu_priority import _idle_class_reversible, background_cpu
        if not _idle_class_reversible():
            print("unprivileged"); raise SystemExit
        def policies():  # of the threads alive now (the cancelled timer's may end while this reads)
            out = set()
            for t in os.listdir("/proc/self/task"):
                try:
                    out.add(os.sched_getscheduler(int(t)))
                except ProcessLookupError:
                    pass
            return out
        idle, other = os.SCHED_IDLE, os.SCHED_OTHER
        with background_cpu(grace_s=60) as cpu:
            seen = []
            t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
            t.start(); t.join()
            quick = (os.sched_getscheduler(0) == idle, seen == [idle], cpu.escalated)
        after_quick = policies() == {other}
        with background_cpu(grace_s=0.3) as cpu:
            before = os.sched_getscheduler(0) == idle
            time.sleep(1.0)  # a save that outlasts the grace period
            lifted = (cpu.escalated, os.sched_getscheduler(0) == other)
        print(quick, after_quick, before, lifted, policies() == {other})
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "unprivileged":
        pytest.skip("this process may not leave the idle class, so background_cpu stays in the normal one")
    assert out.stdout.split("\n")[0] == "(True, True, False) True True (True, True) True", out.stdout


def test_writer_killed_mid_write_leaves_nothing_that_blocks(root, tmp_path):
    """SIGKILL a process while it writes a step: the half-written step is
    listed as uncommitted, never restored, swept before the next save, and
    both a restore and a later save work."""
    store = CheckpointStore(root, keep=5)
    store.save(1, _state(1.0), {"seed": 0})
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {os.getcwd()!r})
        from ray_elastic.checkpoint import CheckpointStore
        big = {{"params": {{f"w{{i}}": np.random.default_rng(i).standard_normal((1024, 1024)).astype(np.float32) for i in range(64)}},
               "opt_state": [np.asarray(2, np.int32)]}}
        print("writing", flush=True)
        CheckpointStore({root!r}, retries=0).save(2, big, {{"seed": 0}})
        print("done", flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert proc.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until step 2 has started to appear
            if any(s.step == 2 for s in store.steps()):
                break
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    steps = store.steps()
    assert any(s.step == 2 and not s.committed for s in steps), steps
    assert store.latest_committed() == 1
    state, _ = store.restore()  # not blocked by the half-written step
    assert int(state["opt_state"][0]) == 1
    assert all(s.committed for s in store.steps())  # swept
    store.save(3, _state(3.0), {"seed": 0})
    assert store.committed_steps() == [1, 3]


def test_missing_bucket_is_a_clear_error(gcs):
    with pytest.raises(StorageError, match="does not exist"):
        CheckpointStore("gs://no-such-bucket/run").preflight(timeout_s=20)


def test_server_down_at_start_is_a_bounded_clear_error(gcs):
    gcs.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="no answer"):
            CheckpointStore("gs://ckpt/down").preflight(timeout_s=2)
        assert time.monotonic() - t0 < 10
    finally:
        gcs.resume()


def test_unwritable_local_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="cannot write"):
        CheckpointStore(str(blocker / "sub")).preflight()


def test_failed_save_is_not_cached(gcs, gcs_outage_fails_fast):
    """A save that failed while the server was away must not make later
    saves skip (a known failure elsewhere): each save starts afresh."""
    root = f"gs://ckpt/{uuid.uuid4().hex[:8]}"
    store = CheckpointStore(root, retries=0)
    store.save(1, _state(1.0), {})
    gcs.stop()
    try:
        with pytest.raises(Exception):
            store.save(2, _state(2.0), {})
    finally:
        gcs.start()
    store.save(3, _state(3.0), {})
    assert 3 in store.committed_steps()
    state, _ = store.restore(3)
    assert int(state["opt_state"][0]) == 3


def test_transient_error_is_retried_with_backoff(tmp_path):
    """A write that fails for real (its folder's parent is a file for a
    moment) is retried after a backoff, and lands."""
    blocker = tmp_path / "blocked"
    blocker.write_text("not a folder")
    waits = []

    def sleep(s):
        waits.append(s)
        if len(waits) == 1:
            blocker.unlink()  # the outage ends during the first backoff

    store = CheckpointStore(str(blocker / "ckpt"), retries=3, backoff_s=0.25, sleep=sleep)
    info = store.save(1, _state(1.0), {})
    assert info["step"] == 1 and store.committed_steps() == [1]
    assert waits == [0.25]


def test_persistent_error_gives_up_after_retries(tmp_path):
    blocker = tmp_path / "blocked"
    blocker.write_text("not a folder")
    waits = []
    store = CheckpointStore(str(blocker / "ckpt"), retries=2, backoff_s=0.1, sleep=waits.append)
    with pytest.raises(StorageError, match="after 3 attempts"):
        store.save(1, _state(1.0), {})
    assert waits == [0.1, 0.2]  # doubling backoff


@pytest.mark.parametrize(
    "bad, setting",
    [
        (dict(path=""), "checkpoint.path"),
        (dict(path="s3://bucket/x"), "checkpoint.path"),
        (dict(path="gs:///x"), "checkpoint.path"),
        (dict(path="/tmp/x", keep=0), "checkpoint.keep"),
        (dict(path="/tmp/x", save_every=-1), "checkpoint.save_every"),
        (dict(path="/tmp/x", retry_backoff_s=-1), "checkpoint.retry_backoff_s"),
    ],
)
def test_config_validation(bad, setting):
    with pytest.raises(ConfigError) as info:
        CheckpointConfig(**bad)
    assert info.value.setting == setting

"""A lost driver (issue #12, point 4), end to end on a real head.

The cluster is the one tests/test_job_submission_e2e.py starts (a `ray
start` head with no CPUs and two one-CPU worker nodes, on ports and a temp
dir of their own, stopped by pid). The job is examples/train_lm.py with
durable checkpoints (`--checkpoint <folder> --save-every 5`), submitted with
`ray job submit`. Mid-run, once a few checkpoints are committed, its driver
(the job's entrypoint process, the single controller) gets SIGKILL: nothing
in ray_elastic runs, as when the head pod's container is OOM-killed.

Then:
- the job is FAILED, and Ray takes the dead driver's worker actors and its
  slices' placement groups down by itself (non-detached actors and placement
  groups belong to their job's driver): the state API shows none of the dead
  job's actors alive and none of its placement groups created, so no leaked
  reservation can block the next run (the same query, before the kill, does
  find them: the check can fail). The one exception is by design: a node's
  `NodeWatcher` (failures/process_state.py) is detached, made by the first
  run on the node for every run after, and reserves nothing; it stays;
- the job is resubmitted with the same entrypoint, as a RayJob's retry
  (`backoffLimit`) or Anyscale's `max_retries` does. The new driver reserves
  both slices (its placement groups are CREATED), takes the watchers the dead
  driver left rather than making its own, resumes from the newest committed
  step (`resumed_from` in its report) and runs every step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

import pytest

from tests.test_job_submission_e2e import RayStartCluster, _logs, _submit, _wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

STEPS = 80  # the kill comes at step ~18 (3 commits), with ~60 steps of margin; the retry runs the rest
SAVE_EVERY = 5
# SIGKILL once this many steps are committed (3 checkpoints at least).
KILL_AT_COMMITTED = 3 * SAVE_EVERY


def _stop(cluster: RayStartCluster) -> None:
    import shutil

    left = cluster.stop()
    if os.environ.get("RAY_ELASTIC_KEEP_TEST_DIRS"):
        print(f"test cluster's folder kept: {cluster.temp_dir}")
    else:
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    assert not left, f"processes of the test cluster still alive: {left}"


@pytest.fixture(scope="module")
def ray_cluster():
    # A second try on a fresh cluster: on a loaded machine a `ray start`
    # worker can miss Ray's fixed 30 s for its raylet to register.
    for attempt in (1, 2):
        cluster = RayStartCluster(tempfile.mkdtemp(prefix="re-drv-", dir="/tmp"))  # short: socket paths < 108 bytes
        try:
            cluster.start()
            break
        except (RuntimeError, TimeoutError) as e:
            _stop(cluster)
            if attempt == 2:
                raise
            print(f"\ntest cluster did not start ({str(e).splitlines()[0]}); trying a fresh one")
    try:
        yield cluster
    finally:
        _stop(cluster)


def _listed(cluster: RayStartCluster, resource: str, **filters) -> list[dict]:
    """`ray list <resource>` through the state API of the head, as dicts."""
    from dataclasses import asdict, is_dataclass

    from ray.util.state.common import ListApiOptions, StateResource

    rows = cluster.state().list(
        StateResource(resource),
        options=ListApiOptions(filters=[(k, "=", v) for k, v in filters.items()], detail=True),
        raise_on_missing_output=False,
    )
    return [asdict(r) if is_dataclass(r) else dict(r) for r in rows]


def _is_node_watcher(actor: dict) -> bool:
    return actor["class_name"] == "NodeWatcher"


def _held_by(cluster: RayStartCluster, job_id: str) -> tuple[list[dict], list[dict]]:
    """What a job still holds: its actors that are not DEAD and its
    placement groups that are not REMOVED (alive, pending, restarting,
    rescheduling: anything that keeps or wants resources), less its node
    watchers, which outlive it on purpose (see `_assert_watchers_reserve_nothing`)."""
    actors = [a for a in _listed(cluster, "actors", job_id=job_id)
              if a["state"] != "DEAD" and not _is_node_watcher(a)]
    groups = [g for g in _listed(cluster, "placement_groups", creator_job_id=job_id) if g["state"] != "REMOVED"]
    return actors, groups


def _assert_watchers_reserve_nothing(watchers: list[dict]) -> None:
    """A node's NodeWatcher is made by the first run on the node for every
    run after (named, detached: failures/process_state.py), so it outlives
    its driver. It must hold no resources and no placement group: a retry
    then finds its reservations unblocked."""
    for w in watchers:
        assert w["is_detached"] and not w["required_resources"] and not w["placement_group_id"], w


def _ray_job(cluster: RayStartCluster, submission_id: str, timeout: float = 120):
    """The job's details once its driver has connected (Ray job id and the
    driver's pid known)."""
    client = cluster.jobs()
    deadline = time.monotonic() + timeout
    while True:
        info = client.get_job_info(submission_id)
        if info.job_id and info.driver_info and info.driver_info.pid:
            return info
        assert str(info.status.value) in ("PENDING", "RUNNING"), _logs(cluster, submission_id)[-5000:]
        assert time.monotonic() < deadline, f"driver of {submission_id} not connected after {timeout} s"
        time.sleep(0.5)


def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_lost_driver_resubmitted_resumes_from_newest_checkpoint(ray_cluster, tmp_path):
    from ray.job_submission import JobStatus

    from ray_elastic.checkpoint import CheckpointStore

    ckpt, report_path, events_path = str(tmp_path / "ckpt"), str(tmp_path / "report.json"), str(tmp_path / "events.jsonl")
    # The entrypoint of both attempts: a retry runs the very same command.
    args = ("--slices", "2", "--policy", "resize", "--steps", str(STEPS), "--checkpoint", ckpt,
            "--save-every", str(SAVE_EVERY), "--report", report_path, "--events", events_path)
    store = CheckpointStore(ckpt)
    t0 = time.monotonic()

    # -- attempt 1: train until a few checkpoints are committed --------------
    first = _submit(ray_cluster, *args)
    info = _ray_job(ray_cluster, first)
    job_id, driver_pid = info.job_id, int(info.driver_info.pid)  # a string in JobDetails
    client = ray_cluster.jobs()
    deadline = time.monotonic() + 240
    while (store.latest_committed() or 0) < KILL_AT_COMMITTED:
        status = client.get_job_status(first)
        assert status == JobStatus.RUNNING, f"job {first} {status} before the kill:\n{_logs(ray_cluster, first)[-5000:]}"
        assert time.monotonic() < deadline, f"no step {KILL_AT_COMMITTED} committed:\n{_logs(ray_cluster, first)[-5000:]}"
        time.sleep(0.2)
    # The driver is the entrypoint process: the pid its event log gives
    # (os.getpid() in the driver) is the one Ray registered for the job.
    assert _events(events_path)[0]["pid"] == driver_pid
    # Before the kill the query finds what the job holds: two slices' placement
    # groups and their workers (plus the checkpoint writer), so an empty answer
    # after it means gone, not a filter that matches nothing.
    actors, groups = _held_by(ray_cluster, job_id)
    assert len([g for g in groups if g["state"] == "CREATED"]) == 2, groups
    assert {a["class_name"] for a in actors if a["state"] == "ALIVE"} >= {"SliceWorker"}, actors
    worker_pids = [a["pid"] for a in actors if a.get("pid")]  # the watchers' processes stay, by design

    os.kill(driver_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    committed_at_kill = store.latest_committed()
    trained = max((e["step"] for e in _events(events_path) if e["event"] == "step"), default=0)
    print(f"\nSIGKILL to driver pid {driver_pid} (job {first}, Ray job {job_id}) at "
          f"{killed_at - t0:.1f} s, step {trained}/{STEPS} logged, newest committed step {committed_at_kill}, "
          f"{len(actors)} actors and {len(groups)} placement groups held")

    # -- the dead driver's job fails, and Ray releases what it held ----------
    assert _wait_for(ray_cluster, first, timeout=60) == "FAILED"
    failed_after = time.monotonic() - killed_at
    deadline = time.monotonic() + 60
    while any(held := _held_by(ray_cluster, job_id)):
        assert time.monotonic() < deadline, f"60 s after the driver's SIGKILL job {job_id} still holds {held}"
        time.sleep(0.2)
    released_after = time.monotonic() - killed_at
    watchers_left = [a for a in _listed(ray_cluster, "actors", job_id=job_id) if a["state"] != "DEAD"]
    assert all(_is_node_watcher(a) for a in watchers_left), watchers_left
    _assert_watchers_reserve_nothing(watchers_left)
    deadline = time.monotonic() + 30
    while left := [p for p in worker_pids if _alive(p)]:
        assert time.monotonic() < deadline, f"the dead driver's actor processes {left} still run"
        time.sleep(0.2)
    exited_after = time.monotonic() - killed_at
    print(f"job FAILED {failed_after:.1f} s after the kill; its actors dead and placement groups removed "
          f"after {released_after:.1f} s; their processes gone after {exited_after:.1f} s; "
          f"{len(watchers_left)} node watchers stay, reserving nothing")

    # -- attempt 2: the retry resumes from the newest committed step --------
    resume_step = store.latest_committed()
    assert resume_step is not None and resume_step >= committed_at_kill
    second = _submit(ray_cluster, *args)
    info2 = _ray_job(ray_cluster, second)
    assert info2.job_id != job_id and int(info2.driver_info.pid) != driver_pid
    # Its slices are placed: both placement groups CREATED, nothing left
    # pending behind a leaked reservation.
    deadline = time.monotonic() + 120
    while True:
        groups2 = _listed(ray_cluster, "placement_groups", creator_job_id=info2.job_id)
        if len([g for g in groups2 if g["state"] == "CREATED"]) == 2:
            break
        status = client.get_job_status(second)
        if status != JobStatus.RUNNING:  # it ended first: its events say the slices came up
            break
        assert time.monotonic() < deadline, f"the new job's slices not placed: {groups2}"
        time.sleep(0.2)
    assert _wait_for(ray_cluster, second, timeout=240) == "SUCCEEDED", _logs(ray_cluster, second)[-5000:]
    # On a node where the dead driver left a watcher, the retry took it
    # rather than making another: a watcher is made once per node, not per run.
    watched = {a["node_id"] for a in watchers_left}
    made_by_retry = [a for a in _listed(ray_cluster, "actors", job_id=info2.job_id)
                     if _is_node_watcher(a) and a["node_id"] in watched]
    assert not made_by_retry, (made_by_retry, watchers_left)
    print(f"resubmitted job {second} resumed from step {resume_step} and finished "
          f"{time.monotonic() - killed_at:.1f} s after the kill ({time.monotonic() - t0:.1f} s in all)")

    with open(report_path) as f:
        report = json.load(f)
    assert report["resumed_from"] == resume_step, (report["resumed_from"], resume_step)
    assert report["steps_completed"] == STEPS and report["outcome"] == "completed", report
    assert report["driver_pid_start"] == report["driver_pid_end"] == int(info2.driver_info.pid)
    assert report["failures"] == [], report["failures"]
    events = _events(events_path)  # the retry's own log (same path, rewritten)
    assert events[0]["pid"] == int(info2.driver_info.pid)
    assert {e["slice"] for e in events if e["event"] == "slice_ready"} == {0, 1}, events
    assert report["slices_per_step"][-1] == 2
    assert store.latest_committed() == STEPS  # the final step is committed too
    logs = _logs(ray_cluster, second)
    assert f"done: {STEPS} steps" in logs, logs[-5000:]

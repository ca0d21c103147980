"""Whether a silent worker is stopped or only busy, asked of its node.

A worker answers heartbeats on a thread of its own, which needs Python's
GIL. A process whose GIL another thread holds for seconds (a garbage
collection over a large heap, a C extension that does not release it, a
multi-GB host copy) answers nothing for as long, yet it is running and
will answer again; a stopped process (SIGSTOP, a debugger) or a frozen
node never will. The kernel knows the difference: /proc/<pid>/stat's
state is T (stopped) or t (traced) for the one, R, S or D for the other.

A `NodeWatcher` is a small actor, one per node (named, detached: made by
the first run that needs it on that node and used by every run after; it
imports nothing beyond Ray and answers from its own process, with no GIL
of the worker's in the way). It is made when a slice goes live on the
node, so it is up before any silence needs it. It also ends the idle
processes a driver's earlier runs kept warm that no later run can use
(`end_idle`, worker/warm_pool.py).
"""

from __future__ import annotations

from typing import Any, Optional

import ray

__all__ = ["BUSY", "GONE", "NodeWatcher", "STOPPED", "ask", "end", "end_idle", "existing_watcher", "proc_state",
           "watcher_for"]

BUSY = "busy"  # running, sleeping or in the kernel: alive, and will answer
STOPPED = "stopped"  # stopped or traced: will not answer until continued
GONE = "gone"  # exited (or a zombie: exited, not yet reaped)

NAMESPACE = "ray_elastic"


def proc_state(pid: int, proc_root: str = "/proc") -> str:
    """BUSY, STOPPED or GONE for `pid` on this machine."""
    try:
        with open(f"{proc_root}/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return GONE
    # The state follows the command name, which is in parentheses and may
    # itself hold spaces or parentheses: read after the last ')'.
    state = stat[stat.rindex(")") + 2:].split(" ", 1)[0]
    if state in ("T", "t"):
        return STOPPED
    if state in ("Z", "X", "x"):
        return GONE
    return BUSY


def end(pid: int, started: float) -> bool:
    """SIGKILL the process `pid` if it is still the one that started at
    `started` (psutil's create_time); True if it was sent."""
    import os
    import signal

    import psutil

    try:
        if abs(psutil.Process(pid).create_time() - started) > 0.05:
            return False  # the pid names another process now
        os.kill(pid, signal.SIGKILL)
        return True
    except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
        return False


def end_idle(job_id: str, marker: str, keep: dict, proc_root: str = "/proc") -> list[int]:
    """SIGKILL every idle worker process of Ray's (titled `ray::IDLE`) of
    job `job_id` on this machine that has the variable `marker` in its
    environment and any variable named in `keep` set otherwise (unset
    reads as ""); returns their pids. Ray never hands such a process to an
    actor whose runtime environment differs, so it would only idle."""
    import os
    import signal

    ended = []
    for pid in filter(str.isdigit, os.listdir(proc_root)):
        try:
            with open(f"{proc_root}/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::IDLE"):
                    continue
            with open(f"{proc_root}/{pid}/environ", "rb") as f:
                env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
        except OSError:  # gone, or not ours to read
            continue
        if env.get("RAY_JOB_ID") != job_id or marker not in env:
            continue
        if all(env.get(k, "") == v for k, v in keep.items()):
            continue
        try:
            os.kill(int(pid), signal.SIGKILL)
            ended.append(int(pid))
        except (ProcessLookupError, PermissionError):
            pass
    return ended


@ray.remote(num_cpus=0, max_concurrency=4)
class NodeWatcher:
    def state(self, pid: int) -> str:
        return proc_state(pid)

    def end(self, pid: int, started: float) -> bool:
        """A worker the driver gave up on, ended at once: Ray's own kill
        waits for a graceful exit that a stopped or GIL-bound process never
        makes, and until the process exits its bundle of the slice's
        placement group (and its accelerator memory) is not free for the
        replacement."""
        return end(pid, started)

    def end_idle(self, job_id: str, marker: str, keep: dict) -> list[int]:
        return end_idle(job_id, marker, keep)


def watcher_for(node_id: str) -> Any:
    """The node's watcher, made if it is not there yet (the call returns
    at once; the process starts in the background)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeWatcher.options(
        name=f"watcher-{node_id}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote()


def existing_watcher(node_id: str) -> Any:
    """The node's watcher if one was made, else None (none is made)."""
    try:
        return ray.get_actor(f"watcher-{node_id}", namespace=NAMESPACE)
    except ValueError:
        return None


def ask(watcher: Any, pid: int, timeout_s: float) -> Optional[str]:
    """The pid's state, or None where the watcher did not answer in time
    (still starting, or its node does not answer either)."""
    try:
        return ray.get(watcher.state.remote(pid), timeout=timeout_s)
    except ray.exceptions.RayError:
        return None

"""A replacement worker starts only once the workers it replaces on its
node are gone: an accelerator's memory is freed when the process that
holds it exits, and a replacement that starts JAX beside a process still
exiting (or hung: SIGSTOPped, stuck in a driver call) cannot allocate
its own (CUDA_ERROR_OUT_OF_MEMORY on a shared GPU).

The driver names the processes it gave up on, by node (pid and start
time, so that a pid the kernel has since given to another process is
never touched). A predecessor still running after `GRACE_S` (Ray's own
kill on its way) is sent SIGKILL; set-up begins once every one has
exited. A zombie (exited, not yet reaped by its raylet) holds no memory
and counts as gone.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Callable, Sequence

import psutil

__all__ = ["GRACE_S", "Predecessor", "PredecessorsGone", "process_started", "wait_gone"]

GRACE_S = 2.0  # Ray's kill of the old actor normally ends it well within this
_EXIT_WAIT_S = 10.0  # after SIGKILL: the kernel frees the process's memory
_START_TOLERANCE_S = 0.05  # psutil's start times are rounded


@dataclasses.dataclass(frozen=True)
class Predecessor:
    """A worker process the driver gave up on: its pid, when it started
    (psutil's create_time, wall clock), and its node."""

    pid: int
    started: float
    node_id: str


@dataclasses.dataclass(frozen=True)
class PredecessorsGone:
    """What the wait found: the predecessors on this node (pids), those
    that still ran and were killed, and the seconds it took."""

    pids: tuple[int, ...]
    killed: tuple[int, ...]
    waited_s: float


def process_started() -> float:
    """This process's start time as `Predecessor.started` takes it."""
    return psutil.Process().create_time()


def _running(p: Predecessor) -> bool:
    """The process is still there (not a zombie) and is the same one."""
    try:
        proc = psutil.Process(p.pid)
        if abs(proc.create_time() - p.started) > _START_TOLERANCE_S:
            return False  # the pid now names another process
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(predecessors: Sequence[Predecessor], node_id: str, grace_s: float = GRACE_S,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
              running: Callable[[Predecessor], bool] = _running,
              kill: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGKILL)) -> PredecessorsGone:
    """Wait until every predecessor on `node_id` has exited, killing those
    still running after `grace_s`. Raises TimeoutError if one outlives its
    SIGKILL by `_EXIT_WAIT_S` (a process stuck in the kernel: its memory
    is not coming back)."""
    mine = [p for p in predecessors if p.node_id == node_id]
    t0 = clock()
    killed: list[int] = []
    left = [p for p in mine if running(p)]
    while left:
        waited = clock() - t0
        if waited >= grace_s:
            for p in left:
                if p.pid not in killed:
                    try:
                        kill(p.pid)
                    except ProcessLookupError:
                        pass
                    killed.append(p.pid)
        if waited >= grace_s + _EXIT_WAIT_S:
            raise TimeoutError(f"worker processes {[p.pid for p in left]} on this node did not exit "
                               f"{_EXIT_WAIT_S:.0f} s after SIGKILL; their memory is still held")
        sleep(0.02)
        left = [p for p in left if running(p)]
    return PredecessorsGone(tuple(p.pid for p in mine), tuple(killed), round(clock() - t0, 4))


"""Linux's idle CPU class for background work (periodic checkpoint saves):
its threads take only CPU time nothing else wants."""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

__all__ = ["background_cpu"]

log = logging.getLogger("ray_elastic")


def _cpu_class(background: bool, skip: frozenset = frozenset()) -> bool:
    """Put every thread of this process (but `skip`) in Linux's idle
    scheduling class, or back in the normal one. Threads started later
    (Orbax's, tensorstore's) inherit the class of the thread that starts
    them. Returns False where some thread could not be moved."""
    policy = getattr(os, "SCHED_IDLE" if background else "SCHED_OTHER", None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        return False
    ok = True
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in skip:
            continue
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except (OSError, ValueError):
            ok = False  # the thread ended, or no permission
    return ok


def _idle_class_reversible() -> bool:
    """Whether this process may leave the idle class again (unprivileged
    processes may not, under the usual RLIMIT_NICE of 0): tried on a
    scratch thread."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join()
    return bool(result and result[0])


# Whether this process may leave the idle class again: probed once.
_REVERSIBLE: Optional[bool] = None


class background_cpu:
    """Run a block in Linux's idle CPU class: its threads then take only
    CPU time nothing else wants, so a periodic save where the writer shares
    CPUs with training (a small head node, a laptop) waits for the steps'
    idle moments instead of slowing them (a nice value still takes a share).
    A block still running after `grace_s` (the CPUs are never idle) goes
    back to the normal class, so a save is late, never starved. Used only
    where the process may leave the class again; elsewhere the block runs
    in the normal class."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.escalated = False
        self._timer: Optional[threading.Timer] = None

    def __enter__(self):
        global _REVERSIBLE
        if _REVERSIBLE is None:
            _REVERSIBLE = _idle_class_reversible()
        if not _REVERSIBLE:
            return self
        # The timer thread stays in the normal class: it must run to lift
        # the block out of a CPU that is never idle.
        self._timer = threading.Timer(self.grace_s, self._escalate)
        self._timer.daemon = True
        self._timer.start()
        _cpu_class(background=True, skip=frozenset({self._timer.native_id}))
        return self

    def _escalate(self) -> None:
        self.escalated = True
        _cpu_class(background=False)
        log.warning("checkpoint writer: no idle CPU for %.0f s; saving at normal priority", self.grace_s)

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            _cpu_class(background=False)

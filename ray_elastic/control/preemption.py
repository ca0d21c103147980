"""Preemption notices, returned at step boundaries: SIGTERM to the driver
(a preemption of the head, a cancelled job), SIGTERM to a worker (reported
with its last step), or a Ray drain notice with a deadline for one of a
live slice's nodes. Time is passed in; the drain lookup is injected."""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import Callable, Optional, Union

from ray_elastic.cluster import drain
__all__ = ["DriverStop", "SliceNotice", "PreemptionWatcher"]

DRAIN_POLL_S = 0.5  # Ray's drain table is read at most this often
WORKER_SIGTERM_GRACE_S = 30.0  # time assumed left after a worker's SIGTERM
DRAIN_DEFAULT_GRACE_S = 60.0  # a drain notice without a deadline


@dataclasses.dataclass(frozen=True)
class DriverStop:
    reason: str


@dataclasses.dataclass(frozen=True)
class SliceNotice:
    slice_id: int
    host: int
    reason: str
    left_s: float  # seconds until the host goes
    noticed_at: float  # wall time of the notice


Notice = Union[DriverStop, SliceNotice]


class PreemptionWatcher:
    def __init__(self, draining_nodes: Callable[[], dict] = drain.draining_nodes):
        self._draining_nodes = draining_nodes
        self._driver_stop: Optional[str] = None
        self._worker_sigterms: dict[tuple[int, int], float] = {}  # (slice, host) -> wall time
        self._drains_read_at = float("-inf")
        self._previous_handler = None

    def install(self) -> None:
        """Catch SIGTERM to the driver (main thread only): the run finishes
        the step in flight, checkpoints it and exits cleanly."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            self._driver_stop = "SIGTERM to the driver"

        self._previous_handler = signal.signal(signal.SIGTERM, handler)

    def uninstall(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def record_step(self, metrics: dict) -> None:
        """Workers report a SIGTERM they caught with their step's metrics."""
        for (s, h), m in metrics.items():
            if "preempt_notice_at" in m:
                self._worker_sigterms.setdefault((s, h), m["preempt_notice_at"])

    def check(self, hosts: dict[int, list[dict]], now: float, wall_now: float) -> Optional[Notice]:
        """The next notice for the run or one of its live slices (`hosts`:
        slice -> its hosts' infos), or None. `now` is the controller's
        clock, `wall_now` the wall clock drain deadlines are given in."""
        if self._driver_stop is not None:
            return DriverStop(self._driver_stop)
        for (s, h), at in sorted(self._worker_sigterms.items()):
            if s in hosts:
                del self._worker_sigterms[(s, h)]
                return SliceNotice(s, h, "SIGTERM to the worker", WORKER_SIGTERM_GRACE_S, at)
        if now - self._drains_read_at < DRAIN_POLL_S or not hosts:
            return None
        self._drains_read_at = now
        draining = self._draining_nodes()
        for s, infos in sorted(hosts.items()):
            for h, info in enumerate(infos):
                if info["node_id"] in draining:
                    deadline_ms = draining[info["node_id"]]
                    left = deadline_ms / 1000.0 - wall_now if deadline_ms else DRAIN_DEFAULT_GRACE_S
                    reason = f"node {info['node_id'][:8]} drained for preemption"
                    return SliceNotice(s, h, reason, left, wall_now)
        return None

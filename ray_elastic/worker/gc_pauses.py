"""Python's garbage collector in a worker: the long-lived heap kept out of
its collections, and the pauses it still makes, measured.

A full collection walks every object the collector tracks while holding
the GIL. A worker's heap is mostly JAX's (its modules, the traced and
compiled step, nanobind's function objects): hundreds of thousands of
objects that live as long as the process. Ray asks every worker of a node
for a full collection (`gc.collect()` on its own thread) whenever the
node's object store fills up, which a snapshot of a large state does; on a
host whose cores are busy with the steps' XLA threads that walk took a
second and more, and for all that time no other thread of the worker ran
Python: the liveness pings went unanswered, and healthy, busy workers were
called hung.

So once set-up has built everything the step needs, the heap is frozen
(`gc.freeze()`: the objects tracked then move to a permanent generation no
collection walks), and again after the process's first step, which builds
what is first made on use. A later collection walks only what is newer:
the few objects a step leaves behind. Frozen objects are still freed when
their last reference goes; only a reference cycle among them is kept for
the process's life (set-up's cycles are collected before the freeze).

`GcPauses` also times every collection of the process, whoever starts it
(`gc.callbacks`), so a step's metrics can say how long the worker's
Python stood still (`gc_pause_s`, the longest since the last report).
"""

from __future__ import annotations

import gc
import threading
import time

__all__ = ["GcPauses", "step_pauses"]


class GcPauses:
    """The collector's pauses in this process, and the freezes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}  # thread id -> perf_counter at its collection's start
        self.longest_s = 0.0  # since the last `take`
        self.full = 0  # full collections (of the oldest generation) since the last `take`
        self.frozen = 0  # objects in the permanent generation after the last freeze
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # Runs in the collecting thread, under the GIL: keep it cheap.
        me = threading.get_ident()
        if phase == "start":
            self._started[me] = time.perf_counter()
            return
        began = self._started.pop(me, None)
        if began is None:
            return
        took = time.perf_counter() - began
        with self._lock:
            self.full += info.get("generation") == 2
            if took > self.longest_s:
                self.longest_s = took

    def freeze(self, collect: bool = False) -> int:
        """Move every object tracked now to the permanent generation
        (after a full collection with `collect`, so that no garbage cycle
        is kept); returns how many objects are frozen."""
        if collect:
            gc.collect()
            self.take()  # set-up's own collection is no pause of a step's
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        return self.frozen

    def thaw(self) -> None:
        """Undo `freeze`: a process kept for another run lets the cycles
        of the last run's objects be collected (the next freeze collects)."""
        gc.unfreeze()
        self.frozen = 0

    def take(self) -> tuple[float, int]:
        """(the longest pause in seconds, full collections) since the last take."""
        with self._lock:
            out = (self.longest_s, self.full)
            self.longest_s, self.full = 0.0, 0
        return out

    def close(self) -> None:
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass


def step_pauses(metrics) -> dict:
    """A step's `gc_pause_s` (the longest any host's collector held its
    Python still since its last apply: what a ping could not get past) and
    `gc_full` (the hosts' full collections in that time), from the hosts'
    apply metrics ((slice, host) -> dict); {} when none reports them."""
    hosts = [m for m in metrics.values() if isinstance(m, dict) and "gc_pause_s" in m]
    if not hosts:
        return {}
    return {"gc_pause_s": max(m["gc_pause_s"] for m in hosts), "gc_full": sum(m.get("gc_full", 0) for m in hosts)}

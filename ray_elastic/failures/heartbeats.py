"""Heartbeats while a step runs: a hung host found in about a second, not at
the step's deadline.

A stopped process and a slow step look alike to a deadline, but not to a
liveness signal that a healthy worker keeps giving while it computes. The
workers answer pings on a thread of their own (the `control` concurrency
group), beside their step's calls, and XLA releases the GIL while it
computes, so a worker busy with a long step still answers at once; a
SIGSTOPped process, or every process of a frozen node, does not answer at
all. While the driver waits for a step's calls (it asks here once a wait
of 0.25 s has brought nothing), every host of a slice with a call still
out is pinged, at most one ping in flight per host and one every
`every_s`; a ping unanswered for `timeout_s` names the host hung.

A worker's first step is the exception: a new process imports, traces and
compiles, and on a busy host its peers do the same at once, so its ping
thread can wait seconds for a core (seen on a loaded 2-core machine with
four slices starting together). A host's pings in its first step get
`first_timeout_s` instead, so a starting slice is not taken for a hung one;
a process frozen in its first step is still found in that long, not at the
first step's deadline. Which step is a host's first is told here before
each step (`started`: a handle not seen before is a new process); a host
only seen once pinged counts as past its start (with short steps, pings
begin whenever a wait first outlasts a poll, maybe long after its start).

The cost: one small actor call per waiting host per `every_s` (0.25 s),
only while the driver waits, none for a step shorter than a wait. An errored ping is left to the call it
shadows (a dead worker's calls fail on their own, and are sorted there).

Ray sits behind two callables (send a ping, which of these refs answered)
and time is passed in, so the logic is tested without a cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Optional

__all__ = ["Heartbeats"]


@dataclasses.dataclass
class _Host:
    worker: Any  # the handle pinged (a replacement is a new handle: a new entry)
    ref: Any = None  # the ping in flight, if any
    sent_at: float = 0.0
    answered_at: float = 0.0
    first_step: int = 0  # its first step: it may still be starting
    settled: bool = True  # past its start (False from `started` until its next step)


class Heartbeats:
    def __init__(self, send: Callable[[Any], Any], answered: Callable[[list], list], clock: Callable[[], float],
                 timeout_s: float = 1.0, every_s: float = 0.25, first_timeout_s: Optional[float] = None):
        self._send, self._answered, self._clock = send, answered, clock
        self.timeout_s, self.every_s = timeout_s, every_s
        self.first_timeout_s = timeout_s if first_timeout_s is None else max(timeout_s, first_timeout_s)
        self._hosts: dict[tuple[int, int], _Host] = {}
        self.pings = 0  # sent so far (for tests and benches)

    def started(self, live: Mapping, step: int) -> None:
        """Step `step` starts on `live`: hosts not seen before are new
        processes, in their first step (`first_timeout_s`)."""
        for key in [k for k in self._hosts if k[0] not in live]:
            del self._hosts[key]
        for s in live:
            for i, worker in enumerate(live[s].workers):
                h = self._hosts.get((s, i))
                if h is None or h.worker is not worker:
                    self._hosts[(s, i)] = _Host(worker, answered_at=self._clock() - self.every_s, first_step=step,
                                                settled=False)

    def quiet(self, live: Mapping, waiting: Iterable[int], step: int) -> Optional[tuple[int, int, float]]:
        """(slice, host, seconds without an answer) of a host of the
        `waiting` slices (those with a call still out) whose ping has gone
        unanswered for `timeout_s` (`first_timeout_s` in its first step);
        None if every one answers. Pings the
        hosts due one on the way. `live`: slice -> an object with
        `.workers` (handles, host order)."""
        now = self._clock()
        waiting = sorted(set(waiting) & set(live))
        for key in [k for k in self._hosts if k[0] not in live]:
            del self._hosts[key]
        out = {self._hosts[k].ref: k for k in self._hosts if self._hosts[k].ref is not None}
        if out:
            for ref in self._answered(list(out)):
                h = self._hosts[out[ref]]
                h.ref, h.answered_at = None, now
        for s in waiting:
            for i, worker in enumerate(live[s].workers):
                h = self._hosts.get((s, i))
                if h is None or h.worker is not worker:  # pinged at once: the driver has waited a poll already
                    h = self._hosts[(s, i)] = _Host(worker, answered_at=now - self.every_s, first_step=step)
                if not h.settled and step != h.first_step:
                    # Past its start: a ping still out from then gets the
                    # usual timeout, counted from now.
                    h.settled, h.sent_at = True, now
                if h.ref is not None:
                    if now - h.sent_at >= (self.timeout_s if h.settled else self.first_timeout_s):
                        return s, i, now - h.sent_at
                elif now - h.answered_at >= self.every_s:
                    h.ref, h.sent_at = self._send(worker), now
                    self.pings += 1
        return None

    def knows(self, live: Mapping, slice_id: int) -> bool:
        """Whether every host of the slice is one seen in a step (the same
        handle): a slice that has not run a step yet (a joining one, its
        processes maybe still starting) is not."""
        workers = live[slice_id].workers
        return all((h := self._hosts.get((slice_id, i))) is not None and h.worker is w for i, w in enumerate(workers))

    def forget(self, slice_id: int) -> None:
        """Drop a slice's hosts (found hung: its pings stay unanswered)."""
        for key in [k for k in self._hosts if k[0] == slice_id]:
            del self._hosts[key]

"""How much of a host's other work runs while it is in the exchange.

A step's exchange on a host is a window: from its gradients being ready
(the last shard's values on the host) to the summed gradient laid out in
its apply, the update's input. The next step's gradients cannot start in
it (they need the update), so the exchange itself hides behind no compute
of its own step; what can run inside it is work off the step's path: the
next step's batch read (worker/batches.py's read-ahead thread) and the
snapshot's views (worker/transfer.py, on the actor's snapshot thread).
This counts, per kind, the seconds spent and the seconds of them inside
an exchange window, so a reader sees both how much of that work the
exchange hid and how much of the window was covered by it.

Spans are on this process's monotonic clock (time.perf_counter). Each
pair of spans is counted once, when the later of the two ends; spans of
one kind do not overlap each other (each kind runs on one thread).
"""

from __future__ import annotations

import threading
from collections import deque

__all__ = ["KINDS", "SpanOverlap"]

KINDS = ("compute", "batch", "snapshot")  # work counted against the exchange's windows


class SpanOverlap:
    """Seconds of each kind of work, and of it inside exchange windows."""

    def __init__(self, keep: int = 64) -> None:
        # Recent spans only: a span ending now cannot reach back past the
        # last `keep` of another kind (each kind is one thread's, in order).
        self._recent = {k: deque(maxlen=keep) for k in ("exchange", *KINDS)}
        self._totals = {"exchange_window_s": 0.0, **{f"{k}_s": 0.0 for k in KINDS},
                        **{f"{k}_in_exchange_s": 0.0 for k in KINDS}}
        self._lock = threading.Lock()

    def add(self, kind: str, start: float, end: float) -> None:
        """A span of `kind` ("exchange" or one of KINDS) from start to end."""
        if kind != "exchange" and kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}")
        end = max(start, end)
        with self._lock:
            if kind == "exchange":
                self._totals["exchange_window_s"] += end - start
                for other in KINDS:
                    self._totals[f"{other}_in_exchange_s"] += _within(self._recent[other], start, end)
            else:
                self._totals[f"{kind}_s"] += end - start
                self._totals[f"{kind}_in_exchange_s"] += _within(self._recent["exchange"], start, end)
            self._recent[kind].append((start, end))

    def as_dict(self) -> dict:
        """The totals, in seconds (a copy)."""
        with self._lock:
            return dict(self._totals)


def _within(spans, start: float, end: float) -> float:
    """Seconds of [start, end] covered by `spans` (which do not overlap each other)."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)

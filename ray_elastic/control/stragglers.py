"""Slow slices (stragglers): a synchronous step waits for its slowest
slice, so one slice computing slower than the others holds every step.

Each host's apply reports the seconds its gradient call of the step took
and how many shards it computed (worker/steps.py); a slice's time per
shard is its slowest host's. A slice slower than `straggler_factor` times
the median of the other slices, for `straggler_steps` steps in a row whose
gradient calls add up to `straggler_min_s` seconds at least, is a
straggler. The seconds are what tell a lasting slowdown (a throttled chip,
a bad host) from a host busy for a moment (a process starting beside the
worker, a save, a collection): ten steps of 50 ms are half a second, and a
warm process starting on a 2-core host made a healthy slice 2.8x slower for
that long. What is done about it (`action`):
- "swap": a hot spare is ready: the slice is taken out at the step
  boundary and the spare takes its place (no step lost);
- "remove": under resize with no spare, when training on without it is
  faster: the others take its shards, so a step takes about n / (n - 1)
  of a healthy one against `ratio` with the straggler kept;
- "report": otherwise (an event, a metric, a progress line), once per
  slowdown; it is reported again only after it recovered and slowed again.

Pure: the controller feeds it the step's metrics and what it knows.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping, Optional

from ray_elastic.errors import SliceFailure, SliceStraggling

__all__ = ["Straggler", "Stragglers"]


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Slice `slice_id` (its slowest host `host`) took `ratio` times the
    others' median per shard for `steps` steps up to `step`."""

    step: int
    slice_id: int
    host: int
    ratio: float
    steps: int
    action: str  # "swap", "remove" or "report"
    rolls_back = False  # taken out at a step boundary: nothing to redo

    def failure(self) -> Optional[SliceFailure]:
        """The failure that takes it out; None when it is only reported."""
        if self.action == "report":
            return None
        return SliceStraggling(self.slice_id, self.host, self.step,
                               f"{self.ratio:.2f}x the other slices' time per shard for {self.steps} steps")


class Stragglers:
    def __init__(self, factor: float, steps: int, min_s: float = 0.0):
        self.factor = factor  # 0: off
        self.steps = steps
        self.min_s = min_s
        self._run: dict[int, int] = {}  # slice -> consecutive slow steps
        self._slow_s: dict[int, float] = {}  # slice -> its gradient seconds over those steps
        self._reported: set[int] = set()

    def observe(self, step: int, metrics: Mapping[tuple[int, int], dict], *, spare_ready: bool, policy: str,
                required: int) -> Optional[Straggler]:
        """The step's metrics ((slice, host) -> an apply's); a straggler
        found now (at most one per step, the slowest), or None."""
        if not self.factor:
            return None
        per_shard: dict[int, tuple[float, int]] = {}  # slice -> (seconds per shard, slowest host)
        took: dict[int, float] = {}  # slice -> its slowest host's gradient seconds this step
        for (s, h), m in metrics.items():
            if m.get("grads_shards"):
                t = m["grads_s"] / m["grads_shards"]
                took[s] = max(took.get(s, 0.0), m["grads_s"])
                if t > per_shard.get(s, (-1.0, 0))[0]:
                    per_shard[s] = (t, h)
        if len(per_shard) < 2:
            return None
        found = []
        for s, (t, h) in per_shard.items():
            others = statistics.median(u for x, (u, _) in per_shard.items() if x != s)
            if others > 0 and t > self.factor * others:
                self._run[s] = self._run.get(s, 0) + 1
                self._slow_s[s] = self._slow_s.get(s, 0.0) + took[s]
                if self._run[s] >= self.steps and self._slow_s[s] >= self.min_s and s not in self._reported:
                    found.append((t / others, s, h))
            else:
                self._forget(s)
        for s in list(self._run):
            if s not in per_shard:  # not in this step (lost, or replaced)
                self._forget(s)
        if not found:
            return None
        ratio, s, h = max(found)
        self._reported.add(s)
        steps = self._run.pop(s)  # straggler_steps, or more where the seconds came later
        self._slow_s.pop(s, None)
        n = len(per_shard)
        if spare_ready:
            action = "swap"
        elif policy == "resize" and n - 1 >= max(1, required) and n / (n - 1) < ratio:
            action = "remove"
        else:
            action = "report"
        return Straggler(step, s, h, round(ratio, 3), steps, action)

    def _forget(self, s: int) -> None:
        """Slice `s` is not slow now (or not in the step): its count starts again."""
        self._run.pop(s, None)
        self._slow_s.pop(s, None)
        self._reported.discard(s)

"""When to take an in-memory snapshot: a policy, told the steps' times and
the snapshots' seals, deciding nothing else. Time is passed in.

With one live slice every `snapshot_every` steps: nothing else holds the
state. With two or more the live slices already hold it in as many
failure domains, so a snapshot guards only against losing every slice at
once, and is worth its cost only as often as that loss makes it pay.
`snapshot_every_replicated="auto"` (the default) takes the Young-Daly
interval, the one that minimises the expected time lost to snapshots and
to the work redone after such a loss:

    interval = sqrt(2 * C * M)  seconds,  in steps: / the median step,

C the time a snapshot costs the run (measured: the steps it overlaps,
against the median step), M the mean time between losses of every slice
(`all_slices_mtbf_s`; each such loss seen in the run moves the estimate:
(M_setting + run time) / (1 + losses seen), a prior worth one loss). A
loss of every slice then redoes at most `interval` steps, plus the steps
of a snapshot not yet sealed when it struck.

Until a snapshot has been measured, the first is taken at `PROBE_STEP`
steps past the start (after the compile-heavy first steps, with a median
to measure against).

A snapshot is measured until the first step after its seal, and the next
is not taken before: the steps between snapshots are the interval or, if
sealing took longer, the steps the last one overlapped (`gap()`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Optional

__all__ = ["PROBE_STEP", "SnapshotCost", "SnapshotSchedule", "young_daly_steps"]

PROBE_STEP = 5
# Steps whose median a snapshot's cost is measured against (those with no
# snapshot in flight), and snapshots whose costs make the estimate.
_WINDOW_STEPS, _WINDOW_COSTS = 50, 5
# A snapshot measured at no cost (noise) counts this share of a step: the
# interval stays finite, and long.
_COST_FLOOR = 0.01


def young_daly_steps(cost_s: float, mtbf_s: float, step_s: float) -> int:
    """The Young-Daly interval sqrt(2 C M) in steps of `step_s` (>= 1)."""
    if step_s <= 0:
        return 1
    return max(1, round(math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s) / step_s))


@dataclasses.dataclass(frozen=True)
class SnapshotCost:
    """One snapshot's measured cost: of `step`, `step_path_s` the time the
    steps it overlapped took over the median step (at least 0), over
    `steps` steps."""

    step: int
    step_path_s: float
    steps: int


class SnapshotSchedule:
    def __init__(self, every_one: int, every_replicated: int | str, mtbf_s: float, start_step: int = 0,
                 now: float = 0.0):
        self.every_one = every_one  # 0: snapshots off
        self.auto = every_replicated == "auto"
        self.fixed = None if self.auto else int(every_replicated)
        self.mtbf_setting_s = mtbf_s
        self._t0 = now
        self._losses, self._elapsed = 0, 0.0
        self._durations: list[float] = []
        self._costs: list[float] = []
        self._last: Optional[int] = None  # the step of the newest snapshot taken
        self._probe_at = start_step + PROBE_STEP
        self._open: Optional[tuple[int, float, int]] = None  # (step, excess so far, steps) of the one measured
        self._chosen = PROBE_STEP  # the interval chosen when the last measurement closed
        self._overlapped = 0  # the steps the last measured snapshot overlapped

    # -- deciding ------------------------------------------------------------

    def due(self, step: int, live: int) -> bool:
        """Whether the state of `step` (the step about to complete) is
        snapshotted, with `live` slices."""
        return self.reason(step, live) is not None

    def reason(self, step: int, live: int) -> Optional[str]:
        """Why the state of `step` is snapshotted with `live` slices:
        "probe" (the first, measuring the cost), "schedule", or None (not
        due)."""
        if not self.every_one:
            return None
        if live < 2:
            return "schedule" if step % self.every_one == 0 else None
        if not self.auto:
            return "schedule" if step % self.fixed == 0 else None
        if self._open is not None:  # one is still being measured
            return None
        if not self._costs:  # none measured yet (or the probe's measurement was cut short)
            return "probe" if step >= self._probe_at else None
        return "schedule" if step >= self._last + self.gap() else None

    def next_at(self) -> Optional[int]:
        """The step the next snapshot with two or more live slices is due
        (None before the first)."""
        return None if self._last is None else self._last + self.gap()

    def gap(self) -> int:
        """The steps from the last snapshot to the next with two or more
        live slices: the interval chosen when the last measurement closed,
        or the steps that snapshot overlapped if more (none is taken while
        one is measured). A loss of every slice redoes at most this many
        steps plus the next snapshot's sealing."""
        return self.fixed if not self.auto else max(self._chosen, self._overlapped)

    def interval(self) -> int:
        """The steps between snapshots with two or more live slices: the
        Young-Daly interval from the estimates now (auto, once a snapshot
        is measured; the next snapshot comes this many steps after the
        last, as chosen when its measurement closed), else the fixed one.
        A loss of every slice redoes at most this many steps (plus a
        snapshot's sealing)."""
        if not self.auto:
            return self.fixed
        if not self._costs or not self._durations:
            return PROBE_STEP
        return young_daly_steps(self.cost_s(), self.mtbf_s(), self.median_step_s())

    def mtbf_s(self) -> float:
        """The mean time between losses of every slice, as now estimated."""
        return self.mtbf_setting_s if not self._losses else (self.mtbf_setting_s + self._elapsed) / (1 + self._losses)

    def cost_s(self) -> float:
        """A snapshot's cost, as now estimated (the median of the last few)."""
        floor = _COST_FLOOR * self.median_step_s()
        return max(floor, statistics.median(self._costs[-_WINDOW_COSTS:])) if self._costs else floor

    def median_step_s(self) -> float:
        return statistics.median(self._durations[-_WINDOW_STEPS:]) if self._durations else 0.0

    # -- what happened ---------------------------------------------------------

    def taken(self, step: int) -> None:
        """A snapshot of `step` was taken (with two or more live slices:
        its cost is measured)."""
        self._last = step
        if self._open is None:
            self._open = (step, 0.0, 0)

    def taken_alone(self, step: int) -> None:
        """A snapshot of `step` was taken with one live slice: not measured."""
        self._last = step

    def step_done(self, step: int, duration_s: float, sealing: bool) -> Optional[SnapshotCost]:
        """Step `step` took `duration_s`; `sealing`: a snapshot is still
        being copied. Returns the cost of the snapshot measured, once the
        first step after its seal (which it may have overlapped) is in."""
        if self._open is None:
            self._durations.append(duration_s)
            return None
        at, excess, n = self._open
        excess, n = excess + duration_s - self.median_step_s(), n + 1
        if sealing:
            self._open = (at, excess, n)
            return None
        self._open = None
        # Steps beside the snapshot that ran faster than the median are
        # noise, not a gain: the cost is never below zero.
        cost = max(0.0, excess)
        self._costs.append(cost)
        self._overlapped = n
        self._chosen = self.interval()
        return SnapshotCost(at, round(cost, 4), n)

    def all_lost(self, now: float) -> None:
        """Every slice was lost at once: the rate the interval guards against."""
        self._losses += 1
        self._elapsed = now - self._t0
        self._chosen = self.interval()

    def restart(self, step: int) -> None:
        """The run goes on from `step` (a rewind or a cold start): the next
        snapshot counts from there."""
        self._open = None
        if self._last is not None and self._last > step:
            self._last = step
        self._probe_at = step + PROBE_STEP

"""The controller's in-memory snapshots: which slices take one after a
step (the schedule's decision, or one a durable checkpoint or a
cross-check's tie-break needs: `wanted`), handing their
copies to the store, and a `snapshot` event per snapshot measured.

The event (and the run report's `snapshots`) gives, per snapshot taken
while two or more slices were live:

- `step`, and `reason`: why it was taken then: `schedule` (the interval
  below; `probe` for the first, which measures the cost), `checkpoint` (a
  durable save of that step reads it) or `cross_check` (a gradient
  cross-check's tie-break would compute from that state);
- `bytes_per_host`, `seal_s` (from its step's end to sealed, off the
  step's path), `views_cpu_s` (the workers' CPU seconds making its host
  views);
- `step_path_s`: what the steps it overlapped took over the median step,
  its cost to the run; never below 0 (steps that ran faster than the
  median beside it are noise, not a gain);
- `interval`: the steps between two scheduled snapshots as chosen now
  (Young-Daly's, or more when sealing took longer), and `next_at`: the
  step the next scheduled one is due, counted from the newest snapshot of
  any reason (each one guards against a loss of every slice alike);
- `max_redo_steps`: at most how many steps a loss of every slice would
  redo.
"""

from __future__ import annotations

from typing import Callable, Optional

from ray_elastic.checkpoint.snapshots import SnapshotRecord, SnapshotStore
from ray_elastic.config import ElasticConfig
from ray_elastic.control.snapshot_schedule import SnapshotSchedule

__all__ = ["Snapshotting"]


class Snapshotting:
    def __init__(self, config: ElasticConfig, store: SnapshotStore, wanted: Callable[[int], Optional[str]],
                 event: Callable[..., None], now: float):
        self.store = store
        self.schedule = SnapshotSchedule(config.snapshot_every, config.snapshot_every_replicated,
                                         config.all_slices_mtbf_s, now=now)
        self._wanted, self._event = wanted, event
        self._sealed: dict[int, SnapshotRecord] = {}
        self._decided = -1  # the newest step a snapshot was decided for
        self._reasons: dict[int, str] = {}  # step -> why its snapshot was taken (until its event)
        self.pin_wait_s = 0.0  # steps' waits for a pinned copy (one live slice, replicated)

    def takers(self, step: int, live: set) -> frozenset:
        """The slices whose reply to the step that makes `step` carries a
        snapshot: two (two failure domains), or the one live. Asked again
        for the same step (a step finished on the survivors), it takes the
        snapshot decided then, from the slices live now."""
        again = self._decided == step
        if not again:
            reason = self.schedule.reason(step, len(live)) or self._wanted(step)
            if not reason:
                return frozenset()
            self._reasons[step] = reason
        takers = sorted(live)[:2]
        self.store.expect(step, len(takers))
        if not again:
            (self.schedule.taken if len(live) >= 2 else self.schedule.taken_alone)(step)
        self._decided = step
        return frozenset(takers)

    def step_done(self, step: int, result, duration_s: float, nodes_of: Callable[[int], list],
                  timeout_s: float) -> None:
        """The step that made `step` is done in `duration_s`: offer its
        snapshot's copies, and measure the snapshot in flight."""
        for s, ref in result.snapshots.items():
            nodes = nodes_of(s)
            self.store.offer(step, s, ref, nodes if isinstance(ref, tuple) else nodes[0],
                             done=result.snapshot_status.get(s, ()))
        if len(result.snapshots) == 1 and not isinstance(next(iter(result.snapshots.values())), tuple):
            # One live slice: no other failure domain holds the state until
            # the driver's pinned copy lands, so wait for it (not for a
            # sharded copy: the driver never pins one).
            self.pin_wait_s += self.store.wait_sealed(timeout=timeout_s)
        cost = self.schedule.step_done(step, duration_s, self.store.sealing())
        for r in self.store.take_records():
            self._sealed[r.step] = r
        if cost is None:
            return
        record = self._sealed.pop(cost.step, None)
        self._sealed = {k: v for k, v in self._sealed.items() if k > cost.step}
        interval = self.schedule.gap()
        reason = self._reasons.pop(cost.step, "schedule")
        self._reasons = {k: v for k, v in self._reasons.items() if k > cost.step}
        self._event("snapshot", step=cost.step, reason=reason, step_path_s=cost.step_path_s,
                    steps_overlapped=cost.steps,
                    **({} if record is None else {"bytes_per_host": record.bytes_per_host,
                                                  "seal_s": round(record.seal_s, 4),
                                                  "views_cpu_s": round(record.views_cpu_s, 4)}),
                    interval=interval, next_at=self.schedule.next_at(),
                    max_redo_steps=interval + cost.steps,
                    mtbf_s=round(self.schedule.mtbf_s(), 1))

    def all_lost(self, now: float) -> None:
        self.schedule.all_lost(now)

    def restart(self, step: int) -> None:
        self.schedule.restart(step)

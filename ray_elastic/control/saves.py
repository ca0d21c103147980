"""When the controller writes a durable checkpoint, and of what: after a
step when one is due, at the end of the run, before a preemption takes a
host, and from a checkpoint at a cold start. Without a CheckpointConfig
every call is a no-op, so the loop reads the same either way.

A preemption notice for one slice is saved without stopping the run when
another live slice holds the same state and the writer actor writes it (a
replicated layout): the save reads that slice's copy, so it needs nothing
from the host that is going, and the run trains on (or resizes) while the
checkpoint commits; `preempt_saved` comes when it has. Otherwise (the
last live slice, or a sharded state whose hosts write their own shards,
which may be the hosts going) the run waits for the commit, as it does
for SIGTERM to the driver."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional

from ray_elastic.checkpoint.coordinator import CheckpointCoordinator
from ray_elastic.checkpoint.snapshots import SnapshotStore
from ray_elastic.checkpoint.state_forms import final_state
from ray_elastic.control.membership import Membership

__all__ = ["Saves"]

log = logging.getLogger("ray_elastic")


@dataclasses.dataclass
class _PreemptSave:
    """A preemption's checkpoint saved beside training."""

    step: int
    ref: Any  # a live slice's copy of the state of `step`
    noticed_at: float  # wall time of the notice
    started: float  # the controller's clock when it was asked for
    submitted: bool = False


class Saves:
    def __init__(self, ckpt: Optional[CheckpointCoordinator], snapshots: SnapshotStore, members: Membership,
                 run_name: str, event: Callable[..., None] = lambda *a, **k: None,
                 clock: Callable[[], float] = time.monotonic):
        self.ckpt = ckpt
        self.snapshots = snapshots
        self.members = members
        self.run_name = run_name
        self._event, self._clock = event, clock
        self._preempts: list[_PreemptSave] = []  # in order; the first may be in flight

    def due(self, step: int) -> bool:
        c = self.ckpt
        if c is None:
            return False
        if c.config.due(step):
            return True
        return c.config.continuous and not c.busy() and step > (c.last_saved or 0)

    def current(self, step: int):
        """A ref to the state of `step` (that step's snapshot, sealed or
        still being copied, else a copy asked from a live slice)."""
        m = self.members
        found = self.snapshots.restore_source(m.backend.node_alive)
        if found is not None and found[0] == step:
            return found[1]
        copy = self.snapshots.copy_of(step)
        return copy if copy is not None else m.backend.state(min(m.live))

    def after_step(self, step: int) -> None:
        """Take in a save that finished; start one if due and none is in flight."""
        c = self.ckpt
        if c is None:
            return
        c.poll()
        self._settle_preempts()
        if c.must_stop():
            raise c.fail_with_rescue(step, self.current(step), self.run_name)
        if not c.busy() and self.due(step):
            c.submit(step, self.current(step))

    def before_preemption(self, step: int, slice_id: int, noticed_at: float, timeout_s: float) -> None:
        """Checkpoint `step` before slice `slice_id`'s host goes (within
        `timeout_s`): beside training from another live slice's copy where
        one can be used, else now, waiting for the commit."""
        c, m = self.ckpt, self.members
        if c is None or not m.live:
            return
        t0 = self._clock()
        others = sorted(m.live - {slice_id})
        if others and not c.writes_on_hosts:
            ref = m.backend.state(others[0])
            # Made before the run moves on: the copy then holds `step`, never a later update.
            if c.copied(ref, timeout_s):
                self._supersede(step)
                self._preempts.append(_PreemptSave(step, ref, noticed_at, t0))
                return self._settle_preempts()
        ok = self.now(step, timeout_s=max(1.0, timeout_s - (self._clock() - t0)))
        self._event("preempt_saved" if ok else "preempt_unsaved", step=step, seconds=round(self._clock() - t0, 3),
                    since_notice_s=round(time.time() - noticed_at, 3), run_waited=True)

    def _supersede(self, step: int) -> None:
        """A newer step replaces the preemption saves not yet started."""
        for p in [p for p in self._preempts if not p.submitted]:
            self._preempts.remove(p)
            self._event("preempt_unsaved", step=p.step, reason=f"superseded by step {step}")

    def settle(self) -> None:
        """Between steps (the run waiting): take in a preemption's save."""
        if self.ckpt is not None and self._preempts:
            self._settle_preempts()

    def _settle_preempts(self, block_s: float = 0.0) -> None:
        """Report a preemption's save that has committed (or failed: counted
        like any failed save); start the next once no save is in flight."""
        c = self.ckpt
        if c is None or not self._preempts:
            return
        c.poll(block_s=block_s)
        p = self._preempts[0]
        if p.submitted and not c.busy():
            self._preempts.pop(0)
            ok = c.last_saved == p.step
            self._event("preempt_saved" if ok else "preempt_unsaved", step=p.step,
                        seconds=round(self._clock() - p.started, 3),
                        since_notice_s=round(time.time() - p.noticed_at, 3), run_waited=False)
        if self._preempts and not c.busy():
            p = self._preempts[0]
            c.submit(p.step, p.ref, urgent=True)
            p.submitted = True

    def at_end(self, step: int) -> None:
        c = self.ckpt
        if c is None:
            return
        while self._preempts:  # a preemption's save commits before the run ends
            self._settle_preempts(block_s=0.5)
        if not self.members.live:
            return
        if not c.config.save_at_end:  # a save in flight commits before the slices go
            return c.poll(block_s=c.config.save_timeout_s)
        if not c.save_now(step, self.current(step), timeout_s=300.0):
            raise c.fail_with_rescue(step, self.current(step), self.run_name)

    def now(self, step: int, timeout_s: float) -> Optional[bool]:
        """Save `step` at once (a preemption notice); None: no checkpoints
        configured or no live slice to save from."""
        if self.ckpt is None or not self.members.live:
            return None
        deadline = self._clock() + timeout_s
        self._supersede(step)
        while self._preempts and self._clock() < deadline:  # one in flight commits first
            self._settle_preempts(block_s=0.5)
        return self.ckpt.save_now(step, self.current(step), timeout_s=max(1.0, deadline - self._clock()))

    def finish(self, timeout_s: float = 60.0) -> None:
        """The run is over, however it ended: a preemption's save in flight
        or queued commits (within `timeout_s`) before the writer goes."""
        deadline = self._clock() + timeout_s
        try:
            while self.ckpt is not None and self._preempts and self._clock() < deadline:
                self._settle_preempts(block_s=0.5)
        except Exception:  # the run's own error, if any, is what the user must see
            log.warning("a preemption's checkpoint could not be finished", exc_info=True)
        finally:
            if self.ckpt is not None:
                self.ckpt.shutdown()

    def cold_start(self, step: int, timeout_s: float, load: Callable) -> int:
        """Load the newest committed checkpoint at or before `step` into the
        live slices (an older one if that step proves damaged); its step."""
        m = self.members
        return self.ckpt.load_into(lambda source: load(sorted(m.live), source, timeout_s), step)

    def keep_before_error(self, step: int, error: BaseException, keep_final: bool,
                          event: Callable[..., None]) -> Optional[Any]:
        """A non-finite loss is found before its step is applied, so every
        live slice still holds the state of `step`: save it as a checkpoint
        (when checkpoints are on) and return it (when `keep_final`), so
        nothing trained is lost with the run. None if not kept."""
        try:
            saved = self.now(step, timeout_s=120.0)
            event("kept_before_error", step=step, checkpoint=bool(saved))
            m = self.members
            if keep_final and m.live:
                return final_state(m.backend.fetch(m.backend.state(min(m.live))))
        except Exception:  # the run's own error is what the user must see
            log.warning("could not keep the state of step %d after %s", step, error, exc_info=True)
        return None

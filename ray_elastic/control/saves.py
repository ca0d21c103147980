"""When the controller writes a durable checkpoint, and of what: after a
step when one is due, at the end of the run, before a preemption takes a
host, and from a checkpoint at a cold start. Without a CheckpointConfig
every call is a no-op, so the loop reads the same either way."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ray_elastic.checkpoint.coordinator import CheckpointCoordinator
from ray_elastic.checkpoint.snapshots import SnapshotStore
from ray_elastic.checkpoint.state_forms import final_state
from ray_elastic.control.membership import Membership

__all__ = ["Saves"]

log = logging.getLogger("ray_elastic")


class Saves:
    def __init__(self, ckpt: Optional[CheckpointCoordinator], snapshots: SnapshotStore, members: Membership,
                 run_name: str):
        self.ckpt = ckpt
        self.snapshots = snapshots
        self.members = members
        self.run_name = run_name

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
        if c.must_stop():
            raise c.fail_with_rescue(step, self.current(step), self.run_name)
        if not c.busy() and self.due(step):
            c.submit(step, self.current(step))

    def at_end(self, step: int) -> None:
        c = self.ckpt
        if c is None or not self.members.live:
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
        return self.ckpt.save_now(step, self.current(step), timeout_s=timeout_s)

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

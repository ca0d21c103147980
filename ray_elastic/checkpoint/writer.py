"""The checkpoint writer: a Ray actor next to the driver that turns
in-memory snapshots into committed Orbax steps, off the step loop.

It writes replicated states (from one slice's host 0); a sharded state is
written by the hosts of a slice, each its own shards (host_writes.py), so
no process holds it whole. A writer killed mid-write is replaced like any
failed worker (coordinator.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from ray_elastic.checkpoint.cpu_priority import background_cpu
from ray_elastic.checkpoint.state_forms import FlatState, WholeState
from ray_elastic.checkpoint.store import CheckpointStore, orbax_checkpoint, unflatten

__all__ = ["CheckpointWriter"]

log = logging.getLogger("ray_elastic")


# A periodic save still waiting for idle CPU after this long is given the
# normal class (see background_cpu).
BACKGROUND_SAVE_GRACE_S = 30.0


class CheckpointWriter:
    """Runs as a Ray actor next to the driver: turns snapshots from the
    object store into committed Orbax steps, and reads them back.

    Periodic saves run in the idle CPU class (`background_cpu`); urgent
    ones (a preemption notice, the end of the run) and restores in the
    normal class."""

    def __init__(self, path: str, keep: int, retries: int, backoff_s: float):
        self.store = CheckpointStore(path, keep=keep, retries=retries, backoff_s=backoff_s)

    def pid(self) -> int:
        return os.getpid()

    def warm(self) -> int:
        """Import Orbax and JAX and open the manager now, while the slices
        start, so the first save does not pay for it during training.
        (Normal CPU class: the run waits for this before its first step.)"""
        import jax  # noqa: F401

        orbax_checkpoint()
        try:
            self.store.open()
        except Exception as e:  # the first save retries and reports it
            log.warning("checkpoint writer: cannot open %s yet: %s", self.store.path, e)
        return os.getpid()

    def save(self, step: int, snapshot: FlatState | WholeState, template: Any, meta: dict, urgent: bool = False) -> dict:
        if urgent:
            return self._save(step, snapshot, template, meta)
        with background_cpu(BACKGROUND_SAVE_GRACE_S) as cpu:
            info = self._save(step, snapshot, template, meta)
        info["escalated"] = cpu.escalated
        return info

    def _save(self, step: int, snapshot: FlatState | WholeState, template: Any, meta: dict) -> dict:
        state = unflatten(snapshot.flat, template) if isinstance(snapshot, FlatState) else snapshot.trees()
        return self.store.save(step, state, {**meta, "step": step})

    def restore(self, step: Optional[int], template: Any) -> tuple[dict, WholeState]:
        """Two results (call with num_returns=2): what happened, small, for
        the driver; and the state, for the workers only. A damaged `step`
        is moved aside and the newest intact one before it restored."""
        import jax
        import numpy as np

        target = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template)
        state, meta, restored, damaged = self.store.restore_intact(step, target)
        info = {"step": restored, "requested": step, "damaged": damaged}
        return info, WholeState(restored, state["params"], state["opt_state"], meta)

    def read_meta(self, step: int) -> dict:
        return self.store.read_meta(step)

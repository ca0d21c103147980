"""In-memory snapshots of the training state in Ray's object store.

Where a copy lives decides what it survives: a worker's
return value is owned by the driver but stored on the worker's node. So a
snapshot counts as complete only once it has copies in two failure domains:
the host-0 workers of two different slices, or, with one live slice, that
slice plus a copy pinned by the driver on the head node (which is fated to
the driver anyway). Losing one node or one whole slice then never loses the
latest complete snapshot.

Under a sharded layout a slice's copy is one part per host (a tuple of
refs, a tuple of one on a one-host slice), on every node of the slice; it
is usable only while all of them live. The driver never pins such a copy
(a sharded state is one too large for one device, and the head node may
not hold it either): with one slice left, the newest committed checkpoint
is the fallback.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, Optional

import ray

__all__ = ["SnapshotStore"]


@dataclasses.dataclass
class _Pending:
    step: int
    needed: int
    refs: dict  # slice_id -> ObjectRef
    nodes: dict = dataclasses.field(default_factory=dict)  # slice_id -> nodes holding the copy
    pinned: Optional[concurrent.futures.Future] = None


class SnapshotStore:
    def __init__(self, fetch: Callable[[Any], Any] = ray.get) -> None:
        self._fetch = fetch  # reads a copy into the driver (the pin)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot-pin")
        self._pending: Optional[_Pending] = None
        self._complete: Optional[_Pending] = None
        self._pinned_value: Any = None

    def expect(self, step: int, copies_from_slices: int) -> None:
        """A snapshot of `step` is being taken by that many slices."""
        self._pending = _Pending(step, max(1, copies_from_slices), {})

    def offer(self, step: int, slice_id: int, ref: Any, nodes: Any = "") -> None:
        """A slice's copy of the snapshot of `step`; `nodes`: the node (or
        nodes, one per part of a sharded copy) holding it."""
        p = self._pending
        if p is None or p.step != step:
            return
        p.refs[slice_id] = ref
        p.nodes[slice_id] = (nodes,) if isinstance(nodes, str) else tuple(nodes)
        if p.needed == 1 and p.pinned is None and not isinstance(ref, tuple):
            # One slice only: pin a second copy next to the driver, off the
            # step loop's thread.
            p.pinned = self._pool.submit(self._fetch, ref)
        self._promote()

    def _promote(self) -> None:
        p = self._pending
        if p is None or len(p.refs) < p.needed:
            return
        # The copies ride on replies the controller has already received, so
        # they are sealed: no need to ask the object store again.
        if p.pinned is not None and (not p.pinned.done() or p.pinned.exception() is not None):
            return
        self._pinned_value = p.pinned.result() if p.pinned is not None else None
        self._complete, self._pending = p, None

    @property
    def has_pinned_copy(self) -> bool:
        """Whether the driver holds a copy of the newest complete snapshot."""
        return self._pinned_value is not None

    def latest_step(self) -> Optional[int]:
        self._promote()
        return None if self._complete is None else self._complete.step

    def restore_source(self, node_alive: Callable[[str], bool]) -> Optional[tuple[int, Any]]:
        """(step, object) to load the newest complete snapshot from.

        Takes a copy on a node that is still alive (a killed worker process
        leaves its node's object store, and the copy, intact); falls back to
        the driver's pinned copy. None if no complete snapshot survives.
        """
        self._promote()
        c = self._complete
        if c is None:
            return None
        for slice_id, ref in c.refs.items():
            if all(node_alive(n) for n in c.nodes.get(slice_id, ("",))):
                return c.step, ref
        if self._pinned_value is not None:
            return c.step, self._pinned_value
        return None

    def discard_latest(self) -> None:
        """Forget the newest snapshot (it failed to load)."""
        self._complete = None
        self._pinned_value = None

    def wait_pinned(self, timeout: float) -> None:
        p = self._pending
        if p is not None and p.pinned is not None:
            try:
                p.pinned.result(timeout=timeout)
            except Exception:
                pass
        self._promote()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

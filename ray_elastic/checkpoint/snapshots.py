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

The copies are made off the step's path (the workers' `snapshot` calls
run beside the next step), so a snapshot is sealed some time after its
step completed: a thread here waits for the calls' statuses and, with one
slice, pins the copy; until then the previous complete snapshot is the one
restored. Each sealed snapshot leaves a record (`SnapshotRecord`): its
bytes per host and how long it took to seal.

With state checks on (control/integrity.py) a snapshot is kept until a
newer one is verified (its step's replicas agreed): a rollback after
silent data corruption goes to the newest verified one, never to one a
corrupted state may have reached. Without checks every snapshot counts
as verified, and only the newest is kept.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Any, Callable, Optional

import ray

__all__ = ["SnapshotRecord", "SnapshotStore"]

# Complete snapshots kept at most: the newest verified one and the newer
# ones a check has not yet verified.
_MAX_KEPT = 4


@dataclasses.dataclass(frozen=True)
class SnapshotRecord:
    """A sealed snapshot: of `step`, `bytes_per_host` (the largest part a
    host copied), `seal_s` from its step's completion to every copy (and
    the pin) sealed, `views_cpu_s` the workers' CPU seconds making the host
    views (summed over hosts; the object store's copy is not in them)."""

    step: int
    bytes_per_host: int
    seal_s: float
    views_cpu_s: float
    copies: int


@dataclasses.dataclass
class _Pending:
    step: int
    needed: int
    refs: dict  # slice_id -> ObjectRef (or a tuple: one per host)
    nodes: dict = dataclasses.field(default_factory=dict)  # slice_id -> nodes holding the copy
    done: dict = dataclasses.field(default_factory=dict)  # slice_id -> its snapshot calls' status refs
    offered_at: float = 0.0
    sealing: Optional[concurrent.futures.Future] = None  # -> (statuses, seconds, pinned value or None)
    pinned: Any = None  # the driver's copy, once sealed (one live slice)


class SnapshotStore:
    def __init__(self, fetch: Optional[Callable[..., Any]] = None, clock: Optional[Callable[[], float]] = None,
                 seal_timeout_s: float = 600.0) -> None:
        import time

        # (ref or list, timeout_s) -> value: reads statuses and the pinned copy into the driver
        self._fetch = fetch or (lambda ref, timeout_s=None: ray.get(ref, timeout=timeout_s))
        self._clock = clock or time.monotonic
        self._seal_timeout_s = seal_timeout_s
        # Two threads: a copy that never seals (its worker frozen) holds
        # one until its timeout, and must not hold up the next.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="snapshot-seal")
        self._pending: list[_Pending] = []  # expected or sealing, oldest first
        # Complete snapshots, oldest first: the newest verified one and any newer.
        self._kept: list[_Pending] = []
        self._verified = math.inf  # the newest step the replicas agreed on (inf: no checks)
        self._records: list[SnapshotRecord] = []

    def expect(self, step: int, copies_from_slices: int) -> None:
        """A snapshot of `step` is being taken by that many slices."""
        self._promote()
        self._pending = [p for p in self._pending if p.sealing is not None][-1:]  # one still sealing may finish
        self._pending.append(_Pending(step, max(1, copies_from_slices), {}))

    def offer(self, step: int, slice_id: int, ref: Any, nodes: Any = "", done: tuple = ()) -> None:
        """A slice's copy of the snapshot of `step`; `nodes`: the node (or
        nodes, one per part of a sharded copy) holding it; `done`: the refs
        of the calls' statuses that say it is sealed (none: it is)."""
        p = next((p for p in self._pending if p.step == step and p.sealing is None), None)
        if p is None:
            return
        p.refs[slice_id] = ref
        p.nodes[slice_id] = (nodes,) if isinstance(nodes, str) else tuple(nodes)
        p.done[slice_id] = tuple(done)
        if len(p.refs) >= p.needed:
            p.offered_at = self._clock()
            # One slice only: pin a second copy next to the driver.
            pin = p.refs[slice_id] if p.needed == 1 and not isinstance(ref, tuple) else None
            statuses = [r for d in p.done.values() for r in d]
            if statuses or pin is not None:
                p.sealing = self._pool.submit(self._seal, statuses, pin, p.offered_at)
            else:
                p.sealing = _done((), 0.0, None)
        self._promote()

    def _seal(self, statuses: list, pin: Any, since: float) -> tuple:
        got = self._fetch(statuses, self._seal_timeout_s) if statuses else []
        pinned = self._fetch(pin, self._seal_timeout_s) if pin is not None else None
        return got, self._clock() - since, pinned

    def _promote(self) -> None:
        """Make the newest sealed snapshot the complete one; drop those
        that failed (a worker lost mid-copy) or that a newer one passed."""
        for p in list(self._pending):
            if p.sealing is None or not p.sealing.done():
                continue
            self._pending.remove(p)
            if p.sealing.exception() is not None or (self._kept and self._kept[-1].step >= p.step):
                continue
            statuses, seal_s, p.pinned = p.sealing.result()
            self._kept.append(p)
            self._records.append(SnapshotRecord(
                step=p.step, bytes_per_host=max((s["bytes"] for s in statuses), default=0), seal_s=seal_s,
                views_cpu_s=sum(s.get("views_cpu_s", 0.0) for s in statuses), copies=len(p.refs)))
        self._prune()

    def _prune(self) -> None:
        """Drop the snapshots older than the newest verified one, and the
        oldest unverified ones beyond `_MAX_KEPT` in all (memory: checks
        that keep missing must not pile snapshots up). The newest verified
        one stays whatever comes after it: it is where a rollback past a
        corruption goes, and the state a two-slice tie-break computes its
        known answer from (control/tie_break.py)."""
        verified = [i for i, p in enumerate(self._kept) if p.step <= self._verified]
        if verified:
            del self._kept[:verified[-1]]
            del self._kept[1:-(_MAX_KEPT - 1)]
        else:
            del self._kept[:-_MAX_KEPT]

    def verified_through(self, step: int) -> None:
        """The replicas agreed on the state of `step`: snapshots of it or
        older are safe to roll back to (and only the newest is kept)."""
        self._verified = step
        self._promote()

    @property
    def _complete(self) -> Optional[_Pending]:
        return self._kept[-1] if self._kept else None

    @property
    def has_pinned_copy(self) -> bool:
        """Whether the driver holds a copy of the newest complete snapshot."""
        return self._complete is not None and self._complete.pinned is not None

    def sealing(self) -> bool:
        """Whether a snapshot is still being copied (offered, not sealed)."""
        self._promote()
        return any(p.sealing is not None for p in self._pending)

    def take_records(self) -> list[SnapshotRecord]:
        """The snapshots sealed since the last call."""
        self._promote()
        out, self._records = self._records, []
        return out

    def latest_step(self) -> Optional[int]:
        self._promote()
        return None if self._complete is None else self._complete.step

    def copy_of(self, step: int) -> Any:
        """A copy of the snapshot of `step`, sealed or still sealing (Ray
        hands it to a call once sealed); None if there is none."""
        self._promote()
        for p in [*self._pending, self._complete]:
            if p is not None and p.step == step and len(p.refs) >= p.needed and p.refs:
                return next(iter(p.refs.values()))
        return None

    def restore_source(self, node_alive: Callable[[str], bool], verified: bool = False,
                       at_most: Optional[int] = None) -> Optional[tuple[int, Any]]:
        """(step, object) to load the newest complete snapshot from (the
        newest verified one, if `verified`; of step `at_most` or older, if
        given: a rollback past a corruption).

        Takes a copy on a node that is still alive (a killed worker process
        leaves its node's object store, and the copy, intact); falls back to
        the driver's pinned copy. None if no such snapshot survives.
        """
        self._promote()
        c = self._complete
        if verified or at_most is not None:
            bound = min(self._verified if verified else math.inf, math.inf if at_most is None else at_most)
            c = next((p for p in reversed(self._kept) if p.step <= bound), None)
        if c is None:
            return None
        for slice_id, ref in c.refs.items():
            if all(node_alive(n) for n in c.nodes.get(slice_id, ("",))):
                return c.step, ref
        if c.pinned is not None:
            return c.step, c.pinned
        return None

    def discard_latest(self) -> None:
        """Forget the newest snapshot (it failed to load)."""
        if self._kept:
            self._kept.pop()

    def discard_after(self, step: int) -> None:
        """Forget the snapshots of steps after `step` (a rollback to it:
        they hold a state the run no longer has)."""
        self._promote()
        self._kept = [p for p in self._kept if p.step <= step]
        self._pending = [p for p in self._pending if p.step <= step]

    def wait_sealed(self, timeout: float) -> float:
        """Wait (up to `timeout`) for the newest snapshot being copied to
        seal (not an older one, which may wait on a frozen node); the
        seconds waited."""
        t0 = self._clock()
        sealing = [p for p in self._pending if p.sealing is not None]
        if sealing:
            try:
                sealing[-1].sealing.result(timeout=timeout)
            except Exception:  # failed or late: the previous snapshot stays the newest
                pass
        self._promote()
        return self._clock() - t0

    def close(self) -> None:
        """The run is over: its copies of the state go with it (their refs
        and the driver's pinned copy), or a driver that keeps the trainer
        would keep them in the object store; the records stay. A save in
        flight holds the copy it reads on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending, self._kept = [], []


def _done(*value) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f

"""Which slices are coming (being provisioned), ready (set up, waiting for
a step boundary to join) and live (training), and where a joining slice's
state comes from.

A joiner loads the state the live slices hold: the newest snapshot when it
is of that step, else a live slice's own memory. With no live slice (every
slice lost, or a pause that took all of them), the newest of the in-memory
snapshot and the last committed checkpoint, rolling the run back to it; or
nothing, a start from scratch.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

from ray_elastic.cluster.backend import SliceBackend
from ray_elastic.errors import CheckpointDamaged, RunFailed, StateLoadFailed
from ray_elastic.checkpoint.snapshots import SnapshotStore

__all__ = ["Membership", "StateSource"]

log = logging.getLogger("ray_elastic")

# Joins that fail in a row (joiners dying, or every copy of the state
# unreadable) before the run stops: the cluster is losing nodes faster
# than it recovers.
MAX_FAILED_JOINS = 5


@dataclasses.dataclass(frozen=True)
class StateSource:
    kind: str  # "snapshot", "live", "checkpoint" or "initial"
    step: int  # the step that state is at
    ref: Any = None  # what joiners load (None: the initial state they have)


class Membership:
    def __init__(
        self,
        backend: SliceBackend,
        snapshots: SnapshotStore,
        emit: Callable[..., None],
        checkpoints: Any = None,
        load_timeout_s: float = 30.0,
    ):
        self.backend = backend
        self.snapshots = snapshots
        self.checkpoints = checkpoints  # CheckpointCoordinator or None
        self._emit = emit
        self._load_timeout_s = load_timeout_s
        self.coming: set[int] = set()
        self.ready: set[int] = set()
        self.live: set[int] = set()
        self._failed_joins = 0

    def start(self, slice_id: int, new_group: bool = False, evict: tuple = ()) -> None:
        """Provision a slice, or a replacement for a failed one (on a new
        placement group: the old one is stuck on a silent node; or away
        from the `evict` nodes, which no slice of the run uses again)."""
        self.live.discard(slice_id)
        self.ready.discard(slice_id)
        if evict:
            self.backend.start(slice_id, new_group=True, evict=tuple(evict))
        elif new_group:
            self.backend.start(slice_id, new_group=True)
        else:
            self.backend.start(slice_id)
        self.coming.add(slice_id)

    def poll(self, block_s: float = 0.0) -> None:
        for up in self.backend.poll(block_s):
            self.coming.discard(up.slice_id)
            self.ready.add(up.slice_id)
            extra = {"phases": dict(up.phases)} if getattr(up, "phases", None) else {}
            if getattr(up, "predecessors", None):
                extra["predecessors"] = dict(up.predecessors)
            self._emit("slice_ready", slice=up.slice_id, setup_s=up.setup_s, **extra)

    def lose(self, slice_id: int, new_group: bool = False, evict: tuple = (), host: Optional[int] = None,
             node_died: bool = False) -> bool:
        """A live slice failed: tear it down and queue its replacement.
        With `new_group` (host `host`'s node is silent: frozen or cut
        off), that node is evicted too: Ray still counts it alive, and a
        group placed on it would wait for Ray to declare it dead. With
        `node_died`, a node that is gone (its raylet refuses connections)
        is evicted the same way: left in the old group, its bundle is one
        Ray reschedules once its health checks declare the node dead, and
        until a node can take it Ray's GCS retries that without pause, a
        core's worth of its time (seen for as long as a lost slice waited),
        and the replacement waits for those health checks (~30 s on Ray's
        defaults). A node id is never used again, so evicting a gone node
        costs the run nothing. Returns whether the replacement gets a new
        group."""
        if (new_group or node_died) and host is not None and not evict:
            try:
                node = self.backend.hosts(slice_id)[host]["node_id"]
            except (KeyError, IndexError, TypeError):  # hosts unknown: a new group, placed anywhere
                node = None
            # A `node_died` whose host's node still answers (inputs lost on
            # another node) keeps its group: that node is not the one gone.
            if node is not None and (new_group or not self.backend.node_alive(node)):
                evict = (node,)
        self.live.discard(slice_id)
        self.backend.retire(slice_id)
        self.start(slice_id, new_group, evict)
        return bool(new_group or evict)

    def go_live(self, slices: set[int]) -> None:
        self.ready -= slices
        self.live |= slices

    def state_source(self, step: int) -> StateSource:
        """Where joiners load the state of `step` from, or what older state
        the run must roll back to when no live slice holds it."""
        latest = self.snapshots.latest_step()
        if self.live:
            if latest == step:
                found = self.snapshots.restore_source(self.backend.node_alive)
                if found is not None:
                    return StateSource("snapshot", step, found[1])
            return StateSource("live", step, self.backend.state(min(self.live)))
        found = self.snapshots.restore_source(self.backend.node_alive)
        durable = self.checkpoints.latest_committed() if self.checkpoints else None
        if durable is not None and (found is None or durable > found[0]):
            ref = self.checkpoints.restore_ref(durable)
            # A step found damaged on reading is moved aside and an older
            # one delivered instead: the run goes back to that one.
            return StateSource("checkpoint", self.checkpoints.restored_step, ref)
        if found is not None:
            return StateSource("snapshot", found[0], found[1])
        # No snapshot survives (snapshots off, none taken yet, or every
        # copy lost with its node): start over from the initial state.
        return StateSource("initial", 0)

    def join(self, new: list[int], source: StateSource) -> bool:
        """Load the state into ready slices and make them live. False if
        the load failed: a joiner that died is queued again; if the joiners
        are fine, the source was bad (a snapshot copy on a node that just
        went) and is dropped, so the next try takes the next-newest."""
        if source.ref is not None and new:
            try:
                self.backend.load(new, source.ref, self._load_timeout_s)
            except CheckpointDamaged as d:  # hosts reading a sharded step found it damaged
                self.checkpoints.damaged_on_load(d)
                self._failed_joins += 1
                return False
            except StateLoadFailed as e:
                if not e.dead:
                    self.snapshots.discard_latest()
                for s in e.dead:
                    self.start(s)
                log.warning("loading state into slices %s failed (%s); %s", new, e.cause,
                            f"re-queued {e.dead}" if e.dead else "trying an older copy")
                self._failed_joins += 1
                if self._failed_joins >= MAX_FAILED_JOINS:
                    raise RunFailed(
                        f"slices {new} failed to load the training state {self._failed_joins} times in a row "
                        f"(last: {e.cause}). The cluster may be losing nodes faster than it recovers; "
                        "check node health, or raise max_retries once it is stable.",
                        setting="max_retries",
                    ) from e
                return False
        self._failed_joins = 0
        self.go_live(set(new))
        return True

    def reconcile(self, step: int, unreachable: bool) -> Optional[int]:
        """After a failure mid-step, the step every survivor now holds (during
        the apply phase some may have applied it; `unreachable`: the lost
        slice's node is gone, so waits on it are given up); None: no survivor."""
        if not self.live:
            return None
        held = self.backend.held_steps(sorted(self.live), step, abort_waits=unreachable)
        steps = set(held.values())
        if len(steps) == 1 and -1 not in steps:
            return steps.pop()
        # A survivor ahead applied the whole step (an apply runs only with all
        # its gradients): the others load its state (its snapshot, else its
        # memory), nothing rolled back. No whole slice ahead: the snapshot.
        newest, latest = max(steps), self.snapshots.latest_step()
        found = self.snapshots.restore_source(self.backend.node_alive) if latest is not None else None
        if latest == newest and found is not None:
            target, source = newest, found[1]
        elif newest >= 0:
            target, source = newest, self.backend.state(min(s for s in self.live if held[s] == newest))
        else:
            target, source = latest or 0, found[1] if found else None
        behind = [s for s in sorted(self.live) if held[s] != target]
        try:
            self.backend.load(behind, source, timeout_s=60)
        except StateLoadFailed as e:
            raise self.backend.locate(sorted(self.live), step, e) from None
        return target

    def hosts(self) -> dict[int, list[dict]]:
        """pid and node of every host of every live slice."""
        return {s: self.backend.hosts(s) for s in sorted(self.live)}

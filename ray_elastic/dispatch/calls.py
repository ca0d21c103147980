"""The calls a step is made of, as the dispatch layer issues and gathers
them: one call on one host (`Call`), the step's deadline (`Deadline`), a
step's gradient phase and reduction tree issued as one graph (`Issued`),
a step's calls grouped by slice, and what a step comes back with
(`StepResult`, or `PartialStep` when a slice failed in it; a DiLoCo
step's metrics averaged over its replicas, `replica_mean`); whether a
slice's hosts hold their own blocks (`per_host`). Pure: nothing here talks to Ray
(step_runner.py makes the calls and waits for them; the group leaders,
leader.py, use the same pieces)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Optional

__all__ = ["Call", "Deadline", "Issued", "PartialStep", "StepResult", "per_host", "refs_by_slice", "replica_mean"]


def per_host(sl) -> bool:
    """Whether each host of a slice holds its own blocks of the state (a
    sharded layout): then every host sends gradients, snapshots and loads
    its own part, and a slice's snapshot is a tuple of one ref per host,
    whatever the host count (one host gives a tuple of one)."""
    return bool(getattr(sl, "per_host", False))


@dataclasses.dataclass(frozen=True)
class Call:
    """One call on one host of a slice: what a gather waits for.
    `reissue` makes the call again (its error was transient: the worker
    still answers) and returns the new call's ref; the new call's other
    returns (a payload, a partial sum, a snapshot) replace the first
    try's where its caller keeps them."""

    slice_id: int
    host: int
    ref: Any  # the reply a gather reads: a status, or an apply's metrics
    reissue: Callable[[], Any]
    # Its other returns as they are now (a payload's chunks, a sum): read
    # with the reply when the call is given up on (dispatch/unread.py).
    others: Callable[[], tuple] = lambda: ()


@dataclasses.dataclass(frozen=True)
class Deadline:
    at: float  # clock time the step must be done by
    seconds: float  # its length, for the report

    @classmethod
    def after(cls, now: float, seconds: float) -> "Deadline":
        return cls(now + seconds, seconds)


@dataclasses.dataclass
class Issued:
    """A step's gradient phase and reduction tree, issued without waiting."""

    step: int
    live: dict  # slice -> the LiveSlice it was issued on
    assignment: dict
    grads: list  # phase-1 Calls
    payloads: dict  # slice -> {host: ref}
    levels: list  # the reduction trees' Calls, level by level
    tops: dict  # sending host index -> the top Parts of its tree (tree.Part)

    def serves(self, k: int, live: Mapping, assignment: Mapping) -> bool:
        """Issued for this very step, slices (the same workers) and shards."""
        return (self.step == k and dict(assignment) == self.assignment and self.live.keys() == live.keys()
                and all(self.live[s] is live[s] for s in live))


def refs_by_slice(calls: Iterable[Call], start: Optional[Mapping[int, list]] = None) -> dict[int, list]:
    """slice -> the refs of its calls, in order, after those of `start`:
    a slice's next gradient calls take every apply of the slice as
    arguments, so that Ray runs them only once the whole slice applied."""
    out = {s: list(refs) for s, refs in (start or {}).items()}
    for c in calls:
        out.setdefault(c.slice_id, []).append(c.ref)
    return out


@dataclasses.dataclass(frozen=True)
class StepResult:
    metrics: dict  # (slice, host) -> the worker's step metrics (loss, notices)
    # slice -> ref of the state it snapshotted after the step (a tuple, one
    # per host, under a sharded layout); copied off the step's path, so not
    # sealed until the refs of its calls' statuses (snapshot_status) are.
    snapshots: dict
    snapshot_status: dict = dataclasses.field(default_factory=dict)

    @property
    def loss(self) -> float:
        return next(iter(self.metrics.values()))["loss"]

    @property
    def aux(self) -> dict:
        """The program's aux metrics of the step, reduced over the global batch."""
        return dict(next(iter(self.metrics.values())).get("aux", {}))


@dataclasses.dataclass(frozen=True)
class PartialStep:
    """What a step had done when a slice failed in its gradient phase: the
    gradients of the slices that finished it (refs on their own nodes).
    Rides on the SliceFailure (`partial`), so that under resize the
    survivors compute only the lost slice's shards and the step completes."""

    step: int
    assignment: dict  # slice -> its shards, as the step began
    payloads: dict  # surviving slice -> {sending host: its gradients (a ref)}
    pending: list = dataclasses.field(default_factory=list)  # survivors' phase-1 Calls still running


def replica_mean(metrics: Mapping, replicas: Mapping[int, int]) -> dict:
    """Every host's metrics with the step's loss and aux metrics averaged
    over the replicas (host 0 of each, in replica order), as MaxText
    reports a DiLoCo step; each replica's own loss stays as replica_loss."""
    firsts = sorted(((replicas[s], m) for (s, h), m in metrics.items() if h == 0), key=lambda x: x[0])
    loss = sum(m["loss"] for _, m in firsts) / len(firsts)
    names = set().union(*(m.get("aux", {}) for _, m in firsts))
    aux = {k: sum(m["aux"][k] for _, m in firsts) / len(firsts) for k in sorted(names)}
    return {key: {**m, "loss": loss, "aux": aux, "replica_loss": m["loss"]} for key, m in metrics.items()}

"""The calls a step is made of, as the dispatch layer issues and gathers
them: one call on one host (`Call`), the step's deadline (`Deadline`), a
step's gradient phase and reduction tree issued as one graph (`Issued`),
and a step's calls grouped by slice. Pure: nothing here talks to Ray
(step_runner.py makes the calls and waits for them; the group leaders,
leader.py, use the same pieces)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Optional

__all__ = ["Call", "Deadline", "Issued", "refs_by_slice"]


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

"""A step's apply calls: every host of a slice applies the step, or none.

A slice's hosts run its apply as one program (under a sharded layout the
gradient's global norm is an all-reduce over them). Were each host's
apply to fetch its own inputs, a node lost with another slice's
gradients would fail the fetch of the hosts whose inputs lay there while
their peers had theirs and applied, alone in that all-reduce: the slice
would hold no one step, and with no snapshot of the step to reload
(after a cold start, say) the healthy slice would be failed for the
other's loss.

So on a slice of several hosts each host first takes its inputs
(`take_inputs`: fetched and held in the worker, given up on as any wait
for inputs is), and every host's apply takes every take's reply as an
argument: Ray runs the applies once all the takes are in, and none of
them if one failed. The slice keeps step k whole, with its gradients,
and the step is finished as after any loss. After a failure a take is
cancelled, never such an apply (one cancelled as the takes all landed
would leave its peers to apply alone): step_runner.settle_applies. A
one-host slice's apply fetches its own inputs: one call is all or none.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from ray_elastic.dispatch.calls import Call, per_host

__all__ = ["IssuedApplies", "issue_applies"]


@dataclasses.dataclass(frozen=True)
class IssuedApplies:
    """A step's apply calls as issued (`issue_applies`)."""

    calls: list  # one Call per host of every slice
    snaps: Callable[[], tuple]  # once gathered: (slice -> state ref(s), slice -> snapshot status refs)
    applies: dict  # (slice, host) -> metrics ref of its apply's latest try (a re-issue replaces it)
    taken: dict  # (slice, host) -> its take_inputs ref, on a slice of several hosts


def issue_applies(k: int, live: Mapping, grad_refs: Mapping[int, list], takers: frozenset, epoch: int) -> IssuedApplies:
    """Step k's apply on every host of the `live` slices: host h takes
    grad_refs[h] (a sharded layout) or grad_refs[0]; the slices in
    `takers` snapshot the new state, off the step's path (every host its
    own blocks under a sharded layout, else host 0)."""
    calls, parts, applies, taken = [], {}, {}, {}  # parts: slice -> {host: (snapshot status ref, state ref)}
    for s, sl in sorted(live.items()):
        own = per_host(sl)
        takes = tuple(w.take_inputs.remote(k, list(grad_refs[h if own else 0]), epoch)
                      for h, w in enumerate(sl.workers)) if len(sl.workers) > 1 else ()
        for h, w in enumerate(sl.workers):
            snapshot = (h == 0 or own) and s in takers
            refs = grad_refs[h if own else 0]

            def call(w=w, snapshot=snapshot, refs=refs, s=s, h=h, takes=takes):
                m_ref = w.apply.remote(k, snapshot, None, epoch, *takes) if takes else w.apply.remote(
                    k, snapshot, list(refs), epoch)
                if snapshot:  # the copy, once the apply is done; the driver owns it
                    parts.setdefault(s, {})[h] = w.snapshot.options(num_returns=2, concurrency_group="snapshot").remote(k, m_ref)
                applies[(s, h)] = m_ref
                return m_ref

            if takes:
                taken[(s, h)] = takes[h]
            # A take's error is its apply's too: read with it once given up on (unread.py).
            calls.append(Call(s, h, call(), call, lambda takes=takes: takes))

    def snaps() -> tuple[dict, dict]:
        return ({s: tuple(refs[h][1] for h in sorted(refs)) if per_host(live[s]) else refs[0][1]
                 for s, refs in parts.items()}, {s: tuple(r[0] for _, r in sorted(refs.items())) for s, refs in parts.items()})

    return IssuedApplies(calls, snaps, applies, taken)

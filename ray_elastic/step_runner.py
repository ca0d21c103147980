"""The data plane: one training step on the live slices.

Phase 1: every host computes the gradients of its slice's shards of the
step's global batch; host 0 of each slice returns them as one object.
Hand-off: up to APPLY_FAN_IN shards, every apply call takes those objects
directly; above, they are summed in a tree of fan-in APPLY_FAN_IN on the
slices' host-0 workers, level by level, so no call carries more than
APPLY_FAN_IN refs and the driver's work stays linear in the slice count.
The tree's shape depends only on the shard count, so the additions happen
in the same order whichever slices are alive (a resized run stays bitwise
equal to a failure-free one). Phase 2: every host applies the mean; the
slices chosen to snapshot return the new state with their reply, so a step
is never reported done before its snapshot is sealed.

A lost or hung host surfaces as a `SliceFailure` (failure_location), the
first one seen; gradients never pass through the driver.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import ray
from ray import exceptions as rex

from ray_elastic.failure_location import TRANSIENT, FailureLocator, failure, short

__all__ = ["APPLY_FAN_IN", "StepResult", "StepRunner"]

APPLY_FAN_IN = 8


@dataclasses.dataclass(frozen=True)
class StepResult:
    metrics: dict  # (slice, host) -> the worker's step metrics (loss, notices)
    snapshots: dict  # slice -> ref of the state it snapshotted after the step

    @property
    def loss(self) -> float:
        return next(iter(self.metrics.values()))["loss"]


@dataclasses.dataclass(frozen=True)
class _Deadline:
    at: float  # clock time the step must be done by
    seconds: float  # its length, for the report


class StepRunner:
    def __init__(self, locator: FailureLocator, clock: Callable[[], float], fan_in: Optional[int] = None):
        self.locator = locator
        self._clock = clock
        self.fan_in = fan_in or APPLY_FAN_IN  # read now: tests lower it

    def run(
        self,
        k: int,
        live: Mapping,
        assignment: Mapping[int, tuple],
        takers: frozenset,
        deadline_s: float,
        on_issued: Callable[[], None] = lambda: None,
    ) -> StepResult:
        """Run step k within deadline_s. `assignment`: slice -> its shards;
        `takers`: slices whose reply carries a snapshot; `on_issued` runs
        once phase 1 is in flight (where injected faults fire)."""
        wait = _Deadline(self._clock() + deadline_s, deadline_s)
        payloads: dict[int, Any] = {}  # slice -> its host 0's gradients (a ref)

        def grads_call(w, s: int, h: int):
            status, payload = w.compute_grads.options(num_returns=2).remote(k, assignment[s])
            if h == 0:
                payloads[s] = payload  # a re-issued call replaces it
            return status

        issued = [
            (s, h, grads_call(w, s, h), lambda w=w, s=s, h=h: grads_call(w, s, h))
            for s, sl in sorted(live.items())
            for h, w in enumerate(sl.workers)
        ]
        on_issued()
        self._gather(issued, k, wait, live)
        grad_refs = self._hand_off(k, live, assignment, payloads, wait)

        issued, snaps = [], {}
        for s, sl in sorted(live.items()):
            for h, w in enumerate(sl.workers):
                take = h == 0 and s in takers

                def call(w=w, take=take):
                    return w.apply.options(num_returns=2).remote(k, take, *grad_refs)

                m_ref, snap_ref = call()
                if take:
                    snaps[s] = snap_ref
                issued.append((s, h, m_ref, lambda call=call: call()[0]))
        return StepResult(self._gather(issued, k, wait, live), snaps)

    def _gather(self, issued: list, k: int, wait: "_Deadline", live: Mapping) -> dict:
        """Wait for every call; raise a SliceFailure on the first lost slice."""
        pending = {ref: (s, h, reissue) for s, h, ref, reissue in issued}
        out = {}
        while pending:
            remaining = wait.at - self._clock()
            if remaining <= 0:
                candidates = [(s, h) for s, h, _ in pending.values()]
                raise self.locator.hung(candidates, live, k, wait.seconds)
            done, rest = ray.wait(list(pending), num_returns=1, timeout=remaining)
            if done and rest:
                # Take everything else already finished in one go, so a
                # phase costs O(slices), not one wait per slice.
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                done += more
            for ref in done:
                s, h, reissue = pending.pop(ref)
                try:
                    out[(s, h)] = ray.get(ref)
                except rex.RayError as e:
                    kind = self.locator.classify_call(e, live, s, h)
                    if kind is TRANSIENT:
                        pending[reissue()] = (s, h, reissue)
                        continue
                    raise failure(kind, self.locator.blame(s, kind, live), h, k, short(e)) from None
        return out

    def _hand_off(self, k: int, live: Mapping, assignment: Mapping, payloads: dict, wait: "_Deadline") -> list:
        """The refs every slice's apply call takes: the phase-1 payloads
        themselves up to `fan_in` shards, else the top of the reduction
        tree over consecutive shards."""
        holder = {shard: payloads[s] for s, shards in assignment.items() for shard in shards}
        nodes = [(shard, [holder[shard]]) for shard in sorted(holder)]  # (key, refs holding it)
        reducers = sorted(live)
        fan = self.fan_in
        while len(nodes) > fan:
            issued, boxes = [], []
            for j in range(0, len(nodes), fan):
                group = nodes[j:j + fan]
                keys = tuple(key for key, _ in group)
                refs = list(dict.fromkeys(r for _, rs in group for r in rs))
                s = reducers[(j // fan) % len(reducers)]
                box: list = []

                def call(w=live[s].workers[0], keys=keys, refs=refs, box=box):
                    status, partial = w.reduce.options(num_returns=2).remote(k, keys, *refs)
                    box[:] = [partial]
                    return status

                issued.append((s, 0, call(), call))
                boxes.append((keys[0], box))
            self._gather(issued, k, wait, live)
            nodes = [(key, [box[0]]) for key, box in boxes]
        return list(dict.fromkeys(r for _, rs in nodes for r in rs))

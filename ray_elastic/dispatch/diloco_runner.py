"""The data plane of DiLoCo (control/diloco.py): inner steps that each
replica takes alone, and the synchronization at a round's end.

An inner step is one call per host; nothing crosses slices. A
synchronization is the exchange of a step (exchange.py) over the
replicas' deltas instead of gradients: each replica's delta is one block
keyed by its replica id with weight 1, so the owners sum the deltas in
replica order and every host's outer apply divides by the count of
replicas that took part. Failures surface as the StepRunner's
`SliceFailure`s (its `gather`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import ray

from ray_elastic.dispatch.calls import Call, Deadline, StepResult
from ray_elastic.dispatch.exchange import MAX_CHUNKS, issue_exchange, sources_of
from ray_elastic.dispatch.exchange_plan import ExchangePlan
from ray_elastic.dispatch.step_runner import StepRunner, per_host, senders
from ray_elastic.dispatch.tree import refs_of
from ray_elastic.errors import SliceFailure
from ray_elastic.dispatch.outer_spec import OuterSpec

__all__ = ["DilocoRunner", "replica_mean"]


def replica_mean(metrics: Mapping, replicas: Mapping[int, int]) -> dict:
    """Every host's metrics with the step's loss and aux metrics averaged
    over the replicas (host 0 of each, in replica order), as MaxText
    reports a DiLoCo step; each replica's own loss stays as replica_loss."""
    firsts = sorted(((replicas[s], m) for (s, h), m in metrics.items() if h == 0), key=lambda x: x[0])
    loss = sum(m["loss"] for _, m in firsts) / len(firsts)
    names = set().union(*(m.get("aux", {}) for _, m in firsts))
    aux = {k: sum(m["aux"][k] for _, m in firsts) / len(firsts) for k in sorted(names)}
    return {key: {**m, "loss": loss, "aux": aux, "replica_loss": m["loss"]} for key, m in metrics.items()}


class DilocoRunner:
    """Inner steps and synchronizations on the live slices, through
    `runner` (its gather, epoch and reduce calls)."""

    def __init__(self, runner: StepRunner, spec: OuterSpec, blocks: int, clock: Callable[[], float]):
        self.runner = runner
        self.spec = spec
        self.blocks = blocks  # the configured replica count: replica r is block r
        self._clock = clock
        self.bytes_synced = 0  # delta bytes every synchronization moved, summed (exchange counters have them per host)

    def inner(self, k: int, live: Mapping, assignment: Mapping[int, tuple], replicas: Mapping[int, int],
              deadline_s: float, on_issued: Callable[..., None]) -> StepResult:
        """Inner step k on every live slice, each on its replica's shards.
        A slice lost in it raises its SliceFailure once the survivors'
        steps are done: theirs need nothing of it, so they hold k + 1."""
        wait = Deadline.after(self._clock(), deadline_s)
        calls = []
        for s in sorted(live):
            for h, w in enumerate(live[s].workers):
                def call(w=w, s=s):
                    return w.inner_step.options(concurrency_group="compute").remote(k, tuple(assignment[s]), self.spec)
                calls.append(Call(s, h, call(), call))
        on_issued()
        try:
            out = self.runner.gather(calls, k, wait, live)
        except SliceFailure as f:
            rest = [c.ref for c in calls if c.slice_id != f.slice_id]
            ray.wait(rest, num_returns=len(rest), timeout=max(0.0, wait.at - self._clock()))
            raise
        return StepResult(replica_mean(out, replicas), {})

    def synchronize(self, boundary: int, since: int, live: Mapping, replicas: Mapping[int, int],
                    deadline_s: float, on_issued: Callable[..., None] = lambda phase="sync": None,
                    fragment: Optional[int] = None) -> tuple:
        """The outer step at `boundary` over the live replicas' deltas
        (`since`: the round's start, the boundary they last synchronized
        at), of Streaming DiLoCo's `fragment` alone if given. A failure cut the last try short after some hosts' applies
        had every input: where whole slices applied it, the others take
        their global params instead of exchanging again; where only some
        hosts did, theirs is taken back and the exchange runs again.
        Returns the replicas whose deltas the outer step averaged (None:
        taken from slices that had synchronized) and the bytes that
        crossed slices. `on_issued("sync")` runs once the outer applies
        are issued."""
        wait = Deadline.after(self._clock(), deadline_s)
        order = sorted(live)
        synced = self._on_hosts(live, order, boundary, wait, lambda w: w.diloco_synced.remote())
        done = [s for s in order if all(synced[(s, h)] == boundary for h in range(len(live[s].workers)))]
        if done:
            behind = [s for s in order if s not in done]
            # They take in what the others' outer step gave the replicas.
            take = "all" if fragment is None else (None if self.spec.overlap else fragment)
            self.adopt(behind, min(done, key=lambda s: replicas[s]), live, boundary, wait, take)
            return None, 0
        if any(v != since for v in synced.values()):
            self._on_hosts(live, order, boundary, wait, lambda w: w.diloco_synced.remote(since))
        plan = ExchangePlan(chunks=1 if len(order) <= 2 else min(len(order), MAX_CHUNKS), blocks=self.blocks,
                            shards=tuple(sorted(replicas[s] for s in order)), fan_in=self.runner.fan_in)
        payloads: dict = {}
        issued: list = []
        try:
            deltas = []
            for s in order:
                for h, w in enumerate(live[s].workers):
                    def call(w=w, s=s, h=h):
                        status, *chunks = w.diloco_delta.options(num_returns=1 + plan.chunks, concurrency_group="compute").remote(
                            boundary, replicas[s], plan, self.spec, fragment)
                        payloads.setdefault(s, {})[h] = tuple(chunks)
                        return status
                    deltas.append(Call(s, h, call(), call, lambda s=s, h=h: payloads[s][h]))
            issued += deltas
            self.runner.gather(deltas, boundary, wait, live)
            # Issued once every delta is in: a re-issued one's chunks are the ones summed.
            reduces, tops = issue_exchange(self.runner, boundary, live, sources_of(payloads), plan, senders(live[order[0]]))
            issued += reduces
            summed = self.runner.gather(reduces, boundary, wait, live)
            applies = []
            for s in order:
                own = per_host(live[s])
                for h, w in enumerate(live[s].workers):
                    def apply(w=w, h=h, own=own):
                        return w.diloco_outer.remote(boundary, self.spec, list(refs_of(tops[h if own else 0])),
                                                     self.runner.epoch, fragment)
                    applies.append(Call(s, h, apply(), apply))
            issued += applies
            on_issued("sync")  # where injected faults of phase "sync" fire
            replies = self.runner.gather(applies, boundary, wait, live)
        except SliceFailure as f:
            self._give_up(f.slice_id, issued, live, boundary)
            raise
        moved = sum(r.get("bytes_in", 0) for r in [*summed.values(), *replies.values()])
        self.bytes_synced += moved
        return replies[(order[0], 0)]["replicas"], moved

    def _give_up(self, lost: int, issued: list, live: Mapping, boundary: int) -> None:
        """A synchronization lost a slice: the survivors' calls still
        waiting for an input stop (they change nothing), the others end;
        then each host has applied the outer step or not, and the next try
        sorts them (`synchronize`). Every reply is read once done."""
        for s in sorted(live):
            if s != lost:
                for w in live[s].workers:
                    w.abort_waits.options(concurrency_group="control").remote(self.runner.epoch, boundary)
        rest = [c.ref for c in issued if c.slice_id != lost]
        ray.wait(rest, num_returns=len(rest), timeout=30.0)
        for c in issued:
            self.runner.unread.add(c.ref, c.others())

    def _on_hosts(self, live: Mapping, order: list, k: int, wait: Deadline, fn: Callable) -> dict:
        """(slice, host) -> fn(worker)'s reply, on every host of the slices in `order`."""
        calls = [Call(s, h, fn(w), lambda w=w: fn(w)) for s in order for h, w in enumerate(live[s].workers)]
        return self.runner.gather(calls, k, wait, live)

    def adopt(self, slices: Sequence[int], donor: int, live: Mapping, boundary: int, wait: Deadline,
              take: Any = "all") -> None:
        """`slices` take `donor`'s global params and outer state (host i
        from host i) and `take` of its global params (steps.py's
        adopt_outer: "all", a fragment, or None); each keeps its inner
        optimizer state."""
        calls = []
        for s in slices:
            for h, w in enumerate(live[s].workers):
                def call(w=w, h=h):
                    return w.diloco_adopt.remote(live[donor].workers[h].diloco_global.remote(self.spec), self.spec, take)
                calls.append(Call(s, h, call(), call))
        self.runner.gather(calls, boundary, wait, live)

    def catch_up(self, slice_id: int, live: Mapping, steps: range, shards: tuple, wait: Deadline) -> None:
        """A joiner recomputes its replica's inner `steps`, one after the other."""
        for k in steps:
            calls = []
            for h, w in enumerate(live[slice_id].workers):
                def call(w=w):
                    return w.inner_step.options(concurrency_group="compute").remote(k, shards, self.spec)
                calls.append(Call(slice_id, h, call(), call))
            self.runner.gather(calls, k, wait, {slice_id: live[slice_id]})

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

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import ray

from ray_elastic.dispatch.calls import Call, Deadline, StepResult, replica_mean
from ray_elastic.dispatch.exchange import MAX_CHUNKS, issue_exchange, sources_of
from ray_elastic.dispatch.exchange_plan import ExchangePlan
from ray_elastic.dispatch.step_runner import StepRunner, per_host, senders
from ray_elastic.dispatch.tree import refs_of
from ray_elastic.errors import SliceFailure
from ray_elastic.dispatch.outer_spec import OuterSpec

__all__ = ["DilocoRunner", "Pending", "SyncCalls"]


class DilocoRunner:
    """Inner steps and synchronizations on the live slices, through
    `runner` (its gather, epoch and reduce calls)."""

    def __init__(self, runner: StepRunner, spec: OuterSpec, blocks: int, clock: Callable[[], float]):
        self.runner = runner
        self.spec = spec
        self.blocks = blocks  # the configured replica count: replica r is block r
        self._clock = clock
        self.bytes_synced = 0  # delta bytes every synchronization moved, summed (exchange counters have them per host)
        self.pending: Optional[Pending] = None  # a synchronization overlapped with inner steps (`start`)
        # (slice, host) -> (worker, refs its next inner step waits for). Ray
        # runs a threaded actor's calls in no set order (docs: "Actor Task
        # Execution Order"), so a round-start state asked of a host
        # (`hold_before_next`) could otherwise be taken after the next inner
        # step, a step later: seen as a spare that loaded it holding the
        # round's second step when asked to recompute its first.
        self._before_next: dict[tuple[int, int], tuple[Any, tuple]] = {}

    def inner(self, k: int, live: Mapping, assignment: Mapping[int, tuple], replicas: Mapping[int, int],
              deadline_s: float, on_issued: Callable[..., None]) -> StepResult:
        """Inner step k on every live slice, each on its replica's shards.
        A slice lost in it raises its SliceFailure once the survivors'
        steps are done: theirs need nothing of it, so they hold k + 1.
        The first step after an overlapped synchronization's boundary waits
        for its host's delta (made from the params of the boundary)."""
        wait = Deadline.after(self._clock(), deadline_s)
        first = self.pending.deltas if self.pending is not None and self.pending.boundary == k else {}
        calls = []
        for s in sorted(live):
            for h, w in enumerate(live[s].workers):
                def call(w=w, s=s, after=tuple(first.get((s, h), ())) + self._after(s, h, w)):
                    return w.inner_step.options(concurrency_group="compute").remote(k, tuple(assignment[s]), self.spec,
                                                                                    *after)
                calls.append(Call(s, h, call(), call))
        on_issued()
        try:
            out = self.runner.gather(calls, k, wait, live)
        except SliceFailure as f:
            rest = [c.ref for c in calls if c.slice_id != f.slice_id]
            ray.wait(rest, num_returns=len(rest), timeout=max(0.0, wait.at - self._clock()))
            raise
        return StepResult(replica_mean(out, replicas), {})

    def hold_before_next(self, slice_id: int, workers: Sequence, refs: Sequence) -> None:
        """The next inner step of host h of `slice_id` waits for `refs[h]`
        (a call on its own worker, so the ref is fetched from its node)."""
        for h, (w, ref) in enumerate(zip(workers, refs)):
            self._before_next[(slice_id, h)] = (w, (ref,))

    def forget(self, slice_id: int) -> None:
        """A slice left: the round-start states held for its next inner
        step go (else, while its id is not live again, its object stays in
        the object store as long as the run's backend: the soak's DiLoCo
        leg counted three such states after its run)."""
        for key in [key for key in self._before_next if key[0] == slice_id]:
            del self._before_next[key]

    def _after(self, slice_id: int, host: int, worker: Any) -> tuple:
        held = self._before_next.pop((slice_id, host), None)
        return held[1] if held is not None and held[0] is worker else ()  # a replaced worker's are void

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
        issued: list = []
        try:
            deltas, payloads = self._deltas(boundary, live, replicas, fragment)
            issued += deltas
            self.runner.gather(deltas, boundary, wait, live)
            # Issued once every delta is in: a re-issued one's chunks are the ones summed.
            calls = self._exchange(boundary, live, payloads, replicas, fragment, deltas, issued)
            summed = self.runner.gather(calls.reduces, boundary, wait, live)
            on_issued("sync")  # where injected faults of phase "sync" fire
            replies = self.runner.gather(calls.applies, boundary, wait, live)
        except SliceFailure as f:
            self._give_up({f.slice_id}, issued, live, boundary)
            raise
        return self._moved(summed, replies, order)

    def _plan(self, live: Mapping, replicas: Mapping[int, int]) -> ExchangePlan:
        return ExchangePlan(chunks=1 if len(live) <= 2 else min(len(live), MAX_CHUNKS), blocks=self.blocks,
                            shards=tuple(sorted(replicas[s] for s in live)), fan_in=self.runner.fan_in)

    def _deltas(self, boundary: int, live: Mapping, replicas: Mapping[int, int], fragment: Optional[int]) -> tuple:
        """Each host's delta call (Calls) and its chunks (slice -> {host: refs})."""
        plan = self._plan(live, replicas)
        payloads: dict = {}
        deltas = []
        for s in sorted(live):
            for h, w in enumerate(live[s].workers):
                def call(w=w, s=s, h=h):
                    status, *chunks = w.diloco_delta.options(num_returns=1 + plan.chunks, concurrency_group="compute").remote(
                        boundary, replicas[s], plan, self.spec, fragment)
                    payloads.setdefault(s, {})[h] = tuple(chunks)
                    return status
                deltas.append(Call(s, h, call(), call, lambda s=s, h=h: payloads[s][h]))
        return deltas, payloads

    def _exchange(self, boundary: int, live: Mapping, payloads: dict, replicas: Mapping[int, int],
                  fragment: Optional[int], deltas: list, issued: list) -> "SyncCalls":
        """The exchange over the deltas' chunks and each host's outer apply
        (Ray runs each once its inputs are in), appended to `issued`."""
        order = sorted(live)
        reduces, tops = issue_exchange(self.runner, boundary, live, sources_of(payloads), self._plan(live, replicas),
                                       senders(live[order[0]]))
        issued += reduces
        applies = []
        for s in order:
            own = per_host(live[s])
            for h, w in enumerate(live[s].workers):
                def apply(w=w, h=h, own=own):
                    return w.diloco_outer.remote(boundary, self.spec, list(refs_of(tops[h if own else 0])),
                                                 self.runner.epoch, fragment)
                applies.append(Call(s, h, apply(), apply))
        issued += applies
        return SyncCalls(deltas, reduces, applies)

    def _moved(self, summed: Mapping, replies: Mapping, order: list) -> tuple:
        """(the replicas the outer step averaged, the bytes that crossed slices)."""
        moved = sum(r.get("bytes_in", 0) for r in [*summed.values(), *replies.values()])
        self.bytes_synced += moved
        return replies[(order[0], 0)]["replicas"], moved

    # -- a synchronization overlapped with inner steps (Streaming DiLoCo) --

    def start(self, boundary: int, live: Mapping, replicas: Mapping[int, int], deadline_s: float,
              on_issued: Callable[..., None], fragment: int) -> None:
        """Issue fragment `fragment`'s synchronization at `boundary` and
        return: the inner steps up to `boundary + overlap` run while it
        moves (the first waits for its host's delta). `finish` gathers it."""
        deltas, payloads = self._deltas(boundary, live, replicas, fragment)
        issued: list = list(deltas)
        calls = self._exchange(boundary, live, payloads, replicas, fragment, deltas, issued)
        self.pending = Pending(boundary, fragment, frozenset(live), calls, issued, deadline_s,
                               {(c.slice_id, c.host): [c.ref] for c in calls.deltas})
        on_issued("sync")

    def finish(self, live: Mapping) -> Optional[tuple]:
        """Gather the synchronization `start` issued, its slices all live:
        (replicas averaged, bytes moved, the inner steps every replica took
        while it moved), or None where it must run again
        (a call was re-issued, so a later one's input is void); a slice
        lost in it raises its failure, the rest given up on (`drop`)."""
        p, order = self.pending, sorted(live)
        # Its deadline counts from now: it ran beside V inner steps, which had their own.
        wait, since = Deadline.after(self._clock(), p.deadline_s), self.runner.reissued
        try:
            self.runner.gather(p.calls.deltas, p.boundary, wait, live)
            summed = self.runner.gather(p.calls.reduces, p.boundary, wait, live)
            replies = self.runner.gather(p.calls.applies, p.boundary, wait, live)
        except SliceFailure as f:
            self.drop(live, lost={f.slice_id})
            raise
        if self.runner.reissued != since:  # one of its calls: a later one's input is void
            self.drop(live)
            return None
        self.pending = None
        # The inner steps every replica had taken past the boundary when its outer step applied.
        ran = min((r["at_step"] for r in replies.values() if "at_step" in r), default=p.boundary) - p.boundary
        return (*self._moved(summed, replies, order), ran)

    def drop(self, live: Mapping, lost: frozenset = frozenset()) -> None:
        """Give up on the synchronization `start` issued (a slice was lost
        since, or it must run again): the calls of the live slices still
        waiting for an input stop; `synchronize` then sorts every host
        out, applied or not. Later calls get the next epoch."""
        p, self.pending = self.pending, None
        if p is not None:
            self._give_up(set(p.slices - set(live)) | set(lost), p.issued, live, p.boundary, next_epoch=True)

    def _give_up(self, lost: set, issued: list, live: Mapping, boundary: int, next_epoch: bool = False) -> None:
        """A synchronization lost slices (or must run again): the others'
        calls still waiting for an input stop (they change nothing), the
        rest end; then each host has applied the outer step or not, and
        the next try sorts them (`synchronize`). Every reply is read once
        done. `next_epoch`: the next try's calls get a new epoch (where no
        failure's recovery gives them one), so this abort spares them."""
        epoch = self.runner.epoch
        if next_epoch:
            self.runner.epoch += 1
        for s in sorted(live):
            if s not in lost:
                for w in live[s].workers:
                    w.abort_waits.options(concurrency_group="control").remote(epoch, boundary)
        rest = [c.ref for c in issued if c.slice_id not in lost]
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

    def catch_up(self, slice_id: int, live: Mapping, steps: range, shards: tuple, wait: Deadline) -> dict:
        """A joiner recomputes its replica's inner `steps`, one after the
        other: step -> its hosts' metrics ((slice, host) -> metrics), the
        loss of a step the lost replica did not report among them."""
        out = {}
        for k in steps:
            calls = []
            for h, w in enumerate(live[slice_id].workers):
                def call(w=w):
                    return w.inner_step.options(concurrency_group="compute").remote(k, shards, self.spec)
                calls.append(Call(slice_id, h, call(), call))
            out[k] = self.runner.gather(calls, k, wait, {slice_id: live[slice_id]})
        return out


@dataclasses.dataclass(frozen=True)
class SyncCalls:
    """A synchronization's calls, by phase."""

    deltas: list
    reduces: list
    applies: list


@dataclasses.dataclass(frozen=True)
class Pending:
    """A synchronization issued, not yet gathered (`DilocoRunner.start`):
    its boundary, fragment, slices, calls (by phase, and all as issued),
    the seconds it may take once gathered, and each host's delta status
    ref, which that host's first inner step after the boundary waits for."""

    boundary: int
    fragment: int
    slices: frozenset
    calls: SyncCalls
    issued: list
    deadline_s: float
    deltas: dict

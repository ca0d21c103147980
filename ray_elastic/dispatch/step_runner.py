"""The data plane: one training step on the live slices.

Phase 1: every host computes the gradients of its slice's shards of the
step's global batch (host 0 of a replicated slice speaks for it; under a
sharded layout every host sends its own blocks and each exchange runs
among the hosts of one index). The exchange (`exchange`, exchange.py,
the default): a reduce-scatter and an all-gather, each host moving what a
ring all-reduce moves. The direct hand-off (a group leader's, or
`exchange="direct"`): up to APPLY_FAN_IN shards every apply takes the
payloads; above, a tree of fan-in APPLY_FAN_IN sums them on the slices'
workers, level by level down to one ref per apply. Either way the order of
the additions depends only on the shard keys (a resized run stays bitwise
equal to a failure-free one). Phase 2: every host applies the mean; the
slices chosen to snapshot copy the new state out in a call of its own.

A lost or hung host surfaces as a `SliceFailure` (failures/location.py), the
first one seen; gradients never pass through the driver.

Pipelined dispatch (`pipeline`, on unless RAY_ELASTIC_PIPELINE=0; replicated
layouts): a step's calls are issued as one graph, without waiting between
phases (Ray hands each result on as it is ready), and with `ahead` the
next step's gradient phase and reduction tree are issued before this step
is gathered, each gradient call after its slice's applies (their replies
are its arguments, so Ray runs it once they are done). The driver
then works while the slices compute: a step costs max(compute, driver)
rather than their sum. Only pure calls are issued ahead; the next apply
waits for the step boundary. Every apply depends on every gradient call of
its step (non-sending hosts' empty payloads ride along as gates), so a
step that fails applies nowhere: a failure loses only the step in flight,
and the calls issued ahead of it are dropped (their results never read;
no new gradient call is issued until they are over, so a worker never
runs two gradient phases at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Mapping, Optional, Sequence

import ray
from ray import exceptions as rex

from ray_elastic.dispatch.applies import issue_applies
from ray_elastic.dispatch.assignment import spread_shards
from ray_elastic.dispatch.unread import Dropped
from ray_elastic.dispatch.calls import Call, Deadline, Issued, PartialStep, StepResult, per_host, refs_by_slice
from ray_elastic.dispatch.exchange import ExchangeSpec, issue_exchange, sources_of
from ray_elastic.dispatch.tree import Part, deeper, gates, holders, refs_of
from ray_elastic.errors import FailureKind, SliceFailure
from ray_elastic.failures.internal import StepAborted
from ray_elastic.failures.location import TRANSIENT, FailureLocator, failure, short, watched_wait

__all__ = ["APPLY_FAN_IN", "PartialStep", "StepResult", "StepRunner", "per_host", "senders"]

APPLY_FAN_IN = 8
# While a step runs, the nodes of the live slices are probed this often: a
# node whose raylet is gone is found before the calls to it fail.
NODE_PROBE_S = 0.25
# Once a call of a phase has finished, the others that finish within this
# long are collected with it: how much later than at once a failed call is
# seen.
GATHER_POLL_S = 0.01


def senders(sl) -> int:
    """How many hosts of a slice send gradients: every host under a sharded
    layout (each holds other blocks), else host 0 (it holds them all)."""
    return len(sl.workers) if per_host(sl) else 1


def pipeline_default() -> bool:
    return os.environ.get("RAY_ELASTIC_PIPELINE", "1") != "0"


class StepRunner:
    """Runs steps on the live slices (`run`, `finish`), and offers the
    blocks they are made of (issue, gather, the reduction tree, settling)
    to the group leaders, which run their group's part of a step with a
    StepRunner of their own (leader.py, grouped_runner.py)."""

    def __init__(self, locator: FailureLocator, clock: Callable[[], float], fan_in: Optional[int] = None,
                 pipeline: Optional[bool] = None):
        self.locator = locator
        self._clock = clock
        self.fan_in = fan_in or APPLY_FAN_IN  # read now: tests lower it
        if self.fan_in < 2:
            raise ValueError(f"fan_in must be at least 2 (a tree of fan-in 1 never ends), got {self.fan_in}")
        self.pipeline = pipeline_default() if pipeline is None else pipeline
        # The reduce-scatter exchange (exchange.py) if set; else the direct
        # hand-off and its reduction tree (a group leader's runner).
        self.exchange: Optional[ExchangeSpec] = None
        self._ahead: Optional[Issued] = None  # the next step, issued ahead
        self._reissued = 0  # calls re-issued so far (their dependents' refs are void)
        self.steps_ahead = 0  # steps that ran on calls issued ahead (for tests and benches)
        self._dropped = Dropped(ray)  # calls given up on: waited for and read (unread.py)
        self.unread = self._dropped.unread
        self._first: dict[tuple[int, int], tuple] = {}  # (step, slice) -> calls its gradient calls wait for
        self._applies: dict = {}  # (slice, host) -> metrics ref of the last step's apply call (its latest try)
        self._taken: dict = {}  # (slice, host) -> its take_inputs ref, on a slice of several hosts (applies.py)
        self._workers: dict = {}  # slice -> its workers, as the last apply calls had them
        # Applies and reductions carry the epoch they were issued in; after
        # a failure, those of the epoch still waiting for an input give up
        # (settle_applies), and later calls get the next epoch. A group
        # leader's is its driver's (one count for every leader).
        self.epoch = 0
        # The step under way: those after it were issued ahead (and give
        # up with settle_applies).
        self.step: Optional[int] = None
        # Asked between waits: True ends a gather with StepAborted (a group
        # leader's call that its driver called off, dispatch/leader.py).
        self.aborted: Callable[[], bool] = lambda: False

    @property
    def reissued(self) -> int:
        """Calls re-issued so far. A re-issued call's dependents, issued on
        its first try, hold a void ref: compare this count before and after
        gathering to know whether they must be issued again."""
        return self._reissued

    def drop(self, issued: Optional[Issued]) -> None:
        self._dropped.drop(issued)  # never read (unread.Dropped)

    def run_first(self, k: int, slice_id: int, refs: Sequence) -> None:
        """Calls (a cross-check's recomputations on `slice_id`'s hosts)
        that every gradient call of step k on that slice takes as
        arguments, so every host runs them first: issued back to back, Ray
        ran about 1 pair in 1500 the other way round, and two hosts paired
        their collectives (docs/integrity.md, "Gradient cross-checks")."""
        self._first[(k, slice_id)] = tuple(refs)

    def drop_ahead(self) -> None:
        """Forget the calls issued ahead (`drop`)."""
        self.drop(self._ahead)
        self._ahead = None

    def settle_dropped(self, wait: Deadline, live: Mapping, only: bool = False) -> None:
        """Wait, within `wait`, for the live slices' dropped gradient calls to end (unread.Dropped.settle)."""
        self._dropped.settle(wait.at - self._clock(), live, only)

    def run(
        self,
        k: int,
        live: Mapping,
        assignment: Mapping[int, tuple],
        takers: frozenset,
        deadline_s: float,
        on_issued: Callable[..., None] = lambda phase="grads": None,
        ahead: Optional[Mapping[int, tuple]] = None,
    ) -> StepResult:
        """Run step k within deadline_s. `assignment`: slice -> its shards;
        `takers`: slices that snapshot the new state; `on_issued` runs
        once phase 1 is in flight, then with "reduce" once every gradient is
        in, and with "apply" once the sum is made (where injected faults
        fire, faults.FAULT_PHASES); `ahead`: the next step's assignment, to
        issue its pure calls early (None: the boundary may change slices)."""
        wait = Deadline.after(self._clock(), deadline_s)
        self.step = k
        self.unread.sweep()
        pre = self._ahead
        if pre is not None and self.pipeline and pre.serves(k, live, assignment):
            self._ahead = None
            self.steps_ahead += 1
        else:
            self.drop_ahead()
            self.settle_dropped(wait, live)
            if not self.pipeline:
                return self._run_in_phases(k, live, assignment, takers, wait, on_issued)
            pre = self.issue_step(k, live, assignment)
        on_issued()
        applies, snaps = self.issue_apply(k, live, {g: refs_of(parts) for g, parts in pre.tops.items()}, takers)
        if ahead is not None:
            # Each host's next gradient call waits for every apply of its
            # slice: were one host's apply aborted after a failure and
            # another's done, the done host alone would enter the step's
            # collectives and hold its one gradient thread for good.
            self._ahead = self.issue_step(k + 1, live, ahead, refs_by_slice(applies))
        since = self.reissued
        try:
            self.gather_grads(pre.grads, pre.payloads, k, live, assignment, wait)
            on_issued("reduce")
            with self._gradients_kept(k, live, assignment, pre.payloads):
                if not self.gather_levels(pre.levels, k, wait, live, since):
                    # A re-issued call's dependents hold its void ref: hand off again.
                    self.drop_ahead()
                    return self._apply(k, live, holders(assignment, pre.payloads), takers, wait, on_issued,
                                       **self._exchanged(assignment, pre.payloads))
                on_issued("apply")
                result = StepResult(self.gather(applies, k, wait, live), *snaps())
        except BaseException:
            self.drop_ahead()  # the step failed: what was issued after it is void
            self._give_up(pre, applies, snaps)
            raise
        if self.reissued != since:
            self.drop_ahead()  # issued after an apply call that was re-issued
        return result

    def _give_up(self, pre: Issued, applies: list, snaps: Callable[[], tuple]) -> None:
        """A step failed: its reductions, applies and snapshots are read once done (unread.py)."""
        for c in [c for level in pre.levels for c in level] + applies:
            self.unread.add(c.ref, c.others())
        states, statuses = snaps()
        for s, status in statuses.items():
            for i, ref in enumerate(status):
                self.unread.add(ref, (states[s][i] if isinstance(states[s], tuple) else states[s],))

    def _run_in_phases(self, k, live, assignment, takers, wait: Deadline, on_issued) -> StepResult:
        """Each phase issued once the one before is gathered."""
        issued, payloads = self.issue_grads(k, live, assignment, plan=self._plan(assignment, len(live)))
        on_issued()
        self.gather_grads(issued, payloads, k, live, assignment, wait)
        on_issued("reduce")
        with self._gradients_kept(k, live, assignment, payloads):
            return self._apply(k, live, holders(assignment, payloads), takers, wait, on_issued,
                               **self._exchanged(assignment, payloads))

    def _plan(self, assignment: Mapping, chunks: int):
        """The exchange's plan of a step (None: the direct hand-off)."""
        return None if self.exchange is None else self.exchange.plan(assignment, chunks, self.fan_in)

    def _exchanged(self, assignment: Mapping, *payload_sets: Mapping, live: int = 0) -> dict:
        """_apply's exchange arguments (none under the direct hand-off)."""
        return {} if self.exchange is None else self.exchange.args(assignment, self.fan_in, payload_sets, live)

    def gather_grads(self, issued: list, payloads: dict, k: int, live: Mapping, assignment: Mapping,
                     wait: Deadline) -> None:
        """Gather a step's gradient calls. A slice lost among them raises
        its failure with a `partial`: the survivors' gradients, and their
        calls still running (kept, not redone)."""
        finished: set = set()
        try:
            self.gather(issued, k, wait, live, finished)
        except SliceFailure as f:
            survivors = {s: payloads[s] for s in live if s != f.slice_id and s in payloads}
            pending = [c for c in issued if c.slice_id in survivors and (c.slice_id, c.host) not in finished]
            raise f.replace(partial=PartialStep(k, dict(assignment), survivors, pending)) from None

    def gather_levels(self, levels: list, k: int, wait: Deadline, live: Mapping, since: int) -> bool:
        """Gather the reduction tree's levels, lowest first, while no call
        was re-issued since the count `since` (`reissued`): the next level
        holds a re-issued call's void ref, its calls fail on that input, and
        a transient error would be re-issued with the same input until the
        deadline. Whether none was (else the tree must be made again over
        the gradients, which are all in)."""
        for level in levels:
            if self.reissued != since:
                return False
            self.gather(level, k, wait, live)
        return self.reissued == since

    @contextlib.contextmanager
    def _gradients_kept(self, k: int, live: Mapping, assignment: Mapping, payloads: dict):
        """Every gradient of step k is in: a slice lost from here on (in
        the reduction or the apply) leaves the survivors' gradients intact
        on their own nodes. The failure carries them, so the step can be
        finished (`finish`) with only the lost slice's shards computed again,
        unless a survivor has applied the step meanwhile (the controller
        reconciles the survivors first)."""
        try:
            yield
        except SliceFailure as f:
            if f.partial is not None:
                raise
            survivors = {s: payloads[s] for s in live if s != f.slice_id and s in payloads}
            raise f.replace(partial=PartialStep(k, dict(assignment), survivors, [])) from None

    def issue_step(self, k: int, live: Mapping, assignment: Mapping, after: Optional[dict] = None) -> Issued:
        """Phase 1 and the reduction tree of step k as one graph (nothing
        gathered); each gradient call waits for `after[slice]`."""
        plan = self._plan(assignment, len(live))
        grads, payloads = self.issue_grads(k, live, assignment, after, plan)
        if plan is not None:
            calls, tops = issue_exchange(self, k, live, sources_of(payloads), plan, senders(next(iter(live.values()))))
            return Issued(k, dict(live), dict(assignment), grads, payloads, [calls] if calls else [], tops)
        holder = holders(assignment, payloads)
        first = min(holder)
        groups = senders(next(iter(live.values())))
        levels, tops = [], {}
        # One tree per sending host index: under a sharded layout host g's
        # apply sums only host g's blocks (host i with host i).
        for g in range(groups):
            leaves = {shard: [refs[g]] for shard, refs in holder.items()}
            for s in sorted(payloads):
                leaves[min(assignment.get(s) or (first,))] += gates(payloads, assignment, s, g, groups)
            built, tops[g] = self.issue_tree(k, live, [Part(key, refs) for key, refs in sorted(leaves.items())], g)
            levels += built
        return Issued(k, dict(live), dict(assignment), grads, payloads, levels, tops)

    def finish(self, partial: PartialStep, live: Mapping, takers: frozenset, deadline_s: float) -> StepResult:
        """Complete a step whose gradient phase lost a slice: the live
        slices compute the shards nobody finished (spread over them in
        order), the others' gradients are kept, and the step applies as
        usual. The reduction is keyed by shard, so the result is bitwise
        the one a failure-free step gives."""
        k, wait = partial.step, Deadline.after(self._clock(), deadline_s)
        self.step = k
        self.drop_ahead()
        self.settle_dropped(wait, live)
        kept = {s: ref for s, ref in partial.payloads.items() if s in live}
        holder = holders(partial.assignment, kept)
        extra = spread_shards(sorted(shard for shards in partial.assignment.values() for shard in shards
                                     if shard not in holder), live)
        plan = self._exchanged(partial.assignment, kept, live=len(live)).get("plan")
        issued, payloads = self.issue_grads(k, live, extra, plan=plan)
        self.gather([c for c in partial.pending if c.slice_id in kept] + issued, k, wait, live)
        holder.update(holders(extra, payloads))
        return self._apply(k, live, holder, takers, wait, **self._exchanged(partial.assignment, kept, payloads))

    def issue_grads(self, k: int, live: Mapping, shards_of: Mapping[int, tuple],
                    after: Optional[dict] = None, plan=None) -> tuple[list, dict]:
        """Phase-1 calls on every host of the slices in `shards_of`; the
        payloads dict fills with each slice's gradients: {host: ref} (only
        the sending hosts' hold any; with an exchange `plan`, a tuple of
        chunk refs). With `after`, each call takes the refs after[slice]
        as arguments: Ray runs it once they are all done."""
        payloads: dict[int, dict] = {}
        self._first = {key: refs for key, refs in self._first.items() if key[0] >= k}

        def grads_call(w, s: int, h: int):
            extra = (tuple(after[s]) if after else ()) + self._first.get((k, s), ())
            fn = w.compute_grads.options(num_returns=2 if plan is None else 1 + plan.chunks, concurrency_group="compute")
            status, *rest = fn.remote(k, shards_of[s], *extra) if plan is None else fn.remote(
                k, shards_of[s], *extra, plan=plan)
            payloads.setdefault(s, {})[h] = rest[0] if plan is None else tuple(rest)  # a re-issue replaces it
            return status

        issued = [
            Call(s, h, grads_call(w, s, h), lambda w=w, s=s, h=h: grads_call(w, s, h),
                 lambda s=s, h=h: (payloads[s][h],))
            for s in sorted(shards_of)
            for h, w in enumerate(live[s].workers)
        ]
        return issued, payloads

    def _apply(self, k: int, live: Mapping, holder: dict, takers: frozenset, wait: Deadline,
               on_issued: Callable[..., None] = lambda phase="grads": None, sources=None, plan=None) -> StepResult:
        groups = senders(next(iter(live.values())))
        if plan is not None:  # the exchange over `sources`, gathered (re-issues update its Parts)
            calls, tops = issue_exchange(self, k, live, sources, plan, groups)
            self.gather(calls, k, wait, live)
            grad_refs = {g: refs_of(tops[g]) for g in range(groups)}
        else:
            grad_refs = {g: self._hand_off(k, live, {shard: refs[g] for shard, refs in holder.items()}, wait, g)
                         for g in range(groups)}
        on_issued("apply")  # the sum is made, the applies not yet issued
        issued, snaps = self.issue_apply(k, live, grad_refs, takers)
        return StepResult(self.gather(issued, k, wait, live), *snaps())

    def issue_apply(self, k: int, live: Mapping, grad_refs, takers: frozenset) -> tuple[list, Callable[[], tuple]]:
        """The apply calls: host h takes grad_refs[h] (a sharded layout) or
        grad_refs[0]; a list is every host's. Returns the calls and what
        gives the snapshots' refs once they are gathered (a re-issued call
        replaces its snapshot's ref). settle_applies then settles these
        calls, and tells these slices (`track_slices`)."""
        if isinstance(grad_refs, list):
            grad_refs = {0: grad_refs}
        out = issue_applies(k, live, grad_refs, takers, self.epoch)
        self._applies, self._taken = out.applies, out.taken  # a re-issue is the one settle_applies waits for
        self.track_slices(live)
        return out.calls, out.snaps

    def track_slices(self, live: Mapping) -> None:
        """The slices settle_applies tells to give up their waits, with
        their workers as now: those the last applies were issued on, or
        (a group leader, whose driver applies on some of them) its group."""
        self._workers = {s: list(sl.workers) for s, sl in live.items()}

    def forget_applies(self) -> None:
        """Let go of the last applies and their slices (an idle leader)."""
        self._applies, self._taken, self._workers = {}, {}, {}

    def applied(self, k: int, live: Mapping) -> Optional[StepResult]:
        """Step k's result on live slices found a step ahead after a loss:
        the metrics each host kept of its apply (its reply may have been
        cancelled), no snapshot. None if no host holds step k + 1."""
        keys = [(s, h) for s in sorted(live) for h in range(len(live[s].workers))]
        try:
            held = ray.get([live[s].workers[h].held_step.remote(True) for s, h in keys], timeout=30.0)
        except rex.RayError:
            return None
        metrics = {key: m for key, (step, m) in zip(keys, held) if step == k + 1 and m is not None}
        return StepResult(metrics, {}) if metrics else None

    def settle_applies(self, timeout_s: float, slices=None, abort_waits: bool = False,
                       watch: Optional[Callable[[set], Optional[SliceFailure]]] = None) -> None:
        """After a failure, settle the step's apply calls before the
        survivors say which step they hold (Membership.reconcile): those
        not started (waiting for an input, maybe on a frozen node) are
        cancelled (their takes, on a slice of several hosts: applies.py);
        those of `slices` (None: all) that run end (up to timeout_s): a
        survivor's apply may have had every input and complete the step
        after the failure. The lost slice's own are not waited for (on a
        lost node they answer once Ray declares it dead). With
        `abort_waits` (the lost node is gone or silent), first the
        survivors' calls waiting for an input give up: one on that node
        would arrive, as an error, only after Ray's pull timeout (10 s).
        After a process death its gradients, in its node's object store,
        still arrive and the survivors complete the step; only the calls
        issued ahead for later steps give up (they would hold the
        worker's threads, which the survivors' status calls need).
        `watch(slices still applying)`: a SliceFailure (raised here) for a
        host of theirs found lost or silent while they are waited for, else
        None (RayBackend: the step's heartbeats)."""
        applies, taken, self._applies, self._taken = self._applies, self._taken, {}, {}
        epoch, self.epoch = self.epoch, self.epoch + 1
        from_step = 0 if abort_waits else None if self.step is None else self.step + 1
        if from_step is not None:
            self.drop_ahead()  # what was issued ahead is told to give up: never run a step on it
        for s, workers in self._workers.items():
            if from_step is not None and (slices is None or s in slices):
                for w in workers:
                    w.abort_waits.options(concurrency_group="control").remote(epoch, from_step)
        for key, ref in applies.items():
            try:
                ray.cancel(taken.get(key, ref))
            except Exception:  # already done, or its actor gone
                pass
            self.unread.add(ref, (taken[key],) if key in taken else ())
        wanted = {ref: s for (s, _), ref in applies.items() if slices is None or s in slices}
        if wanted and watch is None:
            ray.wait(list(wanted), num_returns=len(wanted), timeout=timeout_s)
        elif wanted:
            lost = watched_wait(wanted, watch, self._clock, timeout_s)
            if lost is not None:
                raise lost

    def gather(self, issued: list, k: int, wait: Deadline, live: Mapping, finished: Optional[set] = None) -> dict:
        """Wait for every call; raise a SliceFailure on the first lost slice
        (StepAborted if `aborted` says so). A call whose error is transient
        (the worker still answers) is re-issued (`reissued` counts them).
        `finished` collects the (slice, host) calls that completed. Returns
        (slice, host) -> the call's reply."""
        pending = {c.ref: c for c in issued}
        try:
            out = {}
            while pending:
                remaining = wait.at - self._clock()
                if remaining <= 0:
                    candidates = [(c.slice_id, c.host) for c in pending.values()]
                    raise self.locator.hung(candidates, live, k, wait.seconds)
                refs = list(pending)
                done, _ = ray.wait(refs, num_returns=1, timeout=min(remaining, NODE_PROBE_S))
                if self.aborted():
                    raise StepAborted(k)
                if not done:  # a lost node, or a host that stopped answering its heartbeats
                    lost = self.locator.watch(live, {c.slice_id for c in pending.values()}, k)
                    if lost is not None:
                        raise lost
                    continue
                if len(refs) > 1:
                    # Then everything else that finishes within the poll, in
                    # one more wait: a wait's cost grows with the calls it looks
                    # at, and one per finished call made a phase O(slices^2)
                    # (at 1024 slices, 0.3 s of the driver's CPU per step).
                    remaining = max(0.0, wait.at - self._clock())
                    done, _ = ray.wait(refs, num_returns=len(refs), timeout=min(remaining, GATHER_POLL_S))
                try:  # one get for all of them; one by one only to sort an error
                    values = ray.get(done)
                except rex.RayError:
                    values = None
                for i, ref in enumerate(done):
                    c = pending.pop(ref)
                    s, h = c.slice_id, c.host
                    try:
                        out[(s, h)] = ray.get(ref) if values is None else values[i]
                        if finished is not None:
                            finished.add((s, h))
                    except rex.RayError as e:
                        peer = self.locator.peer_failure(e, live, s, h, k)
                        if peer is not None:
                            raise peer from None
                        kind = self.locator.classify_call(e, live, s, h)
                        if kind is TRANSIENT:
                            self._reissued += 1
                            again = dataclasses.replace(c, ref=c.reissue())
                            pending[again.ref] = again
                            continue
                        raise failure(kind, self.locator.blame(s, kind, live), h, k, short(e)) from None
            return out
        except BaseException:
            for c in pending.values():  # given up on with the step: read once done
                self.unread.add(c.ref, c.others())
            raise

    def _hand_off(self, k: int, live: Mapping, holder: dict, wait: Deadline, host: int = 0) -> list:
        """The refs the apply calls of host index `host` take (`holder`:
        shard -> the phase-1 payload holding it): the payloads themselves up
        to `fan_in` shards, else the top of the reduction tree over
        consecutive shards, reduced on the slices' workers of that host."""
        leaves = [Part(shard, [holder[shard]]) for shard in sorted(holder)]
        _, top = self.issue_tree(k, live, leaves, host, wait=wait)
        return refs_of(top)

    def issue_tree(self, k: int, live: Mapping, nodes: list, host: int = 0, built: int = 0,
                   depth: Optional[int] = None, wait: Optional[Deadline] = None) -> tuple[list, list]:
        """Levels of the reduction tree over `nodes` (Parts, in key order),
        on the live slices' workers of host index `host`: `depth` of them,
        or (None) as many as the tree needs (`deeper`), `built` levels being
        below `nodes` already. With `wait`, each level is gathered before
        the next is issued, on the re-issued calls' sums; else they are
        issued at once, as one graph. Returns the levels' Calls, level by
        level, and the top nodes."""
        levels: list = []
        while (len(levels) < depth) if depth is not None else deeper(len(nodes), built + len(levels), self.fan_in):
            issued, nodes = self.tree_level(k, live, nodes, host)
            if wait is not None:
                self.gather(issued, k, wait, live)
            levels.append(issued)
        return levels, nodes

    def tree_level(self, k: int, live: Mapping, nodes: list, host: int) -> tuple[list, list]:
        """One level of the reduction tree: a reduce call per `fan_in`
        consecutive nodes, round robin over the slices; returns the Calls
        and the level's nodes (a Part per call, holding its partial sum)."""
        reducers = sorted(live)
        fan = self.fan_in
        issued, parts = [], []
        for j in range(0, len(nodes), fan):
            group = nodes[j:j + fan]
            keys = tuple(p.key for p in group)
            refs = refs_of(group)
            s = reducers[(j // fan) % len(reducers)]
            part = Part(keys[0], [])

            def call(w=live[s].workers[host], keys=keys, refs=refs, part=part):
                status, partial = w.reduce.options(num_returns=2).remote(k, keys, list(refs), self.epoch)
                part.refs = [partial]
                return status

            issued.append(Call(s, host, call(), call))
            parts.append(part)
        return issued, parts

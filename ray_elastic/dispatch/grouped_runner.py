"""The data plane through group leaders: the driver's side.

With `slices_per_leader` set, the driver no longer calls every slice. The
shards are cut into ranges (`assignment.leader_ranges`), one per leader; the
live slices into as many groups (`assignment.leader_groups`), each computing its
own range. A steady step is one call per leader (dispatch/leader.py): the
driver sums the leaders' subtree tops of step k (the tree's last levels:
a few calls on the slices' workers, issued on refs), makes the
snapshotting slices' applies itself (so that it owns the snapshots), and
calls `step(k, sum)` on every leader, which applies it on its group and
issues step k+1's gradient phase behind the applies; its reply carries
step k+1's tops. Everything is issued ahead of need, as in the driver's
own pipelined dispatch: a step costs max(compute, the driver's work).

The tree has the shape the driver alone would build, so the sums are
bitwise the same. Failures keep their meaning. A leader answers with the
first failure of its group, sorted into the same closed set of kinds,
with its phase; they are ranked (a leader's gradient phase, then the
driver's own top of the tree, then an apply), because only an apply can
fail for want of an input from elsewhere. A slice lost in the gradient
phase carries a `partial`: `finish` has its group's survivors compute
its shards and keeps every other group's gradients, so no step is
redone. A leader whose process dies is replaced and its part made again
(every call is pure or idempotent): no slice is lost and no step redone.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Optional

import ray
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.dispatch.assignment import leader_groups
from ray_elastic.dispatch.calls import Deadline, refs_by_slice
from ray_elastic.dispatch.leader import GroupLeader
from ray_elastic.dispatch.replies import Applied, Failed, LeaderPhase, Ready, Reissued
from ray_elastic.dispatch.step_runner import PartialStep, StepResult, StepRunner, per_host
from ray_elastic.dispatch.tree import parts_of, tops_of
from ray_elastic.errors import ConfigError, FailureKind, RunFailed, SliceFailure
from ray_elastic.failures.internal import SumAgain
from ray_elastic.failures.location import FailureLocator

__all__ = ["GroupedRunner"]

log = logging.getLogger("ray_elastic")

# How long past a step's deadline a leader may take to answer: its own
# deadline ends its wait, so one that is later still is stuck itself.
LEADER_GRACE_S = 30.0
# Between two waits on the leaders' replies.
POLL_S = 1.0
# After a leader's death mid-step, how long to wait to see whether the
# driver's sum was made.
MADE_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class _Sent:
    """What a leader was last told: its slices (their LiveSlices) and ranges."""

    live: dict
    ranges: list


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """A step whose gradient phase every leader issued ahead."""

    step: int
    parts: list  # per group: slice -> its shards
    tops: dict  # leader -> its subtrees' tops


@dataclasses.dataclass(frozen=True, order=True)
class _Ranked:
    """A failure a round met, ranked for which one counts: a leader's
    gradient phase (0), the driver's own top of the tree (1), an apply
    (2), because only an apply can fail for want of an input from
    elsewhere; then in the order they came."""

    rank: int
    order: int
    failure: SliceFailure = dataclasses.field(compare=False)

    @classmethod
    def of(cls, reply: Failed, seen: list) -> "_Ranked":
        return cls(0 if reply.phase is LeaderPhase.GRADS else 2, len(seen), reply.failure)


@dataclasses.dataclass(frozen=True)
class _Lost:
    """A gradient phase that lost a slice, with its groups: `finish`
    completes it on them."""

    step: int
    groups: list


class GroupedRunner:
    """StepRunner's interface (run, finish, settle_applies, drop_ahead),
    through one GroupLeader per shard range."""

    def __init__(self, locator: FailureLocator, clock: Callable[[], float], ranges: list, depth: int,
                 fan_in: Optional[int] = None):
        # The driver's own calls: the top of the tree over the leaders' parts.
        self.top = StepRunner(locator, clock, fan_in, pipeline=False)
        self.fan_in = self.top.fan_in
        self.locator, self._clock = locator, clock
        self.ranges, self.depth = list(ranges), depth
        self.pipeline = True
        self.steps_ahead = 0  # steps whose gradient phase every leader had issued ahead
        self.leaders_replaced = 0
        # After a leader died mid-step: how its replacement took over.
        self.leader_restarts = {"applied_the_sum": 0, "issued_again": 0}
        self.shards_recomputed = 0  # by finish, over the run (the lost slices' shards)
        self._leaders: list = []
        self._sent: list = []  # per leader: a _Sent, or None
        self._call = 0  # one id per round of calls, for calling a round off
        self._epoch = 0  # StepRunner's epochs, counted here for every leader
        self._fresh = True  # the next collect issues anew (nothing issued ahead is used)
        self._failed: Optional[_Lost] = None
        self._next: Optional[_Ahead] = None

    @property
    def leaders(self) -> list:
        """The leader actors, one per group (for tests and benches)."""
        return list(self._leaders)

    # -- leaders ------------------------------------------------------------

    def _new_leader(self):
        here = ray.get_runtime_context().get_node_id()
        # Beside the driver: a leader holds no state, and on the head node
        # it is lost only with the driver.
        return GroupLeader.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote(self.fan_in)

    def _sync(self, groups: list, live: Mapping, deadline_s: float = 60.0) -> bool:
        """Tell each leader its slices and ranges, where they changed; a
        leader whose slices change first lets its issued calls end (no
        worker runs two gradient phases). Idle leaders let everything go.
        Whether anything changed."""
        while len(self._leaders) < len(groups):
            self._leaders.append(self._new_leader())
            self._sent.append(None)
        changed = []
        for g, (slices, ranges) in enumerate(groups):
            part = {s: live[s] for s in slices}
            sent = self._sent[g]
            if sent is None or sent.ranges != ranges or sent.live.keys() != part.keys() or any(
                    sent.live[s] is not part[s] for s in part):
                changed.append((g, part, ranges))
        idle = [g for g in range(len(groups), len(self._leaders)) if self._sent[g] is not None]
        if not changed and not idle:
            return False
        moving = {s for _, part, _ in changed for s in part}
        waits = [self._leaders[g].quiesce.remote(deadline_s) for g in range(len(groups))
                 if self._sent[g] is not None and set(self._sent[g].live) & moving]
        waits += [self._leaders[g].quiesce.remote(deadline_s, True) for g in idle]
        for g in idle:
            self._sent[g] = None
        try:
            ray.get(waits, timeout=deadline_s + 10)
        except rex.RayError:
            pass  # a leader lost: made again below, when it is used
        for g, part, ranges in changed:
            self._sent[g] = _Sent(part, ranges)
            try:
                ray.get(self._leaders[g].set_live.remote(part, ranges, self.depth), timeout=deadline_s + 60)
            except (rex.RayActorError, rex.WorkerCrashedError) as e:
                self._replace(g, e)
                return self._sync(groups, live, deadline_s) or True
            except rex.GetTimeoutError:
                raise RunFailed(f"group leader {g} did not take its slices within {deadline_s + 60:.0f} s",
                                setting="slices_per_leader") from None
        return True

    def _replace(self, g: int, cause: BaseException) -> None:
        log.warning("group leader %d lost (%s): starting another", g, type(cause).__name__)
        try:
            ray.kill(self._leaders[g], no_restart=True)
        except Exception:  # already gone
            pass
        self._leaders[g] = self._new_leader()
        self._sent[g] = None
        self.leaders_replaced += 1

    def _round(self, calls: dict, wait: Deadline, groups: list, live: Mapping, on_death: Callable,
               top_calls: Optional[list] = None, k: int = 0) -> dict:
        """Make calls[g] = (method, args) on each leader g; their replies
        by leader (Ready, Applied or Reissued: replies.py). A leader that
        dies is replaced and `on_death(g)` makes its call again (once).
        Failures are ranked (_Ranked); a leader's gradient phase calls the
        others off at once, and the driver's own top of the tree
        (`top_calls`) is looked at when an apply fails (it may have failed
        for want of the sum)."""
        self._call += 1
        call = self._call

        def submit(g: int):
            method, args = calls[g]
            return getattr(self._leaders[g], method).remote(call, self._epoch, *args)

        pending = {submit(g): g for g in calls}
        out: dict = {}
        failures: list = []  # _Ranked
        retried: set = set()
        off = []  # whether the round was called off
        again = False  # a leader re-issued its gradient phase: the sum is void, and so is what waited on it

        def call_off() -> None:
            if not off:
                off.append(True)
                for other in pending.values():
                    self._leaders[other].abort.remote(call)

        while pending:
            remaining = wait.at + LEADER_GRACE_S - self._clock()
            if remaining <= 0:
                raise RunFailed(f"group leaders {sorted(pending.values())} did not answer within "
                                f"{wait.seconds + LEADER_GRACE_S:.0f} s", setting="slices_per_leader")
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, POLL_S))
            for ref in done:
                g = pending.pop(ref)
                try:
                    reply = ray.get(ref)
                except (rex.RayActorError, rex.WorkerCrashedError) as e:
                    if g in retried:
                        raise RunFailed(f"group leader {g} died twice in one step: {e}",
                                        setting="slices_per_leader") from None
                    retried.add(g)
                    self._replace(g, e)
                    self._sync(groups, live)
                    try:
                        pending[on_death(g, submit)] = g
                    except SumAgain:
                        # End the round: what the others answer still
                        # counts if it is a failure of their own.
                        call_off()
                        self._drain(pending, failures, wait)
                        if any(x.rank == 0 for x in failures):
                            raise min(failures).failure from None
                        raise
                    continue
                except rex.RayTaskError as e:  # a leader's own error: a defect, not a slice's failure
                    raise RunFailed(f"group leader {g}: {e}", setting="slices_per_leader") from None
                if isinstance(reply, Failed):
                    grads = reply.phase is LeaderPhase.GRADS
                    failures.append(_Ranked.of(reply, failures))
                    if grads:
                        call_off()
                    elif not grads and top_calls and not again:
                        top = self._top_failure(top_calls, k, live)
                        if top is not None:
                            failures.append(_Ranked(1, len(failures), top))
                            call_off()
                        top_calls = None
                elif isinstance(reply, (Ready, Applied, Reissued)):
                    out[g] = reply
                    if isinstance(reply, Reissued) and not again:
                        again = True
                        call_off()  # their copies wait on a void sum
        if again:  # only a gradient phase's failure is a failure of its own
            failures = [x for x in failures if x.rank == 0]
        if failures:
            raise min(failures).failure
        if again:
            return {g: r for g, r in out.items() if isinstance(r, Reissued)}
        if len(out) != len(calls):  # called off with no failure seen: never apply a partial sum
            raise RunFailed(f"group leaders {sorted(set(calls) - set(out))} gave up a step that did not "
                            "fail", setting="slices_per_leader")
        return out

    def _drain(self, pending: dict, failures: list, wait: Deadline) -> None:
        """The replies of a round that was called off: its failures."""
        refs = list(pending)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, wait.at + LEADER_GRACE_S - self._clock()))
        for ref in done:
            try:
                reply = ray.get(ref)
            except rex.RayError:
                continue
            if isinstance(reply, Failed):
                failures.append(_Ranked.of(reply, failures))
        pending.clear()

    def _top_failure(self, top_calls: list, k: int, live: Mapping) -> Optional[SliceFailure]:
        """Whether the driver's own top of the tree failed (a reducer lost):
        looked at for up to a second, on every live slice's node."""
        try:
            self.top.gather(top_calls, k, Deadline.after(self._clock(), 1.0), live)
        except SliceFailure as f:
            return None if f.kind is FailureKind.HUNG else f  # still coming: not a failure of its own
        return None

    # -- steps ----------------------------------------------------------------

    def run(self, k: int, live: Mapping, assignment: Mapping, takers: frozenset, deadline_s: float,
            on_issued: Callable[[], None] = lambda: None, ahead: Optional[Mapping] = None) -> StepResult:
        wait = Deadline.after(self._clock(), deadline_s)
        if any(per_host(sl) for sl in live.values()):
            # Each host of a sharded slice sends its own blocks; a leader's
            # subtrees sum host 0's only.
            raise ConfigError("slices_per_leader", "group leaders take replicated layouts only; this program "
                              "shards its state over each slice's hosts: set slices_per_leader=0")
        groups = leader_groups(live, self.ranges)
        changed = self._sync(groups, live, deadline_s)
        parts = [{s: tuple(assignment[s]) for s in slices} for slices, _ in groups]
        nxt, self._next = self._next, None
        ran_ahead = not changed and not self._fresh and nxt is not None and nxt.step == k and nxt.parts == parts
        self._fresh = False
        try:
            if ran_ahead:
                tops = nxt.tops
            else:
                tops = self._begin_round(k, parts, wait, groups, live)
            on_issued()
            return self._step_round(k, live, groups, tops, takers, wait, ahead, ran_ahead,
                                    lambda g: self._ask_one(g, "begin", k, parts[g], wait.seconds))
        except SliceFailure as f:
            self._fresh = True
            survivors = next((len(slices) - 1 for slices, _ in groups if f.slice_id in slices), 0)
            if f.leader_partial and survivors:
                # Lost in the gradient phase, and its group has survivors to
                # compute its shards: every other gradient is kept (finish).
                self._failed = _Lost(k, groups)
                kept = PartialStep(k, dict(assignment), {s: None for s in live if s != f.slice_id})
                raise f.replace(partial=kept) from None
            raise

    def _begin_round(self, k: int, parts: list, wait: Deadline, groups: list, live: Mapping) -> dict:
        calls = {g: ("begin", (k, parts[g], wait.seconds)) for g in range(len(groups))}
        replies = self._round(calls, wait, groups, live, lambda g, submit: submit(g))
        return {g: r.tops for g, r in replies.items()}

    def _step_round(self, k: int, live: Mapping, groups: list, tops: dict, takers: frozenset, wait: Deadline,
                    ahead: Optional[Mapping], ran_ahead: bool, restart: Callable[[int], tuple]) -> StepResult:
        """Sum the leaders' `tops` and apply on every group; `restart(g)`
        issues a new leader's part of step k and gives its tops."""
        nxt_parts = None if ahead is None else [{s: tuple(ahead[s]) for s in slices} for slices, _ in groups]
        for _ in range(3):
            top, top_calls = self.issue_top(k, live, sorted((t for g in tops for t in tops[g]), key=lambda t: t.key))
            # The snapshotting slices' applies are the driver's own: it then
            # owns the snapshots, which outlive any leader.
            mine = {s: live[s] for s in takers}
            applies, snaps = self.top.issue_apply(k, mine, [t.ref for t in top], takers) if mine else ([], lambda: ({}, {}))
            by_slice = refs_by_slice(applies)

            def step_call(g: int, apply_only: bool = False):
                slices, _ = groups[g]
                return ("step", (k, top, {s: by_slice[s] for s in slices if s in by_slice},
                                 max(1.0, wait.at - self._clock()), None if nxt_parts is None else nxt_parts[g],
                                 apply_only))

            calls = {g: step_call(g) for g in range(len(groups))}

            def on_death(g: int, submit):
                if self._made(top_calls, wait):
                    # The sum was made (the driver owns it): the new leader
                    # applies it; slices that already did answer as before.
                    self.leader_restarts["applied_the_sum"] += 1
                    calls[g] = step_call(g, apply_only=True)
                    return submit(g)
                self.leader_restarts["issued_again"] += 1
                # It was not (the dead leader's tops died with it), so no
                # slice applied: the new leader issues its part of step k
                # again, and the sum is made again (the others answer again
                # as they did).
                tops[g] = restart(g)
                raise SumAgain()

            try:
                replies = self._round(calls, wait, groups, live, on_death, top_calls, k)
            except SumAgain:
                continue
            again = {g: r.tops for g, r in replies.items() if isinstance(r, Reissued)}
            if again:
                tops.update(again)
                continue
            metrics = self.top.gather(applies, k, wait, live) if applies else {}
            for r in replies.values():
                metrics.update(r.metrics)
            if ran_ahead:
                self.steps_ahead += 1
            if nxt_parts is not None and all(r.next_tops is not None for r in replies.values()):
                self._next = _Ahead(k + 1, nxt_parts, {g: r.next_tops for g, r in replies.items()})
            return StepResult(metrics, *snaps())
        raise RunFailed(f"step {k}: the sum over the group leaders was made 3 times without taking",
                        setting="slices_per_leader")

    def _made(self, top_calls: list, wait: Deadline) -> bool:
        """Whether the driver's top of the tree was made (its calls' small
        status replies, waited for up to MADE_WAIT_S). One still coming is
        taken as not made: the group is then issued again, which is safe
        while no slice could apply (no apply runs before the sum)."""
        refs = [c.ref for c in top_calls]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(MADE_WAIT_S, wait.at - self._clock())))
        try:
            ray.get(done)
        except rex.RayError:
            return False
        return len(done) == len(refs)

    def _ask_one(self, g: int, method: str, *args) -> tuple:
        """One leader's begin or finish, alone: its tops."""
        self._call += 1
        try:
            reply = ray.get(getattr(self._leaders[g], method).remote(self._call, self._epoch, *args), timeout=120)
        except rex.RayError as e:
            raise RunFailed(f"group leader {g}, started to replace a lost one, failed its {method}: {e}",
                            setting="slices_per_leader") from None
        return reply.tops

    def issue_top(self, k: int, live: Mapping, tops: list) -> tuple[tuple, list]:
        """The rest of the tree over the leaders' subtrees (`tops`, in key
        order), on the slices' workers, issued on refs: (its one top, as a
        tuple of one Top; its calls)."""
        r = self.top
        r.epoch = self._epoch
        levels, top = r.issue_tree(k, live, parts_of(tops), 0, built=self.depth)
        return tops_of(top), [c for level in levels for c in level]

    def finish(self, partial: PartialStep, live: Mapping, takers: frozenset, deadline_s: float) -> StepResult:
        """Complete a step whose gradient phase lost a slice: that slice's
        group's survivors compute its shards; the other leaders make their
        subtrees again over the gradients they kept. The step applies on
        the groups it ran on, less the lost slice."""
        if self._failed is None or self._failed.step != partial.step:
            raise RuntimeError(f"no gradient phase of step {partial.step} to finish")
        k, groups = self._failed.step, self._failed.groups
        self._failed = None
        wait = Deadline.after(self._clock(), deadline_s)
        groups = [([s for s in slices if s in live], ranges) for slices, ranges in groups]
        self._sync(groups, live, deadline_s)
        calls = {g: ("finish", (k, deadline_s)) for g in range(len(groups))}
        replies = self._round(calls, wait, groups, live, lambda g, submit: submit(g))
        tops = {g: r.tops for g, r in replies.items()}
        self.shards_recomputed += sum(r.shards_recomputed for r in replies.values())
        self._fresh = True
        return self._step_round(k, live, groups, tops, takers, wait, None, False,
                                lambda g: self._ask_one(g, "finish", k, deadline_s))

    def applied(self, k: int, live: Mapping) -> Optional[StepResult]:
        """Step k's result from the applies the driver made itself (the
        snapshotting slices'), as StepRunner.applied."""
        return self.top.applied(k, live)

    def settle_applies(self, timeout_s: float, slices=None, abort_waits: bool = False, watch=None) -> None:
        """After a failure, every leader settles its group's applies, and
        the driver its own (StepRunner.settle_applies); the next calls get
        a new epoch."""
        self._fresh, self._next = True, None
        which = None if slices is None else sorted(slices)
        refs = [(g, leader.settle.remote(self._epoch, timeout_s, which, abort_waits))
                for g, leader in enumerate(self._leaders)]
        self.top.epoch = self._epoch
        self.top.settle_applies(timeout_s, slices, abort_waits, watch)  # the leaders' own: their timeout
        self._epoch += 1
        for g, ref in refs:
            try:
                ray.get(ref, timeout=timeout_s + 10)
            except rex.GetTimeoutError:
                log.warning("group leader %d did not settle its applies within %.0f s", g, timeout_s)
            except rex.RayError as e:
                self._replace(g, e)

    def drop_ahead(self) -> None:
        self._fresh, self._next = True, None

    def close(self) -> None:
        for leader in self._leaders:
            try:
                ray.kill(leader, no_restart=True)
            except Exception:
                pass
        self._leaders, self._sent = [], []

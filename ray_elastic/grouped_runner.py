"""The data plane through group leaders: the driver's side.

With `slices_per_leader` set, the driver no longer calls every slice. The
shards are cut into ranges (`data.leader_ranges`), one per leader; the
live slices into as many groups (`data.leader_groups`), each computing its
own range. A step is two rounds of one call per leader (group_leader.py):

1. `collect`: each leader gathers its group's gradients and its subtrees of
   the reduction tree, and answers with their tops;
2. the driver sums the tops (the rest of the tree: a few calls, on the
   slices' workers), then `step`: each leader applies that sum on its
   group and issues the next step's gradient phase behind the applies.

The tree has the shape the driver alone would build, so the sums are
bitwise the same. Failures keep their meaning: a leader answers with the
first failure of its group, sorted by its own FailureLocator into the same
closed set of kinds, and the driver calls off the other leaders' calls and
raises it. A slice lost in the gradient phase carries a `partial`:
`finish` has its group's survivors compute its shards and keeps every
other gradient, so no step is redone. A leader whose process dies is
replaced and its call made again (every call is pure or idempotent):
no slice is lost and no step is redone.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Optional

import ray
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.data import leader_groups
from ray_elastic.errors import ConfigError, RunFailed, SliceFailure
from ray_elastic.failure_location import FailureLocator
from ray_elastic.group_leader import GroupLeader
from ray_elastic.step_runner import PartialStep, StepResult, StepRunner, _Deadline

__all__ = ["GroupedRunner"]

log = logging.getLogger("ray_elastic")

# How long past a step's deadline a leader may take to answer: its own
# deadline ends its wait, so one that is later still is stuck itself.
LEADER_GRACE_S = 30.0
# Between two waits on the leaders' replies.
POLL_S = 1.0


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
        self._leaders: list = []
        self._sent: list = []  # per leader: (its slices' LiveSlices, its ranges) as last sent, or None
        self._call = 0  # one id per round of calls, for calling a round off
        self._epoch = 0  # StepRunner's epochs, counted here for every leader
        self._fresh = True  # the next collect issues anew (nothing issued ahead is used)
        self._failed: Optional[tuple] = None  # (step, leader, its slices, its ranges, the step's assignment)

    # -- leaders ------------------------------------------------------------

    def _new_leader(self):
        here = ray.get_runtime_context().get_node_id()
        # Beside the driver: a leader holds no state, and on the head node
        # it is lost only with the driver.
        return GroupLeader.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote(self.fan_in)

    def _sync(self, groups: list, live: Mapping) -> None:
        """Tell each leader its slices and ranges, where they changed."""
        while len(self._leaders) < len(groups):
            self._leaders.append(self._new_leader())
            self._sent.append(None)
        refs = []
        for g, (slices, ranges) in enumerate(groups):
            part = {s: live[s] for s in slices}
            sent = self._sent[g]
            if sent is None or sent[1] != ranges or sent[0].keys() != part.keys() or any(
                    sent[0][s] is not part[s] for s in part):
                self._sent[g] = (part, ranges)
                refs.append((g, self._leaders[g].set_live.remote(part, ranges, self.depth)))
        for g, ref in refs:
            try:
                ray.get(ref, timeout=60)
            except rex.RayError as e:
                self._replace(g, e)
                self._sync(groups, live)

    def _replace(self, g: int, cause: BaseException) -> None:
        log.warning("group leader %d lost (%s): starting another", g, type(cause).__name__)
        try:
            ray.kill(self._leaders[g], no_restart=True)
        except Exception:  # already gone
            pass
        self._leaders[g] = self._new_leader()
        self._sent[g] = None
        self.leaders_replaced += 1

    def _round(self, calls: dict, wait: _Deadline, groups: list, live: Mapping,
               on_issued: Callable[[], None] = lambda: None) -> dict:
        """Make calls[g] = (method, args) on each leader g; their replies
        by leader. The first failure calls the rest off and is raised. A
        leader that dies is replaced and asked again, once."""
        self._call += 1
        call = self._call

        def submit(g: int):
            method, args = calls[g]
            return getattr(self._leaders[g], method).remote(call, self._epoch, *args)

        pending = {submit(g): g for g in calls}
        on_issued()
        out, failure, retried = {}, None, set()
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
                    pending[submit(g)] = g
                    continue
                if reply[0] == "failed" and failure is None:
                    failure = (g, reply)
                    for other in pending.values():  # end their waits: the step is over
                        self._leaders[other].abort.remote(call)
                elif reply[0] == "ok":
                    out[g] = reply
        if failure is not None:
            g, (_, f, attrs) = failure
            if attrs.get("node_silent"):
                f.node_silent = True
            f.leader_partial = attrs.get("partial", False)
            raise f
        return out

    # -- steps ----------------------------------------------------------------

    def run(self, k: int, live: Mapping, assignment: Mapping, takers: frozenset, deadline_s: float,
            on_issued: Callable[[], None] = lambda: None, ahead: Optional[Mapping] = None) -> StepResult:
        wait = _Deadline(self._clock() + deadline_s, deadline_s)
        if any(getattr(sl, "per_host", False) for sl in live.values()):
            # Each host of a sharded slice sends its own blocks; a leader's
            # subtrees sum host 0's only.
            raise ConfigError("slices_per_leader", "group leaders take replicated layouts only; this program "
                              "shards its state over each slice's hosts: set slices_per_leader=0")
        groups = leader_groups(live, self.ranges)
        self._sync(groups, live)
        fresh, self._fresh = self._fresh, False
        parts = [{s: tuple(assignment[s]) for s in slices} for slices, _ in groups]
        try:
            replies = self._round({g: ("collect", (k, parts[g], deadline_s, fresh)) for g in range(len(groups))},
                                  wait, groups, live, on_issued)
        except SliceFailure as f:
            self._fresh = True
            g = next(g for g, (slices, _) in enumerate(groups) if f.slice_id in slices)
            if getattr(f, "leader_partial", False) and len(groups[g][0]) > 1:
                # Lost in the gradient phase, and its group has survivors to
                # compute its shards: every other gradient is kept (finish).
                self._failed = (k, g, groups, dict(assignment))
                f.partial = PartialStep(k, dict(assignment), {s: None for s in live if s != f.slice_id})
            raise
        try:
            return self._apply(k, live, replies, takers, wait, ahead,
                               ran_ahead=all(r[2] for r in replies.values()))
        except SliceFailure:
            self._fresh = True
            raise

    def _apply(self, k: int, live: Mapping, replies: dict, takers: frozenset, wait: _Deadline,
               ahead: Optional[Mapping], ran_ahead: bool) -> StepResult:
        top = self._top(k, live, sorted(t for r in replies.values() for t in r[1]), wait)
        groups = leader_groups(live, self.ranges)
        self._sync(groups, live)
        calls = {}
        for g, (slices, _) in enumerate(groups):
            nxt = None if ahead is None else {s: tuple(ahead[s]) for s in slices}
            calls[g] = ("step", (k, top, frozenset(s for s in takers if s in slices), wait.seconds, nxt))
        replies = self._round(calls, wait, groups, live)
        if ran_ahead:
            self.steps_ahead += 1
        if ahead is None:
            self._fresh = True
        metrics, snaps = {}, {}
        for r in replies.values():
            metrics.update(r[1])
            snaps.update(r[2])
        return StepResult(metrics, snaps)

    def _top(self, k: int, live: Mapping, tops: list, wait: _Deadline) -> list:
        """The rest of the tree over the leaders' subtrees, on the slices'
        workers, gathered level by level: [(key, ref)] of its one top."""
        r = self.top
        r._epoch = self._epoch
        nodes, built = [(key, [ref]) for key, ref in tops], self.depth
        while r._deeper(nodes, built):
            built += 1
            issued, boxes = r._tree_level(k, live, nodes, 0)
            r._gather(issued, k, wait, live)
            nodes = [(key, [box[0]]) for key, box in boxes]
        return [(key, refs[0]) for key, refs in nodes]

    def finish(self, partial: PartialStep, live: Mapping, takers: frozenset, deadline_s: float) -> StepResult:
        """Complete a step whose gradient phase lost a slice: that slice's
        group's survivors compute its shards; the other leaders' parts, kept
        by them, are collected as they were."""
        if self._failed is None or self._failed[0] != partial.step:
            raise RuntimeError(f"no gradient phase of step {partial.step} to finish")
        k, failed, groups, assignment = self._failed
        self._failed = None
        wait = _Deadline(self._clock() + deadline_s, deadline_s)
        step_groups = [([s for s in slices if s in live], ranges) for slices, ranges in groups]
        self._sync(step_groups, live)
        calls = {g: ("finish", (k, deadline_s)) if g == failed else
                 ("collect", (k, {s: tuple(assignment[s]) for s in slices}, deadline_s, False))
                 for g, (slices, _) in enumerate(step_groups)}
        replies = self._round(calls, wait, step_groups, live)
        return self._apply(k, live, replies, takers, wait, None, ran_ahead=False)

    def settle_applies(self, timeout_s: float, slices=None, abort_waits: bool = False) -> None:
        """After a failure, every leader settles its group's applies
        (StepRunner.settle_applies); the next calls get a new epoch."""
        self._fresh = True
        refs = [(g, leader.settle.remote(self._epoch, timeout_s, None if slices is None else sorted(slices),
                                         abort_waits)) for g, leader in enumerate(self._leaders)]
        self._epoch += 1
        for g, ref in refs:
            try:
                ray.get(ref, timeout=timeout_s + 10)
            except rex.GetTimeoutError:
                log.warning("group leader %d did not settle its applies within %.0f s", g, timeout_s)
            except rex.RayError as e:
                self._replace(g, e)

    def drop_ahead(self) -> None:
        self._fresh = True

    def close(self) -> None:
        for leader in self._leaders:
            try:
                ray.kill(leader, no_restart=True)
            except Exception:
                pass
        self._leaders, self._sent = [], []

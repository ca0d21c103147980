"""A group leader: the calls of one group of slices, made for the driver.

At hundreds of slices the driver's own calls are the step's bottleneck:
each call costs the calling process about half a millisecond of CPU in
Ray, and a step makes two per slice plus the reduction tree (at 1024
slices, 1.4 s of the driver's CPU per step; `python -m bench scale
--floor`). With `slices_per_leader`, one leader per shard range makes its
group's calls with a `StepRunner` of its own, and the driver makes about
one call per leader per step (dispatch/grouped_runner.py has the driver's side):

- `step(k, top)`: the group's applies of step k, each taking a
  leader-owned copy of `top` (the driver's sum of every group's subtrees:
  its object is fetched once per leader, not once per slice), then step
  k+1's gradient calls behind them and the group's subtrees over them
  (whole subtrees of the reduction tree, `assignment.leader_ranges`), all issued
  at once as in the driver's pipelined dispatch, so nothing waits on the
  leader or the driver between a step's gradients and its applies. Then
  it gathers step k's gradients and subtrees (the "grads" phase), then
  the copy and the applies (the "apply" phase), and answers with the
  applies' metrics and the refs of step k+1's subtree tops, for the
  driver to sum while the slices compute.
- `begin(k)`: the gradient calls and subtrees of a step nothing issued
  ahead (the first, or after a change of slices), answered at once.
- `finish(k)`: after a slice failed in a step's gradient phase, the
  group's survivors compute its shards (the lost slice's group), or the
  subtrees are made again over the gradients kept (the other groups: a
  lost node's `abort_waits` may have ended them).

Its answers are the small dataclasses of replies.py. The leader sorts
its group's failures as the driver would (its own FailureLocator) and
answers with them and their phase. Its own gradient phase depends on
nothing outside its group, so a "grads" failure is a real one; an
"apply" failure may only echo a failure elsewhere (the driver's sum
never came), and the driver ranks them so. A call the driver calls off
(`abort`) ends at its next wait and keeps what it issued. The leader
holds no training state and owns no snapshot (the driver makes the
snapshotting slices' applies itself): if its process dies, the driver
starts another that takes over the group.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Mapping, Optional

import ray

from ray_elastic.dispatch.assignment import spread_shards
from ray_elastic.dispatch.calls import Deadline, Issued, refs_by_slice
from ray_elastic.dispatch.replies import Applied, CalledOff, Failed, LeaderPhase, LeaderReply, Ready, Reissued
from ray_elastic.dispatch.step_runner import PartialStep, StepRunner
from ray_elastic.dispatch.tree import Part, gates, holders, parts_of, refs_of, tops_of
from ray_elastic.errors import SliceFailure
from ray_elastic.failures.internal import StepAborted
from ray_elastic.failures.location import FailureLocator, RayProbe

__all__ = ["GroupLeader", "issue_subtrees"]


def issue_subtrees(runner: StepRunner, k: int, live: Mapping, assignment: Mapping, ranges: list, depth: int,
                   after: Optional[dict] = None) -> Issued:
    """Step k's gradient calls on `live` and `depth` levels of the reduction
    tree over each of `ranges` (replicated layouts: host 0 sends), issued
    as one graph; `tops[0]` lists the subtrees' top Parts, in shard order."""
    grads, payloads = runner.issue_grads(k, live, assignment, after)
    riders = [r for s in sorted(payloads) for r in gates(payloads, assignment, s, 0, 1)]
    levels, tops = _subtrees(runner, k, live, holders(assignment, payloads, 0), riders, ranges, depth)
    return Issued(k, dict(live), dict(assignment), grads, payloads, levels, {0: tops})


def _subtrees(runner: StepRunner, k: int, live: Mapping, holder: dict, riders: list, ranges: list,
              depth: int) -> tuple[list, list]:
    """`depth` levels of the tree over each range (`holder`: shard -> the
    payload holding it); `riders` (gates: payloads that hold no shard)
    ride along with the first leaf, so every apply waits for every
    gradient call. Returns the levels' calls (every range's level i in
    levels[i]) and the subtrees' top Parts."""
    levels: list = [[] for _ in range(depth)]
    tops: list = []
    for i, (lo, hi) in enumerate(ranges):
        leaves = [Part(shard, [holder[shard]] + (riders if i == 0 and shard == lo else [])) for shard in range(lo, hi)]
        built, top = runner.issue_tree(k, live, leaves, 0, depth=depth)
        for level, issued in zip(levels, built):
            level.extend(issued)
        tops += top
    return levels, tops


@dataclasses.dataclass(frozen=True)
class _Answered:
    """The last step applied, and the answer given (a step asked again
    gets it again)."""

    epoch: int
    step: int
    reply: Applied


@ray.remote(num_cpus=0, max_concurrency=4)
class GroupLeader:
    def __init__(self, fan_in: int):
        self.runner = StepRunner(FailureLocator(RayProbe(), time.monotonic, time.sleep), time.monotonic,
                                 fan_in=fan_in, pipeline=True)
        self.live: dict = {}  # slice -> LiveSlice, this group's
        self._ranges: list = []
        self._depth = 1
        # One call at a time touches the runner (a settle the driver gave up
        # on may still run when the next call comes); `abort` never waits.
        self._lock = threading.Lock()
        self._abort_lock = threading.Lock()
        self._call = 0  # id of the call under way
        self._called_off: set = set()
        self.runner.aborted = self._is_called_off
        self._epoch_seen = 0
        self._kept: Optional[Issued] = None  # the gradient phase of the step to apply next
        self._from_finish = False  # _kept was made by finish: a second loss in it has no partial
        self._partial: Optional[PartialStep] = None  # the last gradient phase that lost a slice
        self._done: Optional[_Answered] = None
        # finish's shard -> payload, read anew after a re-issue (None: not from finish)
        self._holder: Optional[Callable[[], dict]] = None

    def ping(self) -> int:
        import os

        return os.getpid()

    def cpu_s(self) -> float:
        """This process's CPU time so far (what a leader costs its host)."""
        return time.process_time()

    def abort(self, call: int) -> None:
        with self._abort_lock:
            self._called_off.add(call)

    def _is_called_off(self) -> bool:
        with self._abort_lock:
            return self._call in self._called_off

    def _begin(self, call: int, epoch: int, k: int) -> None:
        with self._abort_lock:
            self._call = call
            self._called_off = {c for c in self._called_off if c >= call}
        self._epoch_seen = max(self._epoch_seen, epoch)
        self.runner.epoch = epoch  # the driver's: one count for every leader, new ones too
        self.runner.step = k
        if self._partial is not None and self._partial.step != k:
            self._partial = None  # its step is over: let its gradients go

    def set_live(self, live: dict, ranges: list, depth: int) -> None:
        with self._lock:
            self.live, self._ranges, self._depth = dict(live), list(ranges), depth

    def quiesce(self, deadline_s: float, forget: bool = False) -> None:
        """Drop what was issued and wait (up to deadline_s) for its gradient
        calls to end: before the group's slices change, so that no worker
        runs two gradient phases, this leader's and its next one's.
        `forget`: this leader is idle now; let go of everything."""
        with self._lock:
            r = self.runner
            r.drop(self._kept)
            self._kept, self._done = None, None
            r.drop_ahead()
            r.settle_dropped(Deadline.after(time.monotonic(), deadline_s), self.live)
            if forget:
                self._partial, self._done = None, None
                r.forget_applies()

    def begin(self, call: int, epoch: int, k: int, assignment: dict, deadline_s: float) -> Ready:
        """Step k's gradient calls and subtrees, issued (nothing gathered):
        answers their tops."""
        with self._lock:
            self._begin(call, epoch, k)
            r = self.runner
            r.drop(self._kept)
            self._kept, self._partial, self._done, self._holder = None, None, None, None
            r.drop_ahead()
            r.settle_dropped(Deadline.after(time.monotonic(), deadline_s), self.live)
            self._kept = issue_subtrees(r, k, self.live, assignment, self._ranges, self._depth)
            self._from_finish = False
            return Ready(tops_of(self._kept.tops[0]))

    def step(self, call: int, epoch: int, k: int, top: tuple, driver_applies: dict, deadline_s: float,
             ahead: Optional[dict], apply_only: bool = False) -> LeaderReply:
        """Step k's applies on the group's slices but those the driver
        applies itself (`driver_applies`: slice -> its hosts' apply refs),
        each taking a copy of `top` (the driver's sum: one tree.Top); with
        `ahead`, step k+1's gradients and subtrees behind them. Answers
        Applied (with step k+1's tops, or None), Reissued when a gradient
        or subtree call was re-issued and the driver must sum again,
        CalledOff, or Failed."""
        with self._lock:
            self._begin(call, epoch, k)
            if self._done is not None and (self._done.epoch, self._done.step) == (epoch, k):
                return self._done.reply  # asked again (another leader was replaced): applies are idempotent
            pre = Issued(k, dict(self.live), {}, [], {}, [], {0: []}) if apply_only else self._kept
            if pre is None or pre.step != k:
                raise RuntimeError(f"no gradient phase of step {k} was issued on this leader")
            return self._step(k, pre, top, driver_applies, Deadline.after(time.monotonic(), deadline_s), ahead)

    def _step(self, k: int, pre: Issued, top: tuple, driver_applies: dict, wait: Deadline, ahead) -> LeaderReply:
        r, live = self.runner, self.live
        first = min(live)
        copy, copies = r.tree_level(k, {first: live[first]}, parts_of(top), 0)
        mine = {s: sl for s, sl in live.items() if s not in driver_applies}
        applies, _ = r.issue_apply(k, mine, refs_of(copies), frozenset()) if mine else ([], None)
        r.track_slices(live)  # settle_applies tells them all
        nxt = None
        if ahead is not None:
            nxt = issue_subtrees(r, k + 1, live, ahead, self._ranges, self._depth,
                                 refs_by_slice(applies, start=driver_applies))
        phase, since = LeaderPhase.GRADS, r.reissued
        try:
            if self._from_finish:
                r.gather(pre.grads, k, wait, live)  # as the driver's finish: a second loss redoes the step
            else:
                r.gather_grads(pre.grads, pre.payloads, k, live, pre.assignment, wait)
            if not r.gather_levels(pre.levels, k, wait, live, since):
                # A re-issued call's dependents hold its void ref (the
                # driver's sum too): make the subtrees again over the
                # gradients, which are all in, and let the driver sum again.
                holder = self._holder() if self._from_finish else holders(pre.assignment, pre.payloads, 0)
                levels, tops = _subtrees(r, k, live, holder, [], self._ranges, self._depth)
                for level in levels:
                    r.gather(level, k, wait, live)
                self._kept = Issued(k, dict(live), pre.assignment, [], pre.payloads, [], {0: tops})
                r.drop(nxt)
                return Reissued(tops_of(tops))
            phase, since = LeaderPhase.APPLY, r.reissued
            r.gather(copy, k, wait, live)
            if r.reissued != since:
                # The applies hold the first copy's void ref: issue them
                # again on the new one (idempotent where one did apply).
                applies, _ = r.issue_apply(k, mine, refs_of(copies), frozenset()) if mine else ([], None)
                r.track_slices(live)
            metrics = r.gather(applies, k, wait, live)
            if r.reissued != since:
                # The next step's calls wait on a first try: void. The
                # driver issues that step anew (no tops for it).
                r.drop(nxt)
                nxt = None
        except StepAborted:
            r.drop(nxt)
            return CalledOff()
        except SliceFailure as f:
            r.drop(nxt)
            if phase is LeaderPhase.GRADS and not self._from_finish:
                self._kept = None
                self._partial = f.partial
            # The partial's gradients and calls stay here, for finish: the
            # driver learns only that they are kept.
            return Failed(f.replace(partial=None, leader_partial=f.partial is not None), phase)
        self._kept, self._from_finish, self._partial, self._holder = nxt, False, None, None
        reply = Applied(metrics, None if nxt is None else tops_of(nxt.tops[0]))
        self._done = _Answered(r.epoch, k, reply)
        return reply

    def finish(self, call: int, epoch: int, k: int, deadline_s: float) -> Ready:
        """After a slice failed in step k's gradient phase: this group's
        part of it, issued again. The lost slice's group: its survivors
        (`set_live` since) compute its shards, spread over them in order,
        and the others' gradients are kept. Another group: the subtrees are
        made again over its gradients (a lost node's `abort_waits` may have
        ended the first ones). A leader started since: its range, computed
        anew. Answers the tops, like begin, and how many shards it
        computed again."""
        with self._lock:
            self._begin(call, epoch, k)
            r, live = self.runner, self.live
            wait = Deadline.after(time.monotonic(), deadline_s)
            shards = [shard for lo, hi in self._ranges for shard in range(lo, hi)]
            pre, partial = self._kept, self._partial
            if partial is not None and partial.step == k:
                kept, pending, owned = ({s: p for s, p in partial.payloads.items() if s in live}, partial.pending,
                                        partial.assignment)
            elif pre is not None and pre.step == k and pre.live.keys() == live.keys():
                kept, pending, owned = pre.payloads, pre.grads, pre.assignment
            else:
                kept, pending, owned = {}, [], {}
            held = holders(owned, kept)
            r.drop_ahead()
            r.settle_dropped(wait, live)
            missing = [shard for shard in shards if shard not in held]
            extra = spread_shards(missing, live)
            issued, payloads = r.issue_grads(k, live, extra)

            def holder() -> dict:  # read anew after a re-issue, which replaces a payload's ref
                return {**holders(owned, kept, 0), **holders(extra, payloads, 0)}

            self._holder = holder
            levels, tops = _subtrees(r, k, live, holder(), [], self._ranges, self._depth)
            grads = [c for c in pending if c.slice_id in live] + issued
            self._kept = Issued(k, dict(live), {}, grads, {}, levels, {0: tops})
            self._from_finish, self._partial = True, None
            return Ready(tops_of(tops), shards_recomputed=len(missing))

    def settle(self, epoch: int, timeout_s: float, slices: Optional[list], abort_waits: bool) -> None:
        """After a failure: StepRunner.settle_applies on this group's calls.
        One the driver stopped waiting for, overtaken by later calls, does
        nothing."""
        with self._lock:
            if epoch < self._epoch_seen:
                return
            self._epoch_seen = epoch
            self.runner.epoch = epoch
            self._done = None
            self.runner.settle_applies(timeout_s, None if slices is None else set(slices), abort_waits)

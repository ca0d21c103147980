"""A group leader: the calls of one group of slices, made for the driver.

At hundreds of slices the driver's own calls are the step's bottleneck:
each call costs the calling process about half a millisecond of CPU in
Ray, and a step makes two per slice plus the reduction tree (at 1024
slices, 1.4 s of the driver's CPU per step; `python -m bench scale
--floor`). With `slices_per_leader`, the driver makes two calls per
leader per step instead, and each leader runs a `StepRunner` over its
own group (grouped_runner.py has the driver's side):

- `collect(k)`: the group's gradient calls for step k (unless they were
  issued ahead by the last `step` call) and its part of the reduction
  tree (whole subtrees over its shard ranges, `data.leader_ranges`),
  gathered; answers with the refs of its subtrees' tops.
- `step(k, top)`: once the driver has summed every group's tops, the
  group's applies (each takes one leader-owned copy of the driver's sum,
  so the driver's object is fetched once per leader, not once per
  slice), then step k+1's gradient calls and subtrees behind them, issued
  ahead; answers with the applies' metrics and snapshots.
- `finish(k)`: after a slice of this group failed in the gradient phase,
  its survivors compute its shards; the other gradients are kept.

The leader sorts its group's failures as the driver would (its own
FailureLocator) and answers with them; nothing it waits on depends on
another group, so the first failure a leader reports is a real one. A
call the driver calls off (`abort`) ends at its next wait and keeps what
it issued. The leader lives beside the driver and holds no training
state: if its process dies, the driver starts another that takes over the
group (calls are pure or idempotent).
"""

from __future__ import annotations

import time
from typing import Mapping, Optional

import ray

from ray_elastic.errors import SliceFailure, StepAborted
from ray_elastic.failure_location import FailureLocator, RayProbe
from ray_elastic.step_runner import PartialStep, StepRunner, _Deadline, _Issued

__all__ = ["GroupLeader", "issue_subtrees"]


def issue_subtrees(runner: StepRunner, k: int, live: Mapping, assignment: Mapping, ranges: list, depth: int,
                   after: Optional[dict] = None) -> _Issued:
    """Step k's gradient calls on `live` and `depth` levels of the reduction
    tree over each of `ranges` (replicated layouts: host 0 sends), issued
    as one graph; `tops[0]` lists (key, box of its ref) of the subtrees'
    tops, in shard order."""
    grads, payloads = runner._issue_grads(k, live, assignment, after)
    holder = {shard: payloads[s][0] for s, shards in assignment.items() if s in payloads for shard in shards}
    gates = [r for s in sorted(payloads) for h, r in sorted(payloads[s].items()) if h > 0 or not assignment.get(s)]
    levels, tops = _subtrees(runner, k, live, holder, gates, ranges, depth)
    return _Issued(k, dict(live), dict(assignment), grads, payloads, levels, {0: tops})


def _subtrees(runner: StepRunner, k: int, live: Mapping, holder: dict, gates: list, ranges: list,
              depth: int) -> tuple[list, list]:
    """`depth` levels of the tree over each range (`holder`: shard -> the
    payload holding it); `gates` (payloads that hold no shard: hosts that
    send nothing, slices without shards) ride along with the first leaf,
    so every apply waits for every gradient call. Returns the levels'
    calls and (key, box) of each subtree's top."""
    levels: list = [[] for _ in range(depth)]
    tops: list = []
    for i, (lo, hi) in enumerate(ranges):
        nodes = [(shard, [holder[shard]] + (gates if i == 0 and shard == lo else [])) for shard in range(lo, hi)]
        for level in range(depth):
            issued, boxes = runner._tree_level(k, live, nodes, 0)
            levels[level] += issued
            nodes = [(key, [box[0]]) for key, box in boxes]
        tops += boxes
    return levels, tops


@ray.remote(num_cpus=0, max_concurrency=4)
class GroupLeader:
    def __init__(self, fan_in: int):
        self.runner = StepRunner(FailureLocator(RayProbe(), time.monotonic, time.sleep), time.monotonic,
                                 fan_in=fan_in, pipeline=True)
        self.live: dict = {}  # slice -> LiveSlice, this group's
        self._call = 0  # id of the call under way
        self._called_off: set = set()
        self.runner.aborted = lambda: self._call in self._called_off
        self._partial: Optional[PartialStep] = None  # the last gradient phase that lost a slice
        self._kept: Optional[_Issued] = None  # the gradient phase collect last took on
        self._ranges: list = []
        self._depth = 1

    def ping(self) -> int:
        import os

        return os.getpid()

    def cpu_s(self) -> float:
        """This process's CPU time so far (what a leader costs its host)."""
        return time.process_time()

    def set_live(self, live: dict, ranges: list, depth: int) -> None:
        self.live, self._ranges, self._depth = dict(live), list(ranges), depth

    def abort(self, call: int) -> None:
        self._called_off.add(call)

    def _begin(self, call: int, epoch: int, k: int) -> None:
        self._call = call
        self._called_off = {c for c in self._called_off if c >= call}
        self.runner._epoch = epoch  # the driver's: one count for every leader, new ones too
        self.runner._step = k

    def collect(self, call: int, epoch: int, k: int, assignment: dict, deadline_s: float, fresh: bool = False):
        """Step k's gradients and subtrees, gathered. Answers ("ok", tops,
        issued_ahead), ("aborted",) or ("failed", failure, attrs)."""
        self._begin(call, epoch, k)
        wait = _Deadline(time.monotonic() + deadline_s, deadline_s)
        r = self.runner
        ahead = r._ahead
        pre = next((c for c in (self._kept, ahead) if c is not None and not fresh
                    and c.serves(k, self.live, assignment)), None)
        if pre is None:
            for stale in (self._kept, ahead):
                if stale is not None:
                    r._dropped += [(s, ref) for s, _, ref, _ in stale.grads]
            r._ahead = None
            r._settle(wait, self.live)
            pre = issue_subtrees(r, k, self.live, assignment, self._ranges, self._depth)
        # Kept apart from what is issued ahead, which settle_applies drops
        # after a failure: when another group failed in this gradient phase
        # (the driver then calls this one off), finish collects it again.
        self._kept, r._ahead = pre, None
        try:
            return ("ok", self._gather_tree(pre, k, assignment, wait), pre is ahead)
        except StepAborted:
            return ("aborted",)
        except SliceFailure as f:
            self._kept, r._ahead = None, pre
            r.drop_ahead()  # the survivors' calls run on: finish waits for them
            self._partial = getattr(f, "partial", None)
            return _failed(f)

    def _gather_tree(self, pre: _Issued, k: int, assignment: dict, wait: _Deadline) -> list:
        r = self.runner
        reissued = r._reissued
        r._gather_grads(pre.grads, pre.payloads, k, self.live, assignment, wait)
        for level in pre.levels:
            if r._reissued != reissued:
                break
            r._gather(level, k, wait, self.live)
        tops = pre.tops[0]
        if r._reissued != reissued:
            # A re-issued call's dependents hold its void ref: build the
            # subtrees again from the payloads, which are all in.
            holder = {shard: pre.payloads[s][0] for s, shards in assignment.items() for shard in shards}
            levels, tops = _subtrees(r, k, self.live, holder, [], self._ranges, self._depth)
            for level in levels:
                r._gather(level, k, wait, self.live)
        return [(key, box[0]) for key, box in tops]

    def step(self, call: int, epoch: int, k: int, top: list, takers: frozenset, deadline_s: float,
             ahead: Optional[dict]):
        """Step k's applies, each taking a copy of the driver's sum
        (`top`: [(key, ref)]), and with `ahead` step k+1's gradients and
        subtrees issued behind them. Answers ("ok", metrics, snapshots) or
        a failure, as collect."""
        self._begin(call, epoch, k)
        wait = _Deadline(time.monotonic() + deadline_s, deadline_s)
        r = self.runner
        # Every group's gradient phase is in: let its payloads go (held,
        # they would double the gradients' memory in the object store).
        r._ahead, self._kept = None, None
        first = min(self.live)
        try:
            copy_calls, boxes = r._tree_level(k, {first: self.live[first]}, [(key, [ref]) for key, ref in top], 0)
            applies, snaps = r._issue_apply(k, self.live, [boxes[0][1][0]], takers)
            if ahead is not None:
                after: dict = {}
                for s, _, ref, _ in applies:
                    after.setdefault(s, []).append(ref)
                r._ahead = issue_subtrees(r, k + 1, self.live, ahead, self._ranges, self._depth, after)
            reissued = r._reissued
            r._gather(copy_calls, k, wait, self.live)
            if r._reissued != reissued:  # the applies hold the first copy's void ref
                r.drop_ahead()
                applies, snaps = r._issue_apply(k, self.live, [boxes[0][1][0]], takers)
            metrics = r._gather(applies, k, wait, self.live)
            if r._reissued != reissued:
                r.drop_ahead()  # issued after an apply call that was re-issued
            return ("ok", metrics, snaps())
        except StepAborted:
            r.drop_ahead()
            return ("aborted",)
        except SliceFailure as f:
            r.drop_ahead()
            return _failed(f)

    def finish(self, call: int, epoch: int, k: int, deadline_s: float):
        """Complete step k's gradient phase after this group lost a slice in
        it (`collect` answered with the failure): the group's survivors
        (`set_live` since) compute the lost slice's shards, spread over
        them in order; the others' gradients are kept. Answers as collect."""
        self._begin(call, epoch, k)
        wait = _Deadline(time.monotonic() + deadline_s, deadline_s)
        r, partial = self.runner, self._partial
        if partial is None or partial.step != k:
            raise RuntimeError(f"no gradient phase of step {k} to finish")
        r.drop_ahead()
        r._settle(wait, self.live)
        kept = {s: p for s, p in partial.payloads.items() if s in self.live}
        missing = sorted(shard for s, shards in partial.assignment.items() if s not in kept for shard in shards)
        order = sorted(self.live)
        extra = {s: tuple(missing[i::len(order)]) for i, s in enumerate(order) if missing[i::len(order)]}
        try:
            issued, payloads = r._issue_grads(k, self.live, extra)
            r._gather([c for c in partial.pending if c[0] in kept] + issued, k, wait, self.live)
            # Each shard's leaf takes the payload that holds it: a
            # survivor's own, or the one it computed for the lost slice.
            holder = {shard: kept[s][0] for s, shards in partial.assignment.items() if s in kept for shard in shards}
            holder.update({shard: payloads[s][0] for s, shards in extra.items() for shard in shards})
            levels, tops = _subtrees(r, k, self.live, holder, [], self._ranges, self._depth)
            for level in levels:
                r._gather(level, k, wait, self.live)
            self._partial = None
            return ("ok", [(key, box[0]) for key, box in tops], False)
        except StepAborted:
            return ("aborted",)
        except SliceFailure as f:
            self._partial = None
            return _failed(f)

    def settle(self, epoch: int, timeout_s: float, slices: Optional[list], abort_waits: bool) -> None:
        """After a failure: StepRunner.settle_applies on this group's calls."""
        self.runner._epoch = epoch
        self.runner.settle_applies(timeout_s, None if slices is None else set(slices), abort_waits)

    def drop(self) -> None:
        self.runner.drop_ahead()


def _failed(f: SliceFailure) -> tuple:
    # An exception pickles its constructor's arguments only: the rest rides apart.
    return ("failed", f, {"node_silent": bool(getattr(f, "node_silent", False)),
                          "partial": getattr(f, "partial", None) is not None})

"""What the driver's calls alone cost per step at scale: the floor under
any controller that makes per-slice calls from one driver.

No controller and no fakes' bookkeeping: the driver issues each step's
calls in a fixed pattern on two actors that play every slice's worker
(`_Sim`: a slice computes one step at a time, `step_s` long; reductions
and applies wait for their inputs, fetched for real as a worker fetches
them, and do nothing else), pipelined one step ahead, and reads every
reply (as a controller must, to see a failure). Per pattern and slice
count: the mean step time after warm-up, the driver's CPU per step (all
its threads, Ray's included: submitting, answering the workers' fetches of
refs it owns, taking replies) and the simulated workers' CPU per step.

The driver's CPU is the figure that carries over to a real cluster. The
step time does only while the machine has cores to spare: here the
simulated workers' side (on a real cluster spread over the slices' hosts)
runs on the driver's 2 cores, and their queues add latency to the
reduction tree.

Patterns (n slices, a reduction tree of fan-in 8 down to one sum):
- `today`: the controller's pipelined dispatch (step_runner): per slice an
  apply call (the tree's top in a list) and the next step's gradient call
  issued after it (the apply's reply as its argument): 2 calls per slice.
- `folded`: per slice one call that applies step k and computes step
  k+1's gradients, issued ahead but gated on a ref the driver's gate actor
  resolves once it has seen step k - 1 applied everywhere (so no apply runs
  before the driver has seen the step before it): 1 call per slice, and a
  round trip through the driver on every step's critical path.
- `bare`: per slice one call with no ref argument and no tree: what one
  call per slice and step costs, whatever it does.
- `grouped`: today's calls, made by group leaders (`_Leader`, one actor
  per GROUP slices) instead of the driver. Per step the driver makes one
  call per leader and the top of the tree over the groups' sums; each
  leader issues its group's applies, the next step's gradient calls after
  them and its group's part of the tree, owns their refs, reads every
  reply and answers with its group's next sum. The driver's CPU is then
  that of GROUP slices' calls whatever the slice count, and the leaders'
  (reported apart) spreads over the hosts they run on; here they share
  the driver's 2 cores, so the step time does not carry over.

    python -m bench scale --floor --sizes 256,1024
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Sequence

PATTERNS = ("today", "folded", "bare", "grouped")
FAN_IN = 8
GROUP = 32  # slices per leader in `grouped`: 1024 slices, 32 leaders


def _actors():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=100000)
    class _Sim:
        """Many slices' workers: slice i computes one step at a time (its
        compute starts once its inputs are in and its previous one is
        over); reductions and applies wait for their inputs, no more."""

        def __init__(self):
            self.free: dict = {}  # slice -> when its last compute ends

        async def _compute(self, i, step_s):
            start = max(time.time(), self.free.get(i, 0.0))
            self.free[i] = start + step_s
            await asyncio.sleep(self.free[i] - time.time())

        async def grads(self, after, i, k, step_s):
            await self._compute(i, step_s)
            return {"loss": 1.0}, {"grads": k}

        async def apply(self, k, parts):
            await asyncio.gather(*parts)
            return {"step": k + 1, "loss": 1.0}

        async def fold(self, gate, i, k, parts, step_s):
            await asyncio.gather(*parts)
            await self._compute(i, step_s)
            return {"step": k + 1, "loss": 1.0}, {"grads": k + 1}

        async def bare(self, i, k, step_s):
            await self._compute(i, step_s)
            return {"step": k + 1, "loss": 1.0}

        async def reduce(self, k, parts):
            await asyncio.gather(*parts)
            return {"count": len(parts)}, {"sum": k}

        def cpu(self) -> float:
            return time.process_time()

    @ray.remote(num_cpus=0, max_concurrency=1000)
    class _Gate:
        """gate.wait(k) resolves once the driver calls gate.open(k)."""

        def __init__(self):
            self.events: dict = {}

        async def wait(self, k):
            await self.events.setdefault(k, asyncio.Event()).wait()
            return True

        async def open(self, k):
            self.events.setdefault(k, asyncio.Event()).set()
            self.events.pop(k - 2, None)

    @ray.remote(num_cpus=0, max_concurrency=1000)
    class _Leader:
        """One group's calls, as the driver makes them in `today`: the
        group's slices are `first` .. `first + count - 1`."""

        def __init__(self, sims, first: int, count: int, step_s: float):
            self.sims, self.slices, self.step_s = sims, range(first, first + count), step_s
            self.grads = self.reduces = None

        def _sim(self, i: int):
            return self.sims[i % len(self.sims)]

        def _issue(self, k: int, after: dict) -> list:
            """Step k's gradient calls (after[i], slice i's apply, done) and
            the group's part of the tree; the ref of its sum, in a list (so
            that it stays a ref on its way to the driver)."""
            self.grads = [self._sim(i).grads.options(num_returns=2).remote(after.get(i), i, k, self.step_s)
                          for i in self.slices]
            top, self.reduces = _tree(self._sim, k, [g[1] for g in self.grads], down_to_one=True)
            return top

        async def start(self, k: int) -> list:
            return self._issue(k, {})

        async def step(self, k: int, top: list) -> list:
            """Apply step k (top: the whole tree's sum), issue step k + 1
            behind it, read every reply of step k; the next sum's ref."""
            # The group's applies take a copy of the sum this leader owns
            # (one more reduce call, of one piece): the driver's own ref
            # is then fetched once per group, not once per slice.
            relay, mine = self._sim(self.slices[0]).reduce.options(num_returns=2).remote(k, top)
            applies = {i: self._sim(i).apply.remote(k, [mine]) for i in self.slices}
            replies = [g[0] for g in self.grads] + self.reduces + [relay] + list(applies.values())
            nxt = self._issue(k + 1, applies)
            await asyncio.gather(*replies)
            return nxt

        def cpu(self) -> float:
            return time.process_time()

    return _Sim, _Gate, _Leader


def _tree(sim, k: int, payloads: list, down_to_one: bool = False) -> tuple[list, list]:
    """The reduction tree of fan-in FAN_IN over `payloads`, a level's
    j-th call on sim(j) (spread over the simulated actors): the refs its top leaves (one, or up to FAN_IN when no level was needed
    and not `down_to_one`) and its calls' replies."""
    nodes, built, calls = list(payloads), 0, []
    while len(nodes) > FAN_IN or ((built or down_to_one) and len(nodes) > 1):
        built += 1
        level = []
        for j in range(0, len(nodes), FAN_IN):
            status, part = sim(j // FAN_IN).reduce.options(num_returns=2).remote(k, nodes[j:j + FAN_IN])
            calls.append(status)
            level.append(part)
        nodes = level
    return nodes, calls


def _gather(refs: list) -> None:
    """Every reply, read as StepRunner.gather does (block on one, then
    take whatever else finishes within 10 ms in one more wait)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        if pending:
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0.01)
            done += more
        ray.get(done)


def measure(pattern: str, n: int, steps: int = 14, step_s: float = 1.0, warmup: int = 3) -> dict:
    import ray

    sim_cls, gate_cls, leader_cls = _actors()
    sims = [sim_cls.remote() for _ in range(2)]
    gate = gate_cls.remote()
    ray.get([s.cpu.remote() for s in sims])

    def sim(i: int):
        return sims[i % len(sims)]

    def tree(k: int, payloads: list) -> tuple[list, list]:
        return _tree(sim, k, payloads)

    leaders = []
    stamps = []

    def stamp():
        # The actors' CPU only where the window measured starts and ends:
        # asked every step, it would cost the driver a call per actor (as
        # many as its work's in `grouped`).
        # Neither read is inside the driver's window: the first is taken
        # before its clocks, the last after.
        def read():
            return ray.get([a.cpu.remote() for a in sims + leaders])

        cpu = read() if len(stamps) == warmup else [0.0] * (len(sims) + len(leaders))
        clocks = (time.perf_counter(), time.process_time())
        if len(stamps) == steps - 1:
            cpu = read()
        stamps.append((*clocks, sum(cpu[:len(sims)]), sum(cpu[len(sims):])))

    try:
        if pattern == "bare":
            out = [sim(i).bare.remote(i, 0, step_s) for i in range(n)]
            for k in range(1, steps + 1):
                ahead = [sim(i).bare.remote(i, k, step_s) for i in range(n)]
                _gather(out)
                stamp()
                out = ahead
            _gather(out)
        elif pattern == "today":
            grads = [sim(i).grads.options(num_returns=2).remote(None, i, 0, step_s) for i in range(n)]
            top, reduces = tree(0, [g[1] for g in grads])
            for k in range(steps):
                applies = [sim(i).apply.remote(k, top) for i in range(n)]
                ahead = [sim(i).grads.options(num_returns=2).remote(applies[i], i, k + 1, step_s) for i in range(n)]
                top_next, reduces_next = tree(k + 1, [g[1] for g in ahead])
                _gather([g[0] for g in grads] + reduces + applies)
                stamp()
                grads, top, reduces = ahead, top_next, reduces_next
            _gather([g[0] for g in grads] + reduces)
        elif pattern == "folded":
            grads = [sim(i).grads.options(num_returns=2).remote(None, i, 0, step_s) for i in range(n)]
            _gather([g[0] for g in grads])
            top, reduces = tree(0, [g[1] for g in grads])
            opened = gate.wait.remote(-1)
            gate.open.remote(-1)
            folds = [sim(i).fold.options(num_returns=2).remote(opened, i, 0, top, step_s) for i in range(n)]
            for k in range(1, steps + 1):
                top, reduces = tree(k, [f[1] for f in folds])
                boundary = gate.wait.remote(k)
                ahead = [sim(i).fold.options(num_returns=2).remote(boundary, i, k, top, step_s) for i in range(n)]
                _gather([f[0] for f in folds] + reduces)  # step k - 1 applied everywhere
                stamp()
                gate.open.remote(k)
                folds = ahead
            _gather([f[0] for f in folds])
        elif pattern == "grouped":
            leaders += [leader_cls.remote(sims, g, min(GROUP, n - g), step_s) for g in range(0, n, GROUP)]
            sums = ray.get([a.start.remote(0) for a in leaders])
            for k in range(steps):
                top, reduces = tree(k, [r for part in sums for r in part])
                sums = ray.get([a.step.remote(k, top) for a in leaders] + reduces)[:len(leaders)]
                stamp()
        else:
            raise ValueError(f"pattern {pattern!r}: one of {PATTERNS}")
    finally:
        for a in sims + [gate] + leaders:
            ray.kill(a)
    steady = stamps[warmup:]
    span = len(steady) - 1
    wall = [b[0] - a[0] for a, b in zip(steady, steady[1:])]
    return {
        "pattern": pattern, "slices": n, "step_s": step_s, "steps_measured": span,
        "step_wall_mean_s": (steady[-1][0] - steady[0][0]) / span,
        "step_wall_median_s": statistics.median(wall),
        "driver_cpu_per_step_s": (steady[-1][1] - steady[0][1]) / span,
        "sim_cpu_per_step_s": (steady[-1][2] - steady[0][2]) / span,
        "leaders_cpu_per_step_s": (steady[-1][3] - steady[0][3]) / span,
        "leaders": len(leaders),
    }


def run(sizes: Sequence[int] = (256, 1024), patterns: Sequence[str] = PATTERNS, rounds: int = 2,
        steps: int = 14, step_s: float = 1.0, log=print) -> dict:
    """Every pattern at every size, `rounds` times, the patterns alternated
    within a round (a shared machine's speed drifts); medians per cell."""
    rows = []
    for r in range(rounds):
        for n in sizes:
            for p in patterns:
                row = measure(p, n, steps=steps, step_s=step_s)
                row["round"] = r
                rows.append(row)
                log(f"  round {r}, {n:5d} slices, {p:6s}: {row['step_wall_mean_s'] * 1e3:7.1f} ms/step, driver CPU "
                    f"{row['driver_cpu_per_step_s'] * 1e3:6.0f} ms/step, simulated workers' CPU {row['sim_cpu_per_step_s'] * 1e3:6.0f} ms/step"
                    + (f", {row['leaders']} leaders' CPU {row['leaders_cpu_per_step_s'] * 1e3:6.0f} ms/step" if row["leaders"] else ""))
    cells = []
    for n in sizes:
        for p in patterns:
            mine = [x for x in rows if x["slices"] == n and x["pattern"] == p]
            cells.append({"slices": n, "pattern": p, **{k: statistics.median(x[k] for x in mine) for k in (
                "step_wall_mean_s", "driver_cpu_per_step_s", "sim_cpu_per_step_s", "leaders_cpu_per_step_s")},
                          "leaders": mine[0]["leaders"]})
    return {"sizes": list(sizes), "patterns": list(patterns), "rounds": rounds, "steps": steps, "step_s": step_s,
            "rows": rows, "cells": cells}


def table(result: dict) -> str:
    step_s = result["step_s"]
    lines = [
        f"The calls alone, {step_s:g} s of compute per step, medians of {result['rounds']} rounds:",
        "",
        "| slices | pattern | driver's calls per slice and step | driver CPU per step (ms) | … of the step | "
        "leaders' CPU per step, all of them (ms) | simulated workers' CPU per step (ms) | per step, wall, here (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    per_slice = {"today": "2 + tree", "folded": "1 + tree", "bare": "1", "grouped": f"1/{GROUP} + tree"}
    for c in result["cells"]:
        leaders = f"{c['leaders_cpu_per_step_s'] * 1e3:.0f} ({c['leaders']})" if c["leaders"] else "–"
        lines.append(f"| {c['slices']} | {c['pattern']} | {per_slice[c['pattern']]} | {c['driver_cpu_per_step_s'] * 1e3:.0f} "
                     f"| {100 * c['driver_cpu_per_step_s'] / step_s:.0f}% | {leaders} | {c['sim_cpu_per_step_s'] * 1e3:.0f} "
                     f"| {c['step_wall_mean_s'] * 1e3:.0f} |")
    return "\n".join(lines)

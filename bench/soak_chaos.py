"""The soak's fault injector (bench/soak.py): which fault, when, on which
slice, and the cluster changes each one calls for.

`Chaos` runs in the trainer's callbacks (the controller's thread): it
fires faults by wall time and from the events that open a window, adds
replacement nodes through the driver's main thread, takes drained and
evicted nodes away once the run has left them, and thaws frozen nodes
once Ray has declared them dead.

- Kinds (`KINDS`): `kill` (SIGKILL of the worker), `stop` (SIGSTOP: a
  hang), `term` (SIGTERM: a preemption notice to the process), `oom` (a
  leak in the worker past its node's memory threshold: Ray's memory
  monitor kills it; the tight node is made again, its threshold from the
  machine's use then, when the run has not healed for STALLED_S with no
  live slice on it), `remove_node` (its node leaves with its processes),
  `freeze_node` (the node's raylet and processes SIGSTOPped; thawed once
  Ray has declared it dead), `drain` (a Ray drain notice, reason
  preemption; the node is taken away once the run has left it, or at the
  deadline), `corrupt` (one bit of the state the slice's next apply
  makes: silent corruption, which the replicas' vote names) and `slow`
  (every gradient call of the slice `SLOW_MS` longer: a straggler). The
  last two have their node evicted (not used again): the bench replaces
  it and takes it away.
- Order: a seeded shuffle of a cycle in which each kind appears `WEIGHTS`
  times (process faults weighted up: they are cheap to heal), so every
  kind comes once per cycle. An `oom` drawn while no live slice is on the
  memory-tight node (the one node whose raylet runs with a threshold just
  above the machine's use: every raylet kills its own workers when the
  machine passes its threshold, so only one node may be tight) waits for
  the next draw.
- Rate: the next fault as soon as the last one has healed (every slice
  live, the spares back, no replacement node pending, nothing left to
  take away), after a seeded gap drawn from `gap_s`.
- Windows: a share of the faults fire from the events that open a window
  instead of the clock, on a live slice other than the one the event is
  about: `recovery` (the `detected` event of the fault just fired),
  `join` (its `replace` event: a replacement, the spare at once, is about
  to join, with the survivors' state), `checkpoint` (a `checkpoint_started`
  event: a save begins) and `sync` (DiLoCo: the step that ends a round,
  as its synchronization starts). Recovery and join faults chain to the
  fault that opened them (never more than two open at once); checkpoint
  and sync faults take a healed run's turn. Their kind is the next
  drawn if it is a process fault or a node removal, else `kill`.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import time
from typing import Callable, Optional, Sequence

KINDS = ("kill", "remove_node", "stop", "freeze_node", "drain", "term", "oom", "corrupt", "slow")
# Times a kind appears per cycle: process faults heal in seconds on any
# machine; node faults cost a node start (and a frozen node Ray's ~70 s
# verdict), so they come less often.
WEIGHTS = {"kill": 4, "stop": 3, "term": 3, "oom": 2, "remove_node": 1, "freeze_node": 1, "drain": 1,
           "corrupt": 1, "slow": 1}
NODE_KINDS = ("remove_node", "freeze_node", "drain")  # the node goes: a replacement node is added
EVICT_KINDS = ("corrupt", "slow")  # the node is kept out of the run: replaced, then taken away
NOTICE_KINDS = ("drain", "term")  # detected when the run takes the preemption notice
WINDOW_KINDS = ("kill", "stop", "term", "remove_node")  # what a window fault may be
WINDOWS = ("recovery", "join", "checkpoint", "sync")
DRAIN_DEADLINE_S = 30.0
SLOW_MS = 500  # per gradient call: many times a step of the soak's model (straggler_min_s 3 s: bench/soak.py)
OOM_HEADROOM_MB = 4000  # the tight node's threshold: the machine's use when it starts, plus this
OOM_OVERSHOOT_MB = 1024  # a leak takes the machine this far past the threshold
UNDETECTED_AFTER_S = 180.0  # a fault not noticed by then counts as undetected
# A run not healed for this long with no live slice on the memory-tight
# node gets a new tight node: the machine's use grew past the old one's
# threshold (other work on it), and its raylet kills every worker that
# starts there (a spare that never came up: seen with two soaks at once).
STALLED_S = 90.0
THAW_CHECK_S = 2.0  # how often frozen nodes are checked for Ray's verdict
STALE_CHECK_S = 10.0  # after a thaw, when to look whether its processes ended


def alive_pids(pids: Sequence[int]) -> list[int]:
    """Those of `pids` still running (zombies are not)."""
    import psutil

    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def tight_env() -> tuple[dict, int]:
    """A raylet environment whose memory threshold is the machine's use now
    plus OOM_HEADROOM_MB (Ray's monitor checked every 100 ms), and that
    threshold in bytes."""
    import psutil

    vm = psutil.virtual_memory()
    limit = min(vm.total * 0.9, vm.total - vm.available + OOM_HEADROOM_MB * 2**20)
    return ({"RAY_memory_usage_threshold": f"{limit / vm.total:.4f}", "RAY_memory_monitor_refresh_ms": "100"},
            int(limit))


def leak_mb(threshold_bytes: int) -> int:
    """Megabytes that take the machine OOM_OVERSHOOT_MB past `threshold_bytes` now."""
    import psutil

    vm = psutil.virtual_memory()
    return int(max(512, (threshold_bytes - (vm.total - vm.available)) / 2**20 + OOM_OVERSHOOT_MB))


def cycle_of(kinds: Sequence[str], rng: random.Random) -> list[str]:
    """One cycle of the seeded order: each kind WEIGHTS times, shuffled."""
    out = [k for k in kinds for _ in range(WEIGHTS.get(k, 1))]
    rng.shuffle(out)
    return out


class Chaos:
    """Fires the soak's faults from the trainer's callbacks (see the
    module's doc). `failures`: stop once that many have fired, and end
    the run at the first step after the last has healed (`end`:
    the step count to end at, given the step); `window_share`: the share
    of faults fired from a window's event."""

    def __init__(self, cluster, trainer, rec, *, slices: int, spares: int, rng: random.Random, gap_s: tuple,
                 kinds: Sequence[str], name: str, log: Callable, failures: Optional[int] = None,
                 window_share: float = 0.0, windows: Sequence[str] = WINDOWS,
                 end: Optional[Callable[[int], int]] = None, tight: Optional[dict] = None,
                 cluster_work: Optional[queue.Queue] = None, sync_period: int = 0):
        self.cluster, self.trainer, self.rec = cluster, trainer, rec
        self.slices, self.spares = slices, spares
        # (function, args) for the main thread to run on the cluster; None:
        # run them here, on the controller's thread (and count their time).
        self.cluster_work = cluster_work
        self.rng, self.gap_s, self.kinds, self.name, self.log = rng, gap_s, list(kinds), name, log
        self.failures, self.window_share, self.windows = failures, window_share, list(windows)
        self.end, self.sync_period = end, sync_period
        self.tight = tight  # {"node": id or None, "threshold": bytes}: the memory-tight node
        self.faults: list[dict] = []
        self.cycle: list[str] = []
        self.heal_t: Optional[float] = None  # when the run was last seen healed
        self.next_t: Optional[float] = None  # the next clock fault's time, once healed
        self.trigger = "clock"  # what fires the next fault of a healed run: the clock, a checkpoint or a sync
        self.chained: Optional[dict] = None  # {"window", "parent"}: a recovery or join fault owed
        self.started = False
        self.ended_at: Optional[int] = None
        self.changed_t = 0.0  # when a fault fired or the run was last seen healed
        self.tight_renewed = 0
        self.nodes_needed = 0  # replacement nodes the faults call for, not yet up
        self.nodes_asked = 0  # of those, the ones being added
        self.bench_s = 0.0
        self.stopped: list[int] = []  # SIGSTOPped worker pids
        self.frozen: dict[str, dict] = {}  # node -> {"pids", "t", "fault"}
        self.leaving: dict[str, dict] = {}  # node -> {"deadline_t" (drain) or None, "fault", "slice"}
        self.thawed: list[dict] = []
        self._checked_t = float("-inf")
        self._progress_t = 0.0
        self.errors: list[str] = []  # the bench's own, logged and reported

    # -- state ---------------------------------------------------------------

    def _timed(self, fn, *args):
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.bench_s += time.monotonic() - t0

    def _undetected(self) -> list[dict]:
        return [f for f in self.faults if f.get("detected_t") is None and not f.get("undetected")]

    def healed(self) -> bool:
        m = self.trainer.members
        return (len(m.live) == self.slices and not m.coming and len(m.ready) >= self.spares
                and not self.nodes_needed and not self.leaving and not self._undetected())

    def _draw(self, window: bool) -> str:
        """The next kind of the seeded order. A window's fault takes it if
        it is one of WINDOW_KINDS, else a `kill` (the kind stays next)."""
        for _ in range(3):
            if not self.cycle:
                self.cycle = cycle_of(self.kinds, self.rng)
            if window:
                return self.cycle.pop(0) if self.cycle[0] in WINDOW_KINDS else "kill"
            for i, kind in enumerate(self.cycle):
                if kind != "oom" or self._on_tight() is not None:  # an oom waits for a live slice on the tight node
                    return self.cycle.pop(i)
            self.cycle += cycle_of(self.kinds, self.rng)
        return "kill"

    def _on_tight(self) -> Optional[int]:
        """The live slice whose worker is on the memory-tight node."""
        node = self.tight["node"] if self.tight else None
        if node is None:
            return None
        return next((s for s in sorted(self.trainer.members.live) if self.trainer.hosts(s)[0]["node_id"] == node), None)

    def _more(self) -> bool:
        return self.failures is None or len(self.faults) < self.failures

    # -- callbacks ----------------------------------------------------------

    def on_event(self, e: dict) -> None:
        ev, now = e["event"], e["t"]
        if ev == "start":
            self.started, self.changed_t = True, now
        mine = next((f for f in self._undetected() if e.get("slice") == f["slice"]), None)
        if mine is not None and ev == "preempt_notice" and mine["kind"] in NOTICE_KINDS:
            mine.setdefault("notice_t", now)
        if ev == "detected" and mine is not None:
            mine["detected_t"], mine["failure_kind"] = now, e.get("kind")
            if mine["kind"] in NODE_KINDS + EVICT_KINDS:
                self.nodes_needed += 1
            if mine["kind"] in EVICT_KINDS:  # kept out of the run: taken away once it has left it
                self.leaving[mine["node"]] = {"deadline_t": None, "fault": mine["i"], "slice": mine["slice"]}
        elif ev == "detected" and e.get("kind") in ("node_died", "straggler", "corrupted"):
            # A failure the bench did not inject (a FAIL of its own): its
            # node is gone or kept out all the same, and the run needs another.
            self.log(f"    [{self.name}] a failure the bench did not inject: {e.get('kind')} of slice "
                     f"{e.get('slice')}: {str(e.get('cause'))[:200]}")
            self.nodes_needed += 1
        if ev == "replace":
            for node, d in list(self.leaving.items()):
                if d["slice"] == e.get("slice"):  # the run has left it: the cloud takes it away
                    self._take_away(node, "left")
        if ev == "detected" and self.nodes_needed > self.nodes_asked:
            # After the detection is time-stamped. `nodes_needed` drops once
            # the node is up (`_add_node`): the run is not healed before.
            while self.nodes_asked < self.nodes_needed:
                self.nodes_asked += 1
                if self.cluster_work is not None:
                    self.cluster_work.put((self._add_node, ()))
                else:  # blocks this (the controller's) thread for a second or more
                    self._timed(self._add_node)
        window = {"detected": "recovery", "replace": "join", "checkpoint_started": "checkpoint"}.get(ev)
        if window is not None:
            self._window(window, e.get("slice"))
        self.housekeeping()

    def on_step(self, step: int, metrics: dict) -> None:
        self.housekeeping()
        now = self.rec.now()
        if now - self._progress_t >= 60.0:
            self._progress_t = now
            self.log(f"    [{self.name}] {now / 60:.1f} min: step {step}, {metrics['slices']} slices live, "
                     f"{len(self.faults)} faults")
        if self.sync_period and step % self.sync_period == 0:
            self._window("sync", None)
        healed = self.healed()
        if not healed:
            self.heal_t = None
            return
        self.changed_t = now
        if self.heal_t is None:  # healed since the last step: the next fault's turn, after a seeded gap
            self.heal_t = now
            self.next_t = now + self.rng.uniform(*self.gap_s)
            self.trigger = self._next_trigger()
        if not self._more():
            if self.end is not None and self.ended_at is None and metrics["slices"] == self.slices:
                self.ended_at = self.trainer.steps = self.end(step)
                self.log(f"    [{self.name}] {len(self.faults)} faults fired and healed: the run ends at step "
                         f"{self.ended_at}")
            return
        if self.trigger == "clock" and now >= self.next_t:
            self._fire_safely(step, None)

    def _next_trigger(self) -> str:
        """What fires a healed run's next fault: its clock, or (a share of
        them) the next checkpoint save's start or DiLoCo synchronization."""
        timed = [w for w in ("checkpoint", "sync") if w in self.windows]
        if timed and self.rng.random() < self.window_share:
            return self.rng.choice(timed)
        return "clock"

    def _window(self, window: str, about: Optional[int]) -> None:
        """An event opened `window` (`about`: the slice it is about)."""
        if not self.started or not self._more() or window not in self.windows:
            return
        if window in ("recovery", "join"):
            owed = self.chained
            if owed is None or owed["window"] != window or owed["slice"] != about:
                return
            self.chained = None
        elif not (self.trigger == window and self.heal_t is not None and self.rec.now() >= self.next_t):
            return
        self._fire_safely(None, window, avoid=about)

    def _fire_safely(self, step: Optional[int], window: Optional[str], avoid: Optional[int] = None) -> None:
        try:
            self.fire(step, window, avoid)
        except Exception as e:  # noqa: BLE001 (the bench's error, not the run's)
            self.errors.append(f"firing a fault: {type(e).__name__}: {e}")
            self.log(f"    [{self.name}] firing a fault failed: {type(e).__name__}: {e}")

    def fire(self, step: Optional[int], window: Optional[str], avoid: Optional[int] = None) -> None:
        live = sorted(self.trainer.members.live - {avoid})
        if not live:
            return
        if window is None:
            self.chained = None  # one owed to an earlier fault whose window never opened
        kind = self._draw(window is not None)
        s = self._on_tight() if kind == "oom" else self.rng.choice(live)
        info = self.trainer.hosts(s)[0]
        pid, node = info["pid"], info["node_id"]
        t = self.rec.now()
        fault = {"i": len(self.faults), "kind": kind, "slice": s, "t": round(t, 4), "pid": pid, "node": node,
                 "window": window, "after_step": step if step is not None else self.trainer.step}
        backend = self.trainer.members.backend
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "stop":
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)
        elif kind == "term":
            os.kill(pid, signal.SIGTERM)
        elif kind == "oom":
            fault["leak_mb"] = leak_mb(self.tight["threshold"])
            backend.eat_memory(s, 0, fault["leak_mb"])
        elif kind == "corrupt":
            backend.corrupt(s, 0, "state", False)
        elif kind == "slow":
            backend.slow_down(s, 0, SLOW_MS)
        elif kind == "remove_node":
            self._timed(self.cluster.remove_node, node)
        elif kind == "freeze_node":
            self.frozen[node] = {"pids": self.cluster.freeze_node(node), "t": t, "fault": fault["i"]}
        elif kind == "drain":
            from ray_elastic.cluster.drain import drain_node

            fault["drain_accepted"] = drain_node(node, deadline_s=DRAIN_DEADLINE_S)
            self.leaving[node] = {"deadline_t": t + DRAIN_DEADLINE_S, "fault": fault["i"], "slice": s}
        if self.tight is not None and node == self.tight["node"] and kind in NODE_KINDS + EVICT_KINDS:
            self.tight["node"] = None  # it goes: the next node added is the tight one (`_add_node`)
        self.faults.append(fault)
        self.heal_t, self.changed_t = None, t
        self.log(f"    [{self.name}] fault {fault['i']}: {kind} slice {s} at {t:.1f} s"
                 + (f" ({window} window)" if window else f" (after step {step})"))
        # A share of faults fired by the clock has the next one fire in its recovery or join.
        chain = [w for w in ("recovery", "join") if w in self.windows]
        if window is None and chain and self._more() and self.rng.random() < self.window_share:
            self.chained = {"window": self.rng.choice(chain), "slice": s}

    # -- the cluster --------------------------------------------------------

    def _add_node(self) -> None:
        try:
            if self.tight is not None and self.tight["node"] is None:
                # The tight node went: its replacement is the new one, threshold from the machine's use now.
                env, self.tight["threshold"] = tight_env()
                self.tight["node"] = self.cluster.add_node(env=env)
            else:
                self.cluster.add_node()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"adding a node: {type(e).__name__}: {e}")
            self.log(f"    [{self.name}] adding a node failed: {type(e).__name__}: {e}")
        finally:
            self.nodes_asked -= 1
            self.nodes_needed -= 1

    def _renew_tight(self) -> None:
        """A new memory-tight node, its threshold from the machine's use now,
        in place of the old one (a slice starting there starts again)."""
        old = self.tight["node"]
        try:
            env, threshold = tight_env()
            self.tight.update(node=self.cluster.add_node(env=env), threshold=threshold)
            if old in self.cluster.nodes:
                self.cluster.remove_node(old)
            self.tight_renewed += 1
            self.log(f"    [{self.name}] not healed for {STALLED_S:.0f} s: a new memory-tight node")
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"renewing the tight node: {type(e).__name__}: {e}")

    def _take_away(self, node: str, why: str) -> None:
        d = self.leaving.pop(node)
        self.faults[d["fault"]]["node_removed"] = why
        if node in self.cluster.nodes:
            self._timed(self.cluster.remove_node, node)

    def housekeeping(self) -> None:
        # An error here would end the run it watches: log it instead.
        try:
            self._housekeeping()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{type(e).__name__}: {e}")
            self.log(f"    [{self.name}] bench housekeeping failed: {type(e).__name__}: {e}")

    def _housekeeping(self) -> None:
        now = self.rec.now()
        for f in self._undetected():
            if now - f["t"] > UNDETECTED_AFTER_S:
                f["undetected"] = True
                self.log(f"    [{self.name}] fault {f['i']} ({f['kind']}) not detected within "
                         f"{UNDETECTED_AFTER_S:.0f} s")
        for node, d in list(self.leaving.items()):
            if d["deadline_t"] is not None and now >= d["deadline_t"]:
                self._take_away(node, "deadline")
        if (self.started and self.tight is not None and self.tight["node"] is not None and self.cluster_work is not None
                and now - self.changed_t > STALLED_S and self._on_tight() is None and not self.healed()):
            self.changed_t = now  # one renewal per stall period
            self.cluster_work.put((self._renew_tight, ()))
        if now - self._checked_t < THAW_CHECK_S or not (self.frozen or self.thawed):
            return
        self._checked_t = now
        if self.frozen:
            import ray

            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            for node, fr in list(self.frozen.items()):
                if node not in alive:  # Ray has declared it dead: wake it
                    self.cluster.thaw_node(node)
                    del self.frozen[node]
                    self.faults[fr["fault"]]["declared_dead_s"] = round(now - fr["t"], 3)
                    self.thawed.append({"node": node, "pids": fr["pids"], "thawed_t": now, "fault": fr["fault"]})
        for th in list(self.thawed):
            if now - th["thawed_t"] >= STALE_CHECK_S:
                self.faults[th["fault"]]["stale_processes_left"] = len(alive_pids(th["pids"]))
                self.thawed.remove(th)
                if th["node"] in self.cluster.nodes:
                    self._timed(self.cluster.remove_node, th["node"])  # reap what is left

    def cleanup(self) -> None:
        """Once the run has ended: the workers this bench SIGSTOPped and
        the nodes still frozen, thawed or leaving are ended, so that what
        is left is what the run left (bench/soak_leaks.py counts it)."""
        import psutil

        for pid in self.stopped:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_STOPPED:  # still ours (a pid may be reused)
                    os.kill(pid, signal.SIGKILL)
            except (psutil.Error, ProcessLookupError):
                pass
        for node in [*self.frozen, *(th["node"] for th in self.thawed), *self.leaving]:
            if node in self.cluster.nodes:
                self.cluster.remove_node(node)
        self.frozen.clear()
        self.thawed.clear()
        self.leaving.clear()

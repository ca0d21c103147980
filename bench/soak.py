"""Soak: a long chaos run on Ray's default health-check settings, with
durable checkpoints on a GCS-compatible server (fake-gcs-server, a gs://
path), for each policy (`python -m bench soak [--minutes 30] [--policy
pause|resize|both] [--out DIR]`).

What runs, per policy (each on its own fresh local cluster,
`LocalCluster(3, health_checks="default")`: a head without CPUs and one
1-CPU node per slice):

- `ElasticTrainer`, 3 slices of 1 host, the policy's defaults
  (`step_deadline_floor_s` 10 s, `timeout_s` 300 s), `max_retries` high
  enough for the whole soak, `CheckpointConfig("gs://soak/...",
  save_every=200, keep=3)`, `keep_final_state=True`;
- faults decided by wall time: one every 20-60 s (seeded draws), the kinds
  in turn, each cycle of six in a seeded random order, on a random live
  slice: `kill` (SIGKILL of the worker), `remove_node` (its node leaves
  with its processes), `stop` (SIGSTOP of the worker: a hang), `freeze_node`
  (the node's raylet and processes SIGSTOPped: alive but unreachable;
  thawed once Ray has declared it dead, so its stale processes end),
  `drain` (a Ray drain notice, reason preemption, 30 s deadline; the node
  is taken away once the run has left it, or at the deadline) and `term`
  (SIGTERM to the worker: a preemption notice to the process).
  `ray_elastic.Fault` fires at a step; these fire at a time, so the bench
  injects them itself from its callbacks (as compare's chaos does): pids
  and node ids from `trainer.hosts(slice)`, live slices from
  `trainer.members.live`. A fault waits until the previous one is
  detected and healed (every slice live again, no replacement node
  pending), then fires at its drawn time or at once if that has passed.
  No fault fires in the last `END_MARGIN_S` worth of steps, so the run ends
  after its last recovery.
- replacement nodes are added by the driver's main thread (Ray's
  `Cluster.add_node` works only there) while the controller runs on a
  thread of its own, as `ray-elastic demo` does and as a cloud's
  autoscaler adds nodes from outside the driver: asked for in the callback
  of the run's `detected` event for the node faults (remove_node,
  freeze_node, drain), so no controller call waits on a node starting;
  the process faults (kill, stop, term) get their replacement worker on
  the same node. The bench's own node changes still made on the
  controller's thread (the fault's own removal) are counted apart
  (`bench_node_changes_s`).

Run length: a fixed step count, so that the run ends normally (final
checkpoint, `final_state`) and the failure-free reference is the same run.
A warm-up (failure-free, same settings, `WARMUP_STEPS` steps) measures the
wall time per step after start-up; the step count is
`minutes × 60 × GOODPUT_GUESS / (time per step)`, with GOODPUT_GUESS the
share of wall time a chaos run of that policy is expected to spend in kept
steps (for `both`, the mean of the two, so one reference serves both runs:
pause then lasts somewhat longer than --minutes, resize somewhat less).

After the chaos runs, a failure-free reference run of the same step count
(fresh cluster, no checkpoints) gives the state to compare with: every
array of each chaos run's final state must be bitwise equal to it
(`np.array_equal`). Required under pause; under resize it checks the
documented `batch_on_resize="accumulate"` claim.

Figures: failures by kind, detection (fault -> the run noticing: the
`detected` event, or the preemption notice for drain/term) and fault ->
next completed step, medians [min-max] per kind and overall; steps redone;
goodput (whole run; from the first step; less the bench's node changes;
and effective throughput: kept steps × failure-free step time / time since
start); checkpoints committed; the bitwise result. Every failure must be
detected and recovered and the run must finish: otherwise a FAIL line is
printed and the command exits 1.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import queue
import signal
import statistics
import threading
import time
from typing import Callable, Optional, Sequence

from bench.common import ROOT, lm_factory, steady_step_time, summary

KINDS = ("kill", "remove_node", "stop", "freeze_node", "drain", "term")
NODE_KINDS = ("remove_node", "freeze_node", "drain")  # the node goes: a replacement node is added
NOTICE_KINDS = ("drain", "term")  # detected when the run takes the preemption notice
POLICIES = ("pause", "resize")
SLICES = 3
INTERVAL_S = (20.0, 60.0)
DRAIN_DEADLINE_S = 30.0
SAVE_EVERY = 200
KEEP = 3
WARMUP_STEPS = 300
# Share of wall time a chaos run spends in kept steps, to size the run. On
# Ray's default health checks a frozen node is declared dead only after
# ~70 s, and pause waits for its replacement (a first 15-minute soak here
# measured about 40% for pause).
GOODPUT_GUESS = {"pause": 0.45, "resize": 0.85}
END_MARGIN_S = 30.0  # no fault in the run's last this-many seconds of steps (at most 1/6 of the run)
UNDETECTED_AFTER_S = 180.0  # a fault not noticed by then counts as undetected
THAW_CHECK_S = 2.0  # how often frozen nodes are checked for Ray's verdict
STALE_CHECK_S = 10.0  # after a thaw, when to look whether its processes ended


def _print(*args) -> None:
    print(*args, flush=True)


def _cluster():
    from ray_elastic.cluster.local_cluster import LocalCluster

    cluster = LocalCluster(num_nodes=SLICES, health_checks="default")
    cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
    return cluster


def _config(policy: str):
    from ray_elastic import ElasticConfig

    return ElasticConfig(num_slices=SLICES, policy=policy, max_retries=100_000,
                         **({"min_slices": 1} if policy == "resize" else {}))


def _alive_pids(pids: Sequence[int]) -> list[int]:
    import psutil

    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


# --------------------------------------------------------------------------
# Sizing.
# --------------------------------------------------------------------------


def warmup(cluster, ckpt_path: str, steps: int = WARMUP_STEPS, factory=None) -> dict:
    """A failure-free run with the chaos runs' settings: wall seconds per
    step after start-up (the driver's loop and the checkpoints included)."""
    from ray_elastic import CheckpointConfig, ElasticTrainer

    cluster.ensure_nodes(SLICES)
    report = ElasticTrainer(factory or lm_factory(), _config("pause"), steps,
                            checkpoint=CheckpointConfig(ckpt_path, save_every=SAVE_EVERY, keep=KEEP)).fit()
    start_t = next((e["t"] for e in report.events if e["event"] == "start"), 0.0)
    return {"steps": steps, "wall_s": round(report.wall_s, 3), "start_s": round(start_t, 3),
            "per_step_s": (report.wall_s - start_t) / steps, "step_time_s": steady_step_time(report)}


def plan_steps(minutes: float, per_step_s: float, policies: Sequence[str], start_s: float = 0.0) -> int:
    guess = statistics.fmean(GOODPUT_GUESS[p] for p in policies)
    return max(50, int((minutes * 60.0 - start_s) * guess / per_step_s))


# --------------------------------------------------------------------------
# One chaos run.
# --------------------------------------------------------------------------


class _Chaos:
    """Fires faults by wall time from the trainer's callbacks (the driver's
    main thread), adds replacement nodes, takes drained nodes away, thaws
    frozen ones once Ray has declared them dead."""

    def __init__(self, cluster, trainer, rec, *, steps: int, per_step_s: float, rng: random.Random,
                 interval_s: tuple, kinds: Sequence[str], policy: str, log: Callable,
                 max_faults: Optional[int] = None, cluster_work: Optional[queue.Queue] = None):
        self.cluster, self.trainer, self.rec = cluster, trainer, rec
        # (function, args) for the main thread to run on the cluster; None:
        # run them here, on the controller's thread (and count their time).
        self.cluster_work = cluster_work
        self.rng, self.interval_s, self.kinds, self.policy, self.log = rng, interval_s, list(kinds), policy, log
        self.max_faults = max_faults
        # No fault in the last END_MARGIN_S (at most a sixth of the run) of steps.
        margin_s = min(END_MARGIN_S, steps * per_step_s / 6.0)
        self.stop_at_step = steps - int(margin_s / max(per_step_s, 1e-6))
        self.faults: list[dict] = []
        self.cycle: list[str] = []
        self.next_t: Optional[float] = None
        self.start_t: Optional[float] = None
        self.nodes_needed = 0  # replacement nodes the faults call for, not yet up
        self.nodes_asked = 0  # of those, the ones being added
        self.bench_s = 0.0
        self.stopped: list[int] = []  # SIGSTOPped worker pids
        self.frozen: dict[str, dict] = {}  # node -> {"pids", "t", "fault"}
        self.drained: dict[str, dict] = {}  # node -> {"deadline_t", "fault", "slice"}
        self.thawed: list[dict] = []
        self._checked_t = float("-inf")
        self._progress_t = 0.0
        self.errors: list[str] = []  # the bench's own, logged and reported

    # -- helpers ------------------------------------------------------------

    def _timed(self, fn, *args):
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.bench_s += time.monotonic() - t0

    def _open(self) -> Optional[dict]:
        """The newest fault if the run has not noticed it yet."""
        if self.faults and self.faults[-1].get("detected_t") is None and not self.faults[-1].get("undetected"):
            return self.faults[-1]
        return None

    def healed(self) -> bool:
        m = self.trainer.members
        return (len(m.live) == SLICES and not m.coming and not m.ready and not self.nodes_needed
                and not self.drained and self._open() is None)

    def _next_kind(self) -> str:
        if not self.cycle:
            self.cycle = self.rng.sample(self.kinds, len(self.kinds))
        return self.cycle.pop(0)

    # -- callbacks ----------------------------------------------------------

    def on_event(self, e: dict) -> None:
        ev = e["event"]
        if ev == "start" and self.start_t is None:
            self.start_t = e["t"]
            self.next_t = e["t"] + self.rng.uniform(*self.interval_s)
        f = self._open()
        if f is not None and e.get("slice") == f["slice"]:
            if ev == "preempt_notice" and f["kind"] in NOTICE_KINDS and f.get("notice_t") is None:
                f["notice_t"] = e["t"]
            if ev == "detected":
                f["detected_t"] = e["t"]
                f["failure_kind"] = e.get("kind")
                f["step_in_flight"] = e.get("step")
                self.log(f"    [{self.policy}] fault {f['i']} detected as {e.get('kind')} after "
                         f"{e['t'] - f['t']:.1f} s")
                if f["kind"] in NODE_KINDS:
                    self.nodes_needed += 1
        last = self.faults[-1] if self.faults else None
        if (ev == "recovered" and last is not None and last.get("detected_t") is not None
                and e.get("slice") == last["slice"] and "recovered_logged" not in last):
            last["recovered_logged"] = True
            self.log(f"    [{self.policy}] fault {last['i']} recovered: next step {e['t'] - last['t']:.1f} s "
                     f"after the fault, {e.get('steps_rewound')} step(s) redone")
        if ev == "replace":
            for node, d in list(self.drained.items()):
                if d["slice"] == e.get("slice"):  # the run has left it: the cloud takes it away
                    self._remove_drained(node, "left")
        if ev == "detected" and self.nodes_needed > self.nodes_asked:
            # After the detection is time-stamped. `nodes_needed` drops once
            # the node is up (`node_added`): the run is not healed before.
            while self.nodes_asked < self.nodes_needed:
                self.nodes_asked += 1
                if self.cluster_work is not None:
                    self.cluster_work.put((self._add_node, ()))
                else:  # blocks this (the controller's) thread for a second or more
                    self._timed(self._add_node)
        self.housekeeping()

    def _add_node(self) -> None:
        try:
            self.cluster.add_node()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"adding a node: {type(e).__name__}: {e}")
            self.log(f"    [{self.policy}] adding a node failed: {type(e).__name__}: {e}")
        finally:
            self.nodes_asked -= 1
            self.nodes_needed -= 1

    def on_step(self, step: int, metrics: dict) -> None:
        self.housekeeping()
        now = self.rec.now()
        if now - self._progress_t >= 60.0:
            self._progress_t = now
            self.log(f"    [{self.policy}] {now / 60:.1f} min: step {step}/{self.trainer.steps}, "
                     f"{metrics['slices']} slices live, {len(self.faults)} faults")
        if self.next_t is None or now < self.next_t or step >= self.stop_at_step or not self.healed():
            return
        if self.max_faults is not None and len(self.faults) >= self.max_faults:
            return
        try:
            self.fire(step)
        except Exception as e:  # noqa: BLE001 (the bench's error, not the run's)
            self.errors.append(f"firing a fault: {type(e).__name__}: {e}")
            self.log(f"    [{self.policy}] firing a fault failed: {type(e).__name__}: {e}")
            self.next_t = now + self.rng.uniform(*self.interval_s)

    def fire(self, step: int) -> None:
        live = sorted(self.trainer.members.live)
        s = self.rng.choice(live)
        kind = self._next_kind()
        info = self.trainer.hosts(s)[0]
        pid, node = info["pid"], info["node_id"]
        t = self.rec.now()
        fault = {"i": len(self.faults), "kind": kind, "slice": s, "t": round(t, 4), "after_step": step,
                 "pid": pid, "node": node}
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "stop":
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)
        elif kind == "term":
            os.kill(pid, signal.SIGTERM)
        elif kind == "remove_node":
            self._timed(self.cluster.remove_node, node)
        elif kind == "freeze_node":
            self.frozen[node] = {"pids": self.cluster.freeze_node(node), "t": t, "fault": fault["i"]}
        elif kind == "drain":
            from ray_elastic.cluster.drain import drain_node

            accepted = drain_node(node, deadline_s=DRAIN_DEADLINE_S)
            fault["drain_accepted"] = accepted
            self.drained[node] = {"deadline_t": t + DRAIN_DEADLINE_S, "fault": fault["i"], "slice": s}
        self.faults.append(fault)
        self.log(f"    [{self.policy}] fault {fault['i']}: {kind} slice {s} at {t:.1f} s (after step {step})")
        self.next_t = t + self.rng.uniform(*self.interval_s)

    def _remove_drained(self, node: str, why: str) -> None:
        d = self.drained.pop(node)
        self.faults[d["fault"]]["drained_node_removed"] = why
        if node in self.cluster.nodes:
            self._timed(self.cluster.remove_node, node)

    def housekeeping(self) -> None:
        # An error here would end the run it watches: log it instead.
        try:
            self._housekeeping()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{type(e).__name__}: {e}")
            self.log(f"    [{self.policy}] bench housekeeping failed: {type(e).__name__}: {e}")

    def _housekeeping(self) -> None:
        now = self.rec.now()
        f = self._open()
        if f is not None and now - f["t"] > UNDETECTED_AFTER_S:
            f["undetected"] = True
            self.log(f"    [{self.policy}] fault {f['i']} ({f['kind']}) not detected within "
                     f"{UNDETECTED_AFTER_S:.0f} s")
        for node, d in list(self.drained.items()):
            if now >= d["deadline_t"]:
                self._remove_drained(node, "deadline")
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
                    self.log(f"    [{self.policy}] frozen node {node[:8]} declared dead after "
                             f"{now - fr['t']:.0f} s: thawed")
        for th in list(self.thawed):
            if now - th["thawed_t"] >= STALE_CHECK_S:
                left = _alive_pids(th["pids"])
                self.faults[th["fault"]]["stale_processes_left"] = len(left)
                self.log(f"    [{self.policy}] {STALE_CHECK_S:.0f} s after the thaw, {len(left)} of its "
                         f"{len(th['pids'])} stale processes still run; node removed")
                self.thawed.remove(th)
                if th["node"] in self.cluster.nodes:
                    self._timed(self.cluster.remove_node, th["node"])  # reap what is left

    def cleanup(self) -> None:
        from bench.compare import _kill_if_stopped

        for pid in self.stopped:
            _kill_if_stopped(pid)
        # A node still frozen is left to LocalCluster.shutdown, which kills
        # it: woken now, its stale processes would talk to a cluster going down.


def run_chaos(cluster, policy: str, steps: int, *, per_step_s: float, ckpt_path: Optional[str],
              seed: int = 0, interval_s: tuple = INTERVAL_S, kinds: Sequence[str] = KINDS,
              max_faults: Optional[int] = None, factory=None, log=_print,
              cap_s: Optional[float] = None) -> tuple[dict, Optional[dict]]:
    """One chaos run of `steps` steps; returns (figures, final state).
    `cap_s`: end the run sooner, at the first step boundary after that many
    seconds where every slice is live (so a run lasts its minutes whatever
    the machine's speed; the reference then runs the steps it completed)."""
    from bench.compare import _markers, _recorder
    from ray_elastic import CheckpointConfig, ElasticTrainer

    cluster.ensure_nodes(SLICES)
    rec = _recorder()
    checkpoint = CheckpointConfig(ckpt_path, save_every=SAVE_EVERY, keep=KEEP) if ckpt_path else None
    trainer = ElasticTrainer(factory or lm_factory(), _config(policy), steps, callbacks=[rec],
                             checkpoint=checkpoint, keep_final_state=True)
    work: queue.Queue = queue.Queue()
    chaos = _Chaos(cluster, trainer, rec, steps=steps, per_step_s=per_step_s, rng=random.Random(seed),
                   interval_s=interval_s, kinds=kinds, policy=policy, log=log, max_faults=max_faults,
                   cluster_work=work)
    rec.hooks_event.append(chaos.on_event)
    rec.hooks_step.append(chaos.on_step)
    error = None
    t0 = time.monotonic()

    def cap(step: int, metrics: dict) -> None:
        # The trainer's loop ends once its step count is reached: lowering
        # it ends the run normally (final checkpoint, final state).
        if cap_s is not None and time.monotonic() - t0 >= cap_s and step < trainer.steps and chaos.healed() \
                and metrics["slices"] == SLICES:
            log(f"    [{policy}] {cap_s / 60:.0f} min passed: the run ends at step {step}")
            trainer.steps = step

    rec.hooks_step.append(cap)
    failed: list = []

    def fit() -> None:
        try:
            trainer.fit()
        except Exception as e:  # noqa: BLE001 (reported, and a FAIL)
            failed.append(f"{type(e).__name__}: {str(e)[:500]}")
        finally:
            work.put(None)

    # The controller on a thread of its own; this (main) thread makes the
    # cluster changes the faults call for (replacement nodes).
    controller = threading.Thread(target=fit, name="controller", daemon=True)
    controller.start()
    try:
        for fn, args in iter(work.get, None):
            fn(*args)
        controller.join()
    finally:
        chaos.cleanup()
    error = failed[0] if failed else None
    log(f"    [{policy}] done in {time.monotonic() - t0:.0f} s{': ' + error if error else ''}")
    report = trainer.report
    out = analyse(report, rec.steps, chaos, policy=policy, steps=trainer.steps, error=error)
    out["markers"] = _markers(report.events) + [{"t": f["t"], "event": "fault"} for f in chaos.faults]
    out["markers"].sort(key=lambda m: m["t"])
    out["settings"].update(seed=seed, interval_s=list(interval_s), kinds=list(kinds),
                           checkpoint=ckpt_path, save_every=SAVE_EVERY if ckpt_path else None)
    return out, trainer.final_state


def analyse(report, steps_seen: list, chaos: _Chaos, *, policy: str, steps: int, error: Optional[str]) -> dict:
    """Per-fault detection and recovery from the run's events, and the
    run's totals."""
    events = report.events
    detections = [e for e in events if e["event"] == "detected"]
    used: set = set()  # indices of detections matched to an injected fault
    rows = []
    for f in chaos.faults:
        row = {k: v for k, v in f.items() if k not in ("pid", "recovered_logged")}
        j = next((j for j, e in enumerate(detections) if j not in used and e["t"] >= f["t"]
                  and e.get("slice") == f["slice"]), None)
        det = None if j is None else detections[j]
        if j is not None:
            used.add(j)
        notice = None
        if f["kind"] in NOTICE_KINDS:
            notice = next((e for e in events if e["event"] == "preempt_notice" and e["t"] >= f["t"]
                           and e.get("slice") == f["slice"]), None)
        seen = notice if f["kind"] in NOTICE_KINDS else det
        row["detected_s"] = round(seen["t"] - f["t"], 4) if seen else None
        row["failure_kind"] = det.get("kind") if det else None
        row["cause"] = (det.get("cause") or "")[:200] if det else None
        row["recovered_s"] = None
        if det is not None:
            nxt = next((t for t, _, _ in steps_seen if t > det["t"]), None)
            row["recovered_s"] = None if nxt is None else round(nxt - f["t"], 4)
            back = next((e for e in events if e["event"] == "recovered" and e["t"] >= det["t"]
                         and e.get("slice") == f["slice"]), None)
            if back is not None:
                row["steps_rewound"] = back.get("steps_rewound")
                row["restored_from"] = back.get("restored_from")
                row["slices_after"] = back.get("slices_after")
        rows.append(row)
    # Failures the bench did not cause (or a second one from one fault).
    unexpected = [{k: e.get(k) for k in ("t", "kind", "slice", "step", "cause")}
                  for j, e in enumerate(detections) if j not in used]
    by_kind = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        by_kind[kind] = {
            "n": len(mine),
            "detected_as": sorted({r["failure_kind"] or "—" for r in mine}),
            "detected_s": summary([r["detected_s"] for r in mine]),
            "recovered_s": summary([r["recovered_s"] for r in mine]),
            "steps_rewound": summary([r.get("steps_rewound") for r in mine]),
            "not_recovered": sum(1 for r in mine if r["recovered_s"] is None),
        }
    start_t = next((e["t"] for e in events if e["event"] == "start"), 0.0)
    wall = report.wall_s
    after_start = max(1e-9, wall - start_t)
    steady = steady_step_time(report)
    recovered = sum(r["recovered_s"] or 0.0 for r in rows)
    thin = max(1, len(steps_seen) // 3000)
    return {
        "policy": policy,
        "slices": SLICES,
        "steps_requested": steps,
        "steps_completed": report.steps_completed,
        "outcome": report.outcome,
        "error": error or (report.error or None),
        "wall_s": round(wall, 3),
        "start_s": round(start_t, 3),
        "productive_s": round(report.productive_s, 3),
        "goodput": round(report.goodput, 4),
        "goodput_after_start": round(report.productive_s / after_start, 4),
        "goodput_after_start_less_bench": round(report.productive_s / max(1e-9, after_start - chaos.bench_s), 4),
        "step_time_s": steady,
        "steps_run": len(steps_seen),
        "steps_redone_total": len(steps_seen) - report.steps_completed,
        "failures": rows,
        "failures_recorded": len(report.failures),
        "failures_unrecovered": sum(1 for f in report.failures if f.recovered_s is None),
        "unexpected_failures": unexpected,
        "bench_errors": chaos.errors,
        "by_kind": by_kind,
        "detected_s": summary([r["detected_s"] for r in rows]),
        "recovered_s": summary([r["recovered_s"] for r in rows]),
        "steps_rewound": summary([r.get("steps_rewound") for r in rows]),
        "checkpoints": len(report.checkpoints),
        "restores": [{k: e.get(k) for k in ("t", "source", "step")} for e in events if e["event"] == "restore"],
        "lost_s": {
            "start_up": round(start_t, 3),
            "fault_to_next_step": round(recovered, 3),
            "bench_node_changes": round(chaos.bench_s, 3),
            "other": round(wall - start_t - report.productive_s - recovered - chaos.bench_s, 3),
        },
        "timeline": [[t, s] for t, s, _ in steps_seen[::thin]],
        "settings": {"policy": policy, "slices": SLICES, "health_checks": "default",
                     "drain_deadline_s": DRAIN_DEADLINE_S, "stop_at_step": chaos.stop_at_step},
    }


# --------------------------------------------------------------------------
# Reference and the bitwise check.
# --------------------------------------------------------------------------


def run_reference(steps: int, factory=None, log=_print) -> tuple[dict, dict]:
    """A failure-free run of `steps` steps on a fresh cluster."""
    from ray_elastic import ElasticTrainer

    cluster = _cluster()
    try:
        trainer = ElasticTrainer(factory or lm_factory(), _config("pause"), steps, keep_final_state=True)
        report = trainer.fit()
    finally:
        cluster.shutdown()
    info = {"steps": steps, "steps_completed": report.steps_completed, "wall_s": round(report.wall_s, 3),
            "step_time_s": steady_step_time(report), "failures": len(report.failures)}
    log(f"  reference: {steps} steps in {report.wall_s:.0f} s")
    return info, trainer.final_state


def _leaves(tree) -> list[tuple[str, object]]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), v) for p, v in flat]


def bitwise(state, reference) -> dict:
    """Every array of `state` equal to `reference`'s (np.array_equal)."""
    import numpy as np

    if state is None or reference is None:
        return {"equal": False, "arrays": 0, "mismatched": [], "why": "no final state"}
    a, b = _leaves(state), _leaves(reference)
    if [k for k, _ in a] != [k for k, _ in b]:
        return {"equal": False, "arrays": len(a), "mismatched": [], "why": "different tree structure"}
    bad = [k for (k, x), (_, y) in zip(a, b) if not np.array_equal(np.asarray(x), np.asarray(y))]
    return {"equal": not bad, "arrays": len(a), "mismatched": bad[:20]}


# --------------------------------------------------------------------------
# The whole soak.
# --------------------------------------------------------------------------


def checks(result: dict) -> list[str]:
    """FAIL lines (empty: passed)."""
    fails = []
    for policy, r in result["runs"].items():
        if r["error"] or r["outcome"] != "completed" or r["steps_completed"] != r["steps_requested"]:
            fails.append(f"{policy}: the run did not finish ({r['steps_completed']}/{r['steps_requested']} steps, "
                         f"outcome {r['outcome']}, error {r['error']})")
        if not r["failures"]:
            fails.append(f"{policy}: no fault was injected")
        for f in r["failures"]:
            if f["detected_s"] is None or f["recovered_s"] is None:
                fails.append(f"{policy}: fault {f['i']} ({f['kind']}, slice {f['slice']} at {f['t']:.1f} s) "
                             f"{'not detected' if f['detected_s'] is None else 'not recovered'}")
        if r.get("bench_errors"):
            fails.append(f"{policy}: the bench's own errors: {r['bench_errors'][:3]}")
        if r["failures_unrecovered"]:
            fails.append(f"{policy}: {r['failures_unrecovered']} failure(s) in the report never recovered")
        missing = sorted(set(result["settings"]["kinds"]) - set(r["by_kind"]))
        if missing and not result["settings"].get("partial_kinds_ok"):
            fails.append(f"{policy}: fault kinds never injected: {missing}")
        bw = r.get("bitwise")
        if bw is not None and not bw["equal"]:
            fails.append(f"{policy}: final state differs from the failure-free run "
                         f"({bw.get('why') or str(len(bw['mismatched'])) + ' arrays: ' + ', '.join(bw['mismatched'][:5])})")
    return fails


def run(minutes: float = 30.0, policies: Sequence[str] = POLICIES, *, seed: int = 0,
        interval_s: tuple = INTERVAL_S, kinds: Sequence[str] = KINDS, steps: Optional[int] = None,
        warmup_steps: int = WARMUP_STEPS, reference: bool = True, max_faults: Optional[int] = None,
        partial_path: Optional[str] = None, factory=None, log=_print, time_cap: bool = False) -> dict:
    """The soak: warm-up (unless `steps` is given), a chaos run per policy,
    the failure-free reference, the checks. Returns everything soak.json
    holds."""
    from tests.fake_gcs import FakeGcs

    t_start = time.monotonic()
    gcs = FakeGcs().start()
    gcs.point_env()
    gcs.make_bucket("soak")
    tag = time.strftime("%Y%m%d-%H%M%S")
    result: dict = {"settings": {
        "minutes": minutes, "policies": list(policies), "slices": SLICES, "hosts_per_slice": 1,
        "health_checks": "default (Ray's own)", "interval_s": list(interval_s), "kinds": list(kinds),
        "seed": seed, "checkpoint": f"gs://soak/{tag}-<policy> on fake-gcs-server", "save_every": SAVE_EVERY,
        "keep": KEEP, "drain_deadline_s": DRAIN_DEADLINE_S, "goodput_guess": GOODPUT_GUESS,
        "end_margin_s": END_MARGIN_S, "cpus": os.cpu_count(), "max_faults": max_faults,
        "partial_kinds_ok": steps is not None,  # a smoke run with a fixed, short step count
    }, "runs": {}}
    states = {}
    try:
        for i, policy in enumerate(policies):
            cluster = _cluster()
            try:
                if i == 0:
                    if steps is None:
                        w = warmup(cluster, f"gs://soak/{tag}-warmup", warmup_steps, factory=factory)
                        steps = plan_steps(minutes, w["per_step_s"], policies)
                        w["planned_steps"] = steps
                        result["warmup"] = w
                        log(f"  warm-up: {w['per_step_s'] * 1e3:.1f} ms per step after a {w['start_s']:.0f} s "
                            f"start-up -> {steps} steps per run")
                        per_step = w["per_step_s"]
                    else:
                        per_step = minutes * 60.0 / steps
                    result["settings"]["steps"] = steps
                log(f"  chaos, {policy}: {steps} steps, a fault every {interval_s[0]:.0f}-{interval_s[1]:.0f} s")
                r, state = run_chaos(cluster, policy, steps, per_step_s=per_step,
                                     ckpt_path=f"gs://soak/{tag}-{policy}", seed=seed + i,
                                     interval_s=interval_s, kinds=kinds, max_faults=max_faults,
                                     factory=factory, log=log, cap_s=minutes * 60.0 if time_cap and i == 0 else None)
                if time_cap and i == 0 and r["steps_completed"] < steps:
                    # The later runs and the reference take the steps this one completed.
                    steps = r["steps_completed"]
                    result["settings"]["steps"] = steps
            finally:
                cluster.shutdown()
            result["runs"][policy] = r
            states[policy] = state
            if partial_path:  # kept if a later phase dies
                with open(partial_path, "w") as f:
                    json.dump(result, f, indent=1, default=str)
            log(f"  {policy}: {len(r['failures'])} faults, goodput {r['goodput']:.1%}, "
                f"{r['steps_completed']}/{steps} steps")
        if reference:
            info, ref_state = run_reference(steps, factory=factory, log=log)
            result["reference"] = info
            for policy in policies:
                result["runs"][policy]["bitwise"] = bitwise(states[policy], ref_state)
                eff = result["runs"][policy]
                step_s = info["step_time_s"]
                eff["goodput_throughput"] = round(eff["steps_completed"] * step_s /
                                                  max(1e-9, eff["wall_s"] - eff["start_s"]), 4)
    finally:
        gcs.stop()
        shutil.rmtree(gcs.root, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["fails"] = checks(result)
    return result


# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------


def _fmt(summ: Optional[dict], spec: str = ".2f") -> str:
    if not summ or not summ.get("n"):
        return "—"
    if summ["n"] == 1 or summ["min"] == summ["max"]:
        return format(summ["median"], spec)
    return f"{format(summ['median'], spec)} [{format(summ['min'], spec)}–{format(summ['max'], spec)}]"


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.1%}"


KIND_NAMES = {"kill": "worker SIGKILL", "remove_node": "node removed", "stop": "worker SIGSTOP (hang)",
              "freeze_node": "node frozen", "drain": "drain notice (30 s deadline)",
              "term": "worker SIGTERM"}


def table(result: dict) -> str:
    st = result["settings"]
    lines = []
    for policy, r in result["runs"].items():
        lines += [
            f"#### Soak, {policy}: {r['slices']} slices × 1 host, Ray's default health checks, "
            f"checkpoints every {st['save_every']} steps on gs:// (fake-gcs-server); {r['steps_requested']} steps "
            f"in {r['wall_s'] / 60:.1f} min",
            "",
            "| fault | n | detected as | detection (s) | fault → next step (s) | steps redone |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for kind, k in r["by_kind"].items():
            lines.append(f"| {KIND_NAMES.get(kind, kind)} | {k['n']} | {', '.join(k['detected_as'])} "
                         f"| {_fmt(k['detected_s'])} | {_fmt(k['recovered_s'])} | {_fmt(k['steps_rewound'], '.0f')} |")
        lines.append(f"| **all** | {len(r['failures'])} | | {_fmt(r['detected_s'])} | {_fmt(r['recovered_s'])} "
                     f"| {_fmt(r['steps_rewound'], '.0f')} |")
        lines.append("")
    pols = list(result["runs"])
    head = "| figure | " + " | ".join(pols) + " |"
    lines += [head, "|---|" + "---:|" * len(pols)]

    def row(name, fn):
        lines.append(f"| {name} | " + " | ".join(fn(result["runs"][p]) for p in pols) + " |")

    row("run length", lambda r: f"{r['wall_s'] / 60:.1f} min")
    row("steps completed / requested", lambda r: f"{r['steps_completed']} / {r['steps_requested']}")
    row("faults injected (detected, recovered)", lambda r: "{} ({}, {})".format(
        len(r["failures"]), sum(f["detected_s"] is not None for f in r["failures"]),
        sum(f["recovered_s"] is not None for f in r["failures"])))
    row("failures the run reported (unrecovered)", lambda r: f"{r['failures_recorded']} ({r['failures_unrecovered']})")
    row("failures not caused by the bench", lambda r: str(len(r["unexpected_failures"])))
    row("steps redone, sum over the faults (completed steps rolled back)", lambda r: "{} ({})".format(
        sum(f.get("steps_rewound") or 0 for f in r["failures"]), r["steps_redone_total"]))
    row("goodput, whole run", lambda r: _pct(r["goodput"]))
    row("goodput from the first step", lambda r: _pct(r["goodput_after_start"]))
    row("… less the bench's node changes in the driver's thread",
        lambda r: f"{_pct(r['goodput_after_start_less_bench'])} ({r['lost_s']['bench_node_changes']:.0f} s)")
    row("effective throughput (steps × failure-free step time / time since start)",
        lambda r: _pct(r.get("goodput_throughput")))
    row("checkpoints committed", lambda r: str(r["checkpoints"]))
    row("frozen node declared dead by Ray after (s)", lambda r: _fmt(summary(
        [f.get("declared_dead_s") for f in r["failures"] if f["kind"] == "freeze_node"]), ".0f"))
    row("bitwise equal to the failure-free run", lambda r: "—" if r.get("bitwise") is None else (
        f"yes ({r['bitwise']['arrays']} arrays)" if r["bitwise"]["equal"]
        else f"NO ({len(r['bitwise']['mismatched'])} of {r['bitwise']['arrays']} arrays differ)"))
    ref = result.get("reference")
    lines.append("")
    if ref:
        lines.append(f"Failure-free reference: {ref['steps']} steps, {ref['wall_s'] / 60:.1f} min, "
                     f"step time {ref['step_time_s'] * 1e3:.1f} ms (fresh cluster, no checkpoints).")
    lines.append("PASS: every fault detected and recovered, every run finished"
                 + (", final states bitwise equal" if ref else "") if not result["fails"]
                 else "\n".join(f"FAIL: {x}" for x in result["fails"]))
    return "\n".join(lines)


def write(result: dict, out: str) -> dict:
    """soak.json, soak.md and a timeline PNG per run under `out`."""
    os.makedirs(out, exist_ok=True)
    files = {"json": os.path.join(out, "soak.json"), "md": os.path.join(out, "soak.md"), "png": []}
    with open(files["json"], "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = table(result)
    with open(files["md"], "w") as f:
        f.write(text + "\n")
    try:
        from bench.charts import timeline_png

        for policy, r in result["runs"].items():
            path = os.path.join(out, f"timeline-soak-{policy}.png")
            timeline_png([{**r, "system": f"ray_elastic-{policy}", "scenario": "soak",
                           "detected_s": r["detected_s"].get("median"),
                           "recovered_s": r["recovered_s"].get("median"),
                           "steps_rewound": sum(f.get("steps_rewound") or 0 for f in r["failures"])}],
                         path, title=f"soak / {policy}")
            files["png"].append(path)
    except Exception as e:  # noqa: BLE001 (a chart is not worth losing the figures)
        files["chart_error"] = str(e)
    return files

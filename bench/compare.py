"""ray_elastic side by side with Ray Train and a full restart, on the same
local multi-node Ray cluster, the same model (examples/lm.py) and the
same faults (`python -m bench compare [--quick] [--runs N] [--out DIR]`).

Systems:
- ray_elastic-pause / ray_elastic-resize: `ElasticTrainer`, 2 slices of one
  host, in-memory snapshots every step (the defaults);
- raytrain: Ray Train v2 `JaxTrainer`, 2 workers,
  `FailureConfig(max_failures=3)`, restoring its last checkpoint (every 10
  steps) — bench/raytrain.py;
- raytrain-elastic: the same with `ScalingConfig(num_workers=(1, 2))`;
- full-restart: a plain 2-process JAX job (no Ray) that checkpoints every
  10 steps and is started again at once when it fails.

Scenarios: kill (SIGKILL of a worker), remove_node (its node leaves the
cluster, a replacement node is added), stop (SIGSTOP: a hung worker),
preempt (a Ray drain notice with a 10 s deadline for a worker's node;
replacement capacity is added at the notice, the drained node removed once
the system has left it or at the deadline), and chaos (ray_elastic resize,
3 slices, a SIGKILL or node loss every 30-60 s over a bounded run).

Figures per run, as ray_elastic's report defines them: detection (fault to
the system noticing), fault to next completed step, steps redone, throughput
while degraded (steps/s on fewer workers, as a share of full-size steps/s),
goodput (time in the kept steps / wall time, start-up included); plus the
step-time overhead of snapshots and of checkpoints, and the goals.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

from bench.common import DaemonCpu, ensure_nodes, idle_cpu_load, lm_factory, steady_step_time, summary

SYSTEMS = ("ray_elastic-pause", "ray_elastic-pause-spare", "ray_elastic-resize", "raytrain", "raytrain-elastic",
           "full-restart")
SCENARIOS = ("kill", "remove_node", "stop", "preempt", "chaos")
ELASTIC = ("ray_elastic-pause", "ray_elastic-pause-spare", "ray_elastic-resize")

# Cells a system cannot do (or the bench does not run), with the reason.
NOT_APPLICABLE = {
    ("full-restart", "remove_node"): "n/a: the plain job runs outside Ray, with no nodes to lose "
                                     "(a lost node ends it as kill does)",
    ("full-restart", "stop"): "n/a: a plain jax.distributed job has no hang detection "
                              "(the other ranks wait in the collective)",
    ("full-restart", "preempt"): "n/a: no drain notices outside Ray (the node's loss at the "
                                 "deadline is the kill case)",
    ("ray_elastic-pause", "chaos"): "not run: chaos runs resize, and pause with a hot spare",
    ("raytrain", "chaos"): "not run: the peer runners inject one fault per run",
    ("raytrain-elastic", "chaos"): "not run: the peer runners inject one fault per run",
    ("full-restart", "chaos"): "not run: the peer runners inject one fault per run",
}

# chaos_spare_goodput: issue #13's target (3 slices + 1 hot spare, pause).
GOALS = {"recovery_x": 4.0, "steps_redone": 1, "chaos_goodput": 0.90, "chaos_spare_goodput": 0.97}

# Settings shared by every single-fault run.
CHECKPOINT_EVERY = 10  # Ray Train and the full restart; ray_elastic on preempt
HANG_TIMEOUT_S = 10.0  # Ray Train's worker health-check timeout (Ray's default: 600 s)
STEP_DEADLINE_FLOOR_S = 2.0  # ray_elastic's hang floor (default 10 s)
PREEMPT_DEADLINE_S = 10.0


class _TimeUp(Exception):
    """Raised from a callback to end a bounded (chaos) run."""


def _recorder():
    """A ray_elastic Callback that records every completed step on the
    trainer's clock (the one its events use), and passes steps and events
    on to hooks."""
    from ray_elastic.callbacks import Callback

    class Recorder(Callback):
        def __init__(self):
            self.trainer = None
            self.steps: list[tuple[float, int, int]] = []  # (t, step, slices)
            self.hooks_step: list[Callable] = []
            self.hooks_event: list[Callable] = []

        def now(self) -> float:
            tr = self.trainer
            return tr.elapsed_s()

        def on_start(self, trainer):
            self.trainer = trainer

        def on_step(self, step, metrics):
            self.steps.append((round(self.now(), 4), step, metrics["slices"]))
            for h in self.hooks_step:
                h(step, metrics)

        def on_event(self, event):
            for h in self.hooks_event:
                h(event)

    return Recorder()


def _kill_if_stopped(pid) -> None:
    """SIGKILL a worker this bench froze with SIGSTOP, if it is still that
    frozen process (Ray normally ends it when the slice is torn down)."""
    import psutil

    try:
        if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
            os.kill(pid, signal.SIGKILL)
    except (psutil.Error, ProcessLookupError, TypeError, ValueError):
        pass


_MARKED = ("fault", "detected", "restore", "shrink", "grow", "recovered", "wait", "drain_notice",
           "preempt_notice", "preempt_saved", "rewind", "slice_ready")
_NOTICE = ("preempt_notice", "drain_notice")  # the controller's name for it, new and old


def _markers(events: list[dict]) -> list[dict]:
    started = False
    out = []
    for e in events:
        if e["event"] == "start":
            started = True
        if e["event"] in _MARKED and (started or e["event"] != "slice_ready"):
            m = {"t": e["t"], "event": e["event"]}
            if e["event"] == "restore":
                m["step"] = e.get("step")
            out.append(m)
    return out


def _degraded(points: list[tuple], full: int, after_t: Optional[float]) -> dict:
    """points: (t, step, size, duration) of kept steps. Throughput while
    degraded: steps on fewer than `full` workers after the fault, median
    step time against the full-size median."""
    if after_t is None:
        return {"steps": 0, "ratio": None}
    full_d = [d for t, s, n, d in points if n == full and d]
    deg_d = [d for t, s, n, d in points if t > after_t and 0 < n < full and d]
    if not deg_d or not full_d:
        return {"steps": len(deg_d), "ratio": None}
    return {"steps": len(deg_d), "ratio": round(statistics.median(full_d) / statistics.median(deg_d), 4),
            "step_time_s": round(statistics.median(deg_d), 5)}


RATE_WINDOW = 10  # steps: one checkpoint period, so a periodic stall is in every window as in the reference
RATE_SHARE = 0.9
RATE_SKIP = 5  # warm-up steps left out of the reference rate


def _frontier(timeline: list) -> list[tuple[float, int]]:
    """(t, step) of the completions that are new progress: a step above
    every step completed before it (redone steps are not progress)."""
    out, top = [], 0
    for t, s in sorted(((float(t), int(s)) for t, s in timeline), key=lambda x: x[0]):
        if s > top:
            top = s
            out.append((t, s))
    return out


def user_recovery(timeline: list, fault_t: Optional[float], degraded_ratio: Optional[float] = None,
                  window: int = RATE_WINDOW, share: float = RATE_SHARE) -> dict:
    """Recovery as users feel it (bench/README.md defines it):

    - reference rate: the run's own failure-free rate, new steps per second
      from step RATE_SKIP to the last step completed before the fault; times
      the throughput-while-degraded ratio when that is below 1 (a system
      that trains on at a lower rate is back once it runs at that rate);
    - rate_recovered_s: fault to the completion of the first new step after
      it from which the next `window` new steps run at >= `share` of the
      reference rate;
    - lost_s: the steps a failure-free run makes at the failure-free rate
      from the fault to that moment, minus the new steps made, times the
      failure-free step time; lost_end_s: the same to the end of the run
      (the degraded stretch and any later grow-back included).
    """
    front = _frontier(timeline or [])
    if fault_t is None or not front:
        return {}
    pre = [(t, s) for t, s in front if t <= fault_t and s >= RATE_SKIP]
    if len(pre) < 2 or pre[-1][0] <= pre[0][0]:
        return {}
    pre_rate = (pre[-1][1] - pre[0][1]) / (pre[-1][0] - pre[0][0])
    ref = pre_rate * min(1.0, degraded_ratio) if degraded_ratio else pre_rate
    s_f = max((s for t, s in front if t <= fault_t), default=0)
    post = [(t, s) for t, s in front if t > fault_t]
    out = {"pre_rate": round(pre_rate, 3), "ref_rate": round(ref, 3), "window": window, "share": share,
           "rate_recovered_s": None, "lost_s": None, "lost_end_s": None}
    if post:
        t_end, s_end = post[-1]
        out["lost_end_s"] = round((t_end - fault_t) - (s_end - s_f) / pre_rate, 3)
    for i in range(len(post) - window):
        (ta, sa), (tb, sb) = post[i], post[i + window]
        if tb > ta and (sb - sa) / (tb - ta) >= share * ref:
            out["rate_recovered_s"] = round(ta - fault_t, 4)
            out["lost_s"] = round((ta - fault_t) - (sa - s_f) / pre_rate, 3)
            break
    return out


def _add_user_recovery(r: dict) -> dict:
    ratio = (r.get("degraded") or {}).get("ratio")
    u = user_recovery(r.get("timeline") or [], r.get("fault_t"), ratio)
    r["rate"] = u
    r["rate_recovered_s"] = u.get("rate_recovered_s")
    r["lost_s"] = u.get("lost_s")
    r["lost_end_s"] = u.get("lost_end_s")
    return r


# --------------------------------------------------------------------------
# ray_elastic runs.
# --------------------------------------------------------------------------


def run_elastic(cluster, policy: str, scenario: str, steps: int, fail_at: int, *,
                factory=None, num_slices: int = 2, checkpoint_every: int = CHECKPOINT_EVERY,
                preempt_deadline_s: float = PREEMPT_DEADLINE_S, spare_slices: int = 0) -> dict:
    """One ray_elastic run with one fault on slice 1 while step `fail_at` is
    in flight (preempt: the notice after step `fail_at` completes)."""
    from ray_elastic import CheckpointConfig, ElasticConfig, ElasticTrainer, Fault
    from ray_elastic.cluster.drain import drain_node

    if scenario not in ("kill", "remove_node", "stop", "preempt", "none"):
        raise ValueError(f"unknown scenario {scenario!r}")
    ensure_nodes(cluster, num_slices + spare_slices)
    factory = factory or lm_factory()
    rec = _recorder()
    state: dict = {"added": False, "stopped": []}
    ext = cluster.external_nodes()
    faults = () if scenario in ("preempt", "none") else (Fault(scenario, 1, fail_at),)
    ckpt_dir = None
    checkpoint = None
    if scenario == "preempt":
        ckpt_dir = tempfile.mkdtemp(prefix="bench-elastic-ckpt-")
        checkpoint = CheckpointConfig(ckpt_dir, save_every=checkpoint_every, keep=2)
    config = ElasticConfig(num_slices=num_slices, policy=policy, step_deadline_floor_s=STEP_DEADLINE_FLOOR_S,
                           spare_slices=spare_slices)
    trainer = ElasticTrainer(factory, config, steps, faults=faults, remove_node=cluster.remove_node,
                             callbacks=[rec], checkpoint=checkpoint)

    def on_event(e):
        ev = e["event"]
        if ev == "fault" and scenario == "stop":
            state["stopped"].append(trainer.hosts(e["slice"])[e.get("host", 0)]["pid"])
        if scenario == "remove_node" and not state["added"] and ev == "detected":
            # The replacement node comes once the run has noticed the loss
            # (and queued the replacement an autoscaler would see), started
            # as its own `ray start` process from a background thread: the
            # controller's thread is not held up.
            state["added"] = True
            ext.add()
        if scenario == "preempt" and ev in ("shrink", "wait") and state.get("drained") in cluster.nodes:
            cluster.remove_node(state["drained"])  # the system has left it: the cloud takes it

    def on_step(step, metrics):
        if scenario == "preempt" and step == max(1, fail_at - 10) and "spare" not in state:
            # The replacement capacity arrives with the notice. Adding a node
            # blocks this (the controller's) thread for a second or two, so
            # it is added 10 steps before the notice, off the measured clock
            # (and so as not to line up the controller's 0.5 s drain poll).
            state["spare"] = cluster.add_node()
        if scenario == "preempt" and step == fail_at and "drained" not in state:
            node = trainer.hosts(1)[0]["node_id"]
            state.update(drained=node, notice_t=rec.now())
            if not drain_node(node, deadline_s=preempt_deadline_s):
                state["refused"] = True
        d = state.get("drained")
        if d in cluster.nodes and rec.now() >= state["notice_t"] + preempt_deadline_s:
            cluster.remove_node(d)  # the deadline: gone whatever the system did

    rec.hooks_event.append(on_event)
    rec.hooks_step.append(on_step)
    error = None
    try:
        report = trainer.fit()
    except Exception as e:  # noqa: BLE001 (reported in the result)
        report, error = trainer.report, f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        for pid in state["stopped"]:
            _kill_if_stopped(pid)
        if state.get("drained") in cluster.nodes:
            cluster.remove_node(state["drained"])
        if ext.procs or ext.threads:
            state["external_nodes"] = len(ext.procs)
            ext.stop_all()
        if ckpt_dir:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    events = report.events
    markers = _markers(events)
    out = {
        "system": f"ray_elastic-{policy}",
        "scenario": scenario,
        "steps_requested": steps,
        "steps_completed": report.steps_completed,
        "fail_at": fail_at,
        "wall_s": round(report.wall_s, 3),
        "productive_s": round(report.productive_s, 3),
        "goodput": round(report.goodput, 4),
        "step_time_s": steady_step_time(report),
        "fault_t": None,
        "detected_s": None,
        "recovered_s": None,
        "steps_rewound": None,
        "failure_kind": None,
        "timeline": [[t, s] for t, s, _ in rec.steps],
        "markers": markers,
        "error": error or (report.error or None),
        "notes": ["the drain request was refused"] if state.get("refused") else [],
        "settings": {"policy": policy, "slices": num_slices, "step_deadline_floor_s": STEP_DEADLINE_FLOOR_S,
                     "checkpoint_every": checkpoint_every if checkpoint else None,
                     "preempt_deadline_s": preempt_deadline_s if scenario == "preempt" else None},
    }
    f = report.failures[0] if report.failures else None
    if scenario == "preempt" and "notice_t" in state:
        t_notice = state["notice_t"]
        out["fault_t"] = round(t_notice, 4)
        markers.insert(0, {"t": round(t_notice, 4), "event": "fault"})
        markers.sort(key=lambda m: m["t"])
        notice = next((e for e in events if e["event"] in _NOTICE and e["t"] >= t_notice), None)
        det = next((e for e in events if e["event"] == "detected" and e["t"] >= t_notice), None)
        if notice is not None:
            out["detected_s"] = round(notice["t"] - t_notice, 4)
        if det is not None:
            nxt = next((t for t, _, _ in rec.steps if t > det["t"]), None)
            out["recovered_s"] = None if nxt is None else round(nxt - t_notice, 4)
    elif f is not None:
        fault_ev = next((e for e in events if e["event"] == "fault"), None)
        out["fault_t"] = fault_ev["t"] if fault_ev else None
        out["detected_s"], out["recovered_s"] = f.detected_s, f.recovered_s
    if f is not None:
        out["steps_rewound"] = f.steps_rewound
        out["failure_kind"] = f.kind
    # Kept steps with their sizes and durations, on the recorder's clock.
    kept_t = {}
    for t, s, _ in rec.steps:
        kept_t[s] = t  # the last completion of each step is the kept one
    points = [(kept_t.get(i + 1, 0.0), i + 1, n, d)
              for i, (n, d) in enumerate(zip(report.slices_per_step, report.step_times))]
    out["degraded"] = _degraded(points, num_slices, out["fault_t"])
    if state.get("external_nodes"):
        out["settings"]["replacement_node"] = "ray start process, background thread, at detection"
    return _add_user_recovery(out)


def run_chaos(cluster, duration_s: float, *, factory=None, num_slices: int = 3,
              interval_s: tuple = (30.0, 60.0), kinds: Sequence[str] = ("kill", "remove_node"),
              seed: int = 0, policy: str = "resize", spare_slices: int = 0, log=print) -> dict:
    """ray_elastic (`policy`, `spare_slices` hot spares) on `num_slices`
    slices; every 30-60 s (a seeded random draw) a random live slice loses
    its worker (SIGKILL) or its node. A node is removed, and a replacement
    node started as its own `ray start` process, from a background thread,
    as a cloud takes a machine and an autoscaler adds one: the controller's
    thread is never held up by the bench. A fault waits until the last one
    is healed (every slice and spare up again). The run is ended after
    `duration_s` of wall time since its start."""
    from ray_elastic import ElasticConfig, ElasticTrainer

    ensure_nodes(cluster, num_slices + spare_slices)
    factory = factory or lm_factory()
    rng = random.Random(seed)
    rec = _recorder()
    config = ElasticConfig(num_slices=num_slices, policy=policy, max_retries=1000, spare_slices=spare_slices,
                           step_deadline_floor_s=STEP_DEADLINE_FLOOR_S)
    trainer = ElasticTrainer(factory, config, 10 ** 7, callbacks=[rec])
    st: dict = {"next": None, "faults": [], "changing": [], "start_t": None, "bench_s": 0.0}
    ext = cluster.external_nodes()

    def on_event(e):
        if e["event"] == "start":
            st["start_t"] = e["t"]
            st["next"] = e["t"] + rng.uniform(*interval_s)

    def replace_node(node_id: str) -> None:
        # Off the controller's thread: the machine goes (its raylet and
        # workers SIGKILLed), then a new one is started.
        if node_id in cluster.nodes:
            cluster.remove_node(node_id)
        elif not ext.remove(node_id):
            log(f"    chaos: node {node_id} is neither the cluster's nor the bench's")
        ext.add()

    def on_step(step, metrics):
        now = rec.now()
        if now >= duration_s:
            raise _TimeUp()
        if st["next"] is None or now < st["next"]:
            return
        m = trainer.members
        if len(m.live) < num_slices or m.coming or len(m.ready) != spare_slices or any(
                t.is_alive() for t in st["changing"]):
            return  # the last failure is not healed yet: fire once it is
        s = rng.choice(sorted(trainer.members.live))
        kind = rng.choice(list(kinds))
        info = trainer.hosts(s)[0]
        t = rec.now()
        if kind == "kill":
            os.kill(info["pid"], signal.SIGKILL)
        else:
            t0 = time.monotonic()
            th = threading.Thread(target=replace_node, args=(info["node_id"],), daemon=True, name="bench-chaos-node")
            th.start()
            st["changing"].append(th)
            st["bench_s"] += time.monotonic() - t0
        st["faults"].append({"t": round(t, 4), "kind": kind, "slice": s, "after_step": step})
        log(f"    chaos: {kind} slice {s} at {t:.1f} s (step {step})")
        st["next"] = t + rng.uniform(*interval_s)

    rec.hooks_event.append(on_event)
    rec.hooks_step.append(on_step)
    error = None
    daemons = DaemonCpu()
    try:
        with daemons:
            trainer.fit()
    except _TimeUp:
        pass
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        for th in st["changing"]:
            th.join(timeout=60)
        ext.stop_all()
    report = trainer.report
    events = report.events
    markers = _markers(events)
    detected = [e for e in events if e["event"] == "detected"]
    per_failure = []
    for i, f in enumerate(st["faults"]):
        det = next((e for e in detected if e["t"] >= f["t"]), None)
        row = dict(f)
        if det is not None:
            row["detected_s"] = round(det["t"] - f["t"], 4)
            nxt = next((t for t, _, _ in rec.steps if t > det["t"]), None)
            row["recovered_s"] = None if nxt is None else round(nxt - f["t"], 4)
        if i < len(report.failures):
            row["failure_kind"] = report.failures[i].kind
            row["steps_rewound"] = report.failures[i].steps_rewound
        per_failure.append(row)
        markers.append({"t": f["t"], "event": "fault"})
    markers.sort(key=lambda m: m["t"])
    start_t = st["start_t"] or 0.0
    wall = report.wall_s
    steady = steady_step_time(report)
    after_start = max(1e-9, wall - start_t)
    kept_t = {}
    for t, s, _ in rec.steps:
        kept_t[s] = t
    points = [(kept_t.get(i + 1, 0.0), i + 1, n, d)
              for i, (n, d) in enumerate(zip(report.slices_per_step, report.step_times))]
    recovery_gaps = sum(r.get("recovered_s") or 0.0 for r in per_failure)
    return {
        "system": f"ray_elastic-{policy}" + ("-spare" if spare_slices else ""),
        "scenario": "chaos",
        "slices": num_slices,
        "spare_slices": spare_slices,
        "duration_s": duration_s,
        "interval_s": list(interval_s),
        "kinds": list(kinds),
        "seed": seed,
        "wall_s": round(wall, 3),
        "start_s": round(start_t, 3),
        "steps_completed": report.steps_completed,
        "productive_s": round(report.productive_s, 3),
        "goodput": round(report.goodput, 4),
        "goodput_after_start": round(report.productive_s / after_start, 4),
        "goodput_throughput": round(report.steps_completed * steady / after_start, 4) if steady == steady else None,
        "step_time_s": steady,
        "failures": per_failure,
        "failures_recorded": len(report.failures),
        "steps_rewound_total": sum(f.steps_rewound for f in report.failures),
        "detected_s": summary([r.get("detected_s") for r in per_failure]),
        "recovered_s": summary([r.get("recovered_s") for r in per_failure]),
        "steps_rewound": summary([r.get("steps_rewound") for r in per_failure]),
        "degraded": _degraded(points, num_slices, per_failure[0]["t"] if per_failure else None),
        "goodput_after_start_less_bench": round(
            report.productive_s / max(1e-9, after_start - st["bench_s"]), 4),
        "lost_s": {
            "start_up": round(start_t, 3),
            "fault_to_next_step": round(recovery_gaps, 3),
            "bench_node_changes": round(st["bench_s"], 3),
            "other": round(wall - start_t - report.productive_s - recovery_gaps - st["bench_s"], 3),
        },
        "timeline": [[t, s] for t, s, _ in rec.steps],
        "markers": markers,
        # Ray's daemons' CPU over the run (they share the 2 cores with the
        # slices here), and Ray's metrics switch as this run had it.
        "ray_daemons_cpu_s": daemons.by_kind(),
        "ray_metrics_collection": os.environ.get("RAY_enable_metrics_collection", "default (on)"),
        "error": error,
        "notes": [],
    }


IDLE_LOAD = "snapshots on + an idle-class busy loop (reference)"


def overheads(cluster, pairs: int, steps: int, *, factory=None, log=print) -> dict:
    """Step time with snapshots off, snapshots on (the default), and
    snapshots on plus asynchronous checkpoints every 10 steps, the three run
    in turn (order reversed every other round) so they share machine load."""
    from ray_elastic import CheckpointConfig, ElasticConfig, ElasticTrainer

    factory = factory or lm_factory()
    configs = (
        ("snapshots off", 0, None),
        ("snapshots on", 1, None),
        ("snapshots on + checkpoints every 10", 1, CHECKPOINT_EVERY),
        # Reference, not a ray_elastic setting: what any background work in
        # the idle CPU class costs when it shares these cores with training.
        (IDLE_LOAD, 1, None),
    )
    samples: dict = {name: {"median": [], "mean": [], "saves": [], "save_s": []} for name, _, _ in configs}
    for i in range(pairs):
        order = configs if i % 2 == 0 else tuple(reversed(configs))
        for name, every, ckpt_every in order:
            ensure_nodes(cluster, 2)
            path = tempfile.mkdtemp(prefix="bench-ovh-ckpt-") if ckpt_every else None
            try:
                with idle_cpu_load() if name == IDLE_LOAD else contextlib.nullcontext():
                    report = ElasticTrainer(
                        factory, ElasticConfig(num_slices=2, policy="resize", snapshot_every=every), steps,
                        checkpoint=CheckpointConfig(path, save_every=ckpt_every, keep=2) if path else None,
                    ).fit()
            finally:
                if path:
                    shutil.rmtree(path, ignore_errors=True)
            times = [t for j, (t, n) in enumerate(zip(report.step_times, report.slices_per_step))
                     if j >= 5 and n == 2]
            samples[name]["median"].append(statistics.median(times))
            samples[name]["mean"].append(statistics.fmean(times))
            if ckpt_every:
                saves = [c for c in report.checkpoints if c.get("step", 0) < steps]  # not the final one
                samples[name]["saves"].append(len(saves))
                samples[name]["save_s"] += [c.get("latency_s", c.get("seconds")) for c in saves]
        log("    round {}: {}".format(i, ", ".join(
            f"{name} {samples[name]['median'][-1] * 1e3:.1f} ms" for name, _, _ in configs)))
    out = {"pairs": pairs, "steps": steps, "configs": {}}
    for name, _, _ in configs:
        out["configs"][name] = {"median_s": summary(samples[name]["median"]),
                                "mean_s": summary(samples[name]["mean"])}
        if samples[name]["saves"]:
            out["configs"][name]["saves_per_run"] = summary(samples[name]["saves"])
            out["configs"][name]["save_latency_s"] = summary(samples[name]["save_s"])

    def ratio(a, b, key):
        x, y = out["configs"][a][key]["median"], out["configs"][b][key]["median"]
        return x / y - 1.0

    out["snapshot_overhead"] = {"by_median": ratio("snapshots on", "snapshots off", "median_s"),
                                "by_mean": ratio("snapshots on", "snapshots off", "mean_s")}
    out["checkpoint_overhead"] = {
        "by_median": ratio("snapshots on + checkpoints every 10", "snapshots on", "median_s"),
        "by_mean": ratio("snapshots on + checkpoints every 10", "snapshots on", "mean_s"),
    }
    out["idle_load_overhead"] = {"by_median": ratio(IDLE_LOAD, "snapshots on", "median_s"),
                                 "by_mean": ratio(IDLE_LOAD, "snapshots on", "mean_s")}
    return out


# --------------------------------------------------------------------------
# The peers (bench/raytrain.py), with the same extra figures.
# --------------------------------------------------------------------------


def _peer_points(run: dict) -> list[tuple]:
    """(t, step, world, duration) of rank 0's kept steps, from the run's log."""
    path = os.path.join(run.get("workdir") or "", "events.jsonl")
    if not os.path.exists(path):
        return []
    events = []
    with open(path) as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    steps0 = sorted((e for e in events if e.get("ev") == "step" and e.get("rank") == 0), key=lambda e: e["t"])
    if not steps0:
        return []
    t0 = steps0[0]["t"] - (run["timeline"][0][0] if run.get("timeline") else 0.0)
    kept: dict = {}
    seen: dict = {}
    for e in steps0:
        seen[e["pid"]] = seen.get(e["pid"], 0) + 1
        # Warm-up after each (re)start is left out of the step times.
        kept[e["step"]] = (round(e["t"] - t0, 4), e["step"], e.get("world", run.get("num_workers")),
                           e["dur"] if seen[e["pid"]] > 3 else None)
    return [kept[s] for s in sorted(kept)]


def run_peer(cluster, system: str, scenario: str, steps: int, fail_at: int, log=print) -> dict:
    from bench.raytrain import run_full_restart, run_raytrain

    if system == "full-restart":
        r = run_full_restart(steps, fail_at, num_workers=2, checkpoint_every=CHECKPOINT_EVERY,
                             scenario=scenario, time_limit_s=300.0)
    else:
        r = run_raytrain(cluster, scenario, steps, fail_at, num_workers=2, checkpoint_every=CHECKPOINT_EVERY,
                         elastic=system == "raytrain-elastic", hang_timeout_s=HANG_TIMEOUT_S,
                         preempt_deadline_s=PREEMPT_DEADLINE_S, time_limit_s=300.0)
    r["degraded"] = _degraded(_peer_points(r), 2, r.get("fault_t"))
    _add_user_recovery(r)
    if r.get("workdir"):
        shutil.rmtree(r["workdir"], ignore_errors=True)
    return r


# --------------------------------------------------------------------------
# The matrix.
# --------------------------------------------------------------------------


def _cell(system: str, scenario: str, runs: list[dict]) -> dict:
    ratios = [r["degraded"].get("ratio") for r in runs if r.get("degraded")]
    return {
        "system": system,
        "scenario": scenario,
        "status": "ok",
        "runs": len(runs),
        "errors": [r["error"] for r in runs if r.get("error")],
        "detected_s": summary([r.get("detected_s") for r in runs]),
        "recovered_s": summary([r.get("recovered_s") for r in runs]),
        "rate_recovered_s": summary([r.get("rate_recovered_s") for r in runs]),
        "lost_s": summary([r.get("lost_s") for r in runs]),
        "lost_end_s": summary([r.get("lost_end_s") for r in runs]),
        "steps_rewound": summary([r.get("steps_rewound") for r in runs]),
        "degraded_ratio": summary([x for x in ratios if x is not None]),
        "degraded_steps": summary([r["degraded"]["steps"] for r in runs if r.get("degraded")]),
        "goodput": summary([r.get("goodput") for r in runs]),
        "step_time_s": summary([r.get("step_time_s") for r in runs
                                if r.get("step_time_s") is not None and r["step_time_s"] == r["step_time_s"]]),
    }


def plan(quick: bool, systems: Sequence[str], scenarios: Sequence[str]) -> list[tuple[str, str]]:
    """The (system, scenario) cells to run, in order."""
    if quick:
        default = [(s, "kill") for s in SYSTEMS] + [("ray_elastic-resize", "chaos")]
    else:
        default = [(s, sc) for sc in SCENARIOS for s in SYSTEMS if (s, sc) not in NOT_APPLICABLE]
    return [(s, sc) for s, sc in default if s in systems and sc in scenarios]


def run(cluster, *, quick: bool = False, runs: Optional[int] = None,
        systems: Sequence[str] = SYSTEMS, scenarios: Sequence[str] = SCENARIOS,
        steps: Optional[int] = None, fail_at: Optional[int] = None,
        chaos_s: Optional[float] = None, chaos_interval_s: tuple = (30.0, 60.0),
        overhead_pairs: Optional[int] = None, overhead_steps: Optional[int] = None,
        factory=None, log=print) -> dict:
    """Run the matrix; returns everything compare.json holds."""
    runs = runs or (1 if quick else 3)
    steps = steps or (100 if quick else 150)
    # Mid-way between two checkpoints (every 10 steps): the average case for
    # the systems that restore one.
    fail_at = fail_at or (45 if quick else 55)
    chaos_s = chaos_s if chaos_s is not None else (120.0 if quick else 300.0)
    overhead_pairs = overhead_pairs if overhead_pairs is not None else (2 if quick else 5)
    overhead_steps = overhead_steps or (80 if quick else 200)
    t_start = time.monotonic()
    cells_run = plan(quick, systems, scenarios)
    all_runs: list[dict] = []
    cells = []
    chaos = chaos_spare = None
    for system, scenario in cells_run:
        if scenario == "chaos":
            log(f"  {system} / chaos: {chaos_s:.0f} s, a failure every "
                f"{chaos_interval_s[0]:.0f}-{chaos_interval_s[1]:.0f} s")
            policy, _, spare = system.split("-", 1)[1].partition("-")
            run_ = run_chaos(cluster, chaos_s, factory=factory, interval_s=chaos_interval_s, log=log,
                             policy=policy, spare_slices=1 if spare == "spare" else 0)
            if spare:
                chaos_spare = run_
            else:
                chaos = run_
            log(f"    {len(run_['failures'])} failures, goodput {run_['goodput']:.1%} "
                f"(from the first step {run_['goodput_after_start']:.1%})")
            cells.append({"system": system, "scenario": "chaos", "status": "ok", "runs": 1,
                          "errors": [run_["error"]] if run_.get("error") else [],
                          "detected_s": run_["detected_s"], "recovered_s": run_["recovered_s"],
                          "steps_rewound": run_["steps_rewound"],
                          "degraded_ratio": summary([run_["degraded"].get("ratio")]),
                          "degraded_steps": summary([run_["degraded"]["steps"]]),
                          "goodput": summary([run_["goodput"]]),
                          "step_time_s": summary([run_["step_time_s"]])})
            continue
        done = []
        for i in range(runs):
            t0 = time.monotonic()
            if system in ELASTIC:
                policy, _, spare = system.split("-", 1)[1].partition("-")
                r = run_elastic(cluster, policy, scenario, steps, fail_at, factory=factory,
                                spare_slices=1 if spare == "spare" else 0)
            else:
                r = run_peer(cluster, system, scenario, steps, fail_at, log=log)
            r["run"] = i
            done.append(r)
            all_runs.append(r)
            log(f"  {system} / {scenario} run {i}: detected {_s(r.get('detected_s'))}, next step "
                f"{_s(r.get('recovered_s'))}, redone {r.get('steps_rewound')}, goodput "
                f"{_pct(r.get('goodput'))}{' ERROR ' + r['error'] if r.get('error') else ''} "
                f"({time.monotonic() - t0:.0f} s)")
        cells.append(_cell(system, scenario, done))
    for (system, scenario), reason in NOT_APPLICABLE.items():
        if system in systems and scenario in scenarios:
            cells.append({"system": system, "scenario": scenario, "status": "n/a", "reason": reason})
    skipped = [(s, sc) for sc in SCENARIOS for s in SYSTEMS
               if (s, sc) not in cells_run and (s, sc) not in NOT_APPLICABLE]
    ovh = None
    if overhead_pairs:
        log(f"  overheads: {overhead_pairs} rounds of {overhead_steps} steps")
        ovh = overheads(cluster, overhead_pairs, overhead_steps, factory=factory, log=log)
    result = {
        "mode": "quick" if quick else "full",
        "settings": {"runs": runs, "steps": steps, "fail_at": fail_at, "chaos_s": chaos_s,
                     "chaos_interval_s": list(chaos_interval_s), "overhead_pairs": overhead_pairs,
                     "overhead_steps": overhead_steps, "checkpoint_every": CHECKPOINT_EVERY,
                     "raytrain_hang_timeout_s": HANG_TIMEOUT_S,
                     "elastic_step_deadline_floor_s": STEP_DEADLINE_FLOOR_S,
                     "preempt_deadline_s": PREEMPT_DEADLINE_S, "cpus": os.cpu_count()},
        "cells": _order(cells),
        "not_run": [{"system": s, "scenario": sc} for s, sc in skipped],
        "runs": all_runs,
        "chaos": chaos,
        "chaos_spare": chaos_spare,
        "overheads": ovh,
    }
    result["goals"] = goals(result)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return result


def _order(cells: list[dict]) -> list[dict]:
    rank = {(s, sc): (j, i) for i, s in enumerate(SYSTEMS) for j, sc in enumerate(SCENARIOS)}
    return sorted(cells, key=lambda c: rank.get((c["system"], c["scenario"]), (99, 99)))


# --------------------------------------------------------------------------
# Goals.
# --------------------------------------------------------------------------


def _find(result: dict, system: str, scenario: str) -> Optional[dict]:
    for c in result["cells"]:
        if c["system"] == system and c["scenario"] == scenario and c["status"] == "ok":
            return c
    return None


def _med(summ: Optional[dict]) -> Optional[float]:
    return summ.get("median") if summ and summ.get("n") else None


def goals(result: dict) -> dict:
    """The issue's goals, measured: each {goal, measured, met, lines}."""
    out = {"recovery": [], "steps_redone": None, "chaos_goodput": None}
    # 1. Recovery (fault to next completed step) vs Ray Train's restart.
    for scenario in ("kill", "remove_node", "stop", "preempt"):
        for peer in ("raytrain", "raytrain-elastic", "full-restart"):
            p = _find(result, peer, scenario)
            for mine in ELASTIC:
                m = _find(result, mine, scenario)
                if not p or not m:
                    continue
                a, b = _med(m["recovered_s"]), _med(p["recovered_s"])
                if not a or not b:
                    continue
                x = b / a
                row = {"scenario": scenario, "system": mine, "peer": peer, "elastic_s": a, "peer_s": b,
                       "x_faster": round(x, 1), "met": x >= GOALS["recovery_x"] if peer == "raytrain" else None}
                if peer == "raytrain" and x < GOALS["recovery_x"]:
                    row["why"] = _why_recovery(mine, scenario, a, b)
                out["recovery"].append(row)
    # 2. Steps redone: every ray_elastic run, chaos included.
    redone = [r["steps_rewound"] for r in result["runs"]
              if r["system"] in ELASTIC and r.get("steps_rewound") is not None]
    if result.get("chaos"):
        redone += [f["steps_rewound"] for f in result["chaos"]["failures"] if f.get("steps_rewound") is not None]
    if redone:
        worst = max(redone)
        out["steps_redone"] = {"max": worst, "n": len(redone), "met": worst <= GOALS["steps_redone"]}
        if worst > GOALS["steps_redone"]:
            bad = [(r["system"], r["scenario"], r["steps_rewound"]) for r in result["runs"]
                   if r["system"] in ELASTIC and (r.get("steps_rewound") or 0) > 1]
            out["steps_redone"]["why"] = (
                f"runs redoing more than one step: {bad}; a step is redone only when the newest complete "
                "snapshot is older than the step in flight (snapshots off, or every copy lost at once)")
    # 3. Chaos goodput (resize; pause with a hot spare).
    for key, goal in (("chaos", "chaos_goodput"), ("chaos_spare", "chaos_spare_goodput")):
        if result.get(key):
            out[goal] = _chaos_goal(result[key], GOALS[goal])
    return out


def _chaos_goal(ch: dict, target: float) -> dict:
    g, g0 = ch["goodput_after_start"], ch["goodput"]
    row = {"goodput_after_start": g, "goodput_whole_run": g0, "goodput_throughput": ch["goodput_throughput"],
           "failures": len(ch["failures"]), "duration_s": ch["wall_s"], "met": g >= target, "target": target,
           "system": ch.get("system"), "slices": ch.get("slices"), "spare_slices": ch.get("spare_slices", 0)}
    lost = ch["lost_s"]
    row["lost_s"] = lost
    if g < target or g0 < target:
        row["why"] = (
            f"of {ch['wall_s']:.0f} s, {lost['start_up']:.1f} s went to start-up (workers, JAX, compile), "
            f"{lost['fault_to_next_step']:.1f} s from {len(ch['failures'])} faults to the next step, "
            f"{lost['bench_node_changes']:.1f} s to the bench removing and adding nodes in the driver's "
            f"thread, and {lost['other']:.1f} s between steps (the driver's loop, callbacks, membership "
            "changes, replacement workers starting on the same 2 shared cores)")
    return row


def _why_recovery(system: str, scenario: str, a: float, b: float) -> str:
    if system.endswith("pause"):
        return (f"pause waits for a replacement worker ({a:.1f} s: a new process imports JAX and loads the "
                f"compiled step on 2 shared cores) where Ray Train restarts the whole group ({b:.1f} s)")
    return f"{system} took {a:.1f} s against Ray Train's {b:.1f} s"


# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------


def _s(v) -> str:
    return "n/a" if v is None else f"{v:.3f} s"


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def _num(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def _fmt(summ: Optional[dict], spec: str = ".2f", scale: float = 1.0, unit: str = "") -> str:
    if not summ or not summ.get("n"):
        return "—"
    m = summ["median"] * scale
    if summ["n"] == 1 or summ["min"] == summ["max"]:
        return f"{format(m, spec)}{unit}"
    return f"{format(m, spec)}{unit} [{format(summ['min'] * scale, spec)}–{format(summ['max'] * scale, spec)}]"


_STOPS = {
    "ray_elastic-pause": "0 (waits for the replacement)",
    "raytrain": "0 (restarts at full size)",
    "raytrain-elastic": "0 (restarted at full size)",
    "full-restart": "0 (restarts at full size)",
    "ray_elastic-resize": "— (grew back before any step)",
}


def _chaos_lines(ch: dict) -> list:
    """The Markdown table of one chaos run."""
    spares = f" + {ch['spare_slices']} hot spare(s)" if ch.get("spare_slices") else ""
    lines = [
        "",
        f"### Chaos: {ch['system']}, {ch['slices']} slices{spares}, a failure "
        f"({' or '.join(ch['kinds'])}) every {ch['interval_s'][0]:.0f}–{ch['interval_s'][1]:.0f} s, "
        f"{ch['wall_s']:.0f} s run",
        "",
        "| figure | value |",
        "|---|---|",
        f"| failures injected (detected) | {len(ch['failures'])} ({ch['failures_recorded']}) |",
        f"| kinds | {', '.join(f['kind'] + '→' + str(f.get('failure_kind')) for f in ch['failures']) or '—'} |",
        f"| detection (s) | {_fmt(ch['detected_s'], '.3f')} |",
        f"| fault → next step (s) | {_fmt(ch['recovered_s'], '.3f')} |",
        f"| steps redone (per failure) | {_fmt(ch['steps_rewound'], '.0f')} |",
        f"| throughput while degraded | "
        f"{_num(ch['degraded'].get('ratio'), '.0%')} of full ({ch['degraded']['steps']} steps) |",
        f"| steps completed | {ch['steps_completed']} |",
        f"| goodput, whole run (start-up {ch['start_s']:.1f} s included) | {_pct(ch['goodput'])} |",
        f"| goodput from the first step | {_pct(ch['goodput_after_start'])} |",
        f"| … less the bench's own node changes in the driver's thread "
        f"({ch['lost_s']['bench_node_changes']:.1f} s) | {_pct(ch.get('goodput_after_start_less_bench'))} |",
        f"| effective throughput (steps × failure-free step time / time since start) "
        f"| {_pct(ch['goodput_throughput'])} |",
    ]
    lost = ch["lost_s"]
    lines.append(f"| where the rest went (s) | start-up {lost['start_up']:.1f}, fault → next step "
                 f"{lost['fault_to_next_step']:.1f}, bench node changes {lost['bench_node_changes']:.1f}, "
                 f"between steps {lost['other']:.1f} |")
    if ch.get("error"):
        lines.append(f"| error | {ch['error']} |")
    return lines


def tables(result: dict) -> str:
    st = result["settings"]
    lines = [
        f"### Recovery from one fault (2 slices/workers of 1 host; {st['steps']} steps, fault at step "
        f"{st['fail_at']}; median [min–max] over the runs)",
        "",
        "| system | scenario | runs | detection (s) | fault → next step (s) | fault → rate back (s) "
        "| time lost (s) | time lost by the end (s) | steps redone | throughput while degraded | goodput |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for c in result["cells"]:
        if c["scenario"] == "chaos":
            continue
        if c["status"] != "ok":
            lines.append(f"| {c['system']} | {c['scenario']} | — | {c['reason']} | | | | | | | |")
            continue
        dr = c["degraded_ratio"]
        if dr.get("n"):
            deg = f"{_fmt(dr, '.0%')} of full ({_fmt(c['degraded_steps'], '.0f')} steps)"
        elif not c["recovered_s"].get("n"):
            deg = "—"  # it never recovered
        else:
            deg = _STOPS.get(c["system"], "—")
        err = f" ⚠ {len(c['errors'])} run(s) failed" if c["errors"] else ""
        lines.append(
            f"| {c['system']} | {c['scenario']} | {c['runs']}{err} | {_fmt(c['detected_s'], '.3f')} "
            f"| {_fmt(c['recovered_s'], '.3f')} | {_fmt(c.get('rate_recovered_s'), '.3f')} "
            f"| {_fmt(c.get('lost_s'), '.2f')} | {_fmt(c.get('lost_end_s'), '.2f')} "
            f"| {_fmt(c['steps_rewound'], '.0f')} | {deg} "
            f"| {_fmt(c['goodput'], '.0%')} |"
        )
    lines += ["", f"Fault → rate back: to the first new step after the fault from which the next {RATE_WINDOW} "
                  f"new steps run at ≥ {RATE_SHARE:.0%} of the run's failure-free rate (steps {RATE_SKIP} → fault; "
                  "times the degraded ratio when below 1). Time lost: (time from the fault to that moment) − "
                  "(new steps made meanwhile × failure-free step time); by the end: the same to the run's last step."]
    if result.get("not_run"):
        lines += ["", "Not run in this mode: " + ", ".join(
            f"{c['system']}/{c['scenario']}" for c in result["not_run"]) + "."]
    for key in ("chaos", "chaos_spare"):
        if result.get(key):
            lines += _chaos_lines(result[key])
    if result.get("chaos") or result.get("chaos_spare"):
        lines += ["", "Chaos is run for ray_elastic resize and for pause with a hot spare; the peer runners "
                      "inject one fault per run."]
    ovh = result.get("overheads")
    if ovh:
        lines += [
            "",
            f"### Step-time overhead (ray_elastic, 2 slices, {ovh['pairs']} alternated rounds of "
            f"{ovh['steps']} steps; step 5 onwards)",
            "",
            "| configuration | step time, median (ms) | step time, mean (ms) |",
            "|---|---:|---:|",
        ]
        for name, v in ovh["configs"].items():
            lines.append(f"| {name} | {_fmt(v['median_s'], '.1f', 1e3)} | {_fmt(v['mean_s'], '.1f', 1e3)} |")
        so, co = ovh["snapshot_overhead"], ovh["checkpoint_overhead"]
        lines += [
            f"| **snapshot overhead** (on vs off) | {so['by_median']:+.1%} | {so['by_mean']:+.1%} |",
            f"| **checkpoint overhead** (every 10 vs none) | {co['by_median']:+.1%} | {co['by_mean']:+.1%} |",
        ]
        il = ovh.get("idle_load_overhead")
        if il:
            lines.append(f"| reference: an idle-class busy loop on the same cores | {il['by_median']:+.1%} | {il['by_mean']:+.1%} |")
        ck = ovh["configs"].get("snapshots on + checkpoints every 10", {})
        if ck.get("saves_per_run", {}).get("n"):
            lines += ["", f"Checkpoint runs: {_fmt(ck['saves_per_run'], '.0f')} saves per run of {ovh['steps']} "
                          f"steps, each committed {_fmt(ck['save_latency_s'], '.2f')} s after it was handed to "
                          "the writer (a save outlasting 10 steps delays the next one)."]
    lines += ["", "### Goals", ""] + goal_lines(result["goals"])
    return "\n".join(lines)


def goal_lines(g: dict) -> list[str]:
    lines = ["| goal | measured | met |", "|---|---|---|"]
    why = []
    for r in g["recovery"]:
        if r["peer"] != "raytrain":
            continue
        lines.append(
            f"| recovery ≥ {GOALS['recovery_x']:.0f}× faster than Ray Train's restart ({r['scenario']}, "
            f"{r['system']}) | {r['x_faster']:.1f}× ({r['elastic_s']:.2f} s vs {r['peer_s']:.2f} s) "
            f"| {'yes' if r['met'] else 'NO'} |")
        if r.get("why"):
            why.append(f"- recovery, {r['system']} / {r['scenario']}: {r['why']}.")
    if not any(r["peer"] == "raytrain" for r in g["recovery"]):
        lines.append("| recovery ≥ 4× faster than Ray Train's restart | not measured (no pair of runs) | — |")
    others = [r for r in g["recovery"] if r["peer"] != "raytrain"]
    sr = g.get("steps_redone")
    if sr:
        lines.append(f"| steps redone ≤ {GOALS['steps_redone']} (every ray_elastic failure) "
                     f"| max {sr['max']} over {sr['n']} failures | {'yes' if sr['met'] else 'NO'} |")
        if sr.get("why"):
            why.append(f"- steps redone: {sr['why']}.")
    for goal in ("chaos_goodput", "chaos_spare_goodput"):
        cg = g.get(goal)
        if not cg:
            continue
        spares = f" + {cg['spare_slices']} spare" if cg.get("spare_slices") else ""
        lines.append(
            f"| goodput ≥ {cg['target']:.0%} under chaos ({cg.get('system')}, {cg.get('slices', 3)} slices{spares}, "
            f"{cg['failures']} failures in {cg['duration_s']:.0f} s) | {cg['goodput_after_start']:.1%} from the "
            f"first step; {cg['goodput_whole_run']:.1%} with start-up | {'yes' if cg['met'] else 'NO'} |")
        if cg.get("why"):
            why.append(f"- chaos goodput ({cg.get('system')}): {cg['why']}.")
    if others:
        lines += ["", "Other ratios (fault → next step, peer ÷ ray_elastic): " + "; ".join(
            f"{r['system']} vs {r['peer']} ({r['scenario']}): {r['x_faster']:.1f}×" for r in others) + "."]
    if why:
        lines += ["", "Where a goal is not met, or only just:"] + why
    return lines


def write(result: dict, out: str) -> dict:
    """compare.json, compare.md and the PNGs under `out`; returns the paths."""
    from bench.charts import bar_chart, timeline_png

    os.makedirs(out, exist_ok=True)
    files = {"json": os.path.join(out, "compare.json"), "md": os.path.join(out, "compare.md"), "png": []}
    with open(files["json"], "w") as f:  # first, so a chart's failure loses nothing
        json.dump(result, f, indent=1, default=str)
    by_cell: dict = {}
    for r in result["runs"]:
        by_cell.setdefault((r["system"], r["scenario"]), []).append(r)
    ch = result.get("chaos")
    if ch:  # the chart's title wants numbers: the medians, and the total redone
        by_cell[("ray_elastic-resize", "chaos")] = [{
            **ch, "detected_s": _med(ch["detected_s"]), "recovered_s": _med(ch["recovered_s"]),
            "steps_rewound": ch["steps_rewound_total"]}]
    for (system, scenario), runs in by_cell.items():
        path = os.path.join(out, f"timeline-{system}-{scenario}.png")
        timeline_png(runs, path, title=f"{system} / {scenario}")
        files["png"].append(path)
    rows = [{"system": c["system"], "scenario": c["scenario"], "recovered_s": c["recovered_s"],
             "detected_s": c["detected_s"]}
            for c in result["cells"] if c["status"] == "ok"]
    if rows:
        path = os.path.join(out, "recovery.png")
        bar_chart(rows, path, title="Fault → next completed step (median, min–max)")
        files["png"].append(path)
        path = os.path.join(out, "detection.png")
        bar_chart(rows, path, key="detected_s", ylabel="fault → detection (s)",
                  title="Detection (median, min–max)")
        files["png"].append(path)
    result["files"] = {"json": files["json"], "md": files["md"],
                       "png": [os.path.basename(p) for p in files["png"]]}
    with open(files["json"], "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = tables(result)
    with open(files["md"], "w") as f:
        f.write(text + "\n\nCharts: " + ", ".join(result["files"]["png"]) + "\n")
    return files

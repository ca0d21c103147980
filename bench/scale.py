"""Control-plane scale: the real controller (`ElasticTrainer`) against
simulated slices (`bench.fake_slices.FakeSlices`: in-process fake
workers whose calls return real ObjectRefs), with 16 .. 1024 slices.

Per size, one run of `steps` steps with `failures` worker deaths (a real
`ActorDiedError` from the fake's call, at spread steps and slices) under
the resize policy. The driver's wall clock and its CPU time (all threads
of the driver process, Ray's included; far less disturbed than wall time by
other load on a shared machine) are read at every completed step and
controller event:

- per step: the median time between two completed steps without a failure
  nearby (the whole control loop: membership check, drain check, both
  phases' calls, ray.wait/ray.get, snapshot bookkeeping, callbacks);
- per failure: from the controller's "detected" event to its "grow" event
  (tear down the slice, queue a replacement, reconcile the survivors'
  steps, shrink, take in the replacement, load its state; the fakes'
  replacement is ready at once), and fault -> next completed step as the
  report gives it;
- "controller only": the same less the fakes' own share (building their
  results and the actor calls that return them, which stand in for Ray's per-call work).

With a set compute time per step (`--step-s`, e.g. 1 s: the fakes' refs
resolve that long after the step's gradient calls can start, on a clock
actor, never blocking the driver), `pipelined` runs every size twice,
pipelined dispatch off and on (RAY_ELASTIC_PIPELINE), without failures,
and reports the driver's overhead per step: the mean step time after
warm-up less step_s, as a share of the step.

The slope of log(time) against log(slices) (least squares over all sizes,
and between the two largest) says how the cost grows: 1.0 is linear.

What the fakes leave out: Ray's own cost of submitting the calls, which
depends on how many ref arguments they carry. It is measured apart, on a
real (idle) actor, for the gradient hand-off as the controller does it
(a reduction tree of fan-in APPLY_FAN_IN over the shards, computed on the
slices, down to one sum, then n apply calls of one ref: O(n)) and as it
did before the tree (n apply calls of n refs each: O(n^2)).
"""

from __future__ import annotations

import functools
import math
import os
import random
import statistics
import time
from typing import Optional, Sequence

import numpy as np

from bench.common import summary

SIZES = (16, 64, 256, 1024)


def measure(num_slices: int, steps: int = 40, failures: int = 3, policy: str = "resize",
            seed: int = 0, step_s: float = 0.0, pipeline: Optional[bool] = None, clocks: int = 2,
            slices_per_leader: int = 0) -> dict:
    """One run of the real controller on `num_slices` fake slices. Times
    are wall clock and the driver process's CPU time (all its threads,
    Ray's included): CPU time is what the controller costs, and it is far
    less disturbed than wall time by other load on a shared machine."""
    import ray

    from ray_elastic import ElasticConfig
    from ray_elastic.control.controller import Controller, Seams
    from ray_elastic.callbacks import Callback
    from bench.fake_slices import FakeSlices, fake_program

    rng = random.Random(seed)
    warmup = 4
    # Failures at steps spread over the run (at least 3 steps apart), each on
    # a random slice, while step `at` is in flight.
    span = max(1, steps - warmup - 4)
    fail_steps = sorted({warmup + 1 + (i * span) // max(1, failures) for i in range(failures)})
    plan = [(k, rng.randrange(num_slices)) for k in fail_steps]
    backend = FakeSlices.configured(fail=plan, step_s=step_s, clocks=clocks)
    stamps: list[tuple] = []  # (step, wall, cpu, fake wall, fake cpu)
    events: list[tuple] = []  # (event, wall, cpu, fake wall, fake cpu)

    def now() -> tuple:
        inst = backend.instances[-1] if backend.instances else None
        return (time.perf_counter(), time.process_time(),
                inst.fake_s if inst else 0.0, inst.fake_cpu_s if inst else 0.0)

    clock_cpu: dict = {}  # step -> the clock actors' CPU seconds, at the warm-up's end and the last step
    leader_cpu: dict = {}  # the same for the group leaders

    class Probe(Callback):
        def on_start(self, trainer):
            self.trainer = trainer

        def on_step(self, step, metrics):
            stamps.append((step,) + now())
            if step in (warmup, steps) and backend.instances:
                clock_cpu[step] = backend.instances[-1].clock_cpu_s()
                leaders = getattr(self.trainer.members.backend.runner, "leaders", [])
                if leaders:
                    leader_cpu[step] = sum(ray.get([x.cpu_s.remote() for x in leaders]))

        def on_event(self, event):
            events.append((event["event"],) + now())

    config = ElasticConfig(num_slices=num_slices, policy=policy, max_retries=failures + 1,
                           first_step_deadline_s=600.0, step_deadline_floor_s=60.0,
                           slices_per_leader=slices_per_leader,
                           # The simulated workers hand their gradients on
                           # directly: the driver's calls of that pattern
                           # (bench exchange measures the exchange's bytes).
                           exchange="direct")
    t0 = time.perf_counter()
    # The controller builds and checks the program in the driver before it
    # provisions any slice; the fakes never run it.
    program = functools.partial(fake_program, backend.state_floats)
    trainer = Controller(program, config, steps, callbacks=[Probe()], seams=Seams(provisioner=backend))
    saved = os.environ.get("RAY_ELASTIC_PIPELINE")
    if pipeline is not None:
        os.environ["RAY_ELASTIC_PIPELINE"] = "1" if pipeline else "0"
    try:
        report = trainer.fit()
    finally:
        if saved is None:
            os.environ.pop("RAY_ELASTIC_PIPELINE", None)
        else:
            os.environ["RAY_ELASTIC_PIPELINE"] = saved
    wall = time.perf_counter() - t0
    if report.steps_completed != steps:
        raise RuntimeError(f"{num_slices} fake slices: {report.steps_completed}/{steps} steps")
    if len(report.failures) != len(plan):
        raise RuntimeError(f"{num_slices} fake slices: {len(report.failures)} failures, planned {len(plan)}")

    def delta(a: tuple, b: tuple) -> dict:
        """Wall, CPU, and both less the fakes' own share, from a to b."""
        w, c, fw, fc = (y - x for x, y in zip(a, b))
        return {"wall": w, "cpu": c, "wall_ctl": w - fw, "cpu_ctl": c - fc}

    # Steps without a failure nearby: a failure while step k (0-based) is
    # in flight shows before the completion of step k + 1 (a join may fall
    # before step k + 2).
    touched = {k + d for k in fail_steps for d in (1, 2)}
    normal = [delta(a[1:], b[1:]) for a, b in zip(stamps, stamps[1:]) if b[0] > warmup and b[0] not in touched]
    # A failure: the controller's "detected" to its "grow" (the fakes'
    # replacement is ready at once).
    per_failure = []
    for i, e in enumerate(events):
        if e[0] == "detected":
            grow = next((g for g in events[i + 1:] if g[0] == "grow"), None)
            if grow is not None:
                per_failure.append(delta(e[1:], grow[1:]))
    inst = backend.instances[-1]
    out = {
        "slices": num_slices,
        "steps": steps,
        "failures": len(plan),
        "policy": policy,
        "wall_s": round(wall, 3),
        "recovered_s": summary([f.recovered_s for f in report.failures]),
        "steps_rewound": summary([f.steps_rewound for f in report.failures]),
        "fake_calls": inst.calls,
        "fake_s_total": round(inst.fake_s, 3),
        "replacements": len(inst.started) - num_slices,
        "step_set_s": step_s,
        "pipelined": trainer.members.backend.runner.pipeline,
        "steps_issued_ahead": trainer.members.backend.runner.steps_ahead,
        "clock_calls": inst.clock_calls,
        "steps_measured": len(normal),
    }
    for key in ("wall", "cpu", "wall_ctl", "cpu_ctl"):
        out[f"step_{key}_s"] = statistics.median(d[key] for d in normal)
        out[f"failure_{key}_s"] = summary([d[key] for d in per_failure])
    out["step_wall_all_s"] = summary([d["wall"] for d in normal])
    if not plan:  # no failure: the mean step over the run after warm-up (jitter in when a step is seen cancels)
        first = next(a for a in stamps if a[0] >= warmup)
        out["step_wall_mean_s"] = (stamps[-1][1] - first[1]) / max(1, stamps[-1][0] - first[0])
        out["step_cpu_mean_s"] = (stamps[-1][2] - first[2]) / max(1, stamps[-1][0] - first[0])
        if len(clock_cpu) == 2:
            out["clock_cpu_per_step_s"] = (clock_cpu[steps] - clock_cpu[warmup]) / max(1, steps - warmup)
        if len(leader_cpu) == 2:
            out["leader_cpu_per_step_s"] = (leader_cpu[steps] - leader_cpu[warmup]) / max(1, steps - warmup)
    out["slices_per_leader"] = slices_per_leader
    out["leaders"] = len(getattr(trainer.members.backend.runner, "ranges", ()) or ())
    # Kept for the names used before: wall clock, all in.
    out["step_s"], out["step_controller_s"] = out["step_wall_s"], out["step_wall_ctl_s"]
    out["failure_s"], out["failure_controller_s"] = out["failure_wall_s"], out["failure_wall_ctl_s"]
    return out


def pipelined(sizes: Sequence[int] = (256, 1024), step_s: float = 1.0, steps: int = 20,
              log=print, clocks: int = 2, slices_per_leader: int = 32) -> dict:
    """Each size with pipelined dispatch off, on, and on through group
    leaders (`slices_per_leader`; 0 leaves that out), with a set compute
    time per step and no failures: the driver's overhead per step is the
    mean step time after warm-up (last stamp less first, over the steps
    between) less step_s; the median step is reported beside it, and the
    driver's CPU per step, which is what it costs wherever it runs (on
    this machine the wall time also pays for every simulated worker and
    leader sharing its 2 cores)."""
    rows, calibration = [], []
    variants = [(False, 0), (True, 0)] + ([(True, slices_per_leader)] if slices_per_leader else [])
    for n in sizes:
        cal = calibrate(n)
        calibration.append(cal)
        log(f"  {n:5d} slices, one pipelined step's calls: driver CPU {cal['real_cpu_s'] * 1e3:.0f} ms on real actors, "
            f"{cal['fake_cpu_s'] * 1e3:.0f} ms on the fakes ({cal['fake_over_real']:.2f}x)")
        for on, per_leader in variants:
            if per_leader >= n:
                continue
            r = measure(n, steps=steps, failures=0, step_s=step_s, pipeline=on, clocks=clocks,
                        slices_per_leader=per_leader)
            r["overhead_s"] = r["step_wall_mean_s"] - step_s
            r["overhead_share"] = r["overhead_s"] / r["step_wall_mean_s"]
            r["cpu_share"] = r["step_cpu_mean_s"] / step_s
            rows.append(r)
            how = f"through {r['leaders']} leaders" if per_leader else f"pipelined {'on ' if on else 'off'}"
            log(f"  {n:5d} fake slices, {step_s:g} s step, {how}: "
                f"{r['step_wall_mean_s'] * 1e3:8.1f} ms/step (median {r['step_wall_s'] * 1e3:.1f}), driver overhead {r['overhead_s'] * 1e3:7.1f} ms "
                f"({100 * r['overhead_share']:.1f}% of the step; driver CPU {r['step_cpu_mean_s'] * 1e3:.0f} ms/step "
                f"= {100 * r['cpu_share']:.1f}% of step_s, controller only {r['step_cpu_ctl_s'] * 1e3:.0f} ms; "
                f"clock actors {r.get('clock_cpu_per_step_s', 0) * 1e3:.0f} ms"
                + (f"; leaders {r.get('leader_cpu_per_step_s', 0) * 1e3:.0f} ms, all of them" if per_leader else "") + ")")
    return {"sizes": list(sizes), "step_s": step_s, "steps": steps, "clocks": clocks, "rows": rows,
            "calibration": calibration, "slices_per_leader": slices_per_leader}


# Targets of issue #13 for the driver's overhead, as a share of a 1 s step.
OVERHEAD_TARGETS = {256: 0.05, 1024: 0.10}


def pipelined_table(result: dict) -> str:
    lines = [
        f"| slices | pipelined | leaders | per step, wall (ms): mean | … median [min–max] | driver overhead, wall (ms) "
        f"| … share of the step | driver CPU per step (ms) | … share of step_s | target | … controller only (ms) "
        f"| clock actors' CPU per step (ms) | leaders' CPU per step, all (ms) | steps measured |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        a = r["step_wall_all_s"]
        target = OVERHEAD_TARGETS.get(r["slices"])
        cpu = r.get("step_cpu_mean_s", r["step_cpu_s"])
        lines.append(
            f"| {r['slices']} | {'yes' if r['pipelined'] else 'no'} | {r.get('leaders') or '–'} "
            f"| {_ms(r['step_wall_mean_s'])} | {_ms(a['median'])} [{_ms(a['min'])}–{_ms(a['max'])}] "
            f"| {_ms(r['overhead_s'])} | {100 * r['overhead_share']:.1f}% | {_ms(cpu)} | {100 * cpu / result['step_s']:.1f}% "
            f"| {'≤ %d%%' % (100 * target) if target else ''} | {_ms(r['step_cpu_ctl_s'])} "
            f"| {_ms(r.get('clock_cpu_per_step_s'))} | {_ms(r.get('leader_cpu_per_step_s')) if r.get('leaders') else '–'} "
            f"| {r['steps_measured']} |")
    if result.get("calibration"):
        lines += ["", "| slices | one pipelined step's calls, driver CPU (ms): real actors | … the fakes | fakes / real |",
                  "|---:|---:|---:|---:|"]
        for c in result["calibration"]:
            lines.append(f"| {c['slices']} | {_ms(c['real_cpu_s'])} | {_ms(c['fake_cpu_s'])} | {c['fake_over_real']:.2f} |")
    return "\n".join(lines)


def calibrate(num_slices: int, steps: int = 4, hosts: int = 4) -> dict:
    """How faithful the fakes are to Ray: the driver's CPU per step for the
    calls the controller makes (`StepRunner`, pipelined, the same slices
    and shards, nothing else of the controller), once on `hosts` real
    actors each playing num_slices / hosts slices' workers (they fetch
    their inputs as a worker does and compute nothing), once on the fakes
    (their calls due at once). Driver CPU covers all its threads, Ray's
    included; the actors' own work is not in it (on a real cluster it runs
    on the slices' hosts)."""
    import ray

    from bench.fake_slices import FakeSlices, fake_program
    from ray_elastic.failures.location import FailureLocator, RayProbe
    from ray_elastic.cluster.slice_group import LiveSlice
    from ray_elastic.dispatch.step_runner import StepRunner

    node = ray.get_runtime_context().get_node_id()
    info = {"node_id": node, "pid": None, "ip": "127.0.0.1"}
    assignment = {s: (s,) for s in range(num_slices)}

    def per_step(workers: list) -> float:
        live = {s: LiveSlice(s, [workers[s]], [info]) for s in range(num_slices)}
        runner = StepRunner(FailureLocator(RayProbe(), time.monotonic, time.sleep), time.monotonic, pipeline=True)
        c0 = time.process_time()
        for k in range(steps + 1):
            if k == 1:  # the first step issues its gradients itself: not a steady step
                c0 = time.process_time()
            runner.run(k, live, assignment, frozenset(), 600.0, ahead=assignment if k < steps else None)
        return (time.process_time() - c0) / steps

    host = _host_class()
    actors = [host.remote() for _ in range(hosts)]
    try:
        ray.get([a.ping.remote() for a in actors], timeout=120)
        real = per_step([actors[s % hosts] for s in range(num_slices)])
    finally:
        for a in actors:
            ray.kill(a)

    class _Spec:
        def bundles(self):
            return [{}]

    fakes = FakeSlices.configured()(_Spec(), fake_program, 0, num_slices, "calibrate")
    workers = [fakes.start(s).workers[0] for s in range(num_slices)]
    for w in workers:
        w.step = 0
    fake = per_step(workers)
    return {"slices": num_slices, "steps": steps, "hosts": hosts, "real_cpu_s": real, "fake_cpu_s": fake,
            "fake_over_real": fake / real}


def _host_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=3, concurrency_groups={"compute": 1, "control": 1})
    class Host:
        """A real actor standing in for many slices' workers in `calibrate`:
        the calls and replies of `worker.actor.SliceWorker`, no JAX."""

        def ping(self) -> bool:
            return True

        def compute_grads(self, step, shards, *after):
            losses = {s: 1.0 for s in shards}
            return {"loss": losses}, {"grads": {s: {"w": np.zeros(16, np.float32)} for s in shards}, "loss": losses}

        def reduce(self, step, keys, parts, epoch=0):
            ray.get(parts)
            return {"count": len(keys)}, {"key": keys[0], "sum": {"w": np.zeros(16, np.float32)},
                                          "count": len(keys), "loss": {}}

        def apply(self, step, snapshot, parts, epoch=0):
            ray.get(parts)
            return {"step": step + 1, "loss": 1.0}, None

        def abort_waits(self, epoch, from_step=0) -> None:
            return None

    return Host


def submit_cost(num_slices: int, calls: Optional[int] = None) -> dict:
    """Driver-side time to submit one step's gradient hand-off to real Ray
    (the fakes pass refs in-process, so Ray's per-argument work is measured
    here, on an idle actor): as the controller does it now (a reduction
    tree of fan-in APPLY_FAN_IN down to one sum, then n apply calls of one
    ref each), and as it did before the tree (n apply calls of n refs
    each)."""
    import ray

    from ray_elastic.dispatch.step_runner import APPLY_FAN_IN
    from ray_elastic.dispatch.tree import deeper

    @ray.remote(num_cpus=0)
    class Sink:
        def apply(self, step, take, parts, epoch=0):
            return None

        def reduce(self, step, keys, parts, epoch=0):
            return None

    sink = Sink.remote()
    try:
        ray.get(sink.apply.remote(0, False, []))
        refs = [ray.put(0.0) for _ in range(num_slices)]
        calls = calls or max(3, min(40, 4096 // num_slices))
        t0 = time.perf_counter()
        out = [sink.apply.options(num_returns=1).remote(0, False, list(refs)) for _ in range(calls)]
        per_call = (time.perf_counter() - t0) / calls
        ray.get(out)
        reps = max(3, min(8, 4096 // num_slices))
        t0 = time.perf_counter()
        for _ in range(reps):
            level, built = list(refs), 0
            while deeper(len(level), built, APPLY_FAN_IN):  # the runner's own test
                built += 1
                level = [sink.reduce.remote(0, (), level[j:j + APPLY_FAN_IN])
                         for j in range(0, len(level), APPLY_FAN_IN)]
            out = [sink.apply.options(num_returns=1).remote(0, False, list(level)) for _ in range(num_slices)]
        per_step_tree = (time.perf_counter() - t0) / reps
        ray.get(out)
    finally:
        ray.kill(sink)
    return {"calls": calls, "fan_in": APPLY_FAN_IN, "per_step_s": per_step_tree,
            "per_step_before_s": per_call * num_slices}


def slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(y) on log(x)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def run(sizes: Sequence[int] = SIZES, steps: int = 40, failures: int = 5, quick: bool = False,
        log=print) -> dict:
    if quick:
        steps, failures = min(steps, 30), min(failures, 3)
    rows = []
    for n in sizes:
        row = measure(n, steps=steps, failures=failures)
        row["apply_submit"] = submit_cost(n)
        rows.append(row)
        log(f"  {n:5d} fake slices: {row['step_wall_s'] * 1e3:8.2f} ms/step "
            f"(controller only: wall {row['step_wall_ctl_s'] * 1e3:.2f} ms, CPU {row['step_cpu_ctl_s'] * 1e3:.2f} ms), "
            f"{row['failure_wall_s']['median'] * 1e3:8.2f} ms/failure "
            f"(controller CPU {row['failure_cpu_ctl_s']['median'] * 1e3:.2f} ms); real Ray gradient "
            f"hand-off submit {row['apply_submit']['per_step_s'] * 1e3:.1f} ms/step "
            f"(before the reduction tree: {row['apply_submit']['per_step_before_s'] * 1e3:.1f} ms)")
    xs = [r["slices"] for r in rows]
    fits = {}
    for key, _ in SERIES:
        ys = [_get(r, key) for r in rows]
        fits[key] = {"all": slope(xs, ys), "largest_two": slope(xs[-2:], ys[-2:]) if len(xs) >= 2 else None}
    return {"sizes": list(sizes), "rows": rows, "slopes": fits, "linear_if_slope_at_most": 1.1}


# (key, label) of every figure fitted and charted.
SERIES = (
    ("step_wall_s", "per step, wall"),
    ("step_cpu_s", "per step, driver CPU"),
    ("step_wall_ctl_s", "per step, wall, controller only"),
    ("step_cpu_ctl_s", "per step, driver CPU, controller only"),
    ("failure_wall_s", "per failure, wall"),
    ("failure_cpu_ctl_s", "per failure, driver CPU, controller only"),
    ("apply_submit_s", "Ray: gradient hand-off submit (reduction tree, now)"),
    ("apply_submit_before_s", "Ray: apply calls of n refs each (before)"),
)
# The figures that say whether the controller's own work is linear.
CONTROLLER_KEYS = ("step_cpu_ctl_s", "step_wall_ctl_s", "failure_cpu_ctl_s")


def _get(row: dict, key: str):
    if key.startswith("apply_submit"):
        sub = {"apply_submit_s": "per_step_s", "apply_submit_before_s": "per_step_before_s"}[key]
        return row["apply_submit"][sub]
    v = row[key]
    return v.get("median") if isinstance(v, dict) else v


def _ms(v) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f}"


def table(result: dict) -> str:
    lines = [
        "| slices | per step, wall (ms) | per step, driver CPU (ms) | … controller only, wall / CPU (ms) "
        "| per failure, detected→rejoined, wall (ms) | … controller only, CPU (ms) | fault→next step (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        f = r["failure_wall_s"]
        lines.append(
            f"| {r['slices']} | {_ms(r['step_wall_s'])} | {_ms(r['step_cpu_s'])} "
            f"| {_ms(r['step_wall_ctl_s'])} / {_ms(r['step_cpu_ctl_s'])} "
            f"| {_ms(f['median'])} [{_ms(f['min'])}–{_ms(f['max'])}] "
            f"| {_ms(r['failure_cpu_ctl_s']['median'])} | {_ms(r['recovered_s'].get('median'))} |"
        )
    lines += [
        "",
        "| slices | Ray: submit one step's gradient hand-off, reduction tree (now, ms) "
        "| … apply calls of n refs each (before, ms) |",
        "|---:|---:|---:|",
    ]
    for r in result["rows"]:
        a = r["apply_submit"]
        lines.append(f"| {r['slices']} | {_ms(a['per_step_s'])} | {_ms(a['per_step_before_s'])} |")
    s = result["slopes"]

    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}"

    lim = result["linear_if_slope_at_most"]
    lines += ["", f"| log-log slope (time vs slices) | all sizes | two largest | ≤ {lim} (no faster than linear) |",
              "|---|---:|---:|---|"]
    for key, label in SERIES:
        a, b = s[key]["all"], s[key]["largest_two"]
        ok = all(v is not None and v <= lim for v in (a, b))
        lines.append(f"| {label} | {fmt(a)} | {fmt(b)} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines)


def chart(result: dict, path: str) -> str:
    """Log-log chart of per-step and per-failure time against slices."""
    from bench.charts import _plt

    plt = _plt()
    rows = result["rows"]
    xs = [r["slices"] for r in rows]
    styles = {
        "step_wall_s": ("tab:blue", "o-"), "step_cpu_s": ("tab:cyan", "o-"),
        "step_wall_ctl_s": ("tab:blue", "o--"), "step_cpu_ctl_s": ("tab:cyan", "o--"),
        "failure_wall_s": ("tab:red", "s-"), "failure_cpu_ctl_s": ("tab:red", "s--"),
        "apply_submit_s": ("tab:green", "v-"), "apply_submit_before_s": ("tab:purple", "^--"),
    }
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    for key, label in SERIES:
        pts = [(x, _get(r, key)) for x, r in zip(xs, rows)]
        pts = [(x, y) for x, y in pts if y and y > 0]
        if not pts:
            continue
        colour, style = styles[key]
        k = result["slopes"][key]["all"]
        ax.plot(*zip(*pts), style, color=colour, markersize=4,
                label=f"{label} (slope {k:.2f})" if k is not None else label)
    if xs:  # a linear reference through the first per-step point
        y0 = rows[0]["step_wall_s"]
        ax.plot(xs, [y0 * x / xs[0] for x in xs], ":", color="gray", label="linear (slope 1)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("slices (simulated workers behind the real controller)")
    ax.set_ylabel("seconds")
    ax.set_title("Control-plane cost vs slices", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

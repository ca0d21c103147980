"""Control-plane scale: the real controller (`ElasticTrainer`) against
simulated slices (`ray_elastic.fake_slices.FakeSlices`: in-process fake
workers whose calls return real ObjectRefs), with 16 .. 1024 slices.

Per size, one run of `steps` steps with `failures` worker deaths (a real
`ActorDiedError` from the fake's call, at spread steps and slices) under
the resize policy. From the driver-side time of every completed step
(`on_step`):

- per step: the median time between consecutive completed steps without
  a failure (the whole control loop: membership check, drain check, both
  phases' calls, ray.wait/ray.get, snapshot bookkeeping, callbacks);
- per failure: the extra time of the steps around a failure (detect,
  classify, tear down, queue a replacement, reconcile the survivors' steps,
  join the replacement, redo the step) over two normal steps;
- "controller only": the same with the fakes' own time (building their
  results and `ray.put`) taken out.

The slope of log(time) against log(slices) (least squares over all sizes,
and between the two largest) says how the cost grows: 1.0 is linear.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Optional, Sequence

from bench.common import summary

SIZES = (16, 64, 256, 1024)


def _no_program():  # the fakes never build the program
    raise RuntimeError("fake slices do not run a program")


def _trainer_kwargs(backend) -> dict:
    """Use the controller's backend hook when it has one (see the report)."""
    import inspect

    from ray_elastic.controller import ElasticTrainer

    if "slices_backend" in inspect.signature(ElasticTrainer.__init__).parameters:
        return {"slices_backend": backend}
    return {}


def measure(num_slices: int, steps: int = 40, failures: int = 3, policy: str = "resize",
            seed: int = 0) -> dict:
    """One run of the real controller on `num_slices` fake slices."""
    from ray_elastic import ElasticConfig, ElasticTrainer
    from ray_elastic.callbacks import Callback
    from ray_elastic.fake_slices import FakeSlices, install

    rng = random.Random(seed)
    warmup = 4
    # Failures at steps spread over the run (at least 3 steps apart), each on
    # a random slice, while step `at` is in flight.
    span = max(1, steps - warmup - 4)
    fail_steps = sorted({warmup + 1 + (i * span) // max(1, failures) for i in range(failures)})
    plan = [(k, rng.randrange(num_slices)) for k in fail_steps]
    backend = FakeSlices.configured(fail=plan)
    stamps: list[tuple[int, float, float]] = []

    class Probe(Callback):
        def on_step(self, step, metrics):
            fake = backend.instances[-1].fake_s if backend.instances else 0.0
            stamps.append((step, time.perf_counter(), fake))

    config = ElasticConfig(num_slices=num_slices, policy=policy, max_retries=failures + 1,
                           first_step_deadline_s=600.0, step_deadline_floor_s=60.0)
    kwargs = _trainer_kwargs(backend)
    t0 = time.perf_counter()
    if kwargs:
        trainer = ElasticTrainer(_no_program, config, steps, callbacks=[Probe()], **kwargs)
        report = trainer.fit()
    else:
        with install(backend):
            trainer = ElasticTrainer(_no_program, config, steps, callbacks=[Probe()])
            report = trainer.fit()
    wall = time.perf_counter() - t0
    if report.steps_completed != steps:
        raise RuntimeError(f"{num_slices} fake slices: {report.steps_completed}/{steps} steps")
    if len(report.failures) != len(plan):
        raise RuntimeError(f"{num_slices} fake slices: {len(report.failures)} failures, planned {len(plan)}")

    # Interval ending at step s: (wall, fake) seconds since the previous step.
    intervals = {}
    for (s0, t0_, f0), (s1, t1, f1) in zip(stamps, stamps[1:]):
        intervals[s1] = (t1 - t0_, f1 - f0)
    # A failure while step k (0-based) is in flight shows up before the
    # completion of step k + 1, and a join may fall before step k + 2.
    touched = {k + d for k in fail_steps for d in (1, 2)}
    normal = [v for s, v in intervals.items() if s > warmup and s not in touched]
    step_s = statistics.median(w for w, _ in normal)
    step_ctl_s = statistics.median(w - f for w, f in normal)
    per_failure, per_failure_ctl = [], []
    for k in fail_steps:
        around = [intervals[k + d] for d in (1, 2) if k + d in intervals]
        per_failure.append(sum(w for w, _ in around) - len(around) * step_s)
        per_failure_ctl.append(sum(w - f for w, f in around) - len(around) * step_ctl_s)
    inst = backend.instances[-1]
    return {
        "slices": num_slices,
        "steps": steps,
        "failures": len(plan),
        "policy": policy,
        "wall_s": round(wall, 3),
        "step_s": step_s,
        "step_controller_s": step_ctl_s,
        "failure_s": summary(per_failure),
        "failure_controller_s": summary(per_failure_ctl),
        "detected_s": summary([f.detected_s for f in report.failures]),
        "recovered_s": summary([f.recovered_s for f in report.failures]),
        "steps_rewound": summary([f.steps_rewound for f in report.failures]),
        "fake_calls": inst.calls,
        "fake_s_total": round(inst.fake_s, 3),
        "replacements": len(inst.started) - num_slices,
        "hook": "slices_backend" if kwargs else "monkeypatched ray_elastic.controller.RaySlices",
    }


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


def run(sizes: Sequence[int] = SIZES, steps: int = 40, failures: int = 3, quick: bool = False,
        log=print) -> dict:
    if quick:
        steps, failures = min(steps, 30), min(failures, 3)
    rows = []
    for n in sizes:
        row = measure(n, steps=steps, failures=failures)
        rows.append(row)
        log(f"  {n:5d} fake slices: {row['step_s'] * 1e3:8.2f} ms/step "
            f"(controller {row['step_controller_s'] * 1e3:.2f} ms), "
            f"{row['failure_s']['median'] * 1e3:8.2f} ms/failure "
            f"(controller {row['failure_controller_s']['median'] * 1e3:.2f} ms)")
    xs = [r["slices"] for r in rows]
    fits = {}
    for key, get in (
        ("step_s", lambda r: r["step_s"]),
        ("step_controller_s", lambda r: r["step_controller_s"]),
        ("failure_s", lambda r: r["failure_s"]["median"]),
        ("failure_controller_s", lambda r: r["failure_controller_s"]["median"]),
    ):
        ys = [get(r) for r in rows]
        fits[key] = {"all": slope(xs, ys), "largest_two": slope(xs[-2:], ys[-2:]) if len(xs) >= 2 else None}
    return {"sizes": list(sizes), "rows": rows, "slopes": fits, "linear_if_slope_at_most": 1.1}


def _ms(v) -> str:
    return "n/a" if v is None else f"{v * 1e3:.2f}"


def table(result: dict) -> str:
    lines = [
        "| slices | per step (ms) | per step, controller only (ms) | per failure (ms), median [min–max] "
        "| per failure, controller only (ms) | fault→next step (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        f, fc, rec = r["failure_s"], r["failure_controller_s"], r["recovered_s"]
        lines.append(
            f"| {r['slices']} | {_ms(r['step_s'])} | {_ms(r['step_controller_s'])} "
            f"| {_ms(f['median'])} [{_ms(f['min'])}–{_ms(f['max'])}] | {_ms(fc['median'])} "
            f"| {_ms(rec.get('median'))} |"
        )
    s = result["slopes"]

    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}"

    lim = result["linear_if_slope_at_most"]
    lines.append("")
    lines.append("| log-log slope (time vs slices) | all sizes | two largest | no faster than linear (≤ "
                 f"{lim}) |")
    lines.append("|---|---:|---:|---|")
    for key, label in (("step_s", "per step"), ("step_controller_s", "per step, controller only"),
                       ("failure_s", "per failure"), ("failure_controller_s", "per failure, controller only")):
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
    fig, ax = plt.subplots(figsize=(7, 4.6))
    series = (
        ("per step", [r["step_s"] for r in rows], "tab:blue", "o-"),
        ("per step, controller only", [r["step_controller_s"] for r in rows], "tab:blue", "o--"),
        ("per failure", [r["failure_s"]["median"] for r in rows], "tab:red", "s-"),
        ("per failure, controller only", [r["failure_controller_s"]["median"] for r in rows], "tab:red", "s--"),
    )
    keys = ("step_s", "step_controller_s", "failure_s", "failure_controller_s")
    for (label, ys, colour, style), key in zip(series, keys):
        pts = [(x, y) for x, y in zip(xs, ys) if y and y > 0]
        if not pts:
            continue
        k = result["slopes"][key]["all"]
        ax.plot(*zip(*pts), style, color=colour,
                label=f"{label} (slope {k:.2f})" if k is not None else label)
    if xs:  # a linear reference through the first per-step point
        y0 = rows[0]["step_s"]
        ax.plot(xs, [y0 * x / xs[0] for x in xs], ":", color="gray", label="linear (slope 1)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("slices (simulated workers behind the real controller)")
    ax.set_ylabel("seconds")
    ax.set_title("Control-plane cost vs slices", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""What an in-memory snapshot costs, and the interval that pays for it:
`python -m bench snapshots [--quick] [--runs N] [--steps S]`.

One local cluster of 4 nodes, the example LM (`examples/lm.py`), 2 slices.

1. `cost`: per model size (small, medium, large) and hosts per slice (1:
   the replicated layout; 2: FSDP over the slice's hosts), one run with a
   snapshot every 3 steps and one with none, side by side. Per snapshot
   (the run report's `snapshots`): bytes per host, seconds from its step's
   end to sealed (off the step's path), and its cost on the step's path
   (`step_path_s`: the steps it overlapped over the median step); per
   snapshot too, the workers' CPU seconds it took: their CPU time (from
   /proc, every worker of the run) over the measured steps, with snapshots
   less without, over the snapshots taken.
2. `targets`: the large model on 2 slices x 2 hosts, FSDP, alternated
   rounds of: the default (`snapshot_every_replicated="auto"`), snapshots
   off, and the plain 4-process `jax.distributed` job with the same mesh
   and global batch (`bench/sharded_plain.py`). Mean and median step time
   after the warm-up, the interval the default chose, and what it means:
   at most how many steps a loss of every slice would redo, with the
   steady-state overhead C / (interval x step) it plans for.
3. `all_lost`: the small model under the default with a short
   `all_slices_mtbf_s` (so the interval is short enough to see), every
   slice killed at once: the steps redone against the `max_redo_steps` the
   report stated, and the final state bitwise equal to a failure-free run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time

from bench.common import ensure_nodes
from bench.sharded import plain_run

SLICES = 2
OBJECT_STORE_MB = 800  # per node: a replicated snapshot of the large state is one ~290 MiB object
WARMUP = 4  # steps left out of the step times (compile, first collectives)


def _cpu_s(pid: int) -> float:
    """utime + stime of process `pid` (its threads too), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def model(name: str):
    import examples.lm as lm

    return lm.PRESETS[name]


def elastic_run(config, hosts: int, steps: int, every, mtbf_s: float = 86400.0, faults=(), keep=False) -> dict:
    """One ray_elastic run on 2 slices x `hosts`; the workers' CPU seconds
    from step WARMUP to the end."""
    import examples.lm as lm
    from ray_elastic import Callback, CpuSlice, ElasticConfig, ElasticTrainer

    layout = lm.sharded_layout("fsdp") if hosts > 1 else lm.Layout()
    factory = functools.partial(lm.make_program, config, layout)
    cfg = ElasticConfig(num_slices=SLICES, slice=CpuSlice(hosts=hosts, devices_per_host=1), policy="pause",
                        snapshot_every_replicated=every, all_slices_mtbf_s=mtbf_s, step_deadline_floor_s=120.0,
                        first_step_deadline_s=600.0, timeout_s=600.0)
    cpu: dict = {}

    class Cpu(Callback):
        def on_start(self, trainer):
            self.trainer = trainer

        def on_step(self, step, metrics):
            if step not in (WARMUP, steps):
                return
            t = self.trainer
            pids = [i["pid"] for s in sorted(t.members.live) for i in t.hosts(s)]
            try:
                cpu[step] = sum(_cpu_s(p) for p in pids)
            except OSError:  # a worker replaced meanwhile: no figure
                cpu.pop(WARMUP, None)

    trainer = ElasticTrainer(factory, cfg, steps, callbacks=[Cpu()], faults=faults, keep_final_state=keep)
    t0 = time.monotonic()
    report = trainer.fit()
    out = {"hosts": hosts, "every": every, "steps": steps, "wall_s": time.monotonic() - t0,
           "step_times": list(report.step_times), "snapshots": report.snapshots,
           # The bound in force when a loss struck: snapshots measured before
           # the first (those after a rewind may have smaller steps).
           "snapshots_before_loss": _snapshots_before_loss(report.events),
           "failures": [dataclasses.asdict(f) for f in report.failures],
           "workers_cpu_s": cpu[steps] - cpu[WARMUP] if len(cpu) == 2 else None}
    if keep:
        out["final_state"] = trainer.final_state
    if report.steps_completed != steps:
        raise RuntimeError(f"run ended at {report.steps_completed}/{steps} steps: {report.error}")
    return out


def _after_warmup(times: list) -> list:
    return times[WARMUP:] or times


def _cost_cell(on: dict, off: dict) -> dict:
    snaps = [s for s in on["snapshots"] if s["step"] > WARMUP]
    cpu = None
    if on["workers_cpu_s"] is not None and off["workers_cpu_s"] is not None and snaps:
        cpu = (on["workers_cpu_s"] - off["workers_cpu_s"]) / len(snaps)

    def med(key):
        vals = [s[key] for s in snaps if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {"snapshots": len(snaps), "bytes_per_host": med("bytes_per_host"), "seal_s": med("seal_s"),
            "step_path_s": med("step_path_s"), "views_cpu_s": med("views_cpu_s"), "cpu_s_per_snapshot": cpu,
            "median_step_on": statistics.median(_after_warmup(on["step_times"])),
            "median_step_off": statistics.median(_after_warmup(off["step_times"]))}


def run(cluster, quick: bool = False, runs: int = None, steps: int = None, log=print, partial_path: str = "") -> dict:
    ensure_nodes(cluster, SLICES * 2)
    rounds = runs or (1 if quick else 2)
    t0 = time.monotonic()
    result: dict = {"cost": {}, "targets": [], "quick": quick, "warmup_steps": WARMUP}

    def save():
        if partial_path:
            with open(partial_path, "w") as f:
                json.dump({k: v for k, v in result.items()}, f, default=str)

    # 1. cost per size and hosts per slice
    sizes = ("small", "large") if quick else ("small", "medium", "large")
    for name in sizes:
        for hosts in (1, 2):
            n = 12 if name == "large" else 30
            on = elastic_run(model(name), hosts, n, 3)
            off = elastic_run(model(name), hosts, n, 10 ** 9)
            cell = result["cost"][f"{name} x{hosts}"] = _cost_cell(on, off)
            log(f"  cost {name} x{hosts}: {json.dumps(cell)}")
            save()

    # 2. targets: large, 2 x 2 FSDP, alternated
    n = steps or (16 if quick else 40)
    large = model("large")
    for r in range(rounds):
        for system in ("default", "off", "plain"):
            t = time.monotonic()
            if system == "plain":
                times = plain_run(large, n)["step_times"]
                snaps = []
            else:
                out = elastic_run(large, 2, n, "auto" if system == "default" else 10 ** 9)
                times, snaps = out["step_times"], out["snapshots"]
            kept = _after_warmup(times)
            row = {"round": r, "system": system, "mean": statistics.mean(kept), "median": statistics.median(kept),
                   "steps": len(kept), "snapshots": snaps}
            result["targets"].append(row)
            log(f"  {system} round {r}: mean {row['mean']:.3f} s, median {row['median']:.3f} s "
                f"({len(snaps)} snapshots measured, {time.monotonic() - t:.0f} s)")
            save()

    # 3. every slice lost at once, under the default
    small, n3, fail_at = model("small"), 60, 40
    from ray_elastic import Fault

    ref = elastic_run(small, 1, n3, "auto", mtbf_s=30.0, keep=True)
    hit = elastic_run(small, 1, n3, "auto", mtbf_s=30.0, keep=True,
                      faults=(Fault("kill", 0, fail_at), Fault("kill", 1, fail_at)))
    before = hit["snapshots_before_loss"]
    result["all_lost"] = {
        "fail_at": fail_at, "failures": hit["failures"],
        "stated_max_redo_steps": before[-1]["max_redo_steps"] if before else None,
        "interval": before[-1]["interval"] if before else None,
        "steps_redone": max((f["steps_rewound"] for f in hit["failures"]), default=0),
        "bitwise_equal": _same(ref["final_state"], hit["final_state"]),
    }
    log(f"  all_lost: {json.dumps(result['all_lost'], default=str)}")
    result["wall_s"] = time.monotonic() - t0
    save()
    return result


def _snapshots_before_loss(events: list) -> list:
    snaps = []
    for e in events:
        if e["event"] == "detected":
            break
        if e["event"] == "snapshot":
            snaps.append(e)
    return snaps


def _same(a, b) -> bool:
    import jax
    import numpy as np

    if a["step"] != b["step"]:
        return False
    la = jax.tree.leaves((a["params"], a["opt_state"]))
    lb = jax.tree.leaves((b["params"], b["opt_state"]))
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def _f(x, fmt="{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def table(r: dict) -> str:
    lines = ["### What a snapshot costs (2 slices, a snapshot every 3 steps against none; medians per snapshot)", "",
             "| model x hosts/slice | snapshots | MiB per host | sealed after (s, off the step's path) | "
             "on the step's path (s) | workers' CPU s per snapshot | median step on / off (s) |",
             "|---|---|---|---|---|---|---|"]
    for key, c in r["cost"].items():
        mib = None if c["bytes_per_host"] is None else c["bytes_per_host"] / 2 ** 20
        lines.append(f"| {key} | {c['snapshots']} | {_f(mib, '{:.1f}')} | {_f(c['seal_s'])} | {_f(c['step_path_s'])} | "
                     f"{_f(c['cpu_s_per_snapshot'])} | {_f(c['median_step_on'])} / {_f(c['median_step_off'])} |")
    lines += ["", "### Large model, 2 slices x 2 hosts, FSDP: step time after the warm-up (alternated rounds)", "",
              "| round | system | mean (s) | median (s) | snapshots measured | interval chosen | max steps redone |",
              "|---|---|---|---|---|---|---|"]
    for row in r["targets"]:
        last = row["snapshots"][-1] if row["snapshots"] else {}
        lines.append(f"| {row['round']} | {row['system']} | {row['mean']:.3f} | {row['median']:.3f} | "
                     f"{len(row['snapshots'])} | {last.get('interval', '')} | {last.get('max_redo_steps', '')} |")

    def med(system, key):
        vals = [row[key] for row in r["targets"] if row["system"] == system]
        return statistics.median(vals) if vals else None

    d, off, plain = (med(s, "mean") for s in ("default", "off", "plain"))
    dm, plainm = med("default", "median"), med("plain", "median")
    if d and off and plain:
        lines += ["", f"- mean step, default against snapshots off: {100 * (d / off - 1):+.2f}% (target <= +1%)",
                  f"- mean step, default against plain jax.distributed: {100 * (d / plain - 1):+.2f}% (target <= +3%)",
                  f"- median step, default against plain jax.distributed: {100 * (dm / plainm - 1):+.2f}% "
                  "(target <= +2%)"]
    snaps = [s for row in r["targets"] if row["system"] == "default" for s in row["snapshots"]]
    if snaps and off:
        s = snaps[-1]
        cost = statistics.median([x["step_path_s"] for x in snaps])
        lines.append(f"- the default chose {s['interval']} steps (mtbf {s['mtbf_s']:.0f} s, a snapshot's cost "
                     f"{cost:.3f} s): steady-state overhead {100 * max(cost, 0) / (s['interval'] * off):.2f}% of the "
                     f"step time; a loss of every slice redoes at most {s['max_redo_steps']} steps")
    a = r.get("all_lost")
    if a:
        lines += ["", f"### Every slice lost at once (small model, all_slices_mtbf_s=30, killed at step {a['fail_at']})",
                  "", f"- interval {a['interval']}, report's max_redo_steps {a['stated_max_redo_steps']}, "
                  f"steps redone {a['steps_redone']}; final state bitwise equal to a failure-free run: "
                  f"{a['bitwise_equal']}"]
    return "\n".join(lines)


def write(result: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    files = {"json": os.path.join(out_dir, "snapshots.json"), "md": os.path.join(out_dir, "snapshots.md")}
    with open(files["json"], "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(files["md"], "w") as f:
        f.write(table(result) + "\n")
    return files

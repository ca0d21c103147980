"""The elastic core's targets, measured on a real local cluster:

- detection: fault (SIGKILL of a worker) to the exception in the driver;
- recovery: fault to the next completed step (replica resize);
- steps redone after the fault;
- step time with in-memory snapshots every step against snapshots off,
  run alternately so both see the same machine load.
"""

from __future__ import annotations

import time

from bench.common import ensure_nodes, lm_factory, steady_step_time, summary


def recovery_runs(cluster, runs: int, steps: int, fail_at: int, fault: str = "kill", policy: str = "resize") -> dict:
    from ray_elastic import ElasticConfig, ElasticTrainer, Fault

    rows = []
    for i in range(runs):
        ensure_nodes(cluster, 2)
        added = []

        def on_event(e, added=added):
            # A lost node gets a replacement once training has resumed (or,
            # when pausing, while the run waits for it).
            trigger = "wait" if policy == "pause" else "recovered"
            if fault == "remove_node" and e["event"] == trigger and not added:
                added.append(cluster.add_node())

        trainer = ElasticTrainer(
            lm_factory(),
            ElasticConfig(num_slices=2, policy=policy, step_deadline_floor_s=2.0),
            steps,
            faults=(Fault(fault, 1, fail_at),),
            remove_node=cluster.remove_node,
            on_event=on_event,
        )
        report = trainer.fit()
        f = report.failures[0]
        rows.append(
            {
                "run": i,
                "kind": f.kind,
                "detected_s": f.detected_s,
                "recovered_s": f.recovered_s,
                "steps_rewound": f.steps_rewound,
                "step_time_s": steady_step_time(report),
                "goodput": report.goodput,
            }
        )
        print(f"  {policy}/{fault} run {i}: detected {f.detected_s:.3f} s, next step {f.recovered_s:.3f} s, "
              f"redone {f.steps_rewound}", flush=True)
    return {
        "policy": policy,
        "fault": fault,
        "runs": rows,
        "detected_s": summary([r["detected_s"] for r in rows]),
        "recovered_s": summary([r["recovered_s"] for r in rows]),
        "steps_rewound": summary([r["steps_rewound"] for r in rows]),
    }


def snapshot_overhead(cluster, pairs: int, steps: int) -> dict:
    from ray_elastic import ElasticConfig, ElasticTrainer

    ensure_nodes(cluster, 2)
    on, off = [], []
    for i in range(pairs):
        for every, sink in ((1, on), (0, off)) if i % 2 == 0 else ((0, off), (1, on)):
            report = ElasticTrainer(
                lm_factory(), ElasticConfig(num_slices=2, policy="resize", snapshot_every=every), steps
            ).fit()
            sink.append(steady_step_time(report))
        print(f"  pair {i}: snapshots on {on[-1] * 1e3:.1f} ms/step, off {off[-1] * 1e3:.1f} ms/step", flush=True)
    med_on, med_off = summary(on)["median"], summary(off)["median"]
    return {
        "step_time_on_s": summary(on),
        "step_time_off_s": summary(off),
        "overhead": med_on / med_off - 1.0,
    }


def run(cluster, quick: bool) -> dict:
    runs = 3 if quick else 7
    t0 = time.monotonic()
    out = {
        "recovery": recovery_runs(cluster, runs=runs, steps=40 if quick else 60, fail_at=15),
        "snapshots": snapshot_overhead(cluster, pairs=2 if quick else 5, steps=80 if quick else 200),
    }
    out["wall_s"] = time.monotonic() - t0
    return out


def table(result: dict) -> str:
    rec, snap = result["recovery"], result["snapshots"]

    def fmt(s, scale=1.0, unit=""):
        return f"{s['median'] * scale:.3f}{unit} [{s['min'] * scale:.3f}–{s['max'] * scale:.3f}]"

    lines = [
        "| figure (2 slices x 1 host, resize, worker SIGKILLed) | median [min–max] | target |",
        "|---|---|---|",
        f"| detection, fault to exception | {fmt(rec['detected_s'], unit=' s')} | ≤ 1 s |",
        f"| fault to next completed step | {fmt(rec['recovered_s'], unit=' s')} | ≤ 3 s |",
        f"| steps redone | {fmt(rec['steps_rewound'])} | ≤ 1 |",
        f"| step time, snapshots every step | {fmt(snap['step_time_on_s'], 1e3, ' ms')} | |",
        f"| step time, snapshots off | {fmt(snap['step_time_off_s'], 1e3, ' ms')} | |",
        f"| snapshot overhead (ratio of medians) | {snap['overhead'] * 100:+.1f} % | ≤ 5 % |",
    ]
    return "\n".join(lines)

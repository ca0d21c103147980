"""Detection of lost and hung hosts on Ray's default health-check settings
and on the tuned ones the shipped cluster configs set, side by side, with
ray_elastic's own settings at their defaults (the step deadline's 10 s
floor, heartbeats after 1 s).

Each run gets its own local cluster (health checks are head settings):
2 slices under resize, at step 10 one node removed (raylet and processes
killed) or frozen (raylet and processes SIGSTOPped), one worker stopped
(SIGSTOP), or one slice slowed by 3 s a step (a `slow` fault: well over
20x the median step, and no hang); and, under pause, one node removed
while a new node joins once the failure is detected (as an autoscaler
would add one): its fault -> next step is the replacement's whole way
back. Figures per setting: the kind reported, detection (fault ->
exception in the driver), fault -> next completed step, and the share of
a core Ray's GCS used from the fault to the run's end, medians over the
runs; for `slow`, the failures seen (none is right) and the slowest step
against the median before the fault.

    python -m bench detect [--runs N] [--variants remove_node,remove_node_pause]
"""

from __future__ import annotations

import os
import time

from bench.common import ROOT, lm_factory, summary

SETTINGS = ("default", "tuned")
FAULTS = ("remove_node", "freeze_node", "stop", "slow", "remove_node_pause")
# The worker-level faults do not depend on the nodes' health checks.
SETTINGS_OF = {"stop": ("default",), "slow": ("default",)}
SLOW_MS = 3000


def one_run(health_checks: str, fault: str, steps: int = 30, fail_at: int = 10) -> dict:
    import psutil

    from ray_elastic import ElasticConfig, ElasticTrainer, Fault
    from ray_elastic.cluster.local_cluster import LocalCluster

    pause = fault == "remove_node_pause"
    cluster = LocalCluster(num_nodes=2, health_checks=health_checks)
    gcs = psutil.Process(cluster.gcs_pid())
    gcs_cpu = lambda: sum(gcs.cpu_times()[:2])  # noqa: E731
    at_fault: list = []

    def on_event(e):
        if e["event"] == "fault":
            at_fault[:] = [time.monotonic(), gcs_cpu()]
        if e["event"] == "detected" and pause:
            cluster.add_node()

    try:
        cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
        trainer = ElasticTrainer(
            lm_factory(),
            ElasticConfig(num_slices=2, policy="pause") if pause
            else ElasticConfig(num_slices=2, policy="resize", min_slices=1),
            steps if fault != "slow" else fail_at + 6,
            faults=(Fault("remove_node" if pause else fault, 1, fail_at, ms=SLOW_MS if fault == "slow" else 0),),
            remove_node=cluster.remove_node,
            freeze_node=cluster.freeze_node,
            on_event=on_event,
        )
        report = trainer.fit()
        gcs_share = (gcs_cpu() - at_fault[1]) / (time.monotonic() - at_fault[0]) if at_fault else None
    finally:
        cluster.shutdown()
    if fault == "slow":  # right: no failure, the slow steps waited for
        before = sorted(report.step_times[2:fail_at])[len(report.step_times[2:fail_at]) // 2]
        return {"setting": health_checks, "fault": fault, "kind": report.failures[0].kind if report.failures else "none",
                "failures": len(report.failures), "median_before_s": before,
                "slowest_after_s": max(report.step_times[fail_at:]), "detected_s": None, "recovered_s": None}
    f = report.failures[0]  # the injected fault; any later ones are listed
    return {"setting": health_checks, "fault": fault, "kind": f.kind, "cause": f.cause[:160],
            "detected_s": f.detected_s, "recovered_s": f.recovered_s, "gcs_share": gcs_share,
            "later_failures": [(g.kind, g.slice, g.step, g.cause[:120]) for g in report.failures[1:]]}


def run(runs: int = 3, faults=None) -> dict:
    faults = tuple(faults or FAULTS)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise SystemExit(f"--variants: unknown faults {sorted(unknown)}; choose from {','.join(FAULTS)}")
    rows = []
    for r in range(runs):
        for fault in faults:
            for setting in SETTINGS_OF.get(fault, SETTINGS):  # alternated, so load hits both alike
                row = one_run(setting, fault)
                if fault == "slow":
                    print(f"run {r + 1}/{runs} {fault:12s} {setting:8s} failures {row['failures']}, slowest step "
                          f"{row['slowest_after_s']:.3f} s against a median of {row['median_before_s']:.3f} s", flush=True)
                else:
                    print(f"run {r + 1}/{runs} {fault:12s} {setting:8s} {row['kind']:10s} "
                          f"detected {row['detected_s']:.3f} s, next step {row['recovered_s']:.3f} s, "
                          f"GCS {row['gcs_share']:.2f} of a core", flush=True)
                rows.append(row)
    cells = {}
    for fault in faults:
        for setting in SETTINGS_OF.get(fault, SETTINGS):
            mine = [x for x in rows if x["fault"] == fault and x["setting"] == setting]
            cells[f"{fault}/{setting}"] = {
                "kinds": sorted({x["kind"] for x in mine}),
                "detected_s": summary([x["detected_s"] for x in mine]),
                "recovered_s": summary([x["recovered_s"] for x in mine]),
                **({"gcs_share": summary([x["gcs_share"] for x in mine])} if fault != "slow" else {}),
                **({"slowest_over_median": summary([x["slowest_after_s"] / x["median_before_s"] for x in mine])}
                   if fault == "slow" else {}),
            }
    return {"runs": rows, "cells": cells}


def table(result: dict) -> str:
    lines = ["| fault | health checks | kind | detection (median [min-max]) | fault -> next step | GCS, fault -> end |",
             "|---|---|---|---|---|---|"]
    for key, c in result["cells"].items():
        fault, setting = key.split("/")
        d, r = c["detected_s"], c["recovered_s"]
        if fault == "slow":
            x = c["slowest_over_median"]
            lines.append(f"| slow (+{SLOW_MS} ms a step) | {setting} | {', '.join(c['kinds'])} | no hang: slowest step "
                         f"{x['median']:.0f}x the median [{x['min']:.0f}-{x['max']:.0f}] | n/a | n/a |")
            continue
        lines.append(f"| {fault} | {setting} | {', '.join(c['kinds'])} | "
                     f"{d['median']:.3f} s [{d['min']:.3f}-{d['max']:.3f}] | "
                     f"{r['median']:.3f} s [{r['min']:.3f}-{r['max']:.3f}] | "
                     f"{c['gcs_share']['median']:.2f} of a core [{c['gcs_share']['min']:.2f}-{c['gcs_share']['max']:.2f}] |")
    return "\n".join(lines)

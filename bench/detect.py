"""Node-loss detection on Ray's default health-check settings and on the
tuned ones the shipped cluster configs set, side by side.

Each run gets its own local cluster (health checks are head settings):
2 slices under resize, one node removed (raylet and processes killed) or
frozen (raylet and processes SIGSTOPped) at step 10. Figures per setting:
the kind reported, detection (fault -> exception in the driver) and fault
-> next completed step, medians over the runs.

    python -m bench detect [--runs N]
"""

from __future__ import annotations

import os

from bench.common import ROOT, lm_factory, summary

SETTINGS = ("default", "tuned")
FAULTS = ("remove_node", "freeze_node")


def one_run(health_checks: str, fault: str, steps: int = 30, fail_at: int = 10) -> dict:
    from ray_elastic import ElasticConfig, ElasticTrainer, Fault
    from ray_elastic.cluster.local_cluster import LocalCluster

    cluster = LocalCluster(num_nodes=2, health_checks=health_checks)
    try:
        cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
        trainer = ElasticTrainer(
            lm_factory(),
            ElasticConfig(num_slices=2, policy="resize", min_slices=1, step_deadline_floor_s=2.0),
            steps,
            faults=(Fault(fault, 1, fail_at),),
            remove_node=cluster.remove_node,
            freeze_node=cluster.freeze_node,
        )
        report = trainer.fit()
    finally:
        cluster.shutdown()
    f = report.failures[0]  # the injected fault; any later ones are listed
    return {"setting": health_checks, "fault": fault, "kind": f.kind,
            "detected_s": f.detected_s, "recovered_s": f.recovered_s,
            "later_failures": [(g.kind, g.slice, g.step, g.cause[:120]) for g in report.failures[1:]]}


def run(runs: int = 3) -> dict:
    rows = []
    for r in range(runs):
        for fault in FAULTS:
            for setting in SETTINGS:  # alternated, so load hits both alike
                row = one_run(setting, fault)
                print(f"run {r + 1}/{runs} {fault:12s} {setting:8s} {row['kind']:10s} "
                      f"detected {row['detected_s']:.3f} s, next step {row['recovered_s']:.3f} s", flush=True)
                rows.append(row)
    cells = {}
    for fault in FAULTS:
        for setting in SETTINGS:
            mine = [x for x in rows if x["fault"] == fault and x["setting"] == setting]
            cells[f"{fault}/{setting}"] = {
                "kinds": sorted({x["kind"] for x in mine}),
                "detected_s": summary([x["detected_s"] for x in mine]),
                "recovered_s": summary([x["recovered_s"] for x in mine]),
            }
    return {"runs": rows, "cells": cells}


def table(result: dict) -> str:
    lines = ["| fault | health checks | kind | detection (median [min-max]) | fault -> next step |",
             "|---|---|---|---|---|"]
    for key, c in result["cells"].items():
        fault, setting = key.split("/")
        d, r = c["detected_s"], c["recovered_s"]
        lines.append(f"| {fault} | {setting} | {', '.join(c['kinds'])} | "
                     f"{d['median']:.3f} s [{d['min']:.3f}-{d['max']:.3f}] | "
                     f"{r['median']:.3f} s [{r['min']:.3f}-{r['max']:.3f}] |")
    return "\n".join(lines)

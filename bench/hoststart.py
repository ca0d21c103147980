"""Multi-host CPU slices with and without the hosts' own compile cache
(`python -m bench hoststart [--runs N] [--out DIR]`).

JAX's persistent compile cache serves only host 0 of a multi-host CPU
slice (worker/host_cache.py says why); hosts 1 and up keep their own
compiled functions in `compile_cache_dir/ray_elastic-hosts`. Each run
here is a whole run of the example LM (fsdp) on 2 slices of 2 hosts of
2 devices, 8 steps, with a worker of host 1 of slice 1 SIGKILLed at step
3 (pause: its replacement is set up and joins). Two variants, alternated
so that they share the machine's load:
- `default`: the hosts' folder kept from the run before;
- `cold_hosts`: that folder emptied before the run, so that hosts 1 and up
  compile every function at the start, as they all did at every start
  before it existed (host 0 still reads JAX's own cache in both). The
  replacement reads the folder in both: the run's own start filled it.
A first run fills both caches and is left out.

Figures per run: `start` (the trainer's construction to its slices up),
`first_step` (step 0: the step-0 state is made and the first gradients
and apply run), `replacement` (the killed slice's new workers, placement
to set up: SliceUp.setup_s) and `total` (the whole fit).
"""

from __future__ import annotations

import functools
import os
import shutil
import time

from bench.common import summary

SLICES, HOSTS, DEVICES, STEPS, KILL_AT = 2, 2, 2, 8, 3
VARIANTS = ("default", "cold_hosts")


def one_run(variant: str) -> dict:
    import examples.lm as lm
    from ray_elastic import CpuSlice, ElasticConfig, ElasticTrainer, Fault
    from ray_elastic.worker.host_cache import FOLDER

    config = ElasticConfig(num_slices=SLICES, slice=CpuSlice(hosts=HOSTS, devices_per_host=DEVICES), policy="pause",
                           timeout_s=180.0)
    if variant == "cold_hosts":
        shutil.rmtree(os.path.join(config.compile_cache_dir, FOLDER), ignore_errors=True)
    marks: dict = {}
    t0 = time.monotonic()

    def on_event(e):
        now = time.monotonic() - t0
        if e["event"] == "start":
            marks["start"] = now
        elif e["event"] == "replace":
            marks["replacing"] = True
        elif e["event"] == "slice_ready" and marks.get("replacing"):
            marks.setdefault("replacement", e["setup_s"])

    trainer = ElasticTrainer(functools.partial(lm.make_program, lm.LMConfig(), lm.sharded_layout("fsdp")), config,
                             STEPS, faults=(Fault("kill", slice_id=1, step=KILL_AT, host=HOSTS - 1),),
                             on_event=on_event)
    report = trainer.fit()
    total = time.monotonic() - t0
    if report.steps_completed != STEPS or [f.kind for f in report.failures] != ["process_died"]:
        raise RuntimeError(f"{variant}: {report.steps_completed} steps, failures {report.failures}")
    return {"variant": variant, "start_s": marks["start"], "first_step_s": report.step_times[0],
            "replacement_s": marks["replacement"], "total_s": total}


def run(cluster, runs: int = 3, warm_up: bool = True) -> dict:
    """`warm_up=False` skips the first run (a quick check that both
    variants run whole: its figures are not comparable)."""
    from bench.common import ensure_nodes

    ensure_nodes(cluster, SLICES * HOSTS)
    if warm_up:
        one_run("default")  # fills JAX's cache and the hosts' folder: left out
    rows = []
    for r in range(runs):
        for variant in VARIANTS:
            row = one_run(variant)
            rows.append(row)
            print(f"run {r + 1}/{runs} {variant:10s} start {row['start_s']:.1f} s, first step "
                  f"{row['first_step_s']:.1f} s, replacement {row['replacement_s']:.1f} s, "
                  f"total {row['total_s']:.1f} s", flush=True)
    cells = {v: {k: summary([x[k] for x in rows if x["variant"] == v])
                 for k in ("start_s", "first_step_s", "replacement_s", "total_s")} for v in VARIANTS}
    return {"runs": rows, "cells": cells}


def table(result: dict) -> str:
    lines = ["| variant | start | first step | replacement set-up | whole run |", "|---|---|---|---|---|"]
    for v, c in result["cells"].items():
        lines.append("| " + v + " | " + " | ".join(
            f"{c[k]['median']:.1f} s [{c[k]['min']:.1f}-{c[k]['max']:.1f}]"
            for k in ("start_s", "first_step_s", "replacement_s", "total_s")) + " |")
    return "\n".join(lines)

"""Shared pieces of the benchmarks: one local cluster, the example program,
robust summaries."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def lm_factory():
    import examples.lm as lm

    return functools.partial(lm.make_program, lm.LMConfig())


def start_cluster(num_nodes: int):
    from ray_elastic.local_cluster import LocalCluster

    cluster = LocalCluster(num_nodes=num_nodes)
    cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
    return cluster


def ensure_nodes(cluster, n: int) -> None:
    import ray

    alive = {x["NodeID"] for x in ray.nodes() if x["Alive"]}
    for node_id in list(cluster.nodes):
        if node_id not in alive:
            cluster.nodes.pop(node_id)
    while len(cluster.nodes) > n:
        node_id = next(reversed(cluster.nodes))
        cluster.cluster.remove_node(cluster.nodes.pop(node_id))
    while len(cluster.nodes) < n:
        cluster.add_node()


def summary(values: list[float]) -> dict:
    """Median with spread (min, max, and the interquartile range)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"n": 0}
    q = statistics.quantiles(vals, n=4) if len(vals) >= 2 else [vals[0]] * 3
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "p25": q[0],
        "p75": q[2],
    }


def steady_step_time(report, skip_first: int = 5) -> float:
    """Median step time over the steps run on every slice, skipping warm-up
    and steps right after a membership change."""
    times = [
        t for i, (t, n) in enumerate(zip(report.step_times, report.slices_per_step))
        if i >= skip_first and n == report.num_slices
    ]
    return statistics.median(times) if times else float("nan")


@contextlib.contextmanager
def idle_cpu_load():
    """A busy loop in Linux's idle CPU class for the duration: the least any
    background work can cost training on shared cores, a reference for the
    checkpoint writer (which runs its periodic saves in that class)."""
    code = "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()

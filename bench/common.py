"""Shared pieces of the benchmarks: one local cluster, the example program,
robust summaries."""

from __future__ import annotations

import contextlib
import functools
import json
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


def start_cluster(num_nodes: int, object_store_mb: int = 200):
    from ray_elastic.cluster.local_cluster import LocalCluster

    cluster = LocalCluster(num_nodes=num_nodes, object_store_mb=object_store_mb)
    cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
    return cluster


def ensure_nodes(cluster, n: int) -> None:
    """Exactly n nodes, extras removed: a parked node's idle daemons would
    count in the figures."""
    cluster.ensure_nodes(n, park=False)


def write_result(out_dir: str, name: str, result: dict, text: str) -> None:
    """Write a suite's figures as NAME.json and its table as NAME.md under out_dir."""
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text + "\n")


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


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DaemonCpu:
    """CPU seconds Ray's daemons (GCS, raylets, dashboard and its agents,
    log monitors) take on this machine while a bench runs, sampled every
    `period_s` in a thread, per kind. On a real cluster these run on the
    head and beside each host's workers; here they share the 2 cores with
    every slice, so their load is the slices' loss."""

    def __init__(self, period_s: float = 1.0):
        import threading

        self._period = period_s
        self._first: dict = {}  # pid -> (kind, cpu seconds when first seen)
        self._last: dict = {}  # pid -> cpu seconds when last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-daemon-cpu")
        self.timeline: list = []  # (monotonic, {kind: cpu seconds so far})

    def __enter__(self) -> "DaemonCpu":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def _sample(self) -> None:
        import time

        import psutil

        from ray_elastic.cluster.external_nodes import RAY_DAEMONS

        for p in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            cmd = " ".join(p.info.get("cmdline") or [])
            kind = next((k for k, needle in RAY_DAEMONS.items() if needle in cmd), None)
            t = p.info.get("cpu_times")
            if kind is None or t is None:
                continue
            cpu = t.user + t.system
            self._first.setdefault(p.info["pid"], (kind, cpu))
            self._last[p.info["pid"]] = cpu
        self.timeline.append((time.monotonic(), self.by_kind()))

    def by_kind(self) -> dict:
        out: dict = {}
        for pid, (kind, first) in self._first.items():
            out[kind] = out.get(kind, 0.0) + self._last.get(pid, first) - first
        return {k: round(v, 3) for k, v in sorted(out.items())}

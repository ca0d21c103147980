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


def start_cluster(num_nodes: int, object_store_mb: int = 200):
    from ray_elastic.local_cluster import LocalCluster

    cluster = LocalCluster(num_nodes=num_nodes, object_store_mb=object_store_mb)
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


def _renice_group(pgid: int, nice: int) -> None:
    """Set the CPU priority of every process in a process group."""
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                p.nice(nice)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ExternalNodes:
    """Replacement nodes started as separate processes (`ray start --block`
    with the resources a LocalCluster node has), from any thread, as an
    autoscaler adds them: `Cluster.add_node` must run on the main thread,
    which for ray_elastic is the controller's, so adding a node there
    stalls training. Each node is its own process group, stopped by pid
    (`stop_all`), and waited for until Ray has it dead, so the next run
    does not place anything on it."""

    def __init__(self, cluster):
        self.address = cluster.address
        self.cpus = getattr(cluster, "_cpus", 1)
        self.store = getattr(cluster, "_store", 200 * 1024 * 1024)
        self.procs: list = []  # (Popen, node name)
        self.threads: list = []
        self.started_at: list = []

    def add(self) -> None:
        """Start a node now, without waiting for it (a background thread)."""
        import threading
        import time
        import uuid

        name = f"bench-ext-{uuid.uuid4().hex[:8]}"
        self.started_at.append(time.monotonic())

        def go():
            # Every port a node's agents bind, free ones: by default the
            # dashboard agent takes 52365, which another node on this
            # machine may hold; its agent then fails and Ray's raylet
            # exits with it (seen in a chaos run: the node never came up).
            ports = {flag: _free_port() for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                     "runtime-env-agent-port", "metrics-export-port")}
            cmd = ["ray", "start", "--block", f"--address={self.address}", f"--num-cpus={self.cpus}",
                   f"--object-store-memory={self.store}", f"--node-name={name}", "--disable-usage-stats",
                   *(f"--{flag}={port}" for flag, port in ports.items())]
            # A new machine starts its agents in seconds; here they compete
            # with training for 2 cores, and the raylet aborts when its
            # dashboard agent has not registered within Ray's default
            # (`WaitForDashboardAgentPorts`, seen in chaos runs): give it
            # longer, and start the node again if it died anyway, as an
            # autoscaler retries a failed launch.
            # Ray 2.60's raylet waits 15 s for its agents' port files
            # whatever that setting says: the node starts at a raised CPU
            # priority (nice -10), as a machine of its own would have its
            # CPUs, and goes back to the default once it is up.
            env = {**os.environ, "RAY_agent_register_timeout_ms": "120000"}
            for _ in range(3):
                proc = subprocess.Popen(["nice", "-n", "-10", *cmd], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True, env=env)
                self.procs.append((proc, name))
                up = self._came_up(proc, name)
                _renice_group(proc.pid, 0)
                if up:
                    return

        t = threading.Thread(target=go, daemon=True, name="bench-add-node")
        t.start()
        self.threads.append(t)

    @staticmethod
    def _came_up(proc, name: str, timeout_s: float = 180.0) -> bool:
        """True once the node is alive in Ray; False if its `ray start`
        exited first (or never got there)."""
        import time

        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if any(x.get("NodeName") == name and x["Alive"] for x in ray.nodes()):
                return True
            time.sleep(1.0)
        return False

    def node_ids(self) -> list[str]:
        import ray

        names = {n for _, n in self.procs}
        return [x["NodeID"] for x in ray.nodes() if x.get("NodeName") in names and x["Alive"]]

    def remove(self, node_id: str) -> bool:
        """Take one of these nodes away at once (SIGKILL to its process
        group: `ray start`, the raylet, its workers), as a lost machine
        goes. False if `node_id` is not one of them."""
        import signal

        import ray

        name = next((x.get("NodeName") for x in ray.nodes() if x["NodeID"] == node_id), None)
        found = False
        for proc, n in self.procs:  # a retried launch left earlier, dead, processes under the name
            if n == name:
                found = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        return found

    def stop_all(self, wait_s: float = 20.0) -> None:
        import signal
        import time

        import ray

        for t in self.threads:
            t.join(timeout=30)
        names = {n for _, n in self.procs}
        for proc, _ in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the node's group: ray start, raylet, its workers
                except ProcessLookupError:
                    pass
            proc.wait(timeout=30)
        deadline = time.monotonic() + wait_s
        while names and time.monotonic() < deadline:
            if not any(x["Alive"] for x in ray.nodes() if x.get("NodeName") in names):
                break
            time.sleep(0.2)
        self.procs.clear()
        self.threads.clear()


# Ray's own processes on this machine (the cluster's control plane and
# per-node daemons), by what their command line holds.
RAY_DAEMONS = {
    "gcs_server": "gcs_server",
    "raylet": "raylet/raylet",
    "dashboard_agent": "DashboardAgent",
    "runtime_env_agent": "RuntimeEnvAgent",
    "dashboard": "dashboard/dashboard.py",
    "log_monitor": "log_monitor.py",
}


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

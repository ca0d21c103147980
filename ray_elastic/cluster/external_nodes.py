"""Nodes that join a LocalCluster from outside the driver's process, as
an autoscaler's do: each is `ray start --block` in a process group of its
own, started from a background thread, so no controller call waits on it
(`ray.cluster_utils.Cluster.add_node` must run on the main thread, which
is the controller's: a node added there stalls training for as long as a
node takes to start)."""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["ExternalNodes"]


class ExternalNodes:
    """Replacement nodes started as separate processes (`ray start --block`
    with the resources a LocalCluster node has), from any thread, as an
    autoscaler adds them: `Cluster.add_node` must run on the main thread,
    which for ray_elastic is the controller's, so adding a node there
    stalls training. Each node is its own process group, stopped by pid
    (`stop_all`), and waited for until Ray has it dead, so the next run
    does not place anything on it."""

    def __init__(self, address: str, cpus: int = 1, store_bytes: int = 200 * 1024 * 1024):
        self.address = address
        self.cpus = cpus
        self.store = store_bytes
        self.procs: list = []  # (Popen, node name)
        self.threads: list = []
        self.started_at: list = []
        # One per node asked for: its name, when it was asked for and when
        # it was alive in Ray (time.monotonic; None until then, or never).
        self.launches: list[dict] = []
        self._stopping = False  # stop_all: no launch starts after it

    def add(self) -> None:
        """Start a node now, without waiting for it (a background thread)."""
        import threading
        import time
        import uuid

        name = f"ext-{uuid.uuid4().hex[:8]}"
        self.started_at.append(time.monotonic())
        launch = {"name": name, "started": self.started_at[-1], "up": None}
        self.launches.append(launch)

        def go():
            # Every port a node's agents bind, free ones: by default the
            # dashboard agent takes 52365, which another node on this
            # machine may hold; its agent then fails and Ray's raylet
            # exits with it (seen in a chaos run: the node never came up).
            ports = {flag: _free_port() for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                     "runtime-env-agent-port", "metrics-export-port")}
            # The `ray` beside this Python (a virtual environment that is not activated).
            ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
            cmd = [ray_cli if os.path.exists(ray_cli) else "ray", "start", "--block", f"--address={self.address}", f"--num-cpus={self.cpus}",
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
                if self._stopping:
                    return
                proc = subprocess.Popen(["nice", "-n", "-10", *cmd], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True, env=env)
                self.procs.append((proc, name))
                up = self._came_up(proc, name)
                _renice_group(proc.pid, 0)
                if up:
                    launch["up"] = time.monotonic()
                    return

        t = threading.Thread(target=go, daemon=True, name="add-node-outside")
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
        """Stop every node started here (and any launch still retrying)."""
        import signal
        import time

        import ray

        self._stopping = True
        for proc, _ in list(self.procs):  # a launch still waiting for its node gives up at once
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
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
        self._stopping = False  # ready for new launches


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

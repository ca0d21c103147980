"""A real multi-node Ray cluster on this one machine, for the demo, the
tests and the benchmarks (`ray.cluster_utils.Cluster`).

The head node has no CPUs, so no slice lands next to the driver; each
simulated node has room for exactly one host of a slice. Removing a node
kills its raylet and, as on real hardware, every worker process on it
(Ray alone can leave them running, and even finish a call in flight).

A node no longer wanted can be parked instead of removed: a placement
group pinned to it takes its CPUs, so nothing lands there, and giving them
back is instant. Adding a node costs seconds of both cores here (its
raylet and Ray's agents start), so a test suite that goes from two nodes
to four and back many times reuses parked ones.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import ray
from ray.cluster_utils import Cluster

from ray_elastic.cluster.external_nodes import ExternalNodes

__all__ = ["LocalCluster"]

# Faster node-death detection than Ray's production defaults, which are
# tuned for big clusters on real networks.
FAST_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """health_checks: "tuned" (FAST_FAILURE_DETECTION, as the shipped
    cluster configs set) or "default" (Ray's own, as a cluster that sets
    nothing has). dashboard: False starts the head without Ray's dashboard
    (its web server, not the agents on each node: metrics still export).
    log_monitor: False starts the head without Ray's log monitor, which
    tails every worker's log files to forward their lines to drivers that
    connect with log_to_driver=True (`connect` here does not); its polling
    grows with the files, one pair per worker process the cluster ever
    started (~0.03 of a core after 150 of them here)."""

    def __init__(self, num_nodes: int, cpus_per_node: int = 1, object_store_mb: int = 200, health_checks: str = "tuned",
                 dashboard: bool = True, log_monitor: bool = True):
        if health_checks not in ("tuned", "default"):
            raise ValueError(f"health_checks: 'tuned' or 'default', got {health_checks!r}")
        self._cpus = cpus_per_node
        self._store = object_store_mb * 1024 * 1024
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                # A free port: another cluster on this machine may hold 8265.
                **({"dashboard_port": _free_port()} if dashboard else {"include_dashboard": False}),
                "object_store_memory": self._store,
                "include_log_monitor": log_monitor,
                # A copy: Ray adds its own keys to the dict it is given.
                "_system_config": dict(FAST_FAILURE_DETECTION) if health_checks == "tuned" else {},
            },
        )
        self.nodes = {}
        self.parked: dict = {}  # node -> the placement group holding its CPUs
        self.frozen: dict[str, list[int]] = {}  # node -> pids stopped
        for _ in range(num_nodes):
            self.add_node()

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def logs_dir(self) -> str:
        """Where Ray writes this cluster's process logs."""
        return self.cluster.head_node.get_logs_dir_path()

    def add_node(self, env: Optional[dict] = None) -> str:
        """A new worker node; `env`: variables its raylet starts with (a
        node's own Ray settings, e.g. RAY_memory_usage_threshold)."""
        # Ray's Node installs its own SIGTERM handler in this process: keep
        # the driver's (the trainer's graceful preempt-and-checkpoint one).
        previous = signal.getsignal(signal.SIGTERM)
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})  # the raylet's process inherits this process's environment
        try:
            node = self.cluster.add_node(num_cpus=self._cpus, object_store_memory=self._store)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        self.nodes[node.node_id] = node
        return node.node_id

    def external_nodes(self) -> ExternalNodes:
        """A launcher of nodes like this cluster's, each started outside
        this process from a background thread (as an autoscaler adds them;
        the benchmarks' replacement nodes)."""
        return ExternalNodes(self.address, self._cpus, self._store)

    def remove_node(self, node_id: str) -> None:
        self._unpark(node_id)
        node = self.nodes.pop(node_id)
        pids = _worker_pids_on(node)
        self.cluster.remove_node(node, allow_graceful=False)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def freeze_node(self, node_id: str) -> list[int]:
        """SIGSTOP a node's raylet and every process on it: alive, but it
        answers nothing. Returns the pids stopped (thaw_node wakes them)."""
        node = self.nodes[node_id]
        pids = [p.process.pid for p in node.all_processes.get(_raylet_type(), [])] + _worker_pids_on(node)
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        self.frozen[node_id] = pids
        return pids

    def thaw_node(self, node_id: str) -> None:
        for pid in self.frozen.pop(node_id, []):
            _signal(pid, signal.SIGCONT)
        # Woken, a node Ray declared dead has its raylet exit. Its parent
        # here is this process, which would leave it a zombie, and a worker
        # takes a zombie raylet for a live one and never exits (seen: >120 s
        # in CI). On a real host the raylet's parent reaps it: do the same.
        threading.Thread(target=_reap, args=(self.nodes.get(node_id),), daemon=True, name="reap").start()

    def ensure_nodes(self, n: int, park: bool = True) -> "LocalCluster":
        """Make the cluster have exactly n live worker nodes that slices can
        use: forget nodes that died, then take parked nodes back or add new
        ones, or set idle extras aside: parked (`park`), or removed
        (main thread only)."""
        alive = {x["NodeID"] for x in ray.nodes() if x["Alive"]}
        for node_id in list(self.nodes):
            if node_id not in alive:
                self.nodes.pop(node_id)
                self.parked.pop(node_id, None)
        if not park:
            for node_id in list(self.parked):
                self.cluster.remove_node(self.nodes.pop(node_id))
                self._unpark(node_id)
        usable = [x for x in self.nodes if x not in self.parked]
        if len(usable) > n:
            # Idle nodes go first (parked, at once); a busy one is tried
            # (a second's wait) and removed only where no idle one is left.
            free = _free_cpus()
            usable.sort(key=lambda x: free.get(x, 0.0) >= self._cpus)
        while len(usable) > n:
            node_id = usable.pop()
            if not (park and self._park(node_id)):
                # Busy (or not to be parked): removed with what runs there.
                # The node goes too where its placement group is still
                # pending: one removed while Ray places it can keep the CPU
                # it was given (seen with Ray 2.60), so no survivor may hold one.
                self._unpark(node_id)
                self.cluster.remove_node(self.nodes.pop(node_id))
        while len(usable) < n and self.parked:
            node_id = next(reversed(self.parked))
            self._unpark(node_id)
            usable.append(node_id)
        while len(usable) < n:
            usable.append(self.add_node())
        return self

    def _park(self, node_id: str, wait_s: float = 1.0) -> bool:
        """Hold every CPU of the node with a placement group pinned to it;
        False if the node is busy (not all of them free within wait_s)."""
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        pg = placement_group([{"CPU": self._cpus}], bundle_label_selector=[{NODE_ID_LABEL_KEY: node_id}])
        self.parked[node_id] = pg
        ready, _ = ray.wait([pg.ready()], timeout=wait_s)
        return bool(ready)

    def _unpark(self, node_id: str) -> None:
        from ray.util.placement_group import remove_placement_group

        pg = self.parked.pop(node_id, None)
        if pg is not None:
            remove_placement_group(pg)

    def connect(self, runtime_env: Optional[dict] = None) -> None:
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False, runtime_env=runtime_env)

    def gcs_pid(self) -> Optional[int]:
        """The pid of the head's GCS server (the benchmarks read its CPU)."""
        from ray._private import ray_constants

        infos = self.cluster.head_node.all_processes.get(ray_constants.PROCESS_TYPE_GCS_SERVER, [])
        return infos[0].process.pid if infos else None

    def shutdown(self) -> None:
        """Idempotent: stop the connection, then every node. A node still
        frozen is killed, not woken: woken, its stale processes would talk
        to a cluster going down, and the driver's disconnect can wait on them."""
        for pids in self.frozen.values():
            for pid in pids:
                _signal(pid, signal.SIGKILL)
        self.frozen.clear()
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster.head_node is not None or self.cluster.worker_nodes:
            self.cluster.shutdown()


def _free_cpus() -> dict:
    """node id -> its CPUs free now (Ray's resource view: a placement
    group's bundle holds its CPUs whether or not a task runs in it)."""
    try:
        from ray._private.state import available_resources_per_node

        return {node: float(r.get("CPU", 0.0)) for node, r in available_resources_per_node().items()}
    except Exception:  # a Ray without it: every node tried in turn, as before
        return {}


def _worker_pids_on(node) -> list[int]:
    """The worker processes of a node: the raylet's descendants. (Asking
    Ray's state API would need the dashboard, which may not be up.)"""
    import psutil
    from ray._private import ray_constants

    pids = []
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
        try:
            pids += [c.pid for c in psutil.Process(info.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return pids


def _raylet_type() -> str:
    from ray._private import ray_constants

    return ray_constants.PROCESS_TYPE_RAYLET


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(node, limit_s: float = 600.0) -> None:
    """Wait for (reap) the node's daemons as they exit."""
    procs = [p.process for ps in (node.all_processes.values() if node else ()) for p in ps if p.process is not None]
    end = time.monotonic() + limit_s
    while procs and time.monotonic() < end:
        procs = [p for p in procs if p.poll() is None]
        time.sleep(0.2)

"""What a soak run leaves behind (bench/soak.py): the cluster counted
before a chaos run starts and after it has ended, and the difference.

- processes: this driver's descendants (the local cluster's raylets,
  workers and daemons), by name; the run's workers (`SliceWorker`
  actors) must be gone after it, and so must every process a fault hit;
  the node watchers (`NodeWatcher`, detached on purpose: made by the
  first run on a node, used by every run after it) are at most one per
  live node;
- nodes: Ray's live nodes, the same number after as before (the bench
  adds a node for each one a fault took and takes away each one left);
- placement groups: those not removed (`ray.util.placement_group_table`);
- object-store bytes: the bytes of primary copies over the nodes (the
  objects someone still references; Ray's memory summary calls them
  "needed"), and, reported only, all the bytes in use (with the cached
  copies Ray evicts when it needs the room).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from typing import Sequence

# Object-store bytes the run may leave in use: none of its own; a
# little slack for what Ray itself keeps (none was seen).
STORE_SLACK_BYTES = 1 << 20
SETTLE_S = 60.0  # how long after a run its workers, groups and removed nodes may take to go


def _processes() -> Counter:
    import psutil

    names: Counter = Counter()
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline()[:1]) or p.name()
        except psutil.Error:
            continue
        names[_kind(title)] += 1
    return names


def _kind(title: str) -> str:
    """A process's kind from its title: an actor's class ("ray::SliceWorker"),
    an idle worker, a Ray daemon (raylet, gcs_server, ...) or other."""
    m = re.match(r"ray::([A-Za-z_]+)", title)
    if m:
        return m.group(1)
    base = title.rsplit("/", 1)[-1]
    return base.split()[0] if base else "other"


def _head_raylet() -> tuple:
    """The head node's raylet (address, port): Ray's memory calls ask one
    raylet for every node's figures, and take the first live one in the
    node table otherwise, which may be a node the bench has just removed
    and Ray not yet declared dead (the call is refused)."""
    import ray

    head = next(n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n.get("Resources", {}))
    return head["NodeManagerAddress"], head["NodeManagerPort"]


def _memory_reply():
    import ray
    from ray._private.internal_api import get_state_from_address
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    # Ray has no public call for the object store's use; this is what its
    # memory summary (`ray memory`) reads, from the head node's raylet.
    get_state_from_address(ray.get_runtime_context().gcs_address)
    host, port = _head_raylet()
    stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(f"{host}:{port}"))
    return stub.FormatGlobalMemoryInfo(
        node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False), timeout=60.0)


def _store() -> dict:
    """The object store's bytes over the nodes: in use, and of primary
    copies (what someone still references; the rest are cached copies Ray
    evicts when it needs the room)."""
    stats = _memory_reply().store_stats
    return {"used": int(stats.object_store_bytes_used), "primary": int(stats.object_store_bytes_primary_copy)}


def census() -> dict:
    """The cluster as it is now."""
    import ray

    groups = ray.util.placement_group_table()
    store = _store()
    return {
        "processes": dict(_processes()),
        "nodes": sum(1 for n in ray.nodes() if n["Alive"]),
        "placement_groups": sum(1 for g in groups.values() if g.get("state") != "REMOVED"),
        "object_store_bytes": store["primary"],
        "object_store_bytes_used": store["used"],
    }


def _ours(pids: Sequence[int]) -> list[int]:
    """Those of `pids` still running among this driver's descendants (a
    pid the machine has given to another's process since is not ours)."""
    import psutil

    from bench.soak_chaos import alive_pids

    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    return [p for p in alive_pids(pids) if p in mine]


def settled(before: dict, fault_pids: Sequence[int], limit_s: float = SETTLE_S) -> dict:
    """The census after a run, once its workers, groups and removed nodes
    have gone (or `limit_s` passed: Ray's default health checks take some
    seconds to call a removed node dead), with what it leaked against `before`."""
    end = time.monotonic() + limit_s
    while True:
        now = census()
        clean = (not now["processes"].get("SliceWorker") and now["placement_groups"] <= before["placement_groups"]
                 and now["nodes"] <= before["nodes"] and not _ours(fault_pids))
        if clean or time.monotonic() > end:
            break
        time.sleep(1.0)
    left = _ours(fault_pids)
    watchers = now["processes"].get("NodeWatcher", 0)
    leaks = {
        "workers": now["processes"].get("SliceWorker", 0),
        "fault_processes": len(left),
        "nodes": now["nodes"] - before["nodes"],
        "placement_groups": now["placement_groups"] - before["placement_groups"],
        "object_store_bytes": max(0, now["object_store_bytes"] - before["object_store_bytes"] - STORE_SLACK_BYTES),
        "watchers_past_one_per_node": max(0, watchers - now["nodes"]),
    }
    out = {"before": before, "after": now, "leaked": leaks, "none": not any(leaks.values())}
    if leaks["object_store_bytes"]:  # which objects of 100 kB or more, and who holds them
        out["objects"] = _big_objects()
    return out


def _big_objects() -> list:
    """The lines of `ray memory` about objects of 100 kB or more: which,
    and which process holds them (a diagnosis, never an error)."""
    try:
        import ray
        from ray._private.internal_api import get_state_from_address
        from ray.dashboard.memory_utils import memory_summary

        text = memory_summary(get_state_from_address(ray.get_runtime_context().gcs_address), "NODE_ADDRESS",
                              "OBJECT_SIZE", True, "B", None)
    except Exception as e:  # noqa: BLE001
        return [f"ray memory failed: {type(e).__name__}: {e}"]
    return [line for line in text.splitlines() if re.search(r"\b\d{6,}(\.\d+)? B\b", line)][:200]

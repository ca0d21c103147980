"""The machines of the Ray cluster this driver is connected to and the
memory each has for workers, for the driver's preflight
(control/memory_plan.py): Ray's node table, grouped by address."""

from __future__ import annotations

import dataclasses

import ray

__all__ = ["Machine", "machines"]


@dataclasses.dataclass(frozen=True)
class Machine:
    """One machine of the cluster: its address, the bytes its nodes may
    use (Ray's memory and object store resources, measured by each raylet
    at its start), and its CPUs."""

    address: str
    memory: int
    cpus: float


def machines() -> list[Machine]:
    """The live machines with CPUs to run workers on. Several Ray nodes at
    one address (a local cluster, several raylets on a host) share its
    memory: the machine has what its largest node counted."""
    if not ray.is_initialized():
        return []
    by_address: dict[str, tuple[int, float]] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        memory = int(res.get("memory", 0) + res.get("object_store_memory", 0))
        address = node.get("NodeManagerAddress", "")
        was_memory, was_cpus = by_address.get(address, (0, 0.0))
        by_address[address] = (max(was_memory, memory), was_cpus + float(res.get("CPU", 0)))
    return [Machine(a, m, c) for a, (m, c) in sorted(by_address.items()) if c > 0 and m > 0]

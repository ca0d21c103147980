"""Ray's drain notices (a node about to be preempted, with a deadline).

Both calls are private Ray APIs, so they live here and nowhere else.
"""

from __future__ import annotations

__all__ = ["draining_nodes", "drain_node"]


def draining_nodes() -> dict[str, int]:
    """{node_id hex: deadline in ms since the epoch (0: none)}."""
    from ray._private.state import state

    try:
        return dict(state.get_draining_nodes())
    except Exception:  # an old or unreachable GCS: no notices
        return {}


def drain_node(node_id: str, deadline_s: float, message: str = "preemption") -> bool:
    """Send a preemption drain notice for a node (what a cloud's preemption
    hook would do); used by tests, the demo and the benchmarks."""
    import time

    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, _ = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        message,
        deadline_ms,
    )
    return bool(accepted)

"""LocalCluster on the shared cluster: idle extra nodes are parked by
ensure_nodes (nothing can land on them), before any busy one is removed,
and taken back before a node is added; the head's log monitor runs only
where asked for."""

from __future__ import annotations

import pytest
import ray

pytestmark = pytest.mark.cluster


@ray.remote(num_cpus=1)
class _Holder:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_idle_extras_are_parked_then_taken_back_before_any_node_is_added(cluster):
    cluster.ensure_nodes(3)
    before = set(cluster.nodes)
    cluster.ensure_nodes(1)
    assert len(cluster.parked) >= 2 and set(cluster.nodes) == before  # parked, not removed
    parked = set(cluster.parked)
    holders = [_Holder.remote() for _ in range(2)]
    try:
        refs = [h.node.remote() for h in holders]
        # One usable node of one CPU holds one of them at most (none, where
        # an earlier test's work still holds it); a parked node holds none.
        ready, pending = ray.wait(refs, num_returns=2, timeout=5)
        assert pending and not set(ray.get(ready)) & parked
        cluster.ensure_nodes(2)
        assert set(cluster.nodes) == before  # a parked node came back: none was added
        back = parked - set(cluster.parked)
        assert len(back) == 1
        landed, _ = ray.wait(pending, num_returns=1, timeout=60)
        assert landed and ray.get(landed[0]) in back
    finally:
        for h in holders:
            ray.kill(h)


def test_a_busy_extra_is_removed_with_what_runs_there(cluster):
    cluster.ensure_nodes(2)
    holders = [_Holder.remote() for _ in range(2)]
    try:
        on = {ray.get(h.node.remote(), timeout=60) for h in holders}
        assert on == {x for x in cluster.nodes if x not in cluster.parked}
        cluster.ensure_nodes(1)  # both nodes are busy: the newest goes, not parked
        assert len([x for x in cluster.nodes if x not in cluster.parked]) == 1
        assert len(on - set(cluster.nodes)) == 1
    finally:
        for h in holders:
            ray.kill(h)


def test_an_idle_extra_is_parked_before_a_busy_one_is_removed(cluster):
    """Two usable nodes, the first one busy: going to one parks the idle
    one, whatever their order, and the busy one keeps what runs there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cluster.ensure_nodes(2)
    usable = [x for x in cluster.nodes if x not in cluster.parked]
    # On the node ensure_nodes took first before it looked at which are idle.
    holder = _Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(usable[-1], soft=False)).remote()
    try:
        busy = ray.get(holder.node.remote(), timeout=60)
        assert busy == usable[-1]
        nodes_before = set(cluster.nodes)
        cluster.ensure_nodes(1)
        assert set(cluster.nodes) == nodes_before  # none removed
        assert [x for x in cluster.nodes if x not in cluster.parked] == [busy]
        assert ray.get(holder.node.remote(), timeout=60) == busy  # still there
    finally:
        ray.kill(holder)


def _log_monitors_of(cluster) -> list:
    """The log monitor processes whose logs folder is this cluster's."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "log_monitor.py" in cmd and f"--logs-dir={cluster.logs_dir}" in cmd:
            found.append(p.pid)
    return found


def test_the_log_monitor_runs_only_where_asked_for(cluster):
    """The session cluster (log_monitor=False) has no log monitor; a
    LocalCluster with the default has one, on its head (no dashboard
    there: it starts sooner, and the log monitor does not depend on it)."""
    from ray_elastic.cluster.local_cluster import LocalCluster

    assert _log_monitors_of(cluster) == []
    other = LocalCluster(num_nodes=0, dashboard=False)
    try:
        assert len(_log_monitors_of(other)) == 1
    finally:
        other.cluster.shutdown()

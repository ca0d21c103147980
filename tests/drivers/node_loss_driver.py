"""One node loss, in its own process on its own local cluster with the
chosen health-check settings (Ray's defaults, or the tuned ones): prints
the run report as JSON on its last line, plus what the driver saw.

--fault freeze_node under --policy pause: the node is frozen (raylet and
workers SIGSTOPped), a replacement node joins once the failure is detected
(as an autoscaler would), and the JSON says whether Ray still counted the
frozen (or removed) node alive when the run recovered (the replacement did
not wait for Ray's health checks).

--lose-replacement (pause): the replacement's node is removed too, while
its worker starts (a second node has joined for it), and the JSON says
whether Ray still counted that node alive when the run recovered, and the
first removed node when the replacement's group was placed (by the time
the run has recovered from both, on a loaded machine, Ray's health checks
may have declared the first one dead: that says nothing of whether the
replacement waited for them)."""

import argparse
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--health-checks", choices=("tuned", "default"), required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fail-at", type=int, default=10)
    p.add_argument("--fault", choices=("remove_node", "freeze_node"), default="remove_node")
    p.add_argument("--policy", choices=("resize", "pause"), default="resize")
    p.add_argument("--lose-replacement", action="store_true")
    a = p.parse_args()
    import time

    import ray

    from examples import lm
    from ray_elastic import ElasticConfig, ElasticTrainer, Fault
    from ray_elastic.cluster.local_cluster import LocalCluster

    cluster = LocalCluster(num_nodes=2, health_checks=a.health_checks)
    seen: dict = {}

    def freeze(node_id):
        seen["frozen"] = node_id
        cluster.freeze_node(node_id)

    def remove(node_id):
        seen["removed"] = node_id
        cluster.remove_node(node_id)

    def on_event(e):
        if e["event"] == "detected" and a.policy == "pause":
            for _ in range(2 if a.lose_replacement else 1):
                cluster.add_node()  # (Ray's Node must start from the main thread)
        if e["event"] == "replace" and a.lose_replacement and "replacement_removed" not in seen:
            # Remove the node the replacement's new group is placed on, as
            # soon as it is placed: its worker is still starting.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                placed = [n for g in ray.util.placement_group_table().values()
                          if g["state"] == "CREATED" and g["name"].endswith(f"slice{e['slice']}-g1")
                          for n in g["bundles_to_node_id"].values()]
                if placed:
                    # The replacement's group is placed: was the removed
                    # node still alive to Ray then (it did not wait)?
                    alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
                    seen["removed_alive_at_placement"] = bool(alive.get(seen.get("removed")))
                    seen["replacement_removed"] = placed[0]
                    cluster.remove_node(placed[0])
                    break
                time.sleep(0.05)
        if e["event"] == "recovered":
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
            for what in ("frozen", "removed", "replacement_removed"):
                if what in seen:
                    seen[f"{what}_alive_at_recovery"] = bool(alive.get(seen[what]))

    try:
        cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
        config = (ElasticConfig(num_slices=2, policy="resize", min_slices=1) if a.policy == "resize"
                  else ElasticConfig(num_slices=2, policy="pause", step_deadline_floor_s=5.0, timeout_s=240.0))
        trainer = ElasticTrainer(
            functools.partial(lm.make_program, lm.LMConfig()), config, a.steps,
            faults=(Fault(a.fault, 1, a.fail_at),),
            remove_node=remove, freeze_node=freeze, on_event=on_event,
        )
        report = trainer.fit()
    finally:
        cluster.shutdown()
    print(json.dumps(dict(report.to_dict(), driver_saw=seen)), flush=True)


if __name__ == "__main__":
    main()

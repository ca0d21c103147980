"""One node loss under resize, in its own process on its own local cluster
with the chosen health-check settings (Ray's defaults, or the tuned ones):
prints the run report as JSON on its last line."""

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
    a = p.parse_args()
    from examples import lm
    from ray_elastic import ElasticConfig, ElasticTrainer, Fault
    from ray_elastic.local_cluster import LocalCluster

    cluster = LocalCluster(num_nodes=2, health_checks=a.health_checks)
    try:
        cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
        trainer = ElasticTrainer(
            functools.partial(lm.make_program, lm.LMConfig()),
            ElasticConfig(num_slices=2, policy="resize", min_slices=1),
            a.steps,
            faults=(Fault("remove_node", 1, a.fail_at),),
            remove_node=cluster.remove_node,
        )
        report = trainer.fit()
    finally:
        cluster.shutdown()
    print(json.dumps(report.to_dict()), flush=True)


if __name__ == "__main__":
    main()

"""A whole training job in its own process, on its own local cluster (or,
with --address, on a running one): used by the tests to lose everything
(cold start) and to preempt a driver."""

import argparse
import functools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--path", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--report", required=True)
    p.add_argument("--address", default="", help="a running cluster to join instead of making one")
    a = p.parse_args()
    from examples import lm
    from ray_elastic import CheckpointConfig, ElasticConfig, ElasticTrainer
    from ray_elastic.cluster.local_cluster import LocalCluster

    import ray

    cluster = None if a.address else LocalCluster(num_nodes=2)
    if cluster is None:
        ray.init(address=a.address, log_to_driver=False, runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
    else:
        cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})

    def on_step(step, loss, slices):
        print(f"STEP {step} {time.time():.6f}", flush=True)

    def on_event(e):
        if e["event"] in ("preempted", "preempt_saved", "checkpoint_saved"):
            print(f"EVENT {e['event']} {e.get('step')} {time.time():.6f}", flush=True)

    try:
        trainer = ElasticTrainer(
            functools.partial(lm.make_program, lm.LMConfig()),
            ElasticConfig(num_slices=2, policy="pause"),
            a.steps,
            checkpoint=CheckpointConfig(a.path, save_every=a.save_every),
            on_step=on_step, on_event=on_event, keep_final_state=True,
        )
        report = trainer.fit()
        report.write(a.report)
    finally:
        if cluster is not None:
            cluster.shutdown()
        else:
            ray.shutdown()
    print("EXIT", report.outcome, flush=True)


if __name__ == "__main__":
    main()

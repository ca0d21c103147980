"""Train the example transformer LM with ray_elastic on a running Ray cluster.

The script is the Ray driver, hence the single controller: submit it with

    ray job submit --working-dir . -- python examples/train_lm.py --slices 2 --policy resize

or run it on the head node. It connects to the cluster (`ray.init()`),
reserves one placement group per slice, and trains through failures.

    --tpu-topology 4x4 --tpu-version v6e   TPU slices (ray.util.tpu)
    --gpus-per-host 1                      GPU hosts
    (neither)                              CPU hosts
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_elastic import CpuSlice, ElasticConfig, ElasticTrainer, GpuSlice, TpuSlice  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slices", type=int, default=2)
    p.add_argument("--policy", choices=("resize", "pause"), default="resize")
    p.add_argument("--min-slices", type=int, default=None)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--hosts-per-slice", type=int, default=1)
    p.add_argument("--cpus-per-host", type=int, default=1)
    p.add_argument("--gpus-per-host", type=int, default=0)
    p.add_argument("--tpu-topology", default=None)
    p.add_argument("--tpu-version", default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="timeout_s")
    p.add_argument("--max-retries", type=int, default=10)
    p.add_argument("--fault", default=None, help="inject KIND:SLICE:STEP[:HOST] (testing)")
    p.add_argument("--report", default=None, help="write the run report (JSON) here")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint.path: a folder or gs://bucket/prefix; a resubmitted job resumes from its newest committed step")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint.save_every, in steps")
    p.add_argument("--events", default=None, help="write the event timeline (JSON lines) here, as it happens")
    return p.parse_args(argv)


def slice_spec(args):
    if args.tpu_topology or args.tpu_version:
        return TpuSlice(topology=args.tpu_topology or "2x2", accelerator_version=args.tpu_version or "v6e")
    if args.gpus_per_host:
        return GpuSlice(hosts=args.hosts_per_slice, gpus_per_host=args.gpus_per_host, cpus_per_host=args.cpus_per_host)
    return CpuSlice(hosts=args.hosts_per_slice, cpus_per_host=args.cpus_per_host)


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = ElasticConfig(
        num_slices=args.slices,
        slice=slice_spec(args),
        policy=args.policy,
        min_slices=args.min_slices if args.policy == "resize" else None,
        timeout_s=args.timeout,
        max_retries=args.max_retries,
    )  # checked before anything is reserved
    from ray_elastic.faults import Fault

    faults = (Fault.parse(args.fault),) if args.fault else ()

    import ray

    from examples import lm

    # Workers import examples.lm too: ship the folder unless the job's
    # working_dir already carries it.
    ray.init(runtime_env={"py_modules": [os.path.dirname(os.path.abspath(lm.__file__))]})

    def on_event(e):
        print(f"[{e['t']:8.2f} s] {e['event']} " + json.dumps({k: v for k, v in e.items() if k not in ("t", "event")}), flush=True)

    def on_step(step, loss, slices):
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}/{args.steps} loss {loss:.4f} slices {slices}", flush=True)

    from ray_elastic import CheckpointConfig
    from ray_elastic.events import EventLog
    from ray_elastic.metrics import MetricsCallback

    checkpoint = CheckpointConfig(args.checkpoint, save_every=args.save_every) if args.checkpoint else None
    # ray_elastic_* metrics on the cluster's Prometheus endpoint / dashboard.
    callbacks = [MetricsCallback(f"train_lm-{os.getpid()}")]
    if args.events:
        callbacks.append(EventLog(args.events))
    trainer = ElasticTrainer(
        functools.partial(lm.make_program, lm.LMConfig()), config, args.steps,
        faults=faults, on_step=on_step, on_event=on_event, callbacks=callbacks, checkpoint=checkpoint,
    )
    try:
        report = trainer.fit()
    finally:
        callbacks[0].close()
    for f in report.failures:
        print(f"recovered from {f.kind} of slice {f.slice} at step {f.step} in {f.recovered_s} s", flush=True)
    print(f"done: {report.steps_completed} steps, final loss {report.final_loss:.4f}, driver pid {report.driver_pid_end}")
    if args.report:
        report.write(args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

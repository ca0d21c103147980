"""Train the example transformer LM with ray_elastic on a running Ray cluster.

The script is the Ray driver, hence the single controller: submit it with

    ray job submit --working-dir . -- python examples/train_lm.py --slices 2 --policy resize

or run it on the head node. It connects to the cluster (`ray.init()`),
reserves one placement group per slice, and trains through failures.

    --tpu-topology 4x4 --tpu-version v6e   TPU slices (ray.util.tpu)
    --gpus-per-host 1                      GPU hosts
    (neither)                              CPU hosts

The example's model and its layout in a slice (`--model`, `--sharding`,
`--devices-per-host` on CPU hosts), the spares and the rest are the options
of `ray-elastic demo`, defined once in ray_elastic/cli_options.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_elastic import CpuSlice, ElasticTrainer, GpuSlice, TpuSlice  # noqa: E402
from ray_elastic.cli_options import (  # noqa: E402
    add_debug_option, add_shared_options, check_devices_option, debugging, elastic_config, example_program,
    report_error,
)
from ray_elastic.errors import ElasticError  # noqa: E402

PROG = "train_lm.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        epilog="A bad setting prints one line, `train_lm.py: error: SETTING: PROBLEM`, and exits 2 before "
        "anything is reserved; a run that fails exits 1.",
    )
    # The options `ray-elastic demo` has too, defined once (cli_options.py).
    add_shared_options(p, steps=500, timeout_s=300.0)
    p.add_argument("--cpus-per-host", type=int, default=1,
                   help="slice.cpus_per_host: CPUs each host's worker reserves (default: %(default)s)")
    p.add_argument("--gpus-per-host", type=float, default=0,
                   help="slice.gpus_per_host: GPU hosts with this many GPUs each, or a share of one GPU below 1 "
                        "(slices sharing a GPU); 0: CPU hosts (default: %(default)s)")
    p.add_argument("--tpu-topology", default=None,
                   help="slice.topology: TPU slices of this topology, e.g. 4x4 (default: none; 2x2 with --tpu-version)")
    p.add_argument("--tpu-version", default=None,
                   help="slice.accelerator_version: TPU slices of this version, e.g. v6e (default: none; v6e with "
                   "--tpu-topology)")
    p.add_argument("--fault", default=None,
                   help="inject a fault (testing): KIND:SLICE:STEP and what else Fault.parse reads, e.g. kill:1:50 "
                   "(default: none)")
    add_debug_option(p)
    return p


def parse(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def slice_spec(args):
    if args.tpu_topology or args.tpu_version:
        return TpuSlice(topology=args.tpu_topology or "2x2", accelerator_version=args.tpu_version or "v6e")
    if args.gpus_per_host:
        gpus = int(args.gpus_per_host) if args.gpus_per_host >= 1 else args.gpus_per_host
        return GpuSlice(hosts=args.hosts_per_slice, gpus_per_host=gpus, cpus_per_host=args.cpus_per_host)
    return CpuSlice(hosts=args.hosts_per_slice, cpus_per_host=args.cpus_per_host, devices_per_host=args.devices_per_host)


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return train(args)
    except ElasticError as e:  # a bad setting, a failed run: its message, not a traceback
        return report_error(PROG, e, debug=debugging(args))


def train(args: argparse.Namespace) -> int:
    # Every setting is checked before anything is reserved.
    spec = slice_spec(args)
    check_devices_option(args, spec)
    config = elastic_config(args, spec)
    from ray_elastic.failures.faults import Fault, check_faults

    faults = (Fault.parse(args.fault),) if args.fault else ()
    check_faults(faults, config.num_slices, spec.hosts)
    from ray_elastic import CheckpointConfig

    checkpoint = CheckpointConfig(args.checkpoint, save_every=args.save_every) if args.checkpoint else None
    if checkpoint is not None:
        checkpoint.check_storage()  # there and writable

    import ray

    from examples import lm

    program = example_program(lm, args, spec)  # its mesh must fit a slice's devices
    print(f"training {program.describe()}", flush=True)
    # Workers import examples.lm too: ship the folder unless the job's
    # working_dir already carries it.
    ray.init(runtime_env={"py_modules": [os.path.dirname(os.path.abspath(lm.__file__))]})

    def on_event(e):
        print(f"[{e['t']:8.2f} s] {e['event']} " + json.dumps({k: v for k, v in e.items() if k not in ("t", "event")}), flush=True)

    from ray_elastic import Callback
    from ray_elastic.observe.progress import step_line

    class StepLines(Callback):
        def on_step(self, step, metrics):
            if step % args.log_every == 0 or step == args.steps:
                print(step_line(step, args.steps, metrics), flush=True)

    from ray_elastic.observe.events import EventLog
    from ray_elastic.observe.metrics import MetricsCallback

    # ray_elastic_* metrics on the cluster's Prometheus endpoint / dashboard.
    callbacks = [MetricsCallback(f"train_lm-{os.getpid()}")]
    if args.events:
        callbacks.append(EventLog(args.events))
    trainer = ElasticTrainer(
        program.factory, config, args.steps,
        faults=faults, on_event=on_event, callbacks=[*callbacks, StepLines()], checkpoint=checkpoint,
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

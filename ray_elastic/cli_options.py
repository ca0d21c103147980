"""What `ray-elastic demo` and the job driver `examples/train_lm.py` share:
their common options, defined once here, the example program those options
describe, and how both report an error.

Both parsers call `add_shared_options`; a test holds them to the same
names, defaults and help. The options each has alone are its own: the demo
builds a local cluster of CPU hosts and injects one fault (`--fail-at`,
`--fail-slice`, `--fault KIND`); the job driver runs on a cluster that is
already there, of CPU, GPU or TPU hosts (`--cpus-per-host`,
`--gpus-per-host`, `--tpu-topology`, `--tpu-version`), with faults given as
KIND:SLICE:STEP[:HOST].
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from typing import Any, Callable

from ray_elastic.errors import ConfigError, ElasticError, RunFailed

__all__ = [
    "DEBUG_ENV",
    "ExampleProgram",
    "add_debug_option",
    "add_shared_options",
    "check_devices_option",
    "debugging",
    "elastic_config",
    "example_program",
    "exit_code",
    "positive_int",
    "report_error",
]

# Set (to anything but "" or "0") for the full traceback of an error,
# as --debug does.
DEBUG_ENV = "RAY_ELASTIC_DEBUG"

MODELS = ("small", "medium", "large")
EXAMPLES = ("lm", "lm-tokens", "lm-grain", "cnn")
SHARDINGS = ("replicated", "fsdp", "fsdp_tp")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_shared_options(parser: argparse.ArgumentParser, steps: int, timeout_s: float) -> None:
    """Add the options the demo and the job driver share. `steps` and
    `timeout_s` are their defaults, the one thing that differs: the demo's
    run is short and local, a job's replacement may come from a cloud."""
    opt = parser.add_argument
    opt("--slices", type=int, default=2, help="num_slices: slices to train on (default: %(default)s)")
    opt("--policy", choices=("resize", "pause"), default="resize",
        help="resize: train on the survivors at once; pause: wait for the replacement (default: %(default)s)")
    opt("--min-slices", type=int, default=None,
        help="min_slices: with --policy resize, the fewest slices to train on (default: 1)")
    opt("--hosts-per-slice", type=int, default=1, help="slice.hosts: hosts (Ray nodes) in each slice (default: %(default)s)")
    opt("--devices-per-host", type=int, default=1,
        help="slice.devices_per_host: XLA CPU devices in each host's process, CPU slices only (a GPU or TPU "
        "host's devices are its accelerators) (default: %(default)s)")
    opt("--example", choices=EXAMPLES, default="lm",
        help="the program to train: lm, the example LM with a plain mean loss; lm-tokens, the same LM written "
        "like a MaxText or lm1b train step (padded documents weighted by their real tokens, dropout, z-loss, "
        "accuracy, an eval every 10 steps); lm-grain, the same LM fed by a Grain pipeline over an ArrayRecord file "
        "it writes on first use (shuffled, tokenized, documents packed into rows, exact resume); cnn, a small CNN with batch norm statistics as model state "
        "(default: %(default)s)")
    opt("--model", choices=MODELS, default="small",
        help="the example LM's size: small 0.1M, medium 3.2M, large 25M parameters (default: %(default)s)")
    opt("--sharding", choices=SHARDINGS, default="replicated",
        help="the state's layout in a slice: replicated on every device, FSDP over all of them, or FSDP x "
        "tensor parallel (2); the mesh must divide the slice's devices (default: %(default)s)")
    opt("--spare-slices", type=int, default=0,
        help="spare_slices: hot standby slices, started and compiled ahead, that take a failed slice's place "
        "(default: %(default)s)")
    opt("--diloco", type=positive_int, default=None, metavar="H",
        help="enable_diloco with diloco_sync_period H: each slice a replica that trains alone and the replicas "
        "synchronize every H steps (docs/diloco.md) (default: off, a gradient exchange every step)")
    opt("--diloco-fragments", type=positive_int, default=None, metavar="P",
        help="with --diloco: Streaming DiLoCo (enable_streaming_diloco, num_diloco_fragments P): the params cut "
        "into P fragments, one synchronized every H/P steps in turn (default: off)")
    opt("--steps", type=positive_int, default=steps, help="training steps (default: %(default)s)")
    opt("--timeout", type=float, default=timeout_s,
        help="timeout_s: seconds to wait for a replacement before failing (default: %(default)s)")
    opt("--max-retries", type=int, default=10,
        help="max_retries: failures the whole run may absorb (default: %(default)s)")
    opt("--hang-floor", type=float, default=10.0,
        help="step_deadline_floor_s: a step slower than this is a hang (default: %(default)s)")
    opt("--log-every", type=positive_int, default=50,
        help="steps between step lines in the output (the demo in a terminal shows a live line instead) "
        "(default: %(default)s)")
    opt("--report", default=None, help="write the run report as JSON to this file (default: none)")
    opt("--events", default=None, help="write the timeline as JSON lines to this file, as it happens (default: none)")
    opt("--checkpoint", default=None,
        help="checkpoint.path: a folder or gs://bucket/prefix for durable checkpoints; a run on the same path "
        "resumes from its newest committed step (default: none, in-memory snapshots only)")
    opt("--save-every", type=int, default=100, help="checkpoint.save_every, in steps (default: %(default)s)")


def add_debug_option(parser: argparse.ArgumentParser, default: Any = False) -> None:
    """--debug: the full traceback of an error instead of its message
    alone. `default=argparse.SUPPRESS` on a subcommand's parser, so it
    keeps what the top-level parser's --debug set."""
    parser.add_argument("--debug", action="store_true", default=default,
                        help=f"on an error, print its full traceback, not only its message; or set {DEBUG_ENV}=1 "
                        "(default: off)")


def debugging(args: argparse.Namespace) -> bool:
    """Whether --debug or RAY_ELASTIC_DEBUG asks for full tracebacks."""
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def exit_code(error: BaseException) -> int:
    """2 for a bad setting (as argparse exits on a bad option), 1 for a
    run or a storage that failed."""
    return 2 if isinstance(error, ConfigError) else 1


def report_error(prog: str, error: ElasticError, debug: bool = False, stream=None) -> int:
    """Print the error as `PROG: error: MESSAGE` (with its traceback when
    `debug`) and return its exit code."""
    stream = sys.stderr if stream is None else stream
    if debug:
        traceback.print_exception(error, file=stream)
    print(f"{prog}: error: {_message(error)}", file=stream, flush=True)
    return exit_code(error)


def _message(error: ElasticError) -> str:
    if isinstance(error, ConfigError):
        # A store's message may name the setting itself.
        return f"{error.setting}: {error.problem.removeprefix(error.setting + ': ')}"
    if isinstance(error, RunFailed):
        text = f"run failed: {error}"
        if error.setting and error.setting not in str(error):
            text += f" (setting: {error.setting})"
        return text
    return str(error)


def elastic_config(args: argparse.Namespace, spec, **more):
    """The ElasticConfig of the shared options on slices of `spec`;
    `more`: settings one program sets alone. Validated here, before any
    cluster resource is taken."""
    from ray_elastic.config import ElasticConfig

    return ElasticConfig(
        num_slices=args.slices,
        slice=spec,
        policy=args.policy,
        min_slices=args.min_slices if args.policy == "resize" else None,
        timeout_s=args.timeout,
        max_retries=args.max_retries,
        step_deadline_floor_s=args.hang_floor,
        spare_slices=args.spare_slices,
        **({"enable_diloco": True, "diloco_sync_period": args.diloco} if getattr(args, "diloco", None) else {}),
        **({"enable_streaming_diloco": True, "num_diloco_fragments": args.diloco_fragments}
           if getattr(args, "diloco_fragments", None) else {}),
        **more,
    )


@dataclasses.dataclass(frozen=True)
class ExampleProgram:
    """The example program as the options chose it, its layout resolved on
    a slice's devices."""

    model: str
    sharding: str
    layout: Any  # ray_elastic.layout.Layout
    plan: Any  # ray_elastic.layout.LayoutPlan, on `devices` devices
    devices: int  # in one slice
    factory: Callable[[], Any]  # the picklable program factory
    example: str = "lm"

    def describe(self) -> str:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.plan.axis_names, self.plan.axis_sizes))
        what = {"lm": f"the example LM, model {self.model}",
                "lm-tokens": f"the token-weighted example LM, model {self.model}",
                "lm-grain": f"the example LM fed by a Grain pipeline, model {self.model}",
                "cnn": "the example CNN with batch norm"}[self.example]
        return (f"{what}, layout {self.sharding} (mesh {mesh} over {self.devices} "
                f"device{'s' if self.devices != 1 else ''} per slice)")


def example_program(lm, args: argparse.Namespace, spec) -> ExampleProgram:
    """The example program of `--example`, `--model` and `--sharding` on
    slices of `spec`, its mesh checked against the slice's devices (a
    ConfigError naming layout.mesh when it does not divide them). `lm`:
    the example LM module as the workers will import it (the installed
    `ray_elastic.examples.lm` for the demo; the job's own `examples.lm`,
    shipped with it, for the job driver); the other examples are its
    siblings."""
    import functools
    import importlib

    example = getattr(args, "example", "lm")
    package = lm.__name__.rpartition(".")[0]
    layout = lm.Layout() if args.sharding == "replicated" else lm.sharded_layout(args.sharding)
    if example == "cnn":
        if args.sharding != "replicated":
            raise ConfigError("--sharding", "the example CNN's state is replicated; --sharding applies to the "
                              "LM examples")
        if args.model != "small":
            raise ConfigError("--model", "sets the LM examples' size; the example CNN has one")
        cnn = importlib.import_module(f"{package}.cnn")
        factory = functools.partial(cnn.make_program, cnn.CNNConfig(), layout)
    elif example == "lm-tokens":
        tokens = importlib.import_module(f"{package}.lm_tokens")
        factory = functools.partial(tokens.make_program, tokens.TokenLMConfig(lm=lm.PRESETS[args.model]), layout)
    elif example == "lm-grain":
        fed = importlib.import_module(f"{package}.lm_grain")
        factory = functools.partial(fed.make_program, fed.GrainLMConfig(lm=lm.PRESETS[args.model]), layout)
    else:
        factory = functools.partial(lm.make_program, lm.PRESETS[args.model], layout)
    plan = layout.plan(spec.devices)
    return ExampleProgram(args.model, args.sharding, layout, plan, spec.devices, factory, example)


def check_devices_option(args: argparse.Namespace, spec) -> None:
    """--devices-per-host sets a CPU slice's devices; a GPU or TPU host's
    devices are its accelerators, so any other value there is a mistake."""
    from ray_elastic.config import CpuSlice

    if not isinstance(spec, CpuSlice) and args.devices_per_host != 1:
        raise ConfigError("slice.devices_per_host", f"applies to CPU slices only; this slice's devices are its "
                          f"accelerators ({spec.devices} per slice), got --devices-per-host {args.devices_per_host}")

"""`ray-elastic`: the command line.

    ray-elastic demo [--policy resize|pause] [--slices N] [--steps N]
                     [--fail-at STEP] [--fault remove_node|kill|stop]
                     [--report FILE] [--events FILE]
    ray-elastic timeline EVENTS.jsonl [-o OUT.png]
    ray-elastic timeline --report REPORT.json [-o OUT.png]

`demo` starts a real multi-node Ray cluster on this machine (one simulated
node per host), trains the example transformer LM, injects a fault into a
slice mid-run, recovers by the chosen policy, adds a replacement node when a
node was lost, and prints the run's timeline and loss (in a terminal, with a
live progress line). Its metrics go to Ray's metrics system
(`ray_elastic.metrics`); `--events` writes the timeline as JSON lines.

`timeline` draws a run's events file or report as a PNG.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _example_lm():
    """Import examples/lm.py here; `_demo` ships the folder to the workers
    with Ray's runtime_env (py_modules), as a user's job would."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "examples" / "lm.py").exists():
        raise SystemExit(
            "ray-elastic demo needs the repository's examples/ folder next to the "
            "ray_elastic package: install with `pip install -e .` from a clone."
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("examples.lm")


def _demo(args: argparse.Namespace) -> int:
    from ray_elastic import CpuSlice, ElasticConfig, ElasticTrainer, Fault, RunFailed
    from ray_elastic.events import EventLog
    from ray_elastic.local_cluster import LocalCluster
    from ray_elastic.metrics import MetricsCallback
    from ray_elastic.progress import ProgressCallback

    config = ElasticConfig(
        num_slices=args.slices,
        slice=CpuSlice(hosts=args.hosts_per_slice),
        policy=args.policy,
        min_slices=1 if args.policy == "resize" else None,
        timeout_s=args.timeout,
        step_deadline_floor_s=args.hang_floor,
    )  # validated here, before any process or node is started
    from ray_elastic.checkpoints import CheckpointConfig

    checkpoint = CheckpointConfig(args.checkpoint, save_every=args.save_every) if args.checkpoint else None
    fail_at = args.steps // 4 if args.fail_at is None else args.fail_at
    faults = () if fail_at < 0 else (Fault(args.fault, args.fail_slice, fail_at),)
    lm = _example_lm()
    factory = functools.partial(lm.make_program, lm.LMConfig())

    print(f"starting a local Ray cluster: head + {args.slices * args.hosts_per_slice} nodes", flush=True)
    t0 = time.monotonic()
    cluster = LocalCluster(num_nodes=args.slices * args.hosts_per_slice)
    cluster.connect(runtime_env={"py_modules": [os.path.dirname(lm.__file__)]})
    print(f"cluster up in {time.monotonic() - t0:.1f} s; driver pid {os.getpid()}", flush=True)

    lost_node = {"pending": False}
    # In a terminal a live progress line shows the run and prints the events
    # above it; elsewhere (logs, CI) the plain lines below do.
    live = sys.stdout.isatty()
    metrics = MetricsCallback(f"demo-{os.getpid()}")  # on the head node's Prometheus endpoint
    callbacks = [metrics]
    progress = ProgressCallback(args.steps, stream=sys.stdout, events="all") if live else None
    if progress is not None:
        callbacks.append(progress)
    if args.events:
        callbacks.append(EventLog(args.events))

    def on_event(e: dict) -> None:
        name = e["event"]
        if not live:
            print(f"  [{e['t']:7.2f} s] {name}: " + ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event")), flush=True)
        if name == "detected" and e["kind"] in ("node_died", "preempted"):
            lost_node["pending"] = True
        # A replacement node joins: at once when paused, and after the first
        # step on the survivors when resizing (add_node blocks this thread).
        trigger = "wait" if args.policy == "pause" else "recovered"
        if name == trigger and lost_node["pending"]:
            lost_node["pending"] = False
            if progress is not None:
                progress.message("  adding a replacement node to the cluster")
            else:
                print("  adding a replacement node to the cluster", flush=True)
            cluster.add_node()

    def on_step(step: int, loss: float, slices: int) -> None:
        if not live and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step:5d}/{args.steps}  loss {loss:.4f}  slices {slices}", flush=True)

    trainer = ElasticTrainer(
        factory, config, args.steps, faults=faults, remove_node=cluster.remove_node,
        on_step=on_step, on_event=on_event, callbacks=callbacks, checkpoint=checkpoint,
    )
    try:
        report = trainer.fit()
        rc = 0
    except RunFailed as e:
        print(f"run failed: {e}", file=sys.stderr)
        report, rc = trainer.report, 1
    finally:
        metrics.close()
        cluster.shutdown()

    print("\nsummary")
    for f in report.failures:
        print(
            f"  failure {f.kind} slice {f.slice} at step {f.step}: detected in {f.detected_s:.3f} s, "
            f"next step after {f.recovered_s if f.recovered_s is None else round(f.recovered_s, 3)} s, "
            f"steps redone {f.steps_rewound}, slices after {f.slices_after}"
        )
    print(
        f"  steps {report.steps_completed}/{report.steps_requested}, final loss {report.final_loss:.4f}, "
        f"wall {report.wall_s:.1f} s, goodput {report.goodput:.2f}, driver pid "
        f"{report.driver_pid_start} -> {report.driver_pid_end}"
    )
    if args.report:
        report.write(args.report)
        print(f"  report written to {args.report}")
    if args.events:
        print(f"  events written to {args.events} (draw them: ray-elastic timeline {args.events})")
    return rc


def _timeline(args: argparse.Namespace) -> int:
    from ray_elastic.timeline import TimelineInputError, main_timeline

    if (args.events is None) == (args.report is None):
        print("ray-elastic timeline: give an events file or --report REPORT.json (one of them)", file=sys.stderr)
        return 2
    path = args.events if args.events is not None else args.report
    try:
        out = main_timeline(path, args.output, kind="report" if args.report is not None else None, title=args.title)
    except TimelineInputError as e:
        print(f"ray-elastic timeline: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"ray-elastic timeline: error: needs matplotlib ({e}); pip install matplotlib", file=sys.stderr)
        return 1
    print(out)
    return 0


def _checkpoints(args: argparse.Namespace) -> int:
    """List a run's checkpoint steps, committed or not."""
    import datetime

    from ray_elastic.checkpoints import CheckpointStore, StorageError

    store = CheckpointStore(args.path)
    try:
        store.preflight() if args.check else None
        steps = store.steps(sizes=True)
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        import dataclasses

        print(json.dumps([dataclasses.asdict(s) for s in steps], indent=1))
        return 0
    if not steps:
        print(f"no checkpoint steps under {args.path}")
        return 0
    print(f"{'step':>8}  {'state':<11} {'size':>10}  {'written (UTC)':<19}  folder")
    for s in steps:
        when = datetime.datetime.fromtimestamp(s.mtime, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if s.mtime else "?"
        state = "committed" if s.committed else "INCOMPLETE"
        print(f"{s.step:>8}  {state:<11} {_human(s.bytes):>10}  {when:<19}  {s.name}")
    latest = store.latest_committed()
    print(f"latest committed: {latest if latest is not None else 'none'} (a restart resumes from it)")
    return 0


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-elastic", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the example LM on a local cluster through a failure")
    demo.add_argument("--policy", choices=("resize", "pause"), default="resize")
    demo.add_argument("--slices", type=int, default=2)
    demo.add_argument("--hosts-per-slice", type=int, default=1)
    demo.add_argument("--steps", type=int, default=400)
    demo.add_argument("--fail-at", type=int, default=None, help="step of the fault (default steps/4; -1: none)")
    demo.add_argument("--fail-slice", type=int, default=1)
    demo.add_argument("--fault", choices=("remove_node", "kill", "stop"), default="remove_node")
    demo.add_argument("--timeout", type=float, default=120.0, help="timeout_s: wait for a replacement")
    demo.add_argument("--hang-floor", type=float, default=10.0, help="step_deadline_floor_s")
    demo.add_argument("--log-every", type=int, default=50)
    demo.add_argument("--report", default=None, help="write the run report as JSON here")
    demo.add_argument("--events", default=None, help="write the timeline as JSON lines here, as it happens")
    demo.add_argument("--checkpoint", default=None, help="checkpoint.path: a folder or gs://bucket/prefix")
    demo.add_argument("--save-every", type=int, default=100, help="checkpoint.save_every (steps)")
    ck = sub.add_parser("checkpoints", help="list a run's checkpoint steps, committed or not")
    ck.add_argument("path", help="checkpoint.path: a folder or gs://bucket/prefix")
    ck.add_argument("--json", action="store_true", help="print JSON")
    ck.add_argument("--check", action="store_true", help="also check the path is writable")
    tl = sub.add_parser("timeline", help="draw a run's events file or report as a PNG")
    tl.add_argument("events", nargs="?", default=None, help="events file (JSON lines, from demo --events / EventLog)")
    tl.add_argument("--report", default=None, help="a run report JSON (demo --report) instead of an events file")
    tl.add_argument("-o", "--output", default=None, help="PNG to write (default: the input's name with .png)")
    tl.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        return _demo(args)
    if args.command == "timeline":
        return _timeline(args)
    if args.command == "checkpoints":
        return _checkpoints(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

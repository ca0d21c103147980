"""`ray-elastic`: the command line.

    ray-elastic [--debug] demo [--policy resize|pause] [--slices N] [--steps N]
                     [--model small|medium|large] [--sharding replicated|fsdp|fsdp_tp]
                     [--fail-at STEP] [--fault remove_node|kill|stop|slow|corrupt]
                     [--report FILE] [--events FILE] ...
    ray-elastic timeline EVENTS.jsonl [-o OUT.png]
    ray-elastic timeline --report REPORT.json [-o OUT.png]
    ray-elastic checkpoints PATH [--verify [--mark-damaged]] [--json]

`demo` starts a real multi-node Ray cluster on this machine (one simulated
node per host), trains the example transformer LM, injects a fault into a
slice mid-run, recovers by the chosen policy, adds a replacement node when a
node was lost, and prints the run's timeline and loss (in a terminal, with a
live progress line). Its metrics go to Ray's metrics system
(`ray_elastic.observe.metrics`); `--events` writes the timeline as JSON lines.

`timeline` draws a run's events file or report as a PNG.

An error is one line on stderr, `ray-elastic: error: MESSAGE`: exit code 2
for a bad setting (found before any cluster starts), 1 for a run or a
storage that failed; `--debug` or RAY_ELASTIC_DEBUG=1 adds the traceback.
The demo's options that the job driver examples/train_lm.py has too are
defined once, in cli_options.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
import threading
import time
from typing import Optional

from ray_elastic.failures.faults import CORRUPT_TARGETS
from ray_elastic.paths import work_path

__all__ = ["main"]


class _RayOutputToFile:
    """While open, everything this process writes to its stdout and stderr
    (file descriptors 1 and 2) goes to a file: Ray's own messages to the
    driver (a raylet's death notice and state dump when a node is removed on
    purpose), its C++ core worker's log lines and its Python log lines. The
    demo writes its progress, timeline and summary to `out` and `err`, which
    stay on the terminal. An uncaught error restores the descriptors before
    Python prints it, so real errors still reach the user."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> "_RayOutputToFile":
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        self.err = os.fdopen(os.dup(2), "w", buffering=1)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # Errors logged by anyone (ray_elastic, Orbax, Ray) still show.
        self._handler = logging.StreamHandler(self.err)
        self._handler.setLevel(logging.ERROR)
        self._handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self._handler)
        sys.stdout.flush()
        sys.stderr.flush()
        for saved, fd in zip(self._saved, (1, 2)):
            os.dup2(saved, fd)
            os.close(saved)
        self.out.close()
        self.err.close()


def _demo(args: argparse.Namespace) -> int:
    from ray_elastic import CpuSlice, Fault
    from ray_elastic.checkpoint import CheckpointConfig
    from ray_elastic.cli_options import elastic_config, example_program
    from ray_elastic.failures.faults import check_faults
    from ray_elastic.cluster.local_cluster import LocalCluster

    # Every setting is checked here, before any process or node is started:
    # a bad one is a ConfigError, which `main` prints as one line.
    spec = CpuSlice(hosts=args.hosts_per_slice, devices_per_host=args.devices_per_host)
    config = elastic_config(args, spec)
    fail_at = args.steps // 4 if args.fail_at is None else args.fail_at
    ms = args.slow_ms if args.fault == "slow" else 0
    target = args.corrupt if args.fault == "corrupt" else ""
    faults = () if fail_at < 0 else (Fault(args.fault, args.fail_slice, fail_at, ms=ms, target=target),)
    check_faults(faults, config.num_slices, spec.hosts)
    # The example model ships in the package (pyproject.toml maps examples/
    # to ray_elastic.examples), so workers import it like any installed code.
    from ray_elastic.examples import lm

    program = example_program(lm, args, spec)  # its mesh must fit a slice's devices
    checkpoint = CheckpointConfig(args.checkpoint, save_every=args.save_every) if args.checkpoint else None
    if checkpoint is not None:
        checkpoint.check_storage()  # there and writable, before the cluster
    for option, path in (("--report", args.report), ("--events", args.events)):
        _check_output_file(option, path)
    print(f"training {program.describe()}", flush=True)

    num_nodes = (args.slices + args.spare_slices) * args.hosts_per_slice
    print(f"starting a local Ray cluster: head + {num_nodes} nodes", flush=True)
    t0 = time.monotonic()
    # What Ray prints in this process (from the cluster's start on) goes
    # to this file; each Ray process logs to the session's own folder.
    own = work_path(f"demo-{os.getpid()}.out")
    os.makedirs(os.path.dirname(own), exist_ok=True)
    with _RayOutputToFile(own) as console:
        cluster = LocalCluster(num_nodes=num_nodes)
        try:
            logs = cluster.logs_dir
            print(f"cluster up in {time.monotonic() - t0:.1f} s; driver pid {os.getpid()}", file=console.out)
            print(f"Ray's own logs: {logs} (what Ray printed here: {own})", file=console.out)
            rc = run_demo(args, cluster, config, checkpoint, faults, program.factory, console)
            print(f"  Ray's logs: {logs} (what Ray printed here: {own})", file=console.out)
            return rc
        finally:
            cluster.shutdown()  # Ray prints as it stops: still into the file


def _check_output_file(option: str, path) -> None:
    """A file the demo writes as it runs or at its end: its folder must
    exist now, not only when the run is over."""
    from ray_elastic.errors import ConfigError

    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(option, f"cannot write {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise ConfigError(option, f"cannot write {path}: it is a folder")


def run_demo(args, cluster, config, checkpoint, faults, factory, console, node_starts: Optional[list] = None) -> int:
    """The demo's run on a cluster that is up (a LocalCluster): train, add
    a replacement node from outside the controller's thread when a node is
    lost, print the summary to `console.out` (errors to `console.err`).
    `node_starts` collects each node added: when asked for and up
    (time.monotonic), the thread that added it and the controller's.
    Returns the exit code."""
    node_starts = [] if node_starts is None else node_starts
    cluster_work: queue.Queue = queue.Queue()  # what the controller asks of the cluster; None: done
    lost_node: dict = {}
    from ray_elastic import ElasticTrainer, RunFailed
    from ray_elastic.observe.events import EventLog
    from ray_elastic.observe.metrics import MetricsCallback
    from ray_elastic.callbacks import Callback
    from ray_elastic.observe.progress import ProgressCallback, step_line

    out = console.out
    cluster.connect()

    # In a terminal a live progress line shows the run and prints the events
    # above it; elsewhere (logs, CI) the plain lines below do.
    live = out.isatty()
    metrics = MetricsCallback(f"demo-{os.getpid()}")  # on the head node's Prometheus endpoint
    callbacks = [metrics]
    progress = ProgressCallback(args.steps, stream=out, events="all") if live else None
    if progress is not None:
        callbacks.append(progress)
    if args.events:
        callbacks.append(EventLog(args.events))

    def on_event(e: dict) -> None:
        name = e["event"]
        if not live:
            print(f"  [{e['t']:7.2f} s] {name}: " + ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event")), file=out)
        if name == "fault" and e["kind"] in ("remove_node", "freeze_node"):
            lost_node["pending"] = True
        if name == "detected" and e["kind"] in ("corrupted", "straggler"):  # its node is evicted: a new one is needed
            lost_node["pending"] = True
        # The replacement node, as a cloud's autoscaler adds one, is started
        # by this process's main thread (Ray starts local nodes only there),
        # never by the controller's: at once when the run waits for it, and
        # once training goes on (a spare joined, or resize) otherwise.
        trigger = "wait" if args.policy == "pause" and not config.spare_slices else "recovered"
        if name == trigger and lost_node.pop("pending", False):
            text = "  a replacement node is starting (outside the controller, as an autoscaler adds one)"
            progress.message(text) if progress is not None else print(text, file=out)
            cluster_work.put("add_node")

    class StepLines(Callback):
        def on_step(self, step: int, metrics: dict) -> None:
            if not live and (step % args.log_every == 0 or step == args.steps):
                print(step_line(step, args.steps, metrics), file=out)

    trainer = ElasticTrainer(
        factory, config, args.steps, faults=faults, remove_node=cluster.remove_node,
        on_event=on_event, callbacks=[*callbacks, StepLines()], checkpoint=checkpoint,
    )
    # The controller runs on a thread of its own; this (main) thread does
    # the cluster's work the controller asks for, so that no controller
    # call waits on a node starting. (A driver's SIGTERM handler needs the
    # main thread: the demo does without it; `examples/train_lm.py`, the
    # job driver, keeps the controller on its main thread.)
    result: dict = {}

    def fit() -> None:
        try:
            result["report"] = trainer.fit()
        except BaseException as e:  # handed to the main thread
            result["error"] = e
        finally:
            cluster_work.put(None)

    controller = threading.Thread(target=fit, name="controller", daemon=True)
    controller.start()
    try:
        for _ in iter(cluster_work.get, None):
            t0 = time.monotonic()
            cluster.add_node()
            node_starts.append({"started": t0, "up": time.monotonic(), "thread": threading.get_ident(),
                                "controller": controller.ident})
        controller.join()
    finally:
        metrics.close()
    rc = 0
    if isinstance(result.get("error"), RunFailed):
        print(f"run failed: {result['error']}", file=console.err)
        rc = 1
    elif "error" in result:
        raise result["error"]
    report = result.get("report", trainer.report)

    print("\nsummary", file=out)
    for f in report.failures:
        print(
            f"  failure {f.kind} slice {f.slice} at step {f.step}: detected in {f.detected_s:.3f} s, "
            f"next step after {f.recovered_s if f.recovered_s is None else round(f.recovered_s, 3)} s, "
            f"steps redone {f.steps_rewound}, slices after {f.slices_after}",
            file=out,
        )
    print(
        f"  steps {report.steps_completed}/{report.steps_requested}, final loss {report.final_loss:.4f}, "
        f"wall {report.wall_s:.1f} s, goodput {report.goodput:.2f}, driver pid "
        f"{report.driver_pid_start} -> {report.driver_pid_end}",
        file=out,
    )
    if args.report:
        report.write(args.report)
        print(f"  report written to {args.report}", file=out)
    if args.events:
        print(f"  events written to {args.events} (draw them: ray-elastic timeline {args.events})", file=out)
    return rc


def _timeline(args: argparse.Namespace) -> int:
    from ray_elastic.errors import TimelineInputError
    from ray_elastic.observe.timeline import main_timeline

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
    """List a run's checkpoint steps, committed or not; with --verify, read
    and check every committed one (exit 1 if any step is damaged). A path
    that names nothing (no such folder; on GCS, no such bucket) is an error
    (exit 2); an existing folder, or a GCS prefix, with no steps under it
    lists none; storage that cannot be read is an error (exit 1)."""
    import dataclasses
    import datetime

    from ray_elastic.checkpoint import CheckpointStore, integrity
    from ray_elastic.errors import CheckpointDamaged, ConfigError

    store = CheckpointStore(args.path)
    missing = store.missing()
    if missing:
        raise ConfigError("checkpoint.path", missing)
    store.preflight() if args.check else None
    steps = store.steps(sizes=True)
    # Per step: (check, problem). Steps moved aside earlier carry their
    # note; with --verify every committed step is read in full.
    checks = {}
    for s in steps:
        if s.damaged:
            note = integrity.read_marker(args.path, s.name)
            checks[s.name] = ("DAMAGED", f"{note.get('file', '?')}: {note.get('reason', 'no note')}")
        elif args.verify and s.committed:
            try:
                checks[s.name] = ("ok", store.verify(s.step))
            except CheckpointDamaged as d:
                checks[s.name] = ("DAMAGED", f"{d.file}: {d.reason}")
                if args.mark_damaged:
                    moved = store.mark_damaged(d)["moved_to"]
                    checks[moved or s.name] = checks.pop(s.name)
    if args.mark_damaged:
        steps = store.steps(sizes=True)
    damaged = sorted({int(name.split(".")[0]) for name, (check, _) in checks.items() if check == "DAMAGED"})
    rc = 1 if damaged and args.verify else 0  # a plain listing only informs
    if args.json:
        rows = [{**dataclasses.asdict(s), "check": checks.get(s.name, ("", ""))[0], "problem": checks.get(s.name, ("", ""))[1]}
                for s in steps]
        print(json.dumps(rows, indent=1))
        return rc
    if not steps:
        print(f"no checkpoint steps under {args.path}")
        return 0
    print(f"{'step':>8}  {'state':<11} {'size':>10}  {'written (UTC)':<19}  {'folder':<14}  check")
    for s in steps:
        when = datetime.datetime.fromtimestamp(s.mtime, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if s.mtime else "?"
        state = "DAMAGED" if s.damaged else "committed" if s.committed else "INCOMPLETE"
        check, problem = checks.get(s.name, ("", ""))
        detail = f"{check} ({problem})" if check else ""
        print(f"{s.step:>8}  {state:<11} {_human(s.bytes):>10}  {when:<19}  {s.name:<14}  {detail}".rstrip())
    latest = store.latest_committed()
    print(f"latest committed: {latest if latest is not None else 'none'} (a restart resumes from it)")
    if damaged:
        unmoved = [s.step for s in steps if s.committed and checks.get(s.name, ("",))[0] == "DAMAGED"]
        print(f"damaged steps: {', '.join(map(str, damaged))}" + (
            f" (not moved aside yet: {unmoved}; a run does that before restoring, --mark-damaged now)" if unmoved else ""))
    return rc


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    from ray_elastic.cli_options import DEBUG_ENV, add_debug_option, add_shared_options

    parser = argparse.ArgumentParser(
        prog="ray-elastic", description=__doc__.split("\n\n")[0],
        epilog=f"A bad setting prints one line, `ray-elastic: error: SETTING: PROBLEM`, and exits 2; a run that "
        f"fails exits 1. --debug (before or after the command) or {DEBUG_ENV}=1 also prints the traceback.",
    )
    add_debug_option(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the example LM on a local cluster through a failure")
    add_shared_options(demo, steps=400, timeout_s=120.0)
    opt = demo.add_argument
    opt("--fail-at", type=int, default=None, help="step of the fault; -1: no fault (default: steps/4)")
    opt("--fail-slice", type=int, default=1, help="slice the fault hits (default: %(default)s)")
    opt("--fault", choices=("remove_node", "kill", "stop", "slow", "corrupt"), default="remove_node",
        help="remove_node: the node and its processes go; kill: SIGKILL a worker; "
        "stop: SIGSTOP a worker, a hang; slow: the slice takes --slow-ms longer per step from then on, "
        "alive and answering; corrupt: the slice flips a bit of its state or gradient, see --corrupt "
        "(default: %(default)s)")
    opt("--slow-ms", type=int, default=1000, help="with --fault slow: milliseconds added per step (default: %(default)s)")
    opt("--corrupt", choices=CORRUPT_TARGETS, default="state",
        help="with --fault corrupt: what flips, state (the state its next apply makes, on one device) or grads "
             "(the next gradient it sends); with +, at every step from then on; check: its next gradient "
             "cross-check computation only, once (default: %(default)s)")
    add_debug_option(demo, default=argparse.SUPPRESS)
    ck = sub.add_parser("checkpoints", help="list a run's checkpoint steps, committed or not")
    ck.add_argument("path", help="checkpoint.path: a folder or gs://bucket/prefix")
    ck.add_argument("--json", action="store_true", help="print JSON instead of a table (default: off)")
    ck.add_argument("--check", action="store_true", help="also check that the path is writable (default: off)")
    ck.add_argument("--verify", action="store_true",
                    help="read every committed step and check its files and arrays against the checksums "
                    "recorded at save time; exit 1 if any step is damaged (default: off)")
    ck.add_argument("--mark-damaged", action="store_true",
                    help="with --verify: move damaged steps aside as STEP.damaged, so no restore (ours or "
                    "plain Orbax) picks them (default: off)")
    add_debug_option(ck, default=argparse.SUPPRESS)
    tl = sub.add_parser("timeline", help="draw a run's events file or report as a PNG")
    tl.add_argument("events", nargs="?", default=None, help="events file (JSON lines, from demo --events / EventLog)")
    tl.add_argument("--report", default=None, help="a run report JSON (demo --report) instead of an events file (default: none)")
    tl.add_argument("-o", "--output", default=None, help="PNG to write (default: the input's name with .png)")
    tl.add_argument("--title", default=None, help="the chart's title (default: policy, slices, steps and goodput)")
    add_debug_option(tl, default=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ray_elastic.cli_options import debugging, report_error
    from ray_elastic.errors import ElasticError

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = {"demo": _demo, "timeline": _timeline, "checkpoints": _checkpoints}[args.command]
    try:
        return command(args)
    except ElasticError as e:  # a bad setting, a failed run, storage: its message, not a traceback
        return report_error(parser.prog, e, debug=debugging(args))


if __name__ == "__main__":
    sys.exit(main())

"""python -m bench [core|compare|scale|detect|soak|ready|hoststart|sharded|contract|data|snapshots|integrity|falsealarms|accel|sizes|exchange|kept] [--quick] [--out DIR] ...

Runs the benchmarks on a real local multi-node Ray cluster made on the spot,
prints Markdown tables and writes the figures (JSON, Markdown, PNG) under
--out (bench/README.md describes each suite):

- core: ray_elastic's own detection, recovery and snapshot overhead;
- compare: ray_elastic (pause, resize) side by side with Ray Train v2
  (FailureConfig, elastic ScalingConfig) and a full restart, per fault
  scenario, plus chaos, step-time overheads and the goals;
- scale: the real controller against 16..1024 simulated slices (`--step-s 1`:
  pipelined dispatch; `--floor`: the driver's calls alone, no controller);
- detect: node removal and a frozen node on Ray's default health checks
  and on the tuned ones, side by side, and a stopped worker and a slowed
  slice (heartbeats: found, or rightly not), on ray_elastic's defaults;
- soak: a long chaos run per leg (nine fault kinds, the next as soon as the
  last has healed, a share fired mid-recovery, mid-join, mid-checkpoint and
  mid-DiLoCo-synchronization) on Ray's default health checks with
  checkpoints on a GCS-compatible server, then a failure-free reference:
  every failure recovered, final state bitwise equal, nothing leaked
  (`--failures N` or `--minutes`, `--policy pause|resize|diloco|both|all`);
- ready: a replacement worker's placement to ready, per phase (process
  start, imports, JAX init, program, initial state, compile, first state
  load), `--runs` replacements per variant;
- hoststart: whole runs on 2 slices x 2 CPU hosts with a worker killed,
  the hosts' own compile cache (worker/host_cache.py) kept against
  emptied (alternated): start, first step, replacement, whole run;
- sharded: a >= 200 MB state sharded (FSDP) on 2 slices x 2 hosts: worker
  peak memory against the replicated layout, the driver's memory as the
  state grows 4x, step time against one plain jax.distributed job, and the
  cross-slice bytes per host against the ring all-reduce bound;
- contract: the step contract's cost on the example LM (2 slices): today's
  loss_fn(params, batch) against loss_fn(params, batch, ctx) -> LossOutput,
  alternated run by run (target: new <= +2%), and 64 rows per step as 8
  shards against 2 shards of 4 microbatches (gradient bytes per apply,
  worker memory, step time);
- data: the example LM fed by a Grain pipeline over an ArrayRecord file:
  bytes read per host at 1, 2 and 4 hosts per slice, and the step time
  against the same rows from memory (alternated runs);
- snapshots: what an in-memory snapshot costs per model size and hosts per
  slice (bytes, seconds on and off the step's path, CPU seconds), the large
  model 2 x 2 FSDP with the default interval against snapshots off and a
  plain jax.distributed job (alternated), and a loss of every slice against
  the steps the report said it would redo;
- integrity: the state checks' cost (every step against off, alternated,
  small and large models) and a bit flipped in one slice's state: found at
  which step, the slice named, the steps rolled back, bitwise equal;
- falsealarms: every demo command the README and docs give (each example,
  layout and policy, with and without spares), no fault injected,
  alternated: failures per run (all must be 0) and the step times' median,
  mean and p99 (`--steps`, default 200; `--runs`; `--variants`);
- accel: the example LM at 341M parameters on this machine's GPU, plain
  JAX against ray_elastic on 1 slice, 2 slices sharing the GPU, and 2 with
  a SIGKILL under resize, alternated (`--steps`, default 40; `--runs`
  rounds, default 1; `--fail-at`, default 20); `--cpu`: the same on a
  2-node local cluster at a small size;
- sizes: states of 0.3, 1 and 2 GB with short steps on CPU, 2 slices
  against a plain 2-process jax.distributed job, alternated, and a SIGKILL
  at 2 GB (`--steps`, default 12; `--quick`: 0.3 GB only, no kill);
- exchange: the cross-slice exchange, the direct hand-off against the
  reduce-scatter and all-gather, alternated, at 2, 4 and 8 slices
  (`--sizes`) and 1 and 4 shards per slice, and bfloat16 on the wire:
  bytes per host per step against the ring bound, the exchange's seconds,
  step time, peak memory (`--steps`, default 12; `--runs` rounds,
  default 1); `--big`: the 2 GB state on 2 slices (`--runs`, default 2);
- diloco: synchronous training against DiLoCo (sync period 10 and 36) and Streaming DiLoCo (4 fragments), on
  a plain local cluster and behind a simulated 1 Gbit/s link per host:
  steps per second, bytes across slices per step, loss curves (a PNG);
  `--variants overlap`: Streaming DiLoCo with its exchange between two inner
  steps (V 0) against beside the next 5 (V 5), behind a 20 Mbit/s link
- tpu: a slice's step on the accelerator JAX finds (a TPU), in one
  process per variant, no Ray cluster: plain JAX (whole batch, shards as
  microbatches) against one slice, with microbatches, DiLoCo inner steps,
  two slices sharing the device, a snapshot in flight and an Orbax
  checkpoint, alternated (`--size 341m|152m|tiny`, `--steps`, default
  20; `--runs` rounds, default 1; `--variants`);
- kept: a driver's next run on new workers against one on the slices its
  last run kept (keep_workers): slices ready, whole fit, bitwise equal
  (`--runs` rounds, default 5; `--steps`, default 12).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("suite", nargs="?", default="core", choices=("core", "compare", "scale", "detect", "soak", "ready", "hoststart", "sharded",
                                                                     "contract", "data", "snapshots", "integrity",
                                                                     "falsealarms", "accel", "sizes", "exchange", "kept", "diloco",
                                                                     "tpu"))
    parser.add_argument("--cpu", action="store_true", help="accel: CPU slices on a local cluster, a small model")
    parser.add_argument("--size", default="341m", choices=("341m", "152m", "tiny"),
                        help="tpu: the example LM's size (tiny: CPU, a minute)")
    parser.add_argument("--merge", nargs="+", default=None, help="tpu: the JSON results of earlier invocations, as one table")
    parser.add_argument("--big", action="store_true", help="exchange: the 2 GB state on 2 slices only")
    parser.add_argument("--quick", action="store_true", help="fewer runs and steps (a few minutes)")
    parser.add_argument("--out", default="reports/bench", help="folder for the JSON, Markdown and PNG results")
    parser.add_argument("--runs", type=int, default=None, help="compare: runs per cell (quick 1, full 3); detect: runs (3); ready: replacements per variant (5); "
                             "hoststart: alternated rounds (3); "
                             "sharded: alternated ray_elastic/plain rounds (quick 1, full 2); "
                             "contract: alternated today/new-contract pairs (quick 2, full 5)")
    parser.add_argument("--variants", type=_csv, default=None,
                        help="ready: comma-separated subset of variants (default all); integrity: of parts "
                             "(small,large,cross,catch,straggler); diloco: 'overlap' (V 0 against V 5 behind a slow link); "
                             "detect: of faults (remove_node,freeze_node,stop,slow,remove_node_pause)")
    parser.add_argument("--systems", type=_csv, default=None, help="compare: comma-separated subset of systems")
    parser.add_argument("--scenarios", type=_csv, default=None, help="compare: comma-separated subset of scenarios")
    parser.add_argument("--slices-per-leader", type=int, default=32,
                        help="scale --step-s: slices per group leader in the third run of each size (0: no such run)")
    parser.add_argument("--steps", type=int, default=None, help="compare: steps per run; scale: steps per size; soak: steps per run (skips the warm-up); "
                             "sharded: steps per run (quick 6, full 20); contract: steps per run (quick 40, full 120)")
    parser.add_argument("--fail-at", type=int, default=None, help="compare: step of the fault")
    parser.add_argument("--chaos-s", type=float, default=None, help="compare: chaos run length (quick 120, full 300)")
    parser.add_argument("--overhead-pairs", type=int, default=None,
                        help="compare: alternated rounds for the overheads (quick 2, full 5; 0: skip)")
    parser.add_argument("--sizes", type=lambda t: [int(x) for x in _csv(t)], default=None,
                        help="scale: slice counts (default 16,64,256,1024); exchange: slice counts (default 2,4,8)")
    parser.add_argument("--patterns", type=_csv, default=None,
                        help="scale --floor: call patterns (default today,folded,bare,grouped)")
    parser.add_argument("--step-s", type=float, default=None,
                        help="scale: simulated compute per step (e.g. 1): pipelined dispatch off vs on, "
                             "driver overhead per step (default sizes 256,1024)")
    parser.add_argument("--floor", action="store_true",
                        help="scale: the driver's calls alone, no controller (bench/call_floor.py): today's pattern, "
                             "a folded one and one bare call per slice, 1 s compute (default sizes 256,1024)")
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="soak: length of each chaos run without --failures (default 30)")
    parser.add_argument("--failures", type=int, default=None,
                        help="soak: run each leg until this many faults have been fired and healed")
    parser.add_argument("--policy", default="both", choices=("pause", "resize", "diloco", "both", "all"),
                        help="soak: the leg(s): both = pause and resize, all = those and diloco (default both)")
    parser.add_argument("--window-share", type=float, default=None,
                        help="soak: the share of faults fired from an event that opens a window (default 0.25)")
    parser.add_argument("--seed", type=int, default=0, help="soak: seed of the fault draws")
    parser.add_argument("--kinds", type=_csv, default=None,
                        help="soak: comma-separated subset of fault kinds (default all nine)")
    parser.add_argument("--interval", type=lambda t: tuple(float(x) for x in _csv(t)), default=None,
                        help="soak: seconds from a healed run to its next fault, MIN,MAX (default 1,5); "
                             "compare's chaos: seconds between faults (default 30,60)")
    parser.add_argument("--time-cap", action="store_true",
                        help="soak: the first chaos run ends (all slices live) once --minutes have passed, and the "
                        "later runs and the reference take the steps it completed (use with a generous --steps)")
    parser.add_argument("--no-reference", action="store_true",
                        help="soak: skip the failure-free reference run (and the bitwise check)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.suite == "tpu":
        from bench import tpu
        from bench.common import write_result

        if args.merge:  # results of earlier invocations (JSON), as one table
            results = []
            for path in args.merge:
                with open(path) as f:
                    results.append(json.load(f))
            result = tpu.merge(results)
        else:
            result = tpu.run(args.size, variants=tuple(args.variants or tpu.VARIANTS), steps=args.steps or 20,
                             rounds=args.runs or 1)
        text = tpu.table(result)
        print(text)
        os.makedirs(args.out, exist_ok=True)
        write_result(args.out, f"tpu-{result['size']}", result, text)
        return 0

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from bench.common import start_cluster, write_result

    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    if args.suite == "core":
        from bench import core

        cluster = start_cluster(2)
        try:
            result = core.run(cluster, quick=args.quick)
        finally:
            cluster.shutdown()
        text = core.table(result)
        print(text)
        write_result(args.out, "core", result, text)
        return 0

    if args.suite == "accel":
        from bench import accel

        cluster = accel.start(args.cpu)
        try:
            result = accel.run(args.cpu, steps=args.steps or 40, rounds=args.runs or 1, fail_at=args.fail_at or 20)
        finally:
            accel.stop(cluster)
        text = accel.table(result)
        print(text)
        write_result(args.out, "accel", result, text)
        return 0

    if args.suite == "sizes":
        from bench import sizes

        cluster = start_cluster(2, object_store_mb=4000)  # a 2 GB state's snapshot copies and gradients
        try:
            result = sizes.run(steps=args.steps or 12, quick=args.quick, kill=not args.quick)
        finally:
            cluster.shutdown()
        text = sizes.table(result)
        print(text)
        write_result(args.out, "sizes", result, text)
        return 0

    if args.suite == "diloco" and args.variants == ["overlap"]:
        from bench import diloco

        result = diloco.run_overlap(runs=args.runs or (1 if args.quick else 3), steps=args.steps or (60 if args.quick else 300))
        text = diloco.overlap_table(result)
        print(text)
        write_result(args.out, "diloco_overlap", result, text)
        return 0 if all(not c["failures"] and c["same_losses"] for r in result["rows"].values() for c in r.values()) else 1

    if args.suite == "diloco":
        from bench import diloco

        result = diloco.run(runs=args.runs or (1 if args.quick else 3), steps=args.steps or (60 if args.quick else 300),
                            out=args.out)
        text = diloco.table(result)
        print(text)
        write_result(args.out, "diloco", result, text)
        return 0 if all(not c["failures"] and c["same_losses"] for r in result["rows"].values() for c in r.values()) else 1

    if args.suite == "kept":
        from bench import kept

        cluster = start_cluster(2)
        try:
            result = kept.run(runs=args.runs or (2 if args.quick else 5), steps=args.steps or 12)
        finally:
            cluster.shutdown()
        text = kept.table(result)
        print(text)
        write_result(args.out, "kept", result, text)
        return 0 if all(m["all_bitwise_equal"] and not m["failures"] for m in result["medians"].values()) else 1

    if args.suite == "exchange":
        from bench import exchange

        if args.big:
            cluster = start_cluster(2, object_store_mb=4000)  # as bench sizes
            try:
                result = exchange.run_big(steps=args.steps or 12, rounds=args.runs or 2)
            finally:
                cluster.shutdown()
        else:
            cluster = start_cluster(2)
            try:
                result = exchange.run(cluster, steps=args.steps or 12, rounds=args.runs or 1,
                                      slices=args.sizes or exchange.SLICES)
            finally:
                cluster.shutdown()
        text = exchange.table(result)
        print(text)
        write_result(args.out, "exchange-big" if args.big else "exchange", result, text)
        return 0

    if args.suite == "falsealarms":
        from bench import falsealarms

        variants = args.variants or list(falsealarms.COMMANDS)
        bad = [v for v in variants if v not in falsealarms.COMMANDS]
        if bad:
            parser.error(f"unknown variant(s) {bad}; choose from {', '.join(falsealarms.COMMANDS)}")
        result = falsealarms.run(steps=args.steps or (40 if args.quick else 200), runs=args.runs or 1,
                                 variants=variants)
        text = falsealarms.table(result)
        print(text)
        write_result(args.out, "falsealarms", result, text)
        return 0 if result["false_failures"] == 0 else 1

    if args.suite == "ready":
        from bench import ready

        variants = args.variants or list(ready.VARIANTS)
        bad = [v for v in variants if v not in ready.VARIANTS]
        if bad:
            parser.error(f"unknown variant(s) {bad}; choose from {', '.join(ready.VARIANTS)}")
        cluster = start_cluster(len(variants))  # a node each: each variant keeps its placement group
        try:
            result = ready.run(runs=args.runs or 5, variants=variants)
        finally:
            cluster.shutdown()
        text = ready.table(result)
        print(text)
        write_result(args.out, "ready", result, text)
        return 0

    if args.suite == "hoststart":
        from bench import hoststart

        cluster = start_cluster(hoststart.SLICES * hoststart.HOSTS)
        try:
            result = hoststart.run(cluster, runs=args.runs or 3)
        finally:
            cluster.shutdown()
        text = hoststart.table(result)
        print(text)
        write_result(args.out, "hoststart", result, text)
        return 0

    if args.suite == "sharded":
        from bench import sharded

        cluster = start_cluster(sharded.SLICES * sharded.HOSTS, object_store_mb=sharded.OBJECT_STORE_MB)
        try:
            result = sharded.run(cluster, quick=args.quick, steps=args.steps, rounds=args.runs,
                                 partial_path=os.path.join(args.out, "sharded.partial.json"))
        finally:
            cluster.shutdown()
        files = sharded.write(result, args.out)
        print()
        print(sharded.table(result))
        print(f"\nwrote {files['json']} and {files['md']} ({time.monotonic() - t0:.0f} s)")
        return 0

    if args.suite == "data":
        from bench import data

        cluster = start_cluster(4)
        try:
            result = data.run(cluster, quick=args.quick, runs=args.runs, steps=args.steps)
        finally:
            cluster.shutdown()
        files = data.write(result, args.out)
        print()
        print(data.table(result))
        print(f"\nwrote {files['json']} and {files['md']} ({time.monotonic() - t0:.0f} s)")
        return 0

    if args.suite == "snapshots":
        from bench import snapshots

        cluster = start_cluster(4, object_store_mb=snapshots.OBJECT_STORE_MB)
        try:
            result = snapshots.run(cluster, quick=args.quick, runs=args.runs, steps=args.steps,
                                   partial_path=os.path.join(args.out, "snapshots.partial.json"))
        finally:
            cluster.shutdown()
        files = snapshots.write(result, args.out)
        print()
        print(snapshots.table(result))
        print(f"\nwrote {files['json']} and {files['md']} ({time.monotonic() - t0:.0f} s)")
        return 0

    if args.suite == "integrity":
        from bench import integrity

        cluster = start_cluster(4)
        try:
            result = integrity.run(cluster, quick=args.quick, runs=args.runs, steps=args.steps,
                                   parts=tuple(args.variants or integrity.PARTS))
        finally:
            cluster.shutdown()
        files = integrity.write(result, args.out)
        print()
        print(integrity.table(result))
        print(f"\nwrote {files['json']} and {files['md']} ({time.monotonic() - t0:.0f} s)")
        return 0

    if args.suite == "contract":
        from bench import contract

        cluster = start_cluster(contract.SLICES)
        try:
            result = contract.run(cluster, quick=args.quick, runs=args.runs, steps=args.steps,
                                  partial_path=os.path.join(args.out, "contract.partial.json"))
        finally:
            cluster.shutdown()
        files = contract.write(result, args.out)
        print()
        print(contract.table(result))
        print(f"\nwrote {files['json']} and {files['md']} ({time.monotonic() - t0:.0f} s)")
        return 0

    if args.suite == "detect":
        from bench import detect

        result = detect.run(runs=args.runs or (1 if args.quick else 3), faults=args.variants)
        text = detect.table(result)
        print(text)
        write_result(args.out, "detect", result, text)
        return 0

    if args.suite == "soak":
        from bench import soak

        kinds = args.kinds or list(soak.KINDS)
        bad = [k for k in kinds if k not in soak.KINDS]
        if bad:
            parser.error(f"unknown fault kind(s) {bad}; choose from {', '.join(soak.KINDS)}")
        gap = args.interval or soak.GAP_S
        if len(gap) != 2 or not 0 <= gap[0] <= gap[1]:
            parser.error("--interval: MIN,MAX seconds, 0 <= MIN <= MAX")
        if args.failures is not None and args.failures < 1:
            parser.error("--failures: at least 1")
        share = soak.WINDOW_SHARE if args.window_share is None else args.window_share
        if not 0 <= share <= 1:
            parser.error("--window-share: between 0 and 1")
        legs = {"both": soak.POLICIES, "all": soak.LEGS}.get(args.policy, (args.policy,))
        result = soak.run(args.minutes, legs, seed=args.seed, gap_s=gap, kinds=kinds, steps=args.steps,
                          failures=args.failures, window_share=share, reference=not args.no_reference,
                          partial_path=os.path.join(args.out, "soak.partial.json"), time_cap=args.time_cap)
        files = soak.write(result, args.out)
        print()
        print(soak.table(result))
        print(f"\nwrote {files['json']} and {files['md']} ({time.monotonic() - t0:.0f} s)")
        return 1 if result["fails"] else 0

    if args.suite == "compare":
        from bench import compare

        systems = args.systems or list(compare.SYSTEMS)
        scenarios = args.scenarios or list(compare.SCENARIOS)
        for name, known, given in (("system", compare.SYSTEMS, systems), ("scenario", compare.SCENARIOS, scenarios)):
            bad = [x for x in given if x not in known]
            if bad:
                parser.error(f"unknown {name}(s) {bad}; choose from {', '.join(known)}")
        cluster = start_cluster(2)
        try:
            result = compare.run(
                cluster, quick=args.quick, runs=args.runs, systems=systems, scenarios=scenarios,
                steps=args.steps, fail_at=args.fail_at, chaos_s=args.chaos_s,
                overhead_pairs=args.overhead_pairs, **({"chaos_interval_s": args.interval} if args.interval else {}),
            )
        finally:
            cluster.shutdown()
        files = compare.write(result, args.out)
        print()
        print(compare.tables(result))
        print(f"\nwrote {files['json']}, {files['md']} and {len(files['png'])} PNGs under {args.out} "
              f"({time.monotonic() - t0:.0f} s)")
        return 0

    from bench import call_floor, scale

    if args.patterns and (bad := sorted(set(args.patterns) - set(call_floor.PATTERNS))):
        parser.error(f"unknown pattern(s) {bad}; choose from {', '.join(call_floor.PATTERNS)}")
    cluster = start_cluster(0)  # the fakes need no worker nodes
    if args.floor or args.step_s:
        sizes = args.sizes or [256, 1024]
        try:
            if args.floor:
                name = "scale_floor"
                result = call_floor.run(sizes=sizes, rounds=args.runs or 2, steps=args.steps or 14,
                                        step_s=args.step_s or 1.0, patterns=args.patterns or call_floor.PATTERNS)
            else:
                name = "scale_pipelined"
                result = scale.pipelined(sizes=sizes, step_s=args.step_s, steps=args.steps or 20,
                                         slices_per_leader=args.slices_per_leader)
        finally:
            cluster.shutdown()
        text = (call_floor.table if args.floor else scale.pipelined_table)(result)
        print(text)
        write_result(args.out, name, result, text)
        print(f"\nwrote {name}.json and .md under {args.out} ({time.monotonic() - t0:.0f} s)")
        return 0
    try:
        sizes = args.sizes or list(scale.SIZES)
        result = scale.run(sizes=sizes, steps=args.steps or (25 if args.quick else 40),
                           failures=3 if args.quick else 5, quick=args.quick)
    finally:
        cluster.shutdown()
    text = scale.table(result)
    print(text)
    write_result(args.out, "scale", result, text)
    png = scale.chart(result, os.path.join(args.out, "scale.png"))
    print(f"\nwrote scale.json, scale.md and {os.path.basename(png)} under {args.out} "
          f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Soak: a long chaos run on Ray's default health checks, with durable
checkpoints on a GCS-compatible server (fake-gcs-server, a gs:// path),
per leg: `python -m bench soak [--failures N | --minutes M] [--policy
pause|resize|diloco|both|all] [--out DIR]`.

Legs, each on its own fresh local cluster (`LocalCluster(...,
health_checks="default")`: a head without CPUs and one 1-CPU node per
slice and spare, one of them memory-tight for the `oom` faults):

- `pause` and `resize`: `ElasticTrainer`, 3 slices of 1 host and a hot
  spare (`spare_slices=1`), the policy's defaults otherwise (resize:
  `min_slices=1`, `batch_on_resize="accumulate"`), stragglers named
  after 3 s of slow gradient calls (`straggler_min_s`; the default 10 s
  would make a slow slice the slowest fault to heal by far),
  `max_retries` high enough for the whole soak, `CheckpointConfig(
  "gs://soak/...", save_every=SAVE_EVERY, keep=3)`, `keep_final_state`;
- `diloco`: the same under pause with DiLoCo (`diloco_sync_period`
  DILOCO_PERIOD), without the corruption and straggler faults (DiLoCo's
  replicas differ by design: no state check names a corrupted one).

The faults (bench/soak_chaos.py: kinds, their seeded order, the rate,
the windows) are fired by the bench from the trainer's callbacks, as a
production cluster would hit the run: at a time, not at a step. Nodes a
fault takes are replaced by the driver's main thread (Ray's
`Cluster.add_node` works only there) while the controller runs on a
thread of its own, as `ray-elastic demo` does and as a cloud's
autoscaler adds nodes from outside the driver.

Run length: `--failures N` runs each leg until N faults have been fired
and healed, then ends it at the next step (DiLoCo: at the next round's
end) with every slice live; `--minutes M` sizes a fixed step count from
a failure-free warm-up instead (`GOODPUT_GUESS`). Either way the run
ends normally (final checkpoint, `final_state`), and a failure-free run
of the same step count on a fresh cluster gives the state to compare
with: every array of the leg's final state must be bitwise equal to it
(`np.array_equal`).

Before each chaos run and after it has ended, the bench counts the
cluster (bench/soak_leaks.py: processes, nodes, placement groups,
object-store bytes): nothing may be left. Figures (bench/soak_figures.py):
failures by kind and window; detection and fault -> next step, median
and p99 per kind; steps redone; goodput; the bitwise result; failures the
bench did not inject; leaks. A FAIL line for anything amiss, and the
command exits 1.
"""

from __future__ import annotations

import json
import math
import os
import queue
import random
import shutil
import statistics
import threading
import time
from typing import Optional, Sequence

from bench.common import ROOT, lm_factory, steady_step_time
from bench.soak_chaos import EVICT_KINDS, KINDS, WINDOWS, Chaos, cycle_of, tight_env
from bench.soak_figures import analyse, checks, table, write
from bench.soak_leaks import census, settled

__all__ = ["GAP_S", "KINDS", "LEGS", "POLICIES", "WINDOW_SHARE", "bitwise", "checks", "plan_steps", "run", "table",
           "write"]

LEGS = ("pause", "resize", "diloco")
POLICIES = ("pause", "resize")  # `--policy both`
SLICES = 3  # a silent corruption is named by the replicas' vote: 3 at least
SPARES = 1
DILOCO_PERIOD = 20
GAP_S = (1.0, 5.0)  # seconds from a healed run to its next fault (a seeded draw)
WINDOW_SHARE = 0.25  # of the faults, fired from the events that open a window
SAVE_EVERY = 100
KEEP = 3
WARMUP_STEPS = 300
UNBOUNDED_STEPS = 10**7  # a --failures leg: ended by the bench (Chaos.end), never reached
# Share of wall time a chaos run spends in kept steps, to size a --minutes run.
GOODPUT_GUESS = {"pause": 0.45, "resize": 0.85, "diloco": 0.45}


def _print(*args) -> None:
    print(*args, flush=True)


def _cluster(tight: bool) -> tuple:
    """A fresh local cluster on Ray's default health checks, a node per
    slice and spare; with `tight`, one of them is memory-tight (the `oom`
    faults'): (cluster, {"node", "threshold"} or None)."""
    from ray_elastic.cluster.local_cluster import LocalCluster

    cluster = LocalCluster(num_nodes=SLICES + SPARES - (1 if tight else 0), health_checks="default")
    # The driver records where each of its refs was made, so that an
    # object a run leaves referenced is named by the line that made it
    # (soak_leaks: the leak census's object list). Set for the connect
    # only: no node started later (a replacement) inherits it.
    os.environ["RAY_record_ref_creation_sites"] = "1"
    try:
        cluster.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
    finally:
        os.environ.pop("RAY_record_ref_creation_sites", None)
    if not tight:
        return cluster, None
    env, threshold = tight_env()
    return cluster, {"node": cluster.add_node(env=env), "threshold": threshold}


def config(leg: str, spares: int = SPARES):
    """The leg's ElasticConfig (see the module's doc)."""
    from ray_elastic import ElasticConfig

    policy = "resize" if leg == "resize" else "pause"
    return ElasticConfig(num_slices=SLICES, spare_slices=spares, policy=policy, max_retries=10**7, straggler_min_s=3.0,
                         **({"min_slices": 1} if policy == "resize" else {}),
                         **({"enable_diloco": True, "diloco_sync_period": DILOCO_PERIOD} if leg == "diloco" else {}))


def leg_kinds(leg: str, kinds: Sequence[str]) -> list[str]:
    """The fault kinds a leg takes of `kinds`."""
    return [k for k in kinds if not (leg == "diloco" and k in EVICT_KINDS)]


def round_end(leg: str, step: int) -> int:
    """The first step at or after `step` a leg's run may end at: a DiLoCo
    round's end (its last synchronization is one every run makes)."""
    return math.ceil(step / DILOCO_PERIOD) * DILOCO_PERIOD if leg == "diloco" else step


# --------------------------------------------------------------------------
# Sizing a --minutes run.
# --------------------------------------------------------------------------


def warmup(cluster, leg: str, ckpt_path: str, steps: int = WARMUP_STEPS, factory=None) -> dict:
    """A failure-free run with the chaos runs' settings: wall seconds per
    step after start-up (the driver's loop and the checkpoints included)."""
    from ray_elastic import CheckpointConfig, ElasticTrainer

    cluster.ensure_nodes(SLICES + SPARES)
    report = ElasticTrainer(factory or lm_factory(), config(leg), steps,
                            checkpoint=CheckpointConfig(ckpt_path, save_every=SAVE_EVERY, keep=KEEP)).fit()
    start_t = next((e["t"] for e in report.events if e["event"] == "start"), 0.0)
    return {"steps": steps, "wall_s": round(report.wall_s, 3), "start_s": round(start_t, 3),
            "per_step_s": (report.wall_s - start_t) / steps, "step_time_s": steady_step_time(report)}


def plan_steps(minutes: float, per_step_s: float, legs: Sequence[str], start_s: float = 0.0) -> int:
    guess = statistics.fmean(GOODPUT_GUESS[p] for p in legs)
    return max(50, int((minutes * 60.0 - start_s) * guess / per_step_s))


# --------------------------------------------------------------------------
# One chaos run.
# --------------------------------------------------------------------------


def run_chaos(cluster, tight: Optional[dict], leg: str, steps: int, *, ckpt_path: Optional[str], seed: int = 0,
              gap_s: tuple = GAP_S, kinds: Sequence[str] = KINDS, failures: Optional[int] = None,
              window_share: float = WINDOW_SHARE, factory=None, log=_print,
              cap_s: Optional[float] = None) -> tuple[dict, Optional[dict]]:
    """One chaos run of a leg; returns (figures, final state). `steps`:
    its step count (a --failures run is ended by the bench first);
    `cap_s`: end it sooner, at the first step boundary after that many
    seconds where every slice is live."""
    from bench.compare import _recorder
    from ray_elastic import CheckpointConfig, ElasticTrainer

    cluster.ensure_nodes(SLICES + SPARES)
    rec = _recorder()
    checkpoint = CheckpointConfig(ckpt_path, save_every=SAVE_EVERY, keep=KEEP) if ckpt_path else None
    before = census()
    trainer = ElasticTrainer(factory or lm_factory(), config(leg), steps, callbacks=[rec],
                             checkpoint=checkpoint, keep_final_state=True)
    work: queue.Queue = queue.Queue()
    chaos = Chaos(cluster, trainer, rec, slices=SLICES, spares=SPARES, rng=random.Random(seed), gap_s=gap_s,
                  kinds=leg_kinds(leg, kinds), name=leg, log=log, failures=failures, window_share=window_share,
                  windows=[w for w in WINDOWS if w != "sync" or leg == "diloco"],
                  end=(lambda step: round_end(leg, step)) if failures is not None else None,
                  tight=tight, cluster_work=work, sync_period=DILOCO_PERIOD if leg == "diloco" else 0)
    rec.hooks_event.append(chaos.on_event)
    rec.hooks_step.append(chaos.on_step)
    t0 = time.monotonic()

    def cap(step: int, metrics: dict) -> None:
        # The trainer's loop ends once its step count is reached: lowering
        # it ends the run normally (final checkpoint, final state).
        if cap_s is not None and time.monotonic() - t0 >= cap_s and step < trainer.steps and chaos.healed() \
                and metrics["slices"] == SLICES and chaos.ended_at is None:
            chaos.ended_at = trainer.steps = round_end(leg, step)
            log(f"    [{leg}] {cap_s / 60:.0f} min passed: the run ends at step {trainer.steps}")

    rec.hooks_step.append(cap)
    failed: list = []

    def fit() -> None:
        try:
            trainer.fit()
        except Exception as e:  # noqa: BLE001 (reported, and a FAIL)
            failed.append(f"{type(e).__name__}: {str(e)[:500]}")
        finally:
            work.put(None)

    # The controller on a thread of its own; this (main) thread makes the
    # cluster changes the faults call for (replacement nodes).
    controller = threading.Thread(target=fit, name="controller", daemon=True)
    controller.start()
    try:
        for fn, args in iter(work.get, None):
            fn(*args)
        controller.join()
    finally:
        chaos.cleanup()
    error = failed[0] if failed else None
    log(f"    [{leg}] done in {time.monotonic() - t0:.0f} s{': ' + error if error else ''}")
    out = analyse(trainer.report, rec.steps, chaos, name=leg, error=error)
    # The final state, read zero-copy from the object store, pins its object
    # there: the bench takes its own copy before it counts what the run left.
    final, trainer.final_state = _owned(trainer.final_state), None
    out["leaks"] = settled(before, [f["pid"] for f in chaos.faults])
    out["kinds"] = leg_kinds(leg, kinds)
    out["settings"] = (f"{SLICES} slices × 1 host + {SPARES} spare, {config(leg).policy}"
                       + (f", DiLoCo H={DILOCO_PERIOD}" if leg == "diloco" else "")
                       + f", Ray's default health checks, checkpoints every {SAVE_EVERY} steps on gs://")
    return out, final


def _owned(tree):
    """`tree` with every array copied into this process's own memory."""
    import jax
    import numpy as np

    return None if tree is None else jax.tree_util.tree_map(lambda x: np.array(x, copy=True), tree)


# --------------------------------------------------------------------------
# Reference and the bitwise check.
# --------------------------------------------------------------------------


def run_reference(leg: str, steps: int, factory=None, log=_print) -> tuple[dict, dict]:
    """A failure-free run of `steps` steps on a fresh cluster, with the
    leg's training settings (no spare: it holds no state)."""
    from ray_elastic import ElasticTrainer

    cluster, _ = _cluster(tight=False)
    try:
        trainer = ElasticTrainer(factory or lm_factory(), config(leg, spares=0), steps, keep_final_state=True)
        report = trainer.fit()
    finally:
        cluster.shutdown()
    info = {"steps": steps, "steps_completed": report.steps_completed, "wall_s": round(report.wall_s, 3),
            "step_time_s": steady_step_time(report), "failures": len(report.failures)}
    log(f"  reference ({'diloco' if leg == 'diloco' else 'plain'}): {steps} steps in {report.wall_s:.0f} s")
    return info, trainer.final_state


def _leaves(tree) -> list[tuple[str, object]]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), v) for p, v in flat]


def bitwise(state, reference) -> dict:
    """Every array of `state` equal to `reference`'s (np.array_equal)."""
    import numpy as np

    if state is None or reference is None:
        return {"equal": False, "arrays": 0, "mismatched": [], "why": "no final state"}
    a, b = _leaves(state), _leaves(reference)
    if [k for k, _ in a] != [k for k, _ in b]:
        return {"equal": False, "arrays": len(a), "mismatched": [], "why": "different tree structure"}
    bad = [k for (k, x), (_, y) in zip(a, b) if not np.array_equal(np.asarray(x), np.asarray(y))]
    return {"equal": not bad, "arrays": len(a), "mismatched": bad[:20]}


# --------------------------------------------------------------------------
# The whole soak.
# --------------------------------------------------------------------------


def run(minutes: float = 30.0, legs: Sequence[str] = POLICIES, *, seed: int = 0, gap_s: tuple = GAP_S,
        kinds: Sequence[str] = KINDS, steps: Optional[int] = None, failures: Optional[int] = None,
        window_share: float = WINDOW_SHARE, warmup_steps: int = WARMUP_STEPS, reference: bool = True,
        partial_path: Optional[str] = None, factory=None, log=_print, time_cap: bool = False) -> dict:
    """The soak: per leg a chaos run (sized by `failures`, else by a
    warm-up unless `steps` is given), the failure-free reference of the
    steps it completed, the checks. Returns everything soak.json holds."""
    from tests.fake_gcs import FakeGcs

    t_start = time.monotonic()
    gcs = FakeGcs().start()
    gcs.point_env()
    gcs.make_bucket("soak")
    tag = time.strftime("%Y%m%d-%H%M%S")
    # A smoke run: a fixed, short step count, or fewer faults than a cycle of the order has (some kinds not drawn).
    partial = (steps is not None and failures is None) or (failures is not None
                                                           and failures < len(cycle_of(kinds, random.Random(0))))
    result: dict = {"settings": {
        "legs": list(legs), "failures": failures, "minutes": None if failures is not None else minutes,
        "slices": SLICES, "spares": SPARES, "hosts_per_slice": 1, "health_checks": "default (Ray's own)",
        "gap_s": list(gap_s), "window_share": window_share, "kinds": list(kinds), "seed": seed,
        "checkpoint": f"gs://soak/{tag}-<leg> on fake-gcs-server", "save_every": SAVE_EVERY, "keep": KEEP,
        "diloco_sync_period": DILOCO_PERIOD, "cpus": os.cpu_count(),
        "partial_kinds_ok": partial,
    }, "runs": {}}
    states, references = {}, {}
    try:
        for i, leg in enumerate(legs):
            cluster, tight = _cluster(tight="oom" in kinds)
            try:
                if failures is not None:
                    planned = UNBOUNDED_STEPS
                elif steps is None:
                    w = warmup(cluster, leg, f"gs://soak/{tag}-warmup-{leg}", warmup_steps, factory=factory)
                    planned = steps = round_end(leg, plan_steps(minutes, w["per_step_s"], legs))
                    result["warmup"] = {**w, "planned_steps": steps}
                    log(f"  warm-up: {w['per_step_s'] * 1e3:.1f} ms per step -> {steps} steps per run")
                else:
                    planned = round_end(leg, steps)
                log(f"  chaos, {leg}: " + (f"{failures} faults" if failures is not None else f"{planned} steps")
                    + f", the next {gap_s[0]:g}-{gap_s[1]:g} s after the last has healed")
                r, state = run_chaos(cluster, tight, leg, planned, ckpt_path=f"gs://soak/{tag}-{leg}", seed=seed + i,
                                     gap_s=gap_s, kinds=kinds, failures=failures, window_share=window_share,
                                     factory=factory, log=log,
                                     cap_s=minutes * 60.0 if time_cap and failures is None else None)
            finally:
                cluster.shutdown()
            result["runs"][leg], states[leg] = r, state
            if partial_path:  # kept if a later phase dies
                with open(partial_path, "w") as f:
                    json.dump(result, f, indent=1, default=str)
            log(f"  {leg}: {len(r['failures'])} faults, goodput {r['goodput']:.1%}, {r['steps_completed']} steps, "
                f"leaks {'none' if r['leaks']['none'] else r['leaks']['leaked']}")
            if reference and r["steps_completed"]:
                key = ("diloco" if leg == "diloco" else "plain", r["steps_completed"])
                if key not in references:
                    references[key] = run_reference(leg, r["steps_completed"], factory=factory, log=log)
                info, ref_state = references[key]
                r["reference"] = info
                r["bitwise"] = bitwise(state, ref_state)
    finally:
        gcs.stop()
        shutil.rmtree(gcs.root, ignore_errors=True)
    result["settings"]["wall_s"] = round(time.monotonic() - t_start, 1)
    result["fails"] = checks(result)
    return result

"""What the state checks cost, and how fast they catch a flipped bit:
`python -m bench integrity [--quick] [--runs N] [--steps S]`.

One local cluster of 4 nodes, the example LM (`examples/lm.py`).

1. `overhead`: per model size (`small`, the example's default, and
   `large`: examples/lm.py PRESETS), 2 slices of one host, alternated
   runs with `state_check_every=1` (every step; the default is 10) and 0 (off),
   everything else default. Per run the median step after the warm-up;
   per checked run also the medians of `check_s`, the slowest host's
   seconds fingerprinting its state each step (on the worker's
   fingerprint thread, after the update is done, while the next step's
   gradients compute), and of `check_wait_s`, the longest any host's
   apply waited for that fingerprint: what the check adds to the step's
   path, less noisy than a difference of step times on a shared machine.
2. `cross`: the gradient cross-checks' cost. 3 slices, the small model,
   `grad_check_every=10` (to sample many checks in a short run): the
   excess of a checked step (and of the step before it, not pipelined
   into it) over the median step, per check, and what that is at the
   default `grad_check_every=50`: excess / (50 x median step).
3. `catch`: 3 slices under pause, a `corrupt` fault flipping one bit of
   slice 1's state at step 10 (the worker's real arrays, on one device):
   the step the divergence was found at against the step the fault fired,
   the slice named, the steps rolled back, seconds from the fault to the
   next step on the full mesh, and the final state against a failure-free
   run's (bitwise).
4. `catch_grads`: the same with slice 1 flipping a bit of every gradient
   it sends (or recomputes) from step 7 on (`grads+`), cross-checks every
   3 steps: found by which check, named, rolled back past its last clean
   check, bitwise equal.
5. `straggler`: 2 slices and a hot spare, the small model, slice 1 slowed
   from step 10 by the median step (a `slow` fault: +100% step time),
   600 steps, `straggler_steps` and `straggler_min_s` at their defaults
   (10 steps and 10 s of slow gradient calls): the step it was named at, the step
   the spare took its place, the steps redone, and the run's throughput
   (steps per second from its start to its end) against the same run with
   straggler detection off, which keeps the slow slice all along (the
   slow cluster without a failure).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time

from bench.common import ensure_nodes

WARMUP = 4


def _run(size: str, slices: int, steps: int, every: int, faults=(), keep=False, policy="pause",
         grad_every: int = 0) -> dict:
    import examples.lm as lm
    from ray_elastic import Callback, ElasticConfig, ElasticTrainer

    config = lm.PRESETS[size]
    factory = functools.partial(lm.make_program, config)
    cfg = ElasticConfig(num_slices=slices, policy=policy, state_check_every=every, grad_check_every=grad_every,
                        timeout_s=300.0,
                        step_deadline_floor_s=120.0, first_step_deadline_s=600.0)
    checks: list = []
    waits: list = []

    class Checks(Callback):
        def on_step(self, step, metrics):
            if step > WARMUP and "check_s" in metrics:
                checks.append(metrics["check_s"])
                waits.append(metrics["check_wait_s"])

    trainer = ElasticTrainer(factory, cfg, steps, callbacks=[Checks()], faults=faults, keep_final_state=keep)
    t0 = time.monotonic()
    report = trainer.fit()
    if report.steps_completed != steps:
        raise RuntimeError(f"run ended at {report.steps_completed}/{steps} steps: {report.error}")
    out = {"size": size, "every": every, "wall_s": time.monotonic() - t0,
           "median_step_s": statistics.median(report.step_times[WARMUP:]),
           "median_check_s": statistics.median(checks) if checks else None,
           "median_wait_s": statistics.median(waits) if waits else None,
           "step_times": list(report.step_times),
           "failures": [dataclasses.asdict(f) for f in report.failures],
           "events": [e for e in report.events if e["event"] in ("fault", "diverged", "restore", "recovered")]}
    if keep:
        out["final_state"] = trainer.final_state
    return out


def _straggler(log) -> dict:
    import examples.lm as lm
    from ray_elastic import ElasticConfig, ElasticTrainer, Fault

    factory = functools.partial(lm.make_program, lm.PRESETS["small"])
    base = _run("small", 2, 40, 0)
    slow_ms = max(1, round(base["median_step_s"] * 1000))
    steps, slow_at = 600, 10  # long enough to run on well past the swap (straggler_min_s: 10 s of slow calls)
    out: dict = {"median_step_s": base["median_step_s"], "slow_ms": slow_ms, "slow_from_step": slow_at}
    for name, factor, spares in (("detected", 1.3, 1), ("kept_slow", 0.0, 0)):
        holder: dict = {}

        def spare_up_first(e, holder=holder):
            if e["event"] == "start" and not e["spares"] and holder["spares"]:
                m, deadline = holder["trainer"].members, time.monotonic() + 300
                while 2 not in m.ready and time.monotonic() < deadline:
                    m.poll(block_s=0.5)

        holder["spares"] = spares
        cfg = ElasticConfig(num_slices=2, policy="pause", spare_slices=spares, straggler_factor=factor,
                            timeout_s=300.0, step_deadline_floor_s=120.0, first_step_deadline_s=600.0)
        trainer = holder["trainer"] = ElasticTrainer(factory, cfg, steps, faults=(Fault("slow", 1, slow_at,
                                                                                       ms=slow_ms),),
                                                     on_event=spare_up_first)
        report = trainer.fit()
        ev = {e["event"]: e for e in report.events}
        start_t = ev["start"]["t"]
        times = report.step_times
        row = {"steps_per_s": steps / (ev["end"]["t"] - start_t), "failures": [f.kind for f in report.failures],
               "steps_rewound": [f.steps_rewound for f in report.failures],
               # the last half of the run: after the swap, or the slow slice still in
               "median_step_late_s": statistics.median(times[steps // 2:])}
        if "straggler" in ev:
            row["named_at_step"] = ev["straggler"]["step"]
            row["ratio"] = ev["straggler"]["ratio"]
            row["action"] = ev["straggler"]["action"]
            row["swapped_at_step"] = next((e["step"] for e in report.events if e["event"] == "grow"), None)
        out[name] = row
        log(f"  straggler {name}: {json.dumps(row)}")
    return out


def _same(a, b) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves((a["params"], a["opt_state"])), jax.tree.leaves((b["params"], b["opt_state"]))
    return a["step"] == b["step"] and all(np.array_equal(x, y) for x, y in zip(la, lb))


PARTS = ("small", "large", "cross", "catch", "straggler")


def run(cluster, quick: bool = False, runs: int = None, steps: int = None, log=print, parts=PARTS) -> dict:
    """The suite's `parts` (default all): the overhead of `small`, of
    `large`, the `cross`-checks, the `catch`es, the `straggler`."""
    ensure_nodes(cluster, 4)
    rounds = runs or (2 if quick else 4)
    n = steps or (20 if quick else 40)
    result: dict = {"overhead": [], "rounds": rounds, "steps": n, "warmup_steps": WARMUP}
    t0 = time.monotonic()
    for size in [p for p in ("small", "large") if p in parts]:
        for r in range(rounds):
            for every in (1, 0):
                row = _run(size, 2, n if size == "small" else max(12, n // 2), every)
                row.pop("events"), row.pop("failures"), row.pop("step_times")
                row["round"] = r
                result["overhead"].append(row)
                log(f"  {size} every={every} round {r}: median step {row['median_step_s']:.4f} s, "
                    f"check {row['median_check_s']}, waited {row['median_wait_s']}")
    if "cross" in parts:
        result["cross"] = _cross(log)
    if "catch" in parts:
        result.update(_catch(log))
    if "straggler" in parts:
        result["straggler"] = _straggler(log)
    result["wall_s"] = time.monotonic() - t0
    return result


def _cross(log) -> dict:
    """The gradient cross-checks: the excess of checked steps."""
    every, n_cross = 10, 6 * 10 + 1
    cross = _run("small", 3, n_cross, 0, grad_every=every)
    times = cross["step_times"]
    med = statistics.median(times[WARMUP:])
    # step_times[k] is step k (0-based): checked at k % every == 0, and
    # the step before it is not pipelined into it.
    excess = [times[k] + times[k - 1] - 2 * med for k in range(every, len(times), every)]
    out = {"grad_check_every": every, "checks": len(excess), "median_step_s": med,
           "excess_per_check_s": statistics.median(excess),
           "overhead_at_50_pct": 100.0 * statistics.median(excess) / (50 * med)}
    log(f"  cross: {json.dumps(out)}")
    return out


def _catch(log) -> dict:
    """A bit flipped in a slice's state, and in every gradient it sends."""
    result: dict = {}
    fault_at, steps_c = 10, 24

    from ray_elastic import Fault

    ref = _run("small", 3, steps_c, 1, keep=True)
    hit = _run("small", 3, steps_c, 1, keep=True, faults=(Fault("corrupt", 1, fault_at, target="state"),))
    ev = hit["events"]
    diverged = next(e for e in ev if e["event"] == "diverged")
    fault = next(e for e in ev if e["event"] == "fault")
    recovered = next((e for e in ev if e["event"] == "recovered"), None)
    result["catch"] = {
        "fault_step": fault_at, "found_at_step": diverged["step"], "named": diverged["named"],
        "rolled_back_to": next((e["step"] for e in ev if e["event"] == "restore" and e.get("verified")), None),
        "steps_rewound": [f["steps_rewound"] for f in hit["failures"]],
        "kinds": [f["kind"] for f in hit["failures"]],
        "fault_to_found_s": round(diverged["t"] - fault["t"], 3),
        "recovered_s": recovered["recovered_s"] if recovered else None,
        "bitwise_equal": _same(ref["final_state"], hit["final_state"]),
    }
    log(f"  catch: {json.dumps(result['catch'])}")
    hit = _run("small", 3, steps_c, 1, keep=True, grad_every=3,
               faults=(Fault("corrupt", 1, 7, target="grads+"),))
    ev = hit["events"]
    diverged = next(e for e in ev if e["event"] == "diverged")
    result["catch_grads"] = {
        "fault_step": 7, "grad_check_every": 3, "found_at_step": diverged["step"], "named": diverged["named"],
        "detail": diverged["detail"], "last_clean_step": diverged["verified"],
        "rolled_back_to": next((e["step"] for e in ev if e["event"] == "restore"), None),
        "kinds": [f["kind"] for f in hit["failures"]],
        "bitwise_equal": _same(ref["final_state"], hit["final_state"]),
    }
    log(f"  catch_grads: {json.dumps(result['catch_grads'])}")
    return result


def summary(r: dict) -> dict:
    out = {}
    for size in ("small", "large"):
        rows = [x for x in r["overhead"] if x["size"] == size]
        on = [x["median_step_s"] for x in rows if x["every"] == 1]
        off = [x["median_step_s"] for x in rows if x["every"] == 0]
        checks = [x["median_check_s"] for x in rows if x["median_check_s"] is not None]
        waits = [x["median_wait_s"] for x in rows if x.get("median_wait_s") is not None]
        if on and off:
            m_on, m_off = statistics.median(on), statistics.median(off)
            by_round = {(x["round"], x["every"]): x["median_step_s"] for x in rows}
            pairs = [100.0 * (by_round[r, 1] / by_round[r, 0] - 1) for r in sorted({x["round"] for x in rows})
                     if (r, 1) in by_round and (r, 0) in by_round]
            out[size] = {"median_step_on_s": m_on, "median_step_off_s": m_off,
                         "step_difference_pct": 100.0 * (m_on - m_off) / m_off,
                         "round_differences_pct": pairs,
                         "median_round_difference_pct": statistics.median(pairs) if pairs else None,
                         "median_check_s": statistics.median(checks) if checks else None,
                         "check_pct_of_step": 100.0 * statistics.median(checks) / m_off if checks else None,
                         "median_wait_s": statistics.median(waits) if waits else None,
                         "wait_pct_of_step": 100.0 * statistics.median(waits) / m_off if waits else None}
    return out


def table(r: dict) -> str:
    lines = [] if not summary(r) else [
             f"### State checks: every step against off ({r['rounds']} alternated rounds, medians)", "",
             "| model | median step, checks on (s) | off (s) | difference | per round (median) | "
             "fingerprint, on its thread (s) | apply waited for it (s) | waited / step |",
             "|---|---|---|---|---|---|---|---|"]
    for size, s in summary(r).items():
        wait = "" if s["median_wait_s"] is None else f"{s['median_wait_s']:.5f} | {s['wait_pct_of_step']:.2f}%"
        rounds = ", ".join(f"{d:+.1f}%" for d in s["round_differences_pct"])
        lines.append(f"| {size} | {s['median_step_on_s']:.4f} | {s['median_step_off_s']:.4f} | "
                     f"{s['step_difference_pct']:+.1f}% | {rounds} ({s['median_round_difference_pct']:+.1f}%) | "
                     f"{s['median_check_s']:.5f} | {wait} |")
    x = r.get("cross")
    if x:
        lines += ["", f"### Gradient cross-checks (3 slices, one every {x['grad_check_every']} steps, "
                  f"{x['checks']} checks)", "",
                  "| median step (s) | excess per check (s, the checked step and the one before) | "
                  "overhead at grad_check_every=50 |", "|---|---|---|",
                  f"| {x['median_step_s']:.4f} | {x['excess_per_check_s']:.4f} | {x['overhead_at_50_pct']:.2f}% |"]
    c = r.get("catch")
    if c:
        lines += ["", "### A bit flipped in one slice's state (3 slices, pause)", "",
                  "| fault at step | found at step | named (slice, host) | rolled back to | steps redone | "
                  "fault to found (s) | back on the full mesh (s) | bitwise equal to failure-free |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {c['fault_step']} | {c['found_at_step']} | {c['named']} | {c['rolled_back_to']} | "
                  f"{c['steps_rewound']} | {c['fault_to_found_s']} | {c['recovered_s']} | {c['bitwise_equal']} |"]
    st = r.get("straggler")
    if st:
        d, k = st["detected"], st["kept_slow"]
        lines += ["", f"### A straggler: slice 1 slowed by {st['slow_ms']} ms a step from step "
                  f"{st['slow_from_step']} (median step {st['median_step_s']:.3f} s), 2 slices and a spare", "",
                  "| run | named at step | ratio | action | spare in at step | steps redone | steps per second | "
                  "median step, last half (s) |", "|---|---|---|---|---|---|---|---|",
                  f"| detected (default) | {d.get('named_at_step')} | {d.get('ratio')} | {d.get('action')} | "
                  f"{d.get('swapped_at_step')} | {d['steps_rewound']} | {d['steps_per_s']:.2f} | "
                  f"{d['median_step_late_s']:.4f} |",
                  f"| detection off: the slow slice kept | | | | | | {k['steps_per_s']:.2f} | "
                  f"{k['median_step_late_s']:.4f} |"]
    g = r.get("catch_grads")
    if g:
        lines += ["", "### A slice flipping a bit of every gradient it sends (3 slices, pause, cross-checks every 3 "
                  "steps)", "", "| fault from step | found at step | named (slice, host) | last clean check | "
                  "rolled back to | bitwise equal to failure-free |", "|---|---|---|---|---|---|",
                  f"| {g['fault_step']} | {g['found_at_step']} | {g['named']} | {g['last_clean_step']} | "
                  f"{g['rolled_back_to']} | {g['bitwise_equal']} |"]
    return "\n".join(lines)


def write(r: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "integrity.json"), "md": os.path.join(out_dir, "integrity.md")}
    with open(paths["json"], "w") as f:
        json.dump({**r, "summary": summary(r)}, f, indent=1, default=str)
    with open(paths["md"], "w") as f:
        f.write(table(r) + "\n")
    return paths

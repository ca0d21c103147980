"""Synchronous training against DiLoCo, with and without a slow link
between slices: `python -m bench diloco [--runs N] [--steps S] [--out DIR]`.

The example LM on 2 one-host slices of a local cluster, `--steps`
(default 300) steps: synchronous training (a gradient exchange every
step), DiLoCo with diloco_sync_period 10 and 36 (MaxText's default) and
Streaming DiLoCo with 4 fragments (H 36: one fragment every 9 steps).
Each without and with a simulated 1 Gbit/s link per host (worker/exchange_stats.py,
LINK_ENV: a host waits for the bytes it took in from other slices as if
they had come over that link; every host's waits are reported, summed). Per run: steps per second over the steps after the first 20,
bytes that crossed slices per step (every host's counters, summed), the
final loss and the loss curve; the curves of the first unthrottled runs
go into a PNG. Two more rows, unthrottled, show where the loss gap
comes from: H 10 with the outer step that did best here (lr 1.0, no
momentum), and the same with each replica taking the synchronous run's
whole batch (batch_shards 4: twice its tokens per step, as the DiLoCo
paper's replicas each take the baseline's batch). Two more, unthrottled,
follow the DiLoCo paper's protocol, which starts DiLoCo from a pretrained
model: synchronous training and DiLoCo H 10 (MaxText's outer step), each
`--steps` steps from the params that the first synchronous run reached,
on another data order (seed 1). Medians over `--runs`
runs, alternated on one cluster. Throttled and unthrottled runs of a variant must compute the
same losses, bitwise: the link changes timing only.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import ray

from bench.common import lm_factory, start_cluster
from ray_elastic.worker.exchange_stats import LINK_ENV

# name -> (ElasticConfig fields, whether it also runs over the slow link)
VARIANTS = {
    "synchronous": ({}, True),
    "diloco_h10": ({"enable_diloco": True, "diloco_sync_period": 10}, True),
    "diloco_h36": ({"enable_diloco": True, "diloco_sync_period": 36}, True),
    "streaming_h36_f4": ({"enable_diloco": True, "diloco_sync_period": 36, "enable_streaming_diloco": True,
                          "num_diloco_fragments": 4}, True),
    "diloco_h10_lr1_m0": ({"enable_diloco": True, "diloco_sync_period": 10, "diloco_outer_lr": 1.0,
                           "diloco_outer_momentum": 0.0}, False),
    "diloco_h10_lr1_m0_whole_batch": ({"enable_diloco": True, "diloco_sync_period": 10, "diloco_outer_lr": 1.0,
                                       "diloco_outer_momentum": 0.0, "batch_shards": 4}, False),
}
# name -> ElasticConfig fields of the runs from a pretrained start (unthrottled)
PRETRAINED = {
    "synchronous_pretrained": {"seed": 1},
    "diloco_h10_pretrained": {"seed": 1, "enable_diloco": True, "diloco_sync_period": 10},
}
LINK_GBITS = 1.0
SKIP = 20
# The overlap in time (`--variants overlap`): Streaming DiLoCo H 36, 4
# fragments, synchronized between two inner steps (V 0) or beside the next
# 5 (V 5), each unthrottled and behind a link slow enough (20 Mbit/s per
# host) that a fragment's exchange takes a few inner steps' time.
STREAMING = VARIANTS["streaming_h36_f4"][0]
OVERLAP = {"streaming_h36_f4_v0": {**STREAMING, "num_communication_overlapping_steps": 0},
           "streaming_h36_f4_v5": {**STREAMING, "num_communication_overlapping_steps": 5}}
OVERLAP_GBITS = 0.02


def _one(factory, steps: int, fields: dict, keep_final_state: bool = False) -> dict:
    from ray_elastic import ElasticConfig, ElasticTrainer
    from ray_elastic.callbacks import Callback

    config = ElasticConfig(num_slices=2, **fields)
    seen: dict = {}

    class Watch(Callback):
        def on_step(self, step, metrics):
            if step == SKIP:
                seen["from"] = time.perf_counter()

        def on_event(self, event):
            if event["event"] == "end" and trainer.members is not None:  # the workers still up
                t = trainer.members.backend
                seen["to"] = time.perf_counter()
                seen["stats"] = ray.get([w.exchange_stats.remote() for s in sorted(trainer.members.live)
                                         for w in t.workers(s)], timeout=60)

    trainer = ElasticTrainer(factory, config, steps, callbacks=[Watch()], keep_final_state=keep_final_state)
    report = trainer.fit()
    crossed = sum(st["bytes_from_other_slices"] for st in seen["stats"])
    out = {"steps_per_s": round((steps - SKIP) / (seen["to"] - seen["from"]), 3),
           "bytes_per_step": round(crossed / steps), "final_loss": report.losses[-1],
           "link_wait_s": round(sum(st["link_wait_s"] for st in seen["stats"]), 3),
           "losses": list(report.losses), "failures": len(report.failures)}
    if keep_final_state:
        out["params"] = trainer.final_params()
    return out


def plain_loops(steps: int) -> dict:
    """Final losses of plain single-process JAX loops (tests/diloco_reference.py),
    for where DiLoCo's gap comes from: the synchronous run's math (one
    replica, both shards), one replica on one shard (a DiLoCo replica's
    half of the batch, alone), and 2 replicas averaged every step."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.diloco_reference import diloco_reference

    program = lm_factory()()
    loops = {"both shards, one replica (synchronous)": dict(shards=2, replicas=1),
             "one shard, one replica (half the batch)": dict(shards=1, replicas=1),
             "2 replicas averaged every step (H 1)": dict(shards=2, replicas=2, period=1)}
    out = {}
    for name, kw in loops.items():
        _, losses = diloco_reference(program, seed=0, steps=steps, period=kw.pop("period", 10 ** 9), outer_lr=1.0,
                                     outer_momentum=0.0, **kw)
        out[name] = losses[-1]
    return out


def run(runs: int = 3, steps: int = 300, out: str = "reports/bench") -> dict:
    from bench.charts import curves_png

    import examples.lm as lm

    factory = lm_factory()
    rows: dict = {}
    pretrained = None  # the first synchronous run's final params
    cluster = start_cluster(2)
    try:
        for _ in range(runs):  # alternated, so every cell shares the machine's load alike
            for name, (fields, throttled) in VARIANTS.items():
                for link in ("none", f"{LINK_GBITS:g}gbit")[:2 if throttled else 1]:
                    if link == "none":
                        os.environ.pop(LINK_ENV, None)
                    else:  # the driver's setting reaches the run's workers (cluster/slice_group.py)
                        os.environ[LINK_ENV] = str(LINK_GBITS)
                    try:
                        keep = pretrained is None and name == "synchronous" and link == "none"
                        r = _one(factory, steps, fields, keep_final_state=keep)
                        pretrained = r.pop("params", pretrained)
                        rows.setdefault((name, link), []).append(r)
                    finally:
                        os.environ.pop(LINK_ENV, None)
            from_pretrained = functools.partial(lm.make_program, lm.LMConfig(), pretrained=pretrained)
            for name, fields in PRETRAINED.items():
                rows.setdefault((name, "none"), []).append(_one(from_pretrained, steps, fields))
    finally:
        cluster.shutdown()
    out_rows = {}
    for (name, link), rs in rows.items():
        out_rows.setdefault(name, {})[link] = {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
            "bytes_per_step": statistics.median(r["bytes_per_step"] for r in rs),
            "final_loss": rs[0]["final_loss"], "failures": sum(r["failures"] for r in rs),
            "same_losses": all(r["losses"] == rows[(name, "none")][0]["losses"] for r in rs),
            "link_wait_s": [r["link_wait_s"] for r in rs],
            "runs": [{k: v for k, v in r.items() if k != "losses"} for r in rs]}
    os.makedirs(out, exist_ok=True)
    png = curves_png({name: rows[(name, "none")][0]["losses"] for name in VARIANTS}, os.path.join(out, "diloco_loss.png"),
                     f"example LM, 2 slices, {steps} steps: synchronous vs DiLoCo")
    png_pretrained = curves_png({name: rows[(name, "none")][0]["losses"] for name in PRETRAINED},
                                os.path.join(out, "diloco_loss_pretrained.png"),
                                f"example LM, 2 slices, {steps} steps from {steps} synchronous ones")
    return {"steps": steps, "runs": runs, "link_gbits": LINK_GBITS, "rows": out_rows, "png": png,
            "png_pretrained": png_pretrained, "plain_loops": plain_loops(steps)}


def table(result: dict) -> str:
    link = f"{result['link_gbits']:g}gbit"
    sync = result["rows"]["synchronous"]
    lines = [f"example LM, 2 one-host slices, {result['steps']} steps, medians of {result['runs']} runs "
             f"(steps per second over steps {SKIP + 1}..{result['steps']})", "",
             f"| variant | steps/s | steps/s at {result['link_gbits']:g} Gbit/s | kept | bytes across slices per step "
             "| cut vs synchronous | final loss | vs synchronous | same losses throttled |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        if name in PRETRAINED:
            continue
        free, slow = r["none"], r.get(link)
        cut = sync["none"]["bytes_per_step"] / max(free["bytes_per_step"], 1)
        throttled = (f"{slow['steps_per_s']:.2f} | {slow['steps_per_s'] / free['steps_per_s']:.1%}" if slow
                     else "- | -")
        lines.append(f"| {name} | {free['steps_per_s']:.2f} | {throttled} | {free['bytes_per_step']:,.0f} | {cut:.1f}x | "
                     f"{free['final_loss']:.4f} | {free['final_loss'] / sync['none']['final_loss'] - 1:+.1%} | "
                     f"{slow['same_losses'] if slow else '-'} |")
    lines.append(f"\nloss curves: {result['png']}")
    pre = {name: result["rows"][name]["none"] for name in PRETRAINED if name in result["rows"]}
    if pre:
        base = pre["synchronous_pretrained"]["final_loss"]
        lines += ["", f"from a pretrained start (the first synchronous run's params), {result['steps']} more steps, "
                  "data order of seed 1:", "", "| variant | steps/s | final loss | vs synchronous |", "|---|---|---|---|"]
        lines += [f"| {name} | {r['steps_per_s']:.2f} | {r['final_loss']:.4f} | {r['final_loss'] / base - 1:+.1%} |"
                  for name, r in pre.items()]
        lines.append(f"\nloss curves: {result['png_pretrained']}")
    lines += ["", f"plain JAX loops, {result['steps']} steps (outer lr 1.0, no momentum): final loss", ""]
    lines += [f"- {name}: {loss:.4f}" for name, loss in result.get("plain_loops", {}).items()]
    return "\n".join(lines)


def run_overlap(runs: int = 3, steps: int = 300) -> dict:
    """Streaming DiLoCo with V 0 against V 5, each unthrottled and behind
    OVERLAP_GBITS: medians over `runs` alternated rounds on one cluster."""
    factory = lm_factory()
    rows: dict = {}
    cluster = start_cluster(2)
    try:
        for _ in range(runs):
            for name, fields in OVERLAP.items():
                for gbits in (None, OVERLAP_GBITS):
                    if gbits:
                        os.environ[LINK_ENV] = str(gbits)
                    try:
                        rows.setdefault((name, gbits), []).append(_one(factory, steps, fields))
                    finally:
                        os.environ.pop(LINK_ENV, None)
    finally:
        cluster.shutdown()
    out = {}
    for (name, gbits), rs in rows.items():
        out.setdefault(name, {})["none" if gbits is None else f"{gbits:g}gbit"] = {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
            "link_wait_s": statistics.median(r["link_wait_s"] for r in rs),
            "final_loss": rs[0]["final_loss"], "failures": sum(r["failures"] for r in rs),
            "same_losses": all(r["losses"] == rows[(name, None)][0]["losses"] for r in rs),
            "runs": [{k: v for k, v in r.items() if k != "losses"} for r in rs]}
    return {"steps": steps, "runs": runs, "link_gbits": OVERLAP_GBITS, "rows": out}


def overlap_table(result: dict) -> str:
    link = f"{result['link_gbits']:g}gbit"
    lines = [f"Streaming DiLoCo H 36, 4 fragments, 2 one-host slices, {result['steps']} steps, medians of "
             f"{result['runs']} runs (steps per second over steps {SKIP + 1}..{result['steps']})", "",
             f"| V | steps/s | steps/s at {result['link_gbits'] * 1000:g} Mbit/s | kept | link wait, all hosts (s) "
             "| final loss | same losses throttled |", "|---|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        free, slow = r["none"], r[link]
        lines.append(f"| {name.rsplit('_v', 1)[1]} | {free['steps_per_s']:.2f} | {slow['steps_per_s']:.2f} | "
                     f"{slow['steps_per_s'] / free['steps_per_s']:.1%} | {slow['link_wait_s']:.2f} | "
                     f"{free['final_loss']:.4f} | {slow['same_losses']} |")
    return "\n".join(lines)

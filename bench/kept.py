"""A driver's next run on new workers against one on the slices its last
run kept (`ElasticConfig.keep_workers`): `python -m bench kept [--runs N]
[--steps S] [--out DIR]`.

The example LM on 2 one-host slices of a local cluster, alternated round
by round so all share the machine's load: `new`, after
`release_workers()` (new worker processes, from the warm pool's idle ones
where there are: what a run on Ray's and ray_elastic's defaults gets), then
`kept`, on the slices the `new` run kept, then `reprogrammed`: another
program (here the seed: the same model, so the same work to build and
compile) in the processes `kept` kept (`SliceWorker.reprogram`). Per run:
seconds from `fit` to every slice ready (the `start` event), the whole
`fit`, and whether its final state equals bitwise (it must) that of a run
of its program on new workers (the first `new` run's; for `reprogrammed`,
one made before the rounds).
"""

from __future__ import annotations

import statistics
import time

from bench.common import lm_factory

VARIANTS = ("new", "kept", "reprogrammed")
SEEDS = {"new": 0, "kept": 0, "reprogrammed": 1}


def _one(factory, steps: int, seed: int = 0) -> dict:
    import jax
    import numpy as np

    from ray_elastic import ElasticConfig, ElasticTrainer

    t0 = time.perf_counter()
    events: list = []
    trainer = ElasticTrainer(factory, ElasticConfig(num_slices=2, policy="pause", keep_workers=True, seed=seed), steps,
                             keep_final_state=True, on_event=lambda e: events.append((time.perf_counter() - t0, e)))
    report = trainer.fit()
    fit_s = time.perf_counter() - t0
    ready_s = next(t for t, e in events if e["event"] == "start")
    kept = [("kept_process" in e.get("phases", {})) for _, e in events if e["event"] == "slice_ready"]
    leaves = [np.asarray(x) for x in jax.tree.leaves((trainer.final_state["params"], trainer.final_state["opt_state"]))]
    return {"ready_s": round(ready_s, 3), "fit_s": round(fit_s, 3), "kept_slices": sum(kept),
            "steps": report.steps_completed, "failures": len(report.failures), "leaves": leaves}


def run(runs: int = 5, steps: int = 12) -> dict:
    from ray_elastic import release_workers

    factory = lm_factory()
    rows: dict = {v: [] for v in VARIANTS}
    release_workers()
    reference = {SEEDS["reprogrammed"]: _one(factory, steps, SEEDS["reprogrammed"])["leaves"]}  # new workers
    for _ in range(runs):
        release_workers()
        for variant in VARIANTS:
            seed = SEEDS[variant]
            r = _one(factory, steps, seed)
            leaves = r.pop("leaves")
            ref = reference.setdefault(seed, leaves)
            r["bitwise_equal"] = len(leaves) == len(ref) and all((a == b).all() for a, b in zip(leaves, ref))
            rows[variant].append(r)
    release_workers()
    out = {"runs": runs, "steps": steps, "rows": rows, "medians": {}}
    for variant, rs in rows.items():
        out["medians"][variant] = {k: round(statistics.median(r[k] for r in rs), 3) for k in ("ready_s", "fit_s")}
        out["medians"][variant]["kept_slices"] = min(r["kept_slices"] for r in rs)
        out["medians"][variant]["all_bitwise_equal"] = all(r["bitwise_equal"] for r in rs)
        out["medians"][variant]["failures"] = sum(r["failures"] for r in rs)
    return out


def table(result: dict) -> str:
    lines = [f"example LM, 2 slices x 1 CPU host, {result['steps']} steps, medians of {result['runs']} alternated runs",
             "", "| run on | slices ready s | whole fit s | slices kept (min) | failures | bitwise equal |",
             "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        m = result["medians"][variant]
        lines.append(f"| {variant} workers | {m['ready_s']} | {m['fit_s']} | {m['kept_slices']} | {m['failures']} | "
                     f"{'yes' if m['all_bitwise_equal'] else 'NO'} |")
    return "\n".join(lines)

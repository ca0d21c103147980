"""The step contract's cost: `python -m bench contract [--quick] [--runs N] [--steps N]`.

One local cluster, 2 slices x 1 host (a 1-CPU node each), policy resize,
no faults, the example LM (`examples/lm.py`, `LMConfig()`, replicated).

1. **Contract overhead**: today's contract (`lm.make_program`: `loss_fn(params,
   batch)` -> the shard's mean loss) against the new one on the same model,
   optimizer and data (`make_context_program`: `loss_fn(params, batch, ctx)`
   -> `LossOutput(total=summed per-token cross-entropy, weight=target tokens,
   aux={"accuracy": per-token accuracy})`, accuracy reduced as
   `weighted_mean`). The two alternate run by run (today, new, today, new,
   ...), `runs` pairs; each run's figure is its median step time after the
   first 10 steps (`steady_step_time`). Target: the new contract within +2%
   of today's (median of the per-pair ratios).
2. **Microbatches**: the same 64 rows per step on 2 slices, as 8 shards of
   8 rows (`batch_shards=8`: each slice computes 4 shards) or as 2 shards
   of 32 rows scanned in 4 microbatches (`batch_shards=2`,
   `microbatches=4`: each slice computes one gradient). Under the default
   exchange (reduce_scatter) a slice sums its own shards before anything
   crosses, so at 2 slices a host takes in 2 gradients per apply (its
   slice's sum and the other's) in both variants; the direct hand-off
   (`exchange="direct"`) would take in every shard's gradient (8 and 2).
   Per variant: the gradient bytes each host takes in per apply (the
   workers' `exchange_stats`: (bytes from other slices + own bytes) /
   applies), each worker process's peak private (RssAnon) and shared
   (RssShmem: the object store's pages) memory, sampled every 20 ms from the
   end of step 1 (`bench/memory.py`), and the median step time. The two
   variants train on different rows (another shard split), so their losses
   differ: the final loss of each is reported, not compared.

The new contract's loss is pickled by reference (`bench.contract`): the
workers import it from the driver's working directory, which Ray puts on
their path (run `python -m bench` from the repository's root).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from typing import Any

from bench.common import ensure_nodes, steady_step_time, summary
from bench.memory import PeakSampler, status
from ray_elastic.config import ElasticConfig
from ray_elastic.program import LossOutput

SLICES = 2
SKIP = 10  # warm-up steps left out of every step-time figure
TARGET = 0.02  # the new contract's step time: at most +2% over today's
GLOBAL_ROWS = 64
LOSS_RTOL = 1e-4
MB = 1024 * 1024
# Microbatch variants: (rows per shard, shards per step, microbatches).
MICRO = {
    "8 shards x 8 rows": (8, 8, 1),
    "2 shards x 32 rows, 4 microbatches": (32, 2, 4),
}
CONTRACTS = ("today", "context")
AUX = {"accuracy": "weighted_mean"}


# --------------------------------------------------------------------------
# The new contract on the example LM (module-level: the factory pickles).
# --------------------------------------------------------------------------


def _model(config) -> Any:
    """The LM of `config`, as `lm.make_program` builds it."""
    import examples.lm as lm

    return lm.LMModel(vocab_size=config.vocab_size, seq_len=config.seq_len, d_model=config.d_model,
                      num_layers=config.num_layers, num_heads=config.num_heads, mlp_dim=config.mlp_dim)


def context_loss(config, params: Any, batch: Any, ctx: Any) -> LossOutput:
    """The example LM's loss in the new contract: the shard's summed
    next-token cross-entropy over its target tokens, with its per-token
    accuracy. Over the global batch, sum(total) / sum(weight) is today's
    mean loss (every shard has the same number of tokens)."""
    import jax.numpy as jnp
    import optax

    tokens = jnp.asarray(batch["tokens"], dtype=jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = _model(config).apply({"params": params}, inputs).astype(jnp.float32)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weight = jnp.float32(targets.size)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return LossOutput(total=jnp.sum(xent), weight=weight, aux={"accuracy": jnp.sum(correct) / weight})


def make_context_program(config, microbatches: int = 1) -> Any:
    """The example LM with `context_loss`: the same init, optimizer and
    batches as `lm.make_program(config)`."""
    import examples.lm as lm
    from ray_elastic.program import TrainProgram

    return TrainProgram(
        init_params=functools.partial(lm.init_params, config),
        loss_fn=functools.partial(context_loss, config),
        optimizer=lm.make_optimizer(config),
        make_batch=lm.make_program(config).make_batch,
        aux=AUX,
        microbatches=microbatches,
    )


def factory(contract: str, config=None) -> Any:
    import examples.lm as lm

    config = config or lm.LMConfig()
    if contract == "today":
        return functools.partial(lm.make_program, config)
    if contract == "context":
        return functools.partial(make_context_program, config)
    raise ValueError(f"contract: one of {CONTRACTS}, got {contract!r}")


def micro_factory(rows: int, microbatches: int) -> Any:
    import examples.lm as lm

    return functools.partial(lm.make_program, dataclasses.replace(lm.LMConfig(), shard_batch_size=rows),
                             lm.Layout(), None, microbatches)


def grad_bytes() -> int:
    """Bytes of one gradient of the example LM (float32, like its params)."""
    import jax
    import numpy as np

    import examples.lm as lm

    abstract = jax.eval_shape(functools.partial(lm.init_params, lm.LMConfig()), jax.random.PRNGKey(0))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(abstract))


# --------------------------------------------------------------------------
# Runs.
# --------------------------------------------------------------------------


def _probe(steps: int, seen: dict):
    """A callback that samples the workers' memory from the end of step 1
    and reads their pids and exchange counters at the last step (before
    teardown)."""
    import ray

    from ray_elastic import Callback

    class Probe(Callback):
        def on_start(self, trainer):
            self.trainer = trainer

        def on_step(self, step, metrics):
            t = self.trainer
            if "sampler" not in seen and (step == 1 or step == steps):
                seen["sampler"] = PeakSampler(
                    lambda: [i["pid"] for s in sorted(t.members.live) for i in t.hosts(s)]).start()
            if step != steps:
                return
            peaks = seen["sampler"].stop()
            for s in sorted(t.members.live):
                for h, info in enumerate(t.hosts(s)):
                    seen.setdefault("workers", []).append({"slice": s, "host": h, "pid": info["pid"],
                                                           **status(info["pid"]), **peaks.get(info["pid"], {})})
                stats = ray.get([w.exchange_stats.remote() for w in t.members.backend.workers(s)], timeout=60)
                for h, st in enumerate(stats):
                    seen.setdefault("exchange", []).append({"slice": s, "host": h, **st})

    return Probe()


def fit(cluster, program_factory, steps: int, batch_shards=None, probe: bool = False) -> dict:
    """One failure-free run on 2 slices x 1 host, policy resize."""
    from ray_elastic import ElasticConfig, ElasticTrainer

    ensure_nodes(cluster, SLICES)
    seen: dict = {}
    cfg = ElasticConfig(num_slices=SLICES, policy="resize", batch_shards=batch_shards)
    trainer = ElasticTrainer(program_factory, cfg, steps, callbacks=[_probe(steps, seen)] if probe else [])
    t0 = time.monotonic()
    report = trainer.fit()
    wall = time.monotonic() - t0
    if report.steps_completed != steps or report.failures:
        raise RuntimeError(f"{report.steps_completed}/{steps} steps, failures {report.failures} {report.error}")
    if probe and len(seen.get("workers", ())) != SLICES:
        raise RuntimeError(f"worker memory not read ({seen.get('workers')})")
    last = report.metrics_per_step[-1] if report.metrics_per_step else {}
    return {
        "steps": steps,
        "wall_s": wall,
        "step_time_s": steady_step_time(report, skip_first=SKIP),
        "step_times": list(report.step_times),
        "slices_per_step": list(report.slices_per_step),
        "losses": list(report.losses),
        "final_loss": report.losses[-1],
        "final_metrics": {k: v for k, v in last.items() if isinstance(v, (int, float))},
        "workers": seen.get("workers", []),
        "exchange": seen.get("exchange", []),
    }


def _retry(fn, what: str, retries: list, log) -> dict:
    """Once more if a run fails (a first step that misses its deadline on
    a loaded machine, say); the failure is kept in the result."""
    for attempt in range(2):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            if attempt:
                raise
            log(f"  {what}: failed ({str(e)[-300:]}); again")
            retries.append({"run": what, "error": str(e)[-2000:]})


def _log(msg: str) -> None:
    print(msg, flush=True)


def run(cluster, quick: bool = False, runs: int = None, steps: int = None, log=_log, partial_path: str = "") -> dict:
    runs = runs or (2 if quick else 5)
    steps = steps or (40 if quick else 120)
    if steps < SKIP + 2:
        raise ValueError(f"steps: at least {SKIP + 2} (the first {SKIP} are warm-up), got {steps}")
    rounds = 1 if quick or runs < 2 else 2  # microbatch variants, alternated
    t0 = time.monotonic()
    retries: list = []
    contract_runs: dict = {c: [] for c in CONTRACTS}
    micro_runs: dict = {v: [] for v in MICRO}

    def save():
        if partial_path:
            with open(partial_path, "w") as f:
                json.dump({"contract": contract_runs, "micro": micro_runs, "retries": retries}, f)

    log(f"contract overhead: {runs} pairs of {steps} steps, today / new contract alternated")
    for i in range(runs):
        for c in CONTRACTS:
            r = _retry(lambda c=c: fit(cluster, factory(c), steps), f"{c} run {i}", retries, log)
            contract_runs[c].append(r)
            save()
        a, b = contract_runs["today"][-1]["step_time_s"], contract_runs["context"][-1]["step_time_s"]
        log(f"  pair {i}: today {a * 1e3:.1f} ms/step, new contract {b * 1e3:.1f} ms/step, ratio {b / a:.3f}")

    log(f"microbatches: {GLOBAL_ROWS} rows per step, {rounds} round(s) of {steps} steps per variant")
    for i in range(rounds):
        for name, (rows, shards, k) in MICRO.items():
            r = _retry(lambda rows=rows, shards=shards, k=k: fit(cluster, micro_factory(rows, k), steps,
                                                                   batch_shards=shards, probe=True),
                       f"{name} round {i}", retries, log)
            micro_runs[name].append(r)
            save()
            log(f"  {name}, round {i}: {r['step_time_s'] * 1e3:.1f} ms/step, final loss {r['final_loss']:.4f}")
    result = summarize(contract_runs, micro_runs, grad_bytes(), runs, steps, rounds, time.monotonic() - t0)
    result["retries"] = retries
    return result


# --------------------------------------------------------------------------
# Figures.
# --------------------------------------------------------------------------


def _rel_diff(a: list, b: list) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12))) if a.size and a.shape == b.shape else float("nan")


def summarize(contract_runs: dict, micro_runs: dict, grad_b: int, runs: int, steps: int, rounds: int,
              wall: float) -> dict:
    today = [r["step_time_s"] for r in contract_runs["today"]]
    context = [r["step_time_s"] for r in contract_runs["context"]]
    ratios = [b / a for a, b in zip(today, context)]
    med_ratio = statistics.median(ratios)
    contract = {
        "today_s": summary(today),
        "context_s": summary(context),
        "pairs": [{"pair": i, "today_s": a, "context_s": b, "ratio": b / a}
                  for i, (a, b) in enumerate(zip(today, context))],
        "median_ratio": med_ratio,
        "ratio_of_medians": summary(context)["median"] / summary(today)["median"],
        "target_ratio": 1 + TARGET,
        "met": med_ratio <= 1 + TARGET,
        # Same model, data and optimizer: the losses should agree to
        # float32 rounding (a sanity check that the two train the same thing).
        "loss_max_rel_diff": max(_rel_diff(b["losses"], a["losses"])
                                 for a, b in zip(contract_runs["today"], contract_runs["context"])),
        "final_loss": {c: contract_runs[c][0]["final_loss"] for c in CONTRACTS},
        "final_accuracy": contract_runs["context"][0]["final_metrics"].get("accuracy"),
    }
    micro = {}
    for name, rs in micro_runs.items():
        rows, shards, k = MICRO[name]
        hosts = []
        for e in rs[0]["exchange"]:  # the counters of the first round (the others are the same)
            n = max(e["applies"], 1)
            taken = (e["bytes_from_other_slices"] + e["own_bytes"]) / n
            hosts.append({"slice": e["slice"], "host": e["host"], "applies": e["applies"],
                          "bytes_in_per_apply": taken, "from_other_slices_per_apply": e["bytes_from_other_slices"] / n,
                          "own_per_apply": e["own_bytes"] / n, "gradients_per_apply": taken / grad_b})
        workers = []  # per (slice, host): the largest peak over the rounds (each round's are new processes)
        by_place: dict = {}
        for r in rs:
            for w in r["workers"]:
                by_place.setdefault((w["slice"], w["host"]), []).append(w)
        for (s, h), ws in sorted(by_place.items()):
            workers.append({"slice": s, "host": h, "pids": [w["pid"] for w in ws],
                            "peak_RssAnon": max(w.get("peak_RssAnon", 0) for w in ws),
                            "peak_RssShmem": max(w.get("peak_RssShmem", 0) for w in ws),
                            "peak_VmRSS": max(w.get("peak_VmRSS", 0) for w in ws),
                            "VmHWM": max(w.get("VmHWM", 0) for w in ws),
                            "samples": sum(w.get("samples", 0) for w in ws)})
        times = [r["step_time_s"] for r in rs]
        micro[name] = {
            "rows_per_shard": rows, "batch_shards": shards, "microbatches": k,
            "gradients_computed_per_slice": shards // SLICES,
            "step_time_s": summary(times),
            "exchange": hosts,
            "bytes_in_per_apply": statistics.median(x["bytes_in_per_apply"] for x in hosts),
            "gradients_per_apply": statistics.median(x["gradients_per_apply"] for x in hosts),
            "workers": workers,
            "peak_private_max": max(w["peak_RssAnon"] for w in workers),
            "peak_shared_max": max(w["peak_RssShmem"] for w in workers),
            "final_loss": [r["final_loss"] for r in rs],
        }
    names = list(MICRO)
    a, b = micro_runs[names[0]][0], micro_runs[names[1]][0]
    micro_info = {"losses_agree_rtol": LOSS_RTOL, "losses_agree": _rel_diff(b["losses"], a["losses"]) <= LOSS_RTOL,
                  "loss_max_rel_diff": _rel_diff(b["losses"], a["losses"]),
                  "note": "different shard splits of different rows: the losses are not expected to agree"}
    return {
        "settings": {"slices": SLICES, "hosts_per_slice": 1, "policy": "resize", "runs": runs, "steps": steps,
                     "warmup_skipped": SKIP, "micro_rounds": rounds, "global_rows": GLOBAL_ROWS,
                     "grad_bytes": grad_b, "exchange": ElasticConfig().exchange,
                     "order": "today, context alternated run by run"},
        "contract": contract,
        "micro": micro,
        "micro_losses": micro_info,
        "runs": {"contract": contract_runs, "micro": micro_runs},
        "wall_s": wall,
    }


def _mb(b, digits: int = 1) -> str:
    return f"{b / MB:.{digits}f}"


def table(r: dict) -> str:
    c, st = r["contract"], r["settings"]
    lines = [f"Contract overhead: example LM (`LMConfig()`, replicated), {st['slices']} slices x 1 host, resize, "
             f"{st['steps']} steps per run, median step time after the first {st['warmup_skipped']} steps, "
             "today / new contract alternated run by run.", "",
             "| pair | today: loss_fn(params, batch) (ms) | new: loss_fn(params, batch, ctx) -> LossOutput (ms) | "
             "new / today |", "|---|---|---|---|"]
    for p in c["pairs"]:
        lines.append(f"| {p['pair']} | {p['today_s'] * 1e3:.2f} | {p['context_s'] * 1e3:.2f} | {p['ratio']:.3f} |")
    lines.append(f"| median | {c['today_s']['median'] * 1e3:.2f} | {c['context_s']['median'] * 1e3:.2f} | "
                 f"{c['median_ratio']:.3f} |")
    lines += ["", f"Median ratio {(c['median_ratio'] - 1) * 100:+.1f}% (ratio of medians "
                  f"{(c['ratio_of_medians'] - 1) * 100:+.1f}%); target ≤ +{TARGET * 100:.0f}%: "
                  f"{'met' if c['met'] else 'NOT met'}. Losses of the two, step by step: largest relative "
                  f"difference {c['loss_max_rel_diff']:.1e} (final {c['final_loss']['today']:.4f} / "
                  f"{c['final_loss']['context']:.4f}; final accuracy {c['final_accuracy'] if c['final_accuracy'] is not None else float('nan'):.3f}).", ""]
    g = st["grad_bytes"]
    lines += [f"Microbatches: {st['global_rows']} rows per step on {st['slices']} slices, "
              f"{st['micro_rounds']} round(s) of {st['steps']} steps per variant; one gradient is {_mb(g, 2)} MiB "
              f"({g} bytes). Gradient bytes a host takes in per apply (exchange_stats: from other slices + its own), "
              "peak memory per worker process sampled every 20 ms after step 1 (MiB, largest of the workers):", "",
              "| variant | batch_shards | microbatches | gradients computed per slice | taken in per apply per host "
              "(MiB) | = gradients | peak private (RssAnon) | peak shared (RssShmem) | median step (ms) | "
              "final loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in r["micro"].items():
        lines.append(f"| {name} | {m['batch_shards']} | {m['microbatches']} | {m['gradients_computed_per_slice']} | "
                     f"{_mb(m['bytes_in_per_apply'], 2)} | {m['gradients_per_apply']:.2f} | "
                     f"{_mb(m['peak_private_max'])} | {_mb(m['peak_shared_max'])} | "
                     f"{m['step_time_s']['median'] * 1e3:.1f} | "
                     f"{' / '.join(f'{x:.4f}' for x in m['final_loss'])} |")
    lines += ["", "Per worker (MiB):", "", "| variant | slice | taken in per apply: from other slices + own | "
              "peak private (RssAnon) | peak shared (RssShmem) |", "|---|---|---|---|---|"]
    for name, m in r["micro"].items():
        ex = {(e["slice"], e["host"]): e for e in m["exchange"]}
        for w in m["workers"]:
            e = ex.get((w["slice"], w["host"]))
            taken = f"{_mb(e['from_other_slices_per_apply'], 2)} + {_mb(e['own_per_apply'], 2)}" if e else "–"
            lines.append(f"| {name} | {w['slice']} | {taken} | {_mb(w['peak_RssAnon'])} | {_mb(w['peak_RssShmem'])} |")
    ml = r["micro_losses"]
    lines += ["", f"Losses of the two variants agree to rtol {ml['losses_agree_rtol']:g}: "
                  f"{'yes' if ml['losses_agree'] else 'no'} (largest relative difference {ml['loss_max_rel_diff']:.2e}; "
                  "information only: different shard splits of different rows)."]
    return "\n".join(lines)


def write(result: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    files = {"json": os.path.join(out_dir, "contract.json"), "md": os.path.join(out_dir, "contract.md")}
    with open(files["json"], "w") as f:
        json.dump(result, f, indent=1)
    with open(files["md"], "w") as f:
        f.write(table(result) + "\n")
    return files

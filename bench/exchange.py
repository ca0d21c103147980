"""python -m bench exchange: the cross-slice exchange, the direct hand-off
(`exchange="direct"`) against the reduce-scatter and all-gather (the
default), alternated run by run, at 2, 4 and 8 slices of one host (one
1-CPU node each) and 1 and 4 shards per slice; and the same at 2 slices
with bfloat16 on the wire, against float32, with its effect on the loss.
`--big`: the size ladder's 2 GB state on 2 slices, direct against the
reduce-scatter (bench/sizes.py's model and cluster).

The example LM at seq_len 8, d_model 256, 4 layers (about 13 MB of float32
gradient): small, so that 8 workers fit this machine's 2 cores; the bytes
are counted exactly, the times are a 2-core machine's.

Figures per run, over the steps after `SKIP` (the workers' counters read
at both ends, worker/exchange_stats.py):
- bytes a host took in per step from other slices (median and max over
  hosts), against the ring bound 2(n-1)/n x the gradient's bytes;
- seconds a host spent per step in the exchange (`exchange_s`: cutting,
  summing, laying out; waiting for and fetching inputs, `inputs_s`, apart:
  it is mostly waiting for the other slices' gradients);
- median and mean step, and the peak resident memory of a worker;
- what ran inside the exchange's windows (worker/overlap.py): a host's
  window per step (its gradients ready to the summed gradient laid out),
  the share of it covered by the next step's batch read and by snapshot
  views, and the share of each of those that the window hid. Two more runs
  at 2 slices take a snapshot every step (`snapshot_every_replicated=1`),
  so the snapshot's side is measured too.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.memory import PeakSampler  # noqa: E402 (after the path)

SKIP = 3
SLICES = (2, 4, 8)
PER_SLICE = (1, 4)


def small():
    import examples.lm as lm

    return lm.LMConfig(seq_len=8, d_model=256, num_layers=4, num_heads=4, mlp_dim=1024, shard_batch_size=8)


def grad_bytes(config) -> int:
    import jax

    import examples.lm as lm
    from ray_elastic.control.memory_plan import tree_bytes

    return tree_bytes(jax.eval_shape(lm.make_program(config).init_params, jax.random.PRNGKey(0)))


OVERLAP = ("exchange_window_s", "compute_s", "batch_s", "snapshot_s", "compute_in_exchange_s", "batch_in_exchange_s",
           "snapshot_in_exchange_s")


def one_run(config, slices: int, per_slice: int, exchange: str, steps: int, dtype=None, snapshot_every=None) -> dict:
    import ray

    import examples.lm as lm
    from ray_elastic import Callback, ElasticConfig, ElasticTrainer

    cfg = ElasticConfig(num_slices=slices, batch_shards=slices * per_slice, exchange=exchange, exchange_dtype=dtype,
                        policy="pause", timeout_s=600.0, first_step_deadline_s=600.0, step_deadline_floor_s=60.0,
                        snapshot_every_replicated=snapshot_every or "auto")
    seen: dict = {}

    class Probe(Callback):
        def on_start(self, trainer):
            self.trainer = trainer

        def _stats(self):
            t = self.trainer
            return {(s, h): st for s in sorted(t.members.live) for h, st in
                    enumerate(ray.get([w.exchange_stats.remote() for w in t.members.backend.workers(s)], timeout=60))}

        def on_step(self, step, metrics):
            t = self.trainer
            if step == SKIP:
                seen["from"] = self._stats()
                seen["sampler"] = PeakSampler(lambda: [i["pid"] for s in sorted(t.members.live)
                                                       for i in t.hosts(s)]).start()
            if step == steps:
                seen["to"] = self._stats()
                seen["peaks"] = seen["sampler"].stop()

    trainer = ElasticTrainer(functools.partial(lm.make_program, config), cfg, steps, callbacks=[Probe()])
    report = trainer.fit()
    if report.steps_completed != steps or report.failures:
        raise RuntimeError(f"{exchange} on {slices} slices: {report.steps_completed}/{steps} steps, "
                           f"failures {report.failures}")
    hosts = []
    for key, end in seen["to"].items():
        start = seen["from"][key]
        n = end["applies"] - start["applies"]
        hosts.append({k: (end[k] - start[k]) / n for k in ("bytes_from_other_slices", "sent_bytes", "exchange_s",
                                                            "inputs_s", *OVERLAP)})
    times = list(report.step_times)[SKIP:]
    return {"slices": slices, "per_slice": per_slice, "exchange": exchange, "dtype": dtype or "float32",
            "taken_median": statistics.median(h["bytes_from_other_slices"] for h in hosts),
            "taken_max": max(h["bytes_from_other_slices"] for h in hosts),
            "sent_median": statistics.median(h["sent_bytes"] for h in hosts),
            "exchange_s": statistics.median(h["exchange_s"] for h in hosts),
            "inputs_s": statistics.median(h["inputs_s"] for h in hosts),
            "snapshot_every": snapshot_every or "auto",
            "overlap": {k: statistics.median(h[k] for h in hosts) for k in OVERLAP},
            "median_step_s": statistics.median(times), "mean_step_s": statistics.fmean(times),
            "peak_rss": max((p.get("peak_VmRSS", 0) for p in seen["peaks"].values()), default=0),
            "losses": list(report.losses)}


def run(cluster, steps: int = 12, rounds: int = 1, slices=SLICES, per_slice=PER_SLICE, log=print) -> dict:
    from bench.common import ensure_nodes

    t0 = time.monotonic()
    config = small()
    g = grad_bytes(config)
    rows = []
    for n in slices:
        ensure_nodes(cluster, n)
        for m in per_slice:
            for r in range(rounds):
                for exchange in ("direct", "reduce_scatter") if r % 2 == 0 else ("reduce_scatter", "direct"):
                    log(f"{n} slices, {m} shard(s) per slice, round {r + 1}: {exchange}")
                    rows.append(one_run(config, n, m, exchange, steps))
    ensure_nodes(cluster, 2)
    for r in range(rounds):
        for dtype in (None, "bfloat16"):
            log(f"2 slices, wire dtype {dtype or 'float32'}, round {r + 1}")
            rows.append(one_run(config, 2, 1, "reduce_scatter", steps, dtype))
    for r in range(rounds):
        for exchange in ("direct", "reduce_scatter") if r % 2 == 0 else ("reduce_scatter", "direct"):
            log(f"2 slices, a snapshot every step, round {r + 1}: {exchange}")
            rows.append(one_run(config, 2, 1, exchange, steps, snapshot_every=1))
    for row in rows:
        row["ring_bound"] = 2 * (row["slices"] - 1) / row["slices"] * g
        row["ratio_to_ring"] = row["taken_max"] / row["ring_bound"]
    return {"steps": steps, "skip": SKIP, "grad_bytes": g, "rows": rows, "wall_s": time.monotonic() - t0}


def run_big(steps: int = 12, rounds: int = 1, log=print) -> dict:
    """The size ladder's 2 GB state on 2 slices: direct against the
    reduce-scatter, alternated (bench/sizes.py's cluster: 4 GB object
    store per node)."""
    from bench import sizes

    config = sizes.ladder()["2GB"]
    rows = []
    for r in range(rounds):
        for exchange in ("direct", "reduce_scatter") if r % 2 == 0 else ("reduce_scatter", "direct"):
            log(f"2 GB, round {r + 1}: {exchange}")
            out = sizes.elastic_run(config, steps, exchange=exchange)
            rows.append({"exchange": exchange, "round": r + 1, **sizes.figures(out)})
    return {"steps": steps, "state_gb": sizes.state_gb(config), "rows": rows}


def _mb(b: float) -> str:
    return f"{b / 1e6:.2f}"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole > 0 else "-"


def table(result: dict) -> str:
    lines = []
    if "grad_bytes" in result:
        lines += [f"Gradient: {_mb(result['grad_bytes'])} MB per host; steps {result['skip'] + 1}.."
                  f"{result['steps']} counted.", "",
                  "| slices | shards/slice | exchange | wire | taken in/step (MB, max host) | ring bound (MB) | "
                  "x ring | sent/step (MB) | exchange s/step | inputs s/step | median step s | mean step s | "
                  "peak RSS (MB) |", "|" + "---|" * 13]
        for r in result["rows"]:
            lines.append(f"| {r['slices']} | {r['per_slice']} | {r['exchange']} | {r['dtype']} | "
                         f"{_mb(r['taken_max'])} | {_mb(r['ring_bound'])} | {r['ratio_to_ring']:.2f} | "
                         f"{_mb(r['sent_median'])} | {r['exchange_s']:.4f} | {r['inputs_s']:.3f} | "
                         f"{r['median_step_s']:.3f} | {r['mean_step_s']:.3f} | {_mb(r['peak_rss'])} |")
        wide = [r for r in result["rows"] if r["dtype"] == "float32" and r["slices"] == 2 and r["per_slice"] == 1
                and r["exchange"] == "reduce_scatter" and r["snapshot_every"] == "auto"]
        narrow = [r for r in result["rows"] if r["dtype"] == "bfloat16"]
        if wide and narrow:
            diff = max(abs(a - b) for a, b in zip(wide[-1]["losses"], narrow[-1]["losses"]))
            lines += ["", f"bfloat16 on the wire: loss after {result['steps']} steps {narrow[-1]['losses'][-1]:.6f} "
                          f"against float32's {wide[-1]['losses'][-1]:.6f}; largest difference over the steps "
                          f"{diff:.2e}."]
    if "grad_bytes" in result:
        lines += ["", "Inside the exchange's windows (per host per step, medians over hosts): the window, and the "
                      "share of it covered by the next step's batch read and by snapshot views; the share of each "
                      "of those that the window hid, and of the step's gradient compute (0: it cannot).", "",
                  "| slices | shards/slice | exchange | wire | snapshots | window s | batch s | batch hidden | "
                  "snapshot s | snapshot hidden | window covered | compute inside |", "|" + "---|" * 12]
        for r in result["rows"]:
            o = r["overlap"]
            covered = (o["batch_in_exchange_s"] + o["snapshot_in_exchange_s"]) / o["exchange_window_s"]
            lines.append(f"| {r['slices']} | {r['per_slice']} | {r['exchange']} | {r['dtype']} | "
                         f"{r['snapshot_every']} | {o['exchange_window_s']:.4f} | {o['batch_s']:.4f} | "
                         f"{_share(o['batch_in_exchange_s'], o['batch_s'])} | {o['snapshot_s']:.4f} | "
                         f"{_share(o['snapshot_in_exchange_s'], o['snapshot_s'])} | {covered:.0%} | "
                         f"{_share(o['compute_in_exchange_s'], o['compute_s'])} |")
    if "state_gb" in result:
        lines += ["", f"{result['state_gb']:.2f} GB state, 2 slices:", "",
                  "| exchange | round | median step s | mean step s | peak GB | failures |", "|---|---|---|---|---|---|"]
        for r in result["rows"]:
            lines.append(f"| {r['exchange']} | {r['round']} | {r['median_step_s']:.3f} | {r['mean_step_s']:.3f} | "
                         f"{r['peak_gb']:.2f} | {len(r['failures'])} |")
    return "\n".join(lines)

"""Data loading's cost: `python -m bench data [--quick] [--runs N] [--steps N]`.

The example LM fed by a Grain pipeline (`examples/lm_grain.py`: an
ArrayRecord file, a global shuffle, tokenizing, documents packed into rows
of 65 tokens), 16 rows per shard.

1. **Bytes read per host**: one slice of 1, 2 and 4 hosts (pure data
   parallelism: the batch splits over every host), 2 shards per step,
   `steps` steps. Every worker logs each read (`GrainLMConfig.read_log`):
   the rows it was asked for, their bytes, and the bytes of corpus records
   it has read from the file so far. Per host: the file bytes read and the
   row bytes made over the steps (after its compile, which reads shard 0
   whole once for the batch's shapes), the median over the hosts.
2. **Step time**: the same program, model and rows, fed either from memory
   (the rows of every step read beforehand into one .npy file, indexed by
   step and shard) or from the Grain pipeline (reading, tokenizing and
   packing on the fly, the next step's rows read ahead during the step).
   2 slices x 1 host, resize (pause for one slice), no faults, alternated run by run; each run's
   figure is its median step time after the first 10 steps. The two must
   give the same losses, bit for bit (the same rows in the same order).

The memory source is pickled by reference (`bench.data`): run
`python -m bench` from the repository's root.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import tempfile
import time
from typing import Any, Optional

import numpy as np

from bench.common import ensure_nodes, steady_step_time, summary

SKIP = 10
ROWS = 16  # per shard
HOSTS = (1, 2, 4)
SOURCES = ("memory", "grain")


def grain_config(data_dir: str, read_log: str = "") -> Any:
    import examples.lm as lm
    import examples.lm_grain as lg

    return lg.GrainLMConfig(lm=dataclasses.replace(lm.LMConfig(), shard_batch_size=ROWS), data_dir=data_dir,
                            read_log=read_log)


class MemoryRows:
    """make_batch over rows read beforehand: shard s of step k is rows
    (k * shards + s) * ROWS ... of one array per key, loaded once per
    process (np.load with mmap: what a reader from memory costs)."""

    def __init__(self, path: str):
        self.path = path
        self._arrays: Optional[dict] = None

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.path, self._arrays = state["path"], None

    def __call__(self, seed: int, step: int, shard: int, num_shards: int) -> dict:
        if self._arrays is None:
            self._arrays = dict(np.load(self.path))
        first = (step * num_shards + shard) * ROWS
        return {k: v[first: first + ROWS] for k, v in self._arrays.items()}


def memory_program(config: Any, path: str) -> Any:
    import examples.lm_grain as lg

    return dataclasses.replace(lg.make_program(config), make_batch=MemoryRows(path))


def write_rows(config: Any, steps: int, shards: int, path: str) -> str:
    """The rows of `steps` steps (one more for the read-ahead), from the pipeline."""
    import examples.lm_grain as lg

    rows = lg.packed_rows(config)
    n = (steps + 1) * shards * ROWS
    recs = [rows[i] for i in range(n)]
    np.savez(path, **{k: np.stack([r[k] for r in recs]) for k in recs[0]})
    return path


def _fit(cluster, factory, slices: int, hosts: int, shards: int, steps: int) -> Any:
    from ray_elastic import CpuSlice, ElasticConfig, ElasticTrainer

    ensure_nodes(cluster, slices * hosts)
    cfg = ElasticConfig(num_slices=slices, policy="resize" if slices > 1 else "pause", batch_shards=shards,
                        slice=CpuSlice(hosts=hosts, devices_per_host=1), step_deadline_floor_s=30.0)
    report = ElasticTrainer(factory, cfg, steps).fit()
    if report.steps_completed != steps or report.failures:
        raise RuntimeError(f"{report.steps_completed}/{steps} steps, failures {report.failures} {report.error}")
    return report


def host_reads(log: str) -> list[dict]:
    """Per worker process (= host): file bytes and row bytes over the steps."""
    out = []
    for name in sorted(os.listdir(log)):
        lines = [json.loads(x) for x in open(os.path.join(log, name))]
        at_compile = next((x["file_bytes"] for x in lines if x["rows"] is None), 0)
        steps = [x for x in lines if x["rows"] is not None]
        if not steps:  # the driver's own process (it checks the program): no step read
            continue
        out.append({"pid": int(name), "reads": len(steps), "rows_per_read": steps[0]["rows"][1] - steps[0]["rows"][0],
                    "file_bytes": max(x["file_bytes"] for x in steps) - at_compile,
                    "row_bytes": sum(x["row_bytes"] for x in steps)})
    return out


def _log(msg: str) -> None:
    print(msg, flush=True)


def run(cluster, quick: bool = False, runs: Optional[int] = None, steps: Optional[int] = None, log=_log) -> dict:
    runs = runs or (2 if quick else 5)
    steps = steps or (30 if quick else 80)
    if steps < SKIP + 2:
        raise ValueError(f"steps: at least {SKIP + 2}, got {steps}")
    import examples.lm_grain as lg

    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="ray_elastic-bench-data-")
    per_host = []
    log(f"bytes read per host: 1 slice of {HOSTS} hosts, 2 shards x {ROWS} rows, {steps} steps")
    for hosts in HOSTS:
        folder = os.path.join(work, f"reads-{hosts}")
        _fit(cluster, functools.partial(lg.make_program, grain_config(work, folder)), 1, hosts, 2, steps)
        reads = host_reads(folder)
        if len(reads) != hosts:
            raise RuntimeError(f"{len(reads)} hosts logged reads, expected {hosts}")
        row = {"hosts": hosts, "rows_per_host": reads[0]["rows_per_read"],
               "file_bytes_per_host": statistics.median(r["file_bytes"] for r in reads),
               "row_bytes_per_host": statistics.median(r["row_bytes"] for r in reads), "hosts_detail": reads}
        per_host.append(row)
        log(f"  {hosts} host(s): {row['rows_per_host']} rows per host per shard, file "
            f"{row['file_bytes_per_host'] / 1024:.0f} KiB, rows {row['row_bytes_per_host'] / 1024:.0f} KiB per host")

    shards = 2
    path = write_rows(grain_config(work), steps, shards, os.path.join(work, "rows.npz"))
    factories = {"memory": functools.partial(memory_program, grain_config(work), path),
                 "grain": functools.partial(lg.make_program, grain_config(work))}
    timed: dict = {s: [] for s in SOURCES}
    log(f"step time: {runs} alternated pairs of {steps} steps, 2 slices x 1 host")
    for i in range(runs):
        for source in SOURCES:
            report = _fit(cluster, factories[source], 2, 1, shards, steps)
            timed[source].append({"step_time_s": steady_step_time(report, skip_first=SKIP),
                                  "losses": list(report.losses)})
        a, b = timed["memory"][-1]["step_time_s"], timed["grain"][-1]["step_time_s"]
        log(f"  pair {i}: memory {a * 1e3:.1f} ms/step, grain {b * 1e3:.1f} ms/step, ratio {b / a:.3f}")
    ratios = [g["step_time_s"] / m["step_time_s"] for m, g in zip(timed["memory"], timed["grain"])]
    return {
        "settings": {"rows_per_shard": ROWS, "steps": steps, "runs": runs, "warmup_skipped": SKIP},
        "per_host": per_host,
        "step_time": {s: summary([r["step_time_s"] for r in timed[s]]) for s in SOURCES},
        "pairs": [{"memory_s": m["step_time_s"], "grain_s": g["step_time_s"], "ratio": g["step_time_s"] /
                   m["step_time_s"]} for m, g in zip(timed["memory"], timed["grain"])],
        "median_ratio": statistics.median(ratios),
        "same_losses": all(m["losses"] == g["losses"] for m, g in zip(timed["memory"], timed["grain"])),
        "wall_s": time.monotonic() - t0,
    }


def table(r: dict) -> str:
    st = r["settings"]
    lines = [f"Bytes read per host: one slice, 2 shards x {st['rows_per_shard']} rows per step, {st['steps']} "
             "steps, after compile (median over the hosts).", "",
             "| hosts per slice | rows per host per shard | file bytes read per host | row bytes per host |",
             "|---|---|---|---|"]
    for p in r["per_host"]:
        lines.append(f"| {p['hosts']} | {p['rows_per_host']} | {p['file_bytes_per_host'] / 1024:.1f} KiB | "
                     f"{p['row_bytes_per_host'] / 1024:.1f} KiB |")
    lines += ["", f"Step time: 2 slices x 1 host, {st['runs']} alternated pairs of {st['steps']} steps, median step "
              f"after the first {st['warmup_skipped']}.", "", "| source | median step (ms) | min | max |", "|---|---|---|---|"]
    for s in SOURCES:
        t = r["step_time"][s]
        lines.append(f"| {'make_batch from memory' if s == 'memory' else 'Grain over ArrayRecord, packed'} | "
                     f"{t['median'] * 1e3:.1f} | {t['min'] * 1e3:.1f} | {t['max'] * 1e3:.1f} |")
    lines += ["", f"Median per-pair ratio grain / memory: {r['median_ratio']:.3f}. Same losses bit for bit: "
              f"{r['same_losses']}."]
    return "\n".join(lines)


def write(result: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    files = {"json": os.path.join(out_dir, "data.json"), "md": os.path.join(out_dir, "data.md")}
    with open(files["json"], "w") as f:
        json.dump(result, f, indent=1)
    with open(files["md"], "w") as f:
        f.write(table(result) + "\n")
    return files

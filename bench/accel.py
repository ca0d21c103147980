"""python -m bench accel: the example LM on an accelerator at a real size,
plain JAX against ray_elastic, alternated round by round.

Variants, each `--steps` steps of the same global batch (2 shards a step):
- plain: one JAX process, both shards a step (bench/accel_plain.py);
- one_slice: ray_elastic on 1 slice computing both shards;
- two_slices: 2 slices of one host each (on one GPU: sharing it, half the
  GPU each, `GpuSlice(gpus_per_host=0.5)`);
- two_slices_kill: the same, a worker SIGKILLed at step `--fail-at`, under
  resize (0 steps redone is the target).

It needs nothing from the network: Ray local (`ray.init` with the GPU
found), the example's synthetic corpus, the compile cache in a temporary
folder. `--cpu`: the same on a 2-node local cluster of CPU slices, at a
small size (the test runs it so).

Figures per variant: median and mean step (the first `SKIP` steps, the
compile, left out), ratio to plain's median, bytes that crossed slices per
step (counted in the workers) and that over the median step as GB/s, the
device peak (JAX's `peak_bytes_in_use`) and host peak (VmHWM / sampled
RSS) per process, failures, steps redone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.memory import PeakSampler  # noqa: E402 (after the path)

VARIANTS = ("plain", "one_slice", "two_slices", "two_slices_kill")
SKIP = 3  # steps left out of the step figures: the compile, the first snapshot
SHARDS = 2


def sizes():
    import examples.lm as lm

    return {
        # 341M parameters, 4.1 GB of params and Adam state in float32.
        "341m": lm.LMConfig(seq_len=512, d_model=1536, num_layers=12, num_heads=12, mlp_dim=6144, shard_batch_size=16),
        "cpu": lm.LMConfig(seq_len=64, d_model=128, num_layers=2, num_heads=4, mlp_dim=512, shard_batch_size=8),
    }


def plain_run(config, steps: int, gpu: bool, timeout_s: float = 900.0) -> dict:
    cfg = json.dumps({f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cuda" if gpu else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plain.json")
        proc = subprocess.run([sys.executable, "-m", "bench.accel_plain", "--config", cfg, "--steps", str(steps),
                               "--shards", str(SHARDS), "--out", out], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"plain JAX run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as f:
            r = json.load(f)
    return {"step_times": r["step_times"], "losses": r["losses"], "failures": [], "steps_redone": 0,
            "cross_bytes_per_step": 0, "device_peak_bytes": [r["device_peak_bytes"]],
            "host_peak_bytes": [r["host_peak_bytes"]], "device": r["device"]}


def elastic_run(config, steps: int, slices: int, gpu: bool, kill_at: int = 0) -> dict:
    import ray

    import examples.lm as lm
    from ray_elastic import Callback, CpuSlice, ElasticConfig, ElasticTrainer, Fault, GpuSlice

    share = 1 if slices == 1 else 1 / slices
    spec = (GpuSlice(gpus_per_host=share if share < 1 else 1) if gpu else CpuSlice())
    cfg = ElasticConfig(num_slices=slices, slice=spec, batch_shards=SHARDS,
                        policy="resize" if kill_at else "pause", min_slices=1 if kill_at else None,
                        first_step_deadline_s=600.0, timeout_s=600.0)
    seen: dict = {}

    class Probe(Callback):
        def on_start(self, trainer):
            self.trainer = trainer
            seen["sampler"] = PeakSampler(lambda: [i["pid"] for s in sorted(trainer.members.live)
                                                   for i in trainer.hosts(s)]).start()

        def on_step(self, step, metrics):
            if step != steps:
                return
            t = self.trainer
            for s in sorted(t.members.live):
                workers = t.members.backend.workers(s)
                seen.setdefault("exchange", []).extend(ray.get([w.exchange_stats.remote() for w in workers], timeout=60))
                seen.setdefault("device", []).extend(ray.get([w.device_memory.remote() for w in workers], timeout=60))

    faults = (Fault("kill", 1, kill_at),) if kill_at else ()
    trainer = ElasticTrainer(functools.partial(lm.make_program, config), cfg, steps, faults=faults, callbacks=[Probe()])
    report = trainer.fit()
    peaks = seen["sampler"].stop()
    cross = sum(x["bytes_from_other_slices"] for x in seen.get("exchange", []))
    return {
        "step_times": list(report.step_times), "losses": list(report.losses),
        "failures": [f.kind for f in report.failures], "steps_redone": sum(f.steps_rewound for f in report.failures),
        "cross_bytes_per_step": cross / max(1, steps),
        "device_peak_bytes": [d.get("peak_bytes_in_use") for d in seen.get("device", [])],
        "host_peak_bytes": [p.get("peak_VmRSS", 0) for p in peaks.values()],
        "steps_completed": report.steps_completed,
    }


def _figures(runs: list[dict], plain_median: float) -> dict:
    steps = [t for r in runs for t in r["step_times"][SKIP:]]
    med = statistics.median(steps)
    cross = statistics.median([r["cross_bytes_per_step"] for r in runs])
    device = [b for r in runs for b in r["device_peak_bytes"] if b]
    return {
        "runs": len(runs),
        "median_step_s": med,
        "mean_step_s": statistics.fmean(steps),
        "ratio_to_plain": med / plain_median if plain_median else None,
        "cross_bytes_per_step": cross,
        "cross_gb_per_s": cross / med / 1e9 if med else 0.0,
        "device_peak_bytes": max(device) if device else None,
        "host_peak_bytes": max(b for r in runs for b in r["host_peak_bytes"]),
        "failures": sorted({k for r in runs for k in r["failures"]}),
        "failure_count": sum(len(r["failures"]) for r in runs),
        "steps_redone": sum(r["steps_redone"] for r in runs),
    }


def run(cpu: bool, steps: int, rounds: int, fail_at: int, log=print) -> dict:
    config = sizes()["cpu" if cpu else "341m"]
    done: dict[str, list] = {v: [] for v in VARIANTS}
    t0 = time.monotonic()
    for r in range(rounds):
        for v in VARIANTS:  # alternated: every variant once a round
            log(f"round {r + 1}/{rounds}: {v}")
            if v == "plain":
                done[v].append(plain_run(config, steps, gpu=not cpu))
            else:
                slices = 1 if v == "one_slice" else 2
                done[v].append(elastic_run(config, steps, slices, gpu=not cpu,
                                           kill_at=fail_at if v == "two_slices_kill" else 0))
    plain_median = statistics.median([t for r in done["plain"] for t in r["step_times"][SKIP:]])
    return {
        "size": "cpu" if cpu else "341m",
        "config": dataclasses.asdict(config),
        "steps": steps, "rounds": rounds, "fail_at": fail_at,
        "device": done["plain"][0].get("device", ""),
        "wall_s": time.monotonic() - t0,
        "variants": {v: _figures(done[v], plain_median) for v in VARIANTS},
        "raw": done,
    }


def _gb(b) -> str:
    return "-" if b is None else f"{b / 1e9:.2f}"


def table(result: dict) -> str:
    lines = [f"Example LM ({result['size']}) on {result['device']}, {result['steps']} steps x {result['rounds']} "
             f"round(s), alternated; step figures skip the first {SKIP} steps",
             "",
             "| variant | median step (s) | mean step (s) | x plain | cross-slice MB/step | GB/s | device peak GB "
             "| host peak GB | failures | steps redone |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v, f in result["variants"].items():
        ratio = "-" if f["ratio_to_plain"] is None else f"{f['ratio_to_plain']:.2f}"
        lines.append(f"| {v} | {f['median_step_s']:.4f} | {f['mean_step_s']:.4f} | {ratio} | "
                     f"{f['cross_bytes_per_step'] / 1e6:.1f} | {f['cross_gb_per_s']:.2f} | {_gb(f['device_peak_bytes'])} | "
                     f"{_gb(f['host_peak_bytes'])} | {f['failure_count']} {','.join(f['failures'])} | "
                     f"{f['steps_redone']} |")
    return "\n".join(lines)


def start(cpu: bool):
    """The Ray this bench runs on: a 2-node local cluster of CPU slices, or
    Ray local on this machine with its GPU (the driver's own JAX on CPU,
    so that it takes none of the GPU's memory)."""
    if cpu:
        from bench.common import start_cluster

        return start_cluster(2)
    import ray

    os.environ["JAX_PLATFORMS"] = "cpu"  # this process; the workers get cuda (GpuSlice)
    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    return None


def stop(cluster) -> None:
    import ray

    if cluster is not None:
        cluster.shutdown()
    elif ray.is_initialized():
        ray.shutdown()

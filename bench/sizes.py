"""python -m bench sizes: states of 0.3, 1 and 2 GB with short steps, on
CPU, 2 slices of one host against a plain 2-process `jax.distributed` job
(gloo) on the same mesh and global batch, alternated size by size; and a
SIGKILL at the largest size under resize.

The example LM with 8 tokens a row, so that a step is short beside its
state, as on an accelerator (params and Adam state, float32):
0.3 GB (d_model 512, 8 layers), 1 GB (768, 12), 2 GB (1024, 14).

Figures per size and variant: median and mean step (the first `SKIP`
steps left out), the peak resident memory of a worker (ray_elastic) or a
process (plain) from the second step on, failures, steps redone. For a
failure-free ray_elastic run, where a host's step goes (its
`exchange_stats`, read after step `SKIP` and at the end, per step, median
host): the gradient compute (`compute_s`: the shards' gradients to their
values on the host), the exchange's window (the gradients on the host to
the sum laid out: the host path, worker/overlap.py) and the rest of the
step (the update, the driver's calls), with the gradient bytes a host
sends per step and the window's seconds per GB of them.
Targets: no false failure at any size; at 2 GB the mean step at most
plain's and the peak at most 1.15x plain's; the kill recovered with 0
steps redone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.memory import PeakSampler  # noqa: E402 (after the path)

SKIP = 2
SLICES = 2


def ladder(quick: bool = False) -> dict:
    import examples.lm as lm

    sizes = {
        "0.3GB": lm.LMConfig(seq_len=8, d_model=512, num_layers=8, num_heads=8, mlp_dim=2048, shard_batch_size=8),
        "1GB": lm.LMConfig(seq_len=8, d_model=768, num_layers=12, num_heads=8, mlp_dim=3072, shard_batch_size=8),
        "2GB": lm.LMConfig(seq_len=8, d_model=1024, num_layers=14, num_heads=8, mlp_dim=4096, shard_batch_size=8),
    }
    return {"0.3GB": sizes["0.3GB"]} if quick else sizes


def state_gb(config) -> float:
    import jax

    import examples.lm as lm
    from ray_elastic.control.memory_plan import tree_bytes

    program = lm.make_program(config)
    params = jax.eval_shape(program.init_params, jax.random.PRNGKey(0))
    return (tree_bytes(params) + tree_bytes(jax.eval_shape(program.optimizer.init, params))) / 1e9


def plain_run(config, steps: int, timeout_s: float = 1800.0) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = json.dumps({f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plain.json")
        procs = [subprocess.Popen([sys.executable, "-m", "bench.sharded_plain", "--process-id", str(i),
                                   "--coordinator", f"127.0.0.1:{port}", "--config", cfg, "--steps", str(steps),
                                   "--out", out, "--slices", str(SLICES), "--hosts", "1", "--layout", "replicated"],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(SLICES)]
        try:
            logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if not os.path.exists(out):
            raise RuntimeError("plain jax.distributed job failed:\n" + "\n".join(log[-2000:] for log in logs))
        with open(out) as f:
            result = json.load(f)
        peaks = []
        for i in range(SLICES):
            if os.path.exists(f"{out}.mem{i}"):
                with open(f"{out}.mem{i}") as f:
                    peaks.append(json.load(f).get("peak_VmRSS", 0))
    return {"step_times": result["step_times"], "peak_bytes": max(peaks) if peaks else 0, "failures": [],
            "steps_redone": 0}


def elastic_run(config, steps: int, kill_at: int = 0, exchange: str = "reduce_scatter") -> dict:
    import examples.lm as lm
    from ray_elastic import Callback, ElasticConfig, ElasticTrainer, Fault

    cfg = ElasticConfig(num_slices=SLICES, policy="resize" if kill_at else "pause",
                        min_slices=1 if kill_at else None, first_step_deadline_s=600.0, timeout_s=600.0,
                        exchange=exchange)
    seen: dict = {}

    class Probe(Callback):
        def on_start(self, trainer):
            self.trainer = trainer

        def _stats(self):
            import ray

            t = self.trainer
            return [st for s in sorted(t.members.live)
                    for st in ray.get([w.exchange_stats.remote() for w in t.members.backend.workers(s)], timeout=60)]

        def on_step(self, step, metrics):
            t = self.trainer
            if step == 1:  # from the second step on, as the plain job samples
                seen["sampler"] = PeakSampler(lambda: [i["pid"] for s in sorted(t.members.live)
                                                       for i in t.hosts(s)]).start()
            if not kill_at and step in (SKIP, steps):
                seen[step] = self._stats()

    faults = (Fault("kill", 1, kill_at),) if kill_at else ()
    trainer = ElasticTrainer(functools.partial(lm.make_program, config), cfg, steps, faults=faults,
                             callbacks=[Probe()])
    report = trainer.fit()
    peaks = seen["sampler"].stop() if "sampler" in seen else {}
    parts = _step_parts(seen[SKIP], seen[steps]) if SKIP in seen and steps in seen else None
    return {"step_times": list(report.step_times), "steps_completed": report.steps_completed, "parts": parts,
            "peak_bytes": max((p.get("peak_VmRSS", 0) for p in peaks.values()), default=0),
            "failures": [f.kind for f in report.failures],
            "steps_redone": sum(f.steps_rewound for f in report.failures)}


def _step_parts(start: list, end: list) -> dict:
    """Per step, median host: seconds of gradient compute, of the
    exchange's window, and the bytes sent, between two reads of the hosts'
    counters."""
    hosts = []
    for a, b in zip(start, end):
        n = b["applies"] - a["applies"]
        hosts.append({k: (b[k] - a[k]) / n for k in ("compute_s", "exchange_window_s", "exchange_s", "inputs_s",
                                                      "sent_bytes")})
    return {k: statistics.median(h[k] for h in hosts) for k in hosts[0]}


def figures(r: dict) -> dict:
    t = r["step_times"][SKIP:]
    out = {"median_step_s": statistics.median(t), "mean_step_s": statistics.fmean(t), "peak_gb": r["peak_bytes"] / 1e9,
           "failures": r["failures"], "steps_redone": r["steps_redone"]}
    if r.get("parts"):
        out["parts"] = r["parts"]
    return out


def run(steps: int, quick: bool = False, kill: bool = True, log=print) -> dict:
    t0 = time.monotonic()
    rows = []
    sizes = ladder(quick)
    for name, config in sizes.items():
        gb = state_gb(config)
        for variant in ("ray_elastic", "plain"):  # alternated, size by size
            log(f"{name} ({gb:.2f} GB): {variant}")
            r = elastic_run(config, steps) if variant == "ray_elastic" else plain_run(config, steps)
            rows.append({"size": name, "state_gb": gb, "variant": variant, **figures(r)})
    if kill:
        name, config = list(sizes.items())[-1]
        log(f"{name}: ray_elastic with a SIGKILL at step {steps // 2}")
        r = elastic_run(config, steps, kill_at=steps // 2)
        rows.append({"size": name, "state_gb": state_gb(config), "variant": "ray_elastic, SIGKILL (resize)",
                     **figures(r)})
    return {"steps": steps, "rows": rows, "wall_s": time.monotonic() - t0}


def table(result: dict) -> str:
    lines = [f"{result['steps']} steps a run, the first {SKIP} left out; 2 slices of one CPU host against a plain "
             "2-process jax.distributed job", "",
             "| state | variant | median step (s) | mean step (s) | x plain (mean) | peak memory GB | x plain | "
             "failures | steps redone |", "|---|---|---|---|---|---|---|---|---|"]
    plain = {r["size"]: r for r in result["rows"] if r["variant"] == "plain"}
    for r in result["rows"]:
        p = plain.get(r["size"])
        ratio_t = f"{r['mean_step_s'] / p['mean_step_s']:.2f}" if p else "-"
        ratio_m = f"{r['peak_gb'] / p['peak_gb']:.2f}" if p and p["peak_gb"] else "-"
        lines.append(f"| {r['state_gb']:.2f} GB | {r['variant']} | {r['median_step_s']:.3f} | {r['mean_step_s']:.3f} | "
                     f"{ratio_t} | {r['peak_gb']:.2f} | {ratio_m} | {len(r['failures'])} {','.join(r['failures'])} | "
                     f"{r['steps_redone']} |")
    parted = [r for r in result["rows"] if r.get("parts")]
    if parted:
        lines += ["", "Where a ray_elastic host's step goes (per step, median host; the window: its gradients on "
                      "the host to the sum laid out for the update):", "",
                  "| state | mean step (s) | compute (s) | exchange window (s) | of it, own work (s) | rest (s) | "
                  "sent MB/step | window s per GB sent |", "|---|---|---|---|---|---|---|---|"]
        for r in parted:
            p = r["parts"]
            rest = r["mean_step_s"] - p["compute_s"] - p["exchange_window_s"]
            per_gb = p["exchange_window_s"] / (p["sent_bytes"] / 1e9) if p["sent_bytes"] else float("nan")
            lines.append(f"| {r['state_gb']:.2f} GB | {r['mean_step_s']:.3f} | {p['compute_s']:.3f} | "
                         f"{p['exchange_window_s']:.3f} | {p['exchange_s']:.3f} | {rest:.3f} | "
                         f"{p['sent_bytes'] / 1e6:.1f} | {per_gb:.2f} |")
    return "\n".join(lines)

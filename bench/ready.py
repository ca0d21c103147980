"""How long a replacement takes from its placement to ready, per phase
(`python -m bench ready [--runs N] [--out DIR]`).

A replacement is what the controller queues when a slice's worker dies: new
worker actors on the slice's placement group (whose bundle is free again)
that start, import JAX, start its backend, build the program, make the
step-0 state, compile the step (through the persistent compile cache), and,
once the controller joins them at a step boundary, load the live state.
This bench does exactly that, `--runs` times per variant, with the
provisioner the controller uses (`RaySlices`) on a local cluster with a
1-CPU node per variant (each variant keeps its placement group):
start slice 0, wait for it, load a snapshot of the state into it (the
first state load), take one step, kill its worker, start it again. The first start of
each variant (a cold compile cache, a new placement group) is left out of
the medians.

Phases (seconds, `readiness.readiness_phases`): process_start, actor_load
and args_load in a process started for the worker, or warm_process in one
started ahead (the warm pool's); then queue, imports, jax_init,
program_build, initial_state, compile, report (set-up done to the driver
seeing it; this bench polls every 20 ms), then
first_state (`load_state` of the snapshot, round trip from the driver).
`ready` is placement to set-up seen by the driver (SliceUp.setup_s), and
`ready + first_state` the whole way to a slice that can train;
`first_step` is then its first step (gradient and apply, round trip).

Each worker is killed `SETTLE_S` after its slice came up (a failure comes
seconds to hours after a start), so the warm process its set-up asked for
has started; every variant waits the same.

Variants, run in turn (round robin, so they share the machine's load):
- `default`: what the controller does (the compile cache on, one warm
  worker process per host: worker/warm_pool.py);
- `no_warm`: the default without the warm pool (warm_workers=0);
- `no_cache`: compile_cache_dir="" (every compile from scratch);
- `before`: no warm pool, and `RAY_ELASTIC_EAGER_SETUP=1` in the workers'
  environment: set-up as it was before it was cut down (the step-0 state
  made and the snapshot unflattener built in set-up, snapshots unflattened
  by jax's per-leaf device ops).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from bench.common import lm_factory

PHASES = ("process_start", "actor_load", "args_load", "warm_process", "queue", "imports", "jax_init", "program_build", "initial_state",
          "compile", "report", "first_state")
VARIANTS = ("before", "default", "no_warm", "no_cache")
TARGET_S = 3.0
SETTLE_S = 6.0


def _variant_slices(variant: str, factory, cache_dir: str):
    from ray_elastic.config import CpuSlice
    from ray_elastic.cluster.slice_group import RaySlices

    spec = CpuSlice()
    if variant == "before":
        env = dict(spec.worker_env(), RAY_ELASTIC_EAGER_SETUP="1")

        class _Spec(CpuSlice):
            def worker_env(self):
                return env

        spec = _Spec()
    return RaySlices(spec, factory, seed=0, num_shards=2, run_name=f"bench-ready-{variant}-{os.getpid()}",
                     compile_cache_dir="" if variant == "no_cache" else cache_dir,
                     warm_workers=0 if variant in ("before", "no_warm") else 1)


def _one(slices, snapshot=None, timeout_s: float = 300.0) -> dict:
    import ray

    p = slices.start(0)
    deadline = time.monotonic() + timeout_s
    live = None
    while live is None:
        live = slices.poll(p)
        if live is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the slice did not come up")
            time.sleep(0.02)
    row = dict(live.phases)
    row["ready"] = round(live.ready_at - p.started_at, 4)
    w = live.workers[0]
    if snapshot is None:
        snapshot = ray.put(ray.get(w.flat_state.remote()))
    t0 = time.monotonic()
    ray.get(w.load_state.remote(snapshot))
    row["first_state"] = round(time.monotonic() - t0, 4)
    row["ready_and_state"] = round(row["ready"] + row["first_state"], 4)
    # One step, as the controller's first after a join.
    step = ray.get(w.held_step.remote())
    t0 = time.monotonic()
    _, payload = w.compute_grads.options(num_returns=2, concurrency_group="compute").remote(step, (0,))
    ray.get(w.apply.remote(step, False, [payload]))
    row["first_step"] = round(time.monotonic() - t0, 4)
    time.sleep(max(0.0, SETTLE_S - (time.monotonic() - live.ready_at)))
    row.update(_warm_memory(live.infos[0]["pid"]))
    slices.kill(live.workers)
    return row, snapshot


def _warm_memory(worker_pid: int) -> dict:
    """What the warm pool costs on the worker's node: the idle processes
    its raylet started beside the worker with the pool's set-up hook in
    their environment, their count and largest resident and unique (USS)
    memory, MB. Empty where /proc is not readable (not this machine)."""
    import psutil

    from ray_elastic.worker.warm_pool import PRELOAD_ENV

    try:
        raylet = psutil.Process(worker_pid).ppid()
    except psutil.Error:
        return {}
    rss, uss = [], []
    for proc in psutil.process_iter(["pid", "ppid"]):
        if proc.info["ppid"] != raylet or proc.info["pid"] == worker_pid:
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if PRELOAD_ENV.encode() not in f.read():
                    continue
            mem = proc.memory_full_info()
        except (OSError, psutil.Error):
            continue
        rss.append(mem.rss / 2**20)
        uss.append(mem.uss / 2**20)
    out = {"warm_processes": len(rss)}
    if rss:
        out.update(warm_rss_mb=round(max(rss), 1), warm_uss_mb=round(max(uss), 1))
    return out


def run(runs: int = 5, variants=VARIANTS, factory=None, log=print) -> dict:
    factory = factory or lm_factory()
    cache_dir = tempfile.mkdtemp(prefix="bench-ready-xla-")
    slices = {v: _variant_slices(v, factory, cache_dir) for v in variants}
    rows: dict = {v: [] for v in variants}
    snaps: dict = {}
    try:
        for i in range(runs + 1):  # run 0: the cold start, left out
            for v in variants:
                row, snaps[v] = _one(slices[v], snaps.get(v))
                row["run"] = i
                rows[v].append(row)
                log(f"  {v} #{i}: ready {row['ready']:.2f} s + first state {row['first_state']:.2f} s, "
                    f"first step {row['first_step']:.2f} s  "
                    + " ".join(f"{k}={row[k]:.2f}" for k in PHASES[:-1] if k in row))
    finally:
        for s in slices.values():
            s.shutdown()
    out = {"runs": runs, "variants": {}, "target_s": TARGET_S, "cpus": os.cpu_count(),
           "load_avg": os.getloadavg(), "ray_floor": floor(runs, log=log)}
    for v in variants:
        warm = [r for r in rows[v] if r["run"] > 0] or rows[v]
        med = {}
        for k in PHASES + ("ready", "ready_and_state", "first_step", "warm_processes", "warm_rss_mb", "warm_uss_mb"):
            vals = [r[k] for r in warm if k in r]
            if vals:
                med[k] = round(statistics.median(vals), 4)
        out["variants"][v] = {"median": med, "rows": rows[v]}
    return out


def floor(runs: int = 5, log=print) -> dict:
    """What Ray alone takes here to start an actor: creation to the first
    reply of an actor that does nothing (`empty`), and of one that first
    imports what a worker needs (`imports`: jax, flax, optax, the example
    model, ray_elastic.worker.actor), with the workers' environment; median of
    `runs` after a first one left out. No replacement can be ready sooner
    than `imports` without a process started ahead of it."""
    import ray

    from ray_elastic.cluster.slice_group import MALLOC_ENV

    @ray.remote(num_cpus=0)
    class Empty:
        def ready(self):
            return time.time()

    @ray.remote(num_cpus=0)
    class Imports:
        def ready(self):
            import examples.lm  # noqa: F401 (jax, flax, optax)
            import ray_elastic.worker.actor  # noqa: F401
            return time.time()

    out = {}
    for name, cls in (("empty", Empty), ("imports", Imports)):
        times = []
        for _ in range(runs + 1):
            t0 = time.time()
            actor = cls.options(runtime_env={"env_vars": dict(MALLOC_ENV)}).remote()
            times.append(ray.get(actor.ready.remote(), timeout=120) - t0)
            ray.kill(actor)
            time.sleep(1.0)
        out[name] = round(statistics.median(times[1:]), 4)
        log(f"  Ray's floor, {name} actor: {[round(t, 2) for t in times]} s, median {out[name]:.2f} s")
    return out


def table(result: dict) -> str:
    vs = list(result["variants"])
    lines = [
        f"### Replacement readiness: placement → ready, per phase (median of {result['runs']} warm "
        f"replacements per variant, the cold first start left out; load average "
        f"{result['load_avg'][0]:.1f} on {result['cpus']} CPUs)",
        "",
        "| phase (s) | " + " | ".join(vs) + " |",
        "|---|" + "---:|" * len(vs),
    ]
    for k in PHASES + ("ready", "ready_and_state", "first_step", "warm_processes", "warm_rss_mb", "warm_uss_mb"):
        cells = [result["variants"][v]["median"].get(k) for v in vs]
        name = {"ready": "**placement → ready** (SliceUp.setup_s)",
                "ready_and_state": "**placement → ready + first state**",
                "first_step": "then its first step (gradient + apply)",
                "warm_processes": "warm processes beside the worker (count)",
                "warm_rss_mb": "… their memory, resident (MB)",
                "warm_uss_mb": "… their memory, unique to them (MB)"}.get(k, k)
        lines.append(f"| {name} | " + " | ".join("—" if c is None else f"{c:.3f}" for c in cells) + " |")
    fl = result.get("ray_floor") or {}
    if fl:
        lines += ["", f"Ray's floor here (`floor`): an actor that does nothing replies {fl['empty']:.2f} s after its "
                      f"creation, one that first imports what a worker needs {fl['imports']:.2f} s."]
    d = result["variants"].get("default", {}).get("median", {})
    if d.get("ready_and_state") is not None:
        met = d["ready_and_state"] <= result["target_s"]
        lines += ["", f"Target: ≤ {result['target_s']:.0f} s placement → ready (+ first state): "
                      f"{d['ready_and_state']:.2f} s, {'met' if met else 'NOT met'}."]
    return "\n".join(lines)

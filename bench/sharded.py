"""Sharded state (issue #11, item 8): `python -m bench sharded [--quick]`.

One local cluster, 2 slices x 2 hosts (`CpuSlice(hosts=2,
devices_per_host=1)`: one XLA device per worker process, so a replicated
state is held once per process), the example LM (`examples/lm.py`) with
its FSDP layout (`lm.sharded_layout("fsdp")`: every weight split along the
model dimension over the slice's 2 hosts). Runs, in order:

1. `baseline`: a tiny model, sharded: an idle worker's memory (Python,
   Ray, JAX, the compiled step), the floor under every figure below;
2. `quarter`: a model with ~1/4 of the big one's state, sharded;
3. `sharded`: the big model (>= 200 MB of params + Adam state), sharded;
4. `replicated`: the same model, `Layout()` (every host holds it whole);
5. `plain`: the same model as one plain `jax.distributed` job of 4
   processes (`bench/sharded_plain.py`), mesh `slice` x `fsdp`, XLA doing
   every collective; then `sharded` and `plain` once more, alternated
   (`rounds`), for the step-time comparison.

Figures:

- every worker's peak RSS (VmHWM of /proc/<pid>/status, pids from
  `trainer.hosts`), read after the last step, with the state per host;
- the driver's RSS growth during `fit` (sampled every 20 ms in a thread),
  quarter against big;
- median steady-state step time, ray_elastic against plain;
- bytes of gradient blocks each host received from the other slice per
  step (the worker's `exchange_stats` counter), against the ring
  all-reduce bound 2(n-1)/n x its gradient shard bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.common import ROOT, ensure_nodes
from bench.memory import PeakSampler, status

SLICES, HOSTS = 2, 2
MB = 1024 * 1024
# Per node: a replicated snapshot of the big state (~300 MB) is one object.
OBJECT_STORE_MB = 800


def configs(quick: bool) -> dict:
    """LMConfig per model. Memory, not compute, is the point: short
    sequences and small batches keep the steps quick on shared CPUs
    (seq_len changes only the small position table)."""
    import examples.lm as lm

    short = dict(seq_len=16, shard_batch_size=4)
    if quick:
        big = dataclasses.replace(lm.LARGE, num_layers=2, **short)  # ~6.3M params, 76 MB of state
        return {"baseline": dataclasses.replace(lm.LMConfig(), **short), "quarter": None, "big": big}
    big = dataclasses.replace(lm.LARGE, **short)  # ~25M params, ~300 MB of state
    return {"baseline": dataclasses.replace(lm.LMConfig(), **short),
            "quarter": dataclasses.replace(big, num_layers=2), "big": big}


def state_bytes(config) -> dict:
    """Params and optimizer state bytes, and one host's part of them under
    the FSDP layout (its blocks: a leaf split over fsdp counts 1/HOSTS)."""
    import jax
    import numpy as np
    import optax

    import examples.lm as lm
    from ray_elastic.layout import resolve_param_specs

    program = lm.make_program(config, lm.sharded_layout("fsdp"))
    abstract = jax.eval_shape(program.init_params, jax.random.PRNGKey(0))
    opt = jax.eval_shape(program.optimizer.init, abstract)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    specs = resolve_param_specs(program.layout, abstract)
    o_specs = optax.tree_map_params(program.optimizer, lambda _, s: s, opt, specs,
                                    transform_non_params=lambda v: jax.tree.map(lambda _: jax.sharding.PartitionSpec(), v),
                                    is_leaf=is_spec)

    def nbytes(tree):
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))

    def per_host(tree, spec_tree):
        total = 0
        for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(spec_tree, is_leaf=is_spec)):
            n = int(np.prod(a.shape)) * a.dtype.itemsize
            total += n // HOSTS if any(x == "fsdp" or (isinstance(x, tuple) and "fsdp" in x) for x in s) else n
        return total

    params = nbytes(abstract)
    return {
        "params": sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract)),
        "params_bytes": params,
        "opt_bytes": nbytes(opt),
        "state_bytes": params + nbytes(opt),
        "host_state_bytes": per_host(abstract, specs) + per_host(opt, o_specs),
        "host_grad_bytes": per_host(abstract, specs),
    }


class _DriverRss:
    """The driver's RSS, sampled in a thread: start, peak."""

    def __init__(self, period_s: float = 0.02):
        self.period_s = period_s
        self.start = self.peak = status(os.getpid()).get("VmRSS", 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-driver-rss")

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, status(os.getpid()).get("VmRSS", 0))
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.end = status(os.getpid()).get("VmRSS", 0)
        self.peak = max(self.peak, self.end)


def elastic_run(config, layout_name: str, steps: int, snapshot_every: int) -> dict:
    """One failure-free ray_elastic run on 2 slices x 2 hosts; worker peaks
    and exchange counters read after the last step (before teardown)."""
    import functools

    import ray

    import examples.lm as lm
    from ray_elastic import Callback, CpuSlice, ElasticConfig, ElasticTrainer

    layout = lm.sharded_layout("fsdp") if layout_name == "sharded" else lm.Layout()
    factory = functools.partial(lm.make_program, config, layout)
    cfg = ElasticConfig(num_slices=SLICES, slice=CpuSlice(hosts=HOSTS, devices_per_host=1), policy="pause",
                        snapshot_every_replicated=snapshot_every, step_deadline_floor_s=120.0,
                        first_step_deadline_s=600.0, timeout_s=600.0)
    seen: dict = {}

    class Probe(Callback):
        def on_start(self, trainer):
            self.trainer = trainer

        def on_step(self, step, metrics):
            t = self.trainer
            if step == 1:  # from here on, as in the plain job: the steps, not start-up
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

    trainer = ElasticTrainer(factory, cfg, steps, callbacks=[Probe()])
    with _DriverRss() as drv:
        t0 = time.monotonic()
        report = trainer.fit()
        wall = time.monotonic() - t0
    if report.steps_completed != steps or report.failures:
        raise RuntimeError(f"{layout_name} run: {report.steps_completed}/{steps} steps, failures {report.failures}")
    if "workers" not in seen or len(seen["workers"]) != SLICES * HOSTS:
        raise RuntimeError(f"{layout_name} run: worker memory not read ({seen.get('workers')})")
    return {
        "layout": layout_name,
        "steps": steps,
        "wall_s": wall,
        "step_times": list(report.step_times),
        "losses": list(report.losses),
        "workers": seen["workers"],
        "exchange": seen.get("exchange", []),
        "driver": {"start": drv.start, "peak": drv.peak, "end": drv.end, "growth": drv.peak - drv.start},
    }


def plain_run(config, steps: int, timeout_s: float = 900.0) -> dict:
    """The plain 4-process jax.distributed job (bench/sharded_plain.py)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = json.dumps({f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               OMP_NUM_THREADS="1")  # as Ray sets it for a 1-CPU actor
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    from ray_elastic import ElasticConfig

    env["BENCH_COMPILE_CACHE"] = ElasticConfig().compile_cache_dir  # the workers' persistent cache
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plain.json")
        procs = []
        t0 = time.monotonic()
        for i in range(SLICES * HOSTS):
            cmd = [sys.executable, "-m", "bench.sharded_plain", "--process-id", str(i),
                   "--coordinator", f"127.0.0.1:{port}", "--config", cfg, "--steps", str(steps), "--out", out]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        try:
            logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            for p in procs:  # only ours, by pid
                if p.poll() is None:
                    p.kill()
                    p.wait()
        wall = time.monotonic() - t0
        result = None
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
            workers = []
            for i in range(SLICES * HOSTS):
                if os.path.exists(f"{out}.mem{i}"):
                    with open(f"{out}.mem{i}") as f:
                        workers.append(json.load(f))
            result["workers"] = workers
        # Process 0 writes the results once every step is done; a late
        # process can still miss jax.distributed's 30 s shutdown barrier on
        # a loaded machine, which fails the job after the fact.
        if result is None or len(result.get("step_times", ())) != steps:
            raise RuntimeError("plain jax.distributed job failed:\n" + "\n".join(log[-2000:] for log in logs))
    return {"steps": steps, "wall_s": wall, "exit_codes": [p.returncode for p in procs], **result}


def steady(times: list, skip: int) -> dict:
    """Median [min-max] of the step times after the first `skip` (warm-up, compile)."""
    vals = times[skip:] or times
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _log(msg: str) -> None:
    print(msg, flush=True)


def write(result: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    files = {"json": os.path.join(out_dir, "sharded.json"), "md": os.path.join(out_dir, "sharded.md")}
    with open(files["json"], "w") as f:
        json.dump(result, f, indent=1)
    with open(files["md"], "w") as f:
        f.write(table(result) + "\n")
    return files


def run(cluster, quick: bool = False, steps: int = None, rounds: int = None, log=_log,
        partial_path: str = "") -> dict:
    ensure_nodes(cluster, SLICES * HOSTS)
    cfgs = configs(quick)
    steps = steps or (6 if quick else 20)
    rounds = rounds or (1 if quick else 2)
    snap = 2 if quick else 5
    skip = 2 if quick else 4
    t0 = time.monotonic()
    sizes = {name: state_bytes(c) for name, c in cfgs.items() if c is not None}
    for name, s in sizes.items():
        log(f"  {name}: {s['params'] / 1e6:.2f}M params, state {s['state_bytes'] / MB:.1f} MiB, "
            f"per host (fsdp) {s['host_state_bytes'] / MB:.1f} MiB")
    runs: dict = {}
    retries: list = []

    def go(key, fn, *a):
        t = time.monotonic()
        for attempt in range(2):
            try:
                r = fn(*a)
                break
            except Exception as e:  # noqa: BLE001
                # On a loaded machine a slice's first collective can miss
                # gloo's 30 s rendezvous (one host still compiling): run again.
                if attempt:
                    raise
                log(f"  {key}: failed ({str(e)[-300:]}); again")
                retries.append({"run": key, "error": str(e)[-2000:]})
        runs.setdefault(key, []).append(r)
        if partial_path:  # what is done so far, in case a later run fails
            with open(partial_path, "w") as f:
                json.dump({"sizes": sizes, "runs": runs, "retries": retries}, f)
        st = steady(r["step_times"], skip)
        log(f"  {key}: median step {st['median']:.3f} s ({time.monotonic() - t:.0f} s)")
        return r

    go("baseline", elastic_run, cfgs["baseline"], "sharded", steps, snap)
    if cfgs["quarter"] is not None:
        go("quarter", elastic_run, cfgs["quarter"], "sharded", steps, snap)
    go("sharded", elastic_run, cfgs["big"], "sharded", steps, snap)
    go("replicated", elastic_run, cfgs["big"], "replicated", steps, snap)
    go("plain", plain_run, cfgs["big"], steps)
    for _ in range(rounds - 1):  # alternated, so both see the same load
        go("sharded", elastic_run, cfgs["big"], "sharded", steps, snap)
        go("plain", plain_run, cfgs["big"], steps)
    result = summarize(runs, sizes, cfgs, quick, steps, skip, snap, time.monotonic() - t0)
    result["retries"] = retries
    return result


def summarize(runs, sizes, cfgs, quick, steps, skip, snap, wall) -> dict:
    def peaks(key):
        first = runs[key][0]  # memory: the first run of each (a later one's workers are new processes too)
        return [{k: w[k] for k in ("slice", "host", "VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "peak_VmRSS",
                                   "peak_RssAnon", "peak_RssShmem", "samples") if k in w}
                for w in first["workers"]]

    big, small_key = sizes["big"], ("quarter" if "quarter" in runs else "baseline")
    base_peak = statistics.median(w["VmHWM"] for w in runs["baseline"][0]["workers"])
    memory = {}
    for key in ("baseline", "sharded", "replicated"):
        ws = peaks(key)
        hwm = [w["VmHWM"] for w in ws]
        memory[key] = {"workers": ws, "max_peak": max(hwm), "median_peak": statistics.median(hwm),
                       "max_above_baseline": max(hwm) - base_peak}
    # During the steps (sampled): private memory against the plain job's,
    # which has the same XLA buffers and no object store.
    plain_ws = sorted(runs["plain"][0].get("workers", []), key=lambda w: (w["slice"], w["host"]))
    if plain_ws:
        memory["plain"] = {"workers": [{k: w[k] for k in w if k != "process"} for w in plain_ws],
                           "max_peak": max(w["VmHWM"] for w in plain_ws)}
        el_ws = sorted(memory["sharded"]["workers"], key=lambda w: (w["slice"], w["host"]))
        memory["steps"] = {
            "sharded_private_max": max(w.get("peak_RssAnon", 0) for w in el_ws),
            "sharded_store_max": max(w.get("peak_RssShmem", 0) for w in el_ws),
            "plain_private_max": max(w.get("peak_RssAnon", 0) for w in plain_ws),
            "private_above_plain_max": max(a.get("peak_RssAnon", 0) - b.get("peak_RssAnon", 0)
                                           for a, b in zip(el_ws, plain_ws)),
        }
    # Exchange: bytes from the other slice per apply, per host.
    exchange = []
    for e in runs["sharded"][0]["exchange"]:
        n = max(e["applies"], 1)
        exchange.append({"slice": e["slice"], "host": e["host"], "applies": e["applies"],
                         "received_per_step": e["bytes_from_other_slices"] / n,
                         "own_shard_bytes": e["own_bytes"] / n})
    n = SLICES
    shard = statistics.median(x["own_shard_bytes"] for x in exchange)
    el = [t for r in runs["sharded"] for t in r["step_times"][skip:]]
    pl = [t for r in runs["plain"] for t in r["step_times"][skip:]]
    per_round = [{"ray_elastic": statistics.median(a["step_times"][skip:]),
                  "plain": statistics.median(b["step_times"][skip:])}
                 for a, b in zip(runs["sharded"], runs["plain"])]
    step = {"ray_elastic": steady(el, 0), "plain": steady(pl, 0), "rounds": per_round,
            "replicated": steady(runs["replicated"][0]["step_times"], skip)}
    step["overhead"] = step["ray_elastic"]["median"] / step["plain"]["median"] - 1
    driver = {k: runs[k][0]["driver"] for k in (small_key, "sharded")}
    return {
        "settings": {"quick": quick, "slices": SLICES, "hosts_per_slice": HOSTS, "devices_per_host": 1,
                     "steps": steps, "warmup_skipped": skip, "snapshot_every_replicated": snap,
                     "configs": {k: dataclasses.asdict(c) for k, c in cfgs.items() if c is not None},
                     "driver_small": small_key},
        "sizes": sizes,
        "memory": memory,
        "driver": driver,
        "driver_state_ratio": sizes["big"]["state_bytes"] / sizes[small_key]["state_bytes"],
        "step_time": step,
        "exchange": {"hosts": exchange, "shard_bytes": shard, "ring_bound": 2 * (n - 1) / n * shard,
                     "received_per_step": statistics.median(x["received_per_step"] for x in exchange),
                     "slices": n},
        "runs": runs,
        "wall_s": wall,
    }


def _mb(b) -> str:
    return f"{b / MB:.1f}"


def _steps_memory(mem: dict, big: dict) -> list:
    """Sampled peaks during the steps: a worker's private memory against
    the plain job process's of the same slice and host, and the object
    store's pages it had mapped."""
    lines = ["Memory during the steps (sampled every 20 ms after step 1), MiB: private = RssAnon, "
             "store = RssShmem (Ray's object store pages the worker mapped: its snapshot, the gradient payloads):", "",
             "| slice | host | ray_elastic sharded: private | store | plain jax.distributed: private | "
             "private above plain |", "|---|---|---|---|---|---|"]
    el = sorted(mem["sharded"]["workers"], key=lambda w: (w["slice"], w["host"]))
    for a, b in zip(el, mem["plain"]["workers"]):
        pa, pb = a.get("peak_RssAnon", 0), b.get("peak_RssAnon", 0)
        lines.append(f"| {a['slice']} | {a['host']} | {_mb(pa)} | {_mb(a.get('peak_RssShmem', 0))} | {_mb(pb)} | "
                     f"{_mb(pa - pb)} |")
    st = mem["steps"]
    lines += ["", f"Largest private memory above the plain job's: {_mb(st['private_above_plain_max'])} MiB; "
                  f"largest store share: {_mb(st['sharded_store_max'])} MiB; state per host "
                  f"{_mb(big['host_state_bytes'])} MiB, gradient shard {_mb(big['host_grad_bytes'])} MiB.", ""]
    return lines


def table(r: dict) -> str:
    s, mem = r["sizes"], r["memory"]
    big = s["big"]
    lines = [f"Model: {big['params'] / 1e6:.2f}M params, state (params + Adam) {_mb(big['state_bytes'])} MiB; "
             f"2 slices x 2 hosts x 1 device, FSDP over each slice's 2 hosts "
             f"({_mb(big['host_state_bytes'])} MiB of state per host).", "",
             "Worker peak RSS (VmHWM), MiB:", "",
             "| slice | host | idle baseline (tiny model) | sharded (FSDP) | replicated | "
             "sharded at the end: anon / shmem | replicated at the end: anon / shmem |",
             "|---|---|---|---|---|---|---|"]

    def parts(w):
        return f"{_mb(w.get('RssAnon', 0))} / {_mb(w.get('RssShmem', 0))}"

    for b, sh, rp in zip(mem["baseline"]["workers"], mem["sharded"]["workers"], mem["replicated"]["workers"]):
        lines.append(f"| {sh['slice']} | {sh['host']} | {_mb(b['VmHWM'])} | {_mb(sh['VmHWM'])} | {_mb(rp['VmHWM'])} | "
                     f"{parts(sh)} | {parts(rp)} |")
    base = mem["baseline"]["median_peak"]
    lines.append(f"| max | | {_mb(mem['baseline']['max_peak'])} | {_mb(mem['sharded']['max_peak'])} | "
                 f"{_mb(mem['replicated']['max_peak'])} | | |")
    lines.append(f"| max − baseline median | | | {_mb(mem['sharded']['max_peak'] - base)} | "
                 f"{_mb(mem['replicated']['max_peak'] - base)} | | |")
    lines += ["", f"State per host: sharded {_mb(big['host_state_bytes'])} MiB (state / 2 hosts; the snapshot "
                  f"share is as much again), replicated {_mb(big['state_bytes'])} MiB.", ""]
    if "steps" in mem:
        lines += _steps_memory(mem, big)
    d = r["driver"]
    small = r["settings"]["driver_small"]
    lines += ["Driver RSS during fit (sharded), MiB:", "",
              "| model | state MiB | start | peak | growth |", "|---|---|---|---|---|"]
    for key, name in ((small, small), ("sharded", "big")):
        sz = s[key if key != "sharded" else "big"]
        x = d[key]
        lines.append(f"| {name} | {_mb(sz['state_bytes'])} | {_mb(x['start'])} | {_mb(x['peak'])} | {_mb(x['growth'])} |")
    st = r["step_time"]
    lines += ["", "Median steady-state step time, s (min–max):", "",
              "| system | median | min | max | steps |", "|---|---|---|---|---|"]
    for key, name in (("ray_elastic", "ray_elastic (sharded, FSDP)"), ("plain", "plain jax.distributed (slice x fsdp mesh)"),
                      ("replicated", "ray_elastic (replicated)")):
        x = st[key]
        lines.append(f"| {name} | {x['median']:.3f} | {x['min']:.3f} | {x['max']:.3f} | {x['n']} |")
    lines.append(f"| ray_elastic / plain − 1 | {st['overhead'] * 100:+.1f}% | | | |")
    if len(st["rounds"]) > 1:
        lines.append("")
        lines.append("Per round (alternated): " + ", ".join(
            f"{x['ray_elastic']:.3f} vs {x['plain']:.3f}" for x in st["rounds"]))
    ex = r["exchange"]
    lines += ["", "Cross-slice exchange per step, per host (measured in the workers), MiB:", "",
              "| slice | host | received from the other slice | its gradient shard | ring bound 2(n−1)/n × shard |",
              "|---|---|---|---|---|"]
    for h in ex["hosts"]:
        lines.append(f"| {h['slice']} | {h['host']} | {_mb(h['received_per_step'])} | {_mb(h['own_shard_bytes'])} | "
                     f"{_mb(2 * (ex['slices'] - 1) / ex['slices'] * h['own_shard_bytes'])} |")
    return "\n".join(lines)

"""Durable-checkpoint figures (python -m bench.ckpt [--quick]):

- restore time from local disk and from a GCS-compatible server, in s/GB;
- a preemption checkpoint's commit time after a notice (drain and SIGTERM
  to a worker), on a real local cluster;
- step-time overhead of asynchronous checkpoints every 10 steps, runs with
  and without alternated side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid

from bench.common import ensure_nodes, idle_cpu_load, lm_factory, start_cluster, steady_step_time, summary, write_result


def _big_state(mb: int):
    import numpy as np

    n = mb * 1024 * 1024 // 4 // 16
    rng = np.random.default_rng(0)
    return {"params": {f"w{i}": rng.standard_normal(n).astype(np.float32) for i in range(16)}, "opt_state": [np.asarray(1, np.int32)]}


def restore_rates(mb: int, runs: int) -> dict:
    from ray_elastic.checkpoint import CheckpointStore, refresh_listings
    from tests.fake_gcs import FakeGcs

    state = _big_state(mb)
    gb = mb / 1024
    out = {}
    gcs = FakeGcs().start()
    gcs.point_env()
    gcs.make_bucket("bench")
    try:
        for name, path in (("local", os.path.join(tempfile.mkdtemp(), "ck")), ("gcs", f"gs://bench/{uuid.uuid4().hex[:6]}")):
            store = CheckpointStore(path, keep=1)
            save_s, restore_s = [], []
            for i in range(runs):
                t0 = time.perf_counter()
                store.save(i + 1, state, {})
                save_s.append(time.perf_counter() - t0)
                refresh_listings()
                t0 = time.perf_counter()
                store.restore(i + 1)
                restore_s.append(time.perf_counter() - t0)
            out[name] = {
                "state_mb": mb,
                "save_s_per_gb": summary([s / gb for s in save_s]),
                "restore_s_per_gb": summary([s / gb for s in restore_s]),
            }
            print(f"  {name}: save {statistics.median(save_s) / gb:.2f} s/GB, restore {statistics.median(restore_s) / gb:.2f} s/GB", flush=True)
    finally:
        gcs.stop()
    return out


def preemption_commit(cluster, runs: int) -> dict:
    """Seconds from a preemption notice to the committed checkpoint (2
    slices, replicated: saved from the other slice's copy while the run
    trains on; `run_waited` says whether the run stopped for it)."""
    from ray_elastic import CheckpointConfig, ElasticConfig, ElasticTrainer, Fault
    from ray_elastic.callbacks import FunctionCallback
    from ray_elastic.cluster.drain import drain_node

    rows = {"drain": [], "sigterm_worker": []}
    waited = {k: [] for k in rows}
    for i in range(runs):
        for kind in rows:
            ensure_nodes(cluster, 2)
            path = os.path.join(tempfile.mkdtemp(), "ck")
            faults = (Fault("term", 1, 20),) if kind == "sigterm_worker" else ()
            trainer = ElasticTrainer(
                lm_factory(), ElasticConfig(num_slices=2, policy="resize"), 40,
                checkpoint=CheckpointConfig(path, save_every=1000), faults=faults,
            )
            seen = {}

            def on_step(step, loss, slices, trainer=trainer, seen=seen, kind=kind):
                if kind == "drain" and step == 20 and "t" not in seen:
                    seen["node"] = trainer.hosts(1)[0]["node_id"]
                    seen["t"] = time.time()
                    drain_node(seen["node"], deadline_s=30)

            trainer.add_callback(FunctionCallback(on_step=on_step))
            report = trainer.fit()
            saved = [e for e in report.events if e["event"] == "preempt_saved"]
            if saved:
                rows[kind].append(saved[0]["since_notice_s"])
                waited[kind].append(saved[0].get("run_waited"))
                print(f"  {kind} run {i}: committed {saved[0]['since_notice_s']:.3f} s after the notice "
                      f"(run waited: {saved[0].get('run_waited')})", flush=True)
            if kind == "drain" and "node" in seen:
                cluster.remove_node(seen["node"])
    return {k: {**summary(v), "run_waited": waited[k]} for k, v in rows.items()}


def _pin_threads(pid: int, cpus: set) -> None:
    """Set the CPU affinity of every thread of a process (affinity is per
    thread; threads and processes started later inherit their creator's)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return  # the process ended
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # the thread ended


@contextlib.contextmanager
def _training_on(cpus: set):
    """Confine this driver and every process it started (the local
    cluster: GCS, raylets, workers, and so every worker started later) to
    `cpus` for the block."""
    import psutil

    everything = set(range(os.cpu_count() or 1))
    procs = [psutil.Process()] + psutil.Process().children(recursive=True)
    for p in procs:
        _pin_threads(p.pid, cpus)
    try:
        yield
    finally:
        for p in [psutil.Process()] + psutil.Process().children(recursive=True):
            try:
                _pin_threads(p.pid, everything)
            except (OSError, psutil.Error):
                pass


def _own_core_writer(trainer, cpus: set):
    """A callback moving the checkpoint writer to `cpus` once it exists."""
    from ray_elastic.callbacks import FunctionCallback

    done = []

    def on_step(step, loss, slices):
        if not done and trainer.checkpoints is not None:
            _pin_threads(trainer.checkpoints.writer_pid(), cpus)
            done.append(step)

    return FunctionCallback(on_step=on_step)


ARMS = {
    # name: (checkpoints?, idle-class load?, where training runs)
    "none": (False, False, "shared"),
    "checkpoints": (True, False, "shared"),
    "idle_load": (False, True, "shared"),
    "none_1core": (False, False, "core0"),
    "checkpoints_own_core": (True, False, "core0"),
}


def checkpoint_overhead(cluster, pairs: int, steps: int, own_core: bool = True) -> dict:
    """Step time with asynchronous checkpoints every 10 steps against none,
    alternated, order reversed every other round:

    - shared: everything (driver, workers, writer, Ray) on this machine's
      cores, as in the other benchmarks; with, as a reference, an
      idle-class busy loop instead of checkpoints (what any background
      work costs on shared cores);
    - own core (own_core, 2+ CPUs): the run confined to CPU 0, the writer
      moved to CPU 1, as on a cluster where the writer sits on the head
      node and training on the worker hosts; compared with the same
      confined run without checkpoints.
    """
    from ray_elastic import CheckpointConfig, ElasticConfig, ElasticTrainer

    ensure_nodes(cluster, 2)
    arms = [a for a, (_, _, where) in ARMS.items() if where == "shared" or (own_core and (os.cpu_count() or 1) >= 2)]
    median = {a: [] for a in arms}
    mean = {a: [] for a in arms}
    for i in range(pairs):
        for arm in (arms if i % 2 == 0 else list(reversed(arms))):
            with_ckpt, load, where = ARMS[arm]
            ck = CheckpointConfig(os.path.join(tempfile.mkdtemp(), "ck"), save_every=10, save_at_end=False) if with_ckpt else None
            trainer = ElasticTrainer(lm_factory(), ElasticConfig(num_slices=2, policy="resize"), steps, checkpoint=ck)
            if where == "core0" and with_ckpt:
                trainer.add_callback(_own_core_writer(trainer, {1}))
            with (idle_cpu_load() if load else contextlib.nullcontext()), \
                    (_training_on({0}) if where == "core0" else contextlib.nullcontext()):
                report = trainer.fit()
            median[arm].append(steady_step_time(report))
            mean[arm].append(statistics.fmean(report.step_times[5:]))
        print(f"  round {i}: " + ", ".join(f"{a} {median[a][-1] * 1e3:.1f} ms/step" for a in arms), flush=True)

    def over(arm, base, of=median):
        return summary(of[arm])["median"] / summary(of[base])["median"] - 1.0

    out = {
        "step_time_s": {a: summary(median[a]) for a in arms},
        "step_time_with_s": summary(median["checkpoints"]),
        "step_time_without_s": summary(median["none"]),
        "overhead": over("checkpoints", "none"),
        "overhead_by_mean": over("checkpoints", "none", mean),
        "idle_load_overhead": over("idle_load", "none"),
    }
    if "checkpoints_own_core" in arms:
        out["overhead_own_core"] = over("checkpoints_own_core", "none_1core")
        out["overhead_own_core_by_mean"] = over("checkpoints_own_core", "none_1core", mean)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ckpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="reports/bench")
    a = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)
    os.makedirs(a.out, exist_ok=True)
    result = {"restore": restore_rates(mb=64 if a.quick else 256, runs=2 if a.quick else 3)}
    cluster = start_cluster(2)
    try:
        result["preemption_commit_s"] = preemption_commit(cluster, runs=1 if a.quick else 3)
        result["checkpoint_overhead"] = checkpoint_overhead(cluster, pairs=2 if a.quick else 6, steps=150 if a.quick else 300)
    finally:
        cluster.shutdown()
    r = result
    lines = [
        "| figure | median [min–max] | target |",
        "|---|---|---|",
    ]
    for name in ("local", "gcs"):
        x = r["restore"][name]
        lines.append(f"| restore from {name} ({x['state_mb']} MB state) | {x['restore_s_per_gb']['median']:.2f} s/GB [{x['restore_s_per_gb']['min']:.2f}–{x['restore_s_per_gb']['max']:.2f}] | report |")
        lines.append(f"| save to {name} | {x['save_s_per_gb']['median']:.2f} s/GB | |")
    for kind, s in r["preemption_commit_s"].items():
        if s.get("n"):
            how = "the run waited" if any(s.get("run_waited") or ()) else "beside training"
            lines.append(f"| preemption checkpoint committed after notice ({kind}, {how}) | "
                         f"{s['median']:.3f} s [{s['min']:.3f}–{s['max']:.3f}] | ≤ 5 s |")
    o = r["checkpoint_overhead"]
    lines.append(f"| step time, async checkpoint every 10 steps | {o['step_time_with_s']['median'] * 1e3:.1f} ms | |")
    lines.append(f"| step time, no checkpoints | {o['step_time_without_s']['median'] * 1e3:.1f} ms | |")
    lines.append(f"| checkpoint overhead (ratio of medians) | {o['overhead'] * 100:+.1f} % (by mean {o['overhead_by_mean'] * 100:+.1f} %) | ≤ 5 % |")
    lines.append(f"| reference: an idle-class busy loop on the same cores, no checkpoints | {o['idle_load_overhead'] * 100:+.1f} % | |")
    if "overhead_own_core" in o:
        st = o["step_time_s"]
        lines.append(f"| step time, run on CPU 0, writer on CPU 1 / no checkpoints | {st['checkpoints_own_core']['median'] * 1e3:.1f} / {st['none_1core']['median'] * 1e3:.1f} ms | |")
        lines.append(f"| checkpoint overhead, writer on its own core (as on a head node) | {o['overhead_own_core'] * 100:+.1f} % (by mean {o['overhead_own_core_by_mean'] * 100:+.1f} %) | ≤ 5 % |")
    text = "\n".join(lines)
    print(text)
    write_result(a.out, "ckpt", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The peers, measured on the same local cluster, model and faults as ray_elastic:

- `run_raytrain`: Ray Train v2's `JaxTrainer` (one `jax.distributed` group
  over all workers), recovering with `FailureConfig(max_failures=...)` from
  its last reported checkpoint, or with elastic
  `ScalingConfig(num_workers=(1, n))`;
- `run_full_restart`: "just restart the job": a plain multi-process JAX job
  (no Ray) that checkpoints every N steps; when it fails, it is started
  again at once and restores its last checkpoint.

Both train `examples.lm.make_program(LMConfig())` with the same data as a
ray_elastic run: step k's global batch is shards 0..n-1 of `make_batch(seed,
k, shard, n)`, split over the workers of the group, and the gradient is the
mean over the global batch (one jitted step on a global mesh).

Every process appends JSON lines to one log file (all nodes are on this
machine): `start` (pid, rank, node), `restore` (checkpoint step), `step`
(completed step count, its duration), and, from a Ray Train controller
callback, `detect` (the controller saw a worker error). The driver watches
that file to inject the fault when rank 1 completes step `fail_at`, then
builds the timeline and the figures from it.

Figures (as in ray_elastic's report): `fault_t` (s since start), `detected_s`
(fault to the controller's first error; None when not observable),
`recovered_s` (fault to the first step completed by the restarted group),
`steps_rewound` (steps reached before the fault + 1 in flight - the
checkpoint step restored), `goodput` (time in the kept steps / wall time),
`step_time_s` (median step time, warm-up after each start skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ray_elastic.paths import work_path  # noqa: E402

__all__ = ["SCENARIOS", "run_raytrain", "run_full_restart"]

SCENARIOS = ("kill", "stop", "remove_node", "preempt")
SEED = 0
COMPILE_CACHE_DIR = work_path("xla-cache")
_POLL_S = 0.05


# --------------------------------------------------------------------------
# The event log shared by every process of a run.
# --------------------------------------------------------------------------


def _log(path: str, **record) -> None:
    """Append one JSON line (one write on an O_APPEND file: lines from
    several processes never interleave)."""
    record.setdefault("t", time.time())
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class _LogTail:
    """Reads the complete lines appended since the last call."""

    def __init__(self, path: str):
        self.path, self._offset, self.events = path, 0, []

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        new = []
        for line in data[:end].splitlines():
            try:
                new.append(json.loads(line))
            except ValueError:
                pass
        self.events.extend(new)
        return new


# --------------------------------------------------------------------------
# The training loop, shared by the Ray Train workers and the plain job.
# --------------------------------------------------------------------------


def _train_loop(
    cfg: dict,
    rank: int,
    world: int,
    restore: Callable[[], Optional[tuple[int, list]]],
    report: Callable[[int, float, Optional[list]], None],
    preempted: Optional[Callable[[], bool]] = None,
) -> None:
    """Train cfg["steps"] steps from the restored state (or step 0).

    `restore()` gives (step, leaves as numpy) or None; `report(step, loss,
    leaves or None)` is called every cfg["report_every"] steps (default: with
    each checkpoint), with the leaves every cfg["checkpoint_every"] steps and
    at the end. Every step is logged whatever the reporting.
    `preempted()` (Ray Train: a barrier over all workers) is asked at every
    report; the first time it says yes, that report carries a checkpoint (a
    just-in-time checkpoint), and training goes on, as Ray Train advises.
    """
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import examples.lm as lm

    log = cfg["log"]
    phases, t_phase = {}, time.time()

    def phase(name):
        nonlocal t_phase
        now = time.time()
        phases[name] = round(now - t_phase, 3)
        t_phase = now

    if cfg.get("compile_cache_dir"):
        jax.config.update("jax_compilation_cache_dir", cfg["compile_cache_dir"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    program = lm.make_program(lm.LMConfig())
    lm.encoded_corpus(lm.LMConfig().corpus_seed, lm.LMConfig().corpus_chars)
    phase("program")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    by_data = NamedSharding(mesh, PartitionSpec("data"))

    # The global batch is num_shards shards, as in a ray_elastic run with
    # num_shards slices; a smaller group (elastic) takes several shards per
    # worker. Uneven splits fall back to one shard per worker.
    num_shards = cfg["num_shards"]
    if num_shards % world:
        num_shards = world
    mine = list(range(rank, num_shards, world))

    def global_batch(step: int) -> dict:
        parts = [program.make_batch(SEED, step, s, num_shards) for s in mine]
        local = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return {k: jax.make_array_from_process_local_data(by_data, v) for k, v in local.items()}

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(program.loss_fn)(params, batch)
        updates, opt_state = program.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.jit(program.init_params, out_shardings=replicated)(jax.random.PRNGKey(SEED))
    opt_state = jax.jit(program.optimizer.init, out_shardings=replicated)(params)
    jax.block_until_ready((params, opt_state))
    phase("init")
    # Compiled ahead of time, as ray_elastic's workers do: step times below
    # never include compilation.
    step_fn = (
        jax.jit(train_step, out_shardings=(replicated,) * 3, donate_argnums=(0, 1))
        .lower(params, opt_state, global_batch(0))
        .compile()
    )
    phase("compile")
    leaves, treedef = jax.tree.flatten((params, opt_state))
    start = 0
    state = restore()
    if state is not None:
        start, arrays = state
        if len(arrays) != len(leaves):
            raise RuntimeError(f"checkpoint has {len(arrays)} arrays, the state {len(leaves)}")
        leaves = [
            jax.make_array_from_callback(a.shape, replicated, lambda idx, a=a: a[idx]) for a in arrays
        ]
        params, opt_state = jax.tree.unflatten(treedef, leaves)
        _log(log, ev="restore", rank=rank, step=start, pid=os.getpid())
    phase("restore")
    _log(log, ev="ready", rank=rank, pid=os.getpid(), phases=phases)

    def host(a):
        return np.array(a.addressable_data(0), copy=True)  # replicated: the local copy is all of it

    steps, every = cfg["steps"], cfg["checkpoint_every"]
    report_every = cfg.get("report_every") or every or 1
    t_prev = time.time()
    jit_saved = False
    for k in range(start, steps):
        params, opt_state, loss = step_fn(params, opt_state, global_batch(k))
        loss = float(np.asarray(loss.addressable_data(0)))
        done = k + 1
        save = every > 0 and (done % every == 0 or done == steps)
        if preempted is not None and not jit_saved and done % report_every == 0 and preempted():
            jit_saved = save = True
            if rank == 0:
                _log(log, ev="detect", ranks=[], error=["preemption notice"], step=done)
        if save or done % report_every == 0:
            report(done, loss, [host(a) for a in jax.tree.leaves((params, opt_state))] if save else None)
        t = time.time()
        _log(log, ev="step", rank=rank, step=done, dur=t - t_prev, loss=loss, pid=os.getpid(), world=world)
        t_prev = t


def _save_npz(path: str, step: int, arrays: list) -> None:
    import numpy as np

    tmp = path + ".tmp.npz"
    np.savez(tmp, *arrays, step=np.int64(step))
    os.replace(tmp, path)  # atomic: a reader sees a whole checkpoint or none


def _load_npz(path: str) -> tuple[int, list]:
    import numpy as np

    with np.load(path) as z:
        n = sum(1 for name in z.files if name.startswith("arr_"))
        return int(z["step"]), [z[f"arr_{i}"] for i in range(n)]


# --------------------------------------------------------------------------
# Ray Train v2.
# --------------------------------------------------------------------------


def _raytrain_worker(cfg: dict) -> None:
    """Ray Train's train_loop_per_worker (jax.distributed is already up)."""
    import ray
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    _log(cfg["log"], ev="start", rank=rank, world=world, pid=os.getpid(),
         node=ray.get_runtime_context().get_node_id())
    scratch = tempfile.mkdtemp(prefix=f"ckpt-r{rank}-", dir=cfg["scratch"])

    def restore():
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return None
        with ckpt.as_directory() as d:
            return _load_npz(os.path.join(d, "state.npz"))

    def report(step, loss, arrays):
        checkpoint, d = None, None
        if arrays is not None and rank == 0:
            d = tempfile.mkdtemp(dir=scratch)
            _save_npz(os.path.join(d, "state.npz"), step, arrays)
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"step": step, "loss": loss}, checkpoint=checkpoint)
        if d is not None:
            import shutil

            shutil.rmtree(d, ignore_errors=True)

    def preempted():
        return ray.train.get_preemption_info() is not None

    _train_loop(cfg, rank, world, restore, report,
                preempted=preempted if cfg.get("jit_checkpoint") else None)


def _detect_callback(log_path: str):
    """A controller-side callback that logs every worker error the
    controller sees (a failed or timed-out health check, or a raised
    exception): the first one after the fault is the detection."""
    from ray.train import UserCallback

    class _Detect(UserCallback):
        def after_exception(self, run_context, worker_exceptions):
            _log(log_path, ev="detect", ranks=sorted(worker_exceptions),
                 error=sorted({type(e).__name__ for e in worker_exceptions.values()}))

    return _Detect()


def run_raytrain(
    cluster,
    scenario: str,
    steps: int,
    fail_at: int,
    num_workers: int = 2,
    checkpoint_every: int = 10,
    elastic: bool = False,
    *,
    max_failures: int = 3,
    report_every: Optional[int] = None,
    health_check_interval_s: Optional[float] = None,
    hang_timeout_s: Optional[float] = 30.0,
    resize_interval_s: float = 10.0,
    preempt_deadline_s: float = 10.0,
    jit_checkpoint: bool = True,
    replacement_after_s: float = 30.0,
    time_limit_s: float = 600.0,
    compile_cache_dir: Optional[str] = COMPILE_CACHE_DIR,
) -> dict:
    """One Ray Train v2 JaxTrainer run on `cluster` (a connected LocalCluster)
    with one fault at `fail_at`; figures as in the module docstring.

    scenario: "kill" (SIGKILL of rank 1), "stop" (SIGSTOP of rank 1: a hang),
    "remove_node" (rank 1's node and its processes go; a replacement node is
    added at once, or, when elastic, once training has resumed or at the
    latest `replacement_after_s` after the fault), "preempt"
    (a Ray drain notice, reason preemption, for rank 1's node with a
    deadline `preempt_deadline_s` away; a replacement node is added at the
    notice and the drained node removed at the deadline; with
    `jit_checkpoint` the workers ask `ray.train.get_preemption_info()` at
    every report and save a just-in-time checkpoint on the first notice, as
    Ray Train advises), or "none".
    report_every: steps between `ray.train.report` calls (default: with each
    checkpoint). Ray Train v2 keeps one unconsumed report per worker and the
    controller takes one per health-check poll (every 2 s by default), so
    reporting every step caps training at one step per poll interval.
    health_check_interval_s: RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray: 2 s);
    None keeps Ray's setting.
    hang_timeout_s: RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S for the run
    (Ray's default is 600 s); None keeps Ray's setting.
    The run is ended after time_limit_s whatever happens.
    """
    import ray
    import ray.cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxConfig, JaxTrainer

    from bench.common import ensure_nodes

    if scenario not in SCENARIOS + ("none",):
        raise ValueError(f"scenario must be one of {SCENARIOS + ('none',)}, got {scenario!r}")
    if num_workers < 2 and scenario != "none":
        raise ValueError("the fault hits rank 1: num_workers must be >= 2")
    # The train function and the callback travel by value: `bench` is not
    # importable on the workers or the controller.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    ensure_nodes(cluster, num_workers)
    tmp = tempfile.mkdtemp(prefix="bench-raytrain-")
    log_path = os.path.join(tmp, "events.jsonl")
    cfg = {
        "log": log_path,
        "scratch": tmp,
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "report_every": report_every,
        "num_shards": num_workers,
        "compile_cache_dir": compile_cache_dir,
        "jit_checkpoint": scenario == "preempt" and jit_checkpoint,
    }
    trainer = JaxTrainer(
        _raytrain_worker,
        train_loop_config=cfg,
        # use_gpu=True with JAX_PLATFORMS=cpu: Ray Train's JAX backend then
        # runs jax.distributed.initialize over the workers, on CPU.
        jax_config=JaxConfig(use_gpu=True),
        scaling_config=ScalingConfig(
            num_workers=(1, num_workers) if elastic else num_workers,
            resources_per_worker={"CPU": 1},
            elastic_resize_monitor_interval_s=resize_interval_s,
        ),
        run_config=RunConfig(
            name=f"bench-{scenario}-{os.getpid()}-{int(time.time())}",
            storage_path=os.path.join(tmp, "storage"),
            failure_config=FailureConfig(max_failures=max_failures, controller_failure_limit=0),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=[_detect_callback(log_path)],
            # `examples` comes with the job's runtime env (py_modules, set
            # when the driver connected: bench.common.start_cluster).
            worker_runtime_env={
                "env_vars": {"JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"},
            },
        ),
    )

    # Ray Train reads these in the driver and passes them on to its
    # controller and workers.
    env = {
        "RAY_TRAIN_V2_ENABLED": "1",  # the default in ray 2.60; explicit
        # Ray's state API (LocalCluster.remove_node lists the node's actors)
        # must find this cluster even when other Ray clusters run here.
        "RAY_ADDRESS": cluster.address,
    }
    if hang_timeout_s is not None:
        env["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(hang_timeout_s)
    if health_check_interval_s is not None:
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(health_check_interval_s)
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    box: dict = {}

    def fit():
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 (reported in the result)
            box["error"] = e
        box["t_end"] = time.time()

    tail = _LogTail(log_path)
    fault = {}  # t, pid, node, rank0_pid
    stopped: list[int] = []
    replacement_pending = False
    drained: dict = {}  # node, remove_at (epoch s): a drained node still in the cluster
    notes: list[str] = []
    t0 = time.time()
    thread = threading.Thread(target=fit, name="raytrain-fit", daemon=True)
    thread.start()
    try:
        starts: dict[int, dict] = {}
        while thread.is_alive():
            if replacement_pending and fault and time.time() - fault["t"] >= replacement_after_s:
                # The cloud's replacement arrives anyway (an autoscaler would
                # bring one): an elastic restart that waits for both workers
                # would otherwise wait forever.
                replacement_pending = False
                cluster.add_node()
                notes.append(f"training had not resumed {replacement_after_s:.0f} s after the node loss: "
                             "the replacement node was added then")
            if drained and time.time() >= drained["remove_at"]:
                cluster.remove_node(drained.pop("node"))  # the deadline: the cloud takes it
                drained.clear()
            for e in tail.poll():
                if e["ev"] == "start":
                    starts[e["rank"]] = e
                elif (e["ev"] == "step" and e["rank"] == 1 and e["step"] == fail_at
                      and not fault and scenario != "none"):
                    victim = starts[1]
                    fault.update(t=time.time(), pid=victim["pid"], node=victim["node"],
                                 rank0_pid=starts[0]["pid"])
                    if scenario == "kill":
                        os.kill(victim["pid"], signal.SIGKILL)
                    elif scenario == "stop":
                        os.kill(victim["pid"], signal.SIGSTOP)
                        stopped.append(victim["pid"])
                    elif scenario == "preempt":
                        from ray_elastic.cluster.drain import drain_node

                        if not drain_node(victim["node"], deadline_s=preempt_deadline_s):
                            notes.append("Ray refused the drain request")
                        drained.update(node=victim["node"], remove_at=fault["t"] + preempt_deadline_s)
                        cluster.add_node()  # the replacement capacity, at the notice
                    else:  # remove_node: from this (the main) thread, as Ray requires
                        cluster.remove_node(victim["node"])
                        if elastic:
                            replacement_pending = True  # once training has resumed
                        else:
                            cluster.add_node()  # a fixed-size group cannot restart without it
                elif (e["ev"] == "step" and replacement_pending and fault
                      and e["t"] > fault["t"] and e["pid"] != fault["rank0_pid"]):
                    replacement_pending = False
                    cluster.add_node()
            if time.time() - t0 > time_limit_s:
                notes.append(f"ended by the bench's time limit ({time_limit_s:.0f} s)")
                _abort_train_run(cluster.address, stopped)
                thread.join(60)
                break
            time.sleep(_POLL_S)
        thread.join(5.0)
        if thread.is_alive():
            notes.append("JaxTrainer.fit() had not returned when the bench gave up on it")
    finally:
        for pid in stopped:  # a frozen worker Ray did not clean up
            _kill_quietly(pid)
        if drained.get("node") in cluster.nodes:  # never leave a drained node behind
            cluster.remove_node(drained["node"])
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    tail.poll()
    t_end = box.get("t_end", time.time())
    error = box.get("error")
    out = _figures(tail.events, t0, t_end, fault.get("t"), fault.get("rank0_pid"))
    if scenario == "stop" and fault and out["detected_s"] is None:
        notes.append("hang not detected within the bench's time limit")
    out.update(
        system="raytrain-elastic" if elastic else "raytrain",
        scenario=scenario,
        steps_requested=steps,
        fail_at=fail_at,
        num_workers=num_workers,
        checkpoint_every=checkpoint_every,
        settings={"max_failures": max_failures, "hang_timeout_s": hang_timeout_s,
                  "report_every": report_every or checkpoint_every or 1,
                  "health_check_interval_s": health_check_interval_s,
                  "resize_interval_s": resize_interval_s if elastic else None,
                  "preempt_deadline_s": preempt_deadline_s if scenario == "preempt" else None,
                  "jit_checkpoint": cfg["jit_checkpoint"]},
        error=None if error is None else f"{type(error).__name__}: {str(error)[:500]}",
        notes=notes,
        workdir=tmp,
    )
    return out


def _abort_train_run(address: str, stopped: list[int]) -> None:
    """End a Ray Train run that outlived the bench's limit: kill the frozen
    worker and the run's controller (its workers and placement group share
    its fate), by pid."""
    from ray.util.state import list_actors

    for pid in stopped:
        _kill_quietly(pid)
    alive = [("class_name", "=", "TrainController"), ("state", "=", "ALIVE")]
    for actor in list_actors(address=address, filters=alive):
        if getattr(actor, "pid", None):
            _kill_quietly(int(actor.pid))


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------
# Figures from the event log.
# --------------------------------------------------------------------------


def _figures(events: list[dict], t0: float, t_end: float, fault_t: Optional[float],
             old_rank0_pid: Optional[int], skip_first: int = 3) -> dict:
    """Timeline, markers and figures from a run's events (epoch times)."""
    events = sorted(events, key=lambda e: e["t"])
    rel = lambda t: round(t - t0, 4)  # noqa: E731
    steps0 = [e for e in events if e["ev"] == "step" and e["rank"] == 0]
    timeline = [[rel(e["t"]), e["step"]] for e in steps0]
    markers = []
    out = {
        "steps_completed": steps0[-1]["step"] if steps0 else 0,
        "wall_s": round(t_end - t0, 3),
        "fault_t": None if fault_t is None else rel(fault_t),
        "detected_s": None,
        "recovered_s": None,
        "steps_rewound": None,
    }
    if fault_t is not None:
        markers.append({"t": rel(fault_t), "event": "fault"})
        detects = [e for e in events if e["ev"] == "detect" and e["t"] >= fault_t]
        if detects:
            out["detected_s"] = round(detects[0]["t"] - fault_t, 4)
            markers.append({"t": rel(detects[0]["t"]), "event": "detect"})
        before = [e["step"] for e in steps0 if e["pid"] == old_rank0_pid]
        last_before = max(before) if before else 0
        after = [e for e in steps0 if e["t"] > fault_t and e["pid"] != old_rank0_pid]
        if after:
            out["recovered_s"] = round(after[0]["t"] - fault_t, 4)
        restores = [e for e in events if e["ev"] == "restore" and e["rank"] == 0 and e["t"] > fault_t]
        restarted = [e for e in events if e["ev"] == "start" and e["rank"] == 0 and e["t"] > fault_t]
        if restarted:
            first_restore = restores[0]["step"] if restores and restores[0]["pid"] == restarted[0]["pid"] else 0
            out["steps_rewound"] = last_before + 1 - first_restore
        for e in restarted:
            markers.append({"t": rel(e["t"]), "event": "restart", "world": e.get("world")})
        for e in restores:
            markers.append({"t": rel(e["t"]), "event": "restore", "step": e["step"]})
    # The kept steps are each step's last completion.
    kept: dict[int, float] = {}
    for e in steps0:
        kept[e["step"]] = e["dur"]
    productive = sum(d for s, d in kept.items() if s <= out["steps_completed"])
    # Steady state: skip the first steps after each (re)start of the group.
    durations, seen = [], {}
    for e in steps0:
        seen[e["pid"]] = seen.get(e["pid"], 0) + 1
        if seen[e["pid"]] > skip_first:
            durations.append(e["dur"])
    out.update(
        goodput=round(productive / out["wall_s"], 4) if out["wall_s"] > 0 else 0.0,
        productive_s=round(productive, 3),
        step_time_s=round(statistics.median(durations), 5) if durations else None,
        steps_redone_total=len(steps0) - out["steps_completed"],
        restarts=sum(1 for m in markers if m["event"] == "restart"),
        timeline=timeline,
        markers=sorted(markers, key=lambda m: m["t"]),
    )
    return out


# --------------------------------------------------------------------------
# The "just restart the job" baseline: a plain multi-process JAX job.
# --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_worker(args) -> int:
    """One process of the plain job: a jax.distributed member."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.workers, process_id=args.rank)
    cfg = {
        "log": args.log,
        "steps": args.steps,
        "checkpoint_every": args.every,
        "num_shards": args.workers,
        "compile_cache_dir": args.compile_cache_dir or None,
    }
    _log(args.log, ev="start", rank=args.rank, world=args.workers, pid=os.getpid(), node="local")

    def restore():
        names = [n for n in os.listdir(args.ckpt) if n.startswith("state-") and n.endswith(".npz")
                 and ".tmp" not in n]
        if not names:
            return None
        latest = max(names, key=lambda n: int(n[len("state-"):-len(".npz")]))
        return _load_npz(os.path.join(args.ckpt, latest))

    def report(step, loss, arrays):
        if arrays is not None and args.rank == 0:
            _save_npz(os.path.join(args.ckpt, f"state-{step}.npz"), step, arrays)

    _train_loop(cfg, args.rank, args.workers, restore, report)
    jax.distributed.shutdown()
    return 0


def _job_driver(args) -> int:
    """The job: starts its workers; when one fails, ends the others and
    fails (the job scheduler restarts it)."""
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = []
    for rank in range(args.workers):
        cmd = [sys.executable, "-m", "bench.raytrain", "job-worker", "--rank", str(rank),
               "--coordinator", coordinator, "--workers", str(args.workers), "--steps", str(args.steps),
               "--every", str(args.every), "--log", args.log, "--ckpt", args.ckpt,
               "--compile-cache-dir", args.compile_cache_dir]
        procs.append(subprocess.Popen(cmd, cwd=ROOT))
    rc = 0
    while procs:
        for p in list(procs):
            code = p.poll()
            if code is None:
                continue
            procs.remove(p)
            if code != 0:
                rc = 1
                for q in procs:
                    q.kill()
                for q in procs:
                    q.wait()
                procs = []
                break
        time.sleep(_POLL_S)
    return rc


def run_full_restart(
    steps: int,
    fail_at: int,
    num_workers: int = 2,
    checkpoint_every: int = 10,
    scenario: str = "kill",
    *,
    time_limit_s: float = 600.0,
    compile_cache_dir: Optional[str] = COMPILE_CACHE_DIR,
) -> dict:
    """The "restart the job" baseline, same model, data and figures.

    The job is a driver process with `num_workers` JAX processes
    (`jax.distributed`, no Ray). scenario "kill": SIGKILL of rank 1 when it
    completes `fail_at`; the driver sees it, ends the job and fails.
    "kill_driver": SIGKILL of the whole job (driver and workers). Either
    way the job is started again at once and restores its last checkpoint;
    `detected_s` is the fault to the job's exit (what a scheduler sees).
    """
    if scenario not in ("kill", "kill_driver", "none"):
        raise ValueError(f"scenario must be 'kill', 'kill_driver' or 'none', got {scenario!r}")
    tmp = tempfile.mkdtemp(prefix="bench-restart-")
    log_path, ckpt = os.path.join(tmp, "events.jsonl"), os.path.join(tmp, "ckpt")
    os.makedirs(ckpt)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    cmd = [sys.executable, "-m", "bench.raytrain", "job", "--workers", str(num_workers),
           "--steps", str(steps), "--every", str(checkpoint_every), "--log", log_path, "--ckpt", ckpt,
           "--compile-cache-dir", compile_cache_dir or ""]

    launches = []

    def launch():
        # Its own session: the whole job can be killed as one group. Its
        # output (a killed peer makes the others print errors) goes to a file.
        with open(os.path.join(tmp, f"job-{len(launches)}.log"), "wb") as out:
            launches.append(time.time())
            return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                                    stdout=out, stderr=subprocess.STDOUT)

    tail = _LogTail(log_path)
    fault: dict = {}
    detect_t = None
    notes: list[str] = []
    starts: dict[int, dict] = {}
    t0 = time.time()
    job = launch()
    try:
        while True:
            for e in tail.poll():
                if e["ev"] == "start":
                    starts[e["rank"]] = e
                elif (e["ev"] == "step" and e["rank"] == 1 and e["step"] == fail_at
                      and not fault and scenario != "none"):
                    fault.update(t=time.time(), rank0_pid=starts[0]["pid"])
                    if scenario == "kill":
                        _kill_quietly(starts[1]["pid"])
                    else:
                        os.killpg(job.pid, signal.SIGKILL)
            code = job.poll()
            if code == 0:
                break
            if code is not None:
                if fault and detect_t is None:
                    detect_t = time.time()
                    _log(log_path, ev="detect", ranks=[], error=[f"job exit {code}"], t=detect_t)
                job = launch()  # the scheduler restarts the failed job at once
            if time.time() - t0 > time_limit_s:
                notes.append(f"ended by the bench's time limit ({time_limit_s:.0f} s)")
                break
            time.sleep(_POLL_S)
    finally:
        if job.poll() is None:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.wait()
    t_end = time.time()
    tail.poll()
    out = _figures(tail.events, t0, t_end, fault.get("t"), fault.get("rank0_pid"))
    out.update(
        system="full-restart",
        scenario=scenario,
        steps_requested=steps,
        fail_at=fail_at,
        num_workers=num_workers,
        checkpoint_every=checkpoint_every,
        settings={},
        error=None if out["steps_completed"] >= steps else "did not finish",
        notes=notes,
        workdir=tmp,
    )
    return out


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.raytrain")
    parser.add_argument("role", choices=("job", "job-worker"))
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--compile-cache-dir", default="")
    args = parser.parse_args(argv)
    return _job_driver(args) if args.role == "job" else _job_worker(args)


if __name__ == "__main__":
    from bench import raytrain as _self  # the module by its name, not __main__

    sys.exit(_self._main())

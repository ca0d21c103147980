"""One variant of `python -m bench tpu`, in a process of its own (JAX's
device peak is a peak over the process's life: one variant a process).

It runs where no Ray cluster can (the TPU machine opens no socket): the
SliceWorkers are driven in this process as the controller drives its
actors (each gradient call, then each apply with the chunks the exchange
plan routes to it), with Ray only imported.

    python -m bench.tpu_variant --variant V --config JSON --steps N --cache DIR --out FILE

Variants (every one the same global batch: SHARDS shards of the example
LM's make_batch, concatenated for plain):
- plain: one jax.jit of loss, gradient and optax update, state donated;
- plain_micro: the same with the shards as microbatches, summed in the jit;
- one_slice: one SliceWorker computing every shard (compute_grads, apply);
- one_slice_micro: the same, each shard scanned in 2 microbatches;
- one_slice_apart: one_slice with the update a program of its own
  (one_slice_program="update_apart": bitwise any slice count's state);
- diloco: one SliceWorker's DiLoCo inner steps on every shard, an outer
  step after every ROUND of them (timed apart; the inner steps' device
  peak taken before the first);
- two_slices: two SliceWorkers sharing the devices, one shard each, the
  exchange the controller plans for two slices (each sends its sum once,
  each apply takes the other's), with the split: compute, copies out and
  in, sums, update (timed with waits, in this variant only), and one raw
  copy of the gradient each way for the target;
- snapshot: one_slice with an in-memory snapshot begun every SNAP_EVERY
  steps and copied out on a thread of its own (the actor's snapshot
  thread): steps with a snapshot in flight against those without;
- checkpoint: one_slice, then its state saved with Orbax to local disk
  and restored into a fresh worker (seconds and bytes).

Writes {"step_times", "losses", "device_peak_bytes", "host_peak_bytes",
"bytes_off_device", "copy_s", ...} to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SHARDS = 2
SNAP_EVERY = 5
ROUND = 5  # DiLoCo's inner steps between two outer steps


def _block(tree) -> None:
    import jax

    jax.block_until_ready(tree)


def _plain(program, cfg, steps: int, micro: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    rng = jax.random.PRNGKey(0)
    params = jax.jit(program.init_params)(rng)
    opt_state = jax.jit(program.optimizer.init)(params)

    def loss_of(p, batch):
        return program.loss_fn(p, batch)

    def train_step(params, opt_state, batches):
        if micro:  # the shards as microbatches: their gradients summed in the program
            def one(acc, b):
                loss, g = jax.value_and_grad(loss_of)(params, b)
                return jax.tree.map(jnp.add, acc, g), loss
            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, losses = jax.lax.scan(one, zeros, batches)
            grads = jax.tree.map(lambda g: g / SHARDS, grads)
            loss = jnp.mean(losses)
        else:
            whole = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), batches)
            loss, grads = jax.value_and_grad(loss_of)(params, whole)
        updates, opt_state = program.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step_fn = jax.jit(train_step, donate_argnums=(0, 1))

    def batches(step: int):
        parts = [program.make_batch(0, step, s, SHARDS) for s in range(SHARDS)]
        return {k: np.stack([np.asarray(b[k]) for b in parts]) for k in parts[0]}

    try:  # the program's scratch (XLA's memory analysis), which the device peak of buffers leaves out
        analysis = step_fn.lower(params, opt_state, batches(0)).compile().memory_analysis()
        scratch = int(analysis.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without the analysis
        scratch = None
    times, losses = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step_fn(params, opt_state, batches(step))
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
    return {"step_times": times, "losses": losses, "bytes_off_device": 0, "copy_s": 0.0, "scratch_bytes": scratch}


def _worker(factory, slice_id: int, cache: str):
    from ray_elastic.worker.actor import SliceWorker

    w = SliceWorker(slice_id, 0, 1, factory, 0, SHARDS)
    w.setup(None, cache)
    return w


def _plan(chunks: int, blocks: int, program: str = "auto"):
    from ray_elastic.dispatch.exchange_plan import ExchangePlan

    return ExchangePlan(chunks=chunks, blocks=blocks, shards=tuple(range(SHARDS)), fan_in=8, step_program=program)


def _sent(chunks) -> int:
    return sum(int(a.nbytes) for c in chunks if c for segs in c["pieces"].values() for a in segs)


def _one_slice(factory, steps: int, cache: str, snapshot: bool = False, program: str = "auto") -> dict:
    w = _worker(factory, 0, cache)
    plan = _plan(1, 1, program)
    times, losses, sent, in_flight = [], [], 0, []
    snap: dict = {"thread": None, "seconds": []}

    def copy_out(k):
        t0 = time.perf_counter()
        status, state = w.snapshot(k)
        snap["seconds"].append(time.perf_counter() - t0)
        snap["bytes"] = status["bytes"]

    for k in range(steps):
        t0 = time.perf_counter()
        busy = snap["thread"] is not None and snap["thread"].is_alive()
        _, *chunks = w.compute_grads(k, tuple(range(SHARDS)), plan=plan)
        take = snapshot and k > 0 and k % SNAP_EVERY == 0 and not busy
        m = w.apply(k, take, list(chunks))
        _block(w.params)
        times.append(time.perf_counter() - t0)
        losses.append(m["loss"])
        sent += _sent(chunks)
        in_flight.append(busy)
        if take:
            snap["thread"] = threading.Thread(target=copy_out, args=(k,))
            snap["thread"].start()
    if snap["thread"] is not None:
        snap["thread"].join()
    out = {"step_times": times, "losses": losses, "bytes_off_device": sent / steps, "copy_s": 0.0}
    if snapshot:
        out.update(snapshot_in_flight=in_flight, snapshot_s=snap["seconds"], snapshot_bytes=snap.get("bytes", 0))
    out["worker"] = w
    return out


def _diloco(factory, steps: int, cache: str) -> dict:
    """Inner steps, with an outer step (one replica: its delta out and
    the mean applied) after every ROUND of them. The device peak of the
    first round's inner steps is kept apart from the run's, which the
    outer steps may raise."""
    import jax

    from ray_elastic.dispatch.outer_spec import OuterSpec

    w = _worker(factory, 0, cache)
    from ray_elastic.dispatch.exchange_plan import ExchangePlan

    spec = OuterSpec(0.3, 0.9)
    plan = ExchangePlan(chunks=1, blocks=1, shards=(0,), fan_in=8)  # the replicas' deltas: one replica
    times, losses, outer_s, inner_peak = [], [], [], None
    for k in range(steps):
        t0 = time.perf_counter()
        m = w.inner_step(k, tuple(range(SHARDS)), spec)
        _block(w.params)
        times.append(time.perf_counter() - t0)
        losses.append(m["loss"])
        if (k + 1) % ROUND == 0:
            if inner_peak is None:
                inner_peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
            t0 = time.perf_counter()
            _, *chunks = w.diloco_delta(k + 1, 0, plan, spec)
            w.diloco_outer(k + 1, spec, list(chunks))
            _block(w.params)
            outer_s.append(time.perf_counter() - t0)
    return {"step_times": times, "losses": losses, "bytes_off_device": 0, "copy_s": 0.0, "outer_s": outer_s,
            "inner_peak_bytes": inner_peak, "round": ROUND}


class _Split:
    """Seconds per phase of the two-slice step, each phase waited for."""

    def __init__(self):
        self.s: dict = {"copy_out": 0.0, "copy_in": 0.0, "sums": 0.0}

    def wrap(self):
        from ray_elastic.worker import device_sums, host_exchange

        split = self

        def timed(name, fn, wait):
            def run(*a, **kw):
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                if wait:
                    _block(out)
                split.s[name] += time.perf_counter() - t0
                return out
            return run

        host_exchange.HostExchange.host_payload = timed("copy_out", host_exchange.HostExchange.host_payload, False)
        host_exchange.HostExchange.piece_on_device = timed("copy_in", host_exchange.HostExchange.piece_on_device, True)
        device_sums.DeviceSums.combine = timed("sums", device_sums.DeviceSums.combine, True)


def _two_slices(factory, steps: int, cache: str) -> dict:
    import jax
    import numpy as np

    split = _Split()
    split.wrap()
    ws = [_worker(factory, i, cache) for i in range(2)]
    plan = _plan(1, 2)
    times, losses, sent, compute, per_step = [], [], 0, [], []
    for k in range(steps):
        before = dict(split.s)
        t0 = time.perf_counter()
        outs = []
        for i, w in enumerate(ws):
            c0 = time.perf_counter()
            outs.append(w.compute_grads(k, (i,), plan=plan))
            compute.append(time.perf_counter() - c0)
        chunks = [o[1] for o in outs]
        mid = dict(split.s)
        a0 = time.perf_counter()
        ms = [w.apply(k, False, chunks) for w in ws]
        _block([w.params for w in ws])
        applies = time.perf_counter() - a0
        times.append(time.perf_counter() - t0)
        losses.append(ms[0]["loss"])
        sent += _sent(chunks)
        phase = {n: split.s[n] - before[n] for n in split.s}
        # The applies' own time, less what they spent copying in and summing: the updates.
        phase["update"] = applies - sum(split.s[n] - mid[n] for n in split.s)
        per_step.append(phase)
    # The copies themselves: one gradient's tree out to the host and back,
    # each time of a fresh device array (numpy keeps what it fetched once).
    outs, ins = [], []
    for i in range(3):
        grad = jax.tree.map(lambda a, i=i: a * (1.0 + i), ws[0].params)
        _block(grad)
        t0 = time.perf_counter()
        host = jax.tree.map(np.asarray, grad)
        outs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        back = jax.device_put(host)
        _block(back)
        ins.append(time.perf_counter() - t0)
        del back, grad
    copies = 2 * (statistics.median(outs) + statistics.median(ins))  # each slice's gradient, out and in
    # The gradient calls' time, less their copies out: the compute.
    compute_s = [a + b - st["copy_out"] for a, b, st in zip(compute[0::2], compute[1::2], per_step)]
    return {"step_times": times, "losses": losses, "bytes_off_device": sent / steps, "copy_s": copies,
            "split": per_step, "grads_s": compute_s, "raw_copy_out_s": statistics.median(outs),
            "raw_copy_in_s": statistics.median(ins)}


def _checkpoint(factory, steps: int, cache: str, folder: str) -> dict:
    from ray_elastic.checkpoint.store import CheckpointStore

    run = _one_slice(factory, steps, cache)
    w = run.pop("worker")
    from ray_elastic.checkpoint.state_forms import WholeState

    store = CheckpointStore(folder)
    t0 = time.perf_counter()
    state = w.state()  # the host copy a save writes from
    saved = store.save(state.step, state.trees(), {"step": state.step})
    save_s = time.perf_counter() - t0
    fresh = _worker(factory, 0, cache)
    t0 = time.perf_counter()
    trees, meta = store.restore()
    fresh.load_state(WholeState(int(meta["step"]), trees["params"], trees["opt_state"]))
    _block(fresh.params)
    load_s = time.perf_counter() - t0
    import numpy as np
    import jax
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(w.params), jax.tree.leaves(fresh.params)))
    run.update(save_s=save_s, restore_s=load_s, checkpoint_bytes=saved["bytes"], restored_step=fresh.held_step(),
               restored_equal=same)
    return run


def _max_rss() -> int:
    """The process's peak resident set (where /proc/<pid>/status has no VmHWM)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True)
    p.add_argument("--config", required=True, help="LMConfig fields as JSON")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import jax

    from bench.memory import status
    import examples.lm as lm

    jax.config.update("jax_compilation_cache_dir", args.cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    cfg = lm.LMConfig(**json.loads(args.config))
    micro = args.variant in ("plain_micro", "one_slice_micro")
    factory = functools.partial(lm.make_program, cfg, lm.Layout(), None, 2 if args.variant == "one_slice_micro" else 1)
    v = args.variant
    if v in ("plain", "plain_micro"):
        out = _plain(lm.make_program(cfg), cfg, args.steps, micro)
    elif v in ("one_slice", "one_slice_micro"):
        out = _one_slice(factory, args.steps, args.cache)
    elif v == "one_slice_apart":
        out = _one_slice(factory, args.steps, args.cache, program="update_apart")
    elif v == "snapshot":
        out = _one_slice(factory, args.steps, args.cache, snapshot=True)
    elif v == "diloco":
        out = _diloco(factory, args.steps, args.cache)
    elif v == "two_slices":
        out = _two_slices(factory, args.steps, args.cache)
    elif v == "checkpoint":
        out = _checkpoint(factory, args.steps, args.cache, os.path.join(os.path.dirname(args.out), "ckpt-" + v))
    else:
        raise SystemExit(f"unknown variant {v!r}")
    out.pop("worker", None)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    out.update(variant=v, device=device.device_kind, device_peak_bytes=stats.get("peak_bytes_in_use"),
               host_peak_bytes=status(os.getpid()).get("VmHWM") or _max_rss())
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

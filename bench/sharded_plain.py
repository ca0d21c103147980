"""The plain JAX reference of `python -m bench sharded` and `python -m
bench sizes`: one `jax.distributed` job of slices x hosts processes (2 x 2
by default, one CPU device each, gloo collectives) whose global mesh is
`slice` x `fsdp`, so XLA runs every collective, the cross-slice gradient
all-reduce included. `--layout replicated`: the params replicated
everywhere (the example's default layout), as in `bench sizes`.

Same model, params sharding (the example's FSDP logical rules, `fsdp`
inside a slice, replicated over `slice`), optimizer (`program.optimizer`,
its state following the params), loss and data (step k's global batch is
shards 0..1 of `make_batch(seed, k, shard, 2)`, rows split over (slice,
fsdp) as ray_elastic splits them over slices and hosts).

    python -m bench.sharded_plain --process-id I --coordinator HOST:PORT \
        --config '{"seq_len": 16, ...}' --steps N --out FILE

Process 0 writes {"step_times": [...], "losses": [...]} to --out, and
every process its memory (peaks sampled from the end of step 0, as the
ray_elastic run samples its workers) to --out.mem<process id>.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.memory import PeakSampler, status  # noqa: E402 (after the path)

SLICES, HOSTS = 2, 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--config", required=True, help="LMConfig fields as JSON")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--slices", type=int, default=SLICES)
    p.add_argument("--hosts", type=int, default=HOSTS)
    p.add_argument("--layout", choices=("fsdp", "replicated"), default="fsdp")
    args = p.parse_args(argv)
    slices, hosts = args.slices, args.hosts

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get("BENCH_COMPILE_CACHE"):  # as ray_elastic's workers do
        jax.config.update("jax_compilation_cache_dir", os.environ["BENCH_COMPILE_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.distributed.initialize(args.coordinator, num_processes=slices * hosts, process_id=args.process_id)
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import examples.lm as lm
    from ray_elastic.dispatch.assignment import host_rows
    from ray_elastic.layout import resolve_param_specs

    config = lm.LMConfig(**json.loads(args.config))
    program = lm.make_program(config, lm.sharded_layout("fsdp")) if args.layout == "fsdp" else lm.make_program(config)
    devices = jax.devices()  # process order: slice-major, then host
    mesh = Mesh(np.array(devices).reshape(slices, hosts), ("slice", "fsdp"))
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    rng = jax.random.PRNGKey(args.seed)
    abstract = jax.eval_shape(program.init_params, rng)
    specs = resolve_param_specs(program.layout, abstract)  # embed -> fsdp; replicated over slice
    if specs is None:  # the replicated layout
        specs = jax.tree.map(lambda _: PartitionSpec(), abstract)
    o_specs = optax.tree_map_params(
        program.optimizer, lambda _, spec: spec, jax.eval_shape(program.optimizer.init, abstract), specs,
        transform_non_params=lambda v: jax.tree.map(lambda _: PartitionSpec(), v), is_leaf=is_spec,
    )
    named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=is_spec)  # noqa: E731
    p_sh, o_sh = named(specs), named(o_specs)
    params = jax.jit(program.init_params, out_shardings=p_sh)(rng)
    opt_state = jax.jit(program.optimizer.init, out_shardings=o_sh)(params)
    batch_sh = NamedSharding(mesh, PartitionSpec(("slice", "fsdp")))
    repl = NamedSharding(mesh, PartitionSpec())

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(program.loss_fn)(params, batch)
        updates, opt_state = program.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    slice_id, host = divmod(args.process_id, hosts)

    def local_batch(step: int) -> dict:
        full = program.make_batch(args.seed, step, slice_id, slices)
        return {k: np.asarray(v)[host_rows(np.asarray(v).shape[0], host, hosts)] for k, v in full.items()}

    def global_batch(step: int) -> dict:
        return {k: jax.make_array_from_process_local_data(batch_sh, v) for k, v in local_batch(step).items()}

    step_fn = jax.jit(train_step, out_shardings=(p_sh, o_sh, repl), donate_argnums=(0, 1))
    times, losses = [], []
    sampler = None
    for step in range(args.steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step_fn(params, opt_state, global_batch(step))
        losses.append(float(np.asarray(loss.addressable_data(0))))  # waits for the step
        times.append(time.perf_counter() - t0)
        if step == 0:  # from here on, as the ray_elastic run samples its workers: the steps
            sampler = PeakSampler(lambda: [os.getpid()]).start()
    if sampler is not None and args.out:  # every process: its own memory
        peaks = sampler.stop().get(os.getpid(), {})
        with open(f"{args.out}.mem{args.process_id}", "w") as f:
            json.dump({"process": args.process_id, "slice": slice_id, "host": host, **status(os.getpid()), **peaks}, f)
    if args.process_id == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"step_times": times, "losses": losses}, f)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

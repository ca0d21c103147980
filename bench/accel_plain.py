"""The plain JAX reference of `python -m bench accel`: one process, the
example LM's own program (init, loss, optimizer, data), each step over the
global batch of `--shards` shards (shards 0.. of `make_batch(seed, step,
shard, shards)`, concatenated: the mean loss over it is the mean of the
shards' means that ray_elastic averages), jitted with the state donated,
on whatever device JAX has (a GPU on the accelerator machine, else CPU).

    python -m bench.accel_plain --config '{"seq_len": 512, ...}' --steps N --shards 2 --out FILE

Writes {"step_times", "losses", "host_peak_bytes", "device_peak_bytes",
"device"} to --out.
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

from bench.memory import status  # noqa: E402 (after the path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="LMConfig fields as JSON")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import jax
    import numpy as np
    import optax

    import examples.lm as lm

    program = lm.make_program(lm.LMConfig(**json.loads(args.config)))
    rng = jax.random.PRNGKey(args.seed)
    params = jax.jit(program.init_params)(rng)
    opt_state = jax.jit(program.optimizer.init)(params)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(program.loss_fn)(params, batch)
        updates, opt_state = program.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step_fn = jax.jit(train_step, donate_argnums=(0, 1))

    def global_batch(step: int) -> dict:
        parts = [program.make_batch(args.seed, step, s, args.shards) for s in range(args.shards)]
        return {k: np.concatenate([np.asarray(b[k]) for b in parts]) for k in parts[0]}

    times, losses = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step_fn(params, opt_state, global_batch(step))
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    with open(args.out, "w") as f:
        json.dump({"step_times": times, "losses": losses, "host_peak_bytes": status(os.getpid()).get("VmHWM", 0),
                   "device_peak_bytes": stats.get("peak_bytes_in_use"), "device": device.device_kind}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

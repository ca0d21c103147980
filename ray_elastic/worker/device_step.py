"""A slice's step on its devices where it is the run's only slice (or a
DiLoCo replica taking an inner step), computing every shard: each shard's
gradient, their sum in the exchange plan's order and the division by the
step's weight in one program, and the optimizer's update either in the
same program or in the update program every other path runs
(ElasticConfig.one_slice_program). Nothing leaves the devices but the
shards' scalars, fetched once.

- One program, as a plain JAX step is one: no gradient-sized buffer lives
  between programs, so the slice's device memory is plain JAX's; a
  one-slice run's shards are computed in a loop (`lax.scan`), one at a
  time, as a plain step scans its microbatches. The
  compiler then fuses the optimizer's arithmetic with the gradient's, and
  where it fuses a multiply and an add into one (XLA's CPU backend does),
  the bits differ from an update compiled alone: this state is the same
  math as any other path's, equal to float rounding, not bitwise.
- The update apart: the mean gradient is held between the two programs
  (one gradient's memory more), and the state is bitwise the one any
  other split of the same shards over slices makes. The additions follow
  the plan's order exactly (a block's shards folded left in key order,
  the blocks by the plan's tree: the order chunks.py and device_sums.py
  add in), each shard's gradient whole before them (an optimization
  barrier: the compiler would otherwise merge the shards' scatter-adds of
  an embedding's gradient, adding rows in another order), and the weight
  and the update's metrics are float32 folds in key order
  (reduction.float32_values, the host's too).

Without a `post_update`, a step whose loss is not finite keeps the old
state (selected inside the one program: its buffers are donated; the
update apart is not run) and the apply raises, as on the other paths.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ray_elastic.program import TrainProgram
from ray_elastic.worker.reduction import float32_values
from ray_elastic.worker.step_math import grad_function, update_function

__all__ = ["compile_fused", "footprint", "fused_function", "plan_positions"]


def plan_positions(plan) -> tuple:
    """The plan's blocks as positions into its shards in key order: what
    `fused_function` folds (a block's positions in key order)."""
    order = sorted(plan.shards)
    return tuple(tuple(order.index(s) for s in plan.members(b)) for b in plan.block_order())


def fused_function(program: TrainProgram, mesh: Any, seed: int, num_shards: int, batch_ways: int,
                   blocks: tuple, fan_in: int, with_update: bool) -> Callable:
    """(params, opt_state slot, batches, step, shards) -> (params, slot,
    totals, weights, auxes, applied): the step over `batches` (one per
    shard, in key order; `shards` their ids), each shard's scalars, and
    whether the update was applied (False: a non-finite loss, no
    post_update). `blocks`: `plan_positions`' tuple; `fan_in`: the plan's.
    Without `with_update`: (mean gradient, model state, totals, weights,
    auxes), for the update program of the other paths to apply."""
    import jax
    import jax.numpy as jnp

    from ray_elastic.worker.chunks import tree

    grad_fn = grad_function(program, mesh, seed, num_shards, batch_ways)
    # One program over one block (a one-slice run): the shards in a loop.
    # Not where the state must be bitwise another path's (the update apart):
    # the loop's body is compiled apart from the gradient program.
    fold_in_loop = with_update and len(blocks) == 1
    update_fn = update_function(program)
    reduction = program.model_state_reduction
    state_op = jnp.maximum if reduction == "max" else jnp.add

    def fold(trees, op=jnp.add):
        acc = trees[0]
        for t in trees[1:]:
            acc = jax.tree.map(op, acc, t)
        return acc

    def in_plan_order(values, op=jnp.add):
        nodes = [fold([values[i] for i in block], op) for block in blocks]
        return tree(nodes, fan_in, lambda ns: fold(ns, op))

    def scanned(params, slot, batches, at_step, shards):
        """The shards one after another in a loop, their gradients added
        into one sum as they come (a left fold in key order, from -0.0,
        the sum's identity), as a plain JAX step scans microbatches: one
        shard's activations at a time, the compiler free to fuse each add."""
        def one(acc, xs):
            batch, shard = xs
            total, weight, aux, state, g = grad_fn(params, slot, batch, at_step, shard)
            return jax.tree.map(jnp.add, acc, g), (total, weight, aux, state)

        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
        zero = jax.tree.map(lambda p: jnp.full(p.shape, -0.0, p.dtype), params)
        summed, (totals, weights, auxes, states) = jax.lax.scan(one, zero, (stacked, jnp.stack(shards)))
        n = len(batches)
        unstack = lambda t: [jax.tree.map(lambda a, i=i: a[i], t) for i in range(n)]  # noqa: E731
        return summed, unstack(totals), unstack(weights), unstack(auxes), \
            (None if states is None else unstack(states))

    def step(params, slot, batches, at_step, shards):
        if fold_in_loop:
            summed, totals, weights, auxes, states = scanned(params, slot, batches, at_step, shards)
            grads = None
        else:
            outs = [grad_fn(params, slot, b, at_step, s) for b, s in zip(batches, shards)]
            totals, weights, auxes, states, grads = (list(x) for x in zip(*outs))
            # Each shard's gradient whole before the sum: else the compiler
            # may merge the shards' scatter-adds (an embedding's gradient)
            # into one, adding their rows in another order than the sum of
            # the shards'.
            grads = [jax.lax.optimization_barrier(g) for g in grads]
        f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        divisor, metrics = float32_values(totals, weights, {k: [a[k] for a in auxes] for k in program.aux},
                                          program.aux, jnp.add, jnp.maximum, f32)
        if not fold_in_loop:
            summed = in_plan_order(grads)
        mean = jax.tree.map(lambda a: a / divisor.astype(a.dtype), summed)
        state = None
        if program.has_model_state:
            if reduction == "weighted_mean":  # each product whole before the sum, as the host makes them
                states = [jax.lax.optimization_barrier(jax.tree.map(lambda a, w=w: a * w.astype(a.dtype), st))
                          for st, w in zip(states, weights)]
            state = in_plan_order(states, state_op)
            by = {"mean": f32(len(states)), "weighted_mean": divisor}.get(reduction)
            if by is not None:
                state = jax.tree.map(lambda a: a / by.astype(a.dtype), state)
        if not with_update:
            return mean, state, tuple(totals), tuple(weights), tuple(auxes)
        new_params, new_slot = update_fn(params, slot, mean, state, metrics)
        applied = jnp.bool_(True)
        if program.post_update is None:  # a non-finite loss changes nothing: the apply raises
            applied = jnp.isfinite(metrics["loss"])
            new_params = jax.tree.map(lambda n, o: jnp.where(applied, n, o), new_params, params)
            new_slot = jax.tree.map(lambda n, o: jnp.where(applied, n, o), new_slot, slot)
        return new_params, new_slot, tuple(totals), tuple(weights), tuple(auxes), applied

    return step


def compile_fused(layout: Any, compiled: Any, seed: int, num_shards: int, blocks: tuple, fan_in: int,
                  with_update: bool, compile_fn: Callable) -> Any:
    """`fused_function` compiled for the layout's shapes and `len(shards)`
    batches of the step's shape (CompiledStep's), ahead of time through
    `compile_fn` (the persistent compile caches), traced as the step's
    other functions are (setup.traced_under)."""
    import jax
    import numpy as np

    from ray_elastic.worker.setup import traced_under

    program = layout.program
    rep = layout.replicated
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=rep)  # noqa: E731
    n = sum(len(b) for b in blocks)
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=layout.batch_sharding)
             for k, (shape, dtype) in compiled.batch_specs.items()}
    fn = fused_function(program, layout.mesh, seed, num_shards, layout.batch_ways, blocks, fan_in, with_update)
    outs = ((layout.param_shardings, layout.opt_shardings, rep, rep, rep, rep) if with_update
            else (layout.param_shardings, rep, rep, rep, rep))
    with traced_under(layout.mesh, program.layout.rules):
        lowered = jax.jit(fn, donate_argnums=(0, 1) if with_update else (),
                          out_shardings=outs).lower(
            layout.params_spec(), layout.opt_spec(), (batch,) * n, scalar(np.int32), (scalar(np.int32),) * n)
    return compile_fn(lowered)


def footprint(programs: tuple) -> Optional[int]:
    """The most memory any of the compiled `programs` takes on a device
    while it runs, beyond its arguments: its scratch and the outputs not
    aliased to a donated input (XLA's memory analysis); None where a
    program or the backend does not say."""
    sizes = []
    for fn in programs:
        try:
            m = fn.memory_analysis()
            sizes.append(int(m.temp_size_in_bytes) + int(m.output_size_in_bytes) - int(m.alias_size_in_bytes))
        except Exception:  # noqa: BLE001 - no analysis (an older backend, a plain function): unknown
            return None
    return max(sizes) if sizes else None

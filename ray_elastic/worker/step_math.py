"""The program's math as the worker compiles it: one shard's gradient
with its loss, weight, aux metrics and model state, and the update with
the program's `post_update` (program.py has the contracts).

The model state, when the program has one, is carried in the optimizer
state's slot as {"optimizer": ..., "model_state": ...}: snapshots, copies,
checkpoints and every restore path move that slot whole, so the model
state goes wherever the optimizer state goes. `split_slot` / `join_slot`
are the one place that knows the packing.

JAX is imported on use: the driver imports this module through the
worker's actor class.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ray_elastic.errors import ConfigError
from ray_elastic.program import LossOutput, StepContext, TrainProgram, TrainState

__all__ = ["check_outputs", "eval_function", "grad_function", "join_slot", "split_slot", "step_key", "update_function"]


def split_slot(program: TrainProgram, slot: Any) -> tuple:
    """(optimizer state, model state or None) of the held opt_state slot."""
    if program.has_model_state:
        return slot["optimizer"], slot["model_state"]
    return slot, None


def join_slot(program: TrainProgram, opt_state: Any, model_state: Any) -> Any:
    if program.has_model_state:
        return {"optimizer": opt_state, "model_state": model_state}
    return opt_state


def step_key(seed: int, step: Any, shard: Any) -> Any:
    """The RNG key of (seed, step, shard), and of nothing else: a shard gets
    the same key whichever slice computes it, in any run."""
    import jax

    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), step), shard)


def _as_output(value: Any, fn: str = "program.loss_fn") -> LossOutput:
    if isinstance(value, LossOutput):
        return value
    if isinstance(value, (tuple, list, dict)):
        raise ConfigError(fn, f"returned a {type(value).__name__}; return the shard's loss as one "
                          "scalar, or LossOutput(total=..., weight=..., aux={...}) for a summed loss with "
                          "aux metrics")
    return LossOutput(total=value)


def grad_function(program: TrainProgram, mesh: Any, seed: int, num_shards: int, batch_ways: int = 1) -> Callable:
    """(params, opt_state slot, batch, step, shard) -> (total, weight, aux,
    new model state or None, gradient of total). With microbatches, the
    shard's batch is scanned in `program.microbatches` pieces on the device
    (microbatch j's key: `fold_in(ctx.rng, j)`) and one summed gradient
    comes out; totals and weights add up, aux metrics and the model state
    combine by their declared reductions."""
    import jax

    def grad_fn(params, slot, batch, step, shard):
        _, model_state = split_slot(program, slot)
        ctx = StepContext(step=step, shard=shard, num_shards=num_shards, rng=step_key(seed, step, shard),
                          mesh=mesh, model_state=model_state)

        def loss(p, b, c):
            out = _as_output(program.loss_fn(p, b, c) if program.takes_context else program.loss_fn(p, b))
            if jax.numpy.shape(out.total) != ():  # before value_and_grad says it its own way
                raise ConfigError("program.loss_fn", f"the loss has shape {jax.numpy.shape(out.total)}; return "
                                  "one number per shard (the mean loss, or LossOutput.total: the summed loss)")
            new_state = out.model_state if program.has_model_state else None
            if program.has_model_state and new_state is None:
                new_state = model_state
            return out.total, (out.weight, dict(out.aux), new_state)

        k = program.microbatches
        if k == 1:
            (total, (weight, aux, new_state)), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, ctx)
            return total, jax.numpy.asarray(weight, jax.numpy.float32), aux, new_state, grads

        def one(acc, piece):  # one microbatch: its gradient added into the running sum
            j, mb = piece
            c = dataclasses.replace(ctx, rng=jax.random.fold_in(ctx.rng, j))
            (t, (w, a, st)), g = jax.value_and_grad(loss, has_aux=True)(params, mb, c)
            return jax.tree.map(jax.numpy.add, acc, g), (t, jax.numpy.asarray(w, jax.numpy.float32), a, st)

        pieces = microbatched(batch, k, batch_ways)
        zeros = jax.tree.map(jax.numpy.zeros_like, params)
        grads, (totals, weights, auxes, states) = jax.lax.scan(one, zeros, (jax.numpy.arange(k), pieces))
        weight = jax.numpy.sum(weights)
        aux = {name: _combine(program.aux[name], v, weights) for name, v in auxes.items()}
        if states is not None:
            states = jax.tree.map(lambda v: _combine(program.model_state_reduction, v, weights), states)
        return jax.numpy.sum(totals), weight, aux, states, grads

    return grad_fn


def microbatched(batch: Any, k: int, batch_ways: int) -> Any:
    """A shard's batch as k microbatches ([k, rows / k, ...] per key).
    Microbatch j takes the j-th run of rows of every device's block, so
    each holds rows of every device and no row moves between devices."""
    import jax

    def split(a):
        d, m = batch_ways, a.shape[0] // (batch_ways * k)
        return a.reshape((d, k, m) + a.shape[1:]).swapaxes(0, 1).reshape((k, d * m) + a.shape[1:])

    return jax.tree.map(split, batch)


def _combine(reduction: str, values: Any, weights: Any) -> Any:
    """A shard's value from its microbatches' (stacked on axis 0), by the
    reduction the program declares for the global batch."""
    import jax.numpy as jnp

    if reduction == "sum":
        return jnp.sum(values, axis=0)
    if reduction == "max":
        return jnp.max(values, axis=0)
    if reduction == "mean":
        return jnp.mean(values, axis=0)
    w = weights.reshape((-1,) + (1,) * (values.ndim - 1))
    return jnp.sum(values * w, axis=0) / jnp.maximum(jnp.sum(weights), jnp.finfo(jnp.float32).tiny)


def eval_function(program: TrainProgram, mesh: Any, seed: int, num_shards: int) -> Callable:
    """(params, opt_state slot, eval batch, step, shard) -> (total, weight, aux)."""
    import jax.numpy as jnp

    def eval_fn(params, slot, batch, step, shard):
        _, model_state = split_slot(program, slot)
        ctx = StepContext(step=step, shard=shard, num_shards=num_shards, rng=step_key(seed, step, shard),
                          mesh=mesh, model_state=model_state)
        out = _as_output(program.eval_fn(params, batch, ctx), "program.eval_fn")
        return out.total, jnp.asarray(out.weight, jnp.float32), dict(out.aux)

    return eval_fn


def update_function(program: TrainProgram) -> Callable:
    """(params, opt_state slot, mean gradient, new model state, metrics) ->
    (params, opt_state slot): the optimizer's update, then `post_update`."""
    import optax

    def update_fn(params, slot, grads, new_model_state, metrics):
        opt_state, old_model_state = split_slot(program, slot)
        updates, new_opt = program.optimizer.update(grads, opt_state, params)
        new = TrainState(optax.apply_updates(params, updates), new_opt, new_model_state)
        if program.post_update is not None:
            new = program.post_update(TrainState(params, opt_state, old_model_state), new, grads, metrics)
            if not isinstance(new, TrainState):
                raise ConfigError("program.post_update", f"returned a {type(new).__name__}; return a TrainState "
                                  "(params, opt_state, model_state)")
        return new.params, join_slot(program, new.opt_state, new.model_state)

    return update_fn


def check_outputs(program: TrainProgram, out_info: Any, model_state: Any, fn: str = "loss_fn",
                  declared: Any = None) -> None:
    """Check the shapes `fn` returns (its lowered outputs) before the
    first step: a scalar total and weight, aux metrics that are scalars
    with a declared reduction, a model state shaped like the old."""
    import jax

    declared = program.aux if declared is None else declared
    field = "aux" if fn == "loss_fn" else "eval_aux"
    total, weight, aux, new_state, _ = out_info
    if total.shape != ():
        raise ConfigError(f"program.{fn}", f"the loss has shape {total.shape}; return one number per shard "
                          "(the mean loss, or LossOutput.total: the summed loss)")
    if weight.shape != ():
        raise ConfigError(f"program.{fn}", f"LossOutput.weight has shape {weight.shape}; it is one number "
                          "per shard (e.g. the shard's real tokens)")
    undeclared = sorted(set(aux) - set(declared))
    if undeclared:
        raise ConfigError(f"program.{field}", f"{fn} returns aux metrics {undeclared} with no reduction; add "
                          f"them to TrainProgram({field}={{name: 'sum' | 'mean' | 'max' | 'weighted_mean'}})")
    missing = sorted(set(declared) - set(aux))
    if missing:
        raise ConfigError(f"program.{field}", f"metrics {missing} are declared but {fn} does not return them "
                          "in LossOutput.aux")
    for name, value in aux.items():
        if value.shape != ():
            raise ConfigError(f"program.{fn}", f"aux metric {name!r} has shape {value.shape}; a metric is "
                              "one number per shard")
    same = lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype)  # noqa: E731
    if fn == "loss_fn" and program.has_model_state and (
            jax.tree.structure(new_state) != jax.tree.structure(model_state)
            or not all(same(a, b) for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(model_state)))):
        raise ConfigError("program.loss_fn", "LossOutput.model_state is not shaped like init_model_state's "
                          "(the same tree, shapes and dtypes)")

"""What a user hands to ray_elastic: the pieces of one data-parallel training job.

Every piece is a plain function so that a worker process can rebuild the
job from a pickled factory, and so that the batch for a step is a pure
function of (seed, step, shard): a resumed or resized run then sees exactly
the data a failure-free run sees.

Two loss contracts are accepted:

- `loss_fn(params, batch) -> scalar`: the shard's mean loss. The step's
  loss and gradient are the mean over the shards (each shard weighs the
  same), as ray_elastic always did.
- `loss_fn(params, batch, ctx) -> LossOutput`: `ctx` is the StepContext
  (step, shard, RNG key, mesh, model state); the output is the shard's
  summed loss and its weight (e.g. its real tokens), named aux metrics and
  the updated model state. The step's loss is then sum(total) / sum(weight)
  over the global batch and its gradient the gradient of that: what a
  plain JAX job that divides by the real tokens of the global batch
  computes, whatever the slice count. A scalar may still be returned
  (weight 1).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, NamedTuple, Optional

import numpy as np

from ray_elastic.errors import ConfigError
from ray_elastic.layout import Layout

PyTree = Any
Batch = Mapping[str, np.ndarray]

__all__ = ["LossOutput", "REDUCTIONS", "StepContext", "TrainProgram", "TrainState", "skip_nonfinite"]

# How a per-shard value is combined over the global batch, in shard order:
# sum; mean (every shard weighs the same); max; weighted_mean (each shard
# weighs its loss weight, e.g. its real tokens).
REDUCTIONS = ("sum", "mean", "max", "weighted_mean")
# Names ray_elastic's own step metrics use: an aux metric may not take them.
RESERVED_METRICS = ("loss", "slices", "step_s", "step", "shards", "weight")


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a step's functions know besides the params and the batch.

    step, shard: int32 scalars (traced, so one compiled step serves every
    step); num_shards: the global batch's shard count (a Python int);
    rng: a PRNG key derived only from (seed, step, shard), so a shard gets
    the same key whichever slice computes it; mesh: the slice's
    `jax.sharding.Mesh`; model_state: the program's non-trainable state
    (e.g. Flax `batch_stats`), None without one."""

    step: Any
    shard: Any
    num_shards: int
    rng: Any
    mesh: Any
    model_state: Any = None


@dataclasses.dataclass(frozen=True)
class LossOutput:
    """A shard's loss, as a context-taking `loss_fn` returns it.

    total: the loss summed over the shard's rows (each times its weight);
    weight: what `total` is divided by over the global batch (the shard's
    real tokens or rows; 1 for a shard's mean loss); aux: named scalar
    metrics, each reduced over the global batch as `TrainProgram.aux`
    declares; model_state: the updated model state (None: unchanged)."""

    total: Any
    weight: Any = 1.0
    aux: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_state: Any = None


class TrainState(NamedTuple):
    """The state `post_update` sees and returns."""

    params: PyTree
    opt_state: PyTree
    model_state: PyTree = None


def skip_nonfinite(old: TrainState, new: TrainState, grads: PyTree, metrics: Mapping[str, Any]) -> TrainState:
    """A `post_update` that keeps the old state when the step's loss or
    gradient is not finite (the step still counts, as in MaxText)."""
    import jax
    import jax.numpy as jnp

    finite = jnp.isfinite(metrics["loss"])
    for g in jax.tree.leaves(grads):
        finite &= jnp.all(jnp.isfinite(g))
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """A training job, split so the controller can place each piece.

    init_params: rng key -> parameter pytree (same key, same params everywhere).
    loss_fn: (params, batch) -> the shard's mean loss, or (params, batch,
        ctx) -> LossOutput or scalar (see the module's docstring); jit-able.
    optimizer: an optax GradientTransformation.
    make_batch: (seed, step, shard, num_shards) -> numpy batch of that shard of
        the step's global batch. Must be pure: the same arguments give the
        same arrays on any host, at any time. When it also takes a `rows`
        keyword, each host asks only for the rows its devices hold
        (`rows=slice(a, b)`; `rows=None`, once at compile: the whole shard)
        and reads nothing else; `ray_elastic.data.GrainBatches` is one. A
        make_batch with a `check(steps, num_shards)` method is checked
        before any resource is taken (a dataset too short says so).
    layout: how the state is laid out over a slice's devices (layout.py);
        the default replicates it on every device.
    aux: aux metric name -> its reduction over the global batch (REDUCTIONS).
        Every aux value `loss_fn` returns must be named here.
    init_model_state: rng key -> the non-trainable state (e.g. Flax
        `batch_stats`), carried beside the params, saved and restored with
        them; `loss_fn` reads it as `ctx.model_state` and returns the new
        one in `LossOutput.model_state`.
    model_state_reduction: how the shards' new model states combine into
        the step's (REDUCTIONS; "mean" is a synchronized batch norm).
    post_update: (old TrainState, new TrainState, mean gradient, reduced
        metrics) -> the TrainState to keep; jit-able and deterministic, run
        identically on every slice (e.g. `skip_nonfinite`, weight clipping).
    eval_fn: (params, batch, ctx) -> LossOutput or scalar, like loss_fn
        but never differentiated; its aux metrics reduce by `eval_aux`.
    make_eval_batch: (seed, shard, num_shards) -> numpy batch: shard
        `shard` of the fixed held-out set (a `rows` keyword as make_batch's). The set has as many shards as
        the training batch; each is evaluated by the slice that computes
        that training shard, so the result does not depend on the slices.
    microbatches: scan each shard's batch in this many pieces on the
        device and ship one summed gradient per shard (gradient
        accumulation): the same sums as that many times more shards, with
        one gradient's memory and transfer. Microbatch j's key is
        `fold_in(ctx.rng, j)`; aux metrics and the model state combine over
        microbatches by their declared reductions.
    pretrained: the step-0 params instead of `init_params`'s: a params
        tree (host arrays), or a path (local or gs://) to a ray_elastic
        checkpoint folder (its newest intact step's params) or to a plain
        Orbax checkpoint of a params tree. Loaded onto the slice's layout
        as arguments, never compiled in; `init_params` then only gives the
        shapes the weights are checked against. A resumed run restores its
        own checkpoint instead.
    eval_every: evaluate the state of every step that is a multiple of it
        (0: never; nothing is compiled or run). The figures of the state
        after step k come with step k + 1's metrics, as "eval/loss" and
        "eval/<name>".
    """

    init_params: Callable[[Any], PyTree]
    loss_fn: Callable[..., Any]
    optimizer: Any
    make_batch: Callable[[int, int, int, int], Batch]
    layout: Layout = dataclasses.field(default_factory=Layout)
    aux: Mapping[str, str] = dataclasses.field(default_factory=dict)
    init_model_state: Optional[Callable[[Any], PyTree]] = None
    model_state_reduction: Optional[str] = None
    post_update: Optional[Callable[..., TrainState]] = None
    pretrained: Any = None
    microbatches: int = 1
    eval_fn: Optional[Callable[..., Any]] = None
    make_eval_batch: Optional[Callable[[int, int, int], Batch]] = None
    eval_every: int = 0
    eval_aux: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for field in ("aux", "eval_aux"):
            object.__setattr__(self, field, dict(getattr(self, field)))
            for name, reduction in getattr(self, field).items():
                if not isinstance(name, str) or not name or "/" in name:
                    raise ConfigError(f"program.{field}", f"metric names are non-empty strings without '/', "
                                      f"got {name!r}")
                if name in RESERVED_METRICS:
                    raise ConfigError(f"program.{field}", f"{name!r} is a name ray_elastic reports itself; "
                                      "rename the metric")
                if reduction not in REDUCTIONS:
                    raise ConfigError(f"program.{field}", f"metric {name!r} has reduction {reduction!r}; "
                                      f"choose one of {REDUCTIONS}")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError("program.eval_every", f"must be an integer >= 0 (0: no eval), got {self.eval_every!r}")
        if self.eval_every and (self.eval_fn is None or self.make_eval_batch is None):
            raise ConfigError("program.eval_every", "an eval needs both eval_fn and make_eval_batch")
        if self.init_model_state is not None:
            if self.model_state_reduction is None:
                raise ConfigError("program.model_state_reduction", "init_model_state is set but not how the "
                                  f"shards' model states combine; set it to one of {REDUCTIONS} "
                                  "('mean' for batch statistics)")
            if not self.takes_context:
                raise ConfigError("program.loss_fn", "a program with model state needs loss_fn(params, batch, "
                                  "ctx): it reads ctx.model_state and returns LossOutput(model_state=...)")
        if self.model_state_reduction is not None and self.model_state_reduction not in REDUCTIONS:
            raise ConfigError("program.model_state_reduction", f"got {self.model_state_reduction!r}; "
                              f"choose one of {REDUCTIONS}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError("program.microbatches", f"must be an integer >= 1, got {self.microbatches!r}")
        if isinstance(self.pretrained, str) and not self.pretrained.strip():
            raise ConfigError("program.pretrained", "is an empty path; give a checkpoint folder or a params tree")
        if self.post_update is not None and not callable(self.post_update):
            raise ConfigError("program.post_update", f"must be callable, got {self.post_update!r}")

    @property
    def takes_context(self) -> bool:
        """Whether loss_fn takes (params, batch, ctx)."""
        return _positional_args(self.loss_fn) >= 3

    @property
    def batch_takes_rows(self) -> bool:
        """Whether make_batch reads only the rows it is asked for."""
        return _takes_rows(self.make_batch)

    @property
    def eval_batch_takes_rows(self) -> bool:
        return self.make_eval_batch is not None and _takes_rows(self.make_eval_batch)

    def check_data(self, steps: int, num_shards: int) -> None:
        """Raise ConfigError when the data cannot feed `steps` steps of
        `num_shards` shards (through make_batch's own `check`, if any)."""
        for fn in (self.make_batch, self.make_eval_batch if self.eval_every else None):
            check = getattr(fn, "check", None)
            if callable(check):
                check(steps, num_shards)

    @property
    def has_model_state(self) -> bool:
        return self.init_model_state is not None


def _takes_rows(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "rows" in params  # named, not **kwargs: a wrapper may not pass it on


def _positional_args(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or an odd callable: today's contract
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)

"""DiLoCo as a plain single-process JAX loop: the replicas' inner steps
one after another, their deltas averaged in replica order (the tests'
reference for DiLoCo runs, docs/diloco.md)."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np


def diloco_reference(program, *, seed: int, shards: int, replicas: int, steps: int, period: int,
                     outer_lr: float = 0.3, outer_momentum: float = 0.9,
                     active: Optional[Callable[[int, int], bool]] = None,
                     joins_from: Optional[Callable[[int, int], Optional[int]]] = None):
    """(final global params as numpy, per-step mean loss over the active
    replicas). `active(step, replica)`: whether the replica takes inner
    step `step` and, at a round's end, is averaged in (default: always);
    `joins_from(boundary, replica)`: the replica whose inner optimizer
    state a replica re-joining at `boundary` takes (None: it keeps its own)."""
    import jax
    import jax.numpy as jnp
    import optax

    active = active or (lambda step, r: True)
    params0 = program.init_params(jax.random.PRNGKey(seed))
    opt, outer = program.optimizer, optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True)
    global_p, outer_state = params0, outer.init(params0)
    inner = [[params0, opt.init(params0)] for _ in range(replicas)]

    @jax.jit
    def grad(p, batch):
        return jax.value_and_grad(program.loss_fn)(p, batch)

    @jax.jit
    def update(p, o, g):
        updates, o = opt.update(g, o, p)
        return optax.apply_updates(p, updates), o

    losses = []
    for k in range(steps):
        step_losses = []
        for r in range(replicas):
            if not active(k, r):
                continue
            p, o = inner[r]
            mine = [s for s in range(shards) if s % replicas == r]
            acc, total = None, 0.0
            for s in mine:
                batch = {key: jnp.asarray(v) for key, v in program.make_batch(seed, k, s, shards).items()}
                loss, g = grad(p, batch)
                acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
                total += float(loss)
            mean = jax.tree.map(lambda a: a / np.float32(len(mine)), acc)
            inner[r] = list(update(p, o, mean))
            step_losses.append(total / len(mine))
        losses.append(sum(step_losses) / len(step_losses))
        b = k + 1
        if b % period == 0 or b == steps:
            taking = [r for r in range(replicas) if active(k, r)]
            deltas = [jax.tree.map(lambda gp, lp: np.asarray(gp) - np.asarray(lp), global_p, inner[r][0]) for r in taking]
            acc = jax.tree.map(lambda a: np.array(a, copy=True), deltas[0])
            for d in deltas[1:]:
                acc = jax.tree.map(lambda a, x: a + x, acc, d)
            mean = jax.tree.map(lambda a: a / np.float32(len(taking)), acc)
            updates, outer_state = outer.update(mean, outer_state, global_p)
            global_p = optax.apply_updates(global_p, updates)
            for r in range(replicas):
                src = joins_from(b, r) if joins_from else None
                inner[r] = [global_p, inner[r if src is None else src][1]]
    return jax.tree.map(np.asarray, global_p), losses

"""DiLoCo as a plain single-process JAX loop: the replicas' inner steps
one after another, their deltas averaged in replica order (the tests'
reference for DiLoCo runs, docs/diloco.md); with `fragments`, Streaming
DiLoCo: one fragment of the params synchronized every `period /
fragments` steps, the new global fragment mixed into the replicas
`overlap` steps later by `alpha`, every fragment at the last step."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np


def diloco_reference(program, *, seed: int, shards: int, replicas: int, steps: int, period: int,
                     outer_lr: float = 0.3, outer_momentum: float = 0.9,
                     active: Optional[Callable[[int, int], bool]] = None,
                     joins_from: Optional[Callable[[int, int], Optional[int]]] = None,
                     fragments: int = 0, overlap: int = 0, alpha: float = 0.0,
                     averaged: Optional[Callable[[int, int], bool]] = None):
    """(final global params as numpy, per-step mean loss over the active
    replicas). `active(step, replica)`: whether the replica takes inner
    step `step` and, at a round's end, is averaged in (default: always);
    `joins_from(boundary, replica)`: the replica whose inner optimizer
    state a replica re-joining at `boundary` takes (None: it keeps its
    own; under streaming it takes that replica's params too);
    `averaged(boundary, replica)`: whether its delta is averaged in at
    `boundary` (default: active at the step before; a replica lost while
    its synchronization moved may not be)."""
    import jax
    import jax.numpy as jnp
    import optax

    active = active or (lambda step, r: True)
    averaged = averaged or (lambda b, r: active(b - 1, r))
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

    leaves_of = None
    if fragments:
        from ray_elastic.dispatch.outer_spec import fragment_leaves

        every = max(1, int(round(period / fragments)))
        sizes = [a.size * a.dtype.itemsize for a in jax.tree.leaves(params0)]
        leaves_of = fragment_leaves(sizes, fragments)

    def synced_after(b):  # the fragment synchronized once b steps are done (MaxText's order)
        return None if b <= 0 or b % every else (b % (fragments * every)) // every

    def mixed(p, leaves):  # alpha * inner + (1 - alpha) * global on the fragment's leaves
        flat, tdef = jax.tree.flatten(p)
        g = jax.tree.leaves(global_p)
        for i in leaves:
            flat[i] = alpha * flat[i] + (1 - alpha) * g[i] if alpha else g[i]
        return jax.tree.unflatten(tdef, flat)

    losses = []
    for k in range(steps):
        if fragments and overlap and synced_after(k - overlap) is not None:
            for r in range(replicas):
                inner[r][0] = mixed(inner[r][0], leaves_of[synced_after(k - overlap)])
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
        if fragments and b < steps:
            f = synced_after(b)
            if f is None:
                continue
            # The outer step of the whole tree, its results kept on the
            # fragment's leaves only (the optimizer is elementwise).
            frag = set(leaves_of[f])
            deltas = [[np.asarray(gp) - np.asarray(lp) if i in frag else np.zeros_like(np.asarray(gp))
                       for i, (gp, lp) in enumerate(zip(jax.tree.leaves(global_p), jax.tree.leaves(inner[r][0])))]
                      for r in range(replicas) if averaged(b, r)]
            mean = [sum(ds[1:], np.array(ds[0], copy=True)) / np.float32(len(deltas)) for ds in zip(*deltas)]
            mean = jax.tree.unflatten(jax.tree.structure(global_p), mean)
            updates, new_state = outer.update(mean, outer_state, global_p)
            new_p = optax.apply_updates(global_p, updates)
            n = len(jax.tree.leaves(global_p))  # each outer state leaf mirrors a param's
            pick = lambda new, old: jax.tree.unflatten(jax.tree.structure(old), [  # noqa: E731
                a if i % n in frag else b for i, (a, b) in enumerate(zip(jax.tree.leaves(new), jax.tree.leaves(old)))])
            global_p, outer_state = pick(new_p, global_p), pick(new_state, outer_state)
            if not overlap:
                for r in range(replicas):
                    inner[r][0] = mixed(inner[r][0], leaves_of[f])
            for r in range(replicas):  # a joiner takes its donor's whole inner state
                src = joins_from(b, r) if joins_from else None
                if src is not None:
                    inner[r] = list(inner[src])
            continue
        if b % period == 0 or b == steps:
            taking = [r for r in range(replicas) if averaged(b, r)]
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

"""A step's gradient sums on the slice's own devices, in the exchange
plan's order.

A gradient call folds the shards it computes into one sum per block of
the plan (dispatch/exchange_plan.py) on the devices, the running sum
donated to each add: a block's sum is the left fold of its shards in key
order, as `chunks.pieces` makes it on the host. A shard of a block the
call does not hold whole stays a piece of its own. The apply then adds
the pieces by the plan's tree and divides by the step's weight in one
program (`combine`), taking each piece from the devices where this slice
made it, or from the host copy another slice sent. So when one slice
computes every shard of a step, nothing of its gradient leaves the
devices; with several, a host copies its slice's sums out once and the
others' in once.

The additions and the division are those the host's numpy makes
(chunks.py), element by element in the same order, each rounded to the
array's dtype: IEEE addition and division round alike in XLA's CPU
backend and in numpy, so a run's state does not depend on where its sums
were made (the CPU tests compare them bitwise). The adds and the combine
are programs of their own, never fused into the gradient or the update,
where the compiler would be free to contract an add with a multiply.

JAX is imported on use: the driver imports this module through the
worker's actor class.
"""

from __future__ import annotations

from typing import Any, Optional

from ray_elastic.dispatch.exchange_plan import ExchangePlan

__all__ = ["DeviceSums", "TOTAL"]

# The key of a sum already made over every shard of the step (the owners'
# chunks, assembled on the host): `combine` only rounds and divides it.
TOTAL = ("total", None)


class DeviceSums:
    """One host's gradient sums of a step on its devices, and the programs
    that make and combine them. `params_spec`: the params' tree of
    jax.ShapeDtypeStruct, whose shardings and dtypes the mean takes, as
    the update takes it."""

    def __init__(self, params_spec: Any) -> None:
        import jax

        self._out = jax.tree.map(lambda s: s.sharding, params_spec)
        self._dtypes = [s.dtype for s in jax.tree.leaves(params_spec)]
        self.step = -1
        self._held: dict = {}  # {("block", b) or ("shard", s): gradient tree}
        self._programs: dict = {}

    # -- the gradient call's side --

    def start(self, step: int) -> None:
        """A gradient call of `step`: the sums of any other step are let
        go; a second call of the same step (a survivor computing a lost
        slice's shards) adds its own keys."""
        if step != self.step:
            self.step, self._held = step, {}

    def add(self, acc: Any, grad: Any) -> Any:
        """`acc` + `grad` on the devices, acc's buffers donated (`grad`
        itself where there is no sum yet): one step of a block's left fold."""
        return grad if acc is None else self._program("add")(acc, grad)

    def hold(self, step: int, sums: dict) -> None:
        """Keep `sums` ({key: sum}) of `step` for this host's apply; a call
        re-issued for the same shards replaces its first try's."""
        self.start(step)
        self._held.update(sums)

    def held(self, step: int) -> dict:
        """{key: sum} held of `step` (empty for another step)."""
        return dict(self._held) if step == self.step else {}

    def cast(self, tree: Any, dtype: Optional[Any]) -> Any:
        """`tree` rounded to `dtype` on the devices (None: as it is), to be
        copied out at the wire's width."""
        if dtype is None:
            return tree
        import numpy as np

        return self._program(("cast", np.dtype(dtype).name))(tree)

    def drop(self) -> None:
        self.step, self._held = -1, {}

    # -- the apply's side --

    def combine(self, plan: Optional[ExchangePlan], step: int, own: tuple, copied: dict, weight: float) -> Any:
        """The step's mean gradient on the devices: the pieces `own` this
        host holds of `step` (donated) and `copied` (pieces copied in from
        the host, never donated: their buffers may be the host's memory),
        keyed ("block", b) or ("shard", s), or {TOTAL: sum} alone (no
        plan: the sum is made, at the wire's width already); added in the plan's
        order (a split block's shards folded first), divided by `weight`.
        With the plan's wire dtype every piece and the sum are rounded to
        it, as the host exchange rounds what travels (chunks.sum_chunk)."""
        import numpy as np

        mine = self.held(step)
        missing = [k for k in own if k not in mine]
        if missing:
            raise RuntimeError(f"the sums {missing} of step {step} are no longer on this host's devices (an apply "
                               "re-issued after the first took them?)")
        held = {k: mine[k] for k in own}
        if TOTAL in copied:
            held, layout = {}, ((("copied", 0),),)
            copied_keys = [TOTAL]
        else:
            keys = (*held, *copied)
            covered = sorted(s for kind, key in keys for s in (plan.members(key) if kind == "block" else (key,)))
            if covered != sorted(plan.shards):
                raise RuntimeError(f"the apply's gradient sums cover shards {covered}, not the step's "
                                   f"{list(plan.shards)}")
            held_keys, copied_keys = sorted(held), sorted(copied)
            blocks = []
            for b in plan.block_order():
                whole = ("block", b)
                block = [whole] if whole in held or whole in copied else [("shard", s) for s in plan.members(b)]
                blocks.append(tuple(("held", held_keys.index(k)) if k in held else ("copied", copied_keys.index(k))
                                    for k in block))
            layout = tuple(blocks)
        wire = None if plan is None else plan.wire_dtype
        program = self._program(("combine", layout, 2 if plan is None else plan.fan_in, wire))
        ordered = [held[k] for k in sorted(held)]
        mean = program(ordered[:1], ordered[1:], tuple(copied[k] for k in copied_keys), np.float32(weight))
        for k in held:  # donated: gone from the devices
            self._held.pop(k, None)
        return mean

    def divide(self, total: Any, weight: float) -> Any:
        """`total` (this host's sum on its devices, donated) over `weight`."""
        import numpy as np

        return self._program(("divide",))(total, np.float32(weight))

    def _program(self, key: Any):
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._build(key)
        return program

    def _build(self, key: Any):
        import jax
        import jax.numpy as jnp

        from ray_elastic.worker.chunks import tree

        kind = key if isinstance(key, str) else key[0]
        if kind == "add":
            return jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=(0,))
        if kind == "cast":
            dtype = key[1]
            return jax.jit(lambda t: jax.tree.map(lambda a: a.astype(dtype), t))
        if kind == "divide":
            return jax.jit(lambda t, w: jax.tree.map(lambda a: a / w.astype(a.dtype), t), donate_argnums=(0,),
                           out_shardings=self._out)
        _, layout, fan_in, wire = key
        dtypes = self._dtypes

        def rounded(g):  # a piece as it travels, summed in float32 (chunks.sum_chunk)
            return g if wire is None else jax.tree.map(lambda a: a.astype(wire).astype(jnp.float32), g)

        def landed(g):  # the sum as it travels back, in the params' dtypes (chunks.assemble)
            if wire is None:
                return g
            leaves, treedef = jax.tree.flatten(g)
            return jax.tree.unflatten(treedef, [a.astype(wire).astype(d) for a, d in zip(leaves, dtypes)])

        def fold(trees):
            acc = trees[0]
            for t in trees[1:]:
                acc = jax.tree.map(jnp.add, acc, t)
            return acc

        def run(first, rest, copied, weight):  # the first held sum's buffers become the mean's
            pick = {"held": (*first, *rest), "copied": copied}
            nodes = [fold([rounded(pick[src][i]) for src, i in block]) for block in layout]
            total = landed(tree(nodes, fan_in, fold))
            return jax.tree.map(lambda a: a / weight.astype(a.dtype), total)

        return jax.jit(run, donate_argnums=(0,), out_shardings=self._out)

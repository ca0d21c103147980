"""A DiLoCo replica's outer state on one host: the global params of the
round's start and the outer optimizer's state (SGD with Nesterov
momentum, as MaxText's DiLoCo and the paper use), beside the inner state
the worker holds (state.py) and trains alone between synchronizations.

At a synchronization each replica sends `global - params` (its delta);
the mean of the replicas' deltas is the pseudo-gradient the outer
optimizer applies to the global params, and every replica continues from
the new global params with its own inner optimizer state.

Streaming DiLoCo does the same for one fragment of the params at a time
(a run of whole leaves, dispatch/outer_spec.py): the delta, the outer
step and its state are those leaves' alone, and the replica takes the new
global leaves in, mixed with its own by `alpha`, at the synchronization
or `overlap` inner steps later (`mix`).

The arrays lie like the params (replicated, or this host's blocks under a
sharded layout); `host_copy` / `load` move them between processes as the
params' gradients move: whole host arrays, or this host's blocks.

On an accelerator the outer optimizer's state waits between
synchronizations in the host's memory (parked.py): an inner step needs
only the round's global params beside its own state, so a replica's
device holds one copy of the params more than a plain step does, not two.
It comes back onto the devices for the outer step alone (one copy in and
one out a round; moving it changes no bit), and is made leaf by leaf, each
parked before the next, so it is never whole on the devices. On CPU the
two memories are one, and it stays where it is.

JAX is imported on use: the driver imports this module through the
worker's actor class.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ray_elastic.checkpoint.state_forms import HostBlocks, WholeState
from ray_elastic.dispatch.outer_spec import OuterSpec
from ray_elastic.worker.parked import HostParked, park, unpark

__all__ = ["OuterState"]


class OuterState:
    """The global params and outer optimizer state of one host, and the
    last round boundary they were synchronized at (`synced`)."""

    def __init__(self, layout: Any, host: int, park: Optional[bool] = None):
        self._layout = layout
        self._host = host
        # Whether the outer state waits in host memory between outer steps
        # (None: on an accelerator, decided at the first array seen).
        self._park = park
        self.global_params: Any = None
        self.state: Any = None
        self.synced = 0
        self._spec: Optional[OuterSpec] = None
        self._fns: Any = None  # (delta, outer update, copy), jitted once the spec is known
        # What the last outer step replaced, (global params, state, synced,
        # the replica's params; None where it left them), until an inner
        # step settles it: a step that some hosts of the run applied and
        # others did not (a slice lost mid-synchronization) is taken back
        # before it runs again (`undo`).
        self._before: Optional[tuple] = None
        # The first inner step that settles it: the next one, but for a
        # Streaming DiLoCo fragment whose new global leaves are mixed in
        # `overlap` steps later; the driver gathers the synchronization
        # only then, so until then it may still be taken back.
        self._settles_at = 0
        # (boundary, fragment, delta) of the last fragment synchronization
        # with an overlap: the inner steps it overlaps move the params, so
        # a synchronization run again (a slice lost meanwhile) sends the
        # delta as it was at the boundary.
        self._sent: Optional[tuple] = None

    @property
    def started(self) -> bool:
        return self.global_params is not None

    def _jitted(self, spec: OuterSpec) -> Any:
        import jax
        import optax

        if self._fns is None or self._spec != spec:
            opt = spec.optimizer()

            def outer(global_params, state, mean_delta):
                updates, state = opt.update(mean_delta, state, global_params)
                return optax.apply_updates(global_params, updates), state

            self._spec = spec
            self._fns = (jax.jit(lambda g, p: jax.tree.map(lambda a, b: a - b, g, p)), jax.jit(outer),
                         jax.jit(lambda t: jax.tree.map(lambda a: jax.numpy.array(a, copy=True), t)), jax.jit(opt.init),
                         jax.jit(lambda inner, g: [spec.alpha * a + (1 - spec.alpha) * b if spec.alpha else
                                                   jax.numpy.array(b, copy=True) for a, b in zip(inner, g)]))
        return self._fns

    def start(self, params: Any, spec: OuterSpec, step: int) -> None:
        """The round that starts at `step` (0: the run's first) from `params`."""
        _, _, copy, init, _ = self._jitted(spec)
        self.global_params = copy(params)  # the inner update donates the params it reads
        if not self._parks(self.global_params):
            self.state = init(self.global_params)
        else:  # leaf by leaf (the optimizer is elementwise: each state leaf mirrors a param's)
            import jax

            g = jax.tree.leaves(self.global_params)
            parts = [jax.tree.leaves(self._parked(init([a]))) for a in g]
            state_def = jax.tree.structure(jax.eval_shape(init, self.global_params))
            per = state_def.num_leaves // len(g)
            self.state = jax.tree.unflatten(state_def, [parts[i][j] for j in range(per) for i in range(len(g))])
        self.synced = step

    def delta(self, params: Any, spec: OuterSpec, leaves: Optional[tuple] = None) -> Any:
        """global - params: this replica's share of the pseudo-gradient;
        with `leaves` (a fragment), {leaf index: its delta} of those alone."""
        import jax

        if leaves is None:
            return self._jitted(spec)[0](self.global_params, params)
        g, p = jax.tree.leaves(self.global_params), jax.tree.leaves(params)
        return dict(zip(leaves, self._jitted(spec)[0]([g[i] for i in leaves], [p[i] for i in leaves])))

    def delta_at(self, params: Any, spec: OuterSpec, boundary: int, step: int, fragment: Optional[int],
                 leaves: Optional[tuple], who: str) -> Any:
        """`delta`'s at round boundary `boundary`, the replica at inner step
        `step`. A fragment's with an overlap is kept: the inner steps it
        overlaps move the params, and a synchronization run again (a
        slice lost meanwhile) sends it as it was at the boundary."""
        if step == boundary:
            d = self.delta(params, spec, leaves)
            self._sent = (boundary, fragment, d) if leaves is not None and spec.overlap else None
            return d
        if self._sent is None or self._sent[:2] != (boundary, fragment) or not boundary < step <= boundary + spec.overlap:
            raise RuntimeError(f"{who} holds step {step}, asked to synchronize at {boundary}")
        return self._sent[2]

    def _apply_fragment(self, mean: dict, spec: OuterSpec) -> None:
        """The outer step over the leaves of `mean` ({leaf index: mean
        delta}) alone, with their share of the outer state: the optimizer
        is elementwise, each state leaf mirrors a param's (SGD's trace)."""
        import jax

        leaves = tuple(sorted(mean))
        g, g_def = jax.tree.flatten(self.global_params)
        o, o_def = jax.tree.flatten(self.state)
        per = len(o) // len(g)  # state leaves per param leaf, in blocks of the params' order
        sub_def = jax.tree.structure(jax.eval_shape(spec.optimizer().init, [g[i] for i in leaves]))
        sub_state = jax.tree.unflatten(sub_def, [o[j * len(g) + i] for j in range(per) for i in leaves])
        new_g, new_o = self._jitted(spec)[1]([g[i] for i in leaves], self._on_devices(sub_state),
                                             [mean[i] for i in leaves])
        new_o = jax.tree.leaves(self._parked(new_o))
        for n, i in enumerate(leaves):
            g[i] = new_g[n]
            for j in range(per):
                o[j * len(g) + i] = new_o[j * len(leaves) + n]
        self.global_params, self.state = jax.tree.unflatten(g_def, g), jax.tree.unflatten(o_def, o)

    def mix(self, params: Any, spec: OuterSpec, leaves: tuple) -> Any:
        """`params` with the global params' `leaves` taken in:
        alpha * inner + (1 - alpha) * global (alpha 0: the global leaves)."""
        import jax

        p, p_def = jax.tree.flatten(params)
        g = jax.tree.leaves(self.global_params)
        for i, a in zip(leaves, self._jitted(spec)[4]([p[i] for i in leaves], [g[i] for i in leaves])):
            p[i] = a
        return jax.tree.unflatten(p_def, p)

    def apply(self, mean_delta: Any, spec: OuterSpec, boundary: int, params: Any, fragment: bool = False) -> Any:
        """The outer step with the replicas' mean delta, over this replica's
        `params`; returns the params every replica continues from (a copy
        of the new global params). A fragment's step (`fragment`:
        `mean_delta` is {leaf index: mean delta}) moves those leaves alone, and the
        replica's own leaves stay but for the fragment's, mixed in now
        unless they are due `overlap` steps later."""
        _, outer, copy, _, _ = self._jitted(spec)
        later = fragment and spec.overlap  # mixed in before inner step boundary + overlap (SliceSteps.local_step)
        self._before = (self.global_params, self.state, self.synced, None if later else params)
        self._settles_at = boundary + (spec.overlap if later else 0)
        self.synced = boundary
        if fragment:
            self._apply_fragment(mean_delta, spec)
            return params if later else self.mix(params, spec, tuple(sorted(mean_delta)))
        self.global_params, state = outer(self.global_params, self._on_devices(self.state), mean_delta)
        self.state = self._parked(state)
        return copy(self.global_params)

    def undo(self, to: int) -> tuple[bool, Optional[Any]]:
        """Take back the last outer step if it moved `synced` past `to`:
        (whether it did, the replica's params from before it; None where
        the step left them as they were)."""
        if self.synced == to or self._before is None or self._before[2] != to:
            return False, None
        self.global_params, self.state, self.synced, params = self._before
        self._before = None
        return True, params

    def settled(self, step: int) -> None:
        """Inner step `step` runs: an outer step it settles is never taken back."""
        if step >= self._settles_at:
            self._before = None

    def global_copy(self, spec: OuterSpec) -> Any:
        return self._jitted(spec)[2](self.global_params)

    def host_copy(self) -> WholeState | HostBlocks:
        """The global params (as params) and the outer state (as opt_state)
        on the host, stepped at the boundary they were synchronized at:
        whole trees (replicated) or this host's blocks (sharded, tagged
        "p" and "o" as a state's are), the forms a state moves in."""
        import jax

        from ray_elastic.worker.shards import local_blocks

        state = self._on_devices(self.state)
        if self._layout.sharded:
            blocks = {**local_blocks(jax.tree.leaves(self.global_params), "p"),
                      **local_blocks(jax.tree.leaves(state), "o")}
            return HostBlocks(self.synced, blocks, self._host)
        host = lambda t: jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), t)  # noqa: E731
        return WholeState(self.synced, host(self.global_params), host(state))

    def load(self, copy: WholeState | HostBlocks, spec: OuterSpec) -> None:
        """Hold another replica's global params and outer state (`host_copy`'s
        form, from the same host index), or a checkpoint's whole arrays."""
        import jax

        from ray_elastic.worker.shards import from_local_blocks
        from ray_elastic.worker.transfer import device_array

        layout = self._layout
        params_def = jax.tree.structure(layout.params_spec())
        state_def = jax.tree.structure(jax.eval_shape(spec.optimizer().init, layout.params_spec()))
        # Every leaf of the outer state mirrors a param's leaf: the params' specs, as often as needed.
        specs = list(layout.param_specs) * max(1, state_def.num_leaves // max(params_def.num_leaves, 1))
        if isinstance(copy, HostBlocks):
            g = from_local_blocks(copy.blocks, layout.param_specs, "p")
            o = from_local_blocks(copy.blocks, specs[:state_def.num_leaves], "o")
        else:
            g = [device_array(a, sp.sharding) for a, sp in zip(jax.tree.leaves(copy.params), layout.param_specs)]
            o = [device_array(a, sp.sharding) for a, sp in zip(jax.tree.leaves(copy.opt_state), specs)]
        self._jitted(spec)
        self._before = None  # a step loaded is never taken back
        self.global_params = jax.tree.unflatten(params_def, g)
        self.state = self._parked(jax.tree.unflatten(state_def, o))
        self.synced = int(copy.step)

    def _parks(self, tree: Any) -> bool:
        if self._park is None:
            import jax

            leaves = [a for a in jax.tree.leaves(tree) if not isinstance(a, HostParked)]
            if not leaves:
                return False
            self._park = next(iter(leaves[0].sharding.device_set)).platform != "cpu"
        return self._park

    def _parked(self, tree: Any) -> Any:
        """`tree` (the outer state) in the host's memory, where it waits
        between outer steps (the module's docstring says why)."""
        return park(tree) if self._parks(tree) else tree

    def _on_devices(self, tree: Any) -> Any:
        """`tree` back on the devices, for an outer step."""
        return unpark(tree)

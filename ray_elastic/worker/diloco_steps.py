"""DiLoCo's calls on one host (control/diloco.py): inner steps each
replica takes alone, on its own shards, and the outer step that
synchronizes the replicas at a round's end. A base of SliceSteps
(steps.py), whose state, programs and exchange they use: the inner step
is steps.py's one-slice step on the devices (device_step.py), the outer
step's deltas travel by the host exchange (host_exchange.py).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import numpy as np

from ray_elastic.dispatch.exchange_plan import ExchangePlan
from ray_elastic.dispatch.outer_spec import OuterSpec, fragment_leaves
from ray_elastic.worker.host_exchange import first_copy
from ray_elastic.worker.reduction import divided
from ray_elastic.worker.shards import from_local_blocks, local_blocks
from ray_elastic.worker.transfer import device_array

__all__ = ["DilocoSteps"]


def _host_value(a):
    return np.asarray(first_copy(a))


class DilocoSteps:
    """DiLoCo's inner and outer steps of one host (SliceSteps' base)."""

    def local_step(self, step: int, shards: tuple[int, ...], spec: OuterSpec) -> dict:
        """A DiLoCo inner step: the mean gradient of this replica's own
        `shards` (summed in shard order on the devices) applied to its own
        state; nothing crosses slices. Returns the step's metrics (those of
        the last inner step when `step` is already taken). The caller holds
        the state's lock."""
        held = self._held
        done = self._taken_or_ready(step, "for inner step")
        if done is not None:
            return done
        if not self.outer.started:  # the run's first round starts from the step-0 state
            self.outer.start(held.params, spec, step)
        self.outer.settled(step)
        due = spec.mixed_before(step)  # Streaming DiLoCo: a fragment synchronized `overlap` steps ago
        if due is not None:
            held.params = self.outer.mix(held.params, spec, self._fragment(spec, due))
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        mine = tuple(sorted(shards))  # summed in shard order on the devices, in the step's program(s)
        _, values = self._run_fused(step, mine, (tuple(range(len(mine))),), 2,
                                    self._one_program(spec.step_program))
        t1 = time.perf_counter()
        self._exchange.spans.add("compute", t0, t1)
        metrics = {"step": step + 1, "loss": values.loss, "shards": values.shards, "aux": values.aux,
                   "grads_s": t1 - t0, "grads_shards": len(shards)}
        if self._notice.at is not None:
            metrics["preempt_notice_at"] = self._notice.at
        held.last_apply = metrics
        return metrics

    def outer_delta(self, boundary: int, replica: int, plan: ExchangePlan, spec: OuterSpec,
                    fragment: Optional[int] = None) -> tuple:
        """(status, chunk payloads) of this replica's delta at round
        boundary `boundary` (of Streaming DiLoCo's `fragment` alone, if
        given), keyed as shard `replica` with weight 1, so the exchange
        sums the replicas' deltas in replica order and the outer apply
        divides by their count."""
        import jax

        held, layout = self._held, self._layout
        speaks = layout.sharded or self._host == 0
        leaves = self._fragment(spec, fragment)
        d = self.outer.delta_at(held.params, spec, boundary, held.step, fragment, leaves, f"slice {self._slice_id}")
        out: dict = {"grads": {}, "loss": {}, "weight": {}, "aux": {}}
        if speaks:
            if leaves is not None:  # {leaf index: delta}: the blocks keyed by the params' own leaf indices
                out["grads"][replica] = ({(t, leaves[i], k): b for (t, i, k), b in local_blocks(list(d.values())).items()}
                                         if layout.sharded else {i: _host_value(a) for i, a in d.items()})
            else:
                out["grads"][replica] = local_blocks(jax.tree.leaves(d)) if layout.sharded else jax.tree.map(_host_value, d)
            out["loss"][replica], out["weight"][replica], out["aux"][replica] = 0.0, 1.0, {}
        return self._exchange_side.send(plan, out, speaks, self._slice_id)

    def _fragment(self, spec: OuterSpec, fragment: Optional[int]) -> Optional[tuple]:
        """The leaf indices of Streaming DiLoCo's `fragment` (None: every leaf)."""
        if fragment is not None and (self._fragments is None or self._fragments[0] != spec.fragments):
            sizes = [math.prod(sp.shape) * np.dtype(sp.dtype).itemsize for sp in self._layout.param_specs]
            self._fragments = (spec.fragments, fragment_leaves(sizes, spec.fragments))
        return None if fragment is None else self._fragments[1][fragment]

    def outer_apply(self, boundary: int, parts: tuple, spec: OuterSpec, fragment: Optional[int] = None) -> dict:
        """The outer step at `boundary` from the owners' sums of the
        replicas' deltas in `parts` (of Streaming DiLoCo's `fragment`
        alone, if given); the held params become the new global params
        (the fragment's, mixed in, worker/diloco.py), the inner optimizer
        state stays. Idempotent for a boundary already synchronized. The
        caller holds the state's lock."""
        import jax

        held, layout = self._held, self._layout
        if self.outer.synced == boundary:
            return {"synced": boundary, "replicas": None, "bytes_in": 0}
        # A fragment mixed in `overlap` steps later is applied as those steps run: the params stay.
        later = fragment is not None and spec.overlap
        if not (boundary <= held.step <= boundary + spec.overlap if later else held.step == boundary):
            raise RuntimeError(f"slice {self._slice_id} holds step {held.step}, asked to synchronize at {boundary}")
        t0 = time.perf_counter()
        leaves = self._fragment(spec, fragment)
        total = self._exchange_side.gathered(tuple(p for p in parts if p and "chunk" in p),
                                              self._exchange_side.fragment_template(leaves))
        count = math.fsum(total["weight"].values())
        mean = jax.tree.map(lambda a: divided(a, count), total["sum"])
        if leaves is not None and layout.sharded:
            at = {i: n for n, i in enumerate(leaves)}
            arrays = from_local_blocks({(t, at[i], k): b for (t, i, k), b in mean.items()},
                                       [layout.param_specs[i] for i in leaves])
            mean = dict(zip(leaves, arrays))
        elif leaves is not None:
            mean = {i: device_array(a, layout.replicated) for i, a in mean.items()}
        elif layout.sharded:
            mean = jax.tree.unflatten(layout.param_def, from_local_blocks(mean, layout.param_specs))
        else:
            mean = jax.tree.map(lambda a: device_array(a, layout.replicated), mean)
        held.params = self.outer.apply(mean, spec, boundary, held.params, leaves is not None)
        if not later:
            held.generation += 1  # another state than the last inner step made (a fingerprint begun of it is void)
        return {"synced": boundary, "replicas": sorted(total["weight"]), "apply_s": time.perf_counter() - t0}

    def adopt_outer(self, copy: dict, spec: OuterSpec, take: Any = "all") -> int:
        """Hold another replica's global params and outer state and take
        in `take` of its global params: "all" (continue from them), a
        Streaming DiLoCo fragment (mixed in as at a synchronization), or
        None (the held params stay: a joiner's state is loaded apart). A
        joiner's, or a slice whose synchronization was cut short. The
        caller holds the state's lock."""
        self._held.ensure()
        mixed = self.outer.synced == int(copy.step)  # this host applied that step itself: its fragment is in
        self.outer.load(copy, spec)
        if take == "all":
            self._held.params = self.outer.global_copy(spec)
        elif take is not None and not mixed:
            self._held.params = self.outer.mix(self._held.params, spec, self._fragment(spec, take))
        self._held.generation += 1
        return self.outer.synced

    def outer_copy(self, spec: OuterSpec):
        """This host's global params and outer state on the host (the
        round's first, made from the held state, if no inner step ran yet)."""
        held = self._held
        if not self.outer.started:
            held.ensure()
            self.outer.start(held.params, spec, held.step)
        return self.outer.host_copy()

    def undo_outer(self, to: int) -> int:
        """Take back an outer step past boundary `to` (worker/diloco.py's
        `undo`); returns the boundary held after. The caller holds the lock."""
        taken, params = self.outer.undo(to)
        if params is not None:
            self._held.params = params
        self._held.generation += taken
        return self.outer.synced

    def load_outer(self, copy, spec: OuterSpec) -> int:
        """Hold global params and an outer state (a checkpoint's, at a cold
        start), the inner state as it is. The caller holds the state's lock."""
        self.outer.load(copy, spec)
        return self.outer.synced

"""One host's side of the cross-slice exchange, on the host: what it sends
(its gradients' host copies, cut into the plan's chunks), what it sums as
the owner of a chunk, and what its apply takes in (the owners' sums laid
back into whole leaves, or the other slices' pieces put on the devices).

The arithmetic is chunks.py's (pure numpy, in the plan's order); this
module holds the host's forms: a replicated slice's host 0 sends whole
arrays, a sharded slice's hosts each their own blocks (shards.py), and
the template that lays a flat sum back into either form. What stays on
the devices is device_sums.py's.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import numpy as np

from ray_elastic.dispatch.exchange_plan import ExchangePlan
from ray_elastic.worker.chunks import SCALARS, assemble, cut, pieces, sum_chunk, sum_meta, wire
from ray_elastic.worker.exchange_stats import ExchangeStats
from ray_elastic.worker.setup import StateLayout
from ray_elastic.worker.shards import block_key, from_local_blocks, local_blocks
from ray_elastic.worker.transfer import device_array

__all__ = ["HostExchange", "first_copy"]


def first_copy(a):
    """A replicated array's first local copy (a single-device array): what
    this host reads of it."""
    return a.addressable_data(0)


class HostExchange:
    """The host forms of one host's gradients in the exchange. `state_op`:
    how the model states' partial values combine ("max", else "sum")."""

    def __init__(self, layout: StateLayout, stats: ExchangeStats, state_op: str) -> None:
        self._layout, self._stats, self._state_op = layout, stats, state_op
        self._template: Optional[tuple] = None

    def host_payload(self, grad: Any) -> Any:
        """A gradient (or a sum of them) on the host, as this host sends
        it: the whole tree (replicated), or its own blocks (sharded)."""
        import jax

        # Every leaf's copy started before any is waited for: one at a time,
        # two 152M gradients left a TPU v5e in 665 ms, against 550 ms at its
        # host link's rate for one large array (2.2 GB/s).
        if self._layout.sharded:
            leaves = jax.tree.leaves(grad)
            for a in leaves:
                for shard in a.addressable_shards:
                    shard.data.copy_to_host_async()
            return local_blocks(leaves)
        return jax.device_get(jax.tree.map(first_copy, grad))

    @staticmethod
    def wire_dtype(plan: ExchangePlan) -> Optional[np.dtype]:
        """The numpy dtype gradients travel in (None: their own)."""
        import jax

        return None if plan.wire_dtype is None else np.dtype(getattr(jax.numpy, plan.wire_dtype))

    def send(self, plan: ExchangePlan, out: dict, speaks: bool, slice_id: int, summed: Optional[dict] = None) -> tuple:
        """(status, chunk payloads) of a gradient call: `summed` ({key:
        host payload}, the block sums made on the devices and already at
        the wire's width), or else `out`'s per-shard gradients, summed
        block by block here; cut for their owners (chunks.py). Chunk 0
        carries the per-shard scalars and model states, and where the
        step is left to the apply, its shards (`fused`), or where the sums
        stayed on the devices, their keys (`held`)."""
        import jax

        if not speaks:
            return (None,) + (None,) * plan.chunks
        t0 = time.perf_counter()
        if summed is None:
            held = pieces(plan, {s: jax.tree.leaves(g) for s, g in out["grads"].items()})
            leaves = {key: wire(ls, self.wire_dtype(plan)) for key, ls in held.items()}
        else:
            leaves = {key: jax.tree.leaves(p) for key, p in summed.items()}
        cuts = {key: cut(ls, plan.chunks) for key, ls in leaves.items()}
        chunks = [{"chunk": c, "from_slice": slice_id, "plan": plan,
                   "pieces": {key: segs[c] for key, segs in cuts.items()}} for c in range(plan.chunks)]
        chunks[0]["meta"] = {f: out[f] for f in (*SCALARS, "model_state") if f in out}
        for marker in ("fused", "held"):  # the step left to the apply; the sums kept on the devices
            if marker in out:
                chunks[0][marker] = out[marker]
        self._stats.sent(chunks, time.perf_counter() - t0)
        return ({"loss": out["loss"]}, *chunks)

    def reduce_chunk(self, plan: ExchangePlan, c: int, parts: tuple, slice_id: int) -> tuple[dict, dict]:
        """(status {"count"}, sum) of chunk c over the sources' chunks in `parts`: this host owns it."""
        import jax

        t0 = time.perf_counter()
        summed = {**sum_chunk(plan, c, parts, jax.tree.map, self._state_op), "from_slice": slice_id}
        taken = self._stats.reduced(parts, time.perf_counter() - t0)
        return {"count": summed["count"], "bytes_in": taken}, summed

    def meta(self, plan: ExchangePlan, sources: tuple) -> dict:
        """The step's per-shard scalars and model states' sum from the
        sources' own chunks (one chunk each: no owner summed them)."""
        import jax

        state = sum_meta(plan, [p for p in sources if p.get("chunk") == 0], jax.tree.map, self._state_op)
        if state["model_state"] is not None:  # copied: read-only from the object store, divided in place later
            state["model_state"] = jax.tree.map(lambda a: np.array(a, copy=True), state["model_state"])
        return state

    def gathered(self, sums: tuple, template: Optional[tuple] = None) -> dict:
        """The step's summed gradient from the owners' chunk sums (or the
        sources' own chunks: one live slice, no owner summed them), with
        its model state and scalars, on the host; of `template`'s form
        (`template()`'s) where given."""
        import jax

        specs, treedef = template or self.template()  # jax.tree.flatten's (leaves, treedef)
        if "pieces" in sums[0]:  # the sources' own chunks: no owner summed them
            by_chunk: dict = {}
            for p in sums:
                by_chunk.setdefault(p["chunk"], []).append(p)
            sums = tuple(sum_chunk(sums[0]["plan"], c, tuple(ps), jax.tree.map, self._state_op)
                         for c, ps in sorted(by_chunk.items()))
        first = min(sums, key=lambda p: p["chunk"])
        state = first["model_state"]  # copied: read-only from the object store, and divided in place later
        return {"sum": jax.tree.unflatten(treedef, assemble(sums, specs)),
                "model_state": None if state is None else jax.tree.map(lambda a: np.array(a, copy=True), state),
                **{f: first.get(f, {}) for f in SCALARS}}

    def piece_on_device(self, segs: list) -> Any:
        """A whole piece of one source's chunk (one chunk: each leaf's
        elements as one segment, in order; zero-size leaves have none) as
        the params' tree on the devices, in the wire's dtype: views of the
        segments, copied only onto the devices."""
        import jax

        specs, treedef = self.template()
        segments = iter(segs)
        leaves = [next(segments).reshape(spec.shape) if math.prod(spec.shape) else np.zeros(spec.shape, spec.dtype)
                  for spec in specs]
        if next(segments, None) is not None:
            raise RuntimeError("a source's piece holds more leaves than the state's gradient")
        return self.on_device(jax.tree.unflatten(treedef, leaves))

    def on_device(self, payload: Any) -> Any:
        """A host payload (`host_payload`'s form) as the params' tree of
        global arrays: each device takes its block."""
        import jax

        layout = self._layout
        if layout.sharded:
            return jax.tree.unflatten(layout.param_def, from_local_blocks(payload, layout.param_specs))
        return jax.tree.map(lambda a: device_array(a, layout.replicated), payload)

    def template(self) -> tuple:
        """(leaves as jax.ShapeDtypeStruct, treedef) of the gradient a host
        sends: the params' tree (replicated), or the dict of this host's
        blocks (sharded, keyed as shards.local_blocks keys them)."""
        import jax

        if self._template is None:
            layout = self._layout
            if not layout.sharded:
                self._template = jax.tree.flatten(layout.params_spec())
            else:
                blocks = {}
                for i, spec in enumerate(layout.param_specs):
                    for index in spec.sharding.addressable_devices_indices_map(spec.shape).values():
                        key = block_key(index, spec.shape)
                        blocks[(None, i, key)] = jax.ShapeDtypeStruct(tuple(b - a for a, b in key), spec.dtype)
                self._template = jax.tree.flatten(blocks)
        return self._template

    def fragment_template(self, leaves: Optional[tuple]) -> Optional[tuple]:
        """The template (`template`'s form) of a Streaming DiLoCo
        fragment's delta, as DiLoCo's outer step keys it; None: the whole
        params'."""
        import jax

        if leaves is None:
            return None
        specs, treedef = self.template()
        keyed = jax.tree.unflatten(treedef, specs)
        if self._layout.sharded:
            return jax.tree.flatten({k: v for k, v in keyed.items() if k[1] in leaves})
        return jax.tree.flatten({i: specs[i] for i in leaves})

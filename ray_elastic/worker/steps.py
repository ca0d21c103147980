"""The step's math on one host: the gradients of its batch shards, a
reduction-tree node's sum, and the apply of the mean gradient.

Slices are data-parallel replicas of each other; the controller is the
slice axis. It hands each slice its batch shards, routes their gradients
to the slices that reduce or apply them (refs in Ray's object store: the
values never pass through the driver), and has every slice apply the mean.
Under a replicated layout host 0 speaks for its slice (every host holds
the same values); under a sharded one every host sends and sums its own
blocks with the same host index of the other slices (shards.py). Either
way the gradients are summed in the order of their shards (reduction.py),
so the state does not depend on which slice computed which shard.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Optional

import numpy as np

from ray_elastic.dispatch.exchange_plan import ExchangePlan
from ray_elastic.worker.batches import BatchReader
from ray_elastic.dispatch.outer_spec import OuterSpec, fragment_leaves
from ray_elastic.worker.diloco import OuterState
from ray_elastic.worker.chunks import SCALARS, assemble, cut, pieces, sum_chunk, wire
from ray_elastic.worker.exchange_stats import ExchangeStats
from ray_elastic.worker.fingerprint import flip_bit, flip_payload_bit, host_fingerprint
from ray_elastic.worker.notices import PreemptionNotice
from ray_elastic.errors import NonFiniteLoss
from ray_elastic.worker.reduction import divided, eval_values, reduce_pieces, step_values
from ray_elastic.worker.setup import CompiledStep, StateLayout
from ray_elastic.worker.shards import block_key, from_local_blocks, local_blocks
from ray_elastic.worker.state import HeldState
from ray_elastic.worker.state_prints import StatePrints
from ray_elastic.worker.transfer import device_array

__all__ = ["SliceSteps"]


def _host_value(a):
    """A replicated array's value on this host (its first local copy)."""
    return np.asarray(a.addressable_data(0))


class SliceSteps:
    """Gradients, reductions and applies of one host of slice `slice_id`,
    on the state it holds. The batch of (step, shard) is the program's
    `make_batch(seed, step, shard, num_shards)`, of which this host feeds
    the rows its devices hold."""

    def __init__(self, layout: StateLayout, compiled: CompiledStep, held: HeldState, *, slice_id: int,
                 host: int, seed: int, num_shards: int, exchange: ExchangeStats, notice: PreemptionNotice):
        self._layout, self._compiled, self._held = layout, compiled, held
        self._slice_id, self._host = slice_id, host
        self._seed, self._num_shards = seed, num_shards
        self._exchange, self._notice = exchange, notice
        # The model state's reduction (program.py); partial sums add, but for "max".
        self._state_reduction = layout.program.model_state_reduction
        self._state_op = "max" if self._state_reduction == "max" else "sum"
        self._batches = BatchReader(layout.program, seed, num_shards, compiled.rows, compiled.eval_rows,
                                    on_read=functools.partial(exchange.spans.add, "batch"))
        self.delay_s = 0.0  # added to every gradient call: a `slow` fault (SliceWorker.slow_down)
        # Steps whose new state is fingerprinted (0: none): the controller
        # compares the replicas (control/integrity.py); off the step's path
        # (state_prints.py) but for the run's last step.
        self.check_every = 0
        self.final_step = 0
        self._prints = StatePrints()
        # Steps at which the gradients sent are fingerprinted (0: none), for
        # the controller's cross-checks; the last such step's prints.
        self.grad_check_every = 0
        self._grad_prints: tuple[int, dict] = (-1, {})
        self._grads_time: tuple[int, float, int] = (-1, 0.0, 0)  # (step, seconds, shards) of the last gradients
        self._window_from: tuple[int, float] = (-1, 0.0)  # (step, when) the last gradients were ready
        # A `corrupt` fault (SliceWorker.corrupt): "state" or "grads", and
        # whether every step from then on, not only the next.
        self.corrupt: Optional[tuple[str, bool]] = None
        self._template = None  # the gradient's treedef and leaves (shape, dtype), as a host sends it
        self._fragments: Optional[tuple] = None  # Streaming DiLoCo: (fragment count, each one's leaf indices)
        self.outer = OuterState(layout, host)  # DiLoCo's global params and outer optimizer state (diloco.py)

    def close(self) -> None:
        """The run ended: drop the batches read ahead (the process may serve another)."""
        self._batches.close()

    def grads(self, step: int, shards: tuple[int, ...], plan: Optional[ExchangePlan] = None) -> tuple:
        """(status, payload) of the gradients of `shards` at the held
        state, which must be that of step `step`: status {"loss": {shard:
        loss}} for the controller, payload {"grads", "loss", "weight",
        "aux", "model_state", "from_slice"} (per shard) for the slices that
        reduce or apply it; (None, None) from the hosts but 0 of a
        replicated slice. With an exchange `plan`: (status, chunk 0, ...,
        chunk n-1), the chunks this host sends to their owners
        (worker/chunks.py), or Nones from a host that sends nothing."""
        import jax

        held, layout = self._held, self._layout
        if step != held.step:
            raise RuntimeError(f"slice {self._slice_id} holds step {held.step}, asked for {step}")
        held.ensure()
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        speaks = layout.sharded or self._host == 0
        out: dict = {"grads": {}, "loss": {}, "weight": {}, "aux": {}, "model_state": {}}
        at_step = device_array(np.int32(step), layout.replicated)
        for shard in shards:
            total, weight, aux, state, g = self._compiled.grad(
                held.params, held.opt_state, self._global_batch(self._batches.train(step, shard)), at_step,
                device_array(np.int32(shard), layout.replicated))
            if shard == shards[-1]:  # the next step's rows, read while this one's gradients compute
                self._batches.read_ahead(step + 1, shards)
            if not speaks:
                continue
            # Under a sharded layout every host sends its own blocks, to the
            # same host of the other slices; a replicated slice's host 0 all.
            out["grads"][shard] = (local_blocks(jax.tree.leaves(g)) if layout.sharded
                                   else jax.tree.map(_host_value, g))
            if shard == shards[0] and self._corrupting("grads"):
                out["grads"][shard] = flip_payload_bit(out["grads"][shard])
            if self._grad_check_due(step):
                self._grad_prints = (step, {**(self._grad_prints[1] if self._grad_prints[0] == step else {}),
                                            shard: host_fingerprint(out["grads"][shard])})
            out["loss"][shard] = float(_host_value(total))
            out["weight"][shard] = w = float(_host_value(weight))
            out["aux"][shard] = {k: float(_host_value(v)) for k, v in aux.items()}
            if state is not None:  # replicated: every sending host carries it whole
                state = jax.tree.map(_host_value, state)
                out["model_state"][shard] = (jax.tree.map(lambda a: a * np.asarray(w, a.dtype), state)
                                             if self._state_reduction == "weighted_mean" else state)
        t1 = time.perf_counter()
        self._grads_time = (step, t1 - t0, len(shards))
        self._exchange.spans.add("compute", t0, t1)
        self._window_from = (step, t1)  # the exchange's window opens: this host's gradients are ready
        if self._compiled.evaluate is not None and step % layout.program.eval_every == 0:
            out["eval"] = self._evaluate(step, shards, speaks)
        if plan is not None:
            return self._chunks(plan, out, speaks)
        if not speaks:
            return None, None  # host 0 speaks for the slice: the values are replicated
        return {"loss": out["loss"]}, {**out, "from_slice": self._slice_id}

    def _chunks(self, plan: ExchangePlan, out: dict, speaks: bool) -> tuple:
        """(status, chunk payloads) of `out`'s gradients, summed block by
        block and cut for their owners (chunks.py)."""
        import jax

        if not speaks:
            return (None,) + (None,) * plan.chunks
        t0 = time.perf_counter()
        dtype = None if plan.wire_dtype is None else np.dtype(getattr(jax.numpy, plan.wire_dtype))
        held = pieces(plan, {s: jax.tree.leaves(g) for s, g in out["grads"].items()})
        cuts = {key: cut(wire(leaves, dtype), plan.chunks) for key, leaves in held.items()}
        chunks = [{"chunk": c, "from_slice": self._slice_id, "plan": plan,
                   "pieces": {key: segs[c] for key, segs in cuts.items()}} for c in range(plan.chunks)]
        chunks[0]["meta"] = {f: out[f] for f in (*SCALARS, "model_state") if f in out}
        self._exchange.sent(chunks, time.perf_counter() - t0)
        return ({"loss": out["loss"]}, *chunks)

    def recompute(self, step: int, shard: int) -> Optional[int]:
        """A cross-check: the fingerprint of the gradient of `shard` at the
        held state, computed again here as the slice that owns the shard
        computes it; None if the state has moved past `step` (the check
        is missed) or this host sends no gradient (a replicated slice's
        hosts but 0, which still take part in the computation). Issued
        before this step's own gradient call, on the same thread, so the
        state cannot move while it runs."""
        import jax

        held, layout = self._held, self._layout
        if step != held.step:
            return None
        held.ensure()
        *_, g = self._compiled.grad(
            held.params, held.opt_state, self._global_batch(self._batches.train(step, shard)),
            device_array(np.int32(step), layout.replicated), device_array(np.int32(shard), layout.replicated))
        if not (layout.sharded or self._host == 0):
            return None
        payload = local_blocks(jax.tree.leaves(g)) if layout.sharded else jax.tree.map(_host_value, g)
        if self.corrupt == ("grads", True) or self._corrupting("check"):  # a chip gone bad computes this wrong too
            payload = flip_payload_bit(payload)
        return host_fingerprint(payload)

    def fingerprint(self) -> list[int]:
        """This host's fingerprint of the held state (a tie-break's, after
        a replay): the one begun by the apply that made it, or made now."""
        held = self._held
        got = self._prints.take(held.step, held.generation)
        if got is not None:
            return got[0]
        self._prints.wait()
        return self._prints.now((held.params, held.opt_state))[0]

    def _grad_check_due(self, step: int) -> bool:
        return bool(self.grad_check_every) and step > 0 and step % self.grad_check_every == 0

    def _evaluate(self, step: int, shards: tuple[int, ...], speaks: bool) -> dict:
        """The eval of the held state on the held-out shards of `shards`:
        {shard: {"total", "weight", "aux"}} (empty from a host that does
        not speak for its slice)."""
        compiled, layout, out = self._compiled, self._layout, {}
        at_step = device_array(np.int32(step), layout.replicated)
        for shard in shards:
            local = self._batches.held_out(shard)
            total, weight, aux = compiled.evaluate(
                self._held.params, self._held.opt_state, self._global_batch(local, compiled.eval_shapes), at_step,
                device_array(np.int32(shard), layout.replicated))
            if speaks:
                out[shard] = {"total": float(_host_value(total)), "weight": float(_host_value(weight)),
                              "aux": {k: float(_host_value(v)) for k, v in aux.items()}}
        return out

    def reduce_chunk(self, plan: ExchangePlan, c: int, parts: tuple) -> tuple[dict, dict]:
        """(status {"count"}, sum) of chunk c over the sources' chunks in `parts`: this host owns it."""
        import jax

        t0 = time.perf_counter()
        summed = {**sum_chunk(plan, c, parts, jax.tree.map, self._state_op), "from_slice": self._slice_id}
        taken = self._exchange.reduced(parts, time.perf_counter() - t0)
        return {"count": summed["count"], "bytes_in": taken}, summed

    def _gathered(self, sums: tuple, template: Optional[tuple] = None) -> dict:
        """The step's summed gradient from the owners' chunk sums, as
        reduce_pieces would give it (its tree, model state, scalars); of
        `template`'s form (`_grad_template`'s) where given."""
        import jax

        if self._template is None:
            self._template = self._grad_template()
        specs, treedef = template or self._template  # jax.tree.flatten's (leaves, treedef)
        if "pieces" in sums[0]:  # the sources' own chunks: one live slice, no owner summed them
            by_chunk: dict = {}
            for p in sums:
                by_chunk.setdefault(p["chunk"], []).append(p)
            sums = tuple(sum_chunk(sums[0]["plan"], c, tuple(ps), jax.tree.map, self._state_op)
                         for c, ps in sorted(by_chunk.items()))
        first = min(sums, key=lambda p: p["chunk"])
        state = first["model_state"]  # copied: read-only from the object store, and divided in place below
        return {"sum": jax.tree.unflatten(treedef, assemble(sums, specs)),
                "model_state": None if state is None else jax.tree.map(lambda a: np.array(a, copy=True), state),
                **{f: first.get(f, {}) for f in SCALARS}}

    def _grad_template(self) -> tuple:
        """(treedef, leaves as jax.ShapeDtypeStruct) of the gradient a host
        sends: the params' tree (replicated), or the dict of this host's
        blocks (sharded, keyed as shards.local_blocks keys them)."""
        import jax

        layout = self._layout
        if not layout.sharded:
            return jax.tree.flatten(layout.params_spec())
        blocks = {}
        for i, spec in enumerate(layout.param_specs):
            for index in spec.sharding.addressable_devices_indices_map(spec.shape).values():
                key = block_key(index, spec.shape)
                blocks[(None, i, key)] = jax.ShapeDtypeStruct(tuple(b - a for a, b in key), spec.dtype)
        return jax.tree.flatten(blocks)

    def reduce(self, keys: tuple[int, ...], parts: tuple) -> tuple[dict, dict]:
        """(status {"count"}, partial sum) of the pieces of `parts` named by `keys`."""
        import jax

        t0 = time.perf_counter()
        partial = reduce_pieces(jax.tree.map, keys, parts, self._state_op)
        self._exchange.reduced(parts, time.perf_counter() - t0)
        return {"count": partial["count"]}, {**partial, "from_slice": self._slice_id}

    def apply(self, step: int, parts: tuple) -> dict:
        """Apply the step's gradient (the shards' sum over their summed
        weight) in `parts` to the state of step `step`; returns the metrics
        of the step (those of the last apply when `step` is already
        applied). The caller holds the state's lock."""
        import jax

        held, layout, program = self._held, self._layout, self._layout.program
        done = self._taken_or_ready(step, "to apply")
        if done is not None:
            return done
        # The held state's fingerprint, begun by the last apply: (seconds
        # spent on it, seconds this apply waited for it).
        checked, spent = {}, (0.0, 0.0)
        got = self._prints.take(step, held.generation)
        if got is not None:
            checked[step], spent = got[0], got[1:]
        self._prints.wait()  # the update below donates the arrays it reads
        t0 = time.perf_counter()
        sums = [p for p in parts if p and "chunk" in p]
        total = self._gathered(tuple(sums)) if sums else reduce_pieces(jax.tree.map, None, parts, self._state_op)
        t1 = time.perf_counter()
        self._exchange.gathered(parts, t1 - t0)
        if self._window_from[0] == step:
            self._exchange.spans.add("exchange", self._window_from[1], t1)
        values = step_values(total, program.aux)
        if not math.isfinite(values.loss) and program.post_update is None:
            raise NonFiniteLoss(step, values.loss)
        mean = jax.tree.map(lambda a: divided(a, values.weight), total["sum"])
        if layout.sharded:
            mean = jax.tree.unflatten(layout.param_def, from_local_blocks(mean, layout.param_specs))
        else:
            mean = jax.tree.map(lambda a: device_array(a, layout.replicated), mean)
        state = total["model_state"]
        if state is not None:
            by = {"mean": values.shards, "weighted_mean": values.weight}.get(self._state_reduction)
            state = jax.tree.map(lambda a: device_array(a if by is None else divided(a, by), layout.replicated),
                                 state)
        scalars = {k: device_array(np.float32(v), layout.replicated)
                   for k, v in {"loss": values.loss, **values.aux}.items()}
        held.advance(*self._compiled.update(held.params, held.opt_state, mean, state, scalars))
        if self._corrupting("state"):
            held.params = flip_bit(held.params)
        metrics = {"step": step + 1, "loss": values.loss, "shards": values.shards, "aux": values.aux}
        if self._grads_time[0] == step:  # for the controller's straggler detection
            metrics["grads_s"], metrics["grads_shards"] = self._grads_time[1:]
        if self._grad_prints[0] == step:  # this step's gradients were fingerprinted: a cross-check's
            metrics["grad_prints"] = dict(self._grad_prints[1])
        if self.check_every and (step + 1) % self.check_every == 0:
            tree = (held.params, held.opt_state)
            # Made now at the run's last step (no apply follows to report
            # it) and where a process drives several devices (a slice of
            # several processes, or of several devices per process): there
            # a thread's fingerprint, read while the next step's gradients
            # computed, disagreed between healthy replicas now and then (a
            # two-host sharded slice; one host of two devices, fsdp_tp), on
            # CPU; never with one device per process, nor made here.
            if step + 1 == self.final_step or jax.process_count() > 1 or jax.local_device_count() > 1:
                prints, took = self._prints.now(tree)
                checked[step + 1] = prints
                spent = (spent[0] + took, spent[1] + took)
            else:
                self._prints.begin(step + 1, held.generation, tree)
        if checked:
            # {state's step: every device's fingerprint of the shards it
            # holds}; under a replicated layout a host's must all be equal.
            metrics.update(fingerprints=checked, fingerprint_s=spent[0], fingerprint_wait_s=spent[1],
                           replicated=not layout.sharded)
        evaluated = eval_values(total, program.eval_aux)
        if evaluated is not None:  # of the state this step started from
            metrics["aux"] = {**values.aux, "eval/loss": evaluated.loss,
                              **{f"eval/{k}": v for k, v in evaluated.aux.items()}}
        if self._notice.at is not None:
            metrics["preempt_notice_at"] = self._notice.at
        held.last_apply = metrics
        return metrics

    # -- DiLoCo (control/diloco.py): inner steps alone, outer steps together --

    def local_step(self, step: int, shards: tuple[int, ...], spec: OuterSpec) -> dict:
        """A DiLoCo inner step: the mean gradient of this replica's own
        `shards` (summed in shard order on the devices) applied to its own
        state; nothing crosses slices. Returns the step's metrics (those of
        the last inner step when `step` is already taken). The caller holds
        the state's lock."""
        import jax

        held, layout, program = self._held, self._layout, self._layout.program
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
        at_step = device_array(np.int32(step), layout.replicated)
        acc, totals, weights, auxes = None, [], [], []
        for shard in shards:
            total, weight, aux, _, g = self._compiled.grad(
                held.params, held.opt_state, self._global_batch(self._batches.train(step, shard)), at_step,
                device_array(np.int32(shard), layout.replicated))
            if shard == shards[-1]:
                self._batches.read_ahead(step + 1, shards)
            acc = g if acc is None else jax.tree.map(jax.numpy.add, acc, g)
            totals.append(total), weights.append(weight), auxes.append(aux)
        values = step_values({"loss": {s: float(_host_value(t)) for s, t in zip(shards, totals)},
                              "weight": {s: float(_host_value(w)) for s, w in zip(shards, weights)},
                              "aux": {s: {k: float(_host_value(v)) for k, v in a.items()} for s, a in zip(shards, auxes)}},
                             program.aux)
        if not math.isfinite(values.loss) and program.post_update is None:
            raise NonFiniteLoss(step, values.loss)
        weight = device_array(np.float32(values.weight), layout.replicated)
        mean = jax.tree.map(lambda a: a / weight, acc)
        scalars = {k: device_array(np.float32(v), layout.replicated) for k, v in {"loss": values.loss, **values.aux}.items()}
        held.advance(*self._compiled.update(held.params, held.opt_state, mean, None, scalars))
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
        return self._chunks(plan, out, speaks)

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
        total = self._gathered(tuple(p for p in parts if p and "chunk" in p), self._fragment_template(leaves))
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

    def _fragment_template(self, leaves: Optional[tuple]) -> Optional[tuple]:
        """The gradient template (`_grad_template`'s form) of a fragment's
        delta, as outer_delta keys it; None: the whole params'."""
        import jax

        if leaves is None:
            return None
        if self._template is None:
            self._template = self._grad_template()
        specs, treedef = self._template
        keyed = jax.tree.unflatten(treedef, specs)
        if self._layout.sharded:
            return jax.tree.flatten({k: v for k, v in keyed.items() if k[1] in leaves})
        return jax.tree.flatten({i: specs[i] for i in leaves})

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

    def _taken_or_ready(self, step: int, asked: str) -> Optional[dict]:
        """The metrics of step `step` if it is taken already (a re-issued
        call); else None, the held state made sure of, which must be that
        of step `step`."""
        held = self._held
        if held.step == step + 1 and held.last_apply is not None:
            return held.last_apply
        if step != held.step:
            raise RuntimeError(f"slice {self._slice_id} holds step {held.step}, asked {asked} {step}")
        held.ensure()
        return None

    def _corrupting(self, target: str) -> bool:
        """Whether a `corrupt` fault of `target` flips a bit now (once,
        unless it lasts)."""
        if self.corrupt is None or self.corrupt[0] != target:
            return False
        if not self.corrupt[1]:
            self.corrupt = None
        return True

    def _global_batch(self, local: dict, shapes: Optional[dict] = None) -> dict:
        import jax

        shapes = self._compiled.global_shapes if shapes is None else shapes
        return {k: jax.make_array_from_process_local_data(self._layout.batch_sharding, v, shapes[k])
                for k, v in local.items()}

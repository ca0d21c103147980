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
from ray_elastic.worker.diloco import OuterState
from ray_elastic.worker.device_step import compile_fused, footprint, plan_positions
from ray_elastic.worker.device_sums import TOTAL, DeviceSums
from ray_elastic.worker.diloco_steps import DilocoSteps
from ray_elastic.worker.exchange_stats import ExchangeStats
from ray_elastic.worker.host_exchange import HostExchange, first_copy
from ray_elastic.worker.fingerprint import flip_bit, flip_payload_bit, host_fingerprint
from ray_elastic.worker.notices import PreemptionNotice
from ray_elastic.errors import NonFiniteLoss
from ray_elastic.worker.reduction import divided, eval_values, reduce_pieces, step_values
from ray_elastic.worker.setup import CompiledStep, StateLayout
from ray_elastic.worker.shards import from_local_blocks, local_blocks
from ray_elastic.worker.state import HeldState
from ray_elastic.worker.state_prints import StatePrints
from ray_elastic.worker.transfer import device_array

__all__ = ["SliceSteps"]


def _host_value(a):
    """A replicated array's value on this host (its first local copy)."""
    return np.asarray(first_copy(a))


def _tree_map(fn, tree):
    import jax

    return jax.tree.map(fn, tree)


class SliceSteps(DilocoSteps):
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
        # The exchange's host side (host_exchange.py), and the step's sums
        # kept on the devices (device_sums.py).
        self._exchange_side = HostExchange(layout, exchange, self._state_op)
        self._sums = DeviceSums(layout.params_spec())
        self._fused: dict = {}  # the one-slice step's programs, by (plan positions, fan-in)
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
        (worker/chunks.py), or Nones from a host that sends nothing; the
        shards are summed on the devices first (device_sums.py), and where
        this call computes every shard of the step its gradient stays
        there for the apply."""
        held, layout = self._held, self._layout
        if step != held.step:
            raise RuntimeError(f"slice {self._slice_id} holds step {held.step}, asked for {step}")
        held.ensure()
        if plan is not None and not self._host_payloads_due(step):
            return self._grads_on_device(step, shards, plan)
        import jax

        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        speaks = layout.sharded or self._host == 0
        out: dict = {"grads": {}, "loss": {}, "weight": {}, "aux": {}, "model_state": {}}
        for shard, (total, weight, aux, state, g) in self._shard_grads(step, shards):
            if not speaks:
                continue
            # Under a sharded layout every host sends its own blocks, to the
            # same host of the other slices; a replicated slice's host 0 all.
            out["grads"][shard] = self._exchange_side.host_payload(g)
            if shard == shards[0] and self._corrupting("grads"):
                out["grads"][shard] = flip_payload_bit(out["grads"][shard])
            if self._grad_check_due(step):
                self._grad_prints = (step, {**(self._grad_prints[1] if self._grad_prints[0] == step else {}),
                                            shard: host_fingerprint(out["grads"][shard])})
            self._scalars_into(out, shard, jax.device_get(jax.tree.map(first_copy, (total, weight, aux, state))))
        t1 = time.perf_counter()
        self._grads_done(step, t0, t1, len(shards))
        if self._compiled.evaluate is not None and step % layout.program.eval_every == 0:
            out["eval"] = self._evaluate(step, shards, speaks)
        if plan is not None:
            return self._exchange_side.send(plan, out, speaks, self._slice_id)
        if not speaks:
            return None, None  # host 0 speaks for the slice: the values are replicated
        return {"loss": out["loss"]}, {**out, "from_slice": self._slice_id}

    def _shard_grads(self, step: int, shards: tuple):
        """(shard, the gradient program's outputs) of each of `shards` in
        turn at the held state (of step `step`), the next step's rows read
        ahead while the last one computes."""
        held, layout = self._held, self._layout
        at_step = device_array(np.int32(step), layout.replicated)
        for shard in shards:
            out = self._compiled.grad(held.params, held.opt_state, self._global_batch(self._batches.train(step, shard)),
                                      at_step, device_array(np.int32(shard), layout.replicated))
            if shard == shards[-1]:
                self._batches.read_ahead(step + 1, shards)
            yield shard, out

    def _host_payloads_due(self, step: int) -> bool:
        """Whether this step's gradients must reach the host shard by
        shard: a cross-check fingerprints each shard's as sent, or a
        `corrupt` fault flips a bit in one."""
        return self._grad_check_due(step) or (self.corrupt is not None and self.corrupt[0] == "grads")

    def _scalars_into(self, out: dict, shard: int, values: tuple) -> None:
        """A shard's (total, weight, aux, model state), on the host, into
        the payload `out`: the scalars as floats, the model state
        multiplied by the weight where it is a weighted mean."""
        total, weight, aux, state = values
        out["loss"][shard] = float(total)
        out["weight"][shard] = w = float(weight)
        out["aux"][shard] = {k: float(v) for k, v in aux.items()}
        if state is not None:  # replicated: every sending host carries it whole
            out["model_state"][shard] = (_tree_map(lambda a: a * np.asarray(w, a.dtype), state)
                                         if self._state_reduction == "weighted_mean" else state)

    def _grads_done(self, step: int, t0: float, t1: float, shards: int) -> None:
        self._grads_time = (step, t1 - t0, shards)
        self._exchange.spans.add("compute", t0, t1)
        self._window_from = (step, t1)  # the exchange's window opens: this host's gradients are ready

    def _grads_on_device(self, step: int, shards: tuple[int, ...], plan: ExchangePlan) -> tuple:
        """`grads` under an exchange plan. Where this call computes every
        shard of a one-slice run's step, nothing: the apply runs the whole
        step on the devices (device_step.py). Else each shard's gradient is
        folded into its block's sum on the devices (device_sums.py), the
        step's scalars fetched once; the sums stay there where this slice
        computes every shard (the survivor of a larger run), else each is
        rounded to the wire's dtype there, copied out once and cut for the
        owners (and kept on the devices where this host's apply takes it
        back: one owner)."""
        import jax

        layout = self._layout
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        speaks = layout.sharded or self._host == 0
        mine = sorted(shards)
        alone = mine == sorted(plan.shards) and plan.chunks == 1
        if alone and plan.blocks == 1:
            # A one-slice run: the whole step runs as one program in the
            # apply (device_step.py). This call only runs the eval, on the
            # state the step starts from, as the others do.
            out: dict = {"grads": {}, "loss": {}, "weight": {}, "aux": {}, "model_state": {}, "fused": tuple(mine)}
            if self._compiled.evaluate is not None and step % layout.program.eval_every == 0:
                out["eval"] = self._evaluate(step, shards, speaks)
            self._grads_done(step, t0, time.perf_counter(), len(mine))
            return self._exchange_side.send(plan, out, speaks, self._slice_id, summed={})
        sums = self._sums
        sums.start(step)
        made: dict = {}  # this call's sums (a re-issued call makes them anew, never adds to the first's)
        whole = {b for b in {plan.block_of(s) for s in mine} if set(plan.members(b)) <= set(mine)}
        values = []
        for shard, (total, weight, aux, state, g) in self._shard_grads(step, tuple(mine)):
            b = plan.block_of(shard)
            key = ("block", b) if b in whole else ("shard", shard)
            made[key] = sums.add(made.get(key), g)
            values.append((total, weight, aux, state))
        # The scalars (and model states) of every shard in one transfer:
        # the only wait for the devices in this call.
        fetched = jax.device_get([jax.tree.map(first_copy, v) for v in values])
        out: dict = {"grads": {}, "loss": {}, "weight": {}, "aux": {}, "model_state": {}}
        for shard, v in zip(mine, fetched):
            self._scalars_into(out, shard, v)
        t1 = time.perf_counter()
        self._grads_done(step, t0, t1, len(mine))
        if self._compiled.evaluate is not None and step % layout.program.eval_every == 0:
            out["eval"] = self._evaluate(step, shards, speaks)
        if plan.chunks == 1:  # this host's apply sums the chunks: its own are taken from the devices
            sums.hold(step, made)
        if alone:
            # The survivor of a larger run: its blocks' sums stay on the
            # devices for its apply, made by the programs every step of the
            # run uses (a new program compiled now would take a step's
            # deadline), so the state stays bitwise the failure-free run's.
            out["held"] = tuple(sorted(made))
            return self._exchange_side.send(plan, out, speaks, self._slice_id, summed={})
        wire = self._exchange_side.wire_dtype(plan)
        copies = {key: self._exchange_side.host_payload(sums.cast(g, wire)) for key, g in made.items()} \
            if speaks else {}
        return self._exchange_side.send(plan, out, speaks, self._slice_id, summed=copies)

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
        return self._exchange_side.reduce_chunk(plan, c, parts, self._slice_id)

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
        sums = tuple(p for p in parts if p and "chunk" in p)
        if sums and "fused" in sums[0]:
            total, values = self._advance_fused(step, sums[0])
        else:
            total, values = self._advance(step, parts, sums)
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

    def _advance(self, step: int, parts: tuple, sums: tuple) -> tuple:
        """Sum the step's gradients in `parts` (`sums`: those of the
        exchange), divide, update the held state: (total, StepValues),
        total's scalars as `reduce_pieces` gives them."""
        import jax

        held, layout, program = self._held, self._layout, self._layout.program
        t0 = time.perf_counter()
        if sums and "pieces" in sums[0]:  # the sources' own chunks: summed here, on the devices
            total = self._exchange_side.meta(sums[0]["plan"], sums)
        elif sums:  # the owners' sums, laid back into whole leaves on the host
            total = self._exchange_side.gathered(sums)
        else:  # the direct hand-off: payloads or tree nodes, summed here on the host
            total = reduce_pieces(jax.tree.map, None, parts, self._state_op)
        values = step_values(total, program.aux)
        if not math.isfinite(values.loss) and program.post_update is None:
            raise NonFiniteLoss(step, values.loss)
        if sums and "pieces" in sums[0]:
            mean = self._mean_on_device(step, sums, values.divisor)
        elif sums:
            mean = self._sums.combine(None, step, (), {TOTAL: self._exchange_side.on_device(total["sum"])},
                                      values.divisor)
        else:
            mean = jax.tree.map(lambda a: divided(a, values.divisor), total["sum"])
            if layout.sharded:
                mean = jax.tree.unflatten(layout.param_def, from_local_blocks(mean, layout.param_specs))
            else:
                mean = jax.tree.map(lambda a: device_array(a, layout.replicated), mean)
        t1 = time.perf_counter()
        self._exchange.gathered(parts, t1 - t0)
        if self._window_from[0] == step:
            self._exchange.spans.add("exchange", self._window_from[1], t1)
        state = total["model_state"]
        if state is not None:
            by = {"mean": np.float32(values.shards), "weighted_mean": values.divisor}.get(self._state_reduction)
            state = jax.tree.map(lambda a: device_array(a if by is None else divided(a, by), layout.replicated),
                                 state)
        scalars = {k: device_array(v, layout.replicated) for k, v in values.metrics.items()}
        held.advance(*self._compiled.update(held.params, held.opt_state, mean, state, scalars))
        return total, values

    def _advance_fused(self, step: int, chunk: dict) -> tuple:
        """One slice: the whole step (every shard's gradient, their sum,
        the division and the update) as one program on the devices
        (device_step.py), which the gradient call left to this apply
        (`chunk`: its marker, and the eval it ran); (total, StepValues)."""
        plan, shards = chunk["plan"], chunk["fused"]
        t0 = time.perf_counter()
        one = self._one_program(plan.step_program)
        total, values = self._run_fused(step, shards, plan_positions(plan), plan.fan_in, one)
        total["eval"] = chunk.get("meta", {}).get("eval") or {}
        t1 = time.perf_counter()
        waited = self._grads_time[1] if self._grads_time[0] == step else 0.0  # a `slow` fault's delay
        self._grads_time = (step, waited + t1 - t0, len(shards))
        self._exchange.spans.add("compute", t0, t1)
        return total, values

    def scratch_bytes(self) -> Optional[int]:
        """The most memory a device gives any of the step's compiled
        programs while it runs (device_step.footprint), None if unknown."""
        return footprint((self._compiled.grad, self._compiled.update, *self._fused.values()))

    def _one_program(self, mode: str) -> bool:
        """Whether a one-slice run's step or a DiLoCo inner step runs as
        one program, update included (ElasticConfig.one_slice_program): on
        an accelerator, where a gradient's memory counts; with the update
        apart where the state must be bitwise any slice count's (CPU)."""
        if mode != "auto":
            return mode == "one"
        return self._layout.mesh.devices.flat[0].platform != "cpu"

    def _run_fused(self, step: int, shards: tuple, blocks: tuple, fan_in: int, one: bool) -> tuple:
        """Step `step` over `shards` (in key order) on the devices, summed
        by `blocks` (device_step.plan_positions) and `fan_in`, in one
        program (`one`) or with the update apart; the held state advanced.
        (total: the shards' scalars, StepValues). Raises NonFiniteLoss
        with the state unchanged."""
        import jax

        held, layout, program = self._held, self._layout, self._layout.program
        key = (blocks, fan_in, one)
        fused = self._fused.get(key)
        if fused is None:
            fused = self._fused[key] = compile_fused(layout, self._compiled, self._seed, self._num_shards, *key,
                                                     self._compiled.compile)
        batches = tuple(self._global_batch(self._batches.train(step, s)) for s in shards)
        self._batches.read_ahead(step + 1, shards)  # the next step's rows, read while this one computes
        out = fused(held.params, held.opt_state, batches, device_array(np.int32(step), layout.replicated),
                    tuple(device_array(np.int32(s), layout.replicated) for s in shards))
        scalars = out[2:] if one else out[2:5]
        # The step's one wait: its scalars, fetched together.
        fetched = jax.device_get(jax.tree.map(first_copy, scalars))
        totals, weights, auxes = fetched[:3]
        total = {"loss": {s: float(t) for s, t in zip(shards, totals)},
                 "weight": {s: float(w) for s, w in zip(shards, weights)},
                 "aux": {s: {k: float(v) for k, v in a.items()} for s, a in zip(shards, auxes)}}
        values = step_values(total, program.aux)
        if one:
            params, slot = out[:2]
            if not fetched[3]:  # the old state, kept by the program: the step is not taken
                held.params, held.opt_state = params, slot
                raise NonFiniteLoss(step, values.loss)
            held.advance(params, slot)
            return total, values
        if not math.isfinite(values.loss) and program.post_update is None:
            raise NonFiniteLoss(step, values.loss)
        mean, state = out[:2]
        metrics = {k: device_array(v, layout.replicated) for k, v in values.metrics.items()}
        held.advance(*self._compiled.update(held.params, held.opt_state, mean, state, metrics))
        return total, values

    def _mean_on_device(self, step: int, sources: tuple, weight: float) -> Any:
        """The step's mean gradient from the sources' own chunks (one chunk
        each), made on the devices: this slice's pieces where this host
        holds them (never copied out and back), the others' copied in."""
        plan = sources[0]["plan"]
        held = self._sums.held(step)
        own, copied = [], {}
        for p in sources:
            mine = p["from_slice"] == self._slice_id
            own.extend(p.get("held", ()))  # kept on the devices by this host's gradient call
            for key, segs in p["pieces"].items():
                if mine and key in held:
                    own.append(key)
                else:
                    copied[key] = self._exchange_side.piece_on_device(segs)
        return self._sums.combine(plan, step, tuple(dict.fromkeys(own)), copied, weight)

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

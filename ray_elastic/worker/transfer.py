"""The held state on its way out of a host and back in: snapshots, copies
for a joining slice, loads.

What leaves a host depends on the layout:

- replicated: every host holds the whole state. A snapshot is one flat
  buffer (`FlatState`, made by one jitted ravel: one copy, not one per
  leaf); a copy for a joining slice is the trees of host arrays
  (`WholeState`).
- sharded: no host holds the whole state, so both are this host's own
  blocks (`HostBlocks`, shards.py), and they load only into the same host
  index of a slice of the same layout.

Whole arrays (a replicated copy, a checkpoint) load into either layout:
each device takes its block of them.

A snapshot is taken in two halves, so that the step does not wait for it:
`begin_snapshot` (in the apply, under the state's lock: it only keeps the
new state's arrays, or dispatches the replicated ravel) and
`finish_snapshot` (on the actor's snapshot thread: host views of those
arrays, which Ray then copies into the object store while the next step's
gradients compute). A replicated ravel is a buffer of its own; a sharded
host keeps the state's own arrays on CPU, whose views are the buffers
themselves. On an accelerator the host copy takes longer than a step
(4.1 GB at 2.1 GB/s on a TPU v5e), so the state is copied on the devices
first where their memory holds that copy beside the step's own
(`device_copy_fits`); where it does not (the 341M example LM on a 16 GB
v5e: 4.3 GB held, 8.9 GiB of step scratch), the snapshot keeps the
state's own arrays, their host copies started at once, and the next
apply waits for what is left of those copies (not for the ravel, which
the snapshot thread makes of them: `BegunSnapshot.keep`). Where the snapshot holds the state's
own arrays, the next apply, which would donate them to its update, makes
the views itself if the snapshot thread has not yet (`keep_begun`): XLA
does not donate a buffer a view still reads (it copies it instead), so
the views stay those of the snapshot's step. Elsewhere the apply never
waits for a snapshot.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ray_elastic.checkpoint.state_forms import FlatState, HostBlocks, WholeState
from ray_elastic.checkpoint.store import unflatten
from ray_elastic.worker.setup import CompiledStep, StateLayout
from ray_elastic.worker.shards import from_local_blocks, local_blocks
from ray_elastic.worker.state import HeldState

__all__ = ["host_ravel", "BegunSnapshot", "StateTransfer", "device_array", "device_copy_fits"]

# Room kept free beyond the copy and the step's scratch, as a share of a
# device's memory: XLA's allocator fragments, and a program's reservation
# is a little more than its memory analysis says.
COPY_MARGIN = 0.05


def device_array(value: Any, sharding: Any):
    """A global array with `sharding` from the whole array `value` on the
    host: each device takes its block."""
    import jax

    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


class BegunSnapshot:
    """A snapshot of one step's state, begun: the state's arrays (or the
    replicated ravel of them, a fresh buffer), and once `views` has run,
    host views of them. `fetch`, where given, copies the arrays to the host
    as they are (`keep`), and the views are then made from those copies:
    the step that donates the arrays waits for the copies alone, not for
    what the views make of them (a ravel of the whole state)."""

    def __init__(self, step: int, arrays: Any, make_views: Callable[[Any], Any], own_buffers: bool,
                 fetch: Optional[Callable[[Any], Any]] = None):
        self.step = step
        self._arrays, self._make_views, self._fetch = arrays, make_views, fetch
        # Whether `arrays` are buffers of the snapshot's own, which the next
        # update does not donate (else they are the held state's).
        self.own_buffers = own_buffers
        self._views: Any = None
        self._kept = False
        self._lock = threading.Lock()

    def keep(self) -> None:
        """Let go of the arrays now (the next update donates them): their
        host copies (`fetch`), or else the views themselves, made now."""
        with self._lock:
            if self._views is not None or self._kept:
                return
            if self._fetch is None:
                self._views, self._arrays = self._make_views(self._arrays), None
            else:
                self._arrays, self._kept = self._fetch(self._arrays), True

    def views(self) -> Any:
        """The host views (made on the first call: it waits for the arrays
        to be computed)."""
        with self._lock:
            if self._views is None:
                self._views, self._arrays = self._make_views(self._arrays), None
            return self._views


class StateTransfer:
    """The held state of one host, out as snapshots and copies, and in
    from them."""

    def __init__(self, layout: StateLayout, compiled: CompiledStep, held: HeldState, slice_id: int, host: int,
                 scratch: Callable[[], Optional[int]] = lambda: None):
        self._layout, self._compiled, self._held = layout, compiled, held
        self._slice_id, self._host = slice_id, host
        self._scratch = scratch  # the step programs' largest new allocation on a device (None: unknown)
        self._begun: Optional[BegunSnapshot] = None  # the newest snapshot begun, not yet finished

    def begin_snapshot(self) -> None:
        """Begin a snapshot of the held state (the caller holds the
        state's lock); `finish_snapshot` ends it. Waits for nothing: the
        state's update may still be computing."""
        import jax

        held = self._held
        held.ensure()
        if self._layout.sharded:
            arrays = (jax.tree.leaves(held.params), jax.tree.leaves(held.opt_state))
            # On CPU the host's views are the device buffers themselves (no
            # copy), and XLA does not donate a buffer a view reads.
            own = _platform(arrays[0]) != "cpu" and self._copy_fits(arrays[0] + arrays[1])
            if own:
                arrays = _device_copy(arrays)
            elif _platform(arrays[0]) != "cpu":
                _start_host_copies(arrays[0] + arrays[1])
            make = lambda a: {**local_blocks(a[0], tag="p"), **local_blocks(a[1], tag="o")}  # noqa: E731
            fetch = None  # the blocks are host copies already (views on CPU)
        elif _platform(jax.tree.leaves(held.params)) != "cpu":
            # An accelerator's ravel would hold a second flat state and the
            # concatenation's temporaries beside the step's own memory: the
            # leaves are copied on the devices instead where that fits (else
            # kept, their host copies started), and raveled on the host as
            # the snapshot thread copies them out.
            arrays = jax.tree.leaves((held.params, held.opt_state))
            own = self._copy_fits(arrays)
            if own:
                arrays = _device_copy(arrays)
            else:
                _start_host_copies(arrays)
            make, fetch = host_ravel, _host_copies
        else:
            arrays = self._compiled.flatten(held.params, held.opt_state)  # dispatched, a fresh buffer
            make = lambda a: np.asarray(a.addressable_data(0))  # noqa: E731
            own, fetch = True, None
        self._begun = BegunSnapshot(held.step, arrays, make, own, fetch)

    def _copy_fits(self, leaves: list) -> bool:
        """Whether every device of this host holds a copy of its part of
        `leaves` beside what it holds now and the step's scratch."""
        scratch = self._scratch()
        if scratch is None:
            return False
        per_device: dict = {}
        for a in leaves:
            for shard in a.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        return all(device_copy_fits(d.memory_stats(), n, scratch) for d, n in per_device.items())

    def keep_begun(self) -> None:
        """The held state is about to be replaced (by an apply donating
        its arrays): make the begun snapshot's views now if they are not
        made yet and are views of those arrays."""
        begun = self._begun
        if begun is not None and not begun.own_buffers:
            begun.keep()

    def finish_snapshot(self, step: int) -> tuple[dict, FlatState | HostBlocks]:
        """(status, state) of the snapshot begun of `step`'s state: the
        host views, which Ray copies into the object store as this call
        returns. status: step, bytes, and the seconds and CPU seconds of
        this thread (the views, waiting for the update to be computed; the
        copy into the object store comes after and is not in them)."""
        begun, t0, c0 = self._begun, time.perf_counter(), time.thread_time()
        if begun is None or begun.step != step:
            raise RuntimeError(f"slice {self._slice_id} host {self._host}: no snapshot of step {step} was begun "
                               f"(the newest is of step {None if begun is None else begun.step})")
        views = begun.views()  # before letting go of it: an apply on the other thread would skip it
        if self._begun is begun:
            self._begun = None
        if self._layout.sharded:
            state, nbytes = HostBlocks(step, views, self._host), sum(v.nbytes for v in views.values())
        else:
            state, nbytes = FlatState(step, views), views.nbytes
        status = {"step": step, "bytes": int(nbytes), "views_s": time.perf_counter() - t0,
                  "views_cpu_s": time.thread_time() - c0}
        return status, state

    def snapshot(self) -> FlatState | HostBlocks:
        """The state of the held step as it is kept in memory: one flat
        host buffer, or this host's blocks (sharded)."""
        self._held.ensure()
        if self._layout.sharded:
            return self.blocks()
        flat = self._compiled.flatten(self._held.params, self._held.opt_state)  # a fresh buffer: no copy needed
        return FlatState(self._held.step, np.asarray(flat.addressable_data(0)))

    def copy(self) -> WholeState | HostBlocks:
        """The state as host numpy arrays: the trees (replicated) or this
        host's blocks (sharded), views as in `blocks`."""
        import jax

        held = self._held
        held.ensure()
        if self._layout.sharded:  # never the whole state: this host's part
            return self.blocks()
        host = lambda a: np.asarray(a.addressable_data(0))  # noqa: E731 (replicated; views, as in blocks)
        return WholeState(held.step, jax.tree.map(host, held.params), jax.tree.map(host, held.opt_state))

    def blocks(self) -> HostBlocks:
        """This host's own blocks of the state: its snapshot, and what the
        same host of a joining slice loads.

        Views of the device buffers, not copies: Ray copies them into the
        object store as the call returns, and a copy here would double the
        host's peak memory for nothing. The buffers are donated to the next
        update, but XLA does not donate a buffer that a view still reads (it
        copies it instead), so a view never sees the next step's values."""
        import jax

        held = self._held
        out = local_blocks(jax.tree.leaves(held.params), tag="p")
        out.update(local_blocks(jax.tree.leaves(held.opt_state), tag="o"))
        return HostBlocks(held.step, out, self._host)

    def load(self, state: FlatState | HostBlocks | WholeState) -> int:
        """Hold `state` (any of the forms above, or a checkpoint's whole
        arrays); returns its step."""
        if isinstance(state, HostBlocks):  # a sharded snapshot, from the same host index of another slice
            if state.host != self._host:
                raise ValueError(f"host {self._host} of slice {self._slice_id} was handed host {state.host}'s "
                                 "blocks: a sharded state loads host to host")
            trees = self.from_blocks(state.blocks)
            return self._held.hold(trees["params"], trees["opt_state"], int(state.step))
        if isinstance(state, FlatState):  # an in-memory snapshot
            if self._compiled.unravel is not None:
                params, opt_state = self._compiled.unravel(state.flat)
                state = WholeState(state.step, params, opt_state)
            else:
                # On the host, with numpy: jax's unravel runs one small
                # device op per leaf, each compiled on first use, which in
                # a new process costs more than the rest of the load.
                trees = unflatten(state.flat, self._layout.template)
                state = WholeState(state.step, trees["params"], trees["opt_state"])
        if not isinstance(state, WholeState):
            raise TypeError(f"slice {self._slice_id} host {self._host} cannot load a {type(state).__name__}")
        return self._hold_whole(state)

    def from_blocks(self, blocks: dict) -> dict:
        """The params and opt_state trees of global arrays whose local
        blocks are `blocks` (this host's, as `blocks` keys them)."""
        import jax

        layout = self._layout
        return {"params": jax.tree.unflatten(layout.param_def, from_local_blocks(blocks, layout.param_specs, "p")),
                "opt_state": jax.tree.unflatten(layout.opt_def, from_local_blocks(blocks, layout.opt_specs, "o"))}

    def _hold_whole(self, state: WholeState) -> int:
        layout = self._layout

        def make():
            return (_put_tree(state.params, layout.param_def, layout.param_specs),
                    _put_tree(state.opt_state, layout.opt_def, layout.opt_specs))

        return self._held.hold_made(make, int(state.step))


def host_ravel(leaves: list) -> np.ndarray:
    """The flat buffer `jax.flatten_util.ravel_pytree` makes of `leaves`
    (each replicated leaf's first copy, in order, cast to their common
    dtype), made on the host."""
    import jax.numpy as jnp

    dtype = jnp.result_type(*leaves) if leaves else np.float32
    parts = [_host_copies([a])[0].reshape(-1) for a in leaves]
    out = np.empty(sum(p.size for p in parts), dtype)
    at = 0
    for p in parts:
        out[at:at + p.size] = p
        at += p.size
    return out


def device_copy_fits(stats: Optional[dict], copy_bytes: int, scratch_bytes: int) -> bool:
    """Whether a device whose memory is `stats` (its `memory_stats()`)
    holds `copy_bytes` more beside the `scratch_bytes` a step's program
    allocates while it runs, with COPY_MARGIN of its memory to spare.
    False where the device does not say (a copy that does not fit fails
    the next step; one not made only waits)."""
    if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return False
    limit = int(stats["bytes_limit"])
    return limit - int(stats["bytes_in_use"]) >= copy_bytes + scratch_bytes + COPY_MARGIN * limit


def _start_host_copies(leaves: list) -> None:
    """Start every leaf's copy to the host (their views then wait only
    for what is left of them)."""
    for a in leaves:
        a.copy_to_host_async()


def _host_copies(leaves: list) -> list:
    """Each replicated leaf's first copy as a host array (a host array as it is)."""
    return [np.asarray(a.addressable_data(0)) if hasattr(a, "addressable_data") else np.asarray(a) for a in leaves]


def _platform(leaves) -> str:
    return next(iter(leaves[0].sharding.device_set)).platform if leaves else "cpu"


def _device_copy(tree):
    """Fresh buffers holding `tree`'s values, on the same devices (a
    runtime copy: nothing compiled per leaf shape on the step's path)."""
    import jax

    return jax.tree.map(lambda a: jax.device_put(a, a.sharding, may_alias=False), tree)


def _put_tree(tree, treedef, specs):
    """Whole host arrays, laid out by each leaf's spec."""
    import jax

    leaves = [device_array(v, spec.sharding) for v, spec in zip(jax.tree.leaves(tree), specs)]
    return jax.tree.unflatten(treedef, leaves)

"""The worker: one Ray actor process per host, running its slice's part of
each step.

A slice is one JAX system (`jax.distributed` across its hosts when it has
more than one) on a mesh of all its devices, as the program's layout says
(layout.py): by default one `data` axis with the batch split over it and
the training state replicated on every device; under a sharded layout the
state is split over named in-slice axes and each host holds only its own
blocks (shards.py). Slices are data-parallel replicas of each other; the
controller is the slice axis: it hands each slice its batch shards, routes
their gradients between the slices through Ray's object store, and has
every slice apply the mean (steps.py). A slice can therefore be lost, added
or replaced without touching the JAX systems of the others, which is what
makes recovery take a step rather than a restart (a JAX process cannot
re-join a new distributed group: `jax.distributed.initialize` cannot run
twice in one process).

`SliceWorker` is the actor's face: the methods the driver calls by name
through Ray. The work is done by the modules beside it: set-up (setup.py),
the held state (state.py), the step's math (steps.py), snapshots, copies
and loads (transfer.py), sharded checkpoint writes (checkpoints.py), the
SIGTERM notice (notices.py) and the exchange counters (exchange_stats.py).

This module is imported by the driver too (cluster/slice_group.py): JAX is
imported only inside the worker's calls.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

from ray_elastic.checkpoint.state_forms import FlatState, HostBlocks, WholeState
from ray_elastic.dispatch.exchange_plan import ExchangePlan
from ray_elastic.program import TrainProgram
from ray_elastic.worker.checkpoints import HostCheckpointing
from ray_elastic.dispatch.outer_spec import OuterSpec
from ray_elastic.worker.exchange_stats import ExchangeStats
from ray_elastic.worker.gc_pauses import GcPauses
from ray_elastic.worker.host_cache import HostCompileCache
from ray_elastic.worker.inputs import CallInputs
from ray_elastic.worker.notices import PreemptionNotice
from ray_elastic.worker.predecessors import Predecessor, process_started, wait_gone
from ray_elastic.worker.readiness import phase_seconds, readiness_phases
from ray_elastic.worker.setup import compile_step, free_port, lay_out, start_jax
from ray_elastic.worker.state import HeldState
from ray_elastic.worker.steps import SliceSteps
from ray_elastic.worker.transfer import StateTransfer
from ray_elastic.worker.warm_pool import keep_warm

__all__ = ["SliceWorker"]

_MODULE_AT = time.time()  # this module imported: the actor's class loaded
# RAY_ELASTIC_EAGER_SETUP=1 (in the workers' environment): set-up as it was
# before readiness was cut down (the step-0 state made in set-up, snapshots
# unflattened by jax); `python -m bench ready` measures both.
_EAGER_SETUP = os.environ.get("RAY_ELASTIC_EAGER_SETUP", "") == "1"


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class SliceWorker:
    """Host `host` of `hosts` of slice `slice_id`. A plain class;
    `cluster/slice_group.py` turns it into a Ray actor (`ray.remote`)."""

    def __init__(
        self,
        slice_id: int,
        host: int,
        hosts: int,
        program_factory: Callable[[], TrainProgram],
        seed: int,
        num_shards: int,
        created_at: Optional[float] = None,
    ):
        # Readiness phases (wall clock, time.time(), comparable with the
        # driver's on one machine and to NTP's precision across machines):
        # the driver's actor creation, this process's start, the start of
        # this constructor (the class and its module loaded).
        self._init_at = time.time()
        self._created_at = created_at
        self.slice_id = slice_id
        self.host = host
        self.hosts = hosts
        self._factory = program_factory
        self._seed = seed
        self._num_shards = num_shards
        self._held = HeldState()
        self._exchange = ExchangeStats(slice_id)
        # What its calls fetch, and which stop waiting for it (abort_waits;
        # the controller's StepRunner numbers them by epoch and step).
        self._inputs = CallInputs(f"slice {slice_id} host {host}", self._exchange.took_in)
        # A preemption notice finishes the step in hand instead of killing
        # the process mid-step (notices.py).
        self._notice = PreemptionNotice()
        self._notice.install()
        # The collector's walks of JAX's heap stop every thread's Python;
        # the heap is frozen once built (gc_pauses.py).
        self._gc = GcPauses()
        self._first_apply_done = False
        # A fault that outlasts its run (an `oom` fault's touched memory) or a
        # preemption notice: no later run may keep this process (reusable).
        self._tainted = False
        # Made by `setup`: the layout, the compiled step, the step, the state's transfers and checkpoints.
        self._layout = self._compiled = self._steps = self._transfer = self._checkpoints = None
        self._devices = 0
        self._jax_devices: list = []  # the slice's JAX devices, once started (setup)

    @property
    def params(self) -> Any:
        """The held params (global JAX arrays; None before they are made)."""
        return self._held.params

    @property
    def opt_state(self) -> Any:
        return self._held.opt_state

    # -- set-up -----------------------------------------------------------

    def info(self) -> dict:
        import ray

        return {
            "pid": os.getpid(),
            "started": process_started(),  # with the pid, names this process (worker/predecessors.py)
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def coordinator_address(self) -> str:
        """Host 0 of a multi-host slice hosts the JAX coordinator."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def setup(self, coordinator: Optional[str], compile_cache_dir: str = "", warm_workers: int = 0,
              state_check_every: int = 0, grad_check_every: int = 0, final_step: int = 0,
              predecessors: Sequence[Predecessor] = ()) -> dict:
        """Start JAX, build the program, compile the step (the step-0 state
        is made when first needed); then ask this host's raylet for
        `warm_workers` idle processes for a replacement to start in
        (worker/warm_pool.py), off the set-up's path. The state of every
        `state_check_every`-th step is fingerprinted, and the gradients of
        every `grad_check_every`-th (0: never); `final_step`: the run's
        last, whose state is fingerprinted within its apply. Nothing starts
        before the `predecessors` on this host's node (workers the driver
        gave up on) have exited, killed if they still run
        (worker/predecessors.py): their accelerator memory is then free.

        Returns setup_s, devices, per_host (whether the state moves host to
        host: a sharded layout), ready_at and `phases`: seconds per part of
        the way from the actor's creation to ready (readiness.py)."""
        out = self._setup(coordinator, compile_cache_dir, predecessors)
        return self._ready(out, warm_workers, state_check_every, grad_check_every, final_step)

    def renew(self, slice_id: int, warm_workers: int = 0, state_check_every: int = 0, grad_check_every: int = 0,
              final_step: int = 0) -> dict:
        """Serve a new run of the driver in this process, kept from its
        last (cluster/kept_workers.py): the JAX system, layout and compiled
        step stay; everything of a run (the held state, from its step-0
        state again; the batches read ahead; aborts, counters, snapshots
        and checkpoint writers) is made anew, so the run computes what new
        workers would, as slice `slice_id` of the new run (a number the
        worker only names its messages with). The other arguments and the
        reply are setup's; no warm process is asked for again (the one
        set-up asked for stays)."""
        t0, at = time.perf_counter(), time.time()
        self.slice_id = slice_id
        self._steps.close()
        self._gc.thaw()
        self._held = HeldState()
        self._exchange = ExchangeStats(self.slice_id)
        self._inputs = CallInputs(f"slice {slice_id} host {self.host}", self._exchange.took_in)
        self._first_apply_done = False
        self._build_run(self._compiled)
        done = time.time()
        # One phase: the run's parts made in the kept process (readiness.py names the others).
        out = {"setup_s": time.perf_counter() - t0, "devices": self._devices, "phases": {"kept_process": phase_seconds(at, done)},
               "ready_at": done, "per_host": self._layout.sharded, "predecessors": None}
        # The warm process this worker asked for at its set-up is still
        # there, unused (a replacement takes it): asking again would pile
        # up idle processes run after run.
        return self._ready(out, 0, state_check_every, grad_check_every, final_step)

    def reprogram(self, slice_id: int, program_factory: Callable[[], TrainProgram], seed: int, num_shards: int,
                  compile_cache_dir: str = "", warm_workers: int = 0, state_check_every: int = 0,
                  grad_check_every: int = 0, final_step: int = 0) -> dict:
        """Serve a new run of the driver that trains another program (or
        seed, or shard count) on a slice of the same shape, in this
        process, kept from its last (cluster/kept_workers.py): the JAX
        system stays (the backend, and a multi-host slice's
        jax.distributed, which cannot start twice in one process), the
        last run's program, compiled step and state are dropped, and the
        new program is built and compiled as `setup` does, as slice
        `slice_id` of the new run. Other arguments and reply as setup's;
        no warm process is asked for again."""
        t0, at = time.perf_counter(), time.time()
        self.slice_id = slice_id
        self._steps.close()
        self._gc.thaw()
        self._layout = self._compiled = self._steps = self._transfer = self._checkpoints = None
        self._held = HeldState()
        self._exchange = ExchangeStats(self.slice_id)
        self._inputs = CallInputs(f"slice {slice_id} host {self.host}", self._exchange.took_in)
        self._first_apply_done = False
        self._factory, self._seed, self._num_shards = program_factory, seed, num_shards
        marks = [("setup_start", time.time())]
        out = self._build(self._jax_devices, compile_cache_dir, t0, marks)
        # kept_process: the last run's parts dropped; then setup's phases from program_build on.
        out["phases"] = {"kept_process": phase_seconds(at, marks[0][1]),
                         **{name: phase_seconds(a, b) for (_, a), (name, b) in zip(marks, marks[1:])}}
        return self._ready(out, 0, state_check_every, grad_check_every, final_step)

    def reusable(self) -> bool:
        """Whether a later run may keep this process: no fault that
        outlasts its run was injected into it and no preemption notice
        came. A `slow` or `corrupt` fault lives in the run's steps, which
        renew and reprogram make anew, and a `gil` fault is over once its
        call returns: a later run of this process has neither."""
        return not self._tainted and self._notice.at is None

    def _ready(self, out: dict, warm_workers: int, state_check_every: int, grad_check_every: int,
               final_step: int) -> dict:
        out["gc_frozen"] = self._gc.freeze(collect=True)
        self._steps.check_every, self._steps.grad_check_every = state_check_every, grad_check_every
        self._steps.final_step = final_step
        if warm_workers:
            threading.Thread(target=keep_warm, args=(warm_workers,), daemon=True, name="warm-pool").start()
        return out

    def _setup(self, coordinator: Optional[str], compile_cache_dir: str, predecessors: Sequence[Predecessor]) -> dict:
        t0 = time.perf_counter()
        marks = [("setup_start", time.time())]
        # Ray's runtime context starts a Ray of its own in a process that has
        # none (a worker built in a test's or a tool's own process): asked
        # only where there is a predecessor to place.
        node = _node_id() if predecessors else ""
        gone = wait_gone(predecessors, node)
        marks.append(("predecessors", time.time()))
        self._jax_devices = devices = start_jax(coordinator, compile_cache_dir, self.hosts, self.host, marks)
        out = self._build(devices, compile_cache_dir, t0, marks)
        out["phases"] = readiness_phases(self._created_at, _MODULE_AT, self._init_at, marks)
        out["predecessors"] = gone
        return out

    def _build(self, devices: list, compile_cache_dir: str, t0: float, marks: list) -> dict:
        """The program built and laid out over `devices`, its step
        compiled and a run's parts made over them (marks from
        `program_build` on)."""
        cache = HostCompileCache(compile_cache_dir)  # hosts JAX's own cache misses (host_cache.py)
        self._layout = layout = lay_out(devices, self._factory, self._seed, marks, cache.compile)
        self._held.start(layout.initial)
        if _EAGER_SETUP:  # as before (the bench's reference): the state now, and jax's unravel
            self._held.ensure()
        marks.append(("initial_state", time.time()))
        eager_state = (self._held.params, self._held.opt_state) if _EAGER_SETUP else None
        self._devices = len(devices)
        self._compiled = compile_step(layout, self._seed, self._num_shards, marks, eager_state, cache.compile)
        self._build_run(self._compiled)
        return {"setup_s": time.perf_counter() - t0, "devices": len(devices), "ready_at": marks[-1][1],
                "per_host": layout.sharded, "host_cache": {"hits": cache.hits, "misses": cache.misses},
                "predecessors": None}

    def _build_run(self, compiled: Any) -> None:
        """A run's parts over the layout and compiled step (the held state
        started from step 0 where it is new)."""
        layout = self._layout
        if self._held.step < 0:
            self._held.start(layout.initial)
        self._steps = SliceSteps(layout, compiled, self._held, slice_id=self.slice_id, host=self.host,
                                 seed=self._seed, num_shards=self._num_shards, exchange=self._exchange,
                                 notice=self._notice)
        self._transfer = StateTransfer(layout, compiled, self._held, self.slice_id, self.host, self._steps.scratch_bytes)
        self._checkpoints = HostCheckpointing(layout, self._transfer, self._held, self.host, self.hosts)

    # -- one step, in two phases -------------------------------------------

    def compute_grads(self, step: int, shards: tuple[int, ...], *after: Any, plan: Optional[ExchangePlan] = None) -> tuple:
        """Phase 1: the gradient of each assigned shard at the held state.

        `step` is the index of the step being taken: the state held is the
        result of `step` completed steps. Pure in (state, step, shards), so
        the controller may re-issue it. Returns (status, payload): the
        controller reads only the small status; the payload (the gradients:
        the whole tree from host 0 of a replicated slice, none from its
        other hosts; each host's own blocks under a sharded layout) goes
        from here to the slices that reduce or apply it, never through the
        driver. `after`: ignored; a pipelined call passes the previous
        step's apply replies of every host of the slice, so that Ray runs it
        once they are all done (and not at all if one failed). With an
        exchange `plan`, the payload is cut into the plan's chunks, one
        return each (worker/chunks.py).
        """
        return self._steps.grads(step, shards, plan)

    def recompute(self, step: int, shard: int) -> Optional[int]:
        """A gradient cross-check (control/integrity.py): the fingerprint of
        shard `shard`'s gradient at the held state of step `step`, computed
        again on this slice; None if missed or from a host that sends none.
        On the `compute` thread, issued before the step's own call."""
        return self._steps.recompute(step, shard)

    def fingerprint(self) -> list[int]:
        """This host's fingerprint of the state it holds, one per local
        device (a tie-break's: control/tie_break.py)."""
        with self._held.lock:
            return self._steps.fingerprint()

    def reduce_chunk(self, step: int, plan: ExchangePlan, c: int, parts: list, epoch: int = 0) -> tuple[dict, dict]:
        """The exchange's reduce-scatter on the owner of chunk c: the sum of
        every source's chunk c (`parts`: refs, fetched here: inputs.py)
        in the plan's order. Pure, so the controller may re-issue it."""
        return self._steps.reduce_chunk(plan, c, self._inputs.fetch(parts, epoch, step))

    def reduce(self, step: int, keys: tuple[int, ...], parts: list, epoch: int = 0) -> tuple[dict, dict]:
        """One node of the controller's reduction tree: the in-order sum of
        the pieces named by `keys` (shards, or lower nodes' first shards)
        found in `parts` (refs, fetched here: inputs.py). Pure, so the
        controller may re-issue it."""
        return self._steps.reduce(keys, self._inputs.fetch(parts, epoch, step))

    def take_inputs(self, step: int, parts: list, epoch: int = 0) -> int:
        """Fetch the inputs of step `step`'s apply (`parts`, as `apply`
        takes them) and hold them for it, on a slice of several hosts
        (dispatch/applies.py); returns `step`."""
        self._inputs.take(parts, epoch, step)
        return step

    def apply(self, step: int, snapshot: bool, parts: Optional[list], epoch: int = 0, *taken: Any) -> dict:
        """Phase 2: apply the mean of all shard gradients, in shard order.

        `parts` are refs of phase-1 payloads or reduction-tree partial sums
        (fetched here: inputs.py); either way they are summed in the
        order of the shards they cover, so the result does not depend on
        which slice computed which shard. Returns the step's metrics.
        `snapshot`: begin a snapshot of the new state, which the driver's
        `snapshot` call then takes off the step's path (transfer.py).
        `taken`: on a slice of several hosts, every host's `take_inputs`
        reply (Ray runs this call once they are all in, and not at all if
        one failed); `parts` is then None and the inputs are those taken.
        Idempotent for a step already applied, so the controller can
        re-issue it.
        """
        parts = (self._inputs.taken(epoch, step, applied=self._held.step == step + 1) if taken else
                 self._inputs.fetch(parts, epoch, step))
        with self._held.lock:
            self._transfer.keep_begun()  # the apply donates the state a snapshot may not have viewed yet
            metrics = self._steps.apply(step, parts)
            if snapshot:
                self._transfer.begin_snapshot()
        if not self._first_apply_done:  # what the first step made on use lives as long as the process
            self._first_apply_done = True
            self._gc.freeze()
        metrics["gc_pause_s"], metrics["gc_full"] = self._gc.take()
        return metrics

    # -- DiLoCo (control/diloco.py, worker/diloco.py) ------------------------

    def inner_step(self, step: int, shards: tuple[int, ...], spec: OuterSpec, *after: Any) -> dict:
        """A DiLoCo inner step on this replica's own `shards`, applied to
        its own state (no exchange). `after`: ignored (refs Ray waits for:
        a replacement's catch-up chains its steps). Idempotent for a step
        already taken."""
        with self._held.lock:
            metrics = self._steps.local_step(step, shards, spec)
        if not self._first_apply_done:
            self._first_apply_done = True
            self._gc.freeze()
        metrics["gc_pause_s"], metrics["gc_full"] = self._gc.take()
        return metrics

    def diloco_delta(self, boundary: int, replica: int, plan: ExchangePlan, spec: OuterSpec,
                     fragment: Optional[int] = None) -> tuple:
        """(status, chunk 0, ..., chunk n-1): this replica's delta from the
        round's global params (Streaming DiLoCo's `fragment` of it, if
        given), cut for the exchange's owners."""
        with self._held.lock:
            return self._steps.outer_delta(boundary, replica, plan, spec, fragment)

    def diloco_outer(self, boundary: int, spec: OuterSpec, parts: list, epoch: int = 0,
                     fragment: Optional[int] = None) -> dict:
        """The outer step at `boundary` over the owners' sums in `parts`
        (refs, fetched here); idempotent for a boundary already synchronized."""
        parts = self._inputs.fetch(parts, epoch, boundary)
        with self._held.lock:
            reply = self._steps.outer_apply(boundary, parts, spec, fragment)
        if "apply_s" in reply:  # applied now: its inputs are counted (a simulated link waited for) off the
            # lock, so the inner steps it overlaps run meanwhile, as they would while the bytes come in
            reply["bytes_in"] = self._exchange.gathered(parts, reply.pop("apply_s"))
            reply["at_step"] = self._held.step  # the inner steps taken meanwhile (a read: no lock needed)
        return reply

    def hold_copy(self, value: Any) -> Any:
        """`value` (another slice's state, a ref Ray fetched here) back:
        the reply is a copy in this host's node's object store, owned by
        the driver, that outlives the node `value` came from."""
        return value

    def diloco_synced(self, undo_past: Optional[int] = None) -> int:
        """The last round boundary this host synchronized at (0: none yet);
        with `undo_past`, an outer step past that boundary is taken back
        first (a synchronization some hosts of the run applied and others
        did not, run again)."""
        with self._held.lock:
            return self._steps.outer.synced if undo_past is None else self._steps.undo_outer(undo_past)

    def diloco_global(self, spec: OuterSpec) -> WholeState | HostBlocks:
        """This host's global params and outer state on the host, for a joining replica."""
        with self._held.lock:
            return self._steps.outer_copy(spec)

    def diloco_load_outer(self, copy: WholeState | HostBlocks, spec: OuterSpec) -> int:
        """Hold a checkpoint's global params and outer state; the inner
        state (loaded apart) stays. Returns their boundary."""
        with self._held.lock:
            return self._steps.load_outer(copy, spec)

    def diloco_adopt(self, copy: WholeState | HostBlocks, spec: OuterSpec, take: Any = "all") -> int:
        """Hold another replica's global params and outer state
        (`diloco_global`'s) and take in `take` of its global params
        (steps.py's adopt_outer), keeping this replica's inner optimizer
        state. Returns their boundary."""
        with self._held.lock:
            return self._steps.adopt_outer(copy, spec, take)

    def snapshot(self, step: int, *after: Any) -> tuple[dict, FlatState | HostBlocks]:
        """(status, state): the snapshot of the state after step `step`
        that its apply began, on the actor's `snapshot` thread, so the next
        step's gradients compute meanwhile. `after`: the apply's reply, so
        that Ray runs this once the apply is done. The driver issues it and
        so owns the state's copy, which outlives this process on its node."""
        t0 = time.perf_counter()
        try:
            return self._transfer.finish_snapshot(step + 1)
        finally:
            self._exchange.spans.add("snapshot", t0, time.perf_counter())

    def device_memory(self) -> dict:
        """This host's devices' memory as JAX counts it (peak_bytes_in_use,
        bytes_in_use: the largest over its devices; None where the backend
        keeps no count, as on CPU)."""
        import jax

        stats = [d.memory_stats() or {} for d in jax.local_devices()]
        peak = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
        now = [s["bytes_in_use"] for s in stats if "bytes_in_use" in s]
        return {"peak_bytes_in_use": max(peak) if peak else None, "bytes_in_use": max(now) if now else None}

    def exchange_stats(self) -> dict:
        """Cross-slice exchange counters since start: applies, bytes of
        gradient blocks received from other slices' hosts, bytes of this
        slice's own payloads taken, and seconds: in the exchange, and of
        other work inside its windows (worker/overlap.py)."""
        return self._exchange.as_dict()

    # -- state -------------------------------------------------------------

    def flat_state(self) -> FlatState | HostBlocks:
        """The held state's snapshot: one flat host buffer (a jitted ravel:
        one copy, not one per leaf) under a replicated layout, this host's
        own blocks under a sharded one (transfer.py); `load_state` takes it
        back."""
        return self._transfer.snapshot()

    def state(self) -> WholeState | HostBlocks:
        """The training state as host numpy arrays, for a joining slice:
        the whole trees (replicated) or this host's blocks (sharded); views
        of the device buffers (transfer.py)."""
        with self._held.lock:
            return self._transfer.copy()

    def load_state(self, state: FlatState | HostBlocks | WholeState) -> int:
        """Hold `state`: a snapshot, a copy from `state`, or whole arrays;
        a sharded one only from the same host index. Returns its step."""
        return self._transfer.load(state)

    # -- sharded checkpoints (checkpoint/host_writes.py) ----------------------

    def save_checkpoint(self, path: str, keep: int, meta: dict, save_id: str, part: dict) -> dict:
        """Write `part` (the snapshot blocks of this host index, from any
        slice) as step meta["step"], with the other hosts of this slice,
        each its own shards. Runs on the actor's checkpoint thread."""
        return self._checkpoints.save(path, keep, meta, save_id, part)

    def restore_checkpoint(self, path: str, keep: int, step: int, nonce: str) -> int:
        """Load committed `step` with the other hosts of this slice, each
        reading its own shards onto this slice's layout."""
        return self._checkpoints.restore(path, keep, step, nonce)

    def state_template(self) -> dict:
        """The state's tree of shapes and dtypes (for checkpoints)."""
        return self._layout.template

    def held_step(self, with_metrics: bool = False):  # and the metrics of the apply that made it
        return (self._held.step, self._held.last_apply) if with_metrics else self._held.step

    def abort_waits(self, epoch: int, from_step: int = 0) -> None:
        """A slice was lost: every apply or reduction issued in `epoch` or
        before, for step `from_step` or later, that still waits for an
        input stops waiting and raises (it changes nothing). Runs on the
        `control` concurrency group, so it reaches a call that is waiting."""
        self._inputs.aborts.abort(epoch, from_step)

    def ping(self) -> bool:
        return True

    def slow_down(self, ms: int) -> None:
        """A `slow` fault (failures/faults.py): every gradient call of this
        run from now on takes `ms` milliseconds longer, as on a straggler."""
        self._steps.delay_s = ms / 1000.0

    def hold_gil(self, ms: int) -> None:
        """A `gil` fault (failures/faults.py): hold Python's GIL for `ms`
        milliseconds in one C call, as a long garbage collection or a C
        extension does: no thread of this process (pings included) runs
        Python meanwhile, yet the process is alive and busy."""
        import ctypes

        class Timespec(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

        libc = ctypes.PyDLL(None)  # a PyDLL's functions run with the GIL held
        libc.nanosleep(ctypes.byref(Timespec(ms // 1000, (ms % 1000) * 1_000_000)), None)

    def eat_memory(self, mb: int) -> None:
        """An `oom` fault (failures/faults.py): allocate and touch `mb`
        megabytes in 64 MB pieces, hold them 3 s, let them go: a leak that
        Ray's memory monitor may end by killing this process. The process
        may keep the memory it touched (the allocator need not give it
        back): no later run keeps it (reusable)."""
        import numpy as np

        self._tainted = True
        held = [np.ones(64 * 2**20, dtype=np.uint8) for _ in range(max(1, mb // 64))]
        time.sleep(3.0)
        del held

    def corrupt(self, target: str, lasting: bool) -> None:
        """A `corrupt` fault (failures/faults.py): flip one bit of the
        next apply's new state on one device ("state"), of the next
        gradient sent ("grads"), or of the next cross-check's computation
        ("check"); `lasting`: at every step from then on, as a chip gone
        bad would, for this run (the next run's steps are new)."""
        self._steps.corrupt = (target, lasting)

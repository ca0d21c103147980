"""The worker: one process per host, running the slice's part of each step.

A slice is one JAX system (`jax.distributed` across its hosts when it has
more than one) with a 1-D mesh over all its devices: the batch is split over
that axis and the training state is replicated. Slices are data-parallel
replicas of each other; the controller is the slice axis: it hands each
slice its shards, gathers the shard gradients through Ray's object store,
and has every slice apply their mean. A slice can therefore be lost, added
or replaced without touching the JAX systems of the others, which is what
makes recovery take a step rather than a restart (a JAX process cannot
re-join a new distributed group: `jax.distributed.initialize` cannot run
twice in one process).

This module is imported inside worker processes; it imports JAX lazily so
the driver never has to.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ray_elastic.checkpoint.store import unflatten as _unflatten
from ray_elastic.dispatch.assignment import rows_fed
from ray_elastic.errors import ConfigError
from ray_elastic.worker.inputs import Aborts, fetch_inputs
from ray_elastic.program import TrainProgram
from ray_elastic.worker.readiness import readiness_phases
from ray_elastic.worker.reduction import divided, reduce_pieces
from ray_elastic.worker.shards import from_local_blocks, local_blocks
from ray_elastic.worker.warm_pool import keep_warm

__all__ = ["SliceWorker"]

_MODULE_AT = time.time()  # this module imported: the actor's class loaded
# RAY_ELASTIC_EAGER_SETUP=1 (in the workers' environment): set-up as it was
# before readiness was cut down (the step-0 state made in set-up, snapshots
# unflattened by jax); `python -m bench ready` measures both.
_EAGER_SETUP = os.environ.get("RAY_ELASTIC_EAGER_SETUP", "") == "1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SliceWorker:
    """Plain class; `cluster/slice_group.py` turns it into a Ray actor (`ray.remote`)."""

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
        # Which calls stop waiting for their inputs (abort_waits); the
        # controller's StepRunner numbers them by epoch and step.
        self._aborts = Aborts()
        self.slice_id = slice_id
        self.host = host
        self.hosts = hosts
        self._factory = program_factory
        self._seed = seed
        self._num_shards = num_shards
        self._step = -1  # step of the state held; -1 before any
        self._last_apply: Optional[dict] = None
        # `state` may be called (by a joining slice's donor) on a second
        # actor thread: the lock keeps `apply` from replacing the state
        # while it is being copied.
        self._state_lock = threading.Lock()
        self._init_lock = threading.Lock()
        self.params = self.opt_state = None
        self._ckpts = None  # this host's side of sharded checkpoints (host_writes.py), on first use
        # Bytes of gradient blocks this host received from the other
        # slices' hosts (its cross-slice exchange), per apply; read by
        # `exchange_stats` (the sharded benchmark).
        self._exchange = {"applies": 0, "bytes_from_other_slices": 0, "own_bytes": 0}
        # A preemption notice to this process (SIGTERM from the node's
        # shutdown, a kubelet, a spot reclaim): finish the step in hand and
        # tell the controller, which checkpoints and retires the slice at
        # the step boundary, instead of dying mid-step.
        self._sigterm_at: Optional[float] = None
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: keep Ray's default
            pass

    def _on_sigterm(self, signum, frame) -> None:
        if self._sigterm_at is None:
            self._sigterm_at = time.time()

    # -- set-up -----------------------------------------------------------

    def info(self) -> dict:
        import ray

        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def coordinator_address(self) -> str:
        """Host 0 of a multi-host slice hosts the JAX coordinator."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def setup(self, coordinator: Optional[str], compile_cache_dir: str = "", warm_workers: int = 0) -> dict:
        """Start JAX, build the program, compile the step, make step-0 state;
        then ask this host's raylet for `warm_workers` idle processes for a
        replacement to start in (worker/warm_pool.py), off the set-up's path.

        Returns setup_s and `phases`: seconds per part of the way from the
        actor's creation to ready (see `_phases`)."""
        out = self._setup(coordinator, compile_cache_dir)
        if warm_workers:
            threading.Thread(target=keep_warm, args=(warm_workers,), daemon=True, name="warm-pool").start()
        return out

    def _setup(self, coordinator: Optional[str], compile_cache_dir: str) -> dict:
        t0 = time.perf_counter()
        marks = [("setup_start", time.time())]
        import jax
        import optax

        marks.append(("imports", time.time()))

        if compile_cache_dir:
            jax.config.update("jax_compilation_cache_dir", compile_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

        if coordinator is not None:
            # Asking JAX for its backend here would start it too early.
            if os.environ.get("JAX_PLATFORMS", "") == "cpu":
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            # Else JAX's preemption service takes SIGTERM, and the notice is lost.
            jax.config.update("jax_enable_preemption_service", False)
            jax.distributed.initialize(coordinator, num_processes=self.hosts, process_id=self.host)
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        devices = jax.devices()  # starts the backend
        marks.append(("jax_init", time.time()))
        self._jax = jax
        self.program = program = self._factory()
        marks.append(("program_build", time.time()))
        layout = program.layout
        plan = layout.plan(len(devices))
        self.mesh = Mesh(np.array(devices).reshape(plan.axis_sizes), plan.axis_names)
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._batch_sharding = NamedSharding(self.mesh, PartitionSpec(plan.batch_axes))
        self._sharded = layout.sharded

        def grad_fn(params, batch):
            return jax.value_and_grad(program.loss_fn)(params, batch)

        def update_fn(params, opt_state, grads):
            updates, opt_state = program.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        # The step-0 state is made when first needed (`_ensure_state`), not
        # here: a replacement loads the live state at once, so making it
        # would be wasted; the step is compiled against its shapes.
        # Lowered once (traced once: a program may cache what its init
        # traces), compiled and run only when the state is needed.
        rng = jax.random.PRNGKey(self._seed)
        p_out, o_out = self._state_shardings(program, rng)
        init_params = jax.jit(program.init_params, out_shardings=p_out).lower(rng)
        p_shape = init_params.out_info
        p_spec = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), p_shape,
                              _full(p_out, p_shape))
        init_opt = jax.jit(program.optimizer.init, out_shardings=o_out).lower(p_spec)
        o_shape = init_opt.out_info
        self._init_fns = (init_params, init_opt, rng)
        params = p_spec
        opt_state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), o_shape,
                                 _full(o_out, o_shape))
        # The leaves' global shapes and shardings: what a host's blocks are
        # put back into (shards.from_local_blocks).
        self._p_specs, self._p_def = jax.tree.flatten(params)
        self._o_specs, self._o_def = jax.tree.flatten(opt_state)
        p_out, o_out = _full(p_out, p_shape), _full(o_out, o_shape)
        self._template = {"params": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p_shape),
                          "opt_state": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), o_shape)}
        self.params = self.opt_state = None
        self._step = 0
        self._unravel = None
        if _EAGER_SETUP:  # as before (the bench's reference): the state now, and jax's unravel
            self._ensure_state()
        marks.append(("initial_state", time.time()))
        sample = {k: np.asarray(v) for k, v in program.make_batch(self._seed, 0, 0, self._num_shards).items()}
        rows = next(iter(sample.values())).shape[0]
        if rows % plan.batch_ways:
            raise ConfigError("layout.batch_axes", f"a shard's batch of {rows} rows does not split over the "
                              f"{plan.batch_ways} devices of the batch axes {plan.batch_axes}; make the per-shard "
                              "batch a multiple of that, or split the batch over fewer axes")
        # The rows this host's devices hold (all of them under tensor parallelism across hosts).
        index = self._batch_sharding.addressable_devices_indices_map((rows,))
        self._rows = rows_fed([rows_of[0] for rows_of in index.values()], rows)
        global_shape = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self._batch_sharding) for k, v in sample.items()}
        self._global_shapes = {k: v.shape for k, v in sample.items()}
        # Compile once, ahead of time: shapes never change with the number of
        # live slices, so resizing never recompiles.
        self._grad = (
            jax.jit(grad_fn, out_shardings=(self._replicated, p_out)).lower(params, global_shape).compile()
        )
        self._update = (
            jax.jit(update_fn, out_shardings=(p_out, o_out), donate_argnums=(0, 1))
            .lower(params, opt_state, params)
            .compile()
        )
        from jax.flatten_util import ravel_pytree

        marks.append(("compile", time.time()))
        if self._sharded:  # snapshots are each host's own blocks: no flat copy
            return {"setup_s": time.perf_counter() - t0, "devices": len(devices), "phases": self._phases(marks),
                    "ready_at": marks[-1][1], "per_host": True}
        marks.pop()
        if _EAGER_SETUP:
            _, self._unravel = ravel_pytree((self.params, self.opt_state))
        self._flatten = (
            jax.jit(lambda p, o: ravel_pytree((p, o))[0], out_shardings=self._replicated)
            .lower(params, opt_state)
            .compile()
        )
        marks.append(("compile", time.time()))
        return {"setup_s": time.perf_counter() - t0, "devices": len(devices), "phases": self._phases(marks),
                "ready_at": marks[-1][1], "per_host": False}

    def _state_shardings(self, program: TrainProgram, rng) -> tuple:
        """The params' and optimizer state's shardings: replicated, or by
        the layout's specs (the optimizer state following its params)."""
        if not self._sharded:
            return self._replicated, self._replicated
        import optax
        from jax.sharding import NamedSharding, PartitionSpec

        from ray_elastic.layout import resolve_param_specs

        jax = self._jax
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        abstract = jax.eval_shape(program.init_params, rng)
        specs = resolve_param_specs(program.layout, abstract)
        o_specs = optax.tree_map_params(
            program.optimizer, lambda _, spec: spec, jax.eval_shape(program.optimizer.init, abstract), specs,
            transform_non_params=lambda v: jax.tree.map(lambda _: PartitionSpec(), v), is_leaf=is_spec,
        )
        named = lambda tree: jax.tree.map(lambda p: NamedSharding(self.mesh, p), tree, is_leaf=is_spec)  # noqa: E731
        return named(specs), named(o_specs)

    def _ensure_state(self) -> None:
        """Make the step-0 state if no state is held yet (a slice that
        starts the run; a replacement loads one instead)."""
        with self._init_lock:
            if self.params is None:
                init_params, init_opt, rng = self._init_fns
                params = init_params.compile()(rng)
                self.opt_state = init_opt.compile()(params)
                self.params = params

    def _phases(self, marks: list) -> dict:
        return readiness_phases(self._created_at, _MODULE_AT, self._init_at, marks)

    # -- one step, in two phases -------------------------------------------

    def _local_batch(self, step: int, shard: int) -> dict:
        full = self.program.make_batch(self._seed, step, shard, self._num_shards)
        out = {}
        for k, v in full.items():
            out[k] = np.asarray(v)[self._rows]
        return out

    def _to_global_batch(self, local: dict) -> dict:
        return {
            k: self._jax.make_array_from_process_local_data(self._batch_sharding, v, self._global_shapes[k])
            for k, v in local.items()
        }

    def compute_grads(self, step: int, shards: tuple[int, ...], *after: Any) -> tuple[Optional[dict], Optional[dict]]:
        """Phase 1: the gradient of each assigned shard at the held state.

        `step` is the index of the step being taken: the state held is the
        result of `step` completed steps. Pure in (state, step, shards), so
        the controller may re-issue it. Returns (status, payload): the
        controller reads only the small status; the payload (the gradients)
        goes from here to the slices that reduce or apply it, never through
        the driver. `after`: ignored; a pipelined call passes the previous
        step's apply replies of every host of the slice, so that Ray runs it
        once they are all done (and not at all if one failed).
        """
        if step != self._step:
            raise RuntimeError(f"slice {self.slice_id} holds step {self._step}, asked for {step}")
        self._ensure_state()
        grads, losses = {}, {}
        for shard in shards:
            loss, g = self._grad(self.params, self._to_global_batch(self._local_batch(step, shard)))
            if self._sharded:  # every host sends its own blocks, to the same host of the other slices
                grads[shard] = local_blocks(self._jax.tree.leaves(g))
                losses[shard] = float(np.asarray(loss.addressable_data(0)))
            elif self.host == 0:
                grads[shard] = self._jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), g)
                losses[shard] = float(np.asarray(loss.addressable_data(0)))
        if self.host != 0 and not self._sharded:
            return None, None  # host 0 speaks for the slice: the values are replicated
        return {"loss": losses}, {"grads": grads, "loss": losses, "from_slice": self.slice_id}

    def reduce(self, step: int, keys: tuple[int, ...], parts: list, epoch: int = 0) -> tuple[dict, dict]:
        """One node of the controller's reduction tree: the in-order sum of
        the pieces named by `keys` (shards, or lower nodes' first shards)
        found in `parts` (refs, fetched here: see `_inputs`). Pure, so the
        controller may re-issue it."""
        partial = reduce_pieces(self._jax.tree.map, keys, self._inputs(parts, epoch, step))
        return {"count": partial["count"]}, partial

    def apply(self, step: int, snapshot: bool, parts: list, epoch: int = 0):
        """Phase 2: apply the mean of all shard gradients, in shard order.

        `parts` are refs of phase-1 payloads or reduction-tree partial sums
        (fetched here: see `_inputs`); either way they are summed in the
        order of the shards they cover, so the result does not depend on
        which slice computed which shard. Returns (metrics, snapshot or
        None). The snapshot rides on the step's own reply, so a step is
        never reported complete before its snapshot is sealed in the object
        store: a failure at any moment finds the state of the last completed
        step. Idempotent for a step already applied, so the controller can
        re-issue it.
        """
        parts = self._inputs(parts, epoch, step)
        with self._state_lock:
            metrics = self._apply(step, parts)
            return metrics, (self.flat_state() if snapshot else None)

    def _apply(self, step: int, parts: tuple) -> dict:
        if self._step == step + 1 and self._last_apply is not None:
            return self._last_apply
        if step != self._step:
            raise RuntimeError(f"slice {self.slice_id} holds step {self._step}, asked to apply {step}")
        self._ensure_state()
        total = reduce_pieces(self._jax.tree.map, None, parts)
        n = total["count"]
        mean = self._jax.tree.map(lambda a: divided(a, n), total["sum"])
        if self._sharded:
            mean = self._jax.tree.unflatten(self._p_def, from_local_blocks(mean, self._p_specs))
        else:
            mean = self._jax.tree.map(self._replicate, mean)
        self.params, self.opt_state = self._update(self.params, self.opt_state, mean)
        self._step = step + 1
        self._count_exchange(parts)
        losses = total["loss"]
        metrics = {
            "step": step + 1,
            "loss": float(np.mean([losses[s] for s in sorted(losses)])),
            "shards": n,
        }
        if self._sigterm_at is not None:
            metrics["preempt_notice_at"] = self._sigterm_at
        self._last_apply = metrics
        return metrics

    def _count_exchange(self, parts: tuple) -> None:
        """Add this apply's gradient bytes: those of payloads computed by
        other slices (what crossed slices to this host) and of its own."""
        other = own = 0
        for part in parts:
            if not part or "grads" not in part:
                continue  # a gate, or a reduction-tree partial
            n = sum(_nbytes(g) for g in part["grads"].values())
            if part.get("from_slice") == self.slice_id:
                own += n
            else:
                other += n
        self._exchange["applies"] += 1
        self._exchange["bytes_from_other_slices"] += other
        self._exchange["own_bytes"] += own

    def exchange_stats(self) -> dict:
        """Cross-slice exchange counters since start: applies, bytes of
        gradient blocks received from other slices' hosts, bytes of this
        slice's own payloads taken."""
        return dict(self._exchange)

    # -- state -------------------------------------------------------------

    def _replicate(self, value: np.ndarray):
        value = np.asarray(value)
        return self._jax.make_array_from_callback(value.shape, self._replicated, lambda idx: value[idx])

    def _put(self, value, spec):
        value = np.asarray(value)
        return self._jax.make_array_from_callback(value.shape, spec.sharding, lambda idx: value[idx])

    def flat_state(self) -> dict:
        """The state as one host buffer (a jitted ravel: one copy, not one
        per leaf); `load_state` takes it back."""
        self._ensure_state()
        if self._sharded:
            return self._blocks()
        flat = self._flatten(self.params, self.opt_state)  # a fresh buffer: no copy needed
        return {"step": self._step, "flat": np.asarray(flat.addressable_data(0))}

    def state(self) -> dict:
        """The training state as host numpy arrays (views of the device
        buffers: see `_blocks`)."""
        with self._state_lock:
            return self._state()

    def _blocks(self) -> dict:
        """This host's own blocks of the state: its snapshot, and what the
        same host of a joining slice loads.

        Views of the device buffers, not copies: Ray copies them into the
        object store as the call returns, and a copy here would double the
        host's peak memory for nothing. The buffers are donated to the next
        update, but XLA does not donate a buffer that a view still reads (it
        copies it instead), so a view never sees the next step's values."""
        jax = self._jax
        blocks = local_blocks(jax.tree.leaves(self.params), tag="p")
        blocks.update(local_blocks(jax.tree.leaves(self.opt_state), tag="o"))
        return {"step": self._step, "blocks": blocks, "host": self.host}

    def _state(self) -> dict:
        self._ensure_state()
        if self._sharded:  # never the whole state: this host's part
            return self._blocks()
        host = lambda a: np.asarray(a.addressable_data(0))  # noqa: E731 (replicated; views, as in _blocks)
        return {
            "step": self._step,
            "params": self._jax.tree.map(host, self.params),
            "opt_state": self._jax.tree.map(host, self.opt_state),
        }

    def load_state(self, state: dict) -> int:
        if "blocks" in state:  # a sharded snapshot, from the same host index of another slice
            if state.get("host", self.host) != self.host:
                raise ValueError(f"host {self.host} of slice {self.slice_id} was handed host {state['host']}'s "
                                 "blocks: a sharded state loads host to host")
            return self._hold(self._from_blocks(state["blocks"]), int(state["step"]))
        if "flat" in state:  # an in-memory snapshot
            if self._unravel is not None:
                params, opt_state = self._unravel(state["flat"])
                state = {"step": state["step"], "params": params, "opt_state": opt_state}
            else:
                # On the host, with numpy: jax's unravel runs one small
                # device op per leaf, each compiled on first use, which in
                # a new process costs more than the rest of the load.
                state = dict(_unflatten(state["flat"], self._template), step=state["step"])
        with self._state_lock, self._init_lock:
            # Whole arrays (a checkpoint, a replicated snapshot): each
            # device takes its block of them.
            self.params = self._jax.tree.unflatten(self._p_def, [
                self._put(v, spec) for v, spec in zip(self._jax.tree.leaves(state["params"]), self._p_specs)])
            self.opt_state = self._jax.tree.unflatten(self._o_def, [
                self._put(v, spec) for v, spec in zip(self._jax.tree.leaves(state["opt_state"]), self._o_specs)])
            self._step = int(state["step"])
            self._last_apply = None
        return self._step

    def _from_blocks(self, blocks: dict) -> dict:
        jax = self._jax
        return {"params": jax.tree.unflatten(self._p_def, from_local_blocks(blocks, self._p_specs, "p")),
                "opt_state": jax.tree.unflatten(self._o_def, from_local_blocks(blocks, self._o_specs, "o"))}

    def _hold(self, state: dict, step: int) -> int:
        with self._state_lock, self._init_lock:
            self.params, self.opt_state, self._step = state["params"], state["opt_state"], step
            self._last_apply = None
        return step

    # -- sharded checkpoints (checkpoint/host_writes.py) ----------------------

    def _checkpoints(self, path: str, keep: int):
        from ray_elastic.checkpoint.host_writes import HostCheckpoints

        if self._ckpts is None or self._ckpts.path != path:
            self._ckpts = HostCheckpoints(path, keep, self.host, self.hosts)
        return self._ckpts

    def save_checkpoint(self, path: str, keep: int, meta: dict, save_id: str, part: dict) -> dict:
        """Write `part` (the snapshot blocks of this host index, from any
        slice) as step meta["step"], with the other hosts of this slice,
        each its own shards. Runs on the actor's checkpoint thread."""
        if int(part["step"]) != int(meta["step"]):
            raise ValueError(f"asked to save step {meta['step']}, handed a snapshot of step {part['step']}")
        return self._checkpoints(path, keep).save(int(meta["step"]), self._from_blocks(part["blocks"]), meta, save_id)

    def restore_checkpoint(self, path: str, keep: int, step: int, nonce: str) -> int:
        """Load committed `step` with the other hosts of this slice, each
        reading its own shards onto this slice's layout."""
        jax = self._jax
        target = {"params": jax.tree.unflatten(self._p_def, self._p_specs),
                  "opt_state": jax.tree.unflatten(self._o_def, self._o_specs)}
        state, _ = self._checkpoints(path, keep).restore(step, target, nonce)
        return self._hold(state, step)

    def state_template(self) -> dict:
        """The state's tree of shapes and dtypes (for checkpoints)."""
        return self._template

    def held_step(self, with_metrics: bool = False):  # and the metrics of the apply that made it
        return (self._step, self._last_apply) if with_metrics else self._step

    def abort_waits(self, epoch: int, from_step: int = 0) -> None:
        """A slice was lost: every apply or reduction issued in `epoch` or
        before, for step `from_step` or later, that still waits for an
        input stops waiting and raises (it changes nothing). Runs on the
        `control` concurrency group, so it reaches a call that is waiting."""
        self._aborts.abort(epoch, from_step)

    def _inputs(self, refs: list, epoch: int, step: int) -> tuple:
        return fetch_inputs(refs, lambda: self._aborts.covers(epoch, step),
                            f"slice {self.slice_id} host {self.host}: step {step}'s inputs")

    def ping(self) -> bool:
        return True


def _nbytes(tree) -> int:
    """Bytes of the arrays in a payload's gradient (nested dicts, lists of arrays)."""
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return int(np.asarray(tree).nbytes)


def _full(sharding, tree):
    """One sharding per leaf of `tree` (a single one stands for all)."""
    import jax

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda _: sharding, tree)
    return sharding

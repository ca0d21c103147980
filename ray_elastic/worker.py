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

from ray_elastic.data import host_rows
from ray_elastic.program import TrainProgram

__all__ = ["SliceWorker"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SliceWorker:
    """Plain class; `slice_group.py` turns it into a Ray actor (`ray.remote`)."""

    def __init__(
        self,
        slice_id: int,
        host: int,
        hosts: int,
        program_factory: Callable[[], TrainProgram],
        seed: int,
        num_shards: int,
    ):
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

    def setup(self, coordinator: Optional[str], compile_cache_dir: str = "") -> dict:
        """Start JAX, build the program, compile the step, make step-0 state."""
        t0 = time.perf_counter()
        import jax

        if compile_cache_dir:
            jax.config.update("jax_compilation_cache_dir", compile_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

        if coordinator is not None:
            # Asking JAX for its backend here would start it too early.
            if os.environ.get("JAX_PLATFORMS", "") == "cpu":
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator, num_processes=self.hosts, process_id=self.host)
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        import optax

        self._jax = jax
        self.program = program = self._factory()
        self.mesh = Mesh(np.array(jax.devices()), ("data",))
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._batch_sharding = NamedSharding(self.mesh, PartitionSpec("data"))

        def grad_fn(params, batch):
            return jax.value_and_grad(program.loss_fn)(params, batch)

        def update_fn(params, opt_state, grads):
            updates, opt_state = program.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        params = jax.jit(program.init_params, out_shardings=self._replicated)(
            jax.random.PRNGKey(self._seed)
        )
        opt_state = jax.jit(program.optimizer.init, out_shardings=self._replicated)(params)
        sample = self._local_batch(0, 0)
        global_shape = {
            k: jax.ShapeDtypeStruct((v.shape[0] * self.hosts,) + v.shape[1:], v.dtype, sharding=self._batch_sharding)
            for k, v in sample.items()
        }
        # Compile once, ahead of time: shapes never change with the number of
        # live slices, so resizing never recompiles.
        self._grad = (
            jax.jit(grad_fn, out_shardings=self._replicated).lower(params, global_shape).compile()
        )
        self._update = (
            jax.jit(update_fn, out_shardings=(self._replicated, self._replicated), donate_argnums=(0, 1))
            .lower(params, opt_state, params)
            .compile()
        )
        from jax.flatten_util import ravel_pytree

        _, self._unravel = ravel_pytree((params, opt_state))
        self._flatten = (
            jax.jit(lambda p, o: ravel_pytree((p, o))[0], out_shardings=self._replicated)
            .lower(params, opt_state)
            .compile()
        )
        self.params, self.opt_state = params, opt_state
        self._step = 0
        return {"setup_s": time.perf_counter() - t0, "devices": len(jax.devices())}

    # -- one step, in two phases -------------------------------------------

    def _local_batch(self, step: int, shard: int) -> dict:
        full = self.program.make_batch(self._seed, step, shard, self._num_shards)
        out = {}
        for k, v in full.items():
            v = np.asarray(v)
            out[k] = v[host_rows(v.shape[0], self.host, self.hosts)]
        return out

    def _to_global_batch(self, local: dict) -> dict:
        return {
            k: self._jax.make_array_from_process_local_data(self._batch_sharding, v)
            for k, v in local.items()
        }

    def compute_grads(self, step: int, shards: tuple[int, ...]) -> tuple[Optional[dict], Optional[dict]]:
        """Phase 1: the gradient of each assigned shard at the held state.

        `step` is the index of the step being taken: the state held is the
        result of `step` completed steps. Pure in (state, step, shards), so
        the controller may re-issue it. Returns (status, payload): the
        controller reads only the small status; the payload (the gradients)
        goes from here to the slices that reduce or apply it, never through
        the driver.
        """
        if step != self._step:
            raise RuntimeError(f"slice {self.slice_id} holds step {self._step}, asked for {step}")
        grads, losses = {}, {}
        for shard in shards:
            loss, g = self._grad(self.params, self._to_global_batch(self._local_batch(step, shard)))
            if self.host == 0:
                grads[shard] = self._jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), g)
                losses[shard] = float(np.asarray(loss.addressable_data(0)))
        if self.host != 0:
            return None, None  # host 0 speaks for the slice: the values are replicated
        return {"loss": losses}, {"grads": grads, "loss": losses}

    def reduce(self, step: int, keys: tuple[int, ...], *parts: Optional[dict]) -> tuple[dict, dict]:
        """One node of the controller's reduction tree: the in-order sum of
        the pieces named by `keys` (shards, or lower nodes' first shards)
        found in `parts`. Pure, so the controller may re-issue it."""
        partial = reduce_pieces(self._jax.tree.map, keys, parts)
        return {"count": partial["count"]}, partial

    def apply(self, step: int, snapshot: bool, *parts: Optional[dict]):
        """Phase 2: apply the mean of all shard gradients, in shard order.

        `parts` are phase-1 payloads or reduction-tree partial sums; either
        way they are summed in the order of the shards they cover, so the
        result does not depend on which slice computed which shard.
        Returns (metrics, snapshot or None). The snapshot rides on the
        step's own reply, so a step is never reported complete before its
        snapshot is sealed in the object store: a failure at any moment
        finds the state of the last completed step. Idempotent for a step
        already applied, so the controller can re-issue it.
        """
        with self._state_lock:
            metrics = self._apply(step, parts)
            return metrics, (self.flat_state() if snapshot else None)

    def _apply(self, step: int, parts: tuple) -> dict:
        if self._step == step + 1 and self._last_apply is not None:
            return self._last_apply
        if step != self._step:
            raise RuntimeError(f"slice {self.slice_id} holds step {self._step}, asked to apply {step}")
        total = reduce_pieces(self._jax.tree.map, None, parts)
        n = total["count"]
        mean = self._jax.tree.map(lambda a: _divided(a, n), total["sum"])
        mean = self._jax.tree.map(self._replicate, mean)
        self.params, self.opt_state = self._update(self.params, self.opt_state, mean)
        self._step = step + 1
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

    # -- state -------------------------------------------------------------

    def _replicate(self, value: np.ndarray):
        value = np.asarray(value)
        return self._jax.make_array_from_callback(value.shape, self._replicated, lambda idx: value[idx])

    def flat_state(self) -> dict:
        """The state as one host buffer (a jitted ravel: one copy, not one
        per leaf); `load_state` takes it back."""
        flat = self._flatten(self.params, self.opt_state)  # a fresh buffer: no copy needed
        return {"step": self._step, "flat": np.asarray(flat.addressable_data(0))}

    def state(self) -> dict:
        """The training state as host numpy arrays (copies: the device
        buffers are donated to the next update)."""
        with self._state_lock:
            return self._state()

    def _state(self) -> dict:
        host = lambda a: np.array(a.addressable_data(0), copy=True)  # noqa: E731 (replicated)
        return {
            "step": self._step,
            "params": self._jax.tree.map(host, self.params),
            "opt_state": self._jax.tree.map(host, self.opt_state),
        }

    def load_state(self, state: dict) -> int:
        if "flat" in state:  # an in-memory snapshot
            params, opt_state = self._unravel(state["flat"])
            state = {"step": state["step"], "params": params, "opt_state": opt_state}
        with self._state_lock:
            self.params = self._jax.tree.map(self._replicate, state["params"])
            self.opt_state = self._jax.tree.map(self._replicate, state["opt_state"])
            self._step = int(state["step"])
            self._last_apply = None
        return self._step

    def state_template(self) -> dict:
        """The state's tree of shapes and dtypes (for checkpoints)."""
        spec = lambda a: self._jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
        return {"params": self._jax.tree.map(spec, self.params), "opt_state": self._jax.tree.map(spec, self.opt_state)}

    def held_step(self) -> int:
        return self._step

    def ping(self) -> bool:
        return True


def _pieces(part: dict) -> list[tuple[int, Any, int]]:
    """(key, sum, count) of a phase-1 payload (one piece per shard) or of a
    reduction-tree partial sum (one piece keyed by its first shard)."""
    if "grads" in part:
        return [(shard, g, 1) for shard, g in part["grads"].items()]
    return [(part["key"], part["sum"], part["count"])]


def reduce_pieces(tree_map: Callable, keys: Optional[tuple], parts: tuple) -> dict:
    """Sum the pieces of `parts` named by `keys` (None: all), in key order.

    The order of additions depends only on the keys, so every run with the
    same number of shards adds in the same order, whichever slices computed
    or reduced them: a resized run stays bitwise equal to a failure-free
    one. A payload may carry shards of other tree nodes; those are skipped.
    """
    wanted = None if keys is None else set(keys)
    pieces, losses = {}, {}
    for part in parts:
        if part is None:
            continue
        for key, value, count in _pieces(part):
            if wanted is None or key in wanted:
                pieces[key] = (value, count)
        losses.update({s: v for s, v in part["loss"].items() if wanted is None or _covered(s, part, wanted)})
    if wanted is not None and set(pieces) != wanted:
        raise RuntimeError(f"reduction node is missing pieces {sorted(wanted - set(pieces))}")
    order = sorted(pieces)
    acc = tree_map(lambda a: np.array(a, copy=True), pieces[order[0]][0])
    for key in order[1:]:
        acc = tree_map(_add_into, acc, pieces[key][0])
    return {"key": order[0], "sum": acc, "count": sum(pieces[k][1] for k in order), "loss": losses}


def _covered(shard: int, part: dict, wanted: set) -> bool:
    # A payload's losses are per shard; a partial's belong to its key.
    return shard in wanted if "grads" in part else part["key"] in wanted


def _add_into(acc: np.ndarray, value) -> np.ndarray:
    acc += value
    return acc


def _divided(acc: np.ndarray, n: int) -> np.ndarray:
    acc /= n
    return acc

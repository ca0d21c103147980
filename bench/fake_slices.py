"""Simulated slices for measuring the controller at scale.

`FakeSlices` is a drop-in for `slice_group.RaySlices` (same methods:
`start`, `poll`, `kill` (static), `placement_group_state`, `shutdown`)
whose workers are light in-process objects with the methods of
`worker.actor.SliceWorker`. Every `.remote(...)` call makes one real Ray actor
call (on `_Clock`, below) that returns the results, so the controller's
`ray.wait` / `ray.get` code runs for real and the driver pays what a real
worker call costs it; only the JAX work and the worker processes are
gone. Results have the shapes the controller expects: `compute_grads`
gives (status, `{"grads": {shard: tree}, "loss": {shard: float}}`) refs
(host 0; None on other hosts), `reduce` a (status, partial sum), `apply` gives `(metrics, snapshot or None)` refs, `info`
gives `{"pid", "node_id", "ip"}` with the driver's own (alive) node.

A failure is a ref whose `ray.get` raises a real `ray.exceptions.
ActorDiedError`: a call on a tombstone actor, started once and killed, so
the controller's classification and recovery paths run unchanged.

    slices = FakeSlices.configured(fail=[(step, slice_id), ...])
    report = Controller(factory, config, steps, seams=Seams(provisioner=slices)).fit()
    slices.instances[0].fake_s      # seconds the fakes spent in their own calls
    slices.instances[0].fake_cpu_s  # the same in process CPU time

The controller still builds the program once in the driver and checks it
(its preflight: layout, data, memory) before it provisions any slice, so
it is given `fake_program(state_floats)`: a real `TrainProgram` of the
fakes' state and gradient shape (`{"w": float32[state_floats]}`) that no
fake ever runs.

Timed steps (`configured(step_s=1.0)`): each compute_grads takes step_s
of simulated compute, without ever blocking the driver. Every ref a fake
hands out has a modelled ready time (wall clock): compute_grads is ready
step_s after the latest of its call, its worker's previous compute and its
arguments (a pipelined call's argument is the worker's previous apply);
reduce and apply are ready when their arguments are (their own work is
negligible next to the gradients). Each fake call is one call on `_Clock`,
an async actor that sleeps until that time (if it is still to come) and
returns the results: the driver pays a real actor call's submission and
reply, as it would with a real worker. How close that comes is measured
(`bench.scale.calibrate`: one step's calls, as the controller makes them,
on real actors against the fakes): 0.74-1.15x of real calls at 256-1024
slices in the runs so far. (An earlier version `ray.put` the results due
at once, and overstated the driver's work by 45%: a put costs the driver
more than a whole call, and one per result; passing the call's ref
arguments on to the clock overstated it by 30%.) A call any of whose
arguments failed fails too and changes no state, as a Ray task whose
dependency failed never runs. The driver's work is then the step's wall
time less step_s;
the fakes' own share (`fake_s`: their results and the clock calls,
standing in for Ray's per-call work) is counted apart as before.

Used by `bench/scale.py` and its smoke test; never by a real run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

import numpy as np
import ray
from ray import exceptions as rex

from ray_elastic.cluster.slice_group import LiveSlice, Provisioning
from ray_elastic.checkpoint.state_forms import FlatState, WholeState

__all__ = ["FakeSlices", "FakeWorker", "dead_ref", "fake_program"]

_TOMBSTONE: dict = {}  # Ray session (GCS address) -> killed actor handle


@ray.remote(num_cpus=0)
class _Tombstone:
    def ping(self) -> bool:
        return True


def _tombstone():
    key = ray.get_runtime_context().gcs_address
    actor = _TOMBSTONE.get(key)
    if actor is not None:
        return actor
    actor = _Tombstone.remote()
    ray.get(actor.ping.remote(), timeout=120)
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while True:  # until Ray reports it dead (calls then fail at once)
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except rex.ActorDiedError:
            break
        except rex.RayError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the tombstone actor did not die within 30 s")
        time.sleep(0.05)
    _TOMBSTONE.clear()
    _TOMBSTONE[key] = actor
    return actor


@ray.remote(num_cpus=0, max_concurrency=100000)
class _Clock:
    """Returns its arguments at a given wall-clock time."""

    async def at(self, t: float, *values):
        await asyncio.sleep(max(0.0, t - time.time()))
        return values if len(values) > 1 else values[0]

    def ping(self) -> bool:
        return True

    def cpu(self) -> float:
        """This process's CPU time so far (the simulated workers' side of
        every call)."""
        return time.process_time()


def _zeros(size: int, rng: Any) -> dict:
    import jax.numpy as jnp

    return {"w": jnp.zeros((size,), jnp.float32)}


def _loss(params: Any, batch: Any) -> Any:
    import jax.numpy as jnp

    return jnp.sum(params["w"] ** 2) + 0.0 * jnp.sum(batch["x"])


def _batch(seed: int, step: int, shard: int, num_shards: int) -> dict:
    return {"x": np.zeros((1, 1), np.float32)}


def fake_program(state_floats: int = 16):
    """The program the controller checks in the driver (its preflight)
    for a run on fake slices: the fakes' state and gradient shape; the
    fakes never run it."""
    import functools

    import optax

    from ray_elastic.program import TrainProgram

    return TrainProgram(init_params=functools.partial(_zeros, state_floats), loss_fn=_loss,
                        optimizer=optax.sgd(0.1), make_batch=_batch)


def dead_ref():
    """A ref whose ray.get raises ActorDiedError (a call on a dead actor)."""
    return _tombstone().ping.remote()


class _Method:
    def __init__(self, worker: "FakeWorker", name: str, num_returns: int = 1):
        self._worker, self._name, self._num_returns = worker, name, num_returns

    def options(self, num_returns: int = 1, **_ignored) -> "_Method":
        return _Method(self._worker, self._name, num_returns)

    def remote(self, *args, **kwargs):
        return self._worker._call(self._name, self._num_returns, args, kwargs)


class FakeWorker:
    """Stands in for a SliceWorker actor handle: `w.method.remote(...)`
    returns ObjectRefs; a dead worker's calls return refs that raise
    ActorDiedError."""

    _METHODS = ("info", "setup", "compute_grads", "reduce", "take_inputs", "apply", "snapshot", "state", "flat_state",
                "load_state", "held_step", "ping", "state_template", "coordinator_address", "abort_waits")

    def __init__(self, owner: "FakeSlices", slice_id: int, host: int, hosts: int):
        self._owner = owner
        self.slice_id, self.host, self.hosts = slice_id, host, hosts
        self.step = -1
        self.dead = False
        self.free_at = 0.0  # when this worker's last simulated compute ends
        self._last_apply: Optional[dict] = None

    def __getattr__(self, name: str):
        if name in FakeWorker._METHODS:
            return _Method(self, name)
        raise AttributeError(name)

    def _call(self, name: str, num_returns: int, args: tuple, kwargs: dict):
        t0, c0 = time.perf_counter(), time.process_time()
        owner = self._owner
        try:
            if not self.dead and name == "compute_grads" and owner._due(self.slice_id, self.host, args[0]):
                self.dead = True  # the worker "dies" during this call
            # Refs passed as arguments, or in a list (apply and reduce fetch
            # theirs in the call).
            flat = [r for a in args for r in (a if isinstance(a, list) else [a])]
            inputs = [owner.ready.get(a, 0.0) for a in flat if isinstance(a, ray.ObjectRef)]
            if self.dead or None in inputs:  # dead, or an argument failed: the call never runs
                refs = [dead_ref() for _ in range(num_returns)]
                for r in refs:
                    owner.ready[r] = None
            else:
                result = getattr(self, "_" + name)(*args, **kwargs)
                results = [result] if num_returns == 1 else list(result)
                at = max([time.time(), *inputs])
                if name == "compute_grads" and owner.step_s:
                    at = self.free_at = max(at, self.free_at) + owner.step_s
                refs = owner.refs_at(at, results)
            return refs[0] if num_returns == 1 else refs
        finally:
            self._owner.fake_s += time.perf_counter() - t0
            self._owner.fake_cpu_s += time.process_time() - c0
            self._owner.calls += 1

    # -- SliceWorker's methods, minus the JAX work ------------------------

    def _info(self) -> dict:
        return {"pid": None, "node_id": self._owner.node_id, "ip": "127.0.0.1", "fake": True}

    def _coordinator_address(self) -> str:
        return "127.0.0.1:0"

    def _setup(self, coordinator: Optional[str], compile_cache_dir: str = "") -> dict:
        self.step = 0
        return {"setup_s": 0.0, "devices": 1}

    def _compute_grads(self, step: int, shards: tuple, *after) -> tuple:
        if self._owner.handed_out and step > self.step:
            self.step = step
        if step != self.step:
            raise RuntimeError(f"fake slice {self.slice_id} holds step {self.step}, asked for {step}")
        if self.host != 0:
            return None, None
        grads = {s: {"w": self._owner.grad} for s in shards}
        losses = {s: 1.0 / (1 + step) for s in shards}
        return {"loss": losses}, {"grads": grads, "loss": losses}

    def _reduce(self, step: int, keys: tuple, parts: list, epoch: int = 0) -> tuple:
        # parts are refs: a real worker gets them resolved by Ray and sums
        # them; the fake never looks inside.
        return {"count": len(keys)}, {"key": keys[0], "sum": {"w": self._owner.grad}, "count": len(keys), "loss": {}}

    def _take_inputs(self, step: int, parts: list, epoch: int = 0) -> int:
        return step  # ahead of the apply on a slice of several hosts (dispatch/applies.py): nothing to hold

    def _apply(self, step: int, snapshot: bool, parts: list, epoch: int = 0, *taken) -> tuple:
        # parts are refs (payloads or partial sums): a real worker gets them
        # resolved by Ray; the fake never looks inside.
        if self._owner.handed_out and step > self.step:
            self.step = step  # see FakeSlices.handed_out
        if self.step == step + 1 and self._last_apply is not None:
            metrics = self._last_apply
        else:
            if step != self.step:
                raise RuntimeError(f"fake slice {self.slice_id} holds step {self.step}, asked to apply {step}")
            self.step = step + 1
            metrics = {"step": step + 1, "loss": 1.0 / (1 + step), "shards": self._owner.num_shards}
            self._last_apply = metrics
        return metrics

    def _snapshot(self, step: int, *after) -> tuple:
        return {"step": step + 1, "bytes": int(self._owner.flat.nbytes)}, self._flat_state()

    def _flat_state(self) -> FlatState:
        return FlatState(self.step, self._owner.flat)

    def _state(self) -> WholeState:
        return WholeState(self.step, {"w": self._owner.flat}, {})

    def _load_state(self, state: Any) -> int:
        if isinstance(state, ray.ObjectRef):
            state = ray.get(state)
        self.step = int(state.step)
        self._last_apply = None
        return self.step

    def _state_template(self) -> dict:
        return {"params": {"w": (self._owner.flat.shape, str(self._owner.flat.dtype))}, "opt_state": {}}

    def _abort_waits(self, epoch: int, from_step: int = 0) -> None:
        return None  # a fake's inputs are never on a lost node

    def _held_step(self) -> int:
        return self.step

    def _ping(self) -> bool:
        return True


class FakeSlices:
    """Drop-in for RaySlices (same constructor and methods)."""

    # Set by `configured`: when fake workers fail, as (step, slice_id[, host]).
    fail: tuple = ()
    state_floats: int = 16  # size of the fake state and of each gradient
    step_s: float = 0.0  # simulated compute per compute_grads call
    # Clock actors the calls are spread over: the simulated workers' side of
    # every call (on a real cluster, spread over the slices' hosts) runs in
    # them, and one asyncio process takes about 0.35 ms of CPU per call: at
    # 1024 slices a single clock was saturated (0.93 of a core) and its
    # replies came late, which the bench counted as the driver's.
    clocks: int = 2
    instances: list = []  # every FakeSlices built from this class, in order

    def __init__(self, spec, program_factory: Callable, seed: int, num_shards: int, run_name: str,
                 compile_cache_dir: str = "", warm_workers: int = 0, state_check_every: int = 0,
                 grad_check_every: int = 0, final_step: int = 0):
        self.spec = spec
        self.num_shards = num_shards
        self.run_name = run_name
        self.hosts = len(spec.bundles())
        self.node_id = ray.get_runtime_context().get_node_id()
        self.flat = np.zeros(self.state_floats, np.float32)
        self.grad = np.zeros(self.state_floats, np.float32)
        self._pending_failures = [tuple(f) for f in self.fail]
        self.fake_s = 0.0  # time spent inside the fakes' own calls (their clock calls included)
        self.fake_cpu_s = 0.0  # the same, process CPU time
        self.calls = 0
        self.clock_calls = 0
        self.started: list[int] = []
        self.ready: dict = {}  # ref handed out -> its modelled ready time (None: failed)
        self._clocks: list = []  # the clock actors, made on first use
        # Sent to group leaders: a worker's calls are then made on several
        # copies (a leader's, the driver's for snapshot applies), each
        # with its own `step`, which is then taken from the call.
        self.handed_out = False
        if self._pending_failures:
            _tombstone()  # made now, not on the first failure's clock
        type(self).instances.append(self)

    @classmethod
    def configured(cls, fail=(), state_floats: int = 16, step_s: float = 0.0, clocks: int = 2) -> type:
        """A subclass with its own failure plan, step time and instance
        list (the controller builds the backend itself)."""
        return type("FakeSlices", (cls,), {"fail": tuple(fail), "state_floats": state_floats, "step_s": step_s,
                                           "clocks": clocks, "instances": []})

    def __getstate__(self) -> dict:
        # Sent to group leaders with the fake workers (grouped_runner): each
        # leader's copy models the refs its own calls hand out.
        state = dict(self.__dict__)
        state["ready"] = {}
        state["handed_out"] = self.handed_out = True
        return state

    def refs_at(self, at: float, results: list) -> list:
        """Refs of `results` that become ready at wall time `at`: one call
        on the clock actor (a real actor call, as a real worker's would be:
        the driver pays Ray's cost of submitting it and of taking its
        reply)."""
        if not self._clocks:
            self._clocks = [_Clock.remote() for _ in range(self.clocks)]
            ray.get([c.ping.remote() for c in self._clocks])
        clock = self._clocks[self.clock_calls % len(self._clocks)]
        out = clock.at.options(num_returns=len(results)).remote(at, *results)
        refs = [out] if len(results) == 1 else list(out)
        self.clock_calls += 1
        for r in refs:
            self.ready[r] = at
        if len(self.ready) > 100000:  # forget refs long past
            now = time.time()
            self.ready = {r: t for r, t in self.ready.items() if t is None or t > now - 60}
        return refs

    def clock_cpu_s(self) -> float:
        """CPU seconds the clock actors have used so far."""
        return sum(ray.get([c.cpu.remote() for c in self._clocks])) if self._clocks else 0.0

    def _due(self, slice_id: int, host: int, step: int) -> bool:
        for f in self._pending_failures:
            s_step, s_slice = f[0], f[1]
            s_host = f[2] if len(f) > 2 else 0
            if (s_step, s_slice, s_host) == (step, slice_id, host):
                self._pending_failures.remove(f)
                return True
        return False

    def start(self, slice_id: int) -> Provisioning:
        t0 = time.perf_counter()
        workers = [FakeWorker(self, slice_id, h, self.hosts) for h in range(self.hosts)]
        self.fake_s += time.perf_counter() - t0
        self.started.append(slice_id)
        return Provisioning(
            slice_id=slice_id,
            workers=workers,
            info_refs=[w.info.remote() for w in workers],
            setup_refs=[w.setup.remote(None, "") for w in workers],
            started_at=time.monotonic(),
        )

    @staticmethod
    def poll(p: Provisioning) -> Optional[LiveSlice]:
        refs = p.info_refs + p.setup_refs
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(done) < len(refs):
            for ref in done:
                ray.get(ref)
            return None
        infos = ray.get(p.info_refs)
        ray.get(p.setup_refs)
        return LiveSlice(p.slice_id, p.workers, infos, ready_at=time.monotonic())

    @staticmethod
    def kill(workers: list, infos=()) -> None:
        for w in workers:
            if isinstance(w, FakeWorker):
                w.dead = True

    def placement_group_state(self, slice_id: int) -> str:
        return "CREATED"

    def abandon_group(self, slice_id: int, evict: tuple = ()) -> None:
        pass  # no placement groups: a simulated slice holds nothing on a node

    def reap_abandoned(self) -> None:
        pass

    def group_nodes(self, slice_id: int) -> tuple:
        return ()  # no placement groups

    def shutdown(self) -> None:
        pass

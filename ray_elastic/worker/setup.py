"""A worker's set-up: JAX started, the program's state laid out over the
slice's mesh, and the step's functions compiled ahead of time.

A slice is one JAX system (`jax.distributed` across its hosts when it has
more than one). Its mesh comes from the program's layout (layout.py): by
default one `data` axis over every device with the state replicated; a
sharded layout splits the params (and the optimizer state with them) over
named in-slice axes. The shapes never change with the number of live
slices, so nothing here runs again when the run resizes.

Each step of the way appends a (phase name, wall time) mark, from which
the worker reports where its time to ready went (readiness.py).

Imported by the driver through the worker's actor class: JAX and Optax
are imported on use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from typing import Any, Callable, Optional

import numpy as np

from ray_elastic.dispatch.assignment import rows_fed
from ray_elastic.errors import ConfigError
from ray_elastic.program import TrainProgram
from ray_elastic.worker.pretrained import load_pretrained
from ray_elastic.worker.step_math import check_outputs, eval_function, grad_function, join_slot, split_slot, update_function

__all__ = ["CompiledStep", "InitialState", "StateLayout", "compile_step", "free_port", "lay_out", "start_jax",
           "traced_under"]


def free_port() -> int:
    """A TCP port free on this host now (for the JAX coordinator)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_jax(coordinator: Optional[str], compile_cache_dir: str, hosts: int, host: int, marks: list) -> list:
    """Import JAX, point it at the persistent compile cache, join the
    slice's JAX system (with `coordinator`: host 0's address) and start the
    backend. Returns the slice's devices; marks `imports` and `jax_init`."""
    import jax
    import optax  # noqa: F401 (counted here, with jax; the step uses it)

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
        jax.distributed.initialize(coordinator, num_processes=hosts, process_id=host)
    devices = jax.devices()  # starts the backend
    marks.append(("jax_init", time.time()))
    return devices


def _compile(lowered: Any) -> Any:
    return lowered.compile()


class InitialState:
    """The step-0 state's functions, lowered at set-up (traced once: a
    program may cache what its init traces), compiled and run only when
    the state is first needed: a replacement loads the live state at once,
    so making it there would be wasted."""

    def __init__(self, init_params, init_opt, rng, pretrained: Any = None, param_specs: Any = None,
                 compile_fn: Callable = _compile) -> None:
        self._init_params, self._init_opt, self._rng = init_params, init_opt, rng
        self._pretrained, self._param_specs = pretrained, param_specs
        self._compile = compile_fn

    def make(self) -> tuple:
        """(params, opt_state) of step 0, laid out on the slice's mesh: the
        program's init, or its pretrained weights (pretrained.py)."""
        if self._pretrained is not None:
            params = load_pretrained(self._pretrained, self._param_specs)
        else:
            params = self._compile(self._init_params)(self._rng)
        return params, self._compile(self._init_opt)(params, self._rng)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How the training state and the batch lie on this slice's mesh.

    param_specs, opt_specs: the state's leaves as jax.ShapeDtypeStruct with
    their global shapes and shardings (what a host's blocks, or whole
    arrays, are put back into), with the treedefs that rebuild the trees;
    param_shardings, opt_shardings: one sharding per leaf, as trees;
    template: the state's tree of shapes and dtypes (for checkpoints);
    sharded: whether hosts hold different parts of the state."""

    program: TrainProgram
    mesh: Any
    batch_axes: tuple
    batch_ways: int
    replicated: Any  # NamedSharding: every device holds the whole array
    batch_sharding: Any
    sharded: bool
    param_specs: list
    param_def: Any
    opt_specs: list
    opt_def: Any
    param_shardings: Any
    opt_shardings: Any
    template: dict
    initial: InitialState

    def params_spec(self) -> Any:
        """The params' tree of jax.ShapeDtypeStruct (global shapes, shardings)."""
        import jax

        return jax.tree.unflatten(self.param_def, self.param_specs)

    def opt_spec(self) -> Any:
        import jax

        return jax.tree.unflatten(self.opt_def, self.opt_specs)


@contextlib.contextmanager
def traced_under(mesh: Any, rules: tuple):
    """The context the program's functions are traced in: the slice's mesh
    set (so `with_sharding_constraint` on mesh axes works inside a model)
    and the layout's Flax logical axis rules active (so do logical
    constraints, `nn.with_logical_constraint`, as MaxText's layers make)."""
    import jax

    with jax.set_mesh(mesh):
        if not rules:
            yield
            return
        import flax.linen as nn

        with nn.logical_axis_rules(rules):
            yield


def lay_out(devices: list, program_factory: Callable[[], TrainProgram], seed: int, marks: list,
            compile_fn: Callable = _compile) -> StateLayout:
    """Build the program and lay its state out over `devices` by its
    layout; lower the step-0 state's functions (`compile_fn` compiles
    them when the state is first needed). Marks `program_build`."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    program = program_factory()
    marks.append(("program_build", time.time()))
    plan = program.layout.plan(len(devices))
    mesh = Mesh(_device_grid(devices, plan.axis_sizes), plan.axis_names)
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded = program.layout.sharded
    rng = jax.random.PRNGKey(seed)
    with traced_under(mesh, program.layout.rules):
        p_out, o_out = _state_shardings(program, mesh, sharded, replicated, rng)
        init_params = jax.jit(program.init_params, out_shardings=p_out).lower(rng)
        p_shape = init_params.out_info
        p_out = _full(p_out, p_shape)
        params = jax.tree.map(_sharded_struct, p_shape, p_out)
        init_opt = jax.jit(_init_slot(program), out_shardings=o_out).lower(params, rng)
    o_shape = init_opt.out_info
    o_out = _full(o_out, o_shape)
    opt_state = jax.tree.map(_sharded_struct, o_shape, o_out)
    p_specs, p_def = jax.tree.flatten(params)
    o_specs, o_def = jax.tree.flatten(opt_state)
    plain = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    return StateLayout(
        program=program, mesh=mesh, batch_axes=plan.batch_axes, batch_ways=plan.batch_ways,
        replicated=replicated, batch_sharding=NamedSharding(mesh, PartitionSpec(plan.batch_axes)),
        sharded=sharded, param_specs=p_specs, param_def=p_def, opt_specs=o_specs, opt_def=o_def,
        param_shardings=p_out, opt_shardings=o_out,
        template={"params": jax.tree.map(plain, p_shape), "opt_state": jax.tree.map(plain, o_shape)},
        initial=InitialState(init_params, init_opt, rng, program.pretrained, params, compile_fn),
    )


def _device_grid(devices: list, sizes: tuple) -> np.ndarray:
    """The slice's devices as an array of the mesh's shape, in the order
    MaxText's mesh takes them: jax's mesh_utils (topology-aware on TPU,
    by device id on GPU, as given on CPU)."""
    from jax.experimental import mesh_utils

    try:
        return mesh_utils.create_device_mesh(tuple(sizes), devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):  # a topology it cannot map: the given order
        return np.array(devices).reshape(sizes)


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """The step's functions, compiled once for the slice's shapes.

    grad: (params, opt_state, global batch, step, shard) -> (total, weight,
    aux, model state, gradient) (step_math.py); update: (params, opt_state,
    mean gradient, model state, metrics) -> (params, opt_state), donating
    the state;
    flatten: (params, opt_state) -> one replicated buffer, the snapshot of
    a replicated state (None when sharded: a host's snapshot is its own
    blocks); unravel: that buffer back to the trees, with jax, only under
    RAY_ELASTIC_EAGER_SETUP (else numpy does it: see transfer.py).
    rows: the rows of a shard's batch this host's devices hold;
    global_shapes: the shard's batch shapes, per key (batch_specs: with
    their dtypes); evaluate, eval_rows, eval_shapes: the same for the
    program's eval (None without one); compile: the compile function
    (device_step.py compiles the one-slice step through it, when first
    needed)."""

    grad: Any
    update: Any
    flatten: Optional[Any]
    unravel: Optional[Callable]
    rows: Any
    global_shapes: dict
    evaluate: Optional[Any] = None  # (params, opt_state, eval batch, step, shard) -> (total, weight, aux)
    eval_rows: Any = None
    eval_shapes: Optional[dict] = None
    batch_specs: Optional[dict] = None  # the shard's batch: {key: (global shape, dtype)}
    compile: Callable = _compile  # what compiled these: the one-slice step compiles through it too


def compile_step(layout: StateLayout, seed: int, num_shards: int, marks: list,
                 eager_state: Optional[tuple] = None, compile_fn: Callable = _compile) -> CompiledStep:
    """Compile the step against the layout's shapes, ahead of time, with
    `compile_fn` (through the persistent compile caches when they are
    set: host_cache.py). Marks `compile` once all the step's functions are
    compiled. `eager_state`: (params, opt_state) already made
    (RAY_ELASTIC_EAGER_SETUP), for jax's unravel."""
    import jax

    program = layout.program
    # The whole of shard 0 once, for the batch's shapes (a make_batch that
    # takes rows is asked for rows=None); every step then reads its rows.
    sample = program.make_batch(seed, 0, 0, num_shards, rows=None) if program.batch_takes_rows \
        else program.make_batch(seed, 0, 0, num_shards)
    fed, global_shape = _batch_feed(layout, sample, "layout.batch_axes")
    params, opt_state = layout.params_spec(), layout.opt_spec()
    p_out, o_out = layout.param_shardings, layout.opt_shardings
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=layout.replicated)  # noqa: E731
    rows = next(iter(global_shape.values())).shape[0]
    if rows % (layout.batch_ways * program.microbatches):
        raise ConfigError("program.microbatches", f"a shard's {rows} rows do not split into {program.microbatches} "
                          f"microbatches over the {layout.batch_ways} devices of the batch axes; make the rows a "
                          f"multiple of {layout.batch_ways * program.microbatches}")
    grad_fn = grad_function(program, layout.mesh, seed, num_shards, layout.batch_ways)
    rep = layout.replicated  # every scalar and the model state: whole on every device
    _, held_state = split_slot(program, opt_state)
    evaluate = eval_fed = None
    with traced_under(layout.mesh, program.layout.rules):
        lowered = jax.jit(grad_fn, out_shardings=(rep, rep, rep, rep, p_out)).lower(
            params, opt_state, global_shape, scalar(np.int32), scalar(np.int32))
        check_outputs(program, lowered.out_info, held_state)
        grad = compile_fn(lowered)
        if program.eval_every:
            sample = program.make_eval_batch(seed, 0, num_shards, rows=None) if program.eval_batch_takes_rows \
                else program.make_eval_batch(seed, 0, num_shards)
            eval_fed, eval_shape = _batch_feed(layout, sample, "program.make_eval_batch")
            lowered = jax.jit(eval_function(program, layout.mesh, seed, num_shards), out_shardings=rep).lower(
                params, opt_state, eval_shape, scalar(np.int32), scalar(np.int32))
            check_outputs(program, (*lowered.out_info, None, None), None, fn="eval_fn", declared=program.eval_aux)
            evaluate = compile_fn(lowered)
        metrics = {name: scalar(np.float32) for name in ("loss", *program.aux)}
        update = compile_fn(
            jax.jit(update_function(program), out_shardings=(p_out, o_out), donate_argnums=(0, 1))
            .lower(params, opt_state, params, held_state, metrics)
        )
    from jax.flatten_util import ravel_pytree

    flatten = unravel = None
    if not layout.sharded:  # a sharded host's snapshot is its own blocks: no flat copy
        if eager_state is not None:
            _, unravel = ravel_pytree(eager_state)
        flatten = compile_fn(
            jax.jit(lambda p, o: ravel_pytree((p, o))[0], out_shardings=layout.replicated)
            .lower(params, opt_state)
        )
    marks.append(("compile", time.time()))
    return CompiledStep(grad=grad, update=update, flatten=flatten, unravel=unravel, rows=fed,
                        global_shapes={k: v.shape for k, v in global_shape.items()}, evaluate=evaluate,
                        batch_specs={k: (v.shape, v.dtype) for k, v in global_shape.items()}, compile=compile_fn,
                        eval_rows=eval_fed, eval_shapes=None if evaluate is None else
                        {k: v.shape for k, v in eval_shape.items()})


def _batch_feed(layout: StateLayout, sample: dict, setting: str) -> tuple:
    """(the rows of a shard's batch this host's devices hold, the shard's
    global batch as jax.ShapeDtypeStruct per key), from a sample batch."""
    import jax

    sample = {k: np.asarray(v) for k, v in sample.items()}
    rows = next(iter(sample.values())).shape[0]
    if rows % layout.batch_ways:
        raise ConfigError(setting, f"a shard's batch of {rows} rows does not split over the "
                          f"{layout.batch_ways} devices of the batch axes {layout.batch_axes}; make the per-shard "
                          "batch a multiple of that, or split the batch over fewer axes")
    # The rows this host's devices hold (all of them under tensor parallelism across hosts).
    index = layout.batch_sharding.addressable_devices_indices_map((rows,))
    fed = rows_fed([rows_of[0] for rows_of in index.values()], rows)
    return fed, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=layout.batch_sharding)
                 for k, v in sample.items()}


def _init_slot(program: TrainProgram) -> Callable:
    """(params, rng) -> the step-0 opt_state slot: the optimizer's state,
    with the model state beside it when the program has one (step_math.py)."""

    def init(params, rng):
        model_state = program.init_model_state(rng) if program.has_model_state else None
        return join_slot(program, program.optimizer.init(params), model_state)

    return init


def _state_shardings(program: TrainProgram, mesh, sharded: bool, replicated, rng) -> tuple:
    """The params' and optimizer state's shardings: replicated, or by
    the layout's specs (the optimizer state following its params; a model
    state is replicated)."""
    if not sharded:
        return replicated, replicated
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from ray_elastic.layout import resolve_param_specs

    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    abstract = jax.eval_shape(program.init_params, rng)
    specs = resolve_param_specs(program.layout, abstract)
    o_specs = optax.tree_map_params(
        program.optimizer, lambda _, spec: spec, jax.eval_shape(program.optimizer.init, abstract), specs,
        transform_non_params=lambda v: jax.tree.map(lambda _: PartitionSpec(), v), is_leaf=is_spec,
    )
    if program.has_model_state:
        o_specs = join_slot(program, o_specs,
                            jax.tree.map(lambda _: PartitionSpec(), jax.eval_shape(program.init_model_state, rng)))
    named = lambda tree: jax.tree.map(lambda p: NamedSharding(mesh, p), tree, is_leaf=is_spec)  # noqa: E731
    return named(specs), named(o_specs)


def _full(sharding, tree):
    """One sharding per leaf of `tree` (a single one stands for all)."""
    import jax

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda _: sharding, tree)
    return sharding


def _sharded_struct(a, sharding):
    import jax

    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


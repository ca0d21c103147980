"""The program checked in the driver before any slice is reserved: its
layout on the slice's devices, its data's length against the steps asked,
its batch against the devices it splits over, and its state's memory
against the cluster's machines (memory_plan.py). The same errors would
come from the workers' set-up or Ray's memory monitor, but only after
slices were reserved and processes started."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ray_elastic.cluster.node_memory import machines
from ray_elastic.config import CpuSlice, ElasticConfig
from ray_elastic.control.memory_plan import HostNeeds, check_fits, host_needs, tree_bytes
from ray_elastic.errors import ConfigError
from ray_elastic.program import TrainProgram

__all__ = ["check_fragments", "check_program", "preflight", "state_needs"]


def preflight(factory: Callable[[], TrainProgram], config: ElasticConfig, steps: int) -> Optional[HostNeeds]:
    """Every check of this module, before any slice is reserved; returns
    what a host of the run needs (None where the program's shapes could
    not be traced without running it)."""
    c = config
    program = check_program(factory, c.slice.devices, c.seed, c.shards, steps)
    if c.enable_diloco and program.has_model_state:
        raise ConfigError("enable_diloco", "DiLoCo runs of a program with a model state (init_model_state) are "
                          "not supported yet; set enable_diloco=False")
    if c.enable_streaming_diloco:
        check_fragments(program, c)
    needs = state_needs(program, c)
    if needs is not None:
        check_fits(needs, (c.num_slices + c.spare_slices) * len(c.slice.bundles()), machines())
    return needs


def check_fragments(program: TrainProgram, config: ElasticConfig) -> None:
    """Streaming DiLoCo cuts the params into fragments of whole leaves:
    no more fragments than leaves."""
    import jax

    try:
        leaves = len(jax.tree.leaves(jax.eval_shape(program.init_params, jax.random.PRNGKey(config.seed))))
    except Exception:  # an init that needs concrete values: the workers' own check says it
        return
    if config.num_diloco_fragments > leaves:
        raise ConfigError("num_diloco_fragments", f"a fragment is one or more whole leaves of the params, and this "
                          f"program's params have {leaves}: set num_diloco_fragments to at most {leaves}, "
                          f"got {config.num_diloco_fragments}")


def state_needs(program: TrainProgram, config: ElasticConfig) -> Optional[HostNeeds]:
    """One host's needs, from the program's shapes (jax.eval_shape: nothing
    is computed or allocated)."""
    import jax

    try:
        params = jax.eval_shape(program.init_params, jax.random.PRNGKey(config.seed))
        opt = jax.eval_shape(program.optimizer.init, params)
        model = (jax.eval_shape(program.init_model_state, jax.random.PRNGKey(config.seed))
                 if program.init_model_state is not None else None)
    except Exception:  # an init that needs concrete values: no estimate, no refusal
        return None
    p = tree_bytes(params)
    return host_needs(p, p + tree_bytes(opt) + tree_bytes(model), hosts=len(config.slice.bundles()),
                      sharded=program.layout.sharded, shards=config.shards, num_slices=config.num_slices,
                      snapshots=config.snapshot_every != 0, on_host=isinstance(config.slice, CpuSlice),
                      exchange="direct" if config.slices_per_leader else config.exchange)


def check_program(factory: Callable[[], TrainProgram], devices_per_slice: int, seed: int, num_shards: int,
                  steps: int) -> TrainProgram:
    """Raise ConfigError naming the setting to change; returns the program
    (built here) when it can run `steps` steps of `num_shards` shards on
    slices of `devices_per_slice` devices. Builds the program once (its
    factory runs in the driver too) and reads shard 0 of step 0, whole,
    unless make_batch says its rows per shard."""
    program = factory()
    if not isinstance(program, TrainProgram):
        raise ConfigError("program_factory", f"must return a TrainProgram, got {type(program).__name__}")
    plan = program.layout.plan(devices_per_slice)
    program.check_data(steps, num_shards)
    rows = getattr(program.make_batch, "rows_per_shard", None)
    if rows is None:
        sample = (program.make_batch(seed, 0, 0, num_shards, rows=None) if program.batch_takes_rows
                  else program.make_batch(seed, 0, 0, num_shards))
        rows = np.asarray(next(iter(sample.values()))).shape[0]
    split = plan.batch_ways * program.microbatches
    if rows % split:
        setting = "program.microbatches" if program.microbatches > 1 else "layout.batch_axes"
        raise ConfigError(setting, f"a shard's batch of {rows} rows does not split over the {plan.batch_ways} "
                          f"devices of the batch axes {plan.batch_axes}"
                          + (f" in {program.microbatches} microbatches" if program.microbatches > 1 else "")
                          + f"; make the rows per shard a multiple of {split}, or split the batch over fewer axes")
    return program

"""The program checked in the driver before any slice is reserved: its
layout on the slice's devices, its data's length against the steps asked,
and its batch against the devices it splits over. The same errors would
come from the workers' set-up, but only after slices were reserved and
processes started."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ray_elastic.errors import ConfigError
from ray_elastic.program import TrainProgram

__all__ = ["check_program"]


def check_program(factory: Callable[[], TrainProgram], devices_per_slice: int, seed: int, num_shards: int,
                  steps: int) -> None:
    """Raise ConfigError naming the setting to change; returns nothing
    when the program can run `steps` steps of `num_shards` shards on
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

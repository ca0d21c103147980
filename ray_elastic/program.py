"""What a user hands to ray_elastic: the pieces of one data-parallel training job.

Every piece is a plain function so that a worker process can rebuild the job
from a pickled factory, and so that the batch for a step is a pure function of
(seed, step, shard): a resumed or resized run then sees exactly the data a
failure-free run sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from ray_elastic.layout import Layout

PyTree = Any
Batch = Mapping[str, np.ndarray]

__all__ = ["TrainProgram"]


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """A training job, split so the controller can place each piece.

    init_params: rng key -> parameter pytree (same key, same params everywhere).
    loss_fn: (params, batch) -> scalar mean loss over the batch; jit-able.
    optimizer: an optax GradientTransformation.
    make_batch: (seed, step, shard, num_shards) -> numpy batch of that shard of
        the step's global batch. Must be pure: the same arguments give the
        same arrays on any host, at any time.
    layout: how the state is laid out over a slice's devices (layout.py);
        the default replicates it on every device.
    """

    init_params: Callable[[Any], PyTree]
    loss_fn: Callable[[PyTree, Batch], Any]
    optimizer: Any
    make_batch: Callable[[int, int, int, int], Batch]
    layout: Layout = dataclasses.field(default_factory=Layout)

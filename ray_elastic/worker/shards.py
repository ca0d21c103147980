"""A host's own part of sharded arrays, as plain numpy, and back.

Under a sharded layout (layout.py) a host holds some blocks of each array
of the state; several of its devices may hold the same block (an axis the
array is not split over). What a host sends to the other slices, keeps as
its snapshot and loads back is one copy of each distinct block it holds,
keyed by (leaf index, the block's [start, stop) per dimension). The hosts
of the same index in every slice of one layout hold the same blocks under
the same keys, so the cross-slice reduction and a replacement's load are
host i with host i, and the keys alone fix the order of every sum.

JAX is imported on use, so the driver may import this module for free.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["block_key", "local_blocks", "from_local_blocks"]


def block_key(index: tuple, shape: tuple) -> tuple:
    """A block's [start, stop) per dimension (from a shard's index slices)."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


def local_blocks(leaves: Sequence[Any], tag: Any = None) -> dict:
    """{(tag, leaf index, block key): numpy block} for the distinct blocks
    this process holds: read-only views of the device buffers, no copy.
    (XLA does not donate a buffer a view still reads, so a view stays
    valid whatever runs next.)"""
    out: dict = {}
    for i, a in enumerate(leaves):
        for shard in a.addressable_shards:
            key = (tag, i, block_key(shard.index, a.shape))
            if key not in out:
                out[key] = np.asarray(shard.data)
    return out


def from_local_blocks(blocks: dict, specs: Sequence[Any], tag: Any = None) -> list:
    """The global arrays whose local blocks are `blocks` (as `local_blocks`
    keyed them), laid out by each spec's sharding (jax.ShapeDtypeStruct
    leaves)."""
    import jax

    arrays = []
    for i, spec in enumerate(specs):
        per_device = spec.sharding.addressable_devices_indices_map(spec.shape)
        bufs = []
        for device, index in per_device.items():
            key = (tag, i, block_key(index, spec.shape))
            try:
                block = blocks[key]
            except KeyError:
                raise ValueError(f"no block {key[1:]} of leaf {i} {spec.shape}: the state was saved with another "
                                 "layout or by another host index") from None
            bufs.append(jax.device_put(np.asarray(block, dtype=spec.dtype), device))
        arrays.append(jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, bufs))
    return arrays

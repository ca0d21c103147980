"""What every call of one step's cross-slice exchange is told: how many
chunks a gradient is cut into, how the shards group into blocks, the
step's shards, the fan-in of the tree over the blocks, and the dtype on
the wire. Made by the driver (dispatch/exchange.py), read by the workers
(worker/chunks.py); a message between processes, so frozen and named.

The order of every addition depends only on these, never on which slice
holds which shard or owns which chunk:

- a block is the shards the full membership gives one slice (shard s is
  in block s mod `blocks`, as `assign_shards` deals them round robin);
  its sum is the left fold of its shards in key order, made by the slice
  that holds the whole block, or by a chunk's owner from the single
  shards when the block is split (after a resize);
- the blocks' sums are added by a tree of fan-in `fan_in` over the blocks
  in order (groups of `fan_in` consecutive nodes, each a left fold, level
  by level down to one): with one shard per block this is the tree the
  direct hand-off builds over the shards, so both give the same bits.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ray_elastic.config import EXCHANGE_DTYPES
from ray_elastic.errors import ConfigError

__all__ = ["ExchangePlan"]


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """One step's exchange: `chunks` (one per owner: the slices taking
    part when the step was issued), `blocks`, `shards` (every shard of the
    step, in order), `fan_in`, `wire_dtype` (None: the gradient's own),
    `step_program` (ElasticConfig.one_slice_program)."""

    chunks: int
    blocks: int
    shards: tuple
    fan_in: int
    wire_dtype: Optional[str] = None
    step_program: str = "auto"  # how a slice computing every shard runs the step (ElasticConfig.one_slice_program)

    def __post_init__(self):
        if self.chunks < 1 or self.blocks < 1 or self.fan_in < 2:
            raise ValueError(f"an exchange needs chunks >= 1, blocks >= 1 and fan_in >= 2, got {self}")
        if self.wire_dtype not in EXCHANGE_DTYPES:
            raise ConfigError("exchange_dtype", f"must be one of {EXCHANGE_DTYPES}, got {self.wire_dtype!r}")

    def block_of(self, shard: int) -> int:
        return shard % self.blocks

    def members(self, block: int) -> tuple:
        """The shards of `block` in this step, in key order."""
        return tuple(s for s in self.shards if s % self.blocks == block)

    def block_order(self) -> list:
        """The step's non-empty blocks, in order."""
        return sorted({self.block_of(s) for s in self.shards})

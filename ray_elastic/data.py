"""Which part of a step's global batch each live slice computes.

The global batch of step k is shards 0..num_shards-1, each a pure function
of (seed, k, shard) supplied by the user's `make_batch`. There is one shard
per configured slice. The gradient of a step is the mean of the shard
gradients taken in shard order, so it does not depend on which slice
computed which shard: with "accumulate" a run on fewer slices takes the same
optimisation steps as a failure-free run.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["assign_shards", "host_rows"]


def assign_shards(live: Iterable[int], num_shards: int, mode: str) -> dict[int, tuple[int, ...]]:
    """Map each live slice to the shards it computes this step.

    accumulate: every shard is computed; shard s goes to the
        (s mod n)-th live slice, so survivors share a lost slice's work.
    shrink: each live slice computes only its own shard; the global batch
        shrinks with the number of live slices.
    """
    slices = sorted(live)
    if not slices:
        raise ValueError("no live slices to assign shards to")
    if mode == "shrink":
        return {s: (s,) for s in slices}
    if mode != "accumulate":
        raise ValueError(f"unknown batch mode {mode!r}")
    out: dict[int, list[int]] = {s: [] for s in slices}
    for shard in range(num_shards):
        out[slices[shard % len(slices)]].append(shard)
    return {s: tuple(v) for s, v in out.items()}


def host_rows(batch_rows: int, host: int, hosts: int) -> slice:
    """The rows of a shard that one host of a multi-host slice feeds."""
    if batch_rows % hosts:
        raise ValueError(
            f"a shard's batch of {batch_rows} rows does not split evenly over "
            f"{hosts} hosts; make the per-shard batch a multiple of the hosts per slice"
        )
    per = batch_rows // hosts
    return slice(host * per, (host + 1) * per)

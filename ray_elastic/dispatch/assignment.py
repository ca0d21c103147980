"""Which part of a step's global batch each live slice computes.

The global batch of step k is shards 0..num_shards-1, each a pure function
of (seed, k, shard) supplied by the user's `make_batch`. There are
`batch_shards` shards (by default one per configured slice). The gradient of a step is the mean of the shard
gradients taken in shard order, so it does not depend on which slice
computed which shard: with "accumulate" a run on fewer slices takes the same
optimisation steps as a failure-free run.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from ray_elastic.errors import ConfigError

__all__ = ["assign_shards", "host_rows", "leader_groups", "leader_ranges", "rows_fed", "spread_shards"]


def assign_shards(live: Iterable[int], num_shards: int, mode: str,
                  ranges: Optional[Sequence[tuple[int, int]]] = None) -> dict[int, tuple[int, ...]]:
    """Map each live slice to the shards it computes this step.

    accumulate: every shard is computed; shard s goes to the
        (s mod n)-th live slice, so survivors share a lost slice's work.
        With group leaders (`ranges`, from leader_ranges), the live slices
        are cut into one group per range (group_slices) and each range's
        shards go round robin over its own group: a group's gradients never
        leave its leader's part of the reduction tree.
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
    if ranges:
        for group, held in leader_groups(slices, ranges):
            shards = [shard for lo, hi in held for shard in range(lo, hi)]
            for i, shard in enumerate(shards):
                out[group[i % len(group)]].append(shard)
    else:
        for shard in range(num_shards):
            out[slices[shard % len(slices)]].append(shard)
    return {s: tuple(v) for s, v in out.items()}


def spread_shards(missing: Sequence[int], live: Iterable[int]) -> dict[int, tuple[int, ...]]:
    """The shards of a step that nobody finished (a lost slice's), spread
    over the live slices in order, round robin: slice -> the shards it
    computes again (only slices that get some)."""
    order = sorted(live)
    return {s: tuple(missing[i::len(order)]) for i, s in enumerate(order) if missing[i::len(order)]}


def _runs(items: list, groups: int) -> list[list]:
    """`items` cut into `groups` consecutive runs, as even as possible (the
    first ones one longer)."""
    base, extra = divmod(len(items), groups)
    out, i = [], 0
    for g in range(groups):
        n = base + (g < extra)
        out.append(items[i:i + n])
        i += n
    return out


def leader_groups(live: Iterable[int], ranges: Sequence[tuple[int, int]]) -> list[tuple[list[int], list]]:
    """(slices, shard ranges) of each group leader at work: one range per
    leader, the live slices cut into as many runs of consecutive ids, each
    as long as its range's share of the shards (a short last range gets
    fewer slices: every slice then computes about as many shards); with
    fewer live slices than ranges, one slice per leader and the ranges cut
    into as many runs."""
    slices = sorted(live)
    if len(slices) < len(ranges):
        return list(zip(_runs(slices, len(slices)) if slices else [], _runs(list(ranges), len(slices))))
    total = sum(hi - lo for lo, hi in ranges)
    out, start, done = [], 0, 0
    for i, (lo, hi) in enumerate(ranges):
        done += hi - lo
        # At least one slice each, and enough left for the ranges after.
        end = max(start + 1, min(round(len(slices) * done / total), len(slices) - (len(ranges) - 1 - i)))
        out.append((slices[start:end], [(lo, hi)]))
        start = end
    return out


def leader_ranges(num_shards: int, num_slices: int, slices_per_leader: int, fan_in: int) -> tuple[list, int]:
    """The shard ranges of the group leaders and how many levels of the
    reduction tree each leader builds over its range.

    About one leader per `slices_per_leader` slices; each range is a
    multiple of `fan_in` shards and starts at a multiple of its length, so
    a leader's levels are whole subtrees of the tree the driver alone would
    build (the same additions in the same order: bitwise the same sums).
    The depth is the most levels whose nodes the range holds whole. A
    single range is a ConfigError (the controller checks it before any
    resource is reserved)."""
    leaders = -(-num_slices // slices_per_leader)
    size = fan_in * -(-num_shards // (leaders * fan_in))
    depth, span = 0, 1
    while size % (span * fan_in) == 0:
        depth, span = depth + 1, span * fan_in
    ranges = [(lo, min(lo + size, num_shards)) for lo in range(0, num_shards, size)]
    if len(ranges) < 2:
        raise ConfigError("slices_per_leader", (
            f"{num_shards} shards make one leader's range (ranges are whole multiples of the reduction "
            f"tree's fan-in, {fan_in} shards): one leader only adds a hop. Set 0, or use "
            "leaders from 2 * fan-in shards up"))
    return ranges, depth


def host_rows(batch_rows: int, host: int, hosts: int) -> slice:
    """The rows of a shard that one host of a multi-host slice feeds."""
    if batch_rows % hosts:
        raise ValueError(
            f"a shard's batch of {batch_rows} rows does not split evenly over "
            f"{hosts} hosts; make the per-shard batch a multiple of the hosts per slice"
        )
    per = batch_rows // hosts
    return slice(host * per, (host + 1) * per)


def rows_fed(device_rows: list, batch_rows: int) -> slice:
    """The rows of a shard's batch that one host feeds: those its devices
    hold under the batch's sharding (`device_rows`: each addressable
    device's row slice, as `Sharding.addressable_devices_indices_map`
    gives them). All of them when the batch axes do not span the hosts (a
    tensor axis across hosts, say); its share when they do. Must be one
    contiguous range."""
    spans = sorted({(r.start or 0, batch_rows if r.stop is None else r.stop) for r in device_rows})
    start, stop = spans[0][0], max(b for _, b in spans)
    covered = sorted(set().union(*(range(a, b) for a, b in spans)))
    if covered != list(range(start, stop)):
        raise ValueError(f"this host's devices hold rows {spans} of a {batch_rows}-row batch: not one range")
    return slice(start, stop)

"""The reduction tree's pure parts: its nodes, when it needs another
level, its leaves (which payload holds each shard, and the gates that
ride along), and the tops that travel between a group leader and the
driver. The calls that build it are StepRunner.tree_level and
StepRunner.issue_tree (step_runner.py).

The tree's shape depends only on the shard count and its fan-in, never on
which slices are alive, so the additions happen in the same order in
every run (a resized run stays bitwise equal to a failure-free one)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional

__all__ = ["Part", "Top", "deeper", "gates", "holders", "parts_of", "refs_of", "tops_of"]


@dataclasses.dataclass(eq=False)
class Part:
    """A node of the reduction tree: the first shard key it covers, and the
    refs that hold it: a leaf's payload (and any gates riding along), or a
    reduce call's partial sum. Not frozen: a re-issued reduce call puts
    its new sum in `refs`, where whatever reads the node afterwards finds
    it (the next level issued after a gather, a leader's tops)."""

    key: int
    refs: list


@dataclasses.dataclass(frozen=True)
class Top:
    """The top of a subtree, as a group leader and the driver pass it to
    each other: its first shard key and the ref of its sum."""

    key: int
    ref: Any


def deeper(count: int, built: int, fan_in: int) -> bool:
    """Whether the tree needs another level over `count` nodes, `built`
    levels up: above `fan_in` of them, and once there is a tree at all,
    down to one, so that every apply call takes a single ref. The driver
    pays Ray for each ref a call carries (at 1024 slices, one more ref per
    apply call cost it 10-15% of its time per step); one more reduce call
    adds the same pieces in the same key order as the apply would."""
    return count > fan_in or (built > 0 and count > 1)


def refs_of(parts: Iterable[Part]) -> list:
    """The refs an apply call takes over these top nodes, each once."""
    return list(dict.fromkeys(r for p in parts for r in p.refs))


def tops_of(parts: Iterable[Part]) -> tuple:
    """Reduce calls' nodes (one ref each), as Tops to send."""
    return tuple(Top(p.key, r) for p in parts for r in p.refs)


def parts_of(tops: Iterable[Top]) -> list[Part]:
    """Tops received, as nodes to build on."""
    return [Part(t.key, [t.ref]) for t in tops]


def holders(assignment: Mapping, payloads: Mapping, host: Optional[int] = None) -> dict:
    """shard -> the payload holding it ({sending host: ref}), or with
    `host`, that host's ref alone. A slice with no payloads (none kept)
    holds nothing."""
    return {shard: payloads[s] if host is None else payloads[s][host]
            for s, shards in assignment.items() if s in payloads for shard in shards}


def gates(payloads: Mapping, assignment: Mapping, s: int, host: int, groups: int) -> list:
    """Slice s's payloads that no apply call of host index `host` would
    otherwise wait for (non-sending hosts', a slice without shards): they
    ride along with a leaf, empty for the sum, so that every apply waits
    for every gradient call of its step. `groups`: how many host indices
    send (1 when host 0 sends for its slice)."""
    return [r for h, r in sorted(payloads[s].items())
            if (h == host and not assignment.get(s)) or (groups == 1 and h > 0)]

"""The cross-slice gradient sum, in an order fixed by the shard keys.

A step's gradient is the mean of its batch shards' gradients. Whichever
slices computed or reduced them, the pieces are added in the order of
their keys (shards, or a reduction-tree node's first shard), so every run
with the same number of shards adds in the same order and a resized run
stays bitwise equal to a failure-free one. Pure numpy over pytrees: runs in
the workers (reduction-tree nodes and apply) and in unit tests.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

__all__ = ["reduce_pieces", "divided"]


def _pieces(part: dict) -> list[tuple[int, Any, int]]:
    """(key, sum, count) of a phase-1 payload (one piece per shard) or of a
    reduction-tree partial sum (one piece keyed by its first shard)."""
    if "grads" in part:
        return [(shard, g, 1) for shard, g in part["grads"].items()]
    return [(part["key"], part["sum"], part["count"])]


def reduce_pieces(tree_map: Callable, keys: Optional[tuple], parts: tuple) -> dict:
    """Sum the pieces of `parts` named by `keys` (None: all), in key order.

    The order of additions depends only on the keys, so every run with the
    same number of shards adds in the same order, whichever slices computed
    or reduced them: a resized run stays bitwise equal to a failure-free
    one. A payload may carry shards of other tree nodes; those are skipped.
    """
    wanted = None if keys is None else set(keys)
    pieces, losses = {}, {}
    for part in parts:
        if part is None:
            continue
        for key, value, count in _pieces(part):
            if wanted is None or key in wanted:
                pieces[key] = (value, count)
        losses.update({s: v for s, v in part["loss"].items() if wanted is None or _covered(s, part, wanted)})
    if wanted is not None and set(pieces) != wanted:
        raise RuntimeError(f"reduction node is missing pieces {sorted(wanted - set(pieces))}")
    order = sorted(pieces)
    acc = tree_map(lambda a: np.array(a, copy=True), pieces[order[0]][0])
    for key in order[1:]:
        acc = tree_map(_add_into, acc, pieces[key][0])
    return {"key": order[0], "sum": acc, "count": sum(pieces[k][1] for k in order), "loss": losses}


def _covered(shard: int, part: dict, wanted: set) -> bool:
    # A payload's losses are per shard; a partial's belong to its key.
    return shard in wanted if "grads" in part else part["key"] in wanted


def _add_into(acc: np.ndarray, value) -> np.ndarray:
    acc += value
    return acc


def divided(acc: np.ndarray, n: int) -> np.ndarray:
    acc /= n
    return acc

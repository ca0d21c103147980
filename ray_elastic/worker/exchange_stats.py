"""How many gradient bytes a host took in its applies: those computed by
other slices (what crossed slices to this host) and its own slice's. Read
through the worker's `exchange_stats` (`python -m bench sharded`)."""

from __future__ import annotations

import numpy as np

__all__ = ["ExchangeStats", "payload_bytes"]


class ExchangeStats:
    """Cross-slice exchange counters of one host, since its start."""

    def __init__(self, slice_id: int) -> None:
        self._slice_id = slice_id
        self._counts = {"applies": 0, "bytes_from_other_slices": 0, "own_bytes": 0}

    def count(self, parts: tuple) -> None:
        """Add one apply's inputs: the gradient bytes of payloads computed
        by other slices, and of this slice's own."""
        other = own = 0
        for part in parts:
            if not part or "grads" not in part:
                continue  # a gate, or a reduction-tree partial
            n = sum(payload_bytes(g) for g in part["grads"].values())
            if part.get("from_slice") == self._slice_id:
                own += n
            else:
                other += n
        self._counts["applies"] += 1
        self._counts["bytes_from_other_slices"] += other
        self._counts["own_bytes"] += own

    def as_dict(self) -> dict:
        """applies, bytes_from_other_slices, own_bytes (a copy)."""
        return dict(self._counts)


def payload_bytes(tree) -> int:
    """Bytes of the arrays in a payload's gradient (nested dicts, lists of arrays)."""
    if isinstance(tree, dict):
        return sum(payload_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(payload_bytes(v) for v in tree)
    return int(np.asarray(tree).nbytes)

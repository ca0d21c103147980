"""How many gradient bytes a host sent and took in, and how long it spent
on the exchange: what crossed slices to this host (from other slices'
hosts) and what came from its own slice. Read through the worker's
`exchange_stats` (`python -m bench exchange`, `python -m bench sharded`).

Counted in both exchanges: the reduce-scatter and all-gather (chunks.py)
and the direct hand-off with its reduction tree (reduction.py). Seconds
are this host's own (`exchange_s`): cutting and casting what it sends,
summing, and laying the sums back into leaves; not Ray's copies into the
object store, which happen after a call returns. Waiting for the inputs
and fetching them is counted apart (`inputs_s`). What other work ran
inside the exchange's windows is counted too (worker/overlap.py)."""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np

from ray_elastic.worker.chunks import chunk_bytes
from ray_elastic.worker.overlap import SpanOverlap

__all__ = ["LINK_ENV", "ExchangeStats", "part_bytes", "payload_bytes"]

# A simulated cross-slice link, in Gbit/s per host (unset or 0: none), read
# from the worker's environment: a host waits (bytes it took in from other
# slices) x 8 / rate after each exchange call, as if they had come over a
# link that slow (`python -m bench diloco` measures training under it).
LINK_ENV = "RAY_ELASTIC_SIMULATED_LINK_GBITS"


class ExchangeStats:
    """Cross-slice exchange counters of one host, since its start."""

    def __init__(self, slice_id: int) -> None:
        self._slice_id = slice_id
        self._counts = {"applies": 0, "bytes_from_other_slices": 0, "own_bytes": 0, "sent_bytes": 0,
                        "reduce_bytes_in": 0, "gather_bytes_in": 0, "exchange_s": 0.0, "inputs_s": 0.0,
                        "link_wait_s": 0.0}
        self.spans = SpanOverlap()  # the exchange's windows and the work beside them
        self._link_bps = float(os.environ.get(LINK_ENV) or 0) * 1e9

    def _taken(self, parts: tuple, field: str) -> int:
        other = own = 0
        for part in parts:
            n = part_bytes(part)
            if part and part.get("from_slice") == self._slice_id:
                own += n
            else:
                other += n
        self._counts["bytes_from_other_slices"] += other
        self._counts["own_bytes"] += own
        self._counts[field] += other
        if self._link_bps and other:
            self._counts["link_wait_s"] += other * 8 / self._link_bps
            time.sleep(other * 8 / self._link_bps)
        return other

    def sent(self, chunks: list, seconds: float) -> None:
        """A gradient call's chunks, cut (and cast) in `seconds`."""
        self._counts["sent_bytes"] += sum(chunk_bytes(c) for c in chunks)
        self._counts["exchange_s"] += seconds

    def reduced(self, parts: tuple, seconds: float) -> int:
        """A reduce call's inputs (a chunk's sources, or a tree node's),
        summed in `seconds`; returns the bytes that came from other slices."""
        self._counts["exchange_s"] += seconds
        return self._taken(parts, "reduce_bytes_in")

    def gathered(self, parts: tuple, seconds: float) -> None:
        """An apply's inputs (the chunks' sums, or payloads and partial
        sums), laid out or summed in `seconds`; returns the bytes that
        came from other slices."""
        self._counts["applies"] += 1
        self._counts["exchange_s"] += seconds
        return self._taken(parts, "gather_bytes_in")

    def took_in(self, seconds: float) -> None:
        """Seconds a reduce or apply call waited for its inputs and fetched
        them: kept apart (`inputs_s`), as most of it is waiting for the
        other slices' gradients to be computed."""
        self._counts["inputs_s"] += seconds

    def as_dict(self) -> dict:
        """The counters and the overlap's seconds (a copy)."""
        return {**self._counts, **self.spans.as_dict()}


def part_bytes(part: Optional[dict]) -> int:
    """Gradient bytes of an exchange input: a chunk or a chunk's sum, a
    phase-1 payload, a reduction-tree partial sum (0 for a gate)."""
    if not part:
        return 0
    if "chunk" in part:
        return chunk_bytes(part)
    if "grads" in part:
        return sum(payload_bytes(g) for g in part["grads"].values())
    return payload_bytes(part.get("sum"))


def payload_bytes(tree) -> int:
    """Bytes of the arrays in a payload's gradient (nested dicts, lists of arrays)."""
    if tree is None:
        return 0
    if isinstance(tree, dict):
        return sum(payload_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(payload_bytes(v) for v in tree)
    return int(np.asarray(tree).nbytes)

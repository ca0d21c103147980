"""The rows of each batch shard this host feeds, read ahead of the step.

A shard's batch is a pure function of (seed, step, shard), so the next
step's rows can be read while this step computes: after the gradients of
step k the host starts reading step k + 1's rows of the same shards in a
background thread, and the step takes them when it comes (or reads them
then, when the slice was given other shards). Reading thus stays off the
step's path whenever it is shorter than a step.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ray_elastic.errors import ConfigError

__all__ = ["BatchReader"]


class BatchReader:
    """This host's rows of the program's batches (`rows`: the slice of a
    shard's rows its devices hold). A make_batch that takes `rows` is asked
    for those only; any other gives the whole shard, cut here."""

    def __init__(self, program: Any, seed: int, num_shards: int, rows: slice, eval_rows: Optional[slice],
                 on_read: Optional[Callable[[float, float], None]] = None):
        self._program, self._seed, self._num_shards = program, seed, num_shards
        self._rows, self._eval_rows = rows, eval_rows
        self._on_read = on_read  # told each read's (start, end), on time.perf_counter
        self._ahead: dict[tuple[int, int], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def train(self, step: int, shard: int) -> dict:
        """This host's rows of shard `shard` of step `step`."""
        with self._lock:
            ahead = self._ahead.pop((step, shard), None)
            for key in [k for k in self._ahead if k[0] < step]:  # steps already past: never asked for
                self._ahead.pop(key).cancel()
        if ahead is not None:
            return ahead.result()
        return self._read_train(step, shard)

    def read_ahead(self, step: int, shards: tuple[int, ...]) -> None:
        """Start reading `shards` of `step` in the background."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ray_elastic-batches")
            for shard in shards:
                if (step, shard) not in self._ahead:
                    self._ahead[(step, shard)] = self._pool.submit(self._read_train, step, shard)

    def close(self) -> None:
        """Drop the reads ahead and end the read-ahead thread (a run ended)."""
        with self._lock:
            pool, self._pool = self._pool, None
            for f in self._ahead.values():
                f.cancel()
            self._ahead.clear()
        if pool is not None:
            pool.shutdown(wait=True)

    def held_out(self, shard: int) -> dict:
        """This host's rows of shard `shard` of the held-out set."""
        make = self._program.make_eval_batch
        if self._program.eval_batch_takes_rows:
            return _checked(make(self._seed, shard, self._num_shards, rows=self._eval_rows), self._eval_rows,
                            "program.make_eval_batch")
        return {k: np.asarray(v)[self._eval_rows] for k, v in make(self._seed, shard, self._num_shards).items()}

    def _read_train(self, step: int, shard: int) -> dict:
        t0 = time.perf_counter()
        try:
            return self._make_train(step, shard)
        finally:
            if self._on_read is not None:
                self._on_read(t0, time.perf_counter())

    def _make_train(self, step: int, shard: int) -> dict:
        make: Callable = self._program.make_batch
        if self._program.batch_takes_rows:
            return _checked(make(self._seed, step, shard, self._num_shards, rows=self._rows), self._rows,
                            "program.make_batch")
        return {k: np.asarray(v)[self._rows] for k, v in make(self._seed, step, shard, self._num_shards).items()}


def _checked(batch: dict, rows: slice, setting: str) -> dict:
    """A batch asked for `rows`, checked to hold that many rows."""
    want = rows.stop - rows.start
    out = {k: np.asarray(v) for k, v in batch.items()}
    for k, v in out.items():
        if v.shape[:1] != (want,):
            raise ConfigError(setting, f"asked for rows {rows.start}..{rows.stop - 1} of the shard ({want} rows), "
                              f"it gave {v.shape[0] if v.ndim else 'a scalar'} for {k!r}; a make_batch that "
                              "takes `rows` must return exactly those rows")
    return out

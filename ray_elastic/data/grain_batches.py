"""`make_batch` from a Grain `MapDataset`, by record index.

Row r of shard s of step k is record `(k * num_shards + s) * rows + r` of
the dataset (`rows`: rows per shard). That index depends on nothing but
(k, s, r): not on which slice computes the shard, how many slices are
live, or whether the run restarted. So a resumed or resized run reads
exactly the records an uninterrupted one reads, with no iterator state to
save. Grain's `MapDataset` is random access, and its `shuffle` and
`repeat` keep that: past one epoch, `repeat` goes on with the next epoch,
shuffled with its own seed.

A host reads only the rows its devices hold (`rows=` slice): the worker
passes them, so at h hosts per slice each host reads 1/h of the shard
under pure data parallelism.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional, Union

import numpy as np

from ray_elastic.errors import ConfigError

__all__ = ["GrainBatches", "GrainEvalBatches"]

# A zero-argument function that builds the dataset, or the dataset itself.
DatasetSource = Union[Any, Callable[[], Any]]


class _Records:
    """The dataset, built once per process on first read (so that what is
    shipped to the workers is the recipe, not open file handles), and the
    rows of a batch read from it."""

    def __init__(self, dataset: DatasetSource, setting: str):
        import grain

        if not isinstance(dataset, grain.MapDataset) and not callable(dataset):
            raise ConfigError(setting, f"give a grain.MapDataset or a zero-argument function returning one, "
                              f"got {type(dataset).__name__}")
        self._source = dataset
        self._setting = setting
        self._built: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"_source": self._source, "_setting": self._setting}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _built=None, _lock=threading.Lock())

    @property
    def dataset(self) -> Any:
        import grain

        with self._lock:
            if self._built is None:
                built = self._source if isinstance(self._source, grain.MapDataset) else self._source()
                if not isinstance(built, grain.MapDataset):
                    raise ConfigError(self._setting, f"the dataset function returned {type(built).__name__}, "
                                      "not a grain.MapDataset (an IterDataset cannot be read by index: build "
                                      "the pipeline with MapDataset.source(...).shuffle(...).map(...))")
                self._built = built
            return self._built

    def length(self) -> Optional[int]:
        """Records in the dataset; None when it repeats without end."""
        n = len(self.dataset)
        return None if n >= sys.maxsize else n

    def read(self, first: int, count: int, what: str) -> dict:
        """Records first .. first+count-1, stacked per key."""
        ds = self.dataset
        n = self.length()
        if n is not None and first + count > n:
            raise ConfigError(self._setting, f"{what} needs records up to {first + count - 1}, but the dataset "
                              f"has {n}; repeat it (dataset.repeat(epochs), or .repeat() for no end) or ask "
                              "for fewer steps")
        examples = [ds[i] for i in range(first, first + count)]
        hole = next((i for i, e in enumerate(examples) if e is None), None)
        if hole is not None:  # a filter() in a MapDataset leaves holes
            raise ConfigError(self._setting, f"{what}: record {first + hole} is None (a "
                              "MapDataset.filter leaves holes, and every row must be a record); filter the "
                              "data before writing it, or mask rows out through the loss's weights")
        if not examples:
            return {}
        if not isinstance(examples[0], dict):
            raise ConfigError(self._setting, f"records must be dicts of arrays (one per batch key), got "
                              f"{type(examples[0]).__name__}")
        keys = set(examples[0])
        odd = next((i for i, e in enumerate(examples) if not isinstance(e, dict) or set(e) != keys), None)
        if odd is not None:
            got = sorted(examples[odd]) if isinstance(examples[odd], dict) else type(examples[odd]).__name__
            raise ConfigError(self._setting, f"{what}: record {first + odd} has keys {got}, record {first} has "
                              f"{sorted(keys)}; every record needs the same keys (one per batch key)")
        return {k: np.stack([np.asarray(e[k]) for e in examples]) for k in examples[0]}


def _rows_range(rows: Optional[slice], per_shard: int) -> tuple[int, int]:
    if rows is None:
        return 0, per_shard
    start, stop, stride = rows.indices(per_shard)
    if stride != 1:
        raise ValueError(f"rows must be a contiguous slice, got {rows}")
    return start, stop


def _check_rows(rows_per_shard: Any, setting: str) -> int:
    if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, (int, np.integer)) or rows_per_shard < 1:
        raise ConfigError(setting, f"rows_per_shard must be a positive integer, got {rows_per_shard!r}")
    return int(rows_per_shard)


class GrainBatches:
    """A `make_batch(seed, step, shard, num_shards, rows=None)` that reads
    a Grain MapDataset: give it as `TrainProgram(make_batch=...)`.

    dataset: a `grain.MapDataset` whose records are dicts of arrays of one
        row each (source, shuffle, map: its own seeds decide the order), or
        a zero-argument function that builds one (preferred: it is built in
        each worker, so file handles are never pickled).
    rows_per_shard: rows of each shard; the global batch is
        `rows_per_shard * batch_shards`.

    The trainer's seed is not used: the pipeline's own seeds (`shuffle`,
    `seed`) decide the order, as in MaxText's `data_shuffle_seed`.
    """

    def __init__(self, dataset: DatasetSource, rows_per_shard: int):
        self.rows_per_shard = _check_rows(rows_per_shard, "program.make_batch")
        self._records = _Records(dataset, "program.make_batch")

    def __call__(self, seed: int, step: int, shard: int, num_shards: int, rows: Optional[slice] = None) -> dict:
        start, stop = _rows_range(rows, self.rows_per_shard)
        first = (int(step) * int(num_shards) + int(shard)) * self.rows_per_shard
        return self._records.read(first + start, stop - start, f"step {step}, shard {shard}")

    def check(self, steps: int, num_shards: int) -> None:
        """Raise ConfigError when the dataset runs out before `steps` steps
        of `num_shards` shards."""
        n = self._records.length()
        per_step = num_shards * self.rows_per_shard
        if n is not None and steps * per_step > n:
            raise ConfigError("program.make_batch", f"the dataset has {n} records and a step reads {per_step} "
                              f"({num_shards} shards x {self.rows_per_shard} rows): it runs out at step {n // per_step} "
                              f"of the {steps} asked; repeat it (dataset.repeat(epochs), or .repeat() for no end) "
                              "or ask for fewer steps")


class GrainEvalBatches:
    """A `make_eval_batch(seed, shard, num_shards, rows=None)` over a fixed
    held-out Grain MapDataset: shard s is records s*rows .. (s+1)*rows - 1,
    the same at every eval."""

    def __init__(self, dataset: DatasetSource, rows_per_shard: int):
        self.rows_per_shard = _check_rows(rows_per_shard, "program.make_eval_batch")
        self._records = _Records(dataset, "program.make_eval_batch")

    def __call__(self, seed: int, shard: int, num_shards: int, rows: Optional[slice] = None) -> dict:
        start, stop = _rows_range(rows, self.rows_per_shard)
        first = int(shard) * self.rows_per_shard
        return self._records.read(first + start, stop - start, f"the held-out shard {shard}")

    def check(self, steps: int, num_shards: int) -> None:
        n = self._records.length()
        if n is not None and num_shards * self.rows_per_shard > n:
            raise ConfigError("program.make_eval_batch", f"the held-out dataset has {n} records; its {num_shards} "
                              f"shards of {self.rows_per_shard} rows need {num_shards * self.rows_per_shard}")

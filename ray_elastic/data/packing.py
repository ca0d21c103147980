"""Packing variable-length documents into fixed rows, with random access.

Grain's packers (`FirstFitPackIterDataset`, `ConcatThenSplitIterDataset`)
are iterators: row n depends on every document before it, so a restarted
run must replay or checkpoint the iterator. ray_elastic reads rows by index
(grain_batches.py), so this packer works by window: documents
`w * docs_per_window .. (w + 1) * docs_per_window - 1` are packed, in
order and first fit, into `rows_per_window` rows, and row j of the dataset
is row `j % rows_per_window` of window `j // rows_per_window`. Any row is
computed from its own window alone: the same rows after a restart or a
resize. A document that fits in no row of its window is dropped (those
dropped are counted by `dropped_tokens`); size the window so that few are.
Documents longer than a row are cut to the row.
"""

from __future__ import annotations

import sys
from typing import Any

import grain
import numpy as np

__all__ = ["PackedDocuments"]


class PackedDocuments(grain.MapDataset):
    """Rows of `length` tokens packed from the documents of `documents` (a
    grain.MapDataset whose records are dicts with a 1-D token array under
    `key`). Each row is, as in MaxText's packed inputs:
    {key: tokens (0 where empty), "segment_ids": 1, 2, ... per document
    (0 where empty), "positions": each token's position in its document}.
    Epochs: window w reads documents by index, so a `documents.repeat(...)`
    (reshuffled each epoch by Grain) packs on into the next epoch."""

    def __init__(self, documents: grain.MapDataset, length: int, *, key: str = "tokens",
                 docs_per_window: int = 64, rows_per_window: int = 16):
        super().__init__(documents)
        for name, value in (("length", length), ("docs_per_window", docs_per_window),
                            ("rows_per_window", rows_per_window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._docs = documents
        self._length, self._key = length, key
        self._docs_per_window, self._rows_per_window = docs_per_window, rows_per_window
        self._cached: tuple[int, list] = (-1, [])  # the last window packed: hosts read consecutive rows

    def __len__(self) -> int:
        n = len(self._docs)
        if n >= sys.maxsize:
            return sys.maxsize
        return (n // self._docs_per_window) * self._rows_per_window

    def __str__(self) -> str:
        return f"PackedDocuments(length={self._length}, {self._docs_per_window} docs -> {self._rows_per_window} rows)"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        window, row = divmod(int(index), self._rows_per_window)
        # A copy: a later map may change its arrays in place, and the window stays cached.
        return {k: v.copy() for k, v in self.window(window)[0][row].items()}

    def window(self, window: int) -> tuple[list, int]:
        """(the window's rows, the tokens of the documents dropped from it)."""
        cached = self._cached  # read once: a prefetch thread may replace it meanwhile
        if cached[0] != window:
            cached = self._cached = (window, self._pack(window))
        return cached[1]

    def dropped_tokens(self, window: int) -> int:
        return self.window(window)[1]

    def _pack(self, window: int) -> tuple[list, int]:
        first = window * self._docs_per_window
        rows = [[] for _ in range(self._rows_per_window)]  # per row: its documents' tokens
        free = [self._length] * self._rows_per_window
        dropped = 0
        for i in range(first, first + self._docs_per_window):
            doc = self._docs[i]
            if doc is None:
                continue
            tokens = np.asarray(doc[self._key]).reshape(-1)[: self._length]
            fits = next((r for r in range(self._rows_per_window) if free[r] >= tokens.size), None)
            if fits is None or tokens.size == 0:
                dropped += tokens.size
                continue
            rows[fits].append(tokens)
            free[fits] -= tokens.size
        return [self._row(docs) for docs in rows], dropped

    def _row(self, docs: list) -> dict[str, Any]:
        tokens = np.zeros(self._length, np.int32)
        segments = np.zeros(self._length, np.int32)
        positions = np.zeros(self._length, np.int32)
        at = 0
        for n, doc in enumerate(docs, start=1):
            tokens[at: at + doc.size] = doc
            segments[at: at + doc.size] = n
            positions[at: at + doc.size] = np.arange(doc.size)
            at += doc.size
        return {self._key: tokens, "segment_ids": segments, "positions": positions}

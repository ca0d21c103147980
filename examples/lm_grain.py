"""The example LM fed by a Grain pipeline over files: `ray-elastic demo
--example lm-grain` trains it.

What a MaxText or Flax user's input pipeline does, this one does:

* **Files.** A corpus of documents (English-like paragraphs of varying
  length) in an ArrayRecord file, written on first use under `data_dir`
  (the same bytes on every host and every run: they come from a seed).
* **A Grain pipeline.** `MapDataset.source(ArrayRecordDataSource)`, a
  global `shuffle` with its own seed, a tokenizing `map`, and `repeat()`:
  epochs go on without end, each shuffled anew by Grain.
* **Packing.** Documents are packed into rows of `seq_len + 1` tokens
  with segment ids and positions (`ray_elastic.data.PackedDocuments`), and
  the model attends only within a document; the loss counts only the
  targets inside a document (`LossOutput(total, weight)` over real tokens).
* **Exact resume.** `GrainBatches` reads row r of shard s of step k as
  record `(k * shards + s) * rows + r`: a resumed, resized or restarted run
  reads exactly what an uninterrupted one reads, and each host reads only
  the rows its devices hold.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ray_elastic.data import GrainBatches, PackedDocuments
from ray_elastic.layout import Layout
from ray_elastic.program import LossOutput, StepContext, TrainProgram

try:  # the installed package (ray_elastic.examples), or this folder run as `examples`
    from ray_elastic.examples import lm
except ImportError:  # pragma: no cover
    from examples import lm

__all__ = ["GrainLMConfig", "LoggedBatches", "corpus_path", "documents", "make_program", "packed_rows", "plain_batches",
           "write_corpus"]


@dataclasses.dataclass(frozen=True)
class GrainLMConfig:
    """The LM's sizes (lm.LMConfig) and its data's settings."""

    lm: lm.LMConfig = lm.LMConfig()
    data_dir: str = os.path.join(tempfile.gettempdir(), "ray_elastic-lm-grain")
    num_documents: int = 4096
    corpus_seed: int = 0
    shuffle_seed: int = 0  # the pipeline's own, as MaxText's data_shuffle_seed
    # Packing: each run of 5 documents goes into 4 rows (about 3% of
    # tokens dropped, rows 72% full on this corpus). A window of 4 rows
    # divides the rows a host reads, so no two hosts read the same documents.
    docs_per_window: int = 5
    rows_per_window: int = 4
    read_log: str = ""  # a folder: each process logs what it reads there (the data bench's figures)

    def __post_init__(self):
        for name in ("num_documents", "docs_per_window", "rows_per_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def corpus_path(config: GrainLMConfig) -> str:
    return os.path.join(config.data_dir, f"corpus-{config.corpus_seed}-{config.num_documents}.array_record")


def _document(rng: random.Random) -> str:
    """A few sentences: 12 to 90 characters (a row holds 65)."""
    text = lm.generate_corpus(rng.randrange(2**31), rng.choice((12, 20, 30, 45, 60, 90)))
    return text.replace("\n", " ").strip() or "A cat sat."


def write_corpus(config: GrainLMConfig) -> str:
    """The corpus file, written once (atomically: concurrent writers on one
    machine each write a temporary file and the last rename wins, with the
    same bytes). Returns its path."""
    from array_record.python.array_record_module import ArrayRecordWriter

    path = corpus_path(config)
    if os.path.exists(path):
        return path
    os.makedirs(config.data_dir, exist_ok=True)
    rng = random.Random(config.corpus_seed)
    tmp = f"{path}.{os.getpid()}.tmp"
    writer = ArrayRecordWriter(tmp, "group_size:1")
    for _ in range(config.num_documents):
        writer.write(_document(rng).encode("utf-8"))
    writer.close()
    os.replace(tmp, path)
    return path


_FILE_BYTES = [0]  # bytes of records this process read from the corpus file


def _tokenize(record: bytes) -> dict:
    _FILE_BYTES[0] += len(record)
    return {"tokens": lm.encode(record.decode("utf-8"))}


class LoggedBatches:
    """A make_batch that logs, per call, this process's rows and the file
    bytes it has read so far: one JSON line per call in `folder`/<pid>."""

    def __init__(self, inner: GrainBatches, folder: str):
        self._inner, self._folder = inner, folder
        self.rows_per_shard = inner.rows_per_shard

    def check(self, steps: int, num_shards: int) -> None:
        self._inner.check(steps, num_shards)

    def __call__(self, seed: int, step: int, shard: int, num_shards: int, rows=None) -> dict:
        import json

        batch = self._inner(seed, step, shard, num_shards, rows=rows)
        line = {"pid": os.getpid(), "step": int(step), "shard": int(shard),
                "rows": None if rows is None else [rows.start, rows.stop],
                "row_bytes": int(sum(v.nbytes for v in batch.values())), "file_bytes": _FILE_BYTES[0]}
        os.makedirs(self._folder, exist_ok=True)
        with open(os.path.join(self._folder, str(os.getpid())), "a") as f:
            f.write(json.dumps(line) + "\n")
        return batch


def documents(config: GrainLMConfig) -> Any:
    """The pipeline up to the documents: file -> shuffle -> tokenize -> repeat."""
    import grain

    source = grain.sources.ArrayRecordDataSource([write_corpus(config)])
    return grain.MapDataset.source(source).shuffle(seed=config.shuffle_seed).map(_tokenize).repeat()


def packed_rows(config: GrainLMConfig) -> Any:
    """The training rows: the documents packed into rows of seq_len + 1."""
    return PackedDocuments(documents(config), config.lm.seq_len + 1, docs_per_window=config.docs_per_window,
                           rows_per_window=config.rows_per_window)


def _loss_fn(config: GrainLMConfig, params: Any, batch: Any, ctx: StepContext) -> LossOutput:
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    segments = jnp.asarray(batch["segment_ids"], jnp.int32)
    positions = jnp.asarray(batch["positions"], jnp.int32)
    logits = lm.LMModel(vocab_size=config.lm.vocab_size, seq_len=config.lm.seq_len, d_model=config.lm.d_model,
                        num_layers=config.lm.num_layers, num_heads=config.lm.num_heads,
                        mlp_dim=config.lm.mlp_dim).apply(
        {"params": params}, tokens[:, :-1], segment_ids=segments[:, :-1], positions=positions[:, :-1])
    # A target counts when it continues the document of its input token.
    weights = ((segments[:, 1:] > 0) & (segments[:, 1:] == segments[:, :-1])).astype(jnp.float32)
    logits = logits.astype(jnp.float32)
    xent = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    real = jnp.sum(weights)
    return LossOutput(total=jnp.sum(xent * weights), weight=real, aux={"tokens": real})


def make_program(config: GrainLMConfig = GrainLMConfig(), layout: Layout = Layout()) -> TrainProgram:
    """The packed, file-fed LM as a TrainProgram. The corpus is written
    here if missing, so the first call (the driver's check) makes it."""
    write_corpus(config)
    batches = GrainBatches(functools.partial(packed_rows, config), config.lm.shard_batch_size)
    return TrainProgram(
        init_params=functools.partial(lm.init_params, config.lm),
        loss_fn=functools.partial(_loss_fn, config),
        optimizer=lm.make_optimizer(config.lm),
        make_batch=LoggedBatches(batches, config.read_log) if config.read_log else batches,
        layout=layout,
        aux={"tokens": "sum"},
    )


def plain_batches(config: GrainLMConfig, step: int, num_shards: int) -> list:
    """The shards of step `step` read straight from the pipeline, in order:
    what a plain single-process loop over the same data would take."""
    rows = packed_rows(config)
    per = config.lm.shard_batch_size
    out = []
    for shard in range(num_shards):
        first = (step * num_shards + shard) * per
        recs = [rows[i] for i in range(first, first + per)]
        out.append({k: np.stack([r[k] for r in recs]) for k in recs[0]})
    return out

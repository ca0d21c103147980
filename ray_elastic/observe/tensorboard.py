"""A run's step metrics as TensorBoard scalars.

    trainer = ElasticTrainer(..., callbacks=[TensorBoardCallback("runs/lm")])
    # then: tensorboard --logdir runs/lm

MaxText users watch their training in TensorBoard; this writes the same
curves from an elastic run. Every numeric metric of a step (loss, slices,
step_s and the program's own metrics by name) becomes the scalar
`{prefix}/{name}` at that step; metrics already named "eval/..." keep their
name. Non-finite values are written as they are (TensorBoard shows NaN);
anything not a number is skipped.

The writer (tensorboardX, imported here only) is made at the first step, so
building the callback in a driver costs nothing; it is flushed at most once
a second, and closed at `on_end`.
"""

from __future__ import annotations

import numbers
import time
from typing import Any

from ray_elastic.callbacks import Callback
from ray_elastic.errors import ConfigError

__all__ = ["TensorBoardCallback"]

# Seconds between flushes of the event file: often enough to watch a run
# live, rarely enough that a fast step never waits on the disk.
FLUSH_EVERY_S = 1.0


class TensorBoardCallback(Callback):
    """logdir: the folder TensorBoard reads (`tensorboard --logdir`).
    prefix: the tag prefix of the step metrics ("train" gives "train/loss")."""

    def __init__(self, logdir: str, *, prefix: str = "train"):
        if not isinstance(logdir, str) or not logdir.strip():
            raise ConfigError("tensorboard.logdir",
                              f"must be a non-empty path to a folder for the event files, got {logdir!r}")
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise ConfigError("tensorboard.prefix",
                              f"must be a non-empty tag prefix such as 'train', got {prefix!r}")
        self.logdir = logdir
        self.prefix = prefix.strip("/")
        self._writer: Any = None
        self._last_flush = 0.0

    def on_step(self, step: int, metrics: dict) -> None:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=self.logdir)
            self._last_flush = time.monotonic()
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue  # numpy's bool_ is no numbers.Real either
            tag = name if name.startswith("eval/") else f"{self.prefix}/{name}"
            self._writer.add_scalar(tag, float(value), global_step=step)
        now = time.monotonic()
        if now - self._last_flush >= FLUSH_EVERY_S:
            self._writer.flush()
            self._last_flush = now

    def on_end(self, report: Any) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
